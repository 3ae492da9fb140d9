"""Context parallelism (recipe `parallel.cp`): a group of cp ranks shares one replica's sequences.

Position-indexed state is striped over the group: rank c of the group keeps positions p with
p % cp == c, at entry p // cp of its shard (so a shard of a pool of L positions has L / cp
entries, and a program for a context bucket of c positions reads the first c / cp of them, as
for any tensor with one entry per cp positions: models/state.py). Attention runs on every rank
of the group over its own shard, for every query row; the partial results (an output and the
log-sum-exp of the scores it saw) are all-gathered over the group and merged exactly:

    out = sum_c exp(lse_c - M) out_c / sum_c exp(lse_c - M),   M = max_c lse_c

Decode rows are computed by every rank of the group (a step of B rows is small: only the
attention over the context, which grows, is split). A prefill chunk's T rows are split: rank c
computes rows [c T / cp, (c + 1) T / cp) through every projection and MLP, gathers the chunk's
queries and new keys from the group for the attention, and takes its own rows of the merged
output. Striped keys balance the causal attention by themselves (every rank holds every cp-th
position), so contiguous row blocks need no zigzag order. The MoE gathers its input rows from
the group, as its experts are split over every rank, and the chunk's hidden states are gathered
once, before the head. This is the design of SGLang's DCP for MLA (positions striped over the
group, partials merged by LSE) with vLLM's prefill CP (rows split, the chunk's keys gathered).

DeepSeek-V4 stripes its CSA entries (and its indexer's) the same way, by entry (one entry pools
`rate` positions): a shard holds L / (rate cp) entries. The rest (HCA's few entries, the
sliding-window rings, the compressors' rings) stays whole on every rank: each rank attends the
window and the sink itself and merges that partial with the group's partials over the striped
entries; the indexer's top-k is merged from every rank's (top_k).
"""

import torch
from torch import nn

import deepinfer.runtime.collectives  # noqa: F401  (registers torch.ops.deepinfer.*)

GROUP = "cp"


def register_cp_rank(module: nn.Module, layout, rank: int):
    """The module's place in its cp group as a buffer (a tensor: every rank traces the same graph;
    each rank's weight file holds its own value, models.parallel.rank_buffers)."""
    with torch.device("cpu"):  # derived from the layout, also when the weights are on meta
        module.register_buffer("cp_rank", torch.tensor(layout.cp_rank(rank)), persistent=False)


def gather(x: torch.Tensor, cp: int) -> torch.Tensor:
    """The group's x concatenated along dim 0, in group order: [cp N, ...]."""
    return torch.ops.deepinfer.all_gather(x, GROUP, 0, cp)


def gather_rows(rows, cp: int) -> tuple[torch.Tensor, ...]:
    """Per-row tensors [N, ...] of this rank -> the group's [cp N, ...] each, in one all-gather
    (packed in the widest dtype; each comes back in its own)."""
    flat = [x.flatten(1) for x in rows]
    sizes = [x.shape[1] for x in flat]
    parts = gather(torch.cat(flat, dim=-1), cp).split(sizes, dim=-1)
    return tuple(part.to(x.dtype).view(-1, *x.shape[1:]) for part, x in zip(parts, rows))


def own_rows(x: torch.Tensor, cp_rank: torch.Tensor, cp: int) -> torch.Tensor:
    """This rank's block of the rows of x [T, ...] -> [T / cp, ...]."""
    n = x.shape[0] // cp
    return x.index_select(0, cp_rank * n + torch.arange(n, device=x.device))


def over_whole_chunk(fn, x: torch.Tensor, cp_rank: torch.Tensor, cp: int, *args) -> torch.Tensor:
    """fn over the group's whole chunk (this rank's rows x [T / cp, ...] gathered), this rank's
    block of its result kept: for an MoE whose experts are split over the group, so that each
    rank's experts see every row of the chunk."""
    return own_rows(fn(gather(x, cp), *args), cp_rank, cp)


