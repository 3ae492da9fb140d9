"""An inductor graph pass for CPU products of a few rows with a stored float weight: x [M, K] @ W.T,
W a float32 or bfloat16 [N, K] region input and 1 <= M <= most_rows(W), becomes deepinfer's
few-row float kernel (runtime/int_matmul.py's float_matmul), which reads the weight once for all
M rows as it lies, prefetching ahead, with no packing. So does a decode step's heads against one
sequence's KV cache rows (MLA's scores: [H, C] @ rows.T, the rows a slot of the cache pool as
one_row_views.py reads it, after the step's own row is stored): where the product is past
float32_products.py's reductions (a long context), it was a BLAS call on a strided view and a
reduction for the rope columns. The 190M's decode at 512 positions (640-position bucket), old
bundle / new side by side (bench/bundle_ab_bench.py, an Intel Xeon with AMX): int4 TPOT-512
0.95-0.96x, bf16 0.99x; eager, 8 heads x [640, 288] rows: BLAS 27-39 us, the kernel 18; at
4096 rows 165 against 97. (Since, a decode attention of fused_attention.py's size is its kernel
whole, scores, softmax and values in one pass, before these passes run: what stays here is the
scores of the attentions it leaves.)

Why: a decode step or a short prompt chunk is bound by reading the weights, and the BLAS calls
read them slowly at a few rows (MKL's float32 GEMM packs the weight first; blocked_matmul.py's
blocks read 4-8 rows at 0.6-0.8x one row's rate). Side by side, weights streamed from memory,
torch.mm / the kernel, ms, 2 threads of an AMD EPYC (Zen 4):
                          2 rows        8            16           32           64
    float32  [2816, 1024] 1.25 / 0.38   1.15 / 0.55  1.38 / 0.83  1.81 / 1.30  2.75 / 2.42
             [768, 384]   0.15 / 0.03   0.12 / 0.04  0.15 / 0.07  0.19 / 0.13  0.29 / 0.25
    bfloat16 [2816, 1024] 0.31 / 0.20   0.39 / 0.21  0.49 / 0.38  0.68 / 0.67  1.09 / 1.27
             [768, 384]   0.07 / 0.03   0.07 / 0.06  0.07 / 0.09  0.10 / 0.16  0.15 / 0.23
Held to AVX2 (DEEPINFER_KERNEL_MARCH=haswell, ATen, MKL and oneDNN held to AVX2 too; bfloat16's
BLAS product there is float32_products.py's, on a float32 copy of the weight):
    float32  [2816, 1024] 1.19 / 0.37   1.14 / 0.53  1.38 / 0.94  1.81 / 1.69
             [1024, 2816] 1.23 / 0.37   0.93 / 0.82  1.15 / 1.24  1.61 / 2.10
    bfloat16 [2816, 1024] 0.67 / 0.19   1.51 / 0.53  1.62 / 0.97
One row: against inductor's reduction (its mm decomposition; float32_products.py's for bf16),
bf16 LM head [32000, 1024] 1.95 / 1.86 ms, [384, 1024] 0.048 / 0.028; the 190M's decode step, old
bundle / new side by side in one process, bf16 0.92x, float32 0.97x (its prompt of 32 tokens, whose
LM head takes one row: 0.89x, 0.98x). The passes run before inductor's decomposition, which still
makes a reduction of the one-row products the kernel does not take: a computed weight (fp8
decoded: read as stored inside the reduction), a head's matrix (MLA's absorbed products, the KV
cache), shapes off the kernel's multiples of 8 rows and 32 inputs.

The routed experts' decode products (models/moe.py's gathered form: each row times its k experts'
weights, W[ids]) take the kernel too where W is a stored float region input: one call with the
ids, the kernel reading each routed expert's rows where they lie (gathered_matvec.py's reduction,
which it replaces there, reads them as well, but as one 32-lane accumulator an output: bound by
the additions' latency, not the memory, on a CPU whose cache holds the weights). The 190M's decode
step, old bundle / new side by side in one process (bench/bundle_ab_bench.py), 2 threads of an
Intel Xeon with AMX and a 480 MiB L3: bf16 TPOT-32 0.76x (5.68 -> 4.33 ms), float32 0.85x.
"""

import functools

