"""Decode speed of a compiled bundle against the eager paths, side by side, on the same weights.

    .venv/bin/python bench/decode_bench.py                  # tiny, ~100M and 64x4 configs (~10 minutes cold)
    .venv/bin/python bench/decode_bench.py --configs tiny   # just the tiny one

For each config it saves random weights as an HF checkpoint, compiles bundles from it (regions
split per layer, and one whole graph per program), and prints per-token decode latency (batch 1,
median over steps at positions 37..) for: the inductor bundle, the whole-graph bundle, our eager
model, HF transformers eager, and torch.compile of our eager model; then the ratios the targets
are stated in, the executor's host overhead per region call, and cold/warm compile seconds.
All timings in one process on this machine's threads, the five paths taking turns in rounds.

Then, per region of a bundle split per layer and before each layer's MLP: microseconds a call,
the weight bytes a call reads and so the rate it reads them at (a routed expert stack counts
k / n_routed_experts of its bytes: a batch-1 step reads the k experts it routes to; the
embedding, one row). Decode at batch 1 is bound by reading weights, so a region well below the
dense MLP's rate is doing something other than reading them.
"""

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
import yaml
from safetensors.torch import load_file

from deepinfer.compiler.build import compile_recipe
from deepinfer.compiler.recipe import load_recipe
from deepinfer.models import TINY_CONFIG, build_model
from deepinfer.runtime.executor import BundleExecutor
from deepinfer.runtime.step import Step

from context_bench import CONFIGS as MOE_CONFIGS

# tiny, ~100M (1 dense + 2 MoE layers of 16 experts top-4) and the same with 64 smaller experts
CONFIGS = {"tiny": TINY_CONFIG, **MOE_CONFIGS}
PROMPT_LEN, WARMUP, ROUNDS, STEPS_PER_ROUND = 32, 5, 10, 5
STEPS = ROUNDS * STEPS_PER_ROUND
MAX_SEQS, MAX_LEN = 2, 128


def interleaved_median_ms(step_fns: dict) -> dict[str, float]:
    """Per-token ms of each decode path (name -> fn(position)). The paths take turns, ROUNDS rounds of
    STEPS_PER_ROUND consecutive steps each, so a noisy stretch of this shared machine falls on all of
    them alike while each still runs warm; median over all its steps."""
    for i in range(WARMUP):
        for fn in step_fns.values():
            fn(PROMPT_LEN + i)
    times = {name: [] for name in step_fns}
    position = PROMPT_LEN + WARMUP
    for _ in range(ROUNDS):
        for name, fn in step_fns.items():
            for i in range(STEPS_PER_ROUND):
                start = time.perf_counter()
                fn(position + i)
                times[name].append(time.perf_counter() - start)
        position += STEPS_PER_ROUND
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def save_hf_checkpoint(config: dict, directory: Path):
    import transformers

    hf_config = transformers.DeepseekV3Config(**config, num_key_value_heads=config["num_attention_heads"])
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(hf_config).eval()
    model.config._attn_implementation = "eager"
    model.save_pretrained(directory)
    return model


# The per-region table's bundle also cuts each layer before its MLP (at the norm's first op), so
# the MLP or MoE is a region of its own, apart from the attention.
BEFORE_MLP = [{"op": "aten.pow", "module": "layers.*.post_attention_layernorm"}]


def write_recipe(directory: Path, checkpoint: Path, name: str, split_layers: bool, boundaries=()) -> Path:
    recipe = {
        "name": name, "model": {"checkpoint": str(checkpoint)}, "dtype": "float32",
        "methods": {"decode": {"buckets": [1]}, "prefill": {"buckets": [16]}},
        "kv": {"max_seqs": MAX_SEQS, "max_len": MAX_LEN},
        "regions": {"split_layers": split_layers, "boundaries": list(boundaries)},
        "backend": {"name": "inductor"}, "output": str(directory / "bundles" / name),
    }
    path = directory / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def decode_step(slot: int):
    def make(position: int) -> Step:
        return Step("decode", torch.tensor([7]), torch.tensor([position]), torch.tensor([slot]))
    return make


