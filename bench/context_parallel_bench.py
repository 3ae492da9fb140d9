"""Context parallelism at world size 2: cp 2 (the two ranks split a prompt's rows and the state's
positions) against cp 1 (both ranks compute every row and hold every position), the same model,
backend and ranks, runs alternated and each rank on one thread:

- TTFT of a 2048-token prompt (4 chunks of 512): cp 2 / cp 1;
- decode at a 16K context (--context): state bytes a rank (from the manifests) and TPOT, cp 2 / cp 1.

    .venv/bin/python bench/context_parallel_bench.py                 # DeepSeek-V3, one round: ~8 minutes here (V4: ~12)
    .venv/bin/python bench/context_parallel_bench.py --arch deepseek_v4 --rounds 3
    .venv/bin/python bench/context_parallel_bench.py --arch deepseek_v4 --context 32768   # its prefill: several times longer

The models are random, small enough for 2 cores and wide enough in attention that a long prompt
is mostly attention, as at full size (their MoE experts are split over both ranks in either
layout): a DeepSeek-V3, and a DeepSeek-V4 with V4's own compress rates (4 and 128), window (128),
index heads (64 of 128, top-512) and mHC streams (4).
"""

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from deepinfer.compiler.build import compile_recipe
from deepinfer.compiler.recipe import load_recipe

CONFIGS = {}
CONFIGS["deepseek_v3"] = {"vocab_size": 1024, "hidden_size": 512, "intermediate_size": 1024, "moe_intermediate_size": 256,
          "num_hidden_layers": 4, "num_attention_heads": 8, "n_shared_experts": 1, "n_routed_experts": 8,
          "kv_lora_rank": 256, "q_lora_rank": 256, "qk_rope_head_dim": 32, "v_head_dim": 64, "qk_nope_head_dim": 64,
          "n_group": 4, "topk_group": 2, "num_experts_per_tok": 2, "first_k_dense_replace": 1}
CONFIGS["deepseek_v4"] = {"vocab_size": 1024, "hidden_size": 512, "moe_intermediate_size": 256, "num_hidden_layers": 4,
          "num_attention_heads": 16, "head_dim": 256, "partial_rotary_factor": 0.125, "q_lora_rank": 256,
          "n_routed_experts": 8, "num_experts_per_tok": 2,
          "layer_types": ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                          "compressed_sparse_attention"], "mlp_layer_types": ["hash_moe", "hash_moe", "moe", "moe"],
          "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}, "sliding_window": 128,
          "o_groups": 8, "o_lora_rank": 128, "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512, "hc_mult": 4}
PROMPT = 2048