import torch
from torch._inductor.cpu_vec_isa import pick_vec_isa
from torch._inductor.pattern_matcher import Arg, CallFunction, PatternMatcherPass, register_graph_pattern

from deepinfer.compiler.backends import blocked_matmul, float32_products
from deepinfer.runtime import int_matmul

aten = torch.ops.aten
# The most rows the kernel takes, by the vector ISA regions are compiled for (the tables above); the
# kernels are built on the host that runs the region, which has at least that ISA.
FEW_ROWS = {"avx512": {torch.float32: 32, torch.bfloat16: 16}, "avx2": {torch.float32: 16, torch.bfloat16: 16}}
# A one-row product of fewer multiply-adds stays inductor's reduction, fused with the ops around
# it: the op's call costs more than such a product takes (the tiny V3's decode step, old bundle /
# new side by side: float32 0.92x at 64K, 0.96x more at 256K; bfloat16 0.94x at 256K). The 190M's
# smallest weights ([768, 384], [288, 1024]) are above it: there the kernel's 28 us beat the
# reduction's 48 ([384, 1024]).
ONE_ROW_FROM_WORK = 1 << 18
_VIEWS = {aten.permute.default, aten.t.default, aten.transpose.int, aten.view.default, aten.reshape.default,
          aten._unsafe_view.default, aten.unsqueeze.default, aten.squeeze.dim, aten.expand.default}

patterns = PatternMatcherPass(pass_name="deepinfer_few_row_products")


# A bfloat16 weight of at most float32_products.SMALL_MATRIX elements (a tiny model's linears) takes
# the kernel up to this many rows where the CPU has no AMX: past FEW_ROWS its product was MKL's
# float32 GEMM on float32 copies (float32_products.py's small chunks), which on an AMD EPYC packs
# the weight each call (perf, the trained tiny V3's bf16 32-token prompt: MKL's sgemm kernel,
# packing and scaling 22% of it). Eager, 32 rows, us, the kernel / oneDNN's bf16 GEMM / the copies
# and MKL: [96, 192] 14.5 / 21.8 / 28.4, [192, 128] 18.7 / 23.0 / 36.8; [512, 192] 45 / 39 / 88;
# held to AVX2, the kernel / the copies and MKL: [96, 192] 23 / 29-34, [256, 256] 54 / 63. The tiny
# V3's bf16 32-token prompt side by side (bench/bundle_ab_bench.py): 0.87x, its decode and 512-token
# prompt 1.00x.
SMALL_BF16_ROWS = 32


@functools.cache
def isa_words() -> tuple[str, ...]:
    """The vector ISA regions are compiled for here, as words ("avx512", "avx512_vnni", "amx_tile"; none where not x86's)."""
    return tuple(str(pick_vec_isa()).split())


@functools.cache
def few_rows() -> dict:
    """{dtype: the most rows the kernel takes} for this host's vector ISA (its first word), bfloat16
    held to int_matmul.AMX_BF16_MOST_ROWS with AMX."""
    isa = isa_words()
    rows = dict(FEW_ROWS.get(isa[0] if isa else "", {}))
    if "amx_tile" in isa:
        rows[torch.bfloat16] = int_matmul.AMX_BF16_MOST_ROWS
    return rows


def kernel_product(x, weight_t):
    """x [M, K] @ weight_t [K, N], the transpose of a contiguous [N, K] weight, by the kernel."""
    return torch.ops.deepinfer.float_matmul(x.float().contiguous(), weight_t.t(), None).squeeze(1).to(x.dtype)


def kernel_product_batch_of_one(x, weight_t):
    """The same for x [1, M, K] @ weight_t [1, K, N] (an einsum without batch dimensions)."""
    return kernel_product(x[0], weight_t[0]).unsqueeze(0)


# What a region input is seen through as stored: views; a select, as one_row_views.py leaves one
# sequence's read of the KV cache; the region's own write of new rows into the cache (functional
# here; inductor writes it in place, into the input the kernel then reads).
_AS_STORED = {*_VIEWS, aten.select.int, aten.index_put.default}


def stored(node: torch.fx.Node) -> bool:
    """Whether `node` is a region input as stored: a weight, or one sequence's rows of the KV cache."""
    while node.op == "call_function" and node.target in _AS_STORED:
        node = node.args[0]
    return node.op == "placeholder"


