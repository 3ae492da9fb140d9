"""Integer weights times activations: the custom ops the regions call for int8 and int4 linears and experts.

    torch.ops.deepinfer.int4_matmul(x, codes, scale_zero, None)  # a linear: codes [rows, in/2] -> [X, 1, rows]
    torch.ops.deepinfer.int4_matmul(x, codes, scale_zero, ids)   # experts [E, rows, in/2], ids [X, k] -> [X, k, rows]
    torch.ops.deepinfer.int8_matmul(x, codes, scales, ids)       # int8 codes [E, rows, in] (or [rows, in], ids None)
    torch.ops.deepinfer.int4_values(codes, scale_zero)           # the int4 weights in bfloat16 [..., rows, in]
    torch.ops.deepinfer.float_matmul(x, w, ids)                  # float32 or bfloat16 w [E, rows, in] (or [rows, in])

x [X, in] float32. With ids, x row p is multiplied by expert ids[p, j]'s weight for each j (zeros
for an id outside [0, E): a pair another rank computes). Both layouts interleave rows 8 at a time,
so that a 4-byte integer dot product lands one row a lane, as in the repacked layouts of llama.cpp
and ATen:
- int4 (INT4_LAYOUT): q in 0..15, w = (q - 8) * scale + zero, bfloat16 (scale, zero) per group of
  inputs (`pack_int4`): the codes [..., rows, in/2] hold, for each block of 8 rows, units of 32
  bytes, byte 4r + i of unit j holding row r's column 8j + i in its low nibble and 8j + 4 + i in
  its high one; the (scale, zero) pairs [..., rows, in/group, 2] hold, for each block of 8 rows,
  group by group, the 8 rows' pairs (a group's 8 scales are one load).
- int8 (INT8_LAYOUT): codes in -127..127, w = code * scale, a bfloat16 scale a row [..., rows]
  (`pack_int8`): the codes [..., rows, in] hold, for each block of 8 rows, units of 32 bytes,
  byte 4r + i of unit j holding row r's column 4j + i.

How: as llama.cpp's q4_0 / q8_0 x q8_0, the activations are quantized to int8 per block of 32
(scale amax / 127) and multiplied by the codes with integer dot products (AVX-512 VNNI, else AVX2's
maddubs), a float multiply-add per block for the activation scales; int4's scales per block, its
zeros once per group against the group's sum of x (q - 8 in integers: the sum of a block's
activation codes, once per row); int8's row scales once at the end. A decode step reads the bytes
at the memory's rate this way: one row of the 190M's int4 LM head from memory 0.66 ms (28 GB/s,
the box's read rate); decoding each code to float first (inductor's loops, ATen's
`_weight_int4pack_mm_for_cpu` and `_weight_int8pack_mm`) costs more arithmetic than the bytes take
to arrive (bench/quantized_matmul_bench.py).

A prompt chunk's int4 products of DECODED_FROM_ROWS rows or more are GEMMs on the weights decoded
by `int4_values` (in inductor's loops, decoding a layout whose nibbles land apart wrote 0.8 GB/s of
bfloat16). int8's kernel is faster than that at every prompt size measured (up to 512 rows).

float_matmul shares their driver (runs of rows sharing an expert, tiles of 8 weight rows) for float
weights as stored, for a few rows: dot products of up to 4 weight rows x up to 8 activation rows in
float32 (bfloat16 weights: x rounded to bfloat16, AVX512_BF16's dot products where the CPU has
them; AVX2 widens both), each weight row's stream prefetched into L2 four passes ahead. A prompt
chunk's float experts of few rows take it (runtime/grouped_matmul.py), and so do the regions'
linears of up to 16-32 rows (compiler/backends/few_row_products.py): BLAS GEMMs of a few rows read
the weights at half the memory's rate or less.

The kernels (int_matmul.cpp, with runtime/latent_attention.py's decode attention in the same
library) are compiled on the host that runs them, for its CPU (-march=native), once per source,
torch, compiler and CPU, into the compile cache (DEEPINFER_CACHE_DIR/kernels, ~3 s); they use
torch's own threads. Where no C++ compiler works, `reference` and `values` (the
same arithmetic in torch, slower) run instead, with a warning; AOTInductor regions that call the
kernels cannot load there (`KERNEL_PROBLEM` says why): their compiled code calls the kernels'
C functions (`C_SHIMS`) directly, which the library, loaded with its symbols global, provides.
"""

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from . import knobs

