"""Lazy reading of HF checkpoint directories: config.json plus one or many *.safetensors.

Nothing is read until a tensor is asked for, and then only that tensor, with plain reads into
the tensor's own memory: host memory holds the tensor once (a memory map would also keep every
page it touched resident: twice a tensor's size in RSS), and a model is filled one parameter at a
time without a whole-checkpoint copy.
"""

import json
import struct
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from deepinfer.runtime.errors import DeepinferError


class CheckpointError(DeepinferError, ValueError):
    """A checkpoint that cannot be loaded; the message names the file or key and what to do."""

    exit_code = 2  # bad input, as a bad recipe


def read_config(directory: Path) -> dict:
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{path}: no config.json. A checkpoint directory holds config.json plus *.safetensors (HF layout).")
    try:
        return json.loads(path.read_text())
    except (ValueError, RecursionError) as err:  # bad JSON, bad UTF-8, absurd nesting
        raise CheckpointError(f"{path}: not valid JSON ({err}).") from None


# safetensors' dtype names -> torch's (what a checkpoint of ours or a release stores)
TORCH_DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
                "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "F8_E8M0": torch.float8_e8m0fnu,
                "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                "BOOL": torch.bool}
READ_CHUNK = 64 << 20  # bytes of whole rows read at once when only some columns are wanted


class SafetensorsDir:
    """Key -> file index over every *.safetensors in a directory; tensors are read on demand."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        files = sorted(self.directory.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{self.directory}: no *.safetensors weight files. Save the model with save_pretrained (safetensors), not pickle.")
        self._handles = {}
        self._file_of = {}
        for file in files:
            try:
                handle = safe_open(str(file), framework="pt")
            except Exception as err:  # safetensors raises its own error types for bad headers
                raise CheckpointError(f"{file}: unreadable safetensors file ({err}).") from None
            self._handles[file] = handle
            for key in handle.keys():
                self._file_of[key] = file
        self._offsets = {}  # key -> where its bytes start in its file

    def _start(self, key: str) -> int:
        if key not in self._offsets:
            file = self._file_of[key]
            with open(file, "rb") as f:  # (validated by safe_open above)
                size = struct.unpack("<Q", f.read(8))[0]
                header = json.loads(f.read(size))
            self._offsets.update({k: 8 + size + v["data_offsets"][0] for k, v in header.items() if k != "__metadata__"})
        return self._offsets[key]

    def _read_into(self, key: str, out: torch.Tensor, skip: int = 0):
        """Fill `out` (contiguous) with the bytes of `key` from byte `skip` of its data on."""
        view = memoryview(out.view(-1).view(torch.uint8).numpy())
        with open(self._file_of[key], "rb", buffering=0) as f:
            f.seek(self._start(key) + skip)
            done = 0
            while done < len(view):
                n = f.readinto(view[done:])
                if not n:
                    raise CheckpointError(f"{self._file_of[key]}: weight {key!r} is cut short (the file is truncated). "
                                          "Download it again.")
                done += n

    def _dtype(self, key: str) -> torch.dtype:
        name = self.get_dtype(key)
        if name not in TORCH_DTYPES:
            raise CheckpointError(f"{self._file_of[key]}: weight {key!r} is stored as {name}, which deepinfer does not read.")
        return TORCH_DTYPES[name]

    def __contains__(self, key: str) -> bool:
        return key in self._file_of

    def get(self, key: str) -> torch.Tensor:
        if key not in self._file_of:
            raise CheckpointError(f"{self.directory}: weight {key!r} is missing from every *.safetensors file. Is the checkpoint complete?")
        tensor = torch.empty(self.get_shape(key), dtype=self._dtype(key))
        self._read_into(key, tensor)
        return tensor

    def get_slice(self, key: str, dim: int, start: int, length: int) -> torch.Tensor:
        """Rows or columns [start, start + length) of a 2-D weight: rows read alone, columns from
        whole rows read READ_CHUNK bytes at a time."""
        rows, columns = self.get_shape(key)
        dtype = self._dtype(key)
        row_bytes = columns * dtype.itemsize
        if dim == 0:
            out = torch.empty(length, columns, dtype=dtype)
            self._read_into(key, out, start * row_bytes)
            return out
        out = torch.empty(rows, length, dtype=dtype)
        step = max(1, READ_CHUNK // row_bytes)
        for first in range(0, rows, step):
            block = torch.empty(min(step, rows - first), columns, dtype=dtype)
            self._read_into(key, block, first * row_bytes)
            out[first : first + len(block)] = block[:, start : start + length]
        return out

    def get_shape(self, key: str) -> list[int]:
        if key not in self._file_of:
            self.get(key)  # raises the missing-key error
        return self._handles[self._file_of[key]].get_slice(key).get_shape()

    def get_dtype(self, key: str) -> str:
        """safetensors' dtype name, e.g. "BF16", "F8_E4M3"."""
        self.get_shape(key)
        return self._handles[self._file_of[key]].get_slice(key).get_dtype()

    def file_of(self, key: str) -> Path:
        return self._file_of[key]


def set_parameter(model: nn.Module, name: str, tensor: torch.Tensor):
    """Replace parameter `name` (e.g. 'layers.0.mlp.gate.weight') by `tensor`, without copying it."""
    module_name, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(module_name), leaf, nn.Parameter(tensor, requires_grad=False))


def init_buffers(model: nn.Module):
    """(Re)compute the buffers that are derived from the config, on the CPU."""
    for module in model.modules():
        if hasattr(module, "init_buffers"):
            module.init_buffers()
