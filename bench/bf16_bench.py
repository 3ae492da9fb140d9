"""bfloat16 bundles against float32 bundles on this CPU, side by side: decode time per output token
(batch 1) and the time to first token of a 256-token prompt, AOTInductor bundles split per layer as
recipes compile them (--whole-graph: one graph a program).

    .venv/bin/python bench/bf16_bench.py                     # the 12m and 100m configs
    .venv/bin/python bench/bf16_bench.py --configs 12m --regions
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 .venv/bin/python bench/bf16_bench.py   # an AVX-512 host held to AVX2
    .venv/bin/python bench/bf16_bench.py --configs 100m --position 8000 --cold
    .venv/bin/python bench/bf16_bench.py --configs 100m --batch 8    # decode steps of 8 sequences

The first line names the ISA: the CPU's model and bf16 features, the vector ISA ATen and inductor
use (ATEN_CPU_CAPABILITY steers both) and oneDNN's cap. Held to AVX2 on an AVX-512 host, inductor
emits AVX2 code and oneDNN runs its AVX2 kernels, as on an AVX2-only host (the caches and memory
of this host remain). Targets (issue 26): bf16 / f32 TPOT <= 0.8 (half the weight bytes to read)
and 256-token TTFT <= 1.2. The paths take turns in rounds; medians.

Decode steps are at position 300 of a 512-position KV pool; --position P moves them (the pool
grows to the power of two past P: the heads' products over the cache are the step's biggest);
--batch B makes each decode step B sequences' (B rows through every weight, as a server batches).
--cold evicts the CPU caches before each timed call (a read and write of twice the last-level
cache): the weights then come from memory, as in a model much bigger than the cache, or on a host
whose cache is smaller than this one's -- a CPU with a large L3 holds these small models whole,
where bf16's half-size reads cannot show.

--regions also compiles both split per layer and before each MLP and prints each region's host
milliseconds a decode step and a 256-token prefill, f32 beside bf16 (where the time goes).
"""

import argparse
import os
import platform
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

from context_bench import BASE_100M, take_turns
from decode_bench import BEFORE_MLP

CONFIGS = {
    # ~12M: 6 layers (1 dense, 5 MoE of 16 experts, top 4)
    "12m": {**BASE_100M, "vocab_size": 4096, "hidden_size": 256, "intermediate_size": 768, "moe_intermediate_size": 128,
            "num_hidden_layers": 6, "num_attention_heads": 4, "kv_lora_rank": 128, "q_lora_rank": 192},
    "100m": BASE_100M,  # decode_bench's ~97M: 1 dense + 2 MoE layers of 16 experts, vocab 32000
}
PROMPT_LEN, POSITION, POOL = 256, 300, 512  # a prefill chunk of 256 tokens; decode steps at position 300 of 512
# Rounds of 3 calls a path: this many spread the timing over a minute or more. Some hosts have
# stretches of tens of seconds in which many separate BLAS calls run 1.4-1.7x slower (the bf16
# prefill makes more of them than the f32 one); 8 rounds could all fall in one such stretch.
ROUNDS = 40


