"""Per-rank weight files, streamed: each tensor is read (only this rank's slice of it) and written
before the next is read, so neither the checkpoint nor a rank's shard is ever whole in memory.
The one-step compile and the weights step (`deepinfer-compile weights`) both write through here.

A reader is `read_slice(name, rank) -> tensor`: rank's slice of weight `name`, as the bundle stores
it (the spec's shape and dtype)."""

import hashlib
import json
import struct
from pathlib import Path

import torch

from deepinfer.models import read_weight, stored_dtype
from deepinfer.models.checkpoint import TORCH_DTYPES, SafetensorsDir
from deepinfer.models.int_weights import SCALE as INT_SCALE
from deepinfer.models.int_weights import float_source, int8_cut_by_columns, quantized, source_name
from deepinfer.models.parallel import Layout, rank_buffers, shard
from deepinfer.models.quantization import SCALE_SUFFIX

from . import trace

SAFETENSORS_DTYPES = {dtype: name for name, dtype in TORCH_DTYPES.items()}

Specs = list[tuple[str, list[int], torch.dtype]]  # (name, shape, dtype) of each tensor, in file order


ALIGN = 64  # bytes: every tensor starts at a multiple of it in the file (and so in the runtime's buffer)
PADDING = "__padding."  # names of the filler tensors that align the next one


def write_safetensors(path: Path, specs: Specs, tensor_of, on_written=None) -> str:
    """A safetensors file whose header is computed from `specs` up front; `tensor_of(name)` is
    then called once per tensor, in order, and its bytes written straight to disk (and hashed as
    written; `on_written(n)` is told each tensor's bytes). Returns the file's sha256.

    Each tensor starts 64-byte aligned (the runtime views them in place, and vector kernels read
    them: ATen's int8 kernel crashed on a weight that was not 16-byte aligned): the header is
    padded to it, and a filler tensor `__padding.<i>` of zero bytes precedes a tensor that would
    not be (safetensors allows no holes between tensors)."""
    header, offset, laid_out = {}, 0, []
    for name, shape, dtype in specs:
        if offset % ALIGN:
            filler = (f"{PADDING}{len(laid_out)}", [ALIGN - offset % ALIGN], torch.uint8)
            header[filler[0]] = {"dtype": "U8", "shape": filler[1], "data_offsets": [offset, offset + filler[1][0]]}
            offset += filler[1][0]
            laid_out.append(filler)
        size = torch.Size(shape).numel() * dtype.itemsize
        header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
        laid_out.append((name, shape, dtype))
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * ((-8 - len(blob)) % ALIGN)
    digest = hashlib.sha256()
    with open(path, "wb") as f:
        for chunk in (struct.pack("<Q", len(blob)), blob):
            f.write(chunk)
            digest.update(chunk)
        for name, shape, dtype in laid_out:
            tensor = torch.zeros(shape, dtype=dtype) if name.startswith(PADDING) else tensor_of(name)
            if list(tensor.shape) != list(shape) or tensor.dtype != dtype:
                raise ValueError(f"{path}: {name} is {list(tensor.shape)} {tensor.dtype}, expected {shape} {dtype}")
            data = tensor.contiguous().reshape(-1).view(torch.uint8).numpy()
            f.write(data)
            digest.update(data)
            if on_written:
                on_written(data.nbytes)
    return digest.hexdigest()


def file_bytes(specs: Specs) -> int:
    """The tensor bytes of a file of `specs` (its header aside)."""
    return sum(torch.Size(shape).numel() * dtype.itemsize for _, shape, dtype in specs)


def write_rank_file(path: Path, rank: int, specs: Specs, layout: Layout, config, read_slice, on_written=None) -> str:
    """weights/rank-<rank>.safetensors; layout buffers come from models.parallel.rank_buffers."""
    buffers = rank_buffers(layout, config, rank)

    def tensor_of(name):
        leaf = name.rpartition(".")[2]
        return buffers[leaf] if leaf in buffers else read_slice(name, rank)

    return write_safetensors(path, specs, tensor_of, on_written)


def write_rank_files(directory: Path, specs: Specs, layout: Layout, config, read_slice):
    """Every rank's file (the one-step compile)."""
    for rank in range(layout.world_size):
        write_rank_file(Path(directory) / f"rank-{rank}.safetensors", rank, specs, layout, config, read_slice)


def checkpoint_reader(checkpoint: Path, full, layout: Layout, dtype: torch.dtype):
    """Slices read from an HF checkpoint against `full` (the model's meta tensors of full shapes;
    its derived buffers, rope frequencies, are real): only each rank's slice is read."""
    weights = SafetensorsDir(Path(checkpoint))
    derived = dict(full.named_buffers())

    def read_slice(name, rank):
        if name in derived:
            return derived[name]
        shape = tuple(trace.tensor_at(full, name).shape)
        split = layout.split(name)
        part = None
        if split:
            size = shape[split[0]] // split[1]
            part = (split[0], layout.shard_index(name, rank) * size, size)
        return read_weight(weights, full, name, part).to(stored_dtype(full, name, dtype))

    return read_slice


def model_reader(model, layout: Layout):
    """Slices cut from a model in memory (a config + seed recipe's random weights)."""
    return lambda name, rank: shard(name, trace.tensor_at(model, name), layout, rank)


def transformed(read_slice, transform, full):
    """Each slice through a backend's `transform_weight(name, tensor, scales_for)` (scales_for: the
    dtype of the weight a scale belongs to, for scale tensors)."""

    def read(name, rank):
        scaled = name.removesuffix(SCALE_SUFFIX)
        scales_for = full.get_parameter(scaled).dtype if scaled != name else None
        return transform(name, read_slice(name, rank), scales_for)

    return read


def int_quantized(read_slice, read_whole, specs: Specs, layout: Layout, group: int, full):
    """model.quantize's codes and scales (models/int_weights.py) made from each rank's float slice
    as they are written, or from another weight's (`float_source` in `full`, the float model);
    other tensors pass through. A weight cut by columns (row-parallel) and quantized per row is
    read whole (`read_whole(name)`), so its scales are the whole rows': every rank's codes are the
    one-rank bundle's, cut. Codes and their scales come from one quantization (the file order keeps
    them adjacent)."""
    dtypes = {name: dtype for name, _, dtype in specs}
    dims = {name: len(shape) for name, shape, _ in specs}
    last = {}

    def read(name, rank):
        origin = source_name(name)
        if origin + INT_SCALE not in dtypes:
            return read_slice(name, rank)
        if last.get("key") != (origin, rank):
            split = layout.split(origin)
            if dtypes[origin] == torch.int8 and split and split[0] == dims[origin] - 1:
                made = int8_cut_by_columns(origin, read_whole(origin), lambda codes: shard(origin, codes, layout, rank))
            else:
                weight = float_source(full, origin, lambda source: read_slice(source, rank))
                made = quantized(origin, weight, dtypes[origin], group)
            last.update(key=(origin, rank), made=made)
        return last["made"][name]

    return read
