"""8- and 4-bit integer weights for CPU decode (recipe `model.quantize: int8 | int4`): the compiler
quantizes a model's float weights as it writes them, and the regions compute from the codes.

Decode on a CPU reads every active weight once a token, so its speed is the weights' bytes over
the memory bandwidth; 8-bit codes read a quarter of float32's, 4-bit an eighth. What is quantized:
the linear layers and the stacked routed experts, and the LM head unless `head` is off (llama.cpp's
q8_0 and q4_0 quantize it too: at small sizes it is most of the bytes a token reads). Never the
embedding (a lookup of one row a token), the router (float32 as in HF), the norms, and never a
weight the attention reads as a matrix (kv_b_proj, absorbed into the queries): those stay in the
recipe's dtype.

    int8  per output channel, symmetric: codes int8 [out, in] in -127..127 and one bfloat16
          scale per row [out]; w = code x scale. Computed by ATen's `_weight_int8pack_mm`
          (bf16 activations: its fast path), which inductor turns into a fused multiply-reduce
          reading the bytes for a one-row decode step (compiler/backends/int8_matvec.py); from
          DECODED_FROM_ROWS rows (prompt chunks) by a bfloat16 GEMM on the weight decoded first.
    int4  per group of `group` inputs, asymmetric: q in 0..15 with w = (q - 8) x scale + zero
          (zero = min + 8 x scale), bfloat16 (scale, zero) per group, [..., out, in/group, 2]; the
          codes two a byte, [..., out, in/2]; both with rows of 8 interleaved, runtime/int4_matmul.py's
          LAYOUT (recorded in the manifest's quantization_config.int4_layout), the same for
          linears and stacked experts.
          Computed by our kernel `deepinfer::int4_matmul` (activations quantized to int8 blocks,
          integer dot products; ATen's `_weight_int4pack_mm_for_cpu` decodes each nibble to float:
          a [32000, 768] LM head, one row, 1.41 ms against the kernel's 0.59, the memory's floor),
          which also takes a decode step's experts by id, without gathering them; from
          int4_matmul.DECODED_FROM_ROWS rows (prompt chunks) by a bfloat16 GEMM on the weight
          decoded first.
    A layer whose shape a layout does not fit (int4 needs inputs a multiple of the group, outputs
    of 8) is int8 instead, as llama.cpp falls back to another type for rows its blocks do not divide.

Everything is quantized from the rank's float slice, so a rank's codes are those of the whole
weight cut the same way: int4's groups never straddle ranks (checked), and int8's scale of a
weight cut by columns is taken over its whole rows (the reader hands over the whole weight).
"""

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from deepinfer.runtime import int4_matmul
from deepinfer.runtime.grouped_matmul import int8_product

BITS = {"int8": 8, "int4": 4}
GROUPS = (32, 64, 128, 256)  # int4 group sizes (whole blocks of the kernel's 32-column activation scales)
SCALE = "_qscale"  # a quantized weight `name`'s scales are `name_qscale`
INT4_PACK = torch.uint8


@dataclass(frozen=True)
class IntWeights:
    """The recipe's model.quantize: `bits` 8 or 4, int4's `group`, and whether the LM head is quantized."""

    bits: int
    group: int = 32
    head: bool = True

    @property
    def name(self) -> str:
        return f"int{self.bits}"

    def to_dict(self) -> dict:
        """What a manifest's model_config.quantization_config records."""
        int4 = {"group_size": self.group, "int4_layout": int4_matmul.LAYOUT} if self.bits == 4 else {}
        return {"quant_method": "deepinfer", "weights": self.name, **int4, "lm_head": self.head}


def int8_codes(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., out, in] -> (codes int8 [..., out, in], scales bfloat16 [..., out]), symmetric per row."""
    w = w.float()
    scale = (w.abs().amax(dim=-1) / 127).bfloat16().float().clamp(min=2**-100)  # (rounded first: codes fit the stored scale)
    codes = torch.round(w / scale[..., None]).clamp(-127, 127).to(torch.int8)
    return codes, scale.bfloat16()


def int4_codes(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., out, in] -> (q int32 [..., out, in] in 0..15, (scale, zero) bfloat16 [..., out, in/group, 2])."""
    grouped = w.float().unflatten(-1, (-1, group))  # [..., out, in/group, group]
    low, high = grouped.amin(-1), grouped.amax(-1)
    scale = ((high - low) / 15).bfloat16().float().clamp(min=2**-100)
    zero = (low + 8 * scale).bfloat16().float()
    q = torch.round((grouped - zero[..., None]) / scale[..., None] + 8).clamp(0, 15).to(torch.int32).flatten(-2)
    return q, torch.stack([scale, zero], dim=-1).bfloat16()


def layer_bits(dim_in: int, dim_out: int, spec: IntWeights) -> int:
    """int4 where the layout takes the shape (inputs a multiple of the group, outputs of 8), else
    int8 (as llama.cpp falls back to another type for rows its blocks do not divide)."""
    return 4 if spec.bits == 4 and dim_in % spec.group == 0 and dim_out % int4_matmul.ROWS == 0 else 8


