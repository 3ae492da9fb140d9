"""A rank's weights from its safetensors file, as views of the one verified buffer it was read into.

The format (https://github.com/huggingface/safetensors): 8 bytes little-endian header length, a
JSON header {name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}, then
the data. Parsed here rather than by the safetensors library so that the bytes whose sha256 the
manifest lists are the bytes the tensors view: no second read of the file, no second copy.
"""

import json
import math

import torch

from .errors import BundleError

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
MAX_HEADER = 100 << 20


def _refuse(where: str, what: str):
    raise BundleError(f"{where}: not a readable safetensors file ({what}). Recompile the bundle.")


def header_of(buffer: torch.Tensor, where: str) -> tuple[dict, torch.Tensor]:
    """(the JSON header, the data bytes after it) of a safetensors file in `buffer` (uint8)."""
    if buffer.numel() < 8:
        _refuse(where, "shorter than its header")
    length = int.from_bytes(buffer[:8].numpy().tobytes(), "little")
    if not 2 <= length <= min(MAX_HEADER, buffer.numel() - 8):
        _refuse(where, f"a header of {length} bytes")
    try:
        header = json.loads(buffer[8 : 8 + length].numpy().tobytes())
    except (ValueError, RecursionError):
        _refuse(where, "its header is not JSON")
    if not isinstance(header, dict):
        _refuse(where, "its header is not an object")
    return header, buffer[8 + length :]


def tensors_of(buffer: torch.Tensor, where: str) -> dict[str, torch.Tensor]:
    """buffer: uint8 [file bytes] -> {name: tensor viewing it}."""
    header, data = header_of(buffer, where)
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if (not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}
                or not isinstance(entry["dtype"], str) or entry["dtype"] not in DTYPES):
            _refuse(where, f"tensor {name!r} is described by {str(entry)[:80]}")
        dtype, shape, offsets = DTYPES[entry["dtype"]], entry["shape"], entry["data_offsets"]
        if (not isinstance(shape, list) or not all(type(d) is int and 0 <= d < 1 << 40 for d in shape)
                or not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets)
                or not 0 <= offsets[0] <= offsets[1] <= data.numel()
                or offsets[1] - offsets[0] != math.prod(shape) * dtype.itemsize):
            _refuse(where, f"tensor {name!r} has shape {shape} and offsets {offsets} that do not fit its {data.numel()} data bytes")
        raw = data[offsets[0] : offsets[1]]
        if raw.storage_offset() % dtype.itemsize:  # a file not laid out by safetensors' writer: copy to align
            raw = raw.clone()
        tensors[name] = raw.view(dtype).view(shape)
    return tensors
