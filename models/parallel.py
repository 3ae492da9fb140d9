"""How a model is split over ranks, as data: which dim of which weight, and what each rank owns.

Layout (world_size W, tp, ep, cp):
- MLA heads, the dense MLP, the shared experts and the LM head's vocabulary split over `tp`
  consecutive ranks; the W/tp groups of tp ranks are replicas that compute the same tokens,
  unless `cp` > 1: then groups of cp replicas share one replica's sequences, each keeping every
  cp-th position of the state and computing its block of a prompt chunk's rows
  (models/context_parallel.py).
  o_proj and down_proj are row-parallel: the partial sums meet in an all-reduce over "tp".
- Routed experts: each rank HOLDS E/ep experts (its EP shard) and OWNS E/W of them, the ones it
  computes; a routed expert owned elsewhere contributes zero here. The owned partial sum joins
  the shared expert's partial, which only the first tp replica adds, before the MoE block's one
  all-reduce over "world".
- Embedding: replicated. A decode step looks up B rows; splitting the vocabulary would save
  memory but cost an all-reduce every step, and small-batch decode is latency-bound.
- LM head: vocabulary-parallel over "tp", then one all-gather of the [B, V/tp] logits: each rank
  reads 1/tp of the largest weight in the model, and B x V floats are cheap to gather.

Rank-dependent values (expert offsets, the owned range, the shared-expert scale) are buffers set
by `assign_rank`, so every rank traces and runs the SAME graph.

DeepSeek-V4 splits the same way (routed experts over ep/world, the shared expert and the LM head
over tp), and its attention's query side over tp too: V4 attention is shared-KV MQA (one K=V head
that every query head reads) with a grouped low-rank output projection, so a rank takes
n_heads / tp heads in o_groups / tp whole groups -- wq_b and wo_a by rows, wo_b by columns
(row-parallel, then an all-reduce over tp), the sinks by head -- while the K=V head, the
compressors and the indexer, every head's inputs, are computed whole on each rank. Those are the
attention's large weights (V4-Pro: wq_b, wo_a and wo_b are most of the 19 GiB of attention
weights a rank held when attention was replicated, which kept V4-Pro off a trn2 node); the price
is one all-reduce over tp a layer.
"""

from dataclasses import dataclass

import torch

from deepinfer.runtime.errors import DeepinferError

from .quantization import SCALE_SUFFIX

# parameter name suffix -> dim split over tp (0: output rows, column-parallel; 1: input columns, row-parallel)
TP_SPLITS = {
    "self_attn.q_proj.weight": 0,
    "self_attn.q_b_proj.weight": 0,
    "self_attn.kv_b_proj.weight": 0,
    "self_attn.w_uk": 0,  # (kv_b_proj's heads in an int-quantized model)
    "self_attn.w_uv": 0,
    "self_attn.o_proj.weight": 1,
    "mlp.gate_proj.weight": 0,
    "mlp.up_proj.weight": 0,
    "mlp.down_proj.weight": 1,
    "mlp.shared_experts.gate_proj.weight": 0,
    "mlp.shared_experts.up_proj.weight": 0,
    "mlp.shared_experts.down_proj.weight": 1,
    "head.lm_head.weight": 0,
    "ffn.shared_experts.w1.weight": 0,  # DeepSeek-V4 names
    "ffn.shared_experts.w3.weight": 0,
    "ffn.shared_experts.w2.weight": 1,
    "attn.wq_b.weight": 0,  # V4's query heads, in whole output groups
    "attn.wo_a.weight": 0,
    "attn.wo_b.weight": 1,
    "attn.attn_sink": 0,
    "head.weight": 0,
}
# parameter name suffix -> dim split over ep
EP_SPLITS = {"mlp.experts_gate_up": 0, "mlp.experts_down": 0, "ffn.experts_w13": 0, "ffn.experts_w2": 0}


class LayoutError(DeepinferError, ValueError):
    """A parallel layout that does not fit the model; the message names the numbers."""

    exit_code = 2  # bad input, as a bad recipe


