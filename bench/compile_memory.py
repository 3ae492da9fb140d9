"""What writing a bundle's weights costs in memory, for the ~100M DeepSeek-V3 of decode_bench.py in
DeepSeek's fp8 release format (kept fp8, or dequantized to float32 at compile time) and as a plain
float32 checkpoint: the growth of the compiler's anonymous memory (RssAnon) and of its mapped
checkpoint pages (RssFile: page cache, reclaimable) while the weights are read and written, next
to the largest tensor and the whole model in float32.

    .venv/bin/python bench/compile_memory.py      # ~1 minute

Each case runs in a process of its own: plan (tracing on fake weights), then the weight writer,
with /proc/self/status sampled every 5 ms; the last case compiles --no-weights first (not
measured), then measures the weights step (`deepinfer-compile weights`) writing both ranks.

Measured here (two runs, before the plan got its module): anonymous growth 93 / 93 MiB kept fp8,
186 / 126 MiB dequantized to float32, 173 / 148 MiB from the plain float32 checkpoint — against a
largest tensor of 94 MiB (the embedding) and 375 MiB for the whole model in float32; mapped
checkpoint pages 234 / 235 / 374 MiB. Then (Sapphire Rapids, 2 cores): 23 / 138 / 122 MiB, and
the weights step writing both ranks of a world-size-2 bundle from the fp8 release: 11 MiB
(mapped 236 MiB), under one largest tensor.
"""

import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import yaml

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))
from decode_bench import CONFIGS  # noqa: E402
from tests.models.fp8_release import write_fp8_release  # noqa: E402

FIELDS = ("RssAnon", "RssFile")


def memory() -> dict[str, int]:
    """MiB of anonymous and file-backed resident memory of this process."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in FIELDS:
            out[key] = int(value.split()[0]) // 1024
    return out


def measure_writing(recipe_path: Path, out: Path, step: bool) -> dict[str, int]:
    """Peak growth (MiB) of each field while the weights of `recipe_path` are written to `out`: by
    the one-step compile's writer, or (`step`) by the weights step into a bundle compiled --no-weights."""
    from deepinfer.compiler.add_weights import add_weights
    from deepinfer.compiler.build import compile_recipe, weight_writer
    from deepinfer.compiler.plan import plan
    from deepinfer.compiler.recipe import load_recipe

    recipe = load_recipe(recipe_path, output=out / "bundle")
    if step:
        bundle = compile_recipe(recipe, cache_dir=out / "cache", progress=False, weights=False).bundle

        def write(_):
            add_weights(bundle, Path(recipe.model["checkpoint"]), progress=False)
    else:
        write = weight_writer(recipe, plan(recipe))
    before, peak, done = memory(), memory(), threading.Event()

    def sample():
        while not done.is_set():
            for key, value in memory().items():
                peak[key] = max(peak[key], value)
            time.sleep(0.005)

    sampler = threading.Thread(target=sample)
    sampler.start()
    write(out)
    done.set()
    sampler.join()
    return {key: peak[key] - before[key] for key in FIELDS}


def main():
    if len(sys.argv) == 4:  # one case, in a process of its own
        print(json.dumps(measure_writing(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3] == "step")))
        return
    import transformers

    config = dict(CONFIGS["100m"], num_key_value_heads=CONFIGS["100m"]["num_attention_heads"])
    torch.manual_seed(0)
    hf = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**config)).eval()
    largest = max(p.numel() for p in hf.parameters()) * 4 / 2**20
    whole = sum(p.numel() for p in hf.parameters()) * 4 / 2**20
    with tempfile.TemporaryDirectory(prefix="deepinfer-compile-memory-") as tmp:
        work = Path(tmp)
        write_fp8_release(hf, work / "release", work / "plain")
        cases = {"fp8 kept": ("release", "keep", "compile"), "fp8 dequantized to f32": ("release", "dequantize", "compile"),
                 "plain f32 checkpoint": ("plain", "keep", "compile"),
                 "fp8 kept, the weights step (world size 2)": ("release", "keep", "step")}
        print(f"largest tensor {largest:.0f} MiB, whole model in float32 {whole:.0f} MiB\n")
        print("| checkpoint | anonymous growth MiB | mapped checkpoint MiB |\n|---|---|---|")
        for name, (checkpoint, mode, how) in cases.items():
            world = 2 if how == "step" else 1
            recipe = {"name": "memory", "model": {"checkpoint": str(work / checkpoint), "quantized_weights": mode},
                      "parallel": {"world_size": world, "tp": world, "ep": world},
                      "dtype": "float32", "methods": {"decode": {"buckets": [1]}, "prefill": {"buckets": [32]}},
                      "kv": {"max_seqs": 1, "max_len": 128}, "backend": {"name": "export"}}
            path = work / "recipe.yaml"
            path.write_text(yaml.safe_dump(recipe))
            out = work / f"weights-{mode}-{checkpoint}-{how}"
            out.mkdir()
            run = subprocess.run([sys.executable, __file__, str(path), str(out), how], capture_output=True, text=True, check=True)
            growth = json.loads(run.stdout.strip().splitlines()[-1])
            print(f"| {name} | {growth['RssAnon']} | {growth['RssFile']} |", flush=True)


if __name__ == "__main__":
    main()
