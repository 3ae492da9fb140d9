"""DeepSeek's released weight formats: read as they are, kept quantized, dequantized in the graph.

fp8, block-scaled (the V3/R1 release): `quantization_config` is {quant_method: fp8, fmt: e4m3,
activation_scheme: dynamic, weight_block_size: [128, 128]}. A quantized linear weight W [out, in]
is float8_e4m3fn, with a float32 `<key>_scale_inv` [ceil(out/128), ceil(in/128)], and
W = fp8 value x the scale of its 128x128 block (DeepSeek's `weight_dequant`; grids end in partial
blocks when out or in is not a multiple of 128). Norms, embeddings, the router and the head are
bf16.

Kept quantized (the default; model.quantized_weights: keep), a linear holds the fp8 bytes
unchanged and its scales ROW-EXPANDED, [out, ceil(in/128)]: one scale per row and 128-column block
(4 bytes per 128 weights, 3% over the fp8 bytes). Rows then carry their own scales, so stacking
experts (gate rows, then up rows) and cutting rows over ranks never split a block; cutting columns
(row-parallel layers) is refused unless each rank's columns are whole blocks. The dequantization
runs inside the region, next to the matmul that uses the weight.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

FP8 = torch.float8_e4m3fn
SCALE_SUFFIX = "_scale_inv"  # the checkpoint's name for a weight's block scales (multiplied in)


class QuantizationError(ValueError):
    pass


@dataclass(frozen=True)
class Fp8Blocks:
    """A checkpoint's fp8 block quantization: blocks of `block` rows x `block` columns."""

    block: int = 128

    def to_dict(self) -> dict:
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [self.block] * 2}


SUPPORTED = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def parse_quantization(raw, source: str) -> Fp8Blocks | None:
    """config.json's quantization_config -> Fp8Blocks, or None when the checkpoint is not quantized;
    anything but the release's format is refused, naming the key."""
    if not raw:
        return None
    if not isinstance(raw, dict):
        raise QuantizationError(f"{source}: quantization_config must be a mapping, not {type(raw).__name__}.")
    for key, wanted in SUPPORTED.items():
        if raw.get(key) != wanted:
            raise QuantizationError(
                f"{source}: quantization_config.{key}={raw.get(key)!r} is not supported; deepinfer reads DeepSeek's release "
                f"format {SUPPORTED} (or a checkpoint without quantization_config).")
    return Fp8Blocks(block=128)


def blocks(n: int, block: int) -> int:
    return -(-n // block)


def expand_rows(grid: torch.Tensor, rows: int, block: int) -> torch.Tensor:
    """Block scales [ceil(rows/block), nb] -> one row per weight row [rows, nb]."""
    return grid.repeat_interleave(block, dim=0)[:rows]


def dequantize(weight: torch.Tensor, row_scales: torch.Tensor, dtype: torch.dtype, block: int = 128) -> torch.Tensor:
    """fp8 weight [..., out, in] with row-expanded scales [..., out, ceil(in/block)] -> dtype.
    Each scale covers `block` columns; a partial last block uses the first in % block of them."""
    block_of_column = torch.arange(weight.shape[-1], device=weight.device) // block  # [in]
    # (an index, not repeat_interleave + slice: inductor miscompiles that for a partial last block)
    return (weight.float() * row_scales.float()[..., block_of_column]).to(dtype)


class Fp8Linear(nn.Module):
    """A bias-free linear whose weight stays fp8 in memory: `weight` [out, in] float8_e4m3fn and
    `weight_scale_inv` [out, ceil(in/block)] float32, dequantized to x's dtype at each call."""

    def __init__(self, dim_in: int, dim_out: int, block: int):
        super().__init__()
        self.block = block
        self.weight = nn.Parameter(torch.empty(dim_out, dim_in, dtype=FP8), requires_grad=False)
        self.weight_scale_inv = nn.Parameter(torch.empty(dim_out, blocks(dim_in, block)), requires_grad=False)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize(self.weight, self.weight_scale_inv, dtype, self.block)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dequantized(x.dtype))


def linear_weight(module: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """The weight of an nn.Linear or an Fp8Linear, in `dtype` (for code that uses it directly)."""
    return module.dequantized(dtype) if isinstance(module, Fp8Linear) else module.weight


def is_quantized_param(tensor: torch.Tensor, name: str) -> bool:
    """A parameter stored as the checkpoint holds it (fp8 bytes or their scales), whatever the
    recipe's dtype."""
    return tensor.dtype == FP8 or name.endswith(SCALE_SUFFIX)


def stacked_fp8(module: nn.Module, name: str, experts: int, rows: int, columns: int, block: int):
    """Stacked expert weights kept fp8: `name` [E, rows, columns] float8_e4m3fn and
    `name_scale_inv` [E, rows, ceil(columns/block)] float32, row-expanded like Fp8Linear's."""
    module.register_parameter(name, nn.Parameter(torch.empty(experts, rows, columns, dtype=FP8), requires_grad=False))
    scales = torch.empty(experts, rows, blocks(columns, block))
    module.register_parameter(name + SCALE_SUFFIX, nn.Parameter(scales, requires_grad=False))


def expert_weights(module: nn.Module, name: str, dtype: torch.dtype, quantization: Fp8Blocks | None):
    """pick(ids) -> the stacked weights `name` of experts `ids` (any index shape; None: all of
    them) in `dtype`, dequantizing only the experts picked."""
    weight = getattr(module, name)
    scales = getattr(module, name + SCALE_SUFFIX) if quantization else None

    def pick(ids: torch.Tensor | None = None) -> torch.Tensor:
        w = weight if ids is None else weight[ids]
        if scales is None:
            return w
        return dequantize(w, scales if ids is None else scales[ids], dtype, quantization.block)

    return pick
