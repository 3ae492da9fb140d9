"""An inductor graph pass: float8_e4m3fn codes converted to float by integer and float32 ops that
inductor vectorizes as they are, in place of its own conversion.

x86 has no fp8 conversion instruction (before AVX10.2), and inductor's vectorized fp8 -> float32
convert is a long emulation; a weight kept fp8 is decoded at every decode step, so that convert
is the step's cost (bench/fp8_bench.py: kept fp8 decoded slower than float32 weights, a quarter of
the bytes notwithstanding). An e4m3fn code s eeee mmm is exactly the float32 whose sign is s,
whose exponent and mantissa bits 30..20 are 0 eeee mmm, times 2^120 (127 - 7, the exponent
biases' difference): a normal code becomes a normal float32 of the right exponent, a subnormal
code (eeee = 0) a float32 subnormal that the product scales exactly. 0x7F and 0xFF are NaN.
A GEMV over a 4096x4096 fp8 weight with its dequantization (torch.compile, 2 cores, AMD EPYC Zen
4): 5.5 -> 2.8 ms with AVX-512, 23.8 -> 16.2 ms held to AVX2 (float32 weights: 3.4 ms).
"""

import torch
from torch._inductor.pattern_matcher import Arg, CallFunction, PatternMatcherPass, register_graph_pattern

patterns = PatternMatcherPass(pass_name="deepinfer_fp8_decode")

SIGN = -(1 << 31)  # int32 with only bit 31 set


def decoded(codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    b = codes.view(torch.int8).to(torch.int32)  # sign-extended: bit 31 is the code's sign
    value = ((b & SIGN) | ((b & 0x7F) << 20)).view(torch.float32) * 2.0 ** 120
    return torch.where((b & 0x7F) == 0x7F, float("nan"), value).to(dtype)


def _fp8_on_cpu(match) -> bool:
    codes = match.args[0].meta.get("val")
    return codes is not None and codes.dtype == torch.float8_e4m3fn and codes.device.type == "cpu"


@register_graph_pattern(CallFunction(torch.ops.prims.convert_element_type.default, Arg(), Arg()), pass_dict=patterns,
                        extra_check=_fp8_on_cpu)
def _decode(match, codes, dtype):
    match.replace_by_example(lambda c: decoded(c, dtype), [codes])