def bench_config(name: str, config: dict, work: Path, jobs: int) -> dict:
    checkpoint = work / f"{name}-hf"
    hf = save_hf_checkpoint(config, checkpoint)
    cache = work / f"cache-{name}"
    row = {"params_m": sum(p.numel() for p in hf.parameters()) / 1e6}

    start = time.perf_counter()
    split = compile_recipe(load_recipe(write_recipe(work, checkpoint, f"{name}-split", True)), jobs=jobs, cache_dir=cache, progress=False)
    row["compile_cold_s"] = time.perf_counter() - start
    start = time.perf_counter()
    compile_recipe(load_recipe(write_recipe(work, checkpoint, f"{name}-split", True)), jobs=jobs, cache_dir=cache, progress=False)
    row["compile_warm_s"] = time.perf_counter() - start
    whole = compile_recipe(load_recipe(write_recipe(work, checkpoint, f"{name}-whole", False)), jobs=jobs, cache_dir=cache, progress=False)
    cut = compile_recipe(load_recipe(write_recipe(work, checkpoint, f"{name}-cut", True, BEFORE_MLP)), jobs=jobs, cache_dir=cache,
                         progress=False)

    bundle = BundleExecutor(split.bundle)
    whole_bundle = BundleExecutor(whole.bundle)
    make = decode_step(0)
    model = build_model(checkpoint=checkpoint)
    kv = model.new_state(MAX_SEQS, MAX_LEN)
    compiled_kv = model.new_state(MAX_SEQS, MAX_LEN)
    with torch.inference_mode():
        compiled = torch.compile(model.decode, dynamic=False)
        start = time.perf_counter()
        compiled(*make(PROMPT_LEN).inputs(), compiled_kv)
        row["torch_compile_first_call_s"] = time.perf_counter() - start

        cache_hf = hf(torch.randint(0, config["vocab_size"], (1, PROMPT_LEN)), use_cache=True).cache

        def hf_step(pos):
            nonlocal cache_hf
            cache_hf = hf(torch.tensor([[7]]), cache=cache_hf, use_cache=True).cache

        ms = interleaved_median_ms({
            "bundle": lambda pos: bundle.run(make(pos)),
            "whole_graph": lambda pos: whole_bundle.run(make(pos)),
            "our_eager": lambda pos: model.decode(*make(pos).inputs(), kv),
            "torch_compile": lambda pos: compiled(*make(pos).inputs(), compiled_kv),
            "hf_eager": hf_step,
        })
    row.update({f"{name}_ms": value for name, value in ms.items()})

    # Host overhead: a step's wall time minus the time spent inside the region functions.
    bundle.host_seconds = {}
    calls = len(bundle.plans["decode/1"].calls)
    step_times = []
    for i in range(STEPS):
        start = time.perf_counter()
        bundle.run(make(PROMPT_LEN + i))
        step_times.append(time.perf_counter() - start)
    inside = sum(bundle.host_seconds.values())
    row["host_overhead_us_per_call"] = (sum(step_times) - inside) / (STEPS * calls) * 1e6
    row["region_calls_per_step"] = calls
    row["regions"] = region_bandwidth(BundleExecutor(cut.bundle), make, config)
    return row


def region_bandwidth(executor: BundleExecutor, make, config: dict) -> list[dict]:
    """One row per distinct region of decode/1, timed over STEPS steps: the modules it runs for,
    calls a step, us a call, weight MB a call reads, GB/s."""
    executor.host_seconds = {}
    for i in range(WARMUP + STEPS):
        if i == WARMUP:
            executor.host_seconds = {}
        executor.run(make(PROMPT_LEN + i))
    sizes = {name: t.nbytes for name, t in load_file(executor.bundle / executor.manifest.weight_files[0]).items()}
    routed_share = config["num_experts_per_tok"] / config["n_routed_experts"]

    def nbytes(name: str) -> float:
        if ".mlp.experts_" in name:
            return sizes[name] * routed_share
        return sizes[name] / config["vocab_size"] if name.startswith("embed") else sizes[name]  # one row of the table

    rows = {}
    for step in executor.manifest.programs["decode/1"].steps:
        if step.collective:
            continue
        weights = [n for n in step.inputs if n in sizes]
        module = max(weights, key=nbytes, default="-").split(".")
        module = ".".join(module[:3] if module[0] == "layers" else module[:1])
        row = rows.setdefault(step.region, {"modules": [], "calls": 0, "mb": sum(map(nbytes, weights)) / 1e6})
        row["modules"].append(module)
        row["calls"] += 1
    for fingerprint, row in rows.items():
        row["us"] = executor.host_seconds[fingerprint] / (STEPS * row["calls"]) * 1e6
        row["gb_s"] = row["mb"] / row["us"] * 1e3
    return list(rows.values())


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="deepinfer-bench-") as tmp:
        rows = {name: bench_config(name, CONFIGS[name], Path(tmp), args.jobs) for name in args.configs}
    print(f"\ndecode, batch 1, float32, torch {torch.__version__}, {torch.get_num_threads()} threads; ms per token (median of {STEPS})")
    print(f"{'config':>6} {'params':>7} {'bundle':>8} {'whole':>8} {'eager':>8} {'HF':>8} {'t.compile':>9} | "
          f"{'HF/bundle':>9} {'eager/bundle':>12} {'bundle/whole':>12} | {'host us/call':>12} {'cold s':>7} {'warm s':>7}")
    for name, r in rows.items():
        print(f"{name:>6} {r['params_m']:6.1f}M {r['bundle_ms']:8.3f} {r['whole_graph_ms']:8.3f} {r['our_eager_ms']:8.3f} "
              f"{r['hf_eager_ms']:8.3f} {r['torch_compile_ms']:9.3f} | {r['hf_eager_ms'] / r['bundle_ms']:8.2f}x "
              f"{r['our_eager_ms'] / r['bundle_ms']:11.2f}x {r['bundle_ms'] / r['whole_graph_ms']:11.2f}x | "
              f"{r['host_overhead_us_per_call']:12.1f} {r['compile_cold_s']:7.1f} {r['compile_warm_s']:7.1f}")
    print("targets: HF/bundle >= 2x, eager/bundle >= 1.5x, bundle/whole <= 1.10x")
    for name, r in rows.items():
        print(f"\n{name}: decode regions, cut per layer and before each MLP (batch 1; routed experts count the k read of E)")
        print(f"{'largest weights':>28} {'calls':>5} {'us/call':>8} {'MB/call':>8} {'GB/s':>6}")
        for region in sorted(r["regions"], key=lambda region: -region["us"] * region["calls"]):
            modules = ",".join(sorted(set(region["modules"])))
            print(f"{modules[:28]:>28} {region['calls']:5d} {region['us']:8.1f} {region['mb']:8.2f} {region['gb_s']:6.1f}")


if __name__ == "__main__":
    main()
