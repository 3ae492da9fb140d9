"""The inductor backend's int8 matvec pass: a one-row product with int8 weights becomes a fused
reduction over the codes (ATen's kernel stays for a few rows more, a bf16 GEMM for many), with
ATen's result; int8 routed experts are decoded inside the gathered experts' reduction, and int4
linears and experts call deepinfer::int4_matmul from the compiled code."""

import pytest
import torch
import torch.nn.functional as F

from deepinfer.models.int_weights import Int4Experts, IntLinear, IntWeights, gathered_values, int8_codes, int_tensors
from deepinfer.models.moe import gathered
from deepinfer.runtime.grouped_matmul import DECODED_FROM_ROWS
from tests.compiler.test_gathered_matvec import compiled_code


@pytest.mark.parametrize("rows", [1, 4, DECODED_FROM_ROWS])
def test_one_row_reads_int8_codes_in_a_fused_reduction(rows):
    """A few rows call ATen's int8 kernel; a prompt chunk's many, a bf16 GEMM on the decoded weight."""
    torch.manual_seed(0)
    linear = IntLinear(96, 80, IntWeights(8))
    linear.weight.data, linear.weight_qscale.data = int8_codes(torch.randn(80, 96))
    x = torch.randn(rows, 96)
    got, code = compiled_code(linear, x)
    torch.testing.assert_close(got, linear(x), atol=2e-2, rtol=1e-2)  # (bf16 activations: ATen's, or the reduction's)
    assert ("extern_kernels._weight_int8pack_mm(" in code) == (1 < rows < DECODED_FROM_ROWS), code
    assert ("extern_kernels.mm(" in code) == (rows >= DECODED_FROM_ROWS), code


def test_int8_experts_are_decoded_inside_the_reduction():
    torch.manual_seed(0)
    E, k, D, I = 16, 4, 64, 64
    gate_up, down = int_tensors(torch.randn(E, 2 * I, D), 8, 32), int_tensors(torch.randn(E, D, I), 8, 32)

    def routed(x, weights, ids, codes_gate_up, scales_gate_up, codes_down, scales_down):
        return gathered(x, weights, ids, lambda ids: gathered_values(codes_gate_up[ids], scales_gate_up[ids], x.dtype),
                        lambda ids: gathered_values(codes_down[ids], scales_down[ids], x.dtype),
                        lambda gate, up: F.silu(gate) * up)

    args = (torch.randn(1, D), torch.rand(1, k), torch.randperm(E)[:k][None], *gate_up, *down)
    got, code = compiled_code(routed, *args)
    torch.testing.assert_close(got, routed(*args), atol=1e-3, rtol=1e-4)
    assert "extern_kernels.bmm(" not in code and f"(1, {k}, {2 * I}, {D})" not in code, code


def test_int4_linears_and_experts_call_the_kernel_from_compiled_code():
    """The experts by id, never gathered or decoded; a linear's few rows too (many: a bf16 GEMM)."""
    torch.manual_seed(0)
    E, k, D, I = 16, 4, 64, 128
    gate_up, down = int_tensors(torch.randn(E, 2 * I, D), 4, 32), int_tensors(torch.randn(E, D, I), 4, 32)
    linear = IntLinear(D, 48, IntWeights(4))
    linear.weight.data, linear.weight_qscale.data = int_tensors(torch.randn(48, D), 4, 32)

    def decode_step(x, weights, ids, codes_gate_up, scales_gate_up, codes_down, scales_down):
        y = gathered(x, weights, ids, lambda ids: Int4Experts(codes_gate_up, scales_gate_up, ids),
                     lambda ids: Int4Experts(codes_down, scales_down, ids), lambda gate, up: F.silu(gate) * up)
        return linear(y)

    args = (torch.randn(1, D), torch.rand(1, k), torch.randperm(E)[:k][None], *gate_up, *down)
    got, code = compiled_code(decode_step, *args)
    torch.testing.assert_close(got, decode_step(*args), atol=1e-4, rtol=1e-4)
    assert code.count("torch.ops.deepinfer.int4_matmul.default(") == 3 and "extern_kernels.mm(" not in code, code


def test_int4_linears_of_many_rows_decode_the_weight_for_a_gemm_in_a_saved_program(tmp_path):
    """A prompt chunk's rows: the weight decoded to bf16 for a GEMM, a graph torch.export can save."""
    linear = IntLinear(64, 48, IntWeights(4))
    linear.weight.data, linear.weight_qscale.data = int_tensors(torch.randn(48, 64), 4, 32)
    x = torch.randn(DECODED_FROM_ROWS, 64)
    program = torch.export.export(linear, (x,))
    torch.export.save(program, tmp_path / "linear.pt2")
    torch.testing.assert_close(torch.export.load(tmp_path / "linear.pt2").module()(x), linear(x))
    assert "int4_matmul" not in str(program.graph)
