"""A prompt chunk's routed experts, each on exactly the rows routed to it: custom ops the regions call.

    torch.ops.deepinfer.grouped_matmul(x, w, ends)                    # float experts w [E, F, D]
    torch.ops.deepinfer.grouped_int4_matmul(x, codes, scale_zero, ends)  # int4 experts (runtime/int_matmul.py)

x [P, D]: the (token, expert) pairs' rows, sorted by expert; ends [E] int32: where each expert's
rows end (cumulative). The result [P, F] holds expert e's rows times its weight transposed; rows
past ends[-1] (pairs another rank computes) are zeros.

Why ops: how many rows each expert takes is known only when the step runs. A static graph can only
give every expert a fixed capacity (models/moe.py's grouped form: twice the routed FLOPs at the
default capacity 2, and further passes when routing is uneven). Both ops take the experts of a
few rows in one kernel call by id, as a decode step's are, and each busier expert a GEMM: float
experts the few-row float kernel (`float_matmul`) below FLOAT_GEMM_FROM_ROWS, oneDNN's linear
(where ATen has oneDNN) from there; int4 experts the int4 kernel (`int_matmul.matmul`), from
DECODED_FROM_ROWS a GEMM on their weight decoded (int8 experts, never decoded,
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

# From this many rows a float expert's product is faster as oneDNN's GEMM than in the few-row kernel
# (16 experts [1280, 1024], ms for all, the same rows each, the kernel / oneDNN, 2 threads of the
# EPYC: float32 2 rows 3.0 / 6.4, 4 4.0 / 7.1, 8 5.6 / 7.8, 16 ~10 / 10.0; bfloat16 4 rows 2.1 /
# 4.3, 8 2.5 / 4.6, 16 5.0 / 6.0). The grouped op on a chunk's routing (top-4), before / now: 32
# tokens (~8 rows an expert) float32 5.7-6.5 -> 4.8-4.9 ms, bfloat16 3.3 -> 2.4-2.6; 8 tokens (~2)
# bfloat16 2.2-3.1 -> 1.0-1.2; 128 tokens (~32, every expert oneDNN's) within 3%.
FLOAT_GEMM_FROM_ROWS = {torch.float32: 12, torch.bfloat16: 16}
ONEDNN = torch.backends.mkldnn.is_available()  # (asked once: the float kernel runs per expert per step)


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, in] @ w [out, in].T, through oneDNN where ATen has it."""
    if ONEDNN and x.is_contiguous() and w.is_contiguous():
        return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
    return torch.nn.functional.linear(x, w)


def kernel_then_gemms(x: torch.Tensor, ends: torch.Tensor, E: int, features: int, gemm_from_rows: int, kernel, gemm) -> torch.Tensor:
    """[P, features]: the experts of fewer than gemm_from_rows rows in one kernel call, taken by id
    as a decode step's are (kernel(x, ids [P, 1]) -> [P, 1, features]; 16 calls in a loop cost 1.26x
    that on a 32-token int4 prompt's experts); each other expert with rows a GEMM (gemm(rows, e) ->
    [rows, features]). gemm_from_rows 0: every expert a GEMM."""
    bounds = [0, *ends.tolist()]  # expert e's rows: [bounds[e], bounds[e + 1])
    by_kernel = [0 < bounds[e + 1] - bounds[e] < gemm_from_rows for e in range(E)]
    if any(by_kernel):
        expert = torch.searchsorted(ends, torch.arange(x.shape[0], dtype=ends.dtype), right=True)  # [P]; E past the last
        ids = torch.where(torch.tensor([*by_kernel, False])[expert], expert, E)  # E: zeros (a GEMM's rows, another rank's)
        out = kernel(x, ids[:, None]).squeeze(1).to(x.dtype)
    else:
        out = x.new_zeros(x.shape[0], features)
    for e in range(E):
        first, last = bounds[e], bounds[e + 1]
        if last > first and last - first >= gemm_from_rows:
            out[first:last] = gemm(x[first:last], e).to(x.dtype)
    return out


@torch.library.custom_op("deepinfer::grouped_matmul", mutates_args=())
def grouped_matmul(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """Experts of fewer than FLOAT_GEMM_FROM_ROWS rows by the few-row float kernel
    (int_matmul.float_matmul), the others by oneDNN; every expert by oneDNN where the kernel does
    not take the weights' shape."""
    gemm_from_rows = FLOAT_GEMM_FROM_ROWS[w.dtype] if int_matmul.takes_float(w) else 0
    return kernel_then_gemms(x, ends, w.shape[0], w.shape[1], gemm_from_rows,
                             lambda x, ids: torch.ops.deepinfer.float_matmul(x.float().contiguous(), w, ids), lambda rows, e: linear(rows, w[e]))


@torch.library.custom_op("deepinfer::grouped_int4_matmul", mutates_args=())
def grouped_int4_matmul(x: torch.Tensor, codes: torch.Tensor, scale_zero: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """The experts of fewer than int_matmul.DECODED_FROM_ROWS rows by the kernel; each other expert
    a GEMM on its weight decoded."""
    return kernel_then_gemms(x, ends, codes.shape[0], codes.shape[1], int_matmul.DECODED_FROM_ROWS,
                             lambda x, ids: int_matmul.matmul(x, codes, scale_zero, ids),
                             lambda rows, e: int_matmul.product(rows, codes[e], scale_zero[e]))


@grouped_matmul.register_fake
def _(x, w, ends):
    return x.new_empty(x.shape[0], w.shape[1])


@grouped_int4_matmul.register_fake
def _(x, codes, scale_zero, ends):
    return x.new_empty(x.shape[0], codes.shape[1])
