"""Context buckets: decode ms/token at contexts 64, 1K and 4K, side by side in one run.

    .venv/bin/python bench/context_bench.py                  # ~100M and 64-expert configs (~15 min cold)
    .venv/bin/python bench/context_bench.py --configs 100m

For each config (random weights, float32, AOTInductor) it compiles four bundles:
    pool-4096     kv.max_len 4096 and no context buckets: every step attends all 4096 positions
    buckets-4096  the same with decode context buckets [64, 1024] (+ 4096)
    whole-4096    buckets-4096 as one whole graph per program: what cutting layers into regions costs
    pool-256      kv.max_len 256: what a short conversation should cost (the target at context 64)
and times batch-1 decode steps at positions 63, 1023 and 4095 (each step on the smallest context
bucket that holds it, as the engine picks), the bundles taking turns in rounds so a noisy stretch
of this shared machine falls on all alike. Targets: buckets-4096 at context 64 within 1.3x of
pool-256; buckets-4096 within 1.10x of whole-4096.
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
from deepinfer.runtime.executor import BundleExecutor
from deepinfer.runtime.step import Step

BASE_100M = {  # decode_bench's ~97M config: 1 dense + 2 MoE layers of 16 experts, vocab 32000
    "vocab_size": 32000, "hidden_size": 768, "intermediate_size": 2048, "moe_intermediate_size": 512,
    "num_hidden_layers": 3, "num_attention_heads": 8, "n_shared_experts": 1, "n_routed_experts": 16,
    "kv_lora_rank": 256, "q_lora_rank": 384, "qk_rope_head_dim": 32, "v_head_dim": 64, "qk_nope_head_dim": 64,
    "n_group": 4, "topk_group": 2, "num_experts_per_tok": 4, "first_k_dense_replace": 1,
    "max_position_embeddings": 4096, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
}
CONFIGS = {
    "100m": BASE_100M,
    "64x4": {**BASE_100M, "n_routed_experts": 64, "moe_intermediate_size": 256, "n_group": 8, "topk_group": 4},
}
CONTEXTS = [64, 1024]
POSITIONS = [63, 1023, 4095]
BUNDLES = {  # name -> (kv.max_len, decode context buckets, split_layers)
    "pool-4096": (4096, None, True),
    "buckets-4096": (4096, CONTEXTS, True),
    "whole-4096": (4096, CONTEXTS, False),
    "pool-256": (256, None, True),
}
ROUNDS, STEPS_PER_ROUND, WARMUP = 8, 6, 3


def write_recipe(work: Path, config: dict, name: str, max_len: int, contexts, split_layers: bool) -> Path:
    decode = {"buckets": [1], **({"context": contexts} if contexts else {})}
    recipe = {"name": name, "model": {"config": config, "seed": 0}, "dtype": "float32",
              "methods": {"decode": decode, "prefill": {"buckets": [16]}}, "kv": {"max_seqs": 1, "max_len": max_len},
              "regions": {"split_layers": split_layers}, "backend": {"name": "inductor"}, "output": str(work / "bundles" / name)}
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def step_at(executor: BundleExecutor, position: int) -> Step:
    contexts = executor.manifest.contexts.get("decode", [])
    context = next((c for c in contexts if c > position), None)
    return Step("decode", torch.tensor([7]), torch.tensor([position]), torch.tensor([0]), context=context)


def take_turns(runs: dict, repeat: int = STEPS_PER_ROUND, before=None, rounds: int = ROUNDS) -> dict[str, float]:
    """name -> fn(); median ms per call over `rounds` rounds of `repeat` calls each, the runs taking
    turns so a noisy stretch of this shared machine falls on all of them alike. `before()`, if
    given, runs ahead of each timed call, untimed."""
    for fn in runs.values():
        for _ in range(WARMUP):
            fn()
    times = {name: [] for name in runs}
    for _ in range(rounds):
        for name, fn in runs.items():
            for _ in range(repeat):
                if before:
                    before()
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def bench_config(name: str, config: dict, work: Path, jobs: int) -> dict:
    cache = work / f"cache-{name}"
    executors, summaries = {}, {}
    for bundle, (max_len, contexts, split) in BUNDLES.items():
        recipe = load_recipe(write_recipe(work, config, f"{name}-{bundle}", max_len, contexts, split))
        summaries[bundle] = compile_recipe(recipe, jobs=jobs, cache_dir=cache, progress=False)
        executors[bundle] = BundleExecutor(summaries[bundle].bundle)
    runs = {}
    for bundle, executor in executors.items():
        for position in POSITIONS:
            if position < executor.manifest.kv.max_len:
                step = step_at(executor, position)
                runs[bundle, position] = lambda executor=executor, step=step: executor.run(step)
    with torch.inference_mode():
        ms = take_turns(runs)
    return {"ms": ms, "regions": {b: s.unique_regions for b, s in summaries.items()},
            "programs": {b: s.programs for b, s in summaries.items()}}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="deepinfer-bench-") as tmp:
        rows = {name: bench_config(name, CONFIGS[name], Path(tmp), args.jobs) for name in args.configs}
    print(f"\ndecode, batch 1, float32, AOTInductor, torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"ms per token (median of {ROUNDS * STEPS_PER_ROUND})")
    for name, row in rows.items():
        ms = row["ms"]
        print(f"\n{name}: unique regions {row['regions']}")
        print(f"{'bundle':>13} " + " ".join(f"{'pos ' + str(p):>10}" for p in POSITIONS))
        for bundle in BUNDLES:
            cells = [f"{ms[bundle, p]:10.2f}" if (bundle, p) in ms else f"{'-':>10}" for p in POSITIONS]
            print(f"{bundle:>13} " + " ".join(cells))
        print(f"context 64: buckets-4096 / pool-256 = {ms['buckets-4096', 63] / ms['pool-256', 63]:.2f}x (target <= 1.3x), "
              f"pool-4096 / pool-256 = {ms['pool-4096', 63] / ms['pool-256', 63]:.2f}x")
        split_cost = [ms["buckets-4096", p] / ms["whole-4096", p] for p in POSITIONS]
        print("buckets-4096 / whole-4096 (region split cost): " + ", ".join(f"{r:.2f}x" for r in split_cost) + " (target <= 1.10x)")


if __name__ == "__main__":
    main()
