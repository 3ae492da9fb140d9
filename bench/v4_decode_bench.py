"""DeepSeek-V4 decode speed, side by side on the same ~100M-parameter weights: the AOTInductor
bundle, our eager V4 and transformers' eager V4 (with its cache); then how the bundle's decode
time grows with kv.max_len (1K, 4K, 16K) at the same short context.

    .venv/bin/python bench/v4_decode_bench.py      # ~15 minutes cold on 2 cores (3 inductor bundles)

Batch 1, float32, context 32 + the steps timed. Paths take turns in rounds (decode_bench.py's
interleaved_median_ms), so a noisy stretch of this shared machine falls on all of them alike.
A fixed-shape graph pays for its whole pool: the indexer scores all max_len/m CSA entries and
attention reads all of them (masked) plus all max_len/m' HCA entries, whatever the context.
"""

import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

from deepinfer.compiler.build import compile_recipe
from deepinfer.compiler.recipe import load_recipe
from deepinfer.models import build_model
from deepinfer.runtime.executor import BundleExecutor
from deepinfer.runtime.step import Step

sys.path.insert(0, str(Path(__file__).parent))
from decode_bench import PROMPT_LEN, STEPS, decode_step, interleaved_median_ms  # noqa: E402

CSA, HCA, SLIDING = "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"
CONFIG = {  # ~100M parameters: every attention type, hash and top-k MoE layers, 4 mHC streams
    "vocab_size": 32000, "hidden_size": 768, "moe_intermediate_size": 512, "num_hidden_layers": 4,
    "num_attention_heads": 8, "head_dim": 128, "partial_rotary_factor": 0.25, "q_lora_rank": 384,
    "n_routed_experts": 8, "num_experts_per_tok": 2, "layer_types": [SLIDING, CSA, HCA, CSA],
    "mlp_layer_types": ["hash_moe", "hash_moe", "moe", "moe"], "compress_rates": {CSA: 4, HCA: 64},
    "sliding_window": 64, "o_groups": 4, "o_lora_rank": 128, "index_n_heads": 8, "index_head_dim": 64, "index_topk": 32,
    "hc_mult": 4, "max_position_embeddings": 16384,
}
MAX_LENS = (1024, 4096, 16384)


def save_hf_checkpoint(directory: Path):
    import transformers

    torch.manual_seed(0)
    model = transformers.DeepseekV4ForCausalLM(transformers.DeepseekV4Config(**CONFIG)).eval()
    model.config._attn_implementation = "eager"
    model.save_pretrained(directory)
    return model


def compile_bundle(work: Path, checkpoint: Path, max_len: int) -> Path:
    recipe = {"name": f"v4-{max_len}", "model": {"arch": "deepseek_v4", "checkpoint": str(checkpoint)}, "dtype": "float32",
              "methods": {"decode": {"buckets": [1]}, "prefill": {"buckets": [32]}}, "kv": {"max_seqs": 1, "max_len": max_len},
              "backend": {"name": "inductor"}, "output": str(work / f"v4-{max_len}")}
    path = work / f"v4-{max_len}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    start = time.perf_counter()
    bundle = compile_recipe(load_recipe(path), cache_dir=work / "cache", progress=False).bundle
    print(f"compiled max_len={max_len} in {time.perf_counter() - start:.0f} s", flush=True)
    return bundle


def prefill(run, prompt: list[int]):
    n = len(prompt)
    run(Step("prefill", torch.tensor(prompt), torch.arange(n), torch.zeros(n, dtype=torch.int64), torch.tensor([0]),
             torch.tensor([n - 1])))


def main():
    prompt = list(range(100, 100 + PROMPT_LEN))
    with tempfile.TemporaryDirectory(prefix="deepinfer-v4-bench-") as tmp:
        work = Path(tmp)
        hf = save_hf_checkpoint(work / "hf")
        params = sum(p.numel() for p in hf.parameters()) / 1e6
        bundles = {max_len: BundleExecutor(compile_bundle(work, work / "hf", max_len)) for max_len in MAX_LENS}
        for bundle in bundles.values():
            prefill(bundle.run, prompt)
        model = build_model("deepseek_v4", checkpoint=work / "hf")
        state = model.new_state(1, MAX_LENS[0])
        make = decode_step(0)
        with torch.inference_mode():
            prefill(lambda step: model.prefill(*step.inputs(), state), prompt)
            hf_cache = hf(torch.tensor([prompt]), use_cache=True).cache

            def hf_step(pos):
                nonlocal hf_cache
                hf_cache = hf(torch.tensor([[7]]), cache=hf_cache, use_cache=True, position_ids=torch.tensor([[pos]])).cache

            paths = {f"bundle_{n // 1024}k": (lambda pos, b=b: b.run(make(pos))) for n, b in bundles.items()}
            paths.update(our_eager=lambda pos: model.decode(*make(pos).inputs(), state), hf_eager=hf_step)
            ms = interleaved_median_ms(paths)
    print(f"\nDeepSeek-V4 decode, {params:.0f}M parameters, batch 1, float32, context {PROMPT_LEN}..{PROMPT_LEN + STEPS}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads; ms per token (median of {STEPS})")
    print(f"{'path':>12} {'ms/token':>9} {'vs bundle_1k':>13}")
    for name, value in ms.items():
        print(f"{name:>12} {value:9.2f} {value / ms['bundle_1k']:12.2f}x")


if __name__ == "__main__":
    main()
