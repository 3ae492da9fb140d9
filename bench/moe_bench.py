"""Routed experts at prompt sizes: exact and grouped (routed-only) against every expert on every token.

    .venv/bin/python bench/moe_bench.py                # both configs (~10 min cold)
    .venv/bin/python bench/moe_bench.py --configs 64x4

Two measurements per config (context_bench's ~100M config, 16 experts top-4, and 64 experts top-4;
weights as transformers initializes them, whose routing is as even as a trained DeepSeek's aims
to be):
1. The four forms of models/moe.py on one MoE layer, eager (the same BLAS calls AOTInductor
   makes for them), ms by rows N: where each form starts to win (models/moe.py's switch points).
2. Prefill tokens/s of one 512-token prompt through AOTInductor bundles that differ only in the
   prompt experts' form: exact (model.expert_overflow: exact, the default), grouped at
   model.expert_capacity 2 (branch: further passes where an expert is routed past its capacity)
   and 1024 (C >= N: the dense form), and transformers eager on the same weights; plus the
   grouped passes each MoE layer ran.
All timings in one process, the paths taking turns in rounds.
"""

import argparse
import tempfile
from pathlib import Path

import torch
import yaml

from context_bench import CONFIGS, take_turns
from decode_bench import save_hf_checkpoint
from deepinfer.compiler.build import compile_recipe
from deepinfer.compiler.recipe import load_recipe
from deepinfer.models import build_model
from deepinfer.models.deepseek_v3 import swiglu
from deepinfer.models.moe import dense, exact, expert_capacity, expert_places, gathered, grouped, grouped_passes
from deepinfer.models.quantization import expert_weights
from deepinfer.runtime.executor import BundleExecutor
from deepinfer.runtime.step import Step

PROMPT = 512
ROWS = [1, 2, 4, 8, 16, 32, 64, 128, 512]


def forms_ms(moe, hidden: int) -> dict[int, dict[str, float]]:
    """ms of each form on N rows routed by the layer's own router (no overflow: grouped at the
    capacity that holds the step's busiest expert)."""
    gate_up = expert_weights(moe, "experts_gate_up", torch.float32, None)
    down = expert_weights(moe, "experts_down", torch.float32, None)
    E = moe.n_local_experts
    table = {}
    for n in ROWS:
        x = torch.randn(n, hidden, generator=torch.Generator().manual_seed(n))
        weights, ids = moe.gate(x)
        owned = torch.ones_like(ids, dtype=torch.bool)
        expert, place = expert_places(ids, owned, E)
        busiest = int(place.max()) + 1
        table[n] = take_turns({
            "gathered": lambda: gathered(x, weights, ids, gate_up, down, swiglu),
            "exact": lambda: exact(x, weights, ids, owned, gate_up(), down(), swiglu),
            "grouped": lambda: grouped(x, weights, expert, place, 0, busiest, gate_up(), down(), swiglu),
            "dense": lambda: dense(x, weights, ids, gate_up(), down(), swiglu),
        }, repeat=3)
        table[n]["C / N"] = busiest / n
    return table


FORMS = {"exact": {"expert_overflow": "exact"}, "grouped": {"expert_overflow": "branch", "expert_capacity": 2.0},
         "dense": {"expert_overflow": "branch", "expert_capacity": 1024.0}}  # the bundles' recipe keys


