"""deepinfer::int4_matmul (runtime/int4_matmul.py): the kernel built here does the reference's
arithmetic, in its AVX-512 VNNI, AVX2 and plain C++ builds, and stays within the activations'
8-bit rounding of the float product; without a compiler the reference runs, saying so."""

import os
import subprocess
import sys

import pytest
import torch

from deepinfer.models.int_weights import int4_codes
from deepinfer.runtime import int4_matmul
from tests.conftest import ROOT

# (X rows, k experts a row, E, rows, in, group): in 192 and 320 end in blocks the 8-block loop
# leaves to its tail; sorted ids make runs of rows that share an expert; -1 and E: no expert here.
SHAPES = [(1, 4, 16, 96, 1024, 32), (3, 2, 4, 40, 192, 64), (6, 1, 3, 24, 320, 32), (5, 1, 2, 16, 256, 128)]


def case(X, k, E, rows, width, group, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q, scale_zero = int4_codes(torch.randn(E, rows, width, generator=generator), group)
    x = torch.randn(X, width, generator=generator) * torch.rand(X, 1, generator=generator) * 4
    x[0, :32] = 0  # (a block of zeros: its scale is 0)
    ids = torch.randint(-1, E + 1, (X, k), generator=generator).sort(dim=0).values
    return x, int4_matmul.pack(q), scale_zero, ids


def float_product(x, codes, scale_zero, ids):
    w = int4_matmul.values(codes, scale_zero, torch.float32)[ids.clamp(0, codes.shape[0] - 1)]  # [X, k, rows, in]
    return torch.einsum("xi,xkri->xkr", x, w) * ((ids >= 0) & (ids < codes.shape[0]))[..., None]


@pytest.mark.parametrize("shape", SHAPES)
def test_the_kernel_does_the_references_arithmetic_close_to_the_float_product(shape):
    x, codes, scale_zero, ids = case(*shape)
    got = torch.ops.deepinfer.int4_matmul(x, codes, scale_zero, ids)
    torch.testing.assert_close(got, int4_matmul.reference(x, codes, scale_zero, ids), atol=1e-4, rtol=1e-5)
    exact = float_product(x, codes, scale_zero, ids)
    assert (got - exact).norm() < 0.02 * exact.norm()  # (8-bit activations: ~1% of the product)
    linear = torch.ops.deepinfer.int4_matmul(x, codes[0], scale_zero[0], None)
    torch.testing.assert_close(linear, int4_matmul.reference(x, codes[0], scale_zero[0], None), atol=1e-4, rtol=1e-5)


def test_pack_and_values_lay_out_the_columns_in_order():
    q = torch.randint(0, 16, (3, 128))
    codes = int4_matmul.pack(q)
    assert codes.shape == (3, 64) and codes[0, 5] == q[0, 5] | (q[0, 37] << 4)
    scale_zero = torch.tensor([[1.0, 0.0]]).bfloat16().expand(3, 4, 2)  # scale 1, zero 0: w = q - 8
    assert torch.equal(int4_matmul.values(codes, scale_zero, torch.float32), q.float() - 8)


CHECK = """
import torch
from deepinfer.runtime import int4_matmul
from tests.runtime.test_int4_matmul import SHAPES, case
print("built" if int4_matmul.KERNEL_BUILT else "reference")
for shape in SHAPES:
    x, codes, scale_zero, ids = case(*shape)
    torch.testing.assert_close(torch.ops.deepinfer.int4_matmul(x, codes, scale_zero, ids),
                               int4_matmul.reference(x, codes, scale_zero, ids), atol=1e-4, rtol=1e-5)
"""


def run_check(tmp_path, **env):
    environment = {**os.environ, "DEEPINFER_CACHE_DIR": str(tmp_path), "PYTHONPATH": str(ROOT), **env}
    return subprocess.run([sys.executable, "-c", CHECK], env=environment, capture_output=True, text=True, timeout=600, cwd=ROOT)


@pytest.mark.parametrize("march", ["haswell", "x86-64"])
def test_the_avx2_and_plain_builds_agree_with_the_reference(tmp_path, march):
    """What an AVX2-only host (maddubs instead of VNNI) and a CPU without AVX2 run."""
    result = run_check(tmp_path, DEEPINFER_KERNEL_MARCH=march)
    assert result.returncode == 0 and result.stdout.strip() == "built", result.stderr[-3000:]


def test_without_a_compiler_the_reference_runs_and_says_so(tmp_path):
    result = run_check(tmp_path, CXX=str(tmp_path / "no-compiler"))
    assert result.returncode == 0 and result.stdout.strip() == "reference", result.stderr[-3000:]
    assert "the int4 kernel could not be built here" in result.stderr and "Install g++ (or set CXX)" in result.stderr
