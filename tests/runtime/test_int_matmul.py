"""deepinfer::int8_matmul, int4_matmul, int4_values and float_matmul (runtime/int_matmul.py), and the
library's latent_attention (runtime/latent_attention.py): the kernels built here do the reference's
arithmetic, in their AVX-512 (VNNI, BF16), AVX2 and plain C++ builds, and the integer ones stay
within the activations' 8-bit rounding of the float product; without a compiler the reference
runs, saying so."""

import os
import subprocess
import sys

import pytest
import torch

from deepinfer.models.int_weights import int4_codes, int8_codes, int_tensors
from deepinfer.runtime import grouped_matmul, int_matmul
from tests.conftest import ROOT

# (X rows, k experts a row, E, rows, in, group): groups of one to four blocks; rows of one expert
# make runs of 4 at most for integer weights (6: 4 and 2; 11: 4, 4 and 3), of 8 for float ones (11:
# 8 and 3); sorted ids make runs of rows that share an expert; -1 and E: no expert here.
SHAPES = [(1, 4, 16, 96, 1024, 32), (3, 2, 4, 40, 192, 64), (6, 1, 3, 24, 320, 32), (5, 1, 2, 16, 256, 128), (6, 1, 1, 8, 96, 32),
          (11, 1, 1, 16, 64, 32)]


