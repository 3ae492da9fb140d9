"""An inductor graph pass for CPU decode at 4-8 rows: x [M, K] @ W.T, with W [N, K] a contiguous
weight, becomes one batched matmul over blocks of BLOCK weight rows.

Why: from 4 rows on, the CPU BLAS (MKL sgemm) leaves the path it takes for 1-3 rows for one that
reads a big weight at about half the speed (eager torch alike): a memory-bound decode step of 4
rows costs about twice one of 2. Cut into blocks of 64 weight rows, each block's product stays on the fast path
(bench/mm_decomposition_bench.py, 96 MB of weights: 4 rows 5.98 -> 4.01 ms, 8 rows 8.92 -> 4.97 ms,
against 3.11 ms for one row). Up to 3 rows the plain call is already fast, and from 16 rows on it
is faster than blocks: those are left as they are. Weights are region inputs, so this is a view
and a strided batched matmul, never a copy of the weight.
"""

import torch
from torch._inductor.pattern_matcher import Arg, CallFunction, PatternMatcherPass, register_graph_pattern

aten = torch.ops.aten
ROWS = range(4, 9)
BLOCK = 64

patterns = PatternMatcherPass(pass_name="deepinfer_blocked_matmul")


def blocked(x, weight_t):
    """x [M, K] @ weight_t [K, N], where weight_t is the transpose of a contiguous [N, K]."""
    M, K = x.shape
    N = weight_t.shape[1]
    blocks = weight_t.t().view(N // BLOCK, BLOCK, K)  # a view: no copy of the weight
    y = torch.bmm(x.expand(N // BLOCK, M, K), blocks.transpose(1, 2))  # [N/BLOCK, M, BLOCK]
    return y.transpose(0, 1).reshape(M, N)


def blocked_batch_of_one(x, weight_t):
    """The same for x [1, M, K] @ weight_t [1, K, N] (an einsum without batch dimensions)."""
    return blocked(x[0], weight_t[0]).unsqueeze(0)


def weight_product(x: torch.fx.Node, weight_t: torch.fx.Node, batched: bool = False):
    """(x, weight_t)'s values as [M, K] and [K, N] for a CPU product of static shape whose matrix is
    the transpose of a contiguous [N, K] weight (`batched`: a bmm of a batch of one); else None.
    (few_row_products.py asks it too.)"""
    x, w = x.meta.get("val"), weight_t.meta.get("val")
    if x is None or w is None or x.device.type != "cpu" or w.device.type != "cpu":
        return None
    dims = 3 if batched else 2
    if x.dim() != dims or w.dim() != dims or not all(isinstance(s, int) for s in (*x.shape, *w.shape)):
        return None
    if batched:
        if x.shape[0] != 1 or w.shape[0] != 1:
            return None
        x, w = x[0], w[0]
    return (x, w) if tuple(w.stride()) == (1, w.shape[0]) else None


def applies(x: torch.fx.Node, weight_t: torch.fx.Node, batched: bool = False) -> bool:
    values = weight_product(x, weight_t, batched)
    return values is not None and values[0].shape[0] in ROWS and values[1].shape[1] % BLOCK == 0


@register_graph_pattern(CallFunction(aten.mm, Arg(), Arg()), pass_dict=patterns)
def _mm(match, x, weight_t):
    if applies(x, weight_t):
        match.replace_by_example(blocked, [x, weight_t])


@register_graph_pattern(CallFunction(aten.addmm, Arg(), Arg(), Arg()), pass_dict=patterns)
def _addmm(match, bias, x, weight_t):
    if applies(x, weight_t):
        match.replace_by_example(lambda bias, x, weight_t: blocked(x, weight_t) + bias, [bias, x, weight_t])


def plain_batch_of_one(x, weight_t):
    """x [1, M, K] @ weight_t [1, K, N] as one matrix product (a BLAS call)."""
    return torch.mm(x[0], weight_t[0]).unsqueeze(0)


def several_rows_batch_of_one(x: torch.fx.Node, weight_t: torch.fx.Node) -> bool:
    x, w = x.meta.get("val"), weight_t.meta.get("val")
    return (x is not None and w is not None and x.device.type == "cpu" and x.dim() == 3 and w.dim() == 3
            and x.shape[0] == 1 and w.shape[0] == 1 and isinstance(x.shape[1], int) and x.shape[1] > 1)


@register_graph_pattern(CallFunction(aten.bmm, Arg(), Arg()), pass_dict=patterns)
def _bmm(match, x, weight_t):
    if applies(x, weight_t, batched=True):
        match.replace_by_example(blocked_batch_of_one, [x, weight_t])
    elif several_rows_batch_of_one(x, weight_t):
        # inductor's mm decomposition takes every batch-of-one bmm for a one-row product and
        # turns it into a reduction that re-reads the weight once per row: 16 rows of the dense
        # MoE form over 64 experts took 56 ms that way, against ~8 ms for the BLAS call.
        match.replace_by_example(plain_batch_of_one, [x, weight_t])