def write_recipe(work: Path, checkpoint: Path, name: str, form: dict) -> Path:
    recipe = {"name": name, "model": {"checkpoint": str(checkpoint), **form}, "dtype": "float32",
              "methods": {"decode": {"buckets": [1]}, "prefill": {"buckets": [PROMPT]}}, "kv": {"max_seqs": 1, "max_len": 1024},
              "backend": {"name": "inductor"}, "output": str(work / "bundles" / name)}
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def grouped_passes_run(model, tokens: torch.Tensor, capacity: float) -> list[int]:
    """Per MoE layer, the grouped passes the eager model's prefill of `tokens` runs at `capacity`."""
    runs = []

    def count(moe, args):
        _, ids = moe.gate(args[0])
        _, place = expert_places(ids, torch.ones_like(ids, dtype=torch.bool), moe.n_local_experts)
        C = expert_capacity(ids.shape[0], ids.shape[1], moe.config.n_routed_experts, capacity)
        runs.append(sum(1 for start, _ in grouped_passes(C, ids.shape[0]) if start <= int(place.max())))

    moes = [layer.mlp for layer in model.layers if layer.kind == "moe"]
    handles = [m.register_forward_pre_hook(count) for m in moes]
    T = tokens.shape[0]
    with torch.inference_mode():
        model.prefill(tokens, torch.arange(T), torch.zeros(T, dtype=torch.long), torch.tensor([0]), torch.tensor([T - 1]),
                      model.new_state(1, 1024))
    for handle in handles:
        handle.remove()
    return runs


def bench_config(name: str, config: dict, work: Path, jobs: int) -> dict:
    checkpoint = work / f"{name}-hf"
    hf = save_hf_checkpoint({**config, "max_position_embeddings": 1024}, checkpoint)
    model = build_model(checkpoint=checkpoint)
    with torch.inference_mode():
        forms = forms_ms(model.layers[1].mlp, config["hidden_size"])
    cache = work / f"cache-{name}"
    executors = {}
    for label, form in FORMS.items():
        recipe = load_recipe(write_recipe(work, checkpoint, f"{name}-{label}", form))
        executors[label] = BundleExecutor(compile_recipe(recipe, jobs=jobs, cache_dir=cache, progress=False).bundle)
    tokens = torch.randint(0, config["vocab_size"], (PROMPT,), generator=torch.Generator().manual_seed(0))
    step = Step("prefill", tokens, torch.arange(PROMPT), torch.zeros(PROMPT, dtype=torch.long), torch.tensor([0]),
                torch.tensor([PROMPT - 1]))
    with torch.inference_mode():
        ms = take_turns({**{label: (lambda e=e: e.run(step)) for label, e in executors.items()},
                         "hf_eager": lambda: hf(tokens[None])}, repeat=2)
    return {"forms": forms, "tokens_per_s": {k: PROMPT / v * 1e3 for k, v in ms.items()},
            "passes": grouped_passes_run(model, tokens, 2.0)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="deepinfer-bench-") as tmp:
        rows = {name: bench_config(name, CONFIGS[name], Path(tmp), args.jobs) for name in args.configs}
    print(f"\nfloat32, torch {torch.__version__}, {torch.get_num_threads()} threads")
    for name, row in rows.items():
        c = CONFIGS[name]
        print(f"\n{name} ({c['n_routed_experts']} experts, top-{c['num_experts_per_tok']}): one MoE layer's routed experts, "
              "ms (eager) by rows")
        print(f"{'rows':>5} {'gathered':>9} {'exact':>9} {'grouped':>9} {'dense':>9} {'C/N':>6}")
        for n, f in row["forms"].items():
            print(f"{n:5d} {f['gathered']:9.3f} {f['exact']:9.3f} {f['grouped']:9.3f} {f['dense']:9.3f} {f['C / N']:6.2f}")
        t = row["tokens_per_s"]
        print(f"prefill of {PROMPT} tokens, tokens/s: exact {t['exact']:.0f}, grouped {t['grouped']:.0f}, dense {t['dense']:.0f}, "
              f"transformers eager {t['hf_eager']:.0f}; grouped / dense = {t['grouped'] / t['dense']:.2f}x (target >= 4x "
              f"on 64x4), grouped / transformers = {t['grouped'] / t['hf_eager']:.2f}x; grouped passes per MoE layer at "
              f"capacity 2: {row['passes']}")


if __name__ == "__main__":
    main()
