"""Inductor graph passes for matrix products of bfloat16 tensors: computed in float32 from the bf16
operands, the result rounded to bf16 once (as a native bf16 GEMM rounds: accumulated in float32,
stored bf16). What is stored -- weights, activations between ops, the KV pool -- stays bf16. (And
float32's few-row products over small matrices: reductions, as bf16's below.)

`chunk_patterns`, for CPUs without native bf16 math (AVX2; AVX-512 without AVX512_BF16/AMX): a
product of several rows is a BLAS call on float32 copies of its operands, a piece of the matrix
at a time where its copy would pass PIECE_BYTES. Emulated, every bf16 GEMM runs ~9x slower than
in float32 (held to AVX2: a 256x2048 @ 2048x2048 linear 68.6 ms bf16, 7.7 ms f32); the copies
cost ~3% of the f32 GEMM at 256 rows.

`small_chunk_patterns`, for CPUs with native bf16 math: the same for a product of several rows
whose matrix is small (SMALL_MATRIX elements an entry: a tiny model's linears, the heads over a
short KV cache). oneDNN's bf16 GEMM costs ~20 us a call at any small size (an Intel Xeon with
AMX, 32 rows: [96, 192] 19 us, [512, 192] 24), MKL's float32 one 8-9 us with its copies: the
tiny V3's 32-token prompt 3.19 -> 2.30 ms side by side (bench/bundle_ab_bench.py), the 190M's
1.03x / decode 0.96x (its linears are bigger; noise).

`reduction_patterns`, on every CPU: a one-row product (decode; MLA's per-head absorbed einsums;
those with a stored weight are few_row_products.py's, which runs first) is a multiply-reduce,
which inductor compiles to one kernel reading the bf16 weight as stored, two bytes an element, with the row converted to float32 once into a buffer of its own. (inductor's
own mm decomposition makes the same reduction, but inlines what computes the row -- a norm, its
rounding to bf16 -- into it, to run again for every weight row.) So is a product of up to
FEW_ROWS rows whose reads, the matrix once a row, stay within FEW_ROWS_READ_BYTES (a decode step's
heads over a short KV cache): the matrix stays in the core's cache, and the reduction spares the
BLAS call's fixed cost (~25 us for a bf16 GEMM of any small size here) and packing (native bf16)
or float32 copy (AVX2). On an AMD EPYC (Zen 4), 4 heads over a 512-position cache: 14-20 us a
product as a reduction, 33-73 us as a bf16 GEMM, 26-69 us in float32; at 4 rows and a 1 MiB
matrix the reduction lost (162 against 70 us); ~12M model's bf16/f32 TPOT 1.03 -> 0.70 (native
bf16), 0.82 -> 0.70 (held to AVX2). The 190M's 8 heads over its latent cache (MLA: one matrix for
all heads) were 3 GEMMs a layer, ~0.5 ms of a 5-6 ms bf16 decode step (profiled) at 4 rows at most.
float32 products of 2 to FEW_ROWS rows within the same reads are reductions too (one row is
inductor's own decomposition; a stored weight's few rows are few_row_products.py's first):
MKL's float32 GEMM costs ~5 us a call at these sizes (the trained tiny V3's 4 heads, 12 calls a
decode step: 64 us of ~0.5 ms, profiled). Side by side on an Intel
Xeon (bench/bundle_ab_bench.py): tiny V3 TPOT-32 0.91-0.92x, the 190M's 0.93x (TTFT-32 0.96x).

Element-wise ops, norms and softmax need nothing: inductor computes them in float32 registers
from bf16 loads.
"""

import torch
from torch._inductor.pattern_matcher import Arg, CallFunction, PatternMatcherPass, register_graph_pattern

aten = torch.ops.aten
BF16 = torch.bfloat16

reduction_patterns = PatternMatcherPass(pass_name="deepinfer_float32_reduced_products")
chunk_patterns = PatternMatcherPass(pass_name="deepinfer_float32_chunk_products")
small_chunk_patterns = PatternMatcherPass(pass_name="deepinfer_float32_small_chunk_products")


