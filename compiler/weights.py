"""Per-rank weight files, streamed: each tensor is read (only this rank's slice of it) and written
before the next is read, so neither the checkpoint nor a rank's shard is ever whole in memory."""

import json
import struct
from pathlib import Path

import torch

from deepinfer.models.parallel import Layout, rank_buffers

SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int64: "I64",
                      torch.float8_e4m3fn: "F8_E4M3", torch.uint8: "U8"}


def write_safetensors(path: Path, specs: list[tuple[str, list[int], torch.dtype]], tensor_of):
    """A safetensors file whose header is computed from `specs` up front; `tensor_of(name)` is
    then called once per tensor, in order, and its bytes written straight to disk."""
    header, offset = {}, 0
    for name, shape, dtype in specs:
        size = torch.Size(shape).numel() * dtype.itemsize
        header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * ((-len(blob)) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name, shape, dtype in specs:
            tensor = tensor_of(name)
            if list(tensor.shape) != list(shape) or tensor.dtype != dtype:
                raise ValueError(f"{path}: {name} is {list(tensor.shape)} {tensor.dtype}, expected {shape} {dtype}")
            f.write(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())


def write_rank_files(directory: Path, specs, layout: Layout, config, read_slice):
    """weights/rank-<r>.safetensors for every rank. `specs` are the shard shapes (the same on every
    rank); `read_slice(name, rank)` gives rank's slice of a weight; layout buffers come from
    models.parallel.rank_buffers."""
    for rank in range(layout.world_size):
        buffers = rank_buffers(layout, config, rank)

        def tensor_of(name, rank=rank, buffers=buffers):
            leaf = name.rpartition(".")[2]
            return buffers[leaf] if leaf in buffers else read_slice(name, rank)

        write_safetensors(Path(directory) / f"rank-{rank}.safetensors", specs, tensor_of)
