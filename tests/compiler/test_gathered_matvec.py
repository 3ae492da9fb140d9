"""The inductor backend's gathered-matvec pass: the routed experts' decode products read the
gathered weights in place (no copy of the k experts' weights, fp8 ones decoded in the kernel),
with the same result."""

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


@pytest.mark.parametrize("rows", [1, 3])
def test_routed_experts_read_gathered_weights_in_place(rows):
    torch.manual_seed(0)
    E, k, D, I = 16, 4, 96, 64
    w_gate_up, w_down = torch.randn(E, 2 * I, D), torch.randn(E, D, I)
    x, weights = torch.randn(rows, D), torch.rand(rows, k)
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(rows)])
    got, code = compiled_code(routed, x, weights, ids, w_gate_up, w_down)
    torch.testing.assert_close(got, routed(x, weights, ids, w_gate_up, w_down), atol=1e-4, rtol=1e-4)
    assert "extern_kernels.bmm(" not in code, code
    # no buffer holds the k experts' gathered weights: the kernels load them through the ids
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
    assert "extern_kernels.bmm(" not in code and f"(1, {k}, {2 * I}, {D})" not in code, code