INT4_LAYOUT = "int4-rows-of-8"  # the manifest's quantization_config.int4_layout for the layout above
# and its int8_layout: every int8 weight in it (an earlier deepinfer's "int8-rows-of-8" kept linears of
# fewer than int8_linears_in_row_order_below weights in row order)
INT8_LAYOUT = "int8-rows-of-8-every-linear"
ROWS = 8  # weight rows interleaved
BLOCK = 32  # activation columns sharing an int8 scale
# From this many rows an int4 product is faster as a bfloat16 GEMM on the weight decoded by
# int4_values (2 threads, an AMD EPYC, eager, ms, the kernel / the decoding + oneDNN's GEMM;
# [2816, 1024]: 16 rows 0.44 / 0.57, 32 0.93 / 0.80, 48 0.96 / 1.01, 64 1.21 / 1.22, 128 2.60 /
# 2.30; [1280, 1024]: 16 rows 0.15 / 0.27, 32 0.32 / 0.37, 48 0.43 / 0.48, 64 0.59 / 0.56, 128
# 1.13 / 0.95). int8's kernel: 128 rows 0.78 / 0.91, 512 3.38 / 3.60 ([1280, 1024]).
DECODED_FROM_ROWS = 64
# The most rows the float kernel takes of a bfloat16 weight on a CPU with AMX, whose tiles make
# oneDNN's bf16 GEMM faster from ~9 rows (an Intel Xeon with AMX, 2 threads, weights streamed
# from memory, us, oneDNN / the kernel: [1280, 1024] 4 rows 180 / 125, 8 182 / 167, 10 175 / 202,
# 16 169 / 256; [2816, 1024] 8 333 / 332, 16 318 / 526; 16 experts [1280, 1024] of 8 rows each
# 3190 / 2460, 10 3230 / 3120, 16 3340 / 4040). Without AMX the kernel keeps up to 16-48 rows
# (compiler/backends/few_row_products.py, runtime/grouped_matmul.py).
AMX_BF16_MOST_ROWS = 8
AMX = getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()  # (this host's, for the runtime's choices)
# The library's sources: these kernels, and runtime/latent_attention.py's, sharing kernel_abi.h.
SOURCES = tuple(Path(__file__).with_name(name) for name in ("int_matmul.cpp", "latent_attention.cpp", "kernel_abi.h"))
log = logging.getLogger(__name__)

# The kernels' C functions, as AOTInductor's generated code declares them (torch's naming,
# aoti_torch_cpu_<op>; a `Tensor?` is a pointer to a handle, null for None).
C_SHIMS = {
    "int4_matmul": "AOTITorchError aoti_torch_cpu_int4_matmul(AtenTensorHandle x, AtenTensorHandle codes, AtenTensorHandle scale_zero, "
                   "AtenTensorHandle* ids, AtenTensorHandle* ret0)",
    "int8_matmul": "AOTITorchError aoti_torch_cpu_int8_matmul(AtenTensorHandle x, AtenTensorHandle codes, AtenTensorHandle scales, "
                   "AtenTensorHandle* ids, AtenTensorHandle* ret0)",
    "float_matmul": "AOTITorchError aoti_torch_cpu_float_matmul(AtenTensorHandle x, AtenTensorHandle w, AtenTensorHandle* ids, "
                    "AtenTensorHandle* ret0)",
    "int4_values": "AOTITorchError aoti_torch_cpu_int4_values(AtenTensorHandle codes, AtenTensorHandle scale_zero, AtenTensorHandle* ret0)",
}

