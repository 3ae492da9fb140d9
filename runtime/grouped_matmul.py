"""A prompt chunk's routed experts, each on exactly the rows routed to it: custom ops the regions call.

    torch.ops.deepinfer.grouped_matmul(x, w, ends)                    # float experts w [E, F, D]
    torch.ops.deepinfer.grouped_int4_matmul(x, codes, scale_zero, ends)  # int4 experts (runtime/int_matmul.py)

x [P, D]: the (token, expert) pairs' rows, sorted by expert; ends [E] int32: where each expert's
rows end (cumulative). The result [P, F] holds expert e's rows times its weight transposed; rows
past ends[-1] (pairs another rank computes) are zeros.

Why ops: how many rows each expert takes is known only when the step runs. A static graph can only
give every expert a fixed capacity (models/moe.py's grouped form: twice the routed FLOPs at the
default capacity 2, and further passes when routing is uneven). Both ops take the experts of a
few rows in one kernel call by id, as a decode step's are, and each busier expert a GEMM,
consecutive busier experts one batched GEMM (bfloat16 and int4: `gemm_runs`): float experts the
few-row float kernel (`float_matmul`) below gemm_from_rows(w), oneDNN's linear (where ATen has
oneDNN) from there; int4 experts the int4 kernel (`int_matmul.matmul`), from DECODED_FROM_ROWS a
GEMM on their weight decoded (int8 experts, never decoded,
and int4 ones of a chunk too short for a GEMM are that kernel call in the graph: models/moe.py's
grouped_product). Measured against the alternatives (16 experts [1280, 1024], rows routed evenly
at random, eager, ms; an AMD EPYC, 2 threads):
                      32 rows x top-4    128     512
    float32  oneDNN         6.2          11.6    28.7
             MKL (F.linear) 10.2         14.2    34.6
             _grouped_mm    9.1          14.0    33.7   (ATen's grouped GEMM: a loop of MKL calls)
    bfloat16 oneDNN         3.2           5.6    15.0   (F.linear and _grouped_mm within 3%)
MKL's float32 GEMM of a few rows spends much of its time packing the weight (perf: 40% of a
32-token prompt in `mkl_blas_def_sgemm_scopy_right16_bdz`).

Registered on import: the models import this to trace, the runtime's region loaders before they
load a region that calls it.
"""

import torch

from . import int_matmul

