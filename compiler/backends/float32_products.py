"""Inductor graph passes for matrix products of bfloat16 tensors: computed in float32 from the bf16
operands, the result rounded to bf16 once (as a native bf16 GEMM rounds: accumulated in float32,
stored bf16). What is stored -- weights, activations between ops, the KV pool -- stays bf16.

`chunk_patterns`, for CPUs without native bf16 math (AVX2; AVX-512 without AVX512_BF16/AMX): a
product of several rows is one BLAS call on float32 copies of its operands. Emulated, every bf16
GEMM runs ~9x slower than in float32 (held to AVX2: a 256x2048 @ 2048x2048 linear 68.6 ms bf16,
7.7 ms f32); the copies cost ~3% of the f32 GEMM at 256 rows.

`one_row_patterns`, on every CPU: a one-row product (decode; MLA's per-head absorbed einsums) is
a multiply-reduce, which inductor compiles to one kernel reading the bf16 weight as stored, two
bytes an element, with the row converted to float32 once into a buffer of its own. (inductor's
own mm decomposition makes the same reduction, but inlines what computes the row -- a norm, its
rounding to bf16 -- into it, to run again for every weight row.)

Element-wise ops, norms and softmax need nothing: inductor computes them in float32 registers
from bf16 loads.
"""

import torch
from torch._inductor.pattern_matcher import Arg, CallFunction, PatternMatcherPass, register_graph_pattern

aten = torch.ops.aten
BF16 = torch.bfloat16

one_row_patterns = PatternMatcherPass(pass_name="deepinfer_float32_one_row_products")
chunk_patterns = PatternMatcherPass(pass_name="deepinfer_float32_chunk_products")


def _bf16(*nodes: torch.fx.Node) -> bool:
    values = [n.meta.get("val") for n in nodes]
    return all(v is not None and v.dtype == BF16 and v.device.type == "cpu" for v in values)


def _rows(match) -> int:
    return match.args[-2].meta["val"].shape[-2]  # (the row operand is the one before the matrix)


def product(op):
    def computed_in_float32(*args):
        return op(*(a.float() for a in args)).to(BF16)
    return computed_in_float32


def row_product(x32, matrix):
    """x32 [1, K] @ matrix [K, N] (or batched: [B, 1, K] @ [B, K, N]) as a multiply-reduce over K, float32."""
    return (x32.transpose(-1, -2) * matrix.float()).sum(-2, keepdim=True)


def one_row(x32, matrix):
    return row_product(x32, matrix).to(BF16)


def one_row_plus_bias(bias, x32, matrix):
    """The same with a bias added before the one rounding (addmm, baddbmm)."""
    return (row_product(x32, matrix) + bias.float()).to(BF16)


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

    @register_graph_pattern(pattern, pass_dict=one_row_patterns, extra_check=lambda m: _bf16(*m.args) and _rows(m) == 1)
    def _one_row(match, *args):
        *bias, x, matrix = args
        if bias:
            match.replace_by_example(one_row_plus_bias, [*bias, float32_row(x), matrix])
        else:
            match.replace_by_example(one_row, [float32_row(x), matrix])

    @register_graph_pattern(pattern, pass_dict=chunk_patterns, extra_check=lambda m: _bf16(*m.args) and _rows(m) > 1)
    def _chunk(match, *args):
        match.replace_by_example(product(op), list(args))


for _op, _arity in ((aten.mm, 2), (aten.bmm, 2), (aten.addmm, 3), (aten.baddbmm, 3)):
    _register(_op, _arity)
