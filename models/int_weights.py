"""8- and 4-bit integer weights for CPU decode (recipe `model.quantize: int8 | int4`): the compiler
quantizes a model's float weights as it writes them, and the regions compute from the codes.

Decode on a CPU reads every active weight once a token, so its speed is the weights' bytes over
the memory bandwidth; 8-bit codes read a quarter of float32's, 4-bit an eighth. What is quantized:
the linear layers and the stacked routed experts, and the LM head unless `head` is off (llama.cpp's
q8_0 and q4_0 quantize it too: at small sizes it is most of the bytes a token reads). Never the
embedding (a lookup of one row a token), the router (float32 as in HF), the norms, and a weight
the attention reads as a matrix (V4's wo_a): those stay in the recipe's dtype. V3's kv_b_proj,
absorbed into the queries and the output per head, is stored as two stacks of per-head weights
made from it as they are read (`float_source`), which the kernels take as experts.

    int8  per output channel, symmetric: codes int8 in -127..127 and one bfloat16 scale per row
          [out]; w = code x scale; the codes [..., out, in] with rows of 8 interleaved,
          runtime/int_matmul.py's INT8_LAYOUT (the manifest's quantization_config.int8_layout).
    int4  per group of `group` inputs, asymmetric: q in 0..15 with w = (q - 8) x scale + zero
          (zero = min + 8 x scale), bfloat16 (scale, zero) per group, [..., out, in/group, 2]; the
          codes two a byte, [..., out, in/2]; both with rows of 8 interleaved, INT4_LAYOUT
          (quantization_config.int4_layout).
    Both are computed by our kernels `deepinfer::int8_matmul` / `int4_matmul` (activations
    quantized to int8 blocks, integer dot products; ATen's `_weight_int8pack_mm` and
    `_weight_int4pack_mm_for_cpu` decode each code to float: one row of a [32000, 1024] LM head
    2.3x slower in int8, a [32000, 768] one 2.4x in int4), linears and stacked experts alike; a
    decode step's experts are taken by id, never gathered. int4 products of
    int_matmul.DECODED_FROM_ROWS rows or more (prompt chunks) are bfloat16 GEMMs on the weight
    decoded first.
    Every int8 linear, however small, is the kernel's: a small one's decode row was once computed
    in the region's graph (codes widened in inductor's loops), which spared a kernel call when a
    call cost ~3 us, but made a prompt chunk's product a float32 GEMM on the codes widened, and
    since the kernels are called as C functions the call costs less than that reduction (the
    trained tiny V3 side by side, bench/bundle_ab_bench.py, an AMD EPYC: decode 0.79-0.93x, its
    32-token prompt 0.65-0.76x with every int8 linear by the kernel).
    A layer whose shape a layout does not fit (both need outputs a multiple of 8 and inputs of
    32; int4's inputs a multiple of the group) takes the next: int4 -> int8 -> the recipe's float
    dtype, as llama.cpp falls back to another type for rows its blocks do not divide.

Everything is quantized from the rank's float slice, so a rank's codes are those of the whole
weight cut the same way: int4's groups never straddle ranks (checked), and int8's scale of a
weight cut by columns is taken over its whole rows (the reader hands over the whole weight).
"""

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from deepinfer.runtime import int_matmul

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
        int4 = {"group_size": self.group, "int4_layout": int_matmul.INT4_LAYOUT} if self.bits == 4 else {}
        return {"quant_method": "deepinfer", "weights": self.name, **int4, "int8_layout": int_matmul.INT8_LAYOUT, "lm_head": self.head}


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


def layer_bits(dim_in: int, dim_out: int, spec: IntWeights) -> int | None:
    """The bits a layer of this shape takes: the recipe's where its layout fits (outputs a multiple
    of 8, inputs of 32, int4's of the group), else int8 where that fits, else None (float)."""
    if dim_out % int_matmul.ROWS or dim_in % int_matmul.BLOCK:
        return None
    return 4 if spec.bits == 4 and dim_in % spec.group == 0 else 8


