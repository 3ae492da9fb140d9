"""The neuron backend's transform of a bundle's fp8 weights for trn2, which reads float8_e4m3fn
bytes as IEEE e4m3 (bias 7 like e4m3fn, but exponent 1111 is inf/NaN: largest value 240, not 448).

As the field notes do it: each fp8 value v is re-encoded as the IEEE e4m3 byte of v / 2 (448 ->
224) and its block scale doubles, so weight x scale is unchanged. Halving is exact except for
the 16 smallest-magnitude codes with an odd mantissa (|v| < 2^-5: the subnormals and the lowest
binade), whose halves fall between two IEEE codes and round to the even one: an error of at most
2^-9 after the doubled scale, against a block maximum of 448. NaN stays NaN, zeros keep their sign.
"""

import torch

from deepinfer.models.quantization import E8M0, FP8

EXPONENT_BIAS = 7


def ieee_e4m3_value(code: int) -> float:
    sign = -1.0 if code & 0x80 else 1.0
    exponent, mantissa = (code >> 3) & 0xF, code & 0x7
    if exponent == 0xF:
        return sign * float("inf") if mantissa == 0 else float("nan")
    if exponent == 0:
        return sign * 2.0 ** (1 - EXPONENT_BIAS) * mantissa / 8
    return sign * 2.0 ** (exponent - EXPONENT_BIAS) * (1 + mantissa / 8)


def e4m3fn_value(code: int) -> float:
    return torch.tensor([code], dtype=torch.uint8).view(FP8).float().item()


def _nearest_ieee_code(value: float) -> int:
    """Round to nearest IEEE e4m3 code, ties to the even mantissa; NaN to 0x7F."""
    if value != value:
        return 0x7F
    sign = 0x80 if value < 0 or (value == 0 and str(value).startswith("-")) else 0
    finite = [code | sign for code in range(0x78)]  # exponents 0..14, this sign
    return min(finite, key=lambda code: (abs(ieee_e4m3_value(code) - value), code & 1))


def _halving_table() -> torch.Tensor:
    return torch.tensor([_nearest_ieee_code(e4m3fn_value(code) / 2) for code in range(256)], dtype=torch.uint8)


HALVED = _halving_table()  # e4m3fn code -> IEEE e4m3 code of half its value


def to_trn2(name: str, tensor: torch.Tensor, scales_for: torch.dtype | None = None) -> torch.Tensor:
    """A bundle weight as trn2 reads it: fp8 bytes re-encoded halved, and the scales of fp8
    weights (`scales_for` is the dtype of the weight a scale tensor belongs to) doubled: float32
    times 2, e8m0 bytes plus 1 (the field notes' "ue8m0 + 1"). Anything else (fp4 experts and
    their scales included) unchanged."""
    if tensor.dtype == FP8:
        return HALVED[tensor.view(torch.uint8).int()].view(FP8)
    if scales_for != FP8:
        return tensor
    if tensor.dtype == E8M0:
        if int(tensor.max()) >= 254:  # 2^127 doubled is past e8m0 (255 is NaN)
            raise ValueError(f"{name}: an e8m0 scale of 2^127 or NaN cannot be doubled for trn2.")
        return tensor + 1
    return tensor * 2