torch.library.define("deepinfer::int4_matmul", "(Tensor x, Tensor codes, Tensor scale_zero, Tensor? ids) -> Tensor")
torch.library.define("deepinfer::int4_values", "(Tensor codes, Tensor scale_zero) -> Tensor")
torch.library.define("deepinfer::int8_matmul", "(Tensor x, Tensor codes, Tensor scales, Tensor? ids) -> Tensor")
torch.library.define("deepinfer::float_matmul", "(Tensor x, Tensor w, Tensor? ids) -> Tensor")


@torch.library.register_fake("deepinfer::int4_matmul")
@torch.library.register_fake("deepinfer::int8_matmul")
def _(x, codes, scales, ids):
    return x.new_empty(x.shape[0], 1 if ids is None else ids.shape[1], codes.shape[-2])


@torch.library.register_fake("deepinfer::float_matmul")
def _(x, w, ids):
    return x.new_empty(x.shape[0], 1 if ids is None else ids.shape[1], w.shape[-2])


@torch.library.register_fake("deepinfer::int4_values")
def _(codes, scale_zero):
    return codes.new_empty(*codes.shape[:-1], 2 * codes.shape[-1], dtype=torch.bfloat16)


def is_int4(codes: torch.Tensor) -> bool:
    """int4 codes are bytes of two nibbles (uint8); int8 ones int8."""
    return codes.dtype == torch.uint8


def matmul(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, ids: torch.Tensor | None = None) -> torch.Tensor:
    """The op for the codes' format on x in the form the kernels take (contiguous float32): [X, k or 1, rows] float32."""
    op = torch.ops.deepinfer.int4_matmul if is_int4(codes) else torch.ops.deepinfer.int8_matmul
    return op(x.float().contiguous(), codes, scales, None if ids is None else ids.contiguous())