# From this many rows a float expert's product is faster as oneDNN's GEMM than in the few-row kernel.
# The grouped op on 16 experts [1280, 1024], a chunk's routing (top-4) at random, 2 threads of the
# EPYC, ms with every expert oneDNN's / this split: float32 8 tokens (~2 rows an expert) 3.8 / 1.8,
# 32 (~8) 5.6 / 3.9, 64 (~16) 7.7 / 5.8, 128 (~32) 10.2 / 10.2-10.9 (the kernel for all: 10.9);
# bfloat16 8 tokens 2.5 / 1.1, 32 3.4 / 1.6, 64 4.9 / 2.8, 128 6.8 / 5.4, 256 (~64) 10.2 / 10.1.
FLOAT_GEMM_FROM_ROWS = {torch.float32: 24, torch.bfloat16: 48}
# An expert of fewer elements than this is small: its GEMM costs mostly oneDNN's fixed ~20 us a
# call, which the kernel, taking all the experts of few rows in one call, does not pay per expert.
# On a CPU with AMX, bfloat16 experts from this size are GEMMs from int_matmul.AMX_BF16_MOST_ROWS +
# 1 rows, smaller ones from FLOAT_GEMM_FROM_ROWS (the tiny V3's 32-token prompt, experts [256, 192]:
# 3.92 ms with them GEMMs from 9 rows, 3.22 without). Small float32 experts are GEMMs from
# SMALL_FLOAT32_GEMM_FROM_ROWS (an Intel Xeon, 2 threads, one expert's rows, us, kernel / oneDNN:
# [256, 192] 32 rows 21 / 31, 64 rows 40 / 46; [192, 128] 64 rows 24 / 30; [1280, 1024] 32 rows
# 466 / 497, 48 rows 669 / 619).
SMALL_EXPERT_ELEMENTS = 1 << 19
SMALL_FLOAT32_GEMM_FROM_ROWS = 64
ONEDNN = torch.backends.mkldnn.is_available()  # (asked once: the float kernel runs per expert per step)
# oneDNN's bf16 GEMM needs AVX-512 (or native bf16); elsewhere ATen emulates bf16 GEMMs ~9x slower
# than float32's (compiler/backends/float32_products.py), and the kernel, widening bf16 to float32,
# takes float experts of every row count.
ONEDNN_BF16 = ONEDNN and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def gemm_from_rows(w: torch.Tensor) -> int:
    """From how many rows a float expert of w is a GEMM (0: every expert, the kernel not taking w)."""
    if not int_matmul.takes_float(w):
        return 0
    if w.dtype == torch.bfloat16 and not ONEDNN_BF16:
        return 1 << 62  # (never)
    small = w.shape[-2] * w.shape[-1] < SMALL_EXPERT_ELEMENTS
    if w.dtype == torch.bfloat16 and int_matmul.AMX and not small:
        return int_matmul.AMX_BF16_MOST_ROWS + 1
    if w.dtype == torch.float32 and small:
        return SMALL_FLOAT32_GEMM_FROM_ROWS
    return FLOAT_GEMM_FROM_ROWS[w.dtype]


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, in] @ w [out, in].T, through oneDNN where ATen has it (bf16: where oneDNN does)."""
    if ONEDNN and (ONEDNN_BF16 or w.dtype != torch.bfloat16) and x.is_contiguous() and w.is_contiguous():
        return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
    return torch.nn.functional.linear(x, w)


# The most multiply-adds of padding an expert joining a batched GEMM may add (~0.2 ms of an AMX
# core's): padding costs less than separate calls (us, a prompt's routing, int4 / bfloat16, runs
# of one / with this bound / unbounded: 8 experts [256, 192] 1942 / 1157 / 1178, 1712 / 890 / 678;
# 16 experts [1024, 512] 10005 / 6199 / 6290, 7268 / 3742 / 3779; an Intel Xeon, 2 threads), but
# one busy expert among many idle ones would pad them all.
PADDING_PRODUCTS = 1 << 28


def kernel_then_gemms(x: torch.Tensor, ends: torch.Tensor, E: int, features: int, gemm_from_rows: int, most_a_run: int,
                      kernel, gemms) -> torch.Tensor:
    """[P, features]: the experts of fewer than gemm_from_rows rows in one kernel call, taken by id
    as a decode step's are (kernel(x, ids [P, 1]) -> [P, 1, features], zeros for id E; 16 calls in
    a loop cost 1.26x that on a 32-token int4 prompt's experts); the others by runs of up to
    most_a_run consecutive experts (`gemm_runs`), each run's rows padded to its busiest expert's:
    gemms(xs [n, C, in], first) -> [n, C, features] for experts first..first + n - 1, in any float
    dtype (it is converted as it is stored; a padding row's result is dropped). gemm_from_rows 0:
    every expert a GEMM."""
    bounds = [0, *ends.tolist()]  # expert e's rows: [bounds[e], bounds[e + 1])
    counts = [bounds[e + 1] - bounds[e] for e in range(E)]
    by_kernel = [0 < count < gemm_from_rows for count in counts]
    if any(by_kernel):
        expert = torch.searchsorted(ends, torch.arange(x.shape[0], dtype=ends.dtype), right=True)  # [P]; E past the last
        ids = torch.where(torch.tensor([*by_kernel, False])[expert], expert, E)  # E: zeros (a GEMM's rows, another rank's)
        out = kernel(x, ids[:, None]).squeeze(1).to(x.dtype)
    else:
        out = x.new_empty(x.shape[0], features)
        out[bounds[-1]:] = 0  # (another rank's pairs)
    for first, last in gemm_runs(counts, gemm_from_rows, most_a_run, features * x.shape[1]):
        run, C = counts[first:last], max(counts[first:last])
        if min(run) == C:  # (no padding: a run's rows are consecutive in x)
            out[bounds[first]:bounds[last]] = gemms(x[bounds[first]:bounds[last]].view(len(run), C, -1), first).flatten(0, 1)
            continue
        place = torch.arange(C)
        own = place < torch.tensor(run)[:, None]  # [n, C]: not padding
        rows = torch.tensor(bounds[first:last])[:, None] + place * own  # [n, C]: each expert's rows, then its first as padding
        ys = gemms(x.index_select(0, rows.flatten()).view(len(run), C, -1), first).flatten(0, 1)  # [n * C, features]
        out[bounds[first]:bounds[last]] = ys.index_select(0, own.flatten().nonzero().squeeze(1))
    return out


def gemm_runs(counts: list[int], gemm_from_rows: int, most: int, row_elements: int) -> list[tuple[int, int]]:
    """The experts with rows for a GEMM (counts[e] >= gemm_from_rows), as runs [first, last) of at
    most `most` consecutive experts, an expert joining a run while the padding that adds (to the
    run's busiest expert's rows) costs at most PADDING_PRODUCTS multiply-adds (row_elements a
    padding row's). A run's weights are a view, one batched GEMM, whose fixed cost a call (oneDNN's,
    ~40 us on 2 threads of an Intel Xeon) a loop paid an expert (8 experts [256, 192] of 128 rows,
    bfloat16, us: 353 in a loop, 87 batched; int4, decoded: 669 / 221; [1280, 1024] bfloat16 3087 /
    1972)."""
    runs = []
    for e, count in enumerate(counts):
        if count and count >= gemm_from_rows:
            if runs and runs[-1][1] == e and e - runs[-1][0] < most:
                run = counts[runs[-1][0]:e]
                padding = (len(run) + 1) * max(*run, count) - len(run) * max(run) - count
                if padding * row_elements <= PADDING_PRODUCTS:
                    runs[-1] = (runs[-1][0], e + 1)
                    continue
            runs.append((e, e + 1))
    return runs


# Defined and implemented as the int_matmul ops are: a `torch.library.custom_op` costs ~0.1 ms more
# a call from a region (its autograd and dynamo wrappers), 5-10% of a tiny model's 512-token prompt.
torch.library.define("deepinfer::grouped_matmul", "(Tensor x, Tensor w, Tensor ends) -> Tensor")
torch.library.define("deepinfer::grouped_int4_matmul", "(Tensor x, Tensor codes, Tensor scale_zero, Tensor ends) -> Tensor")


def grouped_matmul(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """Experts of fewer than gemm_from_rows(w) rows by the few-row float kernel
    (int_matmul.float_matmul), the others by oneDNN, bfloat16 ones batched; every expert by oneDNN
    where the kernel does not take the weights' shape. (float32's batched GEMM is slower than a
    loop: 8 experts [256, 192] of 128 rows, 1650 us against 695.)"""
    def gemms(xs, first):
        if w.dtype == torch.bfloat16:
            return torch.bmm(xs.to(w.dtype), w[first:first + xs.shape[0]].mT)
        return linear(xs[0], w[first])[None]  # (runs of one: no padding)

    return kernel_then_gemms(x, ends, w.shape[0], w.shape[1], gemm_from_rows(w), w.shape[0] if w.dtype == torch.bfloat16 else 1,
                             lambda x, ids: torch.ops.deepinfer.float_matmul(x.float().contiguous(), w, ids), gemms)


# The most int4 weights a batched GEMM decodes at once: 8 experts [2816, 1024] (46 MB of bfloat16)
# took 17 ms to decode, 4 runs of 2 of them 2.8 (an Intel Xeon, 2 threads).
DECODED_RUN_ELEMENTS = 1 << 23


def grouped_int4_matmul(x: torch.Tensor, codes: torch.Tensor, scale_zero: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """The experts of fewer than int_matmul.DECODED_FROM_ROWS rows by the kernel; the others
    bfloat16 GEMMs on their weights decoded, a run of experts batched."""
    def gemms(xs, first):
        run = slice(first, first + xs.shape[0])
        return torch.bmm(xs.to(torch.bfloat16), torch.ops.deepinfer.int4_values(codes[run], scale_zero[run]).mT)

    E, rows, half = codes.shape
    return kernel_then_gemms(x, ends, E, rows, int_matmul.DECODED_FROM_ROWS, max(1, DECODED_RUN_ELEMENTS // (rows * 2 * half)),
                             lambda x, ids: int_matmul.matmul(x, codes, scale_zero, ids), gemms)


torch.library.impl("deepinfer::grouped_matmul", "CPU")(grouped_matmul)
torch.library.impl("deepinfer::grouped_int4_matmul", "CPU")(grouped_int4_matmul)


@torch.library.register_fake("deepinfer::grouped_matmul")
def _(x, w, ends):
    return x.new_empty(x.shape[0], w.shape[1])


@torch.library.register_fake("deepinfer::grouped_int4_matmul")
def _(x, codes, scale_zero, ends):
    return x.new_empty(x.shape[0], codes.shape[1])
