"""A decode step's attention over its sequences' cached rows becomes deepinfer's one-pass kernel
(runtime/latent_attention.py): in an exported region, the graph

    rows   = index_select(cache, 0, slots)                        # [B, L, C]
    scores = matmul(queries, rows.mT).view(T, H, L) * scale       # queries [B, M, C]
    probs  = softmax(masked_fill(scores, ~visible[:, None, :], -inf), -1, float32).to(dtype)
    out    = matmul(probs.view(B, -1, L), rows[:, :, :values])     # [B, M, values]

(MLA's absorbed attention, models/deepseek_v3.py) becomes latent_attention(queries, cache, slots,
visible, scale, values), where each sequence has at most MOST_QUERIES query rows (a decode step's
heads; a prompt chunk's many rows stay products, which BLAS computes faster).

Why: the products read each layer's cached rows twice from memory and all of the context bucket's
rows; the kernel reads the rows a step sees, once. The 190M bench model's decode at 512 positions
(640-position bucket), old bundle / new side by side (bench/bundle_ab_bench.py, 2 threads of an
AMD EPYC Zen 4): int4 TPOT-512 0.91x (2.17 -> 1.98 ms), bfloat16 0.95x; at 32 positions 1.00x.

Applied to the exported region before inductor traces it, where the attention is still these few
ops (after its decompositions, the softmax is a dozen): only for AOTInductor, whose code calls the
kernel as a C function; the other backends compile the products.
"""

import torch

from deepinfer.runtime import latent_attention  # noqa: F401  (defines torch.ops.deepinfer.latent_attention)

aten = torch.ops.aten
# Query rows a sequence, at most: eager, 2 threads of an AMD EPYC, us, products and softmax / the
# kernel, one sequence of 1024 rows [576 wide, 512 values] (V3's MLA): 8 queries 394 / 229, 16
# 508 / 350, 32 756 / 639, 64 1096 / 1132, 128 1854 / 2249 (BLAS's GEMM keeps its rows in registers).
MOST_QUERIES = 32
# Multiply-adds an attention takes (over its context bucket's rows) from which the kernel takes it:
# below, inductor's loop fused with the ops around it costs no more than a call (the trained tiny
# V3's decode at 64 positions, 4 heads, with the kernel / without, side by side: 1.04x; again with
# the kernel's per-call costs cut by ~10 us, float32 1.01x, bfloat16 1.04x).
FROM_WORK = 1 << 17


def apply(program: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """The program with each such attention one kernel call (in place); as it was without any."""
    graph = program.graph
    found = [match for node in graph.nodes if (match := _attention(node)) is not None]
    for out, arguments, dead in found:
        with graph.inserting_before(out):
            fused = graph.call_function(torch.ops.deepinfer.latent_attention.default, arguments)
        fused.meta.update(out.meta)
        out.replace_all_uses_with(fused)
        for node in dead:  # (the graph's checks of what the removed ops computed go with them)
            for user in list(node.users):
                if user.target is aten._assert_tensor_metadata.default:
                    graph.erase_node(user)
    if found:
        graph.eliminate_dead_code()
        program.graph_module.recompile()
    return program


def _attention(out: torch.fx.Node):
    """(the output node, the kernel's arguments, the nodes it replaces) where `out` is the final
    product of such an attention, else None."""
    if not _is(out, aten.matmul.default):
        return None
    probs_view, values = out.args
    if not (_is(probs_view, aten.view.default) and _is(values, aten.slice.Tensor) and _is(probs := probs_view.args[0], aten.to.dtype)):
        return None
    rows, dim, start, width = (*values.args, None, None, None)[:4]
    softmax = probs.args[0]
    if not (_is(rows, aten.index_select.default) and rows.args[1] == 0 and dim in (2, -1) and start == 0 and isinstance(width, int)
            and _is(softmax, aten.softmax.int) and softmax.args[1] in (2, -1)):
        return None
    masked = softmax.args[0]
    if not (_is(masked, aten.masked_fill.Scalar) and masked.args[2] == float("-inf") and _is(scaled := masked.args[0], aten.mul.Tensor)
            and _is(hidden := masked.args[1], aten.bitwise_not.default) and _is(broadcast := hidden.args[0], aten.unsqueeze.default)
            and broadcast.args[1] == 1 and isinstance(scale := scaled.args[1], float)):
        return None
    scores_view = scaled.args[0]
    if not (_is(scores_view, aten.view.default) and _is(scores := scores_view.args[0], aten.matmul.default)
            and _is(keys := scores.args[1], aten.mT.default) and keys.args[0] is rows):
        return None
    queries, visible, cache, slots = scores.args[0], broadcast.args[0], *rows.args[::2]
    if not _kernel_takes(*(node.meta.get("val") for node in (queries, cache, visible, scores_view)), width):
        return None
    dead = [out, probs_view, probs, softmax, masked, scaled, hidden, broadcast, scores_view, scores, keys, values, rows]
    return out, (queries, cache, slots, visible, scale, width), dead


def _kernel_takes(q, cache, visible, scores, width: int) -> bool:
    """Whether the kernel computes the attention of queries q [B, M, C] over cache [S, L, C] seen
    through visible [T, L] (scores [T, H, L]) to the first `width` columns, and is worth its call."""
    if any(not isinstance(t, torch.Tensor) for t in (q, cache, visible, scores)) or (q.dim(), cache.dim(), visible.dim()) != (3, 3, 2):
        return False
    (B, M, C), L = q.shape, cache.shape[1]
    return (q.dtype in (torch.float32, torch.bfloat16) and cache.dtype == q.dtype and visible.dtype == torch.bool and q.device.type == "cpu"
            and M <= MOST_QUERIES and B * M * L * (C + width) >= FROM_WORK and tuple(visible.shape) == (scores.shape[0], L)
            and C % 8 == 0 and width % 8 == 0 and width <= C and cache.stride(2) == 1)


def _is(node, target) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target is target