class IntLinear(nn.Module):
    """A bias-free linear from int8 or int4 codes (see the module docstring for the layouts)."""

    def __init__(self, dim_in: int, dim_out: int, spec: IntWeights):
        super().__init__()
        self.bits = layer_bits(dim_in, dim_out, spec)
        codes, scales = empty_codes((dim_out, dim_in), self.bits, spec.group)
        self.weight = nn.Parameter(codes, requires_grad=False)
        self.weight_qscale = nn.Parameter(scales, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        if self.bits == 8:
            out = int8_product(flat.to(torch.bfloat16), self.weight, self.weight_qscale)  # (ATen's fast path: bf16)
        else:
            out = int4_matmul.product(flat, self.weight, self.weight_qscale)
        return out.to(x.dtype).view(*x.shape[:-1], -1)


def empty_codes(shape: tuple[int, ...], bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes and scales for a weight of `shape` ([..., out, in]): int8 [..., out, in] with bfloat16
    [..., out]; int4 bytes [..., out, in/2] with (scale, zero) [..., out, in/group, 2]."""
    *lead, rows, columns = shape
    if bits == 8:
        return torch.empty(shape, dtype=torch.int8), torch.empty(*lead, rows, dtype=torch.bfloat16)
    return (torch.empty(*lead, rows, columns // 2, dtype=INT4_PACK),
            torch.empty(*lead, rows, columns // group, 2, dtype=torch.bfloat16))


def int_tensors(w: torch.Tensor, bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A float weight [..., out, in] -> its (codes, scales) as empty_codes lays them out."""
    if bits == 8:
        return int8_codes(w)
    return int4_matmul.pack(*int4_codes(w, group))


def register_stacked(module: nn.Module, name: str, experts: int, rows: int, columns: int, spec: IntWeights):
    """Stacked expert codes `name` [E, rows, ...] and their scales `name_qscale` (empty_codes)."""
    codes, scales = empty_codes((experts, rows, columns), layer_bits(columns, rows, spec), spec.group)
    module.register_parameter(name, nn.Parameter(codes, requires_grad=False))
    module.register_parameter(name + SCALE, nn.Parameter(scales, requires_grad=False))


class Int8Experts(NamedTuple):
    """Every int8 expert of a stack, not dequantized: a prompt chunk's forms multiply each expert's
    rows by its codes (moe.product, through int8_product), instead of writing the whole stack out in
    floats first (4x its bytes, at every step)."""

    codes: torch.Tensor  # [E, rows, columns] int8
    scales: torch.Tensor  # [E, rows] bfloat16

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    def matmul(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        """x [..., columns] @ expert's weight.T -> [..., rows] in x's dtype."""
        flat = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
        return int8_product(flat, self.codes[expert], self.scales[expert]).to(x.dtype).view(*x.shape[:-1], -1)


class RowScaled(NamedTuple):
    """Gathered int8 experts for a decode step's reduction: the codes widened, and the row scales
    that multiply the reduction's result rather than every code (moe.product)."""

    values: torch.Tensor  # [..., rows, columns] the codes, in the activations' dtype
    scales: torch.Tensor  # [..., rows]


class Int4Experts(NamedTuple):
    """A stack of int4 experts, not dequantized: a decode step's rows multiply the experts `ids`
    picks by deepinfer::int4_matmul, which reads only those (moe.product); a prompt chunk's
    forms (ids None) take them decoded (`values`) or, a few rows an expert, by the kernel too."""

    codes: torch.Tensor  # [E, rows, columns/2] bytes
    scale_zero: torch.Tensor  # [E, rows, columns/group, 2] bfloat16
    ids: torch.Tensor | None = None  # [N, k] each row's experts

    @property
    def shape(self) -> torch.Size:
        lead = self.codes.shape[:1] if self.ids is None else self.ids.shape
        return torch.Size((*lead, self.codes.shape[1], 2 * self.codes.shape[2]))

    def values(self, dtype: torch.dtype) -> torch.Tensor:
        """Every expert's weight [E, rows, columns] in dtype."""
        return torch.ops.deepinfer.int4_values(self.codes, self.scale_zero).to(dtype)


def gathered_values(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> RowScaled:
    """Gathered int8 codes and scales -> the weights a decode step's reduction multiplies (in
    dtype), with the row scales apart.

    Why: inductor's reduction over gathered int experts decodes every element in its loop, and
    that arithmetic, not the bytes, sets its speed (one MoE layer's four [1280, 1024] + [1024, 640]
    int8 experts, 2 threads, an AMD EPYC: 18.4 GB/s scaling each code, 30.2 with the scales on the
    result, the box's read bandwidth)."""
    return RowScaled(codes.to(dtype), scales.to(dtype))


def quantized(name: str, w: torch.Tensor, codes_dtype: torch.dtype, group: int) -> dict[str, torch.Tensor]:
    """A float weight `name` ([out, in], or stacked [E, rows, columns]) -> {name: codes, name_qscale:
    scales}, int8 or int4 as the model holds its codes (`codes_dtype`)."""
    codes, scales = int_tensors(w, 8 if codes_dtype == torch.int8 else 4, group)
    return {name: codes, name + SCALE: scales}


def is_int_param(tensor: torch.Tensor, name: str) -> bool:
    """Codes or their scales: stored as they are, whatever the recipe's dtype."""
    return tensor.dtype in (torch.int8, INT4_PACK) or name.endswith(SCALE)


def source_name(name: str) -> str:
    """The float weight a quantized parameter (codes or scales) is made from."""
    return name.removesuffix(SCALE)
