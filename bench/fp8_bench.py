"""DeepSeek-V3 fp8 weights on CPU, side by side on the same weights (the ~100M config of
decode_bench.py, written in DeepSeek's fp8 release format): bundle weight bytes per parameter and
decode ms/token for the weights kept fp8 (dequantized inside each region, float32 compute),
dequantized at compile time to bfloat16, and to float32. (Compile memory: compile_memory.py.)

    .venv/bin/python bench/fp8_bench.py      # ~10 minutes cold on 2 cores (3 inductor bundles)

Batch 1, context 32 + the steps timed; the bundles take turns in rounds (decode_bench.py's
interleaved_median_ms), so a noisy stretch of this shared machine falls on all of them alike.

Measured on an AMD EPYC (Zen 4, 2 cores, AVX-512 without fp8 instructions; the test writer stores
the unquantized embedding and head in float32, half of this small model's 98M parameters, hence
2.5 bytes a parameter in the checkpoint), kept fp8 decoded by compiler/backends/fp8_decode.py:

| weights | bundle bytes / parameter | decode ms/token | vs fp8 kept |
|---|---|---|---|
| fp8 kept | 2.52 | 6.42 | 1.00x |
| dequantized bf16 | 2.00 | 4.17 | 0.65x |
| dequantized f32 | 4.00 | 5.73 | 0.89x |

Keeping fp8 is slower here though it reads a quarter of the bytes: x86 before AVX10.2 has no
e4m3 conversion instruction, so every step decodes the codes with integer ops (inductor's own
convert took 7.29 ms/token; held to AVX2 37.94, fp8_decode.py 19.43: README). A decode that wins
needs hardware fp8 (AVX10.2, AMX-FP8, Trainium, recent GPUs).
"""

import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

from deepinfer.compiler.build import compile_recipe
from deepinfer.compiler.recipe import load_recipe
from deepinfer.runtime.executor import BundleExecutor

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))
from decode_bench import CONFIGS, PROMPT_LEN, STEPS, decode_step, interleaved_median_ms  # noqa: E402
from tests.models.fp8_release import write_fp8_release  # noqa: E402
from v4_decode_bench import prefill  # noqa: E402

VARIANTS = {"fp8 kept": ("keep", "float32"), "dequantized bf16": ("dequantize", "bfloat16"),
            "dequantized f32": ("dequantize", "float32")}


def release_checkpoint(work: Path) -> tuple[Path, int]:
    import transformers

    config = dict(CONFIGS["100m"], num_key_value_heads=CONFIGS["100m"]["num_attention_heads"])
    torch.manual_seed(0)
    hf = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**config)).eval()
    write_fp8_release(hf, work / "release", work / "dequantized")
    return work / "release", sum(p.numel() for p in hf.parameters())


def compile_variant(work: Path, checkpoint: Path, name: str, mode: str, dtype: str) -> Path:
    slug = name.replace(" ", "-")
    recipe = {"name": slug, "model": {"checkpoint": str(checkpoint), "quantized_weights": mode}, "dtype": dtype,
              "methods": {"decode": {"buckets": [1]}, "prefill": {"buckets": [32]}}, "kv": {"max_seqs": 1, "max_len": 128},
              "backend": {"name": "inductor"}, "output": str(work / slug)}
    path = work / f"{slug}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    start = time.perf_counter()
    bundle = compile_recipe(load_recipe(path), cache_dir=work / "cache", progress=False).bundle
    print(f"compiled {name} in {time.perf_counter() - start:.0f} s", flush=True)
    return bundle


def main():
    prompt = list(range(100, 100 + PROMPT_LEN))
    with tempfile.TemporaryDirectory(prefix="deepinfer-fp8-bench-") as tmp:
        work = Path(tmp)
        checkpoint, params = release_checkpoint(work)
        bundles = {name: compile_variant(work, checkpoint, name, *variant) for name, variant in VARIANTS.items()}
        sizes = {name: sum(f.stat().st_size for f in (b / "weights").iterdir()) for name, b in bundles.items()}
        checkpoint_bytes = sum(f.stat().st_size for f in checkpoint.glob("*.safetensors"))
        executors = {name: BundleExecutor(b) for name, b in bundles.items()}
        for executor in executors.values():
            prefill(executor.run, prompt)
        make = decode_step(0)
        with torch.inference_mode():
            ms = interleaved_median_ms({name: (lambda pos, e=e: e.run(make(pos))) for name, e in executors.items()})
    print(f"\nDeepSeek-V3 {params / 1e6:.0f}M parameters (release fp8 checkpoint: {checkpoint_bytes / params:.2f} bytes a "
          f"parameter), batch 1, context {PROMPT_LEN}..{PROMPT_LEN + STEPS}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; ms per token (median of {STEPS})")
    print("| weights | bundle bytes / parameter | decode ms/token | vs fp8 kept |\n|---|---|---|---|")
    for name in VARIANTS:
        print(f"| {name} | {sizes[name] / params:.2f} | {ms[name]:.2f} | {ms[name] / ms['fp8 kept']:.2f}x |")


if __name__ == "__main__":
    main()
