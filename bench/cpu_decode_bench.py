"""CPU decode against llama.cpp at the same bit width, on the same weights: deepinfer's float32,
bfloat16, int8 and int4 bundles (recipe model.quantize) against llama.cpp's f32, bf16, q8_0 and q4_0.

    .venv/bin/python bench/cpu_decode_bench.py                    # ~40 minutes cold (llama.cpp's build ~15 of them)
    .venv/bin/python bench/cpu_decode_bench.py --models tiny-v3-code
    .venv/bin/python bench/cpu_decode_bench.py --models 190m --formats int4     # one pair

Two models: the trained tiny DeepSeek-V3 (checkpoints/tiny-v3-code, 4.7M parameters: fixed costs
dominate) and a ~190M-parameter DeepSeek-V3 of random weights saved as an HF checkpoint (vocab
32000, 1 dense + 3 MoE layers of 16 experts, top 4; the tiny model's tokenizer, padded). llama.cpp
is the one llama-cpp-python 0.3.36 vendors, built for this CPU in the bench's own directory
(bench/llama_cpp_reference.py); the checkpoints are converted with its converter, q4_0 made by its
llama-quantize. Both sides run 2 threads, one sequence, and take turns in rounds (median of each):

    TPOT at 32 / 512   ms a generated token after a 32- / 512-token prompt
    TTFT at 32 / 512   ms to process a 32- / 512-token prompt (ours: its prefill steps), each side after an
                       untimed run of the same prompt (llama-bench's warmup)

Each TPOT also against the floor: the bytes a token must read -- the weights' (the compile summary's
"read per decode token") and the KV cache's rows up to its position -- over this box's read
bandwidth (a float32 sum over 512 MiB on huge pages), measured just before each pair of TPOT times it
judges: the box's neighbours move both by 15-30% within the hour (and the sum, on an AMD EPYC, by
up to 2x between rounds a minute apart), so each round's TPOT, ours and llama.cpp's, is divided by
the floor measured next to it and the table gives the median of those ratios for each side.
"""

import argparse
import math
import platform
import shutil
import statistics
import time
from pathlib import Path

import torch
import yaml
from llama_cpp_reference import LlamaCpp
from quantized_matmul_bench import read_bandwidth

from deepinfer.compiler.build import compile_recipe
from deepinfer.compiler.recipe import load_recipe
from deepinfer.runtime.executor import BundleExecutor
from deepinfer.runtime.step import Step, entries_holding

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "checkpoints" / "tiny-v3-code"
CONFIG_190M = {
    "vocab_size": 32000, "hidden_size": 1024, "intermediate_size": 2816, "moe_intermediate_size": 640,
    "num_hidden_layers": 4, "num_attention_heads": 8, "n_shared_experts": 1, "n_routed_experts": 16,
    "kv_lora_rank": 256, "q_lora_rank": 384, "qk_rope_head_dim": 32, "v_head_dim": 64, "qk_nope_head_dim": 64,
    "n_group": 4, "topk_group": 2, "num_experts_per_tok": 4, "first_k_dense_replace": 1, "max_position_embeddings": 4096,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "num_key_value_heads": 8, "bos_token_id": 0, "eos_token_id": 0,
}
# (ours: recipe dtype, model.quantize) -> llama.cpp's type at the same width
PAIRS = {"float32": ("float32", None, "f32"), "bfloat16": ("bfloat16", None, "bf16"),
         "int8": ("float32", "int8", "q8_0"), "int4": ("float32", "int4", "q4_0")}
MAX_LEN, TOKENS, ROUNDS = 640, 16, 5


def random_checkpoint(directory: Path) -> Path:
    """The ~190M config's random weights as an HF checkpoint, with the tiny model's tokenizer."""
    import transformers

    if not (directory / "config.json").exists():
        torch.manual_seed(0)
        model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**CONFIG_190M))
        model.save_pretrained(directory)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(TINY / name, directory / name)
    return directory


METHODS = {"decode": {"buckets": [1], "context": [64]}, "prefill": {"buckets": [32, 512], "context": [64]}}


