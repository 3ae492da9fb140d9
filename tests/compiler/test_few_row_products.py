"""The inductor backend's few-row pass: a product of 1 to few_rows() rows with a stored float weight,
or with one sequence's rows of the KV cache, calls deepinfer's float kernel, with eager's result;
more rows, computed weights and shapes the kernel does not take stay as inductor makes them (one
row of a computed weight: a reduction)."""

import platform

import pytest
import torch
import torch._inductor.config
from torch._inductor.utils import run_and_get_code

from deepinfer.compiler.backends import few_row_products, inductor


def layer(x, w, bias):
    # a linear, one with a bias, and an einsum without batch dimensions (a batch-of-one bmm)
    return torch.nn.functional.linear(x, w), torch.nn.functional.linear(x, w, bias), torch.einsum("nd,fd->nf", x, w)


def compiled_code(fn, *args):
    torch._dynamo.reset()
    with torch._inductor.config.patch(post_grad_custom_pre_pass=inductor.graph_passes(),
                                      post_grad_fusion_options=inductor.DEFAULTS["post_grad_fusion_options"]):
        results, (code, *_) = run_and_get_code(torch.compile(fn, dynamic=False, backend="inductor"), *args)
    return results, code


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the kernel is taken on x86 hosts (AVX2, AVX-512)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_few_rows_of_a_stored_weight_call_the_kernel_with_eagers_result(dtype):
    torch.manual_seed(0)
    # (one row of a weight of fewer than ONE_ROW_FROM_WORK elements stays inductor's reduction; a
    # small bfloat16 weight takes more rows than a big one without AMX: most_rows)
    most = {features: few_row_products.most_rows(torch.empty(features, 256, dtype=dtype)) for features in (256, 1024)}
    assert dtype == torch.float32 or most[256] == (most[1024] if "amx_tile" in few_row_products.isa_words() else 32)
    for features, rows, calls in ((1024, 1, 3), (256, 1, 0), (256, 8, 3), (256, most[256], 3), (256, most[256] + 1, 0),
                                  (1024, most[1024], 3), (1024, most[1024] + 1, 0)):
        w, bias = torch.randn(features, 256).to(dtype), torch.randn(features).to(dtype)
        x = torch.randn(rows, 256).to(dtype)
        results, code = compiled_code(layer, x, w, bias)
        for got, expected in zip(results, layer(x, w, bias)):
            tolerance = 1e-4 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(got, expected, atol=tolerance, rtol=tolerance)
        assert code.count("torch.ops.deepinfer.float_matmul.default(") == calls, (rows, code)


def cache_scores(kv, write_slots, positions, new, q):
    # a decode step's heads against its sequence's cache rows, after storing its new row (the
    # one-slot read as one_row_views.py leaves it: a select)
    kv.index_put_((write_slots, positions), new)
    return q @ kv[1].mT  # [H, C] @ [C, L]


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the kernel is taken on x86 hosts (AVX2, AVX-512)")
def test_heads_against_one_sequences_cache_rows_call_the_kernel_where_they_lie():
    torch.manual_seed(0)
    kv, new, q = torch.randn(3, 64, 96), torch.randn(1, 96), torch.randn(8, 96)
    expected_kv = kv.clone()
    expected = cache_scores(expected_kv, torch.tensor([1]), torch.tensor([5]), new, q)
    got, code = compiled_code(cache_scores, kv, torch.tensor([1]), torch.tensor([5]), new, q)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(kv, expected_kv)  # (the new row stored, and read by the product)
    assert code.count("torch.ops.deepinfer.float_matmul.default(") == 1, code


def computed_weight(x, w):
    return torch.nn.functional.linear(x, w * 2)


def test_computed_weights_and_other_shapes_stay_blas():
    torch.manual_seed(0)
    _, code = compiled_code(computed_weight, torch.randn(8, 96), torch.randn(2048, 96))
    assert "float_matmul" not in code and "extern_kernels.bmm(" in code  # (blocked_matmul's)
    _, code = compiled_code(computed_weight, torch.randn(1, 96), torch.randn(256, 96))
    assert "float_matmul" not in code and "extern_kernels.mm(" not in code and "extern_kernels.bmm(" not in code  # a reduction
    _, code = compiled_code(layer, torch.randn(8, 80), torch.randn(256, 80), torch.randn(256))  # inputs not of 32
    assert "float_matmul" not in code
