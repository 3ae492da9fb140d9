"""Speculative decoding's step layout, shared by every model with MTP modules.

A verify step and a draft step take rows in blocks of T = k + 1 per sequence (k draft tokens):
the sequence's valid rows first, at consecutive positions, then padding rows in the scratch slot.
A block is one sequence's chunk, as a prefill chunk is: models whose attention works on
[sequences, tokens] (DeepSeek-V4) read it so, and per-row models (DeepSeek-V3) need not care.
"""

import torch


def blocks(positions: torch.Tensor, slots: torch.Tensor, T: int):
    """Rows [N T] in blocks of T -> each block's slot [N], first position [N] and last valid
    row [N] (a block of padding only: the scratch slot, and its last row)."""
    slots, positions = slots.view(-1, T), positions.view(-1, T)
    last = (slots == slots[:, :1]).sum(dim=1) - 1
    return slots[:, 0], positions[:, 0], last


def chain_drafts(step, logits: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, k: int, state: torch.Tensor):
    """k draft tokens per block [N, k]: the argmax of `logits` [N (k + 1), V] at each block's last
    valid row, then k - 1 more, each `step(tokens [N], positions [N], slots [N]) -> logits [N, V]`
    over the previous draft at the next position. A row past `state`'s positions (axis 1: a
    context bucket's view, or the pool) goes to its scratch slot: the engine keeps no draft there."""
    slot, first, last = blocks(positions, slots, k + 1)
    rows = logits.view(slot.shape[0], k + 1, -1)
    drafts = [rows.gather(1, last[:, None, None].expand(-1, 1, rows.shape[-1]))[:, 0].argmax(dim=-1)]
    position = first + last
    scratch, end = state.shape[0] - 1, state.shape[1]
    for j in range(1, k):
        inside = position + j < end
        drafts.append(step(drafts[-1], torch.where(inside, position + j, 0), torch.where(inside, slot, scratch)).argmax(dim=-1))
    return torch.stack(drafts, dim=1)
