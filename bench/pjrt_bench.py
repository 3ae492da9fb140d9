"""The pjrt backend (StableHLO compiled by jaxlib's PJRT CPU client) against inductor and export
bundles of the same checkpoint, side by side in one process.

    .venv/bin/python bench/pjrt_bench.py                 # the ~100M config (a few minutes cold)
    .venv/bin/python bench/pjrt_bench.py --config tiny
    .venv/bin/python bench/pjrt_bench.py --max-seqs 8 --max-len 4096   # a serving-sized state pool

Prints, per backend: bundle load seconds; batch-1 decode ms per token and a 64-token prompt's
prefill ms (medians, the backends taking turns in rounds); for pjrt also the seconds to compile
every region's StableHLO at load (DEEPINFER_PJRT_RECOMPILE=1's cost) against deserializing the
shipped executables, and `pjrt-copy`: the same bundle with its state updated by copy (a torch view
held on each state buffer, so XLA cannot donate it and writes a new pool each call, as before
the runtime kept state in PJRT buffers): what updating state in place saves. All bundles use model.expert_overflow: always (pjrt takes no control flow), so they compute alike.
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
PROMPT = 64
ROUNDS, STEPS = 8, 5


def recipe(work: Path, checkpoint: Path, backend: str, kv: dict) -> Path:
    body = {"name": f"bench-{backend}", "model": {"checkpoint": str(checkpoint), "expert_overflow": "always"},
            "methods": {"decode": {"buckets": [1]}, "prefill": {"buckets": [PROMPT]}},
            "kv": kv, "backend": {"name": backend},
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
    parser.add_argument("--max-seqs", type=int, default=2)
    parser.add_argument("--max-len", type=int, default=256)
    args = parser.parse_args()
    kv = {"max_seqs": args.max_seqs, "max_len": args.max_len}
    with tempfile.TemporaryDirectory(prefix="deepinfer-pjrt-bench-") as tmp:
        work = Path(tmp)
        save_hf_checkpoint(CONFIGS[args.config], work / "hf")
        bundles, compile_s, load_s = {}, {}, {}
        for backend in BACKENDS:
            start = time.perf_counter()
            bundles[backend] = compile_recipe(load_recipe(recipe(work, work / "hf", backend, kv)), cache_dir=work / "cache",
                                              progress=False).bundle
            compile_s[backend] = time.perf_counter() - start
        executors = {}
        for backend in BACKENDS:
            start = time.perf_counter()
            executors[backend] = BundleExecutor(bundles[backend])
            load_s[backend] = time.perf_counter() - start
        executors["pjrt-copy"] = BundleExecutor(bundles["pjrt"])
        recompile_s = recompile_seconds(executors["pjrt"])
        positions = {name: PROMPT for name in executors}

        def decode_fn(name):
            def step():
                executors[name].run(decode(positions[name]))
                positions[name] = PROMPT + (positions[name] - PROMPT + 1) % (args.max_len - PROMPT - 1)
                if name == "pjrt-copy":
                    hold_state_views(executors[name])
            return step

        with torch.inference_mode():
            decode_ms = interleaved({name: decode_fn(name) for name in executors})
            prefill_ms = interleaved({name: (lambda n=name: executors[n].run(prefill())) for name in BACKENDS})
    state_mib = sum(t.nbytes for t in executors["pjrt"].state.values()) / 2**20
    print(f"\n{args.config}: float32, torch {torch.__version__}, {torch.get_num_threads()} threads; kv {kv} "
          f"(state pool {state_mib:.0f} MiB); medians of {ROUNDS * STEPS}")
    print(f"{'backend':>9} {'compile s':>10} {'load s':>8} {'decode ms':>10} {'prefill ms':>11}")
    for backend in BACKENDS:
        print(f"{backend:>9} {compile_s[backend]:10.1f} {load_s[backend]:8.2f} {decode_ms[backend]:10.2f} {prefill_ms[backend]:11.2f}")
    print(f"pjrt decode with state updated by copy: {decode_ms['pjrt-copy']:.2f} ms "
          f"({decode_ms['pjrt-copy'] / decode_ms['pjrt']:.2f}x in place)")
    print(f"pjrt load: deserializing the executables {load_s['pjrt']:.2f} s (whole load) vs compiling their StableHLO "
          f"{recompile_s:.2f} s (regions alone)")
    print(f"decode pjrt / inductor = {decode_ms['pjrt'] / decode_ms['inductor']:.2f}x, pjrt / export = "
          f"{decode_ms['pjrt'] / decode_ms['export']:.2f}x; prefill pjrt / inductor = "
          f"{prefill_ms['pjrt'] / prefill_ms['inductor']:.2f}x")


def hold_state_views(executor):
    """A torch view of each state tensor's PJRT buffer, held until the next step: an outside
    reference, so XLA copies the state instead of updating the donated buffer in place."""
    from deepinfer.runtime.backends.pjrt import _RESIDENT

    executor.held_views = [torch.from_dlpack(_RESIDENT[id(t)]) for t in executor.state.values()]


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