def product(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [M, in] times one int8 or int4 weight -> [M, out] float32: by the kernel, but for int4
    from DECODED_FROM_ROWS rows by a bfloat16 GEMM on the weight decoded (F.linear, which a
    region's graph can hold: ATen sends bf16 to oneDNN)."""
    if is_int4(codes) and x.shape[0] >= DECODED_FROM_ROWS:
        return decoded_product(x, codes, scales).float()
    return matmul(x, codes, scales).squeeze(1)


def decoded_product(x: torch.Tensor, codes: torch.Tensor, scale_zero: torch.Tensor) -> torch.Tensor:
    """x [M, in] times one int4 weight decoded to bfloat16 (`int4_values`), a bfloat16 GEMM -> [M, out] bfloat16."""
    return torch.nn.functional.linear(x.to(torch.bfloat16), torch.ops.deepinfer.int4_values(codes, scale_zero))


def takes_float(w: torch.Tensor) -> bool:
    """Whether float_matmul takes this float32 or bfloat16 weight [..., rows, in]: rows a multiple of
    8, inputs of 32."""
    return w.dtype in (torch.float32, torch.bfloat16) and w.shape[-2] % ROWS == 0 and w.shape[-1] % BLOCK == 0


def float_reference(x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor | None) -> torch.Tensor:
    """float_matmul's arithmetic in torch (x rounded to bfloat16 for bfloat16 weights): where the
    kernel cannot be built, and for tests."""
    x = x.to(w.dtype).float()
    if ids is None:
        return (x @ w.float().T)[:, None]
    out = x.new_zeros(x.shape[0], ids.shape[1], w.shape[-2])
    for expert in ids.unique().tolist():
        if 0 <= expert < w.shape[0]:
            p, j = (ids == expert).nonzero(as_tuple=True)
            out[p, j] = x[p] @ w[expert].float().T
    return out


def pack_int4(q: torch.Tensor, scale_zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes q [..., rows, in] in 0..15 (rows a multiple of 8) and their (scale, zero) [..., rows,
    in/group, 2] -> (bytes [..., rows, in/2], pairs [..., rows, in/group, 2]) in INT4_LAYOUT."""
    *lead, rows, width = q.shape
    units = q.to(torch.uint8).reshape(*lead, rows // ROWS, ROWS, width // 8, 2, 4)  # [..., block, r, j, (low, high), i]
    codes = (units[..., 0, :] | (units[..., 1, :] << 4)).transpose(-3, -2)  # [..., block, j, r, i]
    pairs = scale_zero.reshape(*lead, rows // ROWS, ROWS, -1, 2).transpose(-3, -2)  # [..., block, group, r, 2]
    return codes.reshape(*lead, rows, width // 2).contiguous(), pairs.reshape(scale_zero.shape).contiguous()


def unpack_int4(codes: torch.Tensor, scale_zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`pack_int4` undone: (q [..., rows, in] as float32, (scale, zero) [..., rows, in/group, 2] in row order)."""
    *lead, rows, half = codes.shape
    units = codes.reshape(*lead, rows // ROWS, half // 4, ROWS, 4)  # [..., block, j, r, i]
    q = torch.stack([units & 0xF, units >> 4], dim=-2).to(torch.float32)  # [..., block, j, r, (low, high), i]
    pairs = scale_zero.reshape(*lead, rows // ROWS, -1, ROWS, 2).transpose(-3, -2)
    return q.transpose(-4, -3).reshape(*lead, rows, 2 * half), pairs.reshape(scale_zero.shape)


def pack_int8(codes: torch.Tensor) -> torch.Tensor:
    """int8 codes [..., rows, in] (rows a multiple of 8, in of 4) -> the same bytes in INT8_LAYOUT."""
    *lead, rows, width = codes.shape
    units = codes.reshape(*lead, rows // ROWS, ROWS, width // 4, 4).transpose(-3, -2)  # [..., block, j, r, i]
    return units.reshape(codes.shape).contiguous()


def unpack_int8(codes: torch.Tensor) -> torch.Tensor:
    """`pack_int8` undone: codes [..., rows, in] in row order."""
    *lead, rows, width = codes.shape
    return codes.reshape(*lead, rows // ROWS, width // 4, ROWS, 4).transpose(-3, -2).reshape(codes.shape)


def values(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Codes and scales in their layout -> weights [..., rows, in] in dtype, in torch."""
    if not is_int4(codes):
        return (unpack_int8(codes).float() * scales.float()[..., None]).to(dtype)
    q, scale_zero = unpack_int4(codes, scales)
    grouped = q.unflatten(-1, (scale_zero.shape[-2], -1)) - 8
    scale, zero = scale_zero.float().unbind(-1)
    return (grouped * scale[..., None] + zero[..., None]).flatten(-2).to(dtype)


def reference(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, ids: torch.Tensor | None) -> torch.Tensor:
    """The kernels' arithmetic in torch (activations quantized the same way): where they cannot be built, and for tests."""
    if ids is None:
        codes, scales, ids = codes[None], scales[None], x.new_zeros(x.shape[0], 1, dtype=torch.int64)
    (X, width), k, rows = x.shape, ids.shape[1], codes.shape[1]
    blocks = x.float().view(X, -1, BLOCK)
    amax = blocks.abs().amax(-1, keepdim=True)
    activation = torch.round(blocks * torch.where(amax > 0, 127 / amax, 0.0))  # [X, in/32, 32] int8 values
    block_scale = (amax / 127).squeeze(-1)  # [X, in/32]
    out = x.new_zeros(X, k, rows, dtype=torch.float32)
    for expert in ids.unique().tolist():
        if not 0 <= expert < codes.shape[0]:
            continue
        p, j = (ids == expert).nonzero(as_tuple=True)
        if not is_int4(codes):
            weight = unpack_int8(codes[expert]).float().view(rows, -1, BLOCK)  # [rows, in/32, 32]
            dots = torch.einsum("pbi,rbi->prb", activation[p], weight)  # exact integers in float32
            out[p, j] = (dots * block_scale[p][:, None]).sum(-1) * scales[expert].float()
            continue
        groups = scales.shape[-2]
        q, pairs = unpack_int4(codes[expert], scales[expert])
        centred = q.view(rows, -1, BLOCK) - 8  # [rows, in/32, 32]
        scale, zero = pairs.float().unbind(-1)  # [rows, groups]
        dots = torch.einsum("pbi,rbi->prb", activation[p], centred)
        per_block = scale.repeat_interleave(width // groups // BLOCK, dim=-1)  # [rows, in/32]
        zeros = x.float()[p].view(len(p), groups, -1).sum(-1) @ zero.T  # [pairs, rows]: each group's sum of x times its zeros
        out[p, j] = (dots * per_block * block_scale[p][:, None]).sum(-1) + zeros
    return out


def _host_key(command: list[str]) -> str:
    """What the built kernel depends on: its source, torch, the compiler, its flags and this CPU's features."""
    cpu = Path("/proc/cpuinfo").read_text().split("flags", 1)[-1].split("\n", 1)[0] if Path("/proc/cpuinfo").exists() else ""
    version = subprocess.run([command[0], "--version"], capture_output=True, text=True).stdout
    parts = [*(source.read_bytes() for source in SOURCES), torch.__version__, version, " ".join(command), cpu, os.uname().machine]
    return hashlib.sha256("\0".join(map(str, parts)).encode()).hexdigest()[:20]


def _build() -> Path:
    """The kernel library for this host, compiled into the cache unless there already."""
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (g++ or c++ on PATH, or CXX)")
    torch_dir = Path(torch.__file__).parent
    command = [compiler, "-O3", f"-march={knobs.kernel_march()}", "-fopenmp-simd", "-std=c++17", "-shared", "-fPIC",
               f"-I{torch_dir / 'include'}", *(str(source) for source in SOURCES if source.suffix == ".cpp"),
               f"-L{torch_dir / 'lib'}", "-ltorch_cpu", "-lc10", f"-Wl,-rpath,{torch_dir / 'lib'}"]
    target = knobs.cache_dir() / "kernels" / f"int_matmul-{_host_key(command)}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:  # (ranks may build at once: each renames its own)
        built = Path(scratch) / target.name
        command += ["-o", str(built)]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"`{' '.join(command)}` failed:\n{result.stderr[-2000:]}")
        os.replace(built, target)
    return target


def _register() -> str | None:
    """Load the built kernel as the ops' CPU implementation, its C shims global; the torch
    reference if it cannot be built, which says so when integer weights first use it (a host
    without a compiler running float bundles hears nothing). Why it could not be, or None."""
    try:
        library = str(_build())
        ctypes.CDLL(library, mode=os.RTLD_GLOBAL)  # (before the dispatcher's load, which would keep them local)
        torch.ops.load_library(library)
        return None
    except (OSError, RuntimeError) as error:
        unwarned = [error]

        def warn_once():
            if unwarned:
                log.warning("deepinfer: the int8/int4 and few-row float kernels could not be built here, so they run as their torch "
                            "reference, several times slower (%s). Install g++ (or set CXX) for the fast kernels.", unwarned.pop())

        def matmul_reference(x, codes, scales, ids):
            warn_once()
            return reference(x, codes, scales, ids)

        def values_reference(codes, scales):
            warn_once()
            return values(codes, scales, torch.bfloat16)

        def float_matmul_reference(x, w, ids):
            warn_once()
            return float_reference(x, w, ids)

        for op in ("int4_matmul", "int8_matmul"):
            torch.library.impl(f"deepinfer::{op}", "CPU")(matmul_reference)
        torch.library.impl("deepinfer::float_matmul", "CPU")(float_matmul_reference)
        torch.library.impl("deepinfer::int4_values", "CPU")(values_reference)
        return str(error)


KERNEL_PROBLEM = _register()
KERNEL_BUILT = KERNEL_PROBLEM is None
