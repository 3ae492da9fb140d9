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
          (zero = min + 8 x scale), bfloat16 (scale, zero) per group. A linear keeps the codes in
          ATen's packed layout for `_weight_int4pack_mm_for_cpu` ([out, in/2] bytes) and its
          scales_and_zeros [in/group, out, 2]. That packing depends on the CPU kernel ATen picks
          (AVX-512 and AVX2 lay the codes out differently), so the manifest records it
          (quantization_config.packed_for) and the runtime refuses a host whose ATen picks another.
          Stacked experts, whose rows a decode step gathers (no ATen kernel takes a gathered
          weight), keep plain bytes [E, rows, in/2] in halves: byte j holds column j in its low
          nibble and column in/2 + j in its high one, with (scale, zero) [E, rows, in/group, 2];
          the region dequantizes each half and multiplies it by its half of the input
          (moe.product): two contiguous reductions, where interleaved nibbles cost inductor's
          vectorized loops 5x the time of int8's (bench/cpu_decode_bench.py's MoE regions).
    A layer whose shape a layout does not fit (int4 linears: inputs a multiple of the group,
    outputs of 16; experts: columns of two groups) is int8 instead, as llama.cpp falls back to
    another type for rows its blocks do not divide.

Everything is quantized from the rank's float slice, so a rank's codes are those of the whole
weight cut the same way: int4's groups never straddle ranks (checked), and int8's scale of a
weight cut by columns is taken over its whole rows (the reader hands over the whole weight).
"""

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from deepinfer.runtime.grouped_matmul import int8_product

BITS = {"int8": 8, "int4": 4}
GROUPS = (32, 64, 128, 256)  # int4 group sizes ATen's kernel takes
SCALE = "_qscale"  # a quantized weight `name`'s scales are `name_qscale`
INT4_PACK = torch.uint8


@dataclass(frozen=True)
class IntWeights:
    """The recipe's model.quantize: `bits` 8 or 4, int4's `group`, and whether the LM head is quantized."""

    bits: int
    group: int = 32
    head: bool = True
    packed_for: str | None = None  # int4: the ATen CPU kernel its codes are packed for (packed_for())

    @property
    def name(self) -> str:
        return f"int{self.bits}"

    def to_dict(self) -> dict:
        """What a manifest's model_config.quantization_config records."""
        int4 = {"group_size": self.group, "packed_for": self.packed_for} if self.bits == 4 else {}
        return {"quant_method": "deepinfer", "weights": self.name, **int4, "lm_head": self.head}


def packed_for() -> str:
    """The CPU kernel ATen picks here ("AVX512", "AVX2", "DEFAULT"), which decides int4's packing."""
    return torch.backends.cpu.get_cpu_capability()


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


def int4_values(q: torch.Tensor, scale_zero: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Codes [..., out, in] (any integer dtype) and (scale, zero) [..., out, in/group, 2] -> dtype."""
    grouped = q.unflatten(-1, (scale_zero.shape[-2], -1)).to(torch.float32) - 8
    scale, zero = scale_zero.float().unbind(-1)
    return (grouped * scale[..., None] + zero[..., None]).flatten(-2).to(dtype)


INT4_ROWS = 16  # ATen's int4 packing takes outputs in multiples of 16


def linear_bits(dim_in: int, dim_out: int, spec: IntWeights) -> int:
    """int4 where ATen's kernel takes the shape (inputs a multiple of the group, outputs of 16),
    else int8 (as llama.cpp falls back to another type for rows its blocks do not divide)."""
    return 4 if spec.bits == 4 and dim_in % spec.group == 0 and dim_out % INT4_ROWS == 0 else 8


def stacked_bits(columns: int, spec: IntWeights) -> int:
    """int4 where each half of the columns is whole groups (the halves layout), else int8."""
    return 4 if spec.bits == 4 and columns % (2 * spec.group) == 0 else 8


class Halves(NamedTuple):
    """int4 stacked experts dequantized: the weights of the first and of the second half of the
    input columns, [..., rows, columns/2] each (moe.product multiplies each by its half of x)."""

    low: torch.Tensor
    high: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.low.shape[:-1], 2 * self.low.shape[-1]))


class IntLinear(nn.Module):
    """A bias-free linear from int8 or int4 codes (see the module docstring for the layouts)."""

    def __init__(self, dim_in: int, dim_out: int, spec: IntWeights):
        super().__init__()
        self.bits, self.group = linear_bits(dim_in, dim_out, spec), spec.group
        if self.bits == 8:
            codes = torch.empty(dim_out, dim_in, dtype=torch.int8)
            scales = torch.empty(dim_out, dtype=torch.bfloat16)
        else:
            codes = torch.empty(dim_out, dim_in // 2, dtype=INT4_PACK)
            scales = torch.empty(dim_in // self.group, dim_out, 2, dtype=torch.bfloat16)
        self.weight = nn.Parameter(codes, requires_grad=False)
        self.weight_qscale = nn.Parameter(scales, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)  # (the kernels' fast path takes bf16 activations)
        if self.bits == 8:
            out = int8_product(flat, self.weight, self.weight_qscale)
        else:
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.weight, self.group, self.weight_qscale)
        return out.to(x.dtype).view(*x.shape[:-1], -1)


def linear_tensors(w: torch.Tensor, bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A float weight [out, in] -> IntLinear's (weight, weight_qscale)."""
    if bits == 8:
        return int8_codes(w)
    q, scale_zero = int4_codes(w, group)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), 1)
    return packed, scale_zero.transpose(0, 1).contiguous()  # [in/group, out, 2]: ATen's order


