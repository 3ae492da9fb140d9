"""The inductor backend's blocked-matmul pass: 4-8 rows times a big weight become one batched
matmul over weight blocks, with the same result; other shapes are left to the BLAS call. (Inputs of
80: a shape the few-row kernel, which takes such products first, does not take; weights of 2048-4096
rows: a few rows over a smaller one are float32_products.py's reductions.)"""

import torch
import torch._inductor.config
from torch._inductor.utils import run_and_get_code

from deepinfer.compiler.backends import inductor


def layer(x4, x3, w, bias):
    # 4 rows (blocked), 4 rows with a bias (blocked addmm), 3 rows (left alone)
    return torch.nn.functional.linear(x4, w), torch.nn.functional.linear(x4, w, bias), torch.nn.functional.linear(x3, w)


def test_blocked_matmul_matches_and_applies_only_at_4_to_8_rows():
    torch.manual_seed(0)
    w, bias = torch.randn(4096, 80), torch.randn(4096)
    x4, x3 = torch.randn(4, 80), torch.randn(3, 80)
    torch._dynamo.reset()
    with torch._inductor.config.patch(post_grad_custom_pre_pass=inductor.graph_passes()):
        compiled = torch.compile(layer, dynamic=False, backend="inductor")
        results, (code, *_) = run_and_get_code(compiled, x4, x3, w, bias)
    for got, expected in zip(results, layer(x4, x3, w, bias)):
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert code.count("extern_kernels.bmm(") == 2, code  # the two 4-row products
    assert code.count("extern_kernels.mm(") == 1, code  # the 3-row one, as before


def experts_up(x, w):
    return torch.einsum("nd,efd->nef", x, w)  # a batch-of-one bmm after inductor's decompositions


def test_blocked_matmul_covers_einsum_without_batch_dimensions():
    torch.manual_seed(0)
    w, x = torch.randn(32, 64, 80), torch.randn(4, 80)
    torch._dynamo.reset()
    with torch._inductor.config.patch(post_grad_custom_pre_pass=inductor.graph_passes()):
        got, (code, *_) = run_and_get_code(torch.compile(experts_up, dynamic=False, backend="inductor"), x, w)
    torch.testing.assert_close(got, experts_up(x, w), atol=1e-4, rtol=1e-4)
    # one bmm: the 4 rows seen by each of the 32 blocks of 64 weight rows, without a copy (stride 0)
    assert code.count("extern_kernels.bmm(reinterpret_tensor(arg0_1, (32, 4, 80), (0, 80, 1), 0)") == 1, code


def test_einsum_without_batch_dimensions_keeps_blas_at_other_row_counts():
    """inductor's mm decomposition (the backend's DEFAULTS) would make any batch-of-one bmm a
    reduction that re-reads the weight per row; past one row it stays one BLAS product."""
    torch.manual_seed(0)
    w = torch.randn(64, 64, 80)
    for rows, blas_calls in ((1, 0), (2, 1), (16, 1)):
        x = torch.randn(rows, 80)
        torch._dynamo.reset()
        with torch._inductor.config.patch(post_grad_custom_pre_pass=inductor.graph_passes(),
                                          post_grad_fusion_options=inductor.DEFAULTS["post_grad_fusion_options"]):
            got, (code, *_) = run_and_get_code(torch.compile(experts_up, dynamic=False, backend="inductor"), x, w)
        torch.testing.assert_close(got, experts_up(x, w), atol=1e-4, rtol=1e-4)
        assert code.count("extern_kernels.mm(") == blas_calls, (rows, code)
