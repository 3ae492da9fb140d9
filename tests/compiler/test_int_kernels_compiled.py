"""int8 and int4 linears and experts call deepinfer's kernels (runtime/int_matmul.py) from inductor's
compiled code: a decode step's experts by id, never gathered or decoded; a prompt chunk's int4
linears decode the weight for a bf16 GEMM in a graph torch.export can save. AOTInductor's code calls the
kernels as C functions."""

import os
import subprocess
import sys
import zipfile

import pytest
import torch
import torch.nn.functional as F

from deepinfer.compiler.backends import inductor
from deepinfer.models.int_weights import IntExperts, IntLinear, IntWeights, int_tensors
from deepinfer.models.moe import gathered
from deepinfer.runtime import int_matmul
from deepinfer.runtime.backends import inductor as inductor_runtime
from deepinfer.runtime.int_matmul import DECODED_FROM_ROWS
from tests.compiler.test_gathered_matvec import compiled_code
from tests.conftest import ROOT

OUT = 96  # a linear's outputs


@pytest.mark.parametrize("bits", [8, 4])
def test_linears_and_experts_call_the_kernel_from_compiled_code(bits):
    torch.manual_seed(0)
    E, k, D, I = 16, 4, 64, 128
    gate_up, down = int_tensors(torch.randn(E, 2 * I, D), bits, 32), int_tensors(torch.randn(E, D, I), bits, 32)
    linear = IntLinear(D, OUT, IntWeights(bits))
    linear.weight.data, linear.weight_qscale.data = int_tensors(torch.randn(OUT, D), bits, 32)

    def decode_step(x, weights, ids, codes_gate_up, scales_gate_up, codes_down, scales_down):
        y = gathered(x, weights, ids, lambda ids: IntExperts(codes_gate_up, scales_gate_up, ids),
                     lambda ids: IntExperts(codes_down, scales_down, ids), lambda gate, up: F.silu(gate) * up)
        return linear(y)

    args = (torch.randn(1, D), torch.rand(1, k), torch.randperm(E)[:k][None], *gate_up, *down)
    got, code = compiled_code(decode_step, *args)
    torch.testing.assert_close(got, decode_step(*args), atol=1e-4, rtol=1e-4)
    assert code.count(f"torch.ops.deepinfer.int{bits}_matmul.default(") == 3 and "extern_kernels.mm(" not in code, code


@pytest.mark.parametrize("bits", [8, 4])
def test_a_prompt_chunks_linear_saves_through_torch_export(tmp_path, bits):
    """Many rows: int8 by the kernel still (faster than a GEMM at every prompt size measured), int4
    by a bf16 GEMM on the weight decoded."""
    linear = IntLinear(64, OUT, IntWeights(bits))
    linear.weight.data, linear.weight_qscale.data = int_tensors(torch.randn(OUT, 64), bits, 32)
    x = torch.randn(DECODED_FROM_ROWS, 64)
    program = torch.export.export(linear, (x,))
    torch.export.save(program, tmp_path / "linear.pt2")
    torch.testing.assert_close(torch.export.load(tmp_path / "linear.pt2").module()(x), linear(x))
    assert ("int8_matmul" in str(program.graph)) == (bits == 8) and "int4_matmul" not in str(program.graph)


class EveryKernel(torch.nn.Module):
    """A linear and experts in int4, experts in int8, a float linear, and int4 weights decoded."""

    def forward(self, x, codes4, scales4, experts4, expert_scales4, ids, experts8, expert_scales8, w):
        y = int_matmul.matmul(x, codes4, scales4).squeeze(1)
        y = int_matmul.matmul(y, experts4, expert_scales4, ids).sum(1) + int_matmul.matmul(y, experts8, expert_scales8, ids).sum(1)
        y = torch.ops.deepinfer.float_matmul(y, w, None).squeeze(1)
        return (y @ torch.ops.deepinfer.int4_values(codes4, scales4).float().T,)


LOAD_WITHOUT_A_COMPILER = """
import sys
from deepinfer.runtime.backends import inductor
from deepinfer.runtime.errors import BundleError
try:
    inductor.load(open(sys.argv[1], "rb").read(), None, "regions/every-kernel.aoti.pt2")
except BundleError as error:
    print(error)
"""


def test_aoti_code_calls_the_kernels_as_c_functions_and_a_host_that_cannot_build_them_is_told(tmp_path):
    """No proxy executor (boxed dispatch) between the generated code and the kernels: the same
    results as eager. Where the kernels cannot be built, loading such a region says why and what to do."""
    torch.manual_seed(0)
    D = 64
    args = (torch.randn(3, D), *int_tensors(torch.randn(D, D), 4, 32), *int_tensors(torch.randn(4, D, D), 4, 32),
            torch.tensor([[0, 2], [1, 5], [3, 3]]), *int_tensors(torch.randn(4, D, D), 8, 32), torch.randn(D, D))
    package = torch._inductor.aoti_compile_and_package(torch.export.export(EveryKernel(), args), package_path=str(tmp_path / "r.pt2"),
                                                       inductor_configs={"aot_inductor.custom_ops_to_c_shims": inductor.kernel_shims()})
    with zipfile.ZipFile(package) as archive:
        wrapper = next(archive.read(name).decode() for name in archive.namelist() if name.endswith(".wrapper.cpp"))
    assert "proxy_executor->call_function" not in wrapper
    for op in int_matmul.C_SHIMS:
        assert f"AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_cpu_{op}(" in wrapper, op
    got = inductor_runtime.load(open(package, "rb").read(), None, "r.pt2")(*args)[0]
    torch.testing.assert_close(got, EveryKernel()(*args)[0], atol=0, rtol=0)

    environment = {**os.environ, "DEEPINFER_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": str(ROOT), "CXX": str(tmp_path / "no-compiler")}
    result = subprocess.run([sys.executable, "-c", LOAD_WITHOUT_A_COMPILER, package], env=environment, capture_output=True, text=True,
                            timeout=600, cwd=ROOT)
    assert result.stdout.startswith("regions/every-kernel.aoti.pt2: this region's compiled code calls deepinfer's CPU kernels"), result
    assert "could not be built on this host" in result.stdout and "Install g++ (or set CXX" in result.stdout, result.stdout