def write_recipe(work: Path, arch: str, backend: str, cp: int, context: int = 16384) -> Path:
    contexts = [2048 << i for i in range((context // 2048).bit_length())]  # 2048 .. context
    recipe = {"name": f"cp{cp}", "model": {"arch": arch, "config": {**CONFIGS[arch], "max_position_embeddings": context}, "seed": 0}, "dtype": "float32",
              "parallel": {"world_size": 2, "tp": 1, "ep": 2, "cp": cp},
              "methods": {"decode": {"buckets": [1], "context": contexts}, "prefill": {"buckets": [512], "context": list(contexts)}},  # (two lists: no YAML alias)
              "kv": {"max_seqs": 1, "max_len": context}, "backend": {"name": backend}, "output": str(work / f"cp{cp}")}
    path = work / f"cp{cp}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def state_bytes_per_rank(bundle: Path) -> int:
    """Bytes of one sequence slot's state on a rank, from the manifest's state specs."""
    manifest = json.loads((bundle / "manifest.json").read_text())
    sizes = {"float32": 4, "bfloat16": 2}
    return sum(math.prod(t["shape"][1:]) * sizes[t["dtype"]] for layer in manifest["state"] for t in layer)


def timing(bundle: Path, prompt_tokens: int, max_tokens: int) -> dict:
    prompt = ",".join(str(3 + i % 1000) for i in range(prompt_tokens))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-m", "deepinfer.runtime.cli", "--bundle", str(bundle), "--prompt-ids", prompt,
                          "--max-tokens", str(max_tokens), "--json"], capture_output=True, text=True, env=env, timeout=3600)
    if run.returncode != 0:
        raise SystemExit(f"deepinfer-run {bundle} failed:\n{run.stderr[-3000:]}")
    result = json.loads(run.stdout.strip().splitlines()[-1])
    return {**result["timing"], "tokens": result["results"][0]["token_ids"]}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=1, help="alternated runs of each layout (medians reported)")
    parser.add_argument("--arch", choices=sorted(CONFIGS), default="deepseek_v3")
    parser.add_argument("--backend", choices=["inductor", "export"], default="inductor",
                        help="inductor: the CPU deployment's code; export: eager kernels, a fast compile, but "
                             "decode is then mostly the host's cost of dispatching each op")
    parser.add_argument("--context", type=int, default=16384, choices=[16384, 32768, 65536],
                        help="the decode context (a power of 2; the prompt prefilled to reach it takes most of the time)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="deepinfer-cp-bench-") as tmp:
        work = Path(tmp)
        bundles = {cp: compile_recipe(load_recipe(write_recipe(work, args.arch, args.backend, cp, args.context)), cache_dir=work / "cache", progress=False).bundle
                   for cp in (1, 2)}
        ttft, tpot, tokens = {1: [], 2: []}, {1: [], 2: []}, {1: set(), 2: set()}
        for _ in range(args.rounds):
            for cp in (1, 2):
                short = timing(bundles[cp], PROMPT, 2)
                ttft[cp].append(short["ttft"])
                long = timing(bundles[cp], args.context - 32, 17)  # (room for its tokens)
                tpot[cp].append(long["tpot"])
                tokens[cp].add((tuple(short["tokens"]), tuple(long["tokens"])))
        state = {cp: state_bytes_per_rank(bundles[cp]) for cp in (1, 2)}
    median = {name: {cp: statistics.median(v[cp]) for cp in (1, 2)} for name, v in (("ttft", ttft), ("tpot", tpot))}
    model = {"deepseek_v3": "DeepSeek-V3 (random, hidden 512, 8 heads, kv_lora 256, 4 layers)",
             "deepseek_v4": "DeepSeek-V4 (random, hidden 512, 16 heads of 256, sliding + CSA 4 + HCA 128 + CSA, window 128, "
                            "top-512 of 64 index heads of 128 as released, 4 mHC streams)"}[args.arch]
    print(f"\n{model}, float32, {args.backend} backend, world size 2 "
          f"(tp 1, ep 2), each rank 1 thread, {args.rounds} alternated rounds, medians; {os.cpu_count()} cores")
    print(f"  {'':34s} {'cp 1':>10s} {'cp 2':>10s} {'cp 2 / cp 1':>12s}")
    print(f"  {f'TTFT, {PROMPT}-token prompt (s)':34s} {median['ttft'][1]:10.3f} {median['ttft'][2]:10.3f} "
          f"{median['ttft'][2] / median['ttft'][1]:12.2f}")
    print(f"  {'state a rank, one slot (MiB)':34s} {state[1] / 2**20:10.1f} {state[2] / 2**20:10.1f} {state[2] / state[1]:12.2f}")
    print(f"  {f'TPOT at a {args.context - 32}-token context (ms)':34s} {median['tpot'][1] * 1e3:10.1f} {median['tpot'][2] * 1e3:10.1f} "
          f"{median['tpot'][2] / median['tpot'][1]:12.2f}")
    same = tokens[1] == tokens[2] and len(tokens[1]) == 1
    print(f"  greedy tokens of cp 2 equal cp 1's: {'yes' if same else 'NO'}")


if __name__ == "__main__":
    main()