def compile_bundle(checkpoint: Path, name: str, dtype: str, quantize: str | None, work: Path, methods: dict = METHODS,
                   max_seqs: int = 1):
    """An inductor bundle of `checkpoint` (model.quantize: `quantize`) in work/bundles; its compile summary."""
    recipe = {"name": name, "model": {"checkpoint": str(checkpoint), **({"quantize": quantize} if quantize else {})},
              "dtype": dtype, "methods": methods, "kv": {"max_seqs": max_seqs, "max_len": MAX_LEN},
              "backend": {"name": "inductor"}, "output": str(work / "bundles" / name)}
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    summary = compile_recipe(load_recipe(path), jobs=2, cache_dir=work / "cache", progress=False)
    print(f"  {name}: {summary}", flush=True)
    return summary


def our_bundle(checkpoint: Path, name: str, dtype: str, quantize: str | None, work: Path):
    summary = compile_bundle(checkpoint, name, dtype, quantize, work)
    return BundleExecutor(summary.bundle), summary


def prefill(executor: BundleExecutor, length: int):
    """A `length`-token prompt in one chunk, in the smallest context bucket that holds it."""
    context = next(c for c in executor.manifest.contexts["prefill"] if c >= length)
    step = Step("prefill", torch.arange(length) % 1000 + 5, torch.arange(length), torch.zeros(length, dtype=torch.long),
                torch.zeros(1, dtype=torch.long), torch.tensor([length - 1]), context=context)
    executor.run(step)


def decode_ms(executor: BundleExecutor, start: int) -> float:
    """Median ms of TOKENS decode steps after a `start`-token prompt (prefilled first, untimed)."""
    prefill(executor, start)
    times = []
    for position in range(start, start + TOKENS):
        context = next((c for c in executor.manifest.contexts["decode"] if c > position))
        step = Step("decode", torch.tensor([7]), torch.tensor([position]), torch.zeros(1, dtype=torch.long), context=context)
        begin = time.perf_counter()
        executor.run(step)
        times.append(time.perf_counter() - begin)
    return statistics.median(times) * 1e3


def prefill_ms(executor: BundleExecutor, length: int) -> float:
    """ms of a `length`-token prefill after an untimed one, as llama-bench times a prompt after its
    warmup run of the same prompt (the first call after the other side's run pays for threads
    woken from sleep and caches it evicted: the tiny V3's float32 TTFT-32 3.7 ms that way, 2.2
    warm)."""
    prefill(executor, length)
    begin = time.perf_counter()
    prefill(executor, length)
    return (time.perf_counter() - begin) * 1e3


MEASURES = {"TPOT 32": (lambda e: decode_ms(e, 32), lambda l, g: l.bench(g, depth=32, tokens=TOKENS)),
            "TPOT 512": (lambda e: decode_ms(e, 512), lambda l, g: l.bench(g, depth=512, tokens=TOKENS)),
            "TTFT 32": (lambda e: prefill_ms(e, 32), lambda l, g: l.bench(g, prompt=32)),
            "TTFT 512": (lambda e: prefill_ms(e, 512), lambda l, g: l.bench(g, prompt=512))}


def cache_bytes(executor: BundleExecutor, position: int) -> int:
    """Bytes of the state a decode token at `position` must read: every layer's entries holding the
    positions up to it. The bundle reads its whole context bucket; that padding is not the floor's."""
    return sum(entries_holding(position + 1, spec.positions_per_entry, spec.shape[1]) * math.prod(spec.shape[2:])
               * getattr(torch, spec.dtype).itemsize for layer in executor.manifest.state for spec in layer)