def _cpu_values_of(dtype, nodes) -> bool:
    values = [n.meta.get("val") for n in nodes]
    return all(v is not None and v.dtype == dtype and v.device.type == "cpu" for v in values)


def _bf16(*nodes: torch.fx.Node) -> bool:
    return _cpu_values_of(BF16, nodes)


def _float32(*nodes: torch.fx.Node) -> bool:
    return _cpu_values_of(torch.float32, nodes)


def _rows(match) -> int:
    return match.args[-2].meta["val"].shape[-2]  # (the row operand is the one before the matrix)


FEW_ROWS, FEW_ROWS_READ_BYTES = 16, 2 << 20  # reductions up to these (rows x the bf16 matrix's bytes); past them BLAS


def _as_reduction(match) -> bool:
    """One row; or a few rows over a matrix small enough to stay in the core's cache while the
    reduction reads it once a row (the heads' products over a short KV cache)."""
    matrix = match.args[-1].meta["val"]
    rows = _rows(match)
    return rows == 1 or (rows <= FEW_ROWS and rows * matrix.shape[-2] * matrix.shape[-1] * matrix.element_size() <= FEW_ROWS_READ_BYTES)


# At most this much float32 copy of a matrix at a time (product). 8 MiB rather than 4: pieces of
# two ~100M experts (3 MiB each) a BLAS call, not one. On the shared EPYC, one BLAS call per expert
# ran 1.4-1.7x slower in stretches of tens of seconds (one bmm over them all did not: the calls'
# own cost); held to AVX2, ~100M 256-token prefill, bf16/f32 alternating in one process: 4 MiB
# 0.99-1.04, in those stretches 1.36-1.43; 8 MiB 1.04-1.06, in them 1.07-1.20.
PIECE_BYTES = 8 << 20


# Products with matrices (an entry of a batched one) of at most this many elements are computed in
# float32 on CPUs with native bf16 math too (small_chunk_patterns).
SMALL_MATRIX = 1 << 16


def _small(match) -> bool:
    matrix = match.args[-1].meta["val"]
    return matrix.shape[-2] * matrix.shape[-1] <= SMALL_MATRIX


def float32_copy(matrix):
    """`matrix` in float32, its elements in the order they are stored: a weight's transpose
    ([K, N] of a [N, K] weight) is converted as the weight and viewed transposed again (BLAS
    takes either), not written out transposed -- a strided convert ~3x slower."""
    if matrix.dim() >= 2 and matrix.stride(-2) == 1 and matrix.stride(-1) != 1:
        return matrix.transpose(-1, -2).float().transpose(-1, -2)
    return matrix.float()


def product(op, batch_step: int, along: str | None = None, step: int = 0):
    """op (mm, bmm, addmm, baddbmm) of bf16 operands as BLAS calls on float32 copies of them, the
    result rounded to bf16 once. Where the matrix's float32 copy would pass PIECE_BYTES, a piece
    of it at a time, each piece's copy made just before its BLAS call: `batch_step` entries of a
    batched matrix (bmm, baddbmm: grouped experts, heads), and within an entry too big alone,
    `step` of its columns (`along` "columns") or of its inner dimension ("inner": the pieces'
    products summed in float32, then rounded once). The copies stay small: in cache, in memory
    malloc reuses. One float32 copy of a whole matrix -- every expert's weights of an MoE layer,
    50 MB at ~100M; the KV cache a decode step's heads attend over -- is written to fresh pages
    each call. Held to AVX2, ~100M, bf16/f32 (bench/bf16_bench.py): 256-token TTFT 1.23-1.51
    -> 1.02 (the MoE prefill had taken 1.48x float32's time), TPOT at 8000 positions of an
    8192-position cache 1.07 -> 0.78."""
    def computed_in_float32(*args):
        *bias, x, matrix = args
        batched = matrix.dim() == 3
        entries = matrix.shape[0] if batched else 1
        K, N = matrix.shape[-2:]

        def piece(t, first):  # t's entries [first, first + batch_step) (a broadcast t whole)
            return t[first:first + batch_step] if batched and t.dim() == 3 and t.shape[0] == entries else t

        outs = []
        for first in range(0, entries, batch_step):
            x32, m, b = piece(x, first).float(), piece(matrix, first), [piece(t, first).float() for t in bias]
            if along == "columns":
                y = torch.cat([op(*(t[..., c:c + step] if t.shape[-1] == N else t for t in b), x32, float32_copy(m[..., c:c + step]))
                               for c in range(0, N, step)], dim=-1)
            elif along == "inner":
                y = sum(torch.matmul(x32[..., k:k + step], float32_copy(m[..., k:k + step, :])) for k in range(0, K, step))
                y = y + b[0] if b else y
            else:
                y = op(*b, x32, float32_copy(m))
            outs.append(y.to(BF16))
        return torch.cat(outs) if len(outs) > 1 else outs[0]
    return computed_in_float32