def stacked_tensors(w: torch.Tensor, bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Float stacked experts [E, rows, columns] -> (codes, scales) as register_stacked holds them."""
    if bits == 8:
        return int8_codes(w)
    q, scale_zero = int4_codes(w, group)
    low, high = q.to(torch.uint8).chunk(2, dim=-1)
    return (low | (high << 4)).contiguous(), scale_zero


def register_stacked(module: nn.Module, name: str, experts: int, rows: int, columns: int, spec: IntWeights):
    """Stacked expert codes `name` and their scales `name_qscale`: int8 [E, rows, columns] with
    bfloat16 [E, rows]; int4 bytes [E, rows, columns/2] with (scale, zero) [E, rows, columns/group, 2]."""
    if stacked_bits(columns, spec) == 8:
        codes = torch.empty(experts, rows, columns, dtype=torch.int8)
        scales = torch.empty(experts, rows, dtype=torch.bfloat16)
    else:
        codes = torch.empty(experts, rows, columns // 2, dtype=INT4_PACK)
        scales = torch.empty(experts, rows, columns // spec.group, 2, dtype=torch.bfloat16)
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


def gathered_values(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> RowScaled | Halves:
    """Gathered stacked codes and scales -> the weights a decode step's reduction multiplies (in
    dtype): int8 ones with the row scales apart.

    Why: inductor's reduction over gathered int experts decodes every element in its loop, and
    that arithmetic, not the bytes, sets its speed (one MoE layer's four [1280, 1024] + [1024, 640]
    int8 experts, 2 threads, an AMD EPYC: 18.4 GB/s scaling each code, 30.2 with the scales on the
    result, the box's read bandwidth). int4 experts stay decoded in the loop: factoring their
    scales and zeros out the same way (the zeros times each group's sum of x) made the decode step
    slower (190M int4 TPOT 3.91 -> 4.59 ms), the extra reductions costing more than they saved."""
    if codes.dtype == torch.int8:
        return RowScaled(codes.to(dtype), scales.to(dtype))
    return stacked_values(codes, scales, dtype)


def nibbles(codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int4 bytes -> (low, high) nibbles as float32, each masked in place (the high one is
    (byte & 0xF0) / 16): inductor's vectors shift 8-bit lanes in emulation (a reduction over
    `bytes >> 4` reads 8.5 GB/s, over `bytes & 15` 31.9; [20480, 512] bytes, 2 threads, AMD EPYC;
    the 190M int4 decode step 4.17 -> 3.91 ms)."""
    return (codes & 0xF).to(torch.float32), (codes & 0xF0).to(torch.float32) * 0.0625


def stacked_values(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | Halves:
    """Stacked expert codes and scales (any leading index shape) -> weights in dtype; int4 ones as
    the Halves their bytes hold."""
    if codes.dtype == torch.int8:
        return (codes.to(torch.float32) * scales.float()[..., None]).to(dtype)
    low_scales, high_scales = scales.chunk(2, dim=-2)
    low, high = nibbles(codes)
    return Halves(int4_values(low, low_scales, dtype), int4_values(high, high_scales, dtype))


def quantized(name: str, w: torch.Tensor, codes_dtype: torch.dtype, group: int) -> dict[str, torch.Tensor]:
    """A float weight `name` ([out, in], or stacked [E, rows, columns]) -> {name: codes, name_qscale:
    scales}, int8 or int4 as the model holds its codes (`codes_dtype`)."""
    bits = 8 if codes_dtype == torch.int8 else 4
    codes, scales = (stacked_tensors if w.dim() == 3 else linear_tensors)(w, bits, group)
    return {name: codes, name + SCALE: scales}


def is_int_param(tensor: torch.Tensor, name: str) -> bool:
    """Codes or their scales: stored as they are, whatever the recipe's dtype."""
    return tensor.dtype in (torch.int8, INT4_PACK) or name.endswith(SCALE)


def source_name(name: str) -> str:
    """The float weight a quantized parameter (codes or scales) is made from."""
    return name.removesuffix(SCALE)
