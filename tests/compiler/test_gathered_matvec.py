"""The routed experts' decode products in the inductor backend: stored float experts taken by id
by the few-row kernel (few_row_products.py), fp8 ones read where they lie and decoded inside a
reduction (gathered_matvec.py); never a copy of the k experts' weights, and eager's result."""

import platform

import pytest
import torch
import torch._inductor.config
import torch.nn.functional as F
from torch._inductor.utils import run_and_get_code

from deepinfer.compiler.backends import inductor
from deepinfer.models.moe import gathered
from deepinfer.models.quantization import dequantize


def swiglu(gate, up):
    return F.silu(gate) * up


def routed(x, weights, ids, w_gate_up, w_down):
    return gathered(x, weights, ids, lambda ids: w_gate_up[ids], lambda ids: w_down[ids], swiglu)


def compiled_code(fn, *args):
    """fn compiled as the inductor backend compiles a region (its passes and fusion options)."""
    torch._dynamo.reset()
    with torch._inductor.config.patch(post_grad_custom_pre_pass=inductor.graph_passes(),
                                      post_grad_fusion_options=inductor.DEFAULTS["post_grad_fusion_options"]):
        got, (code, *_) = run_and_get_code(torch.compile(fn, dynamic=False, backend="inductor"), *args)
    return got, code


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the kernel is taken on x86 hosts (AVX2, AVX-512)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3])
def test_stored_routed_experts_are_taken_by_id_by_the_kernel(rows, dtype):
    torch.manual_seed(0)
    E, k, D, I = 16, 4, 96, 64
    w_gate_up, w_down = (torch.randn(E, 2 * I, D) / 8).to(dtype), (torch.randn(E, D, I) / 8).to(dtype)
    x, weights = torch.randn(rows, D).to(dtype), torch.rand(rows, k).to(dtype)
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(rows)])
    got, code = compiled_code(routed, x, weights, ids, w_gate_up, w_down)
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got, routed(x, weights, ids, w_gate_up, w_down), atol=tolerance, rtol=tolerance)
    # gate/up and down each one kernel call taking the experts by id: no BLAS call, no buffer of
    # the k experts' gathered weights
    assert code.count("torch.ops.deepinfer.float_matmul.default(") == 2, code
    assert "extern_kernels.bmm(" not in code, code
    assert f"({rows}, {k}, {2 * I}, {D})" not in code and f"({rows}, {k}, {D}, {I})" not in code, code


def test_fp8_experts_are_decoded_inside_the_reduction():
    torch.manual_seed(0)
    E, k, D, I = 16, 4, 192, 64  # 192 inputs: a whole and a partial 128-column scale block
    w_gate_up, w_down = torch.randn(E, 2 * I, D).to(torch.float8_e4m3fn), torch.randn(E, D, I).to(torch.float8_e4m3fn)
    s_gate_up, s_down = torch.rand(E, 2 * I, 2), torch.rand(E, D, 1)

    def fp8_routed(x, weights, ids, w_gate_up, s_gate_up, w_down, s_down):
        return gathered(x, weights, ids, lambda ids: dequantize(w_gate_up[ids], s_gate_up[ids], x.dtype),
                        lambda ids: dequantize(w_down[ids], s_down[ids], x.dtype), swiglu)

    args = (torch.randn(1, D), torch.rand(1, k), torch.randperm(E)[:k][None], w_gate_up, s_gate_up, w_down, s_down)
    got, code = compiled_code(fp8_routed, *args)
    torch.testing.assert_close(got, fp8_routed(*args), atol=1e-3, rtol=1e-4)
    assert "extern_kernels.bmm(" not in code and f"(1, {k}, {2 * I}, {D})" not in code and "float_matmul" not in code, code

