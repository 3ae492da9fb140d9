"""The pjrt backend (StableHLO compiled by jaxlib's PJRT CPU client) against inductor and export
bundles of the same checkpoint, side by side in one process.

    .venv/bin/python bench/pjrt_bench.py                 # the ~100M config (a few minutes cold)
    .venv/bin/python bench/pjrt_bench.py --config tiny

Prints, per backend: bundle load seconds; batch-1 decode ms per token and a 64-token prompt's
prefill ms (medians, the backends taking turns in rounds); for pjrt also the seconds to compile
every region's StableHLO at load (DEEPINFER_PJRT_RECOMPILE=1's cost) against deserializing the
shipped executables. All bundles use model.expert_overflow: always (pjrt takes no control flow), so they compute alike.
"""

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
import yaml

from deepinfer.compiler.build import compile_recipe
from deepinfer.compiler.recipe import load_recipe
from deepinfer.models import TINY_CONFIG
from deepinfer.runtime.executor import BundleExecutor
from deepinfer.runtime.step import Step

from context_bench import CONFIGS as MOE_CONFIGS
from decode_bench import save_hf_checkpoint

CONFIGS = {"tiny": TINY_CONFIG, **MOE_CONFIGS}
BACKENDS = ("export", "inductor", "pjrt")
MAX_SEQS, MAX_LEN, PROMPT = 2, 256, 64
ROUNDS, STEPS = 8, 5


def recipe(work: Path, checkpoint: Path, backend: str) -> Path:
    body = {"name": f"bench-{backend}", "model": {"checkpoint": str(checkpoint), "expert_overflow": "always"},
            "methods": {"decode": {"buckets": [1]}, "prefill": {"buckets": [PROMPT]}},
            "kv": {"max_seqs": MAX_SEQS, "max_len": MAX_LEN}, "backend": {"name": backend},
            "output": str(work / "bundles" / backend)}
    path = work / f"{backend}.yaml"
    path.write_text(yaml.safe_dump(body))
    return path


def decode(position: int) -> Step:
    return Step("decode", torch.tensor([7]), torch.tensor([position]), torch.tensor([0]))


def prefill() -> Step:
    return Step("prefill", torch.arange(3, 3 + PROMPT), torch.arange(PROMPT), torch.zeros(PROMPT, dtype=torch.long),
                read_slot=torch.tensor([0]), last_index=torch.tensor([PROMPT - 1]))


def interleaved(fns: dict) -> dict[str, float]:
    """Median ms of each fn, the fns taking turns (ROUNDS rounds of STEPS calls) after a warm-up."""
    for fn in fns.values():
        fn()
    times = {name: [] for name in fns}
    for _ in range(ROUNDS):
        for name, fn in fns.items():
            for _ in range(STEPS):
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="100m", choices=list(CONFIGS))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="deepinfer-pjrt-bench-") as tmp:
        work = Path(tmp)
        save_hf_checkpoint(CONFIGS[args.config], work / "hf")
        bundles, compile_s, load_s = {}, {}, {}
        for backend in BACKENDS:
            start = time.perf_counter()
            bundles[backend] = compile_recipe(load_recipe(recipe(work, work / "hf", backend)), cache_dir=work / "cache",
                                              progress=False).bundle
            compile_s[backend] = time.perf_counter() - start
        executors = {}
        for backend in BACKENDS:
            start = time.perf_counter()
            executors[backend] = BundleExecutor(bundles[backend])
            load_s[backend] = time.perf_counter() - start
        recompile_s = recompile_seconds(executors["pjrt"])
        positions = {backend: PROMPT for backend in BACKENDS}

        def decode_fn(backend):
            def step():
                executors[backend].run(decode(positions[backend]))
                positions[backend] = PROMPT + (positions[backend] - PROMPT + 1) % (MAX_LEN - PROMPT - 1)
            return step

        with torch.inference_mode():
            decode_ms = interleaved({backend: decode_fn(backend) for backend in BACKENDS})
            prefill_ms = interleaved({backend: (lambda b=backend: executors[b].run(prefill())) for backend in BACKENDS})
    print(f"\n{args.config}: float32, torch {torch.__version__}, {torch.get_num_threads()} threads; medians of {ROUNDS * STEPS}")
    print(f"{'backend':>9} {'compile s':>10} {'load s':>8} {'decode ms':>10} {'prefill ms':>11}")
    for backend in BACKENDS:
        print(f"{backend:>9} {compile_s[backend]:10.1f} {load_s[backend]:8.2f} {decode_ms[backend]:10.2f} {prefill_ms[backend]:11.2f}")
    print(f"pjrt load: deserializing the executables {load_s['pjrt']:.2f} s (whole load) vs compiling their StableHLO "
          f"{recompile_s:.2f} s (regions alone)")
    print(f"decode pjrt / inductor = {decode_ms['pjrt'] / decode_ms['inductor']:.2f}x, pjrt / export = "
          f"{decode_ms['pjrt'] / decode_ms['export']:.2f}x; prefill pjrt / inductor = "
          f"{prefill_ms['pjrt'] / prefill_ms['inductor']:.2f}x")


def recompile_seconds(executor) -> float:
    """Seconds to compile every pjrt region's StableHLO (what DEEPINFER_PJRT_RECOMPILE=1 adds)."""
    from safetensors import safe_open

    from deepinfer.runtime.backends.pjrt import compile_stablehlo, pjrt_client

    client = pjrt_client("cpu")
    total = 0.0
    for region in executor.manifest.regions.values():
        with safe_open(str(executor.bundle / region.file), "np") as f:
            text = f.get_tensor("stablehlo").tobytes().decode()
        start = time.perf_counter()
        compile_stablehlo(client, text)
        total += time.perf_counter() - start
    return total


if __name__ == "__main__":
    main()