def stripe(positions: torch.Tensor, slots: torch.Tensor, cp_rank: torch.Tensor, cp: int, scratch: int):
    """Where the rows at `positions` [T] of `slots` [T] go in this rank's shard: (slot, entry);
    rows kept by another rank of the group go to the scratch slot."""
    return torch.where(positions % cp == cp_rank, slots, scratch), positions // cp


def key_positions(entries: int, cp_rank: torch.Tensor, cp: int, device) -> torch.Tensor:
    """[entries]: the position each entry of this rank's shard holds."""
    return torch.arange(entries, device=device) * cp + cp_rank


def top_k(scores: torch.Tensor, k: int, cp_rank: torch.Tensor, cp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """scores [..., E / cp] of this rank's entries (entry i holds the group's entry i cp + cp_rank;
    -inf: not visible) -> the top min(k, E) entries of the whole group's E: their ids [..., k]
    and whether each is visible. Any top-k entry of the group is among the top-k of the rank that
    holds it, so the top-k of the group's candidates is the top-k of all E (one all-gather)."""
    local = scores.topk(min(k, scores.shape[-1]), dim=-1)  # [..., k']
    ids = local.indices * cp + cp_rank
    packed = torch.stack([local.values.float(), ids.float()], dim=-1)  # [..., k', 2] (ids < 2^24: exact in float32)
    parts = gather(packed, cp).view(cp, *packed.shape).movedim(0, -3)  # [..., cp, k', 2]
    values, ids = parts.flatten(-3, -2).unbind(-1)  # [..., cp k'] each
    best = values.topk(min(k, scores.shape[-1] * cp), dim=-1)
    return ids.gather(-1, best.indices).long(), torch.isfinite(best.values)


def partial_softmax(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """scores [..., K] (-inf where not visible) -> probabilities [..., K] float32 over this
    shard's keys and their log-sum-exp [...] (-inf, with zero probabilities, where none is visible)."""
    scores = scores.float()
    peak = scores.amax(dim=-1, keepdim=True)
    peak = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))
    weights = (scores - peak).exp()
    total = weights.sum(dim=-1, keepdim=True)
    probs = weights / total.clamp(min=torch.finfo(torch.float32).tiny)
    return probs, (peak + total.log()).squeeze(-1)


def merge(out: torch.Tensor, lse: torch.Tensor, cp: int) -> torch.Tensor:
    """Every rank's partial out [T, ..., C] with its lse [T, ...] -> the attention over all
    shards [T, ..., C] (one all-gather over the group)."""
    return merge_partials(*gather_partials(out, lse, cp)).to(out.dtype)


def gather_partials(out: torch.Tensor, lse: torch.Tensor, cp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's partial out [T, ..., C] and lse [T, ...] -> float32 [cp, T, ..., C], [cp, T, ...]."""
    C = out.shape[-1]
    packed = torch.cat([out.float(), lse[..., None]], dim=-1)  # [T, ..., C + 1]
    outs, lses = gather(packed, cp).view(cp, *packed.shape).split([C, 1], dim=-1)
    return outs, lses.squeeze(-1)


def merge_partials(outs: torch.Tensor, lses: torch.Tensor) -> torch.Tensor:
    """Partials over disjoint keys, outs [P, ..., C] with lses [P, ...] -> the attention over all
    of them [..., C] float32."""
    weights = (lses - lses.amax(dim=0, keepdim=True)).exp()[..., None]  # [P, ..., 1]
    return (outs * weights).sum(dim=0) / weights.sum(dim=0)


class SplitRows(nn.Module):
    """A prefill chunk's per-row tensors [T, ...] -> this rank's block of rows [T / cp, ...]."""

    def __init__(self, layout):
        super().__init__()
        self.layout = layout
        self.init_buffers()

    def init_buffers(self, rank: int = 0):
        register_cp_rank(self, self.layout, rank)

    def forward(self, *rows):
        return tuple(own_rows(x, self.cp_rank, self.layout.cp) for x in rows)


class GatherRows(nn.Module):
    """The group's blocks of rows -> the whole chunk's [T, ...] (one all-gather)."""

    def __init__(self, cp: int):
        super().__init__()
        self.cp = cp

    def forward(self, *rows):
        return gather_rows(rows, self.cp)
