"""The neuron backend's fp8 transform for trn2 (IEEE e4m3 reading of fp8 bytes), bit-exact on CPU:
every one of the 256 codes, the scales, and the round trip back through torch's own e4m3fn."""

import math

import pytest
import torch

from deepinfer.compiler.backends import backend_module
from deepinfer.compiler.backends.neuron_fp8 import HALVED, e4m3fn_value, ieee_e4m3_value, to_trn2

FP8 = torch.float8_e4m3fn
# Halving is inexact only where the half of an odd mantissa falls between codes: exponent field
# 0 (subnormals) or 1 (the lowest normal binade), mantissa odd, either sign.
INEXACT = {sign | exponent << 3 | mantissa for sign in (0, 0x80) for exponent in (0, 1) for mantissa in (1, 3, 5, 7)}


def test_ieee_e4m3_decoding_follows_the_format():
    assert ieee_e4m3_value(0x77) == 240.0 and ieee_e4m3_value(0xF7) == -240.0  # largest finite
    assert ieee_e4m3_value(0x78) == math.inf and math.isnan(ieee_e4m3_value(0x79))
    assert ieee_e4m3_value(0x08) == 2.0**-6 and ieee_e4m3_value(0x01) == 2.0**-9  # smallest normal, subnormal
    assert e4m3fn_value(0x7E) == 448.0 and math.isnan(e4m3fn_value(0x7F))  # (the checkpoint's format)


def test_every_code_halves_exactly_or_rounds_to_even_by_at_most_half_a_step():
    for code in range(256):
        value, halved = e4m3fn_value(code), int(HALVED[code])
        if math.isnan(value):
            assert math.isnan(ieee_e4m3_value(halved)), hex(code)
        elif code in INEXACT:
            assert abs(2 * ieee_e4m3_value(halved) - value) == 2.0**-9 and halved & 1 == 0, hex(code)
        else:
            assert 2 * ieee_e4m3_value(halved) == value and math.copysign(1, ieee_e4m3_value(halved)) == math.copysign(1, value), hex(code)
    assert int(HALVED[0x7E]) == 0x76 and ieee_e4m3_value(0x76) == 224.0  # 448 -> 224, inside trn2's 240


def test_round_trip_through_torch_e4m3fn_restores_every_exact_code():
    for code in set(range(256)) - INEXACT - {0x7F, 0xFF}:
        back = torch.tensor([2 * ieee_e4m3_value(int(HALVED[code]))]).to(FP8).view(torch.uint8).item()
        assert back == code, hex(code)


def test_to_trn2_rewrites_fp8_weights_and_doubles_their_scales_only():
    weight = torch.arange(256, dtype=torch.uint8).view(FP8).reshape(16, 16)
    assert torch.equal(to_trn2("layers.1.o_proj.weight", weight).view(torch.uint8).flatten(), HALVED)
    scales = torch.tensor([[0.5, 3.0]])
    assert torch.equal(to_trn2("layers.1.o_proj.weight_scale_inv", scales, FP8), torch.tensor([[1.0, 6.0]]))
    e8m0 = torch.tensor([[0, 127, 200]], dtype=torch.uint8)  # 2^-127, 1, 2^73
    assert to_trn2("layers.1.attn.wq_a.weight_scale_inv", e8m0, FP8).tolist() == [[1, 128, 201]]
    fp4_scales = torch.tensor([[127]], dtype=torch.uint8)  # fp4 experts are not re-encoded, nor their scales
    assert to_trn2("layers.1.ffn.experts_w2_scale_inv", fp4_scales, torch.uint8) is fp4_scales
    with pytest.raises(ValueError, match="cannot be doubled"):
        to_trn2("layers.1.attn.wq_a.weight_scale_inv", torch.tensor([254], dtype=torch.uint8), FP8)
    router = torch.randn(8, 4)
    assert to_trn2("layers.1.mlp.gate.weight", router) is router
    assert backend_module("neuron").transform_weight is to_trn2  # what the compiler applies to a neuron bundle's weights
