"""An inductor graph pass for CPUs without native bfloat16 math (AVX2, AVX-512 without
AVX512_BF16/AMX): a matrix product of bfloat16 tensors is computed in float32 and its result
rounded back to bfloat16.

Why: on such a CPU every bf16 GEMM is emulated; a 256-row prefill product runs ~9x slower than the
same one in float32 (bench/bf16_bench.py, held to AVX2: a 256x2048 @ 2048x2048 linear 68.6 ms
bf16, 7.7 ms f32). Converting its bf16 operands first costs one pass over them (~3% of the f32
GEMM at 256 rows). At one row (decode), inductor's mm decomposition turns the product into a
multiply-reduce, and the conversion fuses into it: the kernel reads the weight as stored, two
bytes an element. Everything else (element-wise ops, norms, softmax) inductor already computes in
float32 registers from bf16 loads. What is stored -- weights, activations between ops, the KV
pool -- stays bf16, and results are rounded as a native bf16 GEMM rounds them (accumulated in
float32, stored bf16).
"""

import torch
from torch._inductor.pattern_matcher import Arg, CallFunction, PatternMatcherPass, register_graph_pattern

aten = torch.ops.aten
BF16 = torch.bfloat16

patterns = PatternMatcherPass(pass_name="deepinfer_float32_products")


def _bf16(*nodes: torch.fx.Node) -> bool:
    values = [n.meta.get("val") for n in nodes]
    return all(v is not None and v.dtype == BF16 and v.device.type == "cpu" for v in values)


def product(op):
    def computed_in_float32(*args):
        return op(*(a.float() for a in args)).to(BF16)
    return computed_in_float32


def one_row(x32, matrix):
    """x32 [1, K] @ matrix [K, N] (or batched: [B, 1, K] @ [B, K, N]) as a multiply-reduce over K,
    which inductor compiles to one kernel reading the matrix as stored."""
    return (x32.transpose(-1, -2) * matrix.float()).sum(-2, keepdim=True).to(BF16)


def one_row_plus_bias(bias, x32, matrix):
    """The same with a bias added before the one rounding (addmm, baddbmm)."""
    return ((x32.transpose(-1, -2) * matrix.float()).sum(-2, keepdim=True) + bias.float()).to(BF16)


def float32_row(x: torch.fx.Node) -> torch.fx.Node:
    """x converted to float32 into a buffer of its own, ahead of the reduction: inlined, what
    computes the row (a norm, its rounding to bf16) would run again for every column."""
    graph = x.graph
    with graph.inserting_after(x):
        x32 = graph.call_function(torch.ops.prims.convert_element_type.default, (x, torch.float32))
    x32.meta["val"] = x.meta["val"].float()
    x32.meta["inductor_realize_to_strides"] = True
    return x32


def _register(op, arity: int):
    @register_graph_pattern(CallFunction(op, *(Arg() for _ in range(arity))), pass_dict=patterns,
                            extra_check=lambda match: _bf16(*match.args))
    def _replace(match, *args):
        *bias, x, matrix = args
        if x.meta["val"].shape[-2] > 1:
            match.replace_by_example(product(op), list(args))
        elif bias:
            match.replace_by_example(one_row_plus_bias, [*bias, float32_row(x), matrix])
        else:
            match.replace_by_example(one_row, [float32_row(x), matrix])


for _op, _arity in ((aten.mm, 2), (aten.bmm, 2), (aten.addmm, 3), (aten.baddbmm, 3)):
    _register(_op, _arity)
