"""The inductor backend's float32-products passes: a bf16 matrix product is computed in float32
from its bf16 operands and rounded to bf16 once -- a one-row product as a reduction that reads the
bf16 weight as stored (every host), a chunk's as a BLAS call on float32 copies (hosts without
native bf16 math; with it, chunks over small matrices). A few-row product over a small matrix is
a reduction in float32 too."""

import torch
import torch._inductor.config
import torch.nn.functional as F
from torch._inductor.utils import run_and_get_code

from deepinfer.compiler.backends import float32_products, inductor

BF16 = torch.bfloat16
SHAPES = ((1, 96), (40, 96), (320, 96), (256, 96), (1, 4, 32), (4, 32, 48), (320,), (1, 4, 64), (1, 64, 48))  # layer's arguments


def layer(row, rows, w_row, w_rows, q, w_heads, bias, probs, cache):
    # a decode row and a 40-row chunk times weights (past the few-row kernel's rows), a per-head product (MLA's absorbed einsum),
    # a decode row through a linear with a bias (addmm), and a decode step's 4 heads summing a
    # short cache (a few rows over a small matrix)
    return (F.linear(row, w_row), F.linear(rows, w_rows), torch.einsum("thn,hnr->thr", q, w_heads),
            F.linear(row, w_row, bias), torch.einsum("bht,btr->bhr", probs, cache))


def in_float32(*args):
    """What the pass promises: each product of the bf16 values in float32, rounded to bf16 once."""
    return tuple(out.to(BF16) for out in layer(*(t.float() for t in args)))


def compiled(bf16_products_in_float32: bool, *args):
    torch._dynamo.reset()
    with torch._inductor.config.patch(post_grad_custom_pre_pass=inductor.graph_passes(bf16_products_in_float32),
                                      post_grad_fusion_options=inductor.DEFAULTS["post_grad_fusion_options"]):
        return run_and_get_code(torch.compile(layer, dynamic=False, backend="inductor"), *args)


def test_bf16_products_are_computed_in_float32():
    torch.manual_seed(0)
    args = tuple(torch.randn(shape).to(BF16) for shape in SHAPES)
    results, (code, *_) = compiled(True, *args)
    for got, expected in zip(results, in_float32(*args)):
        assert got.dtype == BF16
        torch.testing.assert_close(got, expected, atol=0, rtol=2 ** -7)  # at most the last bf16 bit apart
    # the 40-row product: one BLAS call, on float32 copies of its operands (the weight's in its stored order)
    assert code.count("extern_kernels.mm(") == 1 and "empty_strided_cpu((256, 96), (96, 1), torch.float32)" in code, code
    # the one-row and few-row products: reductions that read the matrices as stored, never a float32 copy of one
    assert "extern_kernels.bmm(" not in code and "extern_kernels.addmm(" not in code, code
    for weight in ("(320, 96)", "(96, 320)", "(4, 32, 48)", "(1, 64, 48)"):
        assert f"empty_strided_cpu({weight}" not in code, code


def test_with_native_bf16_chunk_products_stay_bf16_but_small_ones():
    """A host with native bf16 math multiplies a chunk's bf16 operands as they are, but for a small
    matrix (SMALL_MATRIX elements): BLAS on float32 copies, as without (oneDNN's fixed cost)."""
    torch.manual_seed(0)
    big = (SHAPES[0], SHAPES[1], SHAPES[2], (float32_products.SMALL_MATRIX // 96 + 8, 96), *SHAPES[4:])
    args = tuple(torch.randn(shape).to(BF16) for shape in big)
    _, (code, *_) = compiled(False, *args)
    assert f"extern_kernels.mm(arg2_1, reinterpret_tensor(arg3_1, (96, {big[3][0]})" in code, code  # the bf16 operands themselves
    args = tuple(torch.randn(shape).to(BF16) for shape in SHAPES)
    results, (code, *_) = compiled(False, *args)
    torch.testing.assert_close(results[1], in_float32(*args)[1], atol=0, rtol=2 ** -7)
    assert code.count("extern_kernels.mm(") == 1 and "empty_strided_cpu((256, 96), (96, 1), torch.float32)" in code, code


def test_float32_few_row_products_over_small_matrices_are_reductions():
    """float32: a decode step's heads over a short cache (a few rows over a small matrix) and the
    per-head product are reductions, without the BLAS call's fixed cost (the 40-row chunk is one BLAS
    call). The same results as eager's float32."""
    torch.manual_seed(0)
    args = tuple(torch.randn(shape) for shape in SHAPES)
    results, (code, *_) = compiled(False, *args)
    for got, expected in zip(results, layer(*args)):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert code.count("extern_kernels.mm(") == 1 and "extern_kernels.bmm(" not in code, code


def big_products(xs, w_experts, rows, w_rows, bias, probs, cache):
    # grouped experts (MoE prompt chunks: each expert's rows times its weight), a linear with a
    # bias, and a decode step's 24 heads summing a long cache (inner dimension 640); rows past FEW_ROWS
    return (torch.einsum("ecd,efd->ecf", xs, w_experts), F.linear(rows, w_rows, bias),
            torch.einsum("bht,btr->bhr", probs, cache))


def test_big_matrices_are_copied_to_float32_a_piece_at_a_time(monkeypatch):
    """A matrix whose float32 copy passes PIECE_BYTES is multiplied a piece at a time (experts of
    a batched product; column blocks of a linear; blocks of a long inner dimension, summed), each
    piece's copy made before its BLAS call: the same products as one call."""
    monkeypatch.setattr(float32_products, "PIECE_BYTES", 2 * 128 * 96 * 4)  # two experts; 256 columns; 512 inner
    torch.manual_seed(0)
    shapes = ((6, 24, 96), (6, 128, 96), (40, 96), (320, 96), (320,), (1, 24, 640), (1, 640, 48))
    args = tuple(torch.randn(shape).to(BF16) for shape in shapes)
    torch._dynamo.reset()
    with torch._inductor.config.patch(post_grad_custom_pre_pass=inductor.graph_passes(True)):
        results, (code, *_) = run_and_get_code(torch.compile(big_products, dynamic=False, backend="inductor"), *args)
    expected = tuple(out.to(BF16) for out in big_products(*(t.float() for t in args)))
    for got, want in zip(results, expected):
        torch.testing.assert_close(got, want, atol=2 ** -7, rtol=2 ** -7)  # (the inner pieces' sum adds in another order)
    assert code.count("extern_kernels.bmm(") == 3, code  # 6 experts, two a piece
    assert code.count("extern_kernels.addmm(") == 2, code  # columns 0-255, 256-319
    assert code.count("extern_kernels.mm(") == 2, code  # inner 0-511, 512-639 (a batch of one: mm)
    for whole in ("(6, 96, 128)", "(96, 320)", "(1, 640, 48)"):
        assert f"empty_strided_cpu({whole}" not in code, code  # no float32 copy of a whole matrix
