"""An inductor graph pass for routed experts at decode: a one-row product whose matrix is
gathered (W[ids]: the row's routed experts) becomes a multiply-reduce that reads each gathered
weight where it lies.

Why: inductor lowers a one-row bmm on the CPU to a multiply-reduce anyway, but a batch-of-ONE bmm
(one decode row times its k experts' gate and up weights) is taken first by its mm-decomposition
pass (inductor.DEFAULTS turn it on for one-row decode), which makes the matrix a real buffer: for
a gathered matrix, a copy of the k experts' weights, read, written and read again. The MoE decode
region read its weights at 0.59x the dense layers' rate (bench/decode_bench.py's per-region
table); rewritten here first, inductor loads the weights through the ids inside the reducing
kernel, and experts kept fp8 or fp4 are decoded there rather than into a float32 copy. (Stored
float experts, gathered as they are, go to deepinfer's few-row kernel by id first:
few_row_products.py.)
"""

import torch
from torch._inductor.pattern_matcher import Arg, CallFunction, PatternMatcherPass, register_graph_pattern

aten = torch.ops.aten
# Ops that only view, reorder or convert a tensor (between a gather and the bmm reading it).
_LAYOUT_OPS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.permute.default,
               aten.transpose.int, aten.expand.default, aten.unsqueeze.default, aten.squeeze.dim, aten.clone.default,
               torch.ops.prims.convert_element_type.default}

patterns = PatternMatcherPass(pass_name="deepinfer_gathered_matvec")


def matvec(vector, matrix):
    """vector [B, 1, K] @ matrix [B, K, N] -> [B, 1, N], as a product summed over K. The vector is
    made a buffer first: inductor would otherwise recompute what produces it (the norm, SiLU x up)
    inside the reduction, once per output."""
    K = vector.shape[-1]
    buffered = torch.ops.prims.inductor_force_stride_order.default(vector, [K, K, 1])
    return (buffered.transpose(1, 2) * matrix).sum(1, keepdim=True)


def gathered(node: torch.fx.Node) -> bool:
    """Whether `node` is computed from a gather (aten.index) by views and element-wise ops: a
    plain gather, or one of fp8 / fp4 experts dequantized (codes decoded, times their scales),
    which the reduction then reads as stored."""
    if node.op != "call_function":
        return False
    if node.target is aten.index.Tensor:
        return True
    if node.target in _LAYOUT_OPS or torch.Tag.pointwise in getattr(node.target, "tags", ()):
        return any(gathered(arg) for arg in node.all_input_nodes)
    return False


def applies(match) -> bool:
    vector, matrix = match.args
    v = vector.meta.get("val")
    return (v is not None and v.device.type == "cpu" and v.dim() == 3 and v.shape[1] == 1
            and gathered(matrix))


@register_graph_pattern(CallFunction(aten.bmm, Arg(), Arg()), pass_dict=patterns, extra_check=applies)
def _bmm(match, vector, matrix):
    match.replace_by_example(matvec, [vector, matrix])
