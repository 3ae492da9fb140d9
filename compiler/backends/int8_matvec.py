"""An inductor graph pass: a one-row product with int8 weights (`_weight_int8pack_mm`, how the
model computes model.quantize: int8 linears) becomes a multiply-reduce that reads the int8 codes
where they lie and widens them in registers.

Why: a decode step of one sequence multiplies one row by every weight, so its cost is reading
the weights; ATen's int8 kernel reads them at half the bandwidth the box gives (the ~100M model's
LM head, 32000 x 768, one row, 2 threads, AMD EPYC Zen 4: 1.81 ms, where the bytes take 0.85 ms
at 28.9 GB/s), while inductor's fused reduction over the codes runs at that floor (0.85 ms:
bench/quantized_matmul_bench.py). From two rows on, ATen's kernel reads each weight once for all
rows and stays (the reduction would read it once a row).
"""

import torch
from torch._inductor.pattern_matcher import Arg, CallFunction, PatternMatcherPass, register_graph_pattern

patterns = PatternMatcherPass(pass_name="deepinfer_int8_matvec")


def matvec(row, codes, scales):
    """row [1, K] @ (codes [N, K] x scales [N]).T -> [1, N] in row's dtype, accumulated in float32.
    The row is made a buffer first: inductor would otherwise recompute what produces it (the
    norm before a projection, SiLU x up before down_proj) inside the loop, once per output."""
    buffered = torch.ops.prims.inductor_force_stride_order.default(row.float(), [row.shape[1], 1])
    return ((buffered[:, None, :] * codes.float()[None]).sum(-1) * scales.float()).to(row.dtype)


def one_row(match) -> bool:
    row = match.args[0].meta.get("val")
    return row is not None and row.device.type == "cpu" and row.dim() == 2 and row.shape[0] == 1


@register_graph_pattern(CallFunction(torch.ops.aten._weight_int8pack_mm.default, Arg(), Arg(), Arg()), pass_dict=patterns,
                        extra_check=one_row)
def _int8_matvec(match, row, codes, scales):
    match.replace_by_example(matvec, [row, codes, scales])