@dataclass(frozen=True)
class Layout:
    world_size: int = 1
    tp: int = 1
    ep: int = 1
    cp: int = 1

    @property
    def replicas(self) -> int:
        """Data-parallel factor of the tp-sharded parts: world_size = tp x replicas."""
        return self.world_size // self.tp

    def cp_rank(self, rank: int) -> int:
        """Which of its context-parallel group's cp shares rank holds: replicas r and r + 1 of
        the same tp index are neighbours in a cp group (ranks rank % tp + tp k)."""
        return rank // self.tp % self.cp

    def split(self, name: str) -> tuple[int, int] | None:
        """(dim, parts) that parameter `name` is split into, or None if every rank holds all of it.
        An fp8 weight's row-expanded scales split as the weight does (dim 1 in whole blocks)."""
        name = name.removesuffix(SCALE_SUFFIX)
        for suffix, dim in TP_SPLITS.items():
            if name.endswith(suffix) and self.tp > 1:
                return dim, self.tp
        for suffix, dim in EP_SPLITS.items():
            if name.endswith(suffix) and self.ep > 1:
                return dim, self.ep
        return None

    def shard_index(self, name: str, rank: int) -> int:
        """Which of the `parts` slices of `name` rank holds."""
        name = name.removesuffix(SCALE_SUFFIX)
        return rank % self.tp if any(name.endswith(s) for s in TP_SPLITS) else rank // (self.world_size // self.ep)

    def check(self, config) -> None:
        c, w, tp, ep = config, self.world_size, self.tp, self.ep
        if min(w, tp, ep) < 1:
            raise LayoutError(f"parallel: world_size={w}, tp={tp}, ep={ep} must all be >= 1.")
        if w % tp:
            raise LayoutError(f"parallel: world_size={w} must be tp={tp} x replicas; {w} is not divisible by {tp}.")
        if w % ep:
            raise LayoutError(f"parallel: ep={ep} must divide world_size={w} (each EP shard is held by world_size/ep ranks).")
        if self.cp < 1 or (w // tp) % self.cp:
            raise LayoutError(f"parallel: cp={self.cp} must divide world_size / tp = {w // tp}, the replicas of the tp-split "
                              "model: a context-parallel group is cp ranks of one tp index that would otherwise compute "
                              "the same rows. Choose cp among the divisors of world_size / tp.")
        sizes = [(what, n, tp, "tp") for what, n in c.tp_sharded_sizes().items()]
        for what, n, parts, name in sizes + [
            ("n_routed_experts", c.n_routed_experts, ep, "ep"),
            ("n_routed_experts", c.n_routed_experts, w, "world_size"),
        ]:
            if n % parts:
                raise LayoutError(f"parallel: {name}={parts} does not divide {what}={n}.")
        quantization = getattr(c, "quantization", None)
        if hasattr(quantization, "block") and tp > 1:  # (fp8 blocks; int4 groups that a split cuts fall back to int8)
            for what, columns in c.row_parallel_inputs().items():
                if columns % (tp * quantization.block):
                    raise LayoutError(f"parallel: tp={tp} splits {what}={columns} input columns into {columns // tp} a rank, "
                                      f"which cuts a {quantization.block}-column fp8 scale block. Choose a tp that leaves each "
                                      f"rank whole blocks, or compile with model.quantized_weights: dequantize.")
        if getattr(c, "attention_bias", False) and tp > 1:
            raise LayoutError("parallel: tp > 1 with attention_bias is not supported (the row-parallel o_proj bias would be added tp times).")


def rank_buffers(layout: Layout, config, rank: int) -> dict[str, torch.Tensor]:
    """Buffer values for `rank` by leaf name (the same in every layer): the MoE's, and the
    attention's place in its context-parallel group."""
    return {**moe_buffers(layout, config, rank), "cp_rank": torch.tensor(layout.cp_rank(rank))}


def moe_buffers(layout: Layout, config, rank: int) -> dict[str, torch.Tensor]:
    held = config.n_routed_experts // layout.ep
    owned = config.n_routed_experts // layout.world_size
    return {
        "expert_offset": torch.tensor(rank // (layout.world_size // layout.ep) * held),
        "owned_begin": torch.tensor(rank * owned),
        "owned_end": torch.tensor((rank + 1) * owned),
        "shared_scale": torch.tensor(1.0 if rank < layout.tp else 0.0),
    }


def shard(name: str, tensor: torch.Tensor, layout: Layout, rank: int) -> torch.Tensor:
    """Rank's slice of the full tensor `name` (a view; no copy)."""
    split = layout.split(name)
    if split is None:
        return tensor
    dim, parts = split
    size = tensor.shape[dim] // parts
    return tensor.narrow(dim, layout.shard_index(name, rank) * size, size)
