"""A prompt chunk's routed experts, each on exactly the rows routed to it: custom ops the regions call.

    torch.ops.deepinfer.grouped_matmul(x, w, ends)                    # float experts w [E, F, D]
    torch.ops.deepinfer.grouped_int4_matmul(x, codes, scale_zero, ends)  # int4 experts (runtime/int_matmul.py)

x [P, D]: the (token, expert) pairs' rows, sorted by expert; ends [E] int32: where each expert's
rows end (cumulative). The result [P, F] holds expert e's rows times its weight transposed; rows
past ends[-1] (pairs another rank computes) are zeros.

Why ops: how many rows each expert takes is known only when the step runs. A static graph can only
give every expert a fixed capacity (models/moe.py's grouped form: twice the routed FLOPs at the
default capacity 2, and further passes when routing is uneven). Float experts loop here, one
product each, by oneDNN's linear (where ATen has oneDNN); int4 experts take one kernel call by id
(`int_matmul.matmul`), the busiest a GEMM on their weight decoded (int8 experts, never decoded,
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

ONEDNN = torch.backends.mkldnn.is_available()  # (asked once: the float kernel runs per expert per step)


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, in] @ w [out, in].T, through oneDNN where ATen has it."""
    if ONEDNN and x.is_contiguous() and w.is_contiguous():
        return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
    return torch.nn.functional.linear(x, w)


def per_expert(x: torch.Tensor, ends: torch.Tensor, features: int, product) -> torch.Tensor:
    """[P, features]: product(rows, e) for each expert e's rows of x, zeros past the last."""
    out = x.new_zeros(x.shape[0], features)
    start = 0
    for expert, end in enumerate(ends.tolist()):
        if end > start:
            out[start:end] = product(x[start:end], expert)
        start = end
    return out


@torch.library.custom_op("deepinfer::grouped_matmul", mutates_args=())
def grouped_matmul(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    return per_expert(x, ends, w.shape[1], lambda rows, e: linear(rows, w[e]))


@torch.library.custom_op("deepinfer::grouped_int4_matmul", mutates_args=())
def grouped_int4_matmul(x: torch.Tensor, codes: torch.Tensor, scale_zero: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """One kernel call for the experts of fewer than int_matmul.DECODED_FROM_ROWS rows, taken by id
    as a decode step's (16 calls in a loop cost 1.26x that on a 32-token prompt's experts); each
    other expert a GEMM on its weight decoded."""
    E = codes.shape[0]
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    decoded = torch.cat([counts >= int_matmul.DECODED_FROM_ROWS, counts.new_ones(1, dtype=torch.bool)])  # [E + 1]
    expert = torch.searchsorted(ends, torch.arange(x.shape[0], dtype=ends.dtype), right=True)  # [P]; E past the last
    ids = torch.where(decoded[expert], E, expert)  # E: zeros from the kernel (decoded below, or another rank's)
    out = int_matmul.matmul(x, codes, scale_zero, ids[:, None]).squeeze(1).to(x.dtype)
    if bool(decoded[:E].any()):
        start = 0
        for e, end in enumerate(ends.tolist()):
            if end - start >= int_matmul.DECODED_FROM_ROWS:
                out[start:end] = int_matmul.product(x[start:end], codes[e], scale_zero[e]).to(x.dtype)
            start = end
    return out


@grouped_matmul.register_fake
def _(x, w, ends):
    return x.new_empty(x.shape[0], w.shape[1])


@grouped_int4_matmul.register_fake
def _(x, codes, scale_zero, ends):
    return x.new_empty(x.shape[0], codes.shape[1])
