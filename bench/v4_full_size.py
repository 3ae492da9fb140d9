"""Full-size DeepSeek-V4 (Flash and Pro) traced on fake weights: what a real deployment compiles.

    .venv/bin/python bench/v4_full_size.py            # both models, ~2 minutes on 2 cores
    .venv/bin/python bench/v4_full_size.py flash

Prints, per model: trace time and peak memory (in a fresh process each), unique regions and
schedule steps, state bytes per sequence slot at 64K and 1M context (bf16 entries and rings),
and weight bytes per rank at 64 ranks (ep 64, bf16). No weights are ever materialized.
"""

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

CSA, HCA, SLIDING = "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"
YARN = {"rope_type": "yarn", "factor": 16, "original_max_position_embeddings": 65536, "beta_fast": 32, "beta_slow": 1}
COMMON = dict(vocab_size=129280, head_dim=512, partial_rotary_factor=64 / 512, num_experts_per_tok=6, scoring_func="sqrtsoftplus",
              routed_scaling_factor=1.5, swiglu_limit=10.0, sliding_window=128, index_n_heads=64, index_head_dim=128,
              hc_mult=4, hc_sinkhorn_iters=20, rope_theta=10000.0, compress_rope_theta=160000.0, rope_parameters=YARN,
              max_position_embeddings=1048576, compress_rates={CSA: 4, HCA: 128})
MODELS = {
    # 43 layers: 2 sliding, then CSA / HCA alternating; 3 hash-routed MoE layers.
    "flash": dict(COMMON, hidden_size=4096, num_hidden_layers=43, num_attention_heads=64, q_lora_rank=1024, o_groups=8,
                  o_lora_rank=1024, n_routed_experts=256, moe_intermediate_size=2048, index_topk=512,
                  layer_types=[SLIDING] * 2 + [CSA if i % 2 == 0 else HCA for i in range(41)], num_hash_layers=3),
    # 61 layers: 2 HCA, then CSA / HCA alternating (transformers' default schedule).
    "pro": dict(COMMON, hidden_size=7168, num_hidden_layers=61, num_attention_heads=128, q_lora_rank=1536, o_groups=16,
                o_lora_rank=1024, n_routed_experts=384, moe_intermediate_size=3072, index_topk=1024, num_hash_layers=3),
}

TRACE = """
import json, resource, sys, time
from deepinfer.compiler.plan import plan
from deepinfer.compiler.recipe import load_recipe
start = time.perf_counter()
p = plan(load_recipe(sys.argv[1]))
print(json.dumps({"trace_s": round(time.perf_counter() - start, 1),
                  "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
                  "unique_regions": len(p.regions), "steps": {k: len(v.steps) for k, v in p.programs.items()}}))
"""


def sizes(config: dict) -> dict:
    """State bytes per slot and weight bytes per rank, from shapes only (fake tensors, real dtypes)."""
    from deepinfer.models import build_model
    from deepinfer.models.parallel import Layout

    out = {}
    for label, max_len in (("state_per_slot_64k_mib", 1 << 16), ("state_per_slot_1m_mib", 1 << 20)):
        model = build_model("deepseek_v4", config=config, dtype="bfloat16", device="fake")
        per_slot = sum(_numel(s.shape[1:]) * s.dtype.itemsize for layer in model.state_specs(1, max_len) for s in layer)
        out[label] = round(per_slot / 2**20, 1)
    rank0 = build_model("deepseek_v4", config=config, dtype="bfloat16", device="fake", layout=Layout(64, 1, 64))
    out["weights_per_rank_gib_at_ep64"] = round(sum(p.numel() * p.dtype.itemsize for p in rank0.parameters()) / 2**30, 2)
    full = build_model("deepseek_v4", config=config, dtype="bfloat16", device="fake")
    out["weights_total_gib"] = round(sum(p.numel() * p.dtype.itemsize for p in full.parameters()) / 2**30, 1)
    return out


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def trace(name: str, config: dict, work: Path) -> dict:
    recipe = {"name": f"v4-{name}", "model": {"arch": "deepseek_v4", "config": config}, "dtype": "bfloat16",
              "methods": {"decode": {"buckets": [8]}, "prefill": {"buckets": [512]}}, "kv": {"max_seqs": 8, "max_len": 65536},
              "backend": {"name": "export"}, "output": str(work / name)}
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    run = subprocess.run([sys.executable, "-c", TRACE, str(path)], capture_output=True, text=True, timeout=1800)
    if run.returncode:
        raise SystemExit(run.stderr[-3000:])
    return json.loads(run.stdout.splitlines()[-1])


def main():
    names = sys.argv[1:] or list(MODELS)
    with tempfile.TemporaryDirectory() as work:
        for name in names:
            report = {**trace(name, MODELS[name], Path(work)), **sizes(MODELS[name])}
            print(f"V4-{name}: {json.dumps(report)}")


if __name__ == "__main__":
    main()
