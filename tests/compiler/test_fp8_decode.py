"""The inductor backend's fp8-decode pass: float8_e4m3fn codes become floats by integer ops and
one float32 product, exactly as torch converts them (every code: normal, subnormal, zero, NaN)."""

import torch

from tests.compiler.test_gathered_matvec import compiled_code

FP8 = torch.float8_e4m3fn


def test_every_fp8_code_decodes_exactly():
    codes = torch.arange(256, dtype=torch.uint8).repeat(4).view(FP8)  # 1024: the vectorized loop, not only its tail
    got, code = compiled_code(lambda c: (c.float(), c.to(torch.bfloat16)), codes)
    for value, dtype in zip(got, (torch.float32, torch.bfloat16)):
        torch.testing.assert_close(value, codes.to(dtype), atol=0, rtol=0, equal_nan=True)
    assert "c10::bit_cast<int8_t>" in code, code  # the codes were read as bytes: the pass replaced the convert


def test_a_dequantized_fp8_product_matches_torch():
    torch.manual_seed(0)
    weight, scales, x = (torch.randn(64, 256) * 0.05).to(FP8), torch.rand(64, 2), torch.randn(1, 256)

    def product(x, weight, scales):  # models/quantization.py's dequantize, 128-column scale blocks
        return x @ (weight.float() * scales.repeat_interleave(128, 1)).t()

    got, _ = compiled_code(product, x, weight, scales)
    torch.testing.assert_close(got, product(x, weight, scales), atol=1e-5, rtol=1e-5)