def pieces(matrix) -> tuple[int, str | None, int]:
    """product's (batch_step, along, step) for `matrix` [.., K, N]: whole where its float32 copy
    fits PIECE_BYTES; within an entry, the longer of K and N is cut (in multiples of 64)."""
    K, N = matrix.shape[-2:]
    entry_bytes = 4 * K * N
    if entry_bytes <= PIECE_BYTES:
        return max(1, PIECE_BYTES // entry_bytes), None, 0
    along, other = ("columns", K) if N >= K else ("inner", N)
    return 1, along, max(64, PIECE_BYTES // (4 * other) // 64 * 64)


def row_product(x32, matrix):
    """x32 [R, K] @ matrix [K, N] (or batched: [B, R, K] @ [B, K, N]) as a multiply-reduce over K, float32."""
    if x32.shape[-2] == 1:
        return (x32.transpose(-1, -2) * matrix.float()).sum(-2, keepdim=True)
    return (x32.unsqueeze(-1) * matrix.float().unsqueeze(-3)).sum(-2)  # [.., R, K, N] summed over K


def reduced(x32, matrix):
    return row_product(x32, matrix).to(matrix.dtype)


def reduced_plus_bias(bias, x32, matrix):
    """The same with a bias added before the one rounding (addmm, baddbmm)."""
    return (row_product(x32, matrix) + bias.float()).to(matrix.dtype)


def float32_row(x: torch.fx.Node) -> torch.fx.Node:
    """x converted to float32 into a buffer of its own, ahead of the reduction."""
    graph = x.graph
    with graph.inserting_after(x):
        x32 = graph.call_function(torch.ops.prims.convert_element_type.default, (x, torch.float32))
    x32.meta["val"] = x.meta["val"].float()
    x32.meta["inductor_realize_to_strides"] = True
    return x32


def _register(op, arity: int):
    pattern = CallFunction(op, *(Arg() for _ in range(arity)))

    @register_graph_pattern(pattern, pass_dict=reduction_patterns, extra_check=lambda m: _as_reduction(m) and (
        _bf16(*m.args) or (_float32(*m.args) and _rows(m) > 1)))
    def _reduce(match, *args):
        *bias, x, matrix = args
        x32 = float32_row(x) if _bf16(x) else x
        if bias:
            match.replace_by_example(reduced_plus_bias, [*bias, x32, matrix])
        else:
            match.replace_by_example(reduced, [x32, matrix])

    @register_graph_pattern(pattern, pass_dict=chunk_patterns, extra_check=lambda m: _bf16(*m.args) and not _as_reduction(m))
    @register_graph_pattern(pattern, pass_dict=small_chunk_patterns, extra_check=lambda m: _bf16(*m.args) and not _as_reduction(m) and _small(m))
    def _chunk(match, *args):
        match.replace_by_example(product(op, *pieces(args[-1].meta["val"])), list(args))


for _op, _arity in ((aten.mm, 2), (aten.bmm, 2), (aten.addmm, 3), (aten.baddbmm, 3)):
    _register(_op, _arity)