def most_rows(weight: torch.Tensor) -> int:
    """The most rows the kernel takes of a product with this float weight on this host."""
    rows = few_rows()[weight.dtype]
    if weight.dtype == torch.bfloat16 and weight.numel() <= float32_products.SMALL_MATRIX and "amx_tile" not in isa_words():
        return max(rows, SMALL_BF16_ROWS)
    return rows


def applies(x: torch.fx.Node, weight_t: torch.fx.Node, batched: bool = False) -> bool:
    values = blocked_matmul.weight_product(x, weight_t, batched)
    if values is None:
        return False
    xv, wv = values
    return (xv.dtype in few_rows() and wv.dtype == xv.dtype and 1 <= xv.shape[0] <= most_rows(wv)
            and (xv.shape[0] > 1 or wv.numel() >= ONE_ROW_FROM_WORK) and int_matmul.takes_float(wv.t()) and stored(weight_t))


@register_graph_pattern(CallFunction(aten.mm, Arg(), Arg()), pass_dict=patterns)
def _mm(match, x, weight_t):
    if applies(x, weight_t):
        match.replace_by_example(kernel_product, [x, weight_t])


@register_graph_pattern(CallFunction(aten.addmm, Arg(), Arg(), Arg()), pass_dict=patterns)
def _addmm(match, bias, x, weight_t):
    if applies(x, weight_t):
        match.replace_by_example(lambda bias, x, weight_t: kernel_product(x, weight_t) + bias, [bias, x, weight_t])


def gathered_kernel_product(vector, experts, ids):
    """vector [B, 1, K] @ (experts[ids] seen as [B, K, M]) -> [B, 1, M]: each batch entry's row
    times the M / F rows' worth of its gathered experts [F, K], by the kernel taking them by id."""
    B, _, K = vector.shape
    x = vector.reshape(B, K).float().contiguous()
    return torch.ops.deepinfer.float_matmul(x, experts, ids.reshape(B, -1).contiguous()).reshape(B, 1, -1).to(vector.dtype)


def gathered_experts(vector: torch.fx.Node, matrix: torch.fx.Node):
    """(experts, ids) where the bmm vector [B, 1, K] @ matrix [B, K, M] is each row times gathered
    stored float experts (matrix: views of experts[ids], experts a contiguous [E, F, K] region
    input the kernel takes) in the kernel's order: the matrix's columns the gathered weights' rows
    in turn, M / F experts an entry (the routed experts' gate/up: [N, K, k F]; their down: [N k, K, F]);
    else None."""
    v, m = vector.meta.get("val"), matrix.meta.get("val")
    node = matrix
    while node.op == "call_function" and node.target in _VIEWS:
        node = node.args[0]
    if v is None or m is None or node.op != "call_function" or node.target is not aten.index.Tensor:
        return None
    experts, indices = node.args
    if experts.op != "placeholder" or len(indices) != 1 or indices[0] is None:
        return None
    w, ids = experts.meta["val"], indices[0].meta["val"]
    if (v.device.type != "cpu" or v.dim() != 3 or v.shape[1] != 1 or v.dtype not in few_rows() or w.dtype != v.dtype
            or w.dim() != 3 or not w.is_contiguous() or not int_matmul.takes_float(w) or ids.dtype != torch.int64):
        return None
    (B, K, M), F = m.shape, w.shape[1]
    if not all(isinstance(s, int) for s in (*m.shape, *ids.shape)) or K != w.shape[2] or M % F or B * M != ids.numel() * F:
        return None
    # matrix[b, :, c] must be the gathered tensor's row b M + c (it is contiguous [*ids, F, K]);
    # (a dimension of size 1 may have any stride)
    if any(size > 1 and stride != expected for size, stride, expected in zip(m.shape, m.stride(), (M * K, 1, K))) or m.storage_offset():
        return None
    return experts, indices[0]


@register_graph_pattern(CallFunction(aten.bmm, Arg(), Arg()), pass_dict=patterns)
def _bmm(match, x, weight_t):
    if applies(x, weight_t, batched=True):
        match.replace_by_example(kernel_product_batch_of_one, [x, weight_t])
    elif (found := gathered_experts(x, weight_t)) is not None:
        match.replace_by_example(gathered_kernel_product, [x, *found])
