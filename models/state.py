"""What a layer keeps per sequence slot, as data the compiler and runtime read: `StateSpec`.

A tensor whose axis 1 is indexed by position (a KV cache: one entry per position; compressed
entries: one per `positions_per_entry` positions) says so, and a program compiled for a context
bucket c then reads and writes only its first c / positions_per_entry entries: a view of the
pool, never a copy. Tensors of a fixed size whatever the context (a sliding window's ring, a
compressor's buffer) leave it None.
"""

from typing import NamedTuple

import torch


class StateSpec(NamedTuple):
    name: str
    shape: list[int]  # [max_seqs + 1, ...]: one row per sequence slot, the last one scratch
    dtype: torch.dtype
    positions_per_entry: int | None = None  # axis 1 holds one entry per this many positions


def allocate(specs: list[list[StateSpec]]) -> list[list[torch.Tensor]]:
    """Zeroed tensors for every layer's specs."""
    return [[torch.zeros(s.shape, dtype=s.dtype) for s in layer] for layer in specs]


def context_view(tensor: torch.Tensor, spec: StateSpec, context: int | None) -> torch.Tensor:
    """The part of a state tensor a program for `context` positions reads: its first
    context / positions_per_entry entries on axis 1 (the whole tensor when not position-indexed)."""
    if context is None or spec.positions_per_entry is None:
        return tensor
    return tensor.narrow(1, 0, context // spec.positions_per_entry)