def isa_line() -> str:
    flags = set()
    model = platform.processor()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
        elif line.startswith("model name"):
            model = line.split(":", 1)[1].strip()
        if flags and model:
            break
    native = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    held = {name: os.environ[name] for name in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA") if name in os.environ}
    return (f"CPU: {model}; flags {' '.join(native)}; ATen/inductor ISA {torch.backends.cpu.get_cpu_capability()}"
            + (f" (held by {held})" if held else "") + f"; {torch.get_num_threads()} threads")


def pool_for(position: int) -> int:
    """KV pool positions for decode steps at `position`: 512, or the power of two past it."""
    return max(POOL, 1 << position.bit_length())


def compile_bundle(work: Path, name: str, config: dict, dtype: str, split_layers: bool, boundaries: list,
                   pool: int = POOL, batch: int = 1) -> Path:
    config = {**config, "max_position_embeddings": max(config["max_position_embeddings"], pool)}
    recipe = {"name": name, "model": {"config": config, "seed": 0}, "dtype": dtype,
              "methods": {"decode": {"buckets": [batch]}, "prefill": {"buckets": [PROMPT_LEN]}},
              "kv": {"max_seqs": batch, "max_len": pool},
              "regions": {"split_layers": split_layers, "boundaries": boundaries},
              "backend": {"name": "inductor"}, "output": str(work / name)}
    (work / f"{name}.yaml").write_text(yaml.safe_dump(recipe))
    return compile_recipe(load_recipe(work / f"{name}.yaml"), cache_dir=work / "cache", progress=False).bundle


def decode_step(position: int = POSITION, batch: int = 1) -> Step:
    """One decode row for each of `batch` sequences, all at `position`."""
    return Step("decode", torch.arange(batch) + 7, torch.full((batch,), position), torch.arange(batch))


def last_level_cache_bytes() -> int:
    size = Path("/sys/devices/system/cpu/cpu0/cache/index3/size")
    text = size.read_text().strip() if size.exists() else "64M"
    return int(text[:-1]) << {"K": 10, "M": 20, "G": 30}[text[-1]]


def cache_evictor():
    """A call that reads and writes twice the last-level cache, leaving none of the model in it."""
    buffer = torch.zeros(2 * last_level_cache_bytes() // 4)
    return lambda: buffer.add_(1.0)


def prefill_step() -> Step:
    return Step("prefill", torch.arange(PROMPT_LEN) % 200 + 5, torch.arange(PROMPT_LEN), torch.zeros(PROMPT_LEN, dtype=torch.int64),
                read_slot=torch.tensor([0]), last_index=torch.tensor([PROMPT_LEN - 1]))


def region_ms(executor: BundleExecutor, step: Step) -> dict:
    """Median host ms per region fingerprint for one run of `step` (3 runs)."""
    per_call = {}
    for _ in range(3):
        executor.host_seconds = {}
        executor.run(step)
        for fingerprint, seconds in executor.host_seconds.items():
            per_call.setdefault(fingerprint, []).append(seconds)
    return {fingerprint: statistics.median(seconds) * 1e3 for fingerprint, seconds in per_call.items()}


def region_table(split: dict, position: int, batch: int):
    """Host ms each region takes in a decode step and in a 256-token prefill, f32 and bf16 bundles
    split alike, their regions matched by name."""
    for label, step in (("decode", decode_step(position, batch)), (f"prefill {PROMPT_LEN}", prefill_step())):
        rows = {}  # region name -> {dtype: [ms a step over its uses, uses]}
        for dtype, executor in split.items():
            ms = region_ms(executor, step)
            calls = [s for s in executor.manifest.programs[step.key].steps if s.region]
            uses = {fingerprint: sum(c.region == fingerprint for c in calls) for fingerprint in ms}
            for call in calls:
                # named by the first weight it reads that is not a norm's ("layers.*.mlp.gate.weight")
                name = next((n for n in call.inputs if ("weight" in n or "experts" in n) and "norm" not in n), call.inputs[0])
                name = ".".join("*" if part.isdigit() else part for part in name.split("."))
                cell = rows.setdefault(name, {}).setdefault(dtype, [0.0, 0])
                cell[0] += ms[call.region] / uses[call.region]
                cell[1] += 1
        totals = {dtype: sum(rows[n][dtype][0] for n in rows) for dtype in split}
        print(f"  {label}: f32 {totals['float32']:.1f} ms, bf16 {totals['bfloat16']:.1f} ms in regions")
        for name, cells in sorted(rows.items(), key=lambda kv: -kv[1]["bfloat16"][0]):
            f32, bf16 = cells["float32"][0], cells["bfloat16"][0]
            print(f"    f32 {f32:8.2f} ms  bf16 {bf16:8.2f} ms  {bf16 / f32:5.2f}  x{cells['bfloat16'][1]}  {name}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--regions", action="store_true", help="per-region host time of split f32 and bf16 bundles")
    parser.add_argument("--whole-graph", action="store_true", help="time bundles of one graph a program")
    parser.add_argument("--position", type=int, default=POSITION, help="decode steps' position (the pool grows past it)")
    parser.add_argument("--cold", action="store_true", help="evict the CPU caches before each timed call")
    parser.add_argument("--batch", type=int, default=1, help="sequences a decode step advances")
    args = parser.parse_args()
    pool = pool_for(args.position)
    print(isa_line())
    print(f"decode at position {args.position} of a {pool}-position KV pool; caches "
          + (f"evicted before each timed call ({2 * last_level_cache_bytes() >> 20} MiB)" if args.cold else "warm"))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for name in args.configs:
            start = time.perf_counter()
            executors = {dtype: BundleExecutor(compile_bundle(work, f"{name}-{dtype}", CONFIGS[name], dtype, not args.whole_graph, [],
                                                              pool, args.batch))
                         for dtype in ("float32", "bfloat16")}
            form = ("one graph a program" if args.whole_graph else "split per layer") + (", cold" if args.cold else "")
            form += f", position {args.position}" if args.position != POSITION else ""
            form += f", decode batch {args.batch}" if args.batch != 1 else ""
            print(f"\n{name} ({form}): compiled in {time.perf_counter() - start:.0f} s")
            runs, decode, prefill = {}, decode_step(args.position, args.batch), prefill_step()  # built once, outside the timing
            for dtype, executor in executors.items():
                runs[f"tpot {dtype}"] = lambda e=executor: e.run(decode)
                runs[f"ttft {dtype}"] = lambda e=executor: e.run(prefill)
            ms = take_turns(runs, repeat=3, before=cache_evictor() if args.cold else None, rounds=ROUNDS)
            tpot, ttft = ms["tpot bfloat16"] / ms["tpot float32"], ms["ttft bfloat16"] / ms["ttft float32"]
            rows.append((f"{name} ({form})", ms, tpot, ttft))
            print(f"  TPOT  f32 {ms['tpot float32']:8.2f} ms  bf16 {ms['tpot bfloat16']:8.2f} ms  bf16/f32 {tpot:.2f} "
                  f"(target <= 0.8) {'MET' if tpot <= 0.8 else 'MISSED'}")
            print(f"  TTFT  f32 {ms['ttft float32']:8.1f} ms  bf16 {ms['ttft bfloat16']:8.1f} ms  bf16/f32 {ttft:.2f} "
                  f"(target <= 1.2) {'MET' if ttft <= 1.2 else 'MISSED'}")
            if args.regions:
                region_table({dtype: BundleExecutor(compile_bundle(work, f"{name}-{dtype}-split", CONFIGS[name], dtype, True, BEFORE_MLP,
                                                                   pool, args.batch))
                              for dtype in ("float32", "bfloat16")}, args.position, args.batch)
    print("\n| config | TPOT f32 | TPOT bf16 | ratio | TTFT-256 f32 | TTFT-256 bf16 | ratio |")
    print("|---|---|---|---|---|---|---|")
    for name, ms, tpot, ttft in rows:
        print(f"| {name} | {ms['tpot float32']:.2f} ms | {ms['tpot bfloat16']:.2f} ms | {tpot:.2f} | "
              f"{ms['ttft float32']:.1f} ms | {ms['ttft bfloat16']:.1f} ms | {ttft:.2f} |")


if __name__ == "__main__":
    main()
