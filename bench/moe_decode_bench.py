"""Routed experts at decode batches: the gathered form against the dense form, where models/moe.py
switches between them.

    .venv/bin/python bench/moe_decode_bench.py     # ~3 minutes

One MoE layer's routed experts, each form compiled as the inductor backend compiles a region (its
graph passes and options), microseconds a call by rows N, for three expert shapes: the serve
bench's V4 (8 experts top-2 of 512), the ~100M V3 (16 top-4 of 512) and 64 top-4 of 256. Decode
is bound by reading weights, so the calls cycle through copies of the weights (~600 MB in all,
more than this host's caches) and random routing: every call reads its experts from memory, as a
step of a real model does. Gathering reads one expert per (row, expert) pair; the dense form
reads every expert once and multiplies all N rows by it.
"""

import argparse
import statistics
import time

import torch
import torch._inductor.config
import torch.nn.functional as F

from deepinfer.compiler.backends import inductor
from deepinfer.models.moe import dense, gathered

SHAPES = {"v4 8x2": (8, 2, 512), "v3 16x4": (16, 4, 512), "v3 64x4": (64, 4, 256)}  # E, k, I
HIDDEN = 768
PAIRS_PER_EXPERT = (0.5, 1.0, 1.5, 2.0)  # N * k / E
WEIGHT_BYTES, CASES, CALLS, ROUNDS = 600e6, 32, 64, 6


def swiglu(gate, up):
    return F.silu(gate) * up


FORMS = {
    "gathered": lambda x, weights, ids, w_gate_up, w_down: gathered(x, weights, ids, lambda i: w_gate_up[i],
                                                                    lambda i: w_down[i], swiglu),
    "dense": lambda x, weights, ids, w_gate_up, w_down: dense(x, weights, ids, w_gate_up, w_down, swiglu),
}


def forms_us(E: int, k: int, I: int, rows: int) -> dict[str, float]:
    copies = max(2, int(WEIGHT_BYTES // (E * 3 * I * HIDDEN * 4)))
    weights = [(torch.randn(E, 2 * I, HIDDEN) * 0.02, torch.randn(E, HIDDEN, I) * 0.02) for _ in range(copies)]
    g = torch.Generator().manual_seed(rows)
    cases = [(torch.randn(rows, HIDDEN, generator=g), torch.rand(rows, k, generator=g),
              torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(rows)])) for _ in range(CASES)]
    torch._dynamo.reset()
    with torch._inductor.config.patch(post_grad_custom_pre_pass=inductor.graph_passes(),
                                      post_grad_fusion_options=inductor.DEFAULTS["post_grad_fusion_options"]):
        compiled = {name: torch.compile(fn, dynamic=False) for name, fn in FORMS.items()}
        for fn in compiled.values():
            torch.testing.assert_close(fn(*cases[0], *weights[0]), FORMS["dense"](*cases[0], *weights[0]), atol=1e-4, rtol=1e-4)
        times = {name: [] for name in FORMS}
        for _ in range(ROUNDS):  # the forms take turns, so a noisy stretch falls on both
            for name, fn in compiled.items():
                start = time.perf_counter()
                for i in range(CALLS):
                    fn(*cases[i % CASES], *weights[i % copies])
                times[name].append((time.perf_counter() - start) / CALLS * 1e6)
    return {name: statistics.median(t) for name, t in times.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    args = parser.parse_args()
    print(f"routed experts at decode batches, float32, inductor backend, weights cold, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; us per layer")
    print(f"{'experts':>8} {'rows':>5} {'pairs/E':>8} {'gathered':>9} {'dense':>9} {'dense/gathered':>15}")
    for name in args.shapes:
        E, k, I = SHAPES[name]
        for share in PAIRS_PER_EXPERT:
            rows = int(share * E / k)
            us = forms_us(E, k, I, rows)
            print(f"{name:>8} {rows:5d} {share:8.1f} {us['gathered']:9.0f} {us['dense']:9.0f} {us['dense'] / us['gathered']:14.2f}x",
                  flush=True)


if __name__ == "__main__":
    main()