class IntLinear(nn.Module):
    """A bias-free linear from int8 or int4 codes (see the module docstring for the layouts)."""

    def __init__(self, dim_in: int, dim_out: int, spec: IntWeights):
        super().__init__()
        self.bits = layer_bits(dim_in, dim_out, spec)
        codes, scales = empty_codes((dim_out, dim_in), self.bits, spec.group)
        self.weight = nn.Parameter(codes, requires_grad=False)
        self.weight_qscale = nn.Parameter(scales, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = int_matmul.product(x.reshape(-1, x.shape[-1]), self.weight, self.weight_qscale)
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
        codes, scales = int8_codes(w)
        return int_matmul.pack_int8(codes), scales
    return int_matmul.pack_int4(*int4_codes(w, group))


def register_stacked(module: nn.Module, name: str, experts: int, rows: int, columns: int, spec: IntWeights):
    """Stacked expert codes `name` [E, rows, ...] and their scales `name_qscale` (empty_codes), or
    float weights where no layout fits their shape."""
    bits = layer_bits(columns, rows, spec)
    if bits is None:
        module.register_parameter(name, nn.Parameter(torch.empty(experts, rows, columns)))
        return
    codes, scales = empty_codes((experts, rows, columns), bits, spec.group)
    module.register_parameter(name, nn.Parameter(codes, requires_grad=False))
    module.register_parameter(name + SCALE, nn.Parameter(scales, requires_grad=False))


class IntExperts(NamedTuple):
    """A stack of int8 or int4 experts, not dequantized: a decode step's rows multiply the experts
    `ids` picks by the kernel, which reads only those (moe.product); a prompt chunk's forms (ids
    None) take every expert by the kernel too, or int4 ones decoded (`values`) from
    int_matmul.DECODED_FROM_ROWS rows an expert."""

    codes: torch.Tensor  # [E, rows, columns] int8, or [E, rows, columns/2] int4 bytes
    scales: torch.Tensor  # [E, rows] bfloat16, or int4's (scale, zero) [E, rows, columns/group, 2]
    ids: torch.Tensor | None = None  # [N, k] each row's experts

    @property
    def shape(self) -> torch.Size:
        lead = self.codes.shape[:1] if self.ids is None else self.ids.shape
        columns = self.codes.shape[2] * (2 if int_matmul.is_int4(self.codes) else 1)
        return torch.Size((*lead, self.codes.shape[1], columns))

    def values(self, dtype: torch.dtype) -> torch.Tensor:
        """Every int4 expert's weight [E, rows, columns] in dtype."""
        return torch.ops.deepinfer.int4_values(self.codes, self.scales).to(dtype)


def quantized(name: str, w: torch.Tensor, codes_dtype: torch.dtype, group: int) -> dict[str, torch.Tensor]:
    """A float weight `name` ([out, in], or stacked [E, rows, columns]) -> {name: codes, name_qscale:
    scales}, int8 or int4 as the model holds its codes (`codes_dtype`)."""
    codes, scales = int_tensors(w, 8 if codes_dtype == torch.int8 else 4, group)
    return {name: codes, name + SCALE: scales}


def int8_cut_by_columns(name: str, whole: torch.Tensor, cut) -> dict[str, torch.Tensor]:
    """An int8 weight `name` cut by columns over ranks: codes quantized over its whole rows (the
    scales the whole rows'), `cut(codes)` the rank's columns, laid out -> {name: codes, name_qscale: scales}."""
    codes, scales = int8_codes(whole)
    return {name: int_matmul.pack_int8(cut(codes)), name + SCALE: scales}


def is_int_param(tensor: torch.Tensor, name: str) -> bool:
    """Codes or their scales: stored as they are, whatever the recipe's dtype."""
    return tensor.dtype in (torch.int8, INT4_PACK) or name.endswith(SCALE)


def source_name(name: str) -> str:
    """The float weight a quantized parameter (codes or scales) is made from."""
    return name.removesuffix(SCALE)


def float_source(model: nn.Module, name: str, read) -> torch.Tensor:
    """The float weight an int-quantized model's weight `name` is quantized from, `read(float name)`
    reading the float model's: itself, or for a module's `derived_weights` {name: (source name,
    make(module, source))} made from another (MLA's up-projections cut per head)."""
    prefix, _, leaf = name.rpartition(".")
    module = model.get_submodule(prefix)
    made = getattr(module, "derived_weights", {}).get(leaf)
    return read(name) if made is None else made[1](module, read(f"{prefix}.{made[0]}"))
