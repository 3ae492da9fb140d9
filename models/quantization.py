"""DeepSeek's released weight formats: read as they are, kept quantized, dequantized in the graph.

fp8, block-scaled (the V3/R1 release): `quantization_config` is {quant_method: fp8, fmt: e4m3,
activation_scheme: dynamic, weight_block_size: [128, 128]}. A quantized linear weight W [out, in]
is float8_e4m3fn, with a float32 `<key>_scale_inv` [ceil(out/128), ceil(in/128)], and
W = fp8 value x the scale of its 128x128 block (DeepSeek's `weight_dequant`; grids end in partial
blocks when out or in is not a multiple of 128). Norms, embeddings, the router and the head are
bf16. The V4 release adds `scale_fmt: ue8m0` (the block scales are powers of two, stored as e8m0
bytes) and `expert_dtype: fp4`: routed experts in fp4 e2m1, [out, in/2] bytes holding two codes
each (the even column in the low nibble), with an e8m0 scale per 32 inputs, [out, in/32].

Kept quantized (the default; model.quantized_weights: keep), a linear holds the checkpoint's bytes
unchanged and fp8 scales ROW-EXPANDED, [out, ceil(in/128)]: one scale per row and 128-column block
(4 bytes per 128 weights with float32 scales: 3% over the fp8 bytes). Rows then carry their own
scales, so stacking experts (gate rows, then up rows) and cutting rows over ranks never split a
block; cutting columns (row-parallel layers) is refused unless each rank's columns are whole
blocks. fp4 scales are per row already. The dequantization runs inside the region, next to the
matmul that uses the weight.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from . import int_weights
from .int_weights import IntLinear, IntWeights

FP8 = torch.float8_e4m3fn
SCALE_SUFFIX = "_scale_inv"  # the checkpoint's name for a weight's block scales (multiplied in)


class QuantizationError(ValueError):
    pass


@dataclass(frozen=True)
class Fp8Blocks:
    """A checkpoint's quantization: fp8 weights in blocks of `block` x `block`, their scales
    float32 or power-of-two e8m0 bytes (`scale_fmt` "ue8m0", V4); routed experts fp8 like the
    rest, or fp4 (`expert_dtype` "fp4", V4: e2m1 two per byte, an e8m0 scale per 32 inputs)."""

    block: int = 128
    scale_fmt: str = "float"
    expert_dtype: str = "fp8"

    def to_dict(self) -> dict:
        out = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [self.block] * 2}
        return out | {"scale_fmt": self.scale_fmt, "expert_dtype": self.expert_dtype}


BLOCK = 128  # the fp8 block edge of DeepSeek's releases, the only one read
SUPPORTED = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [BLOCK, BLOCK]}
CHOICES = {"scale_fmt": ("float", "ue8m0"), "expert_dtype": ("fp8", "fp4")}  # optional keys, default first


def parse_quantization(raw, source: str) -> Fp8Blocks | None:
    """config.json's quantization_config -> Fp8Blocks, or None when the checkpoint is not quantized;
    anything but DeepSeek's release formats is refused, naming the key."""
    if not raw:
        return None
    if not isinstance(raw, dict):
        raise QuantizationError(f"{source}: quantization_config must be a mapping, not {type(raw).__name__}.")
    for key, wanted in SUPPORTED.items():
        if raw.get(key) != wanted:
            raise QuantizationError(
                f"{source}: quantization_config.{key}={raw.get(key)!r} is not supported; deepinfer reads DeepSeek's release "
                f"format {SUPPORTED} (or a checkpoint without quantization_config).")
    for key, allowed in CHOICES.items():
        if raw.get(key, allowed[0]) not in allowed:
            raise QuantizationError(f"{source}: quantization_config.{key}={raw[key]!r} is not supported; choose one of {list(allowed)}.")
    return Fp8Blocks(BLOCK, raw.get("scale_fmt", "float"), raw.get("expert_dtype", "fp8"))