def token_bytes(executor: BundleExecutor, summary, measure: str) -> int:
    """A TPOT measure's bytes a token reads, weights and cache (the middle token of the TOKENS
    decoded after the measure's prompt): over a bandwidth, its floor."""
    return summary.decode_bytes + cache_bytes(executor, int(measure.split()[1]) + TOKENS // 2)


def bench_model(name: str, checkpoint: Path, llama: LlamaCpp, work: Path, formats: list[str]):
    print(f"\n{name}: compiling and converting", flush=True)
    sides = {}
    for ours, (dtype, quantize, theirs) in ((f, PAIRS[f]) for f in formats):
        executor, summary = our_bundle(checkpoint, f"{name}-{ours}", dtype, quantize, work)
        gguf = llama.convert(checkpoint, work / f"{name}-{theirs}.gguf", theirs)
        sides[ours] = (executor, gguf, summary)
    for executor, _, _ in sides.values():  # warm
        decode_ms(executor, 32)
    times = {(ours, m): ([], []) for ours in formats for m in MEASURES}
    bandwidths = {(ours, m): [] for ours in formats for m in MEASURES if m.startswith("TPOT")}
    for _ in range(ROUNDS):
        for ours, (executor, gguf, _) in sides.items():
            for measure, (mine, theirs) in MEASURES.items():
                if (ours, measure) in bandwidths:  # (the box's rate now, next to the two times it judges)
                    bandwidths[ours, measure].append(read_bandwidth())
                times[ours, measure][0].append(mine(executor))
                times[ours, measure][1].append(theirs(llama, gguf))
    rates = [b for measured in bandwidths.values() for b in measured]
    print(f"\n{name}, ms (median of {ROUNDS} rounds), 2 threads; floor = the weight and KV cache bytes a token reads over "
          f"the read bandwidth measured just before each TPOT pair ({min(rates):.1f}-{max(rates):.1f} GB/s; the median floor "
          "shown); each side's / floor the median of its rounds' ratios")
    print("| weights | measure | deepinfer | llama.cpp | ratio | floor | deepinfer / floor | llama.cpp / floor |")
    print("|---|---|---|---|---|---|---|---|")
    for ours, (executor, _, summary) in sides.items():
        for measure in MEASURES:
            mine, theirs = (statistics.median(t) for t in times[ours, measure])
            floor = ours_to_floor = theirs_to_floor = ""
            if measure.startswith("TPOT"):
                read = token_bytes(executor, summary, measure)
                floors = [read / b / 1e6 for b in bandwidths[ours, measure]]  # ms at each measured GB/s
                floor = f"{statistics.median(floors):.3f}"
                ours_to_floor, theirs_to_floor = (f"{statistics.median(t / f for t, f in zip(side, floors)):.2f}"
                                                  for side in times[ours, measure])
            print(f"| {ours} / {PAIRS[ours][2]} | {measure} | {mine:.3f} | {theirs:.3f} | {mine / theirs:.2f} | {floor} | "
                  f"{ours_to_floor} | {theirs_to_floor} |", flush=True)
    if "int8" in formats and "float32" in formats:
        int8, f32 = (statistics.median(times[f, "TPOT 32"][0]) for f in ("int8", "float32"))
        print(f"\nint8 TPOT at 32 / our float32's: {int8 / f32:.2f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["tiny-v3-code", "190m"], choices=["tiny-v3-code", "190m"])
    parser.add_argument("--formats", nargs="+", default=list(PAIRS), choices=list(PAIRS), help="our weights, each against llama.cpp's at its width")
    parser.add_argument("--work", type=Path, default=Path.home() / ".cache" / "deepinfer-bench" / "cpu-decode")
    parser.add_argument("--llama-cpp", type=Path, default=Path.home() / ".cache" / "deepinfer-bench" / "llama.cpp")
    args = parser.parse_args()
    torch.set_num_threads(2)

    args.work.mkdir(parents=True, exist_ok=True)
    llama = LlamaCpp.build(args.llama_cpp)
    isa = " ".join(f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16") if f in Path("/proc/cpuinfo").read_text())
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, CPU flags: {isa}")
    for name in args.models:
        checkpoint = TINY if name == "tiny-v3-code" else random_checkpoint(args.work / "hf-190m")
        bench_model(name, checkpoint, llama, args.work, args.formats)


if __name__ == "__main__":
    main()