@pytest.fixture(autouse=True)
def two_threads():
    """The kernels split their tasks over threads: checked with two, whatever this test process was
    given (`make test` gives each of its two one)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def case(X, k, E, rows, width, group, bits=4, seed=0):
    generator = torch.Generator().manual_seed(seed)
    codes, scales = int_tensors(torch.randn(E, rows, width, generator=generator), bits, group)
    x = torch.randn(X, width, generator=generator) * torch.rand(X, 1, generator=generator) * 4
    x[0, :32] = 0  # (a block of zeros: its scale is 0)
    ids = torch.randint(-1, E + 1, (X, k), generator=generator).sort(dim=0).values
    return x, codes, scales, ids


def float_product(x, codes, scales, ids):
    w = int_matmul.values(codes, scales, torch.float32)[ids.clamp(0, codes.shape[0] - 1)]  # [X, k, rows, in]
    return torch.einsum("xi,xkri->xkr", x, w) * ((ids >= 0) & (ids < codes.shape[0]))[..., None]


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("shape", SHAPES)
def test_the_kernel_does_the_references_arithmetic_close_to_the_float_product(shape, bits):
    x, codes, scales, ids = case(*shape, bits=bits)
    got = int_matmul.matmul(x, codes, scales, ids)
    torch.testing.assert_close(got, int_matmul.reference(x, codes, scales, ids), atol=1e-4, rtol=1e-5)
    exact = float_product(x, codes, scales, ids)
    assert (got - exact).norm() < 0.02 * exact.norm()  # (8-bit activations: ~1% of the product)
    linear = int_matmul.matmul(x, codes[0], scales[0])
    torch.testing.assert_close(linear, int_matmul.reference(x, codes[0], scales[0], None), atol=1e-4, rtol=1e-5)


def float_case(X, k, E, rows, width, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    w = torch.randn(E, rows, width, generator=generator).to(dtype)
    x = torch.randn(X, width, generator=generator)
    return x, w, torch.randint(-1, E + 1, (X, k), generator=generator).sort(dim=0).values


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [shape[:5] for shape in SHAPES])
def test_the_few_row_float_kernel_does_the_references_arithmetic(shape, dtype):
    """float_matmul: float32 weights times x; bfloat16 ones times x rounded to bfloat16 (as a bf16
    GEMM computes), with ids (runs of 4 and 2 rows, no expert here) and without."""
    x, w, ids = float_case(*shape, dtype)
    got = torch.ops.deepinfer.float_matmul(x, w, ids)
    torch.testing.assert_close(got, int_matmul.float_reference(x, w, ids), atol=1e-4, rtol=1e-4)
    assert not got[(ids < 0) | (ids >= w.shape[0])].any()
    linear = torch.ops.deepinfer.float_matmul(x, w[0], None)
    torch.testing.assert_close(linear, int_matmul.float_reference(x, w[0], None), atol=1e-4, rtol=1e-4)


def test_int4_pack_interleaves_rows_of_8_and_unpack_undoes_it():
    q, scale_zero = torch.randint(0, 16, (2, 16, 64)), torch.randn(2, 16, 2, 2).bfloat16()
    codes, pairs = int_matmul.pack_int4(q, scale_zero)
    assert codes.shape == (2, 16, 32) and pairs.shape == scale_zero.shape
    # expert 1, row block 1, unit j = 3 (columns 24-31), row r = 5, i = 2: column 26 low, 30 high
    assert codes[1].flatten()[(8 * 32 + 3 * 32 + 4 * 5 + 2)] == q[1, 13, 26] | (q[1, 13, 30] << 4)
    assert torch.equal(pairs[1].view(-1, 2)[8 * 2 + 1 * 8 + 5], scale_zero[1, 13, 1])  # block 1, group 1, row 5
    unpacked, unpacked_pairs = int_matmul.unpack_int4(codes, pairs)
    assert torch.equal(unpacked, q.float()) and torch.equal(unpacked_pairs, scale_zero)
    scale, zero = scale_zero.float().unbind(-1)
    expected = (q.float().view(2, 16, 2, 32) - 8) * scale[..., None] + zero[..., None]
    torch.testing.assert_close(int_matmul.values(codes, pairs, torch.float32), expected.view(2, 16, 64))
    assert torch.equal(torch.ops.deepinfer.int4_values(codes, pairs), int_matmul.values(codes, pairs, torch.bfloat16))


def test_int8_pack_interleaves_rows_of_8_and_unpack_undoes_it():
    codes = torch.randint(-127, 128, (2, 16, 64), dtype=torch.int8)
    packed = int_matmul.pack_int8(codes)
    assert packed[1].flatten()[8 * 64 + 3 * 32 + 4 * 5 + 2] == codes[1, 13, 14]  # expert 1, row block 1, unit 3, row 5, i 2
    assert torch.equal(int_matmul.unpack_int8(packed), codes)
    w = torch.randn(2, 16, 64)
    stored, scales = int_tensors(w, 8, 32)
    assert torch.equal(int_matmul.unpack_int8(stored), int8_codes(w)[0]) and torch.equal(scales, int8_codes(w)[1])


def test_a_prompts_int4_experts_take_one_kernel_call_and_the_busiest_a_gemm_on_the_weight_decoded():
    """deepinfer::grouped_int4_matmul: rows sorted by expert; the experts of fewer than
    DECODED_FROM_ROWS rows by id in one call, the others decoded (experts 2 and 3 one batched GEMM,
    expert 2's rows padded); rows past the last end zeros. Each equal to that expert's own product."""
    many = int_matmul.DECODED_FROM_ROWS
    x, codes, scale_zero, _ = case(3 * many + 39, 1, 6, 16, 64, 32)
    ends = torch.tensor([3, 3, 3 + many, 12 + 2 * many, 32 + 2 * many, 32 + 3 * many], dtype=torch.int32)  # (7 rows: no expert)
    got = torch.ops.deepinfer.grouped_int4_matmul(x, codes, scale_zero, ends)
    start = 0
    for expert, end in enumerate(ends.tolist()):
        assert torch.equal(got[start:end], int_matmul.product(x[start:end], codes[expert], scale_zero[expert]))
        start = end
    assert not got[start:].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_prompts_float_experts_take_the_kernel_and_the_busiest_a_gemm(dtype):
    """deepinfer::grouped_matmul: rows sorted by expert; the experts of fewer than gemm_from_rows
    rows by the kernel, the others a GEMM; rows past the last end zeros. Each close to that
    expert's own product."""
    x, w, _ = float_case(130, 1, 4, 16, 64, dtype)
    many = min(grouped_matmul.gemm_from_rows(w), 60)
    ends = torch.tensor([3, 3, 3 + many, 8 + 2 * many], dtype=torch.int32)  # (the rest: no expert)
    got = torch.ops.deepinfer.grouped_matmul(x.to(dtype), w, ends)
    start = 0
    for expert, end in enumerate(ends.tolist()):
        expected = (x[start:end].to(dtype).float() @ w[expert].float().T).to(dtype)
        torch.testing.assert_close(got[start:end], expected, atol=1e-4, rtol=1e-4 if dtype == torch.float32 else 1e-2)
        start = end
    assert not got[start:].any()


def test_the_experts_gemms_go_in_runs_while_their_padding_is_cheap():
    """Consecutive experts with rows for a GEMM share one batched GEMM, padded to the run's busiest
    expert: a run ends where an expert's padding would pass PADDING_PRODUCTS, or at `most` experts."""
    budget = grouped_matmul.PADDING_PRODUCTS  # (rows of 1024 elements: budget // 1024 padding rows a run may take on)
    rows = budget // 1024
    assert grouped_matmul.gemm_runs([3, 0, 64, 70, 20, 64, 64 + rows, 64 + rows, 64], 64, 8, 1024) == [(2, 4), (5, 9)]
    assert grouped_matmul.gemm_runs([64, 65 + rows, 65 + rows, 64], 64, 8, 1024) == [(0, 1), (1, 3), (3, 4)]
    assert grouped_matmul.gemm_runs([64] * 5, 64, 2, 1024) == [(0, 2), (2, 4), (4, 5)]
    assert grouped_matmul.gemm_runs([1, 2, 0], 0, 8, 1024) == [(0, 2)]


CHECK = """
import torch
from deepinfer.runtime import int_matmul, latent_attention
from tests.runtime.test_int_matmul import SHAPES, case, float_case
from tests.runtime.test_latent_attention import CASES, case as attention_case
print("built" if int_matmul.KERNEL_BUILT else "reference")
for shape in CASES:
    args = attention_case(*shape)
    torch.testing.assert_close(torch.ops.deepinfer.latent_attention(*args), latent_attention.reference(*args), atol=2e-6, rtol=1e-5)
for shape in SHAPES:
    for dtype in (torch.float32, torch.bfloat16):
        x, w, ids = float_case(*shape[:5], dtype)
        torch.testing.assert_close(torch.ops.deepinfer.float_matmul(x, w, ids), int_matmul.float_reference(x, w, ids), atol=1e-4, rtol=1e-4)
    for bits in (8, 4):
        x, codes, scales, ids = case(*shape, bits=bits)
        torch.testing.assert_close(int_matmul.matmul(x, codes, scales, ids), int_matmul.reference(x, codes, scales, ids),
                                   atol=1e-4, rtol=1e-5)
    assert torch.equal(torch.ops.deepinfer.int4_values(codes, scales), int_matmul.values(codes, scales, torch.bfloat16))
"""


def run_check(tmp_path, **env):
    environment = {**os.environ, "DEEPINFER_CACHE_DIR": str(tmp_path), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "2", **env}
    return subprocess.run([sys.executable, "-c", CHECK], env=environment, capture_output=True, text=True, timeout=600, cwd=ROOT)


@pytest.mark.parametrize("march", ["skylake-avx512", "haswell", "x86-64"])
def test_the_avx2_and_plain_builds_agree_with_the_reference(tmp_path, march):
    """What an AVX-512 host without VNNI and BF16 (bfloat16 weights widened), an AVX2-only host
    (maddubs instead of VNNI) and a CPU without AVX2 run."""
    if march == "skylake-avx512" and "avx512f" not in open("/proc/cpuinfo").read():
        pytest.skip("this CPU has no AVX-512 to run that build")
    result = run_check(tmp_path, DEEPINFER_KERNEL_MARCH=march)
    assert result.returncode == 0 and result.stdout.strip() == "built", result.stderr[-3000:]


def test_without_a_compiler_the_reference_runs_and_says_so(tmp_path):
    result = run_check(tmp_path, CXX=str(tmp_path / "no-compiler"))
    assert result.returncode == 0 and result.stdout.strip() == "reference", result.stderr[-3000:]
    assert "the int8/int4 and few-row float kernels could not be built here" in result.stderr and "Install g++ (or set CXX)" in result.stderr