def blocks(n: int, block: int) -> int:
    return -(-n // block)


FP4 = torch.uint8  # fp4 e2m1 weights: two codes a byte, the even column in the low nibble
FP4_GROUP = 32  # columns sharing one e8m0 scale in an fp4 weight
E8M0 = torch.uint8  # power-of-two scales kept as their e8m0 bytes: 2 ** (byte - 127)


def fp4_size_problem(config) -> tuple[str, str] | None:
    """(field, why) where fp4 experts cannot hold the config's sizes, or None."""
    if config.quantization and config.quantization.expert_dtype == "fp4":
        for key in ("hidden_size", "moe_intermediate_size"):
            if getattr(config, key) % FP4_GROUP:
                return key, f"must be a multiple of {FP4_GROUP} for fp4 experts (one e8m0 scale per {FP4_GROUP} inputs)."
    return None


def e8m0_values(scale_bytes: torch.Tensor) -> torch.Tensor:
    """e8m0 bytes -> float32: 2 ** (byte - 127); byte 255 is NaN."""
    values = torch.exp2(scale_bytes.float() - 127)
    return torch.where(scale_bytes == 255, float("nan"), values)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """fp4 e2m1 codes (0-15) -> float32: sign bit 3, exponent bits 2-1 (bias 1), mantissa bit 0."""
    codes = codes.to(torch.int32)
    exponent, mantissa = (codes >> 1) & 3, (codes & 1).float()
    magnitude = torch.where(exponent == 0, 0.5 * mantissa, torch.exp2(exponent.float() - 1) * (1 + 0.5 * mantissa))
    return torch.where((codes & 8) != 0, -magnitude, magnitude)


def expand_rows(grid: torch.Tensor, rows: int, block: int) -> torch.Tensor:
    """Block scales [ceil(rows/block), nb] -> one row per weight row [rows, nb]."""
    return grid.repeat_interleave(block, dim=0)[:rows]


def dequantize(weight: torch.Tensor, row_scales: torch.Tensor, dtype: torch.dtype, block: int = 128) -> torch.Tensor:
    """A quantized weight [..., out, in] with one scale per row and column group -> dtype.
    fp8: scales [..., out, ceil(in/block)], float32 or e8m0 bytes, a partial last block using the
    first in % block of them. fp4 (packed [..., out, in/2]): e8m0 scales [..., out, in/32]."""
    if weight.dtype == FP4:
        values = e2m1_values(torch.stack([weight & 0xF, weight >> 4], dim=-1).flatten(-2))  # [..., out, in]
        group = FP4_GROUP
    else:
        values, group = weight.float(), block
    scales = e8m0_values(row_scales) if row_scales.dtype == E8M0 else row_scales.float()
    group_of_column = torch.arange(values.shape[-1], device=weight.device) // group  # [in]
    # (an index, not repeat_interleave + slice: inductor miscompiles that for a partial last block)
    return (values * scales[..., group_of_column]).to(dtype)


def _scale_dtype(quantization: "Fp8Blocks") -> torch.dtype:
    return E8M0 if quantization.scale_fmt == "ue8m0" else torch.float32


class Fp8Linear(nn.Module):
    """A bias-free linear whose weight stays fp8 in memory: `weight` [out, in] float8_e4m3fn and
    `weight_scale_inv` [out, ceil(in/block)] (float32, or e8m0 bytes), dequantized to x's dtype
    at each call."""

    def __init__(self, dim_in: int, dim_out: int, quantization: Fp8Blocks):
        super().__init__()
        self.block = quantization.block
        self.weight = nn.Parameter(torch.empty(dim_out, dim_in, dtype=FP8), requires_grad=False)
        scales = torch.empty(dim_out, blocks(dim_in, self.block), dtype=_scale_dtype(quantization))
        self.weight_scale_inv = nn.Parameter(scales, requires_grad=False)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize(self.weight, self.weight_scale_inv, dtype, self.block)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dequantized(x.dtype))


Quantization = Fp8Blocks | IntWeights | None  # the checkpoint's fp8, or the recipe's model.quantize (models/int_weights.py)


