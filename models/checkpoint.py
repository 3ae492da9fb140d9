"""Lazy reading of HF checkpoint directories: config.json plus one or many *.safetensors.

Nothing is read until a tensor is asked for, and then only that tensor (safetensors memory-maps
the files), so a model is filled one parameter at a time without a whole-checkpoint copy.
"""

import json
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

    def __contains__(self, key: str) -> bool:
        return key in self._file_of

    def get(self, key: str) -> torch.Tensor:
        if key not in self._file_of:
            raise CheckpointError(f"{self.directory}: weight {key!r} is missing from every *.safetensors file. Is the checkpoint complete?")
        return self._handles[self._file_of[key]].get_tensor(key)

    def get_slice(self, key: str, dim: int, start: int, length: int) -> torch.Tensor:
        """Rows or columns [start, start + length) of a 2-D weight, reading only those bytes."""
        self.get_shape(key)  # names a missing key
        view = self._handles[self._file_of[key]].get_slice(key)
        return view[start : start + length] if dim == 0 else view[:, start : start + length]

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