def linear(dim_in: int, dim_out: int, quantization: Quantization = None, bias: bool = False) -> nn.Module:
    """nn.Linear, an Fp8Linear where the checkpoint's weights are fp8 and kept so, or an IntLinear
    where the recipe quantizes them (bias-free layers only: a biased one stays float)."""
    if isinstance(quantization, IntWeights) and not bias and int_weights.layer_bits(dim_in, dim_out, quantization):
        return IntLinear(dim_in, dim_out, quantization)
    if isinstance(quantization, Fp8Blocks):
        return Fp8Linear(dim_in, dim_out, quantization)
    return nn.Linear(dim_in, dim_out, bias=bias)


def absorbed_linear(dim_in: int, dim_out: int, quantization: Quantization = None, bias: bool = False) -> nn.Module:
    """A linear whose weight the model reads as a matrix (linear_weight: absorbed attention
    projections): fp8 as the checkpoint keeps it, never int-quantized as it is (the int layouts
    are the kernels'; V3's MLA stores int codes cut from it instead)."""
    return linear(dim_in, dim_out, quantization if isinstance(quantization, Fp8Blocks) else None, bias)


def head_linear(dim_in: int, dim_out: int, quantization: Quantization = None) -> nn.Module:
    """The LM head: int-quantized when the recipe says so (model.quantize_head), else float (the
    release's head is bf16)."""
    return linear(dim_in, dim_out, quantization if isinstance(quantization, IntWeights) and quantization.head else None)


def linear_weight(module: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """The weight of an nn.Linear or an Fp8Linear, in `dtype` (for code that uses it directly)."""
    return module.dequantized(dtype) if isinstance(module, Fp8Linear) else module.weight


def is_quantized_param(tensor: torch.Tensor, name: str) -> bool:
    """A parameter stored as the checkpoint holds it (fp8 or fp4 bytes, or their scales), or as
    the recipe's quantization made it, whatever the recipe's dtype."""
    return tensor.dtype in (FP8, FP4) or name.endswith(SCALE_SUFFIX) or int_weights.is_int_param(tensor, name)


def stacked_experts(module: nn.Module, name: str, experts: int, rows: int, columns: int, quantization: Quantization):
    """Stacked expert weights `name` [E, rows, columns], in the model's dtype, or kept quantized:
    fp8 with `name_scale_inv` [E, rows, ceil(columns/block)] (row-expanded like Fp8Linear's), or
    fp4 [E, rows, columns/2] with e8m0 `name_scale_inv` [E, rows, columns/32]; or int8 / int4
    codes (models/int_weights.py)."""
    if isinstance(quantization, IntWeights):
        int_weights.register_stacked(module, name, experts, rows, columns, quantization)
        return
    if quantization is None:
        module.register_parameter(name, nn.Parameter(torch.empty(experts, rows, columns)))
        return
    if quantization.expert_dtype == "fp4":
        weight = torch.empty(experts, rows, columns // 2, dtype=FP4)
        scales = torch.empty(experts, rows, columns // FP4_GROUP, dtype=E8M0)
    else:
        weight = torch.empty(experts, rows, columns, dtype=FP8)
        scales = torch.empty(experts, rows, blocks(columns, quantization.block), dtype=_scale_dtype(quantization))
    module.register_parameter(name, nn.Parameter(weight, requires_grad=False))
    module.register_parameter(name + SCALE_SUFFIX, nn.Parameter(scales, requires_grad=False))


def expert_weights(module: nn.Module, name: str, dtype: torch.dtype, quantization: Quantization):
    """pick(ids) -> the stacked weights `name` of experts `ids` (any index shape; None: all of
    them) in `dtype`, dequantizing only the experts picked."""
    weight = getattr(module, name)
    int_codes = isinstance(quantization, IntWeights) and int_weights.is_int_param(weight, name)  # (not a float fallback)
    fp8 = isinstance(quantization, Fp8Blocks)
    scales = getattr(module, name + (int_weights.SCALE if int_codes else SCALE_SUFFIX)) if int_codes or fp8 else None

    def pick(ids: torch.Tensor | None = None) -> torch.Tensor:
        if int_codes:  # the kernel takes the stack and the ids
            return int_weights.IntExperts(weight, scales, ids)
        w = weight if ids is None else weight[ids]
        if scales is None:
            return w
        picked = scales if ids is None else scales[ids]
        return dequantize(w, picked, dtype, quantization.block)

    return pick
