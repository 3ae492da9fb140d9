"""DeepSeek-V3 in plain PyTorch, written for static-graph compilation.

The math follows HF transformers' `DeepseekV3ForCausalLM`: MLA attention over a compressed KV
cache, dense SwiGLU MLPs for the first `first_k_dense_replace` layers, DeepSeekMoE after that.

The model is a short Python driver (`prefill`, `decode`) that only calls sub-modules: `embed`,
`layers[i]` (kind dense or MoE), `head`. The compiler records that call sequence and traces each
KIND once; every call takes plain tensors (weights and KV included), so one traced graph serves
every layer of its kind:

    prefill(tokens [T], positions [T], write_slots [T], read_slot [1], last_index [1], kv) -> logits [1, V]
        one chunk of one sequence; attention covers the cached prefix plus the chunk (causal).
    decode(tokens [B], positions [B], slots [B], kv) -> logits [B, V]
        one token for each of B sequences.
    score(tokens, positions, write_slots, read_slot, last_index, targets [T], kv) -> [T (2 TOP + 1) + V]
        a prefill chunk that also scores each row's next prompt token (models/prompt_scoring.py).

State: one tensor per layer ("latent"), [max_seqs + 1, max_len, kv_lora_rank + qk_rope_head_dim],
holding the normalized latent and the rotated rope key; written in place. Slot `max_seqs` is
scratch: padding rows and padding tokens write there, never into a live sequence.
"""

import math
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

import deepinfer.runtime.collectives  # noqa: F401  (registers torch.ops.deepinfer.*)
from deepinfer.runtime import int_matmul

from . import context_parallel, int_weights
from .deepseek_v3_config import DeepseekV3Config, RopeConfig, yarn_mscale
from .moe import product, routed_experts
from .parallel import Layout, moe_buffers
from .prompt_scoring import PromptScorer
from .quantization import Quantization, absorbed_linear, expert_weights, head_linear, linear, linear_weight, stacked_experts
from .speculative import chain_drafts
from .state import StateSpec, allocate


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Same order as HF: normalize in float32, cast back, then scale.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_frequencies(rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [dim/2] and the cos/sin scale, as HF's default and YaRN rope compute them."""
    exponents = torch.arange(0, dim, 2, dtype=torch.float32) / dim
    inv_freq = 1.0 / (rope.rope_theta**exponents)
    if rope.rope_type == "default":
        return inv_freq, 1.0

    def correction_dim(rotations: float) -> float:
        return dim * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(rope.rope_theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp  # 1 where the original frequency is kept
    inv_freq = inv_freq / rope.factor * (1 - extrapolation) + inv_freq * extrapolation
    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = yarn_mscale(rope.factor, rope.mscale) / yarn_mscale(rope.factor, rope.mscale_all_dim)
        else:
            attention_factor = yarn_mscale(rope.factor, 1.0)
    return inv_freq, float(attention_factor)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rotate x [..., r] by cos/sin [..., r/2] (already broadcast to x's leading dims).

    Interleaved pairs (x0, x1), (x2, x3), ... come out de-interleaved, as in HF; queries and keys
    get the same layout, so their dot products are unchanged."""
    half = x.shape[-1] // 2
    x1, x2 = (x[..., 0::2], x[..., 1::2]) if interleaved else (x[..., :half], x[..., half:])
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class InputEmbedding(nn.Module):
    """Token embedding plus this step's rope angles, shared by every layer, and the first layer's
    (zero) pending sub-layer output: see DecoderLayer."""

    def __init__(self, config: DeepseekV3Config):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(config.vocab_size, config.hidden_size))
        self.rope = config.rope
        self.rope_dim = config.qk_rope_head_dim
        self.init_buffers()

    def init_buffers(self):
        with torch.device("cpu"):  # derived from the config, also when the weights are on meta
            inv_freq, self.attention_factor = rope_frequencies(self.rope, self.rope_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor):
        h = F.embedding(tokens, self.weight)  # [T, D]
        angles = positions[:, None].float() * self.inv_freq[None, :]  # [T, r/2]
        cos = (angles.cos() * self.attention_factor).to(h.dtype)
        sin = (angles.sin() * self.attention_factor).to(h.dtype)
        return h, torch.zeros_like(h), cos, sin


class MLAttention(nn.Module):
    """Multi-head latent attention with the compressed cache and absorbed up-projections.
    Under tensor parallelism this rank holds n_heads / tp heads; o_proj's partials are all-reduced.
    Under context parallelism the cache is striped over the cp group (models/context_parallel.py)."""

    def __init__(self, config: DeepseekV3Config, layout: Layout = Layout()):
        super().__init__()
        c, q = config, config.quantization
        self.tp, self.cp = layout.tp, layout.cp
        self.n_heads = c.num_attention_heads // layout.tp
        self.nope, self.rope_dim, self.v_dim = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        self.kv_lora_rank = c.kv_lora_rank
        self.interleaved = c.rope_interleave
        self.scale = c.softmax_scale
        if c.q_lora_rank is None:
            self.q_proj = linear(c.hidden_size, self.n_heads * c.qk_head_dim, q)
        else:
            self.q_a_proj = linear(c.hidden_size, c.q_lora_rank, q, c.attention_bias)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, c.rms_norm_eps)
            self.q_b_proj = linear(c.q_lora_rank, self.n_heads * c.qk_head_dim, q)
        self.kv_a_proj_with_mqa = linear(c.hidden_size, c.kv_cache_dim, q, c.attention_bias)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, c.rms_norm_eps)
        self.quantization = q
        if self.int_heads(q):  # (the checkpoint's kv_b_proj, cut per head: derived_weights)
            stacked_experts(self, "w_uk", self.n_heads, self.kv_lora_rank, self.nope, q)
            stacked_experts(self, "w_uv", self.n_heads, self.v_dim, self.kv_lora_rank, q)
        else:
            self.kv_b_proj = absorbed_linear(c.kv_lora_rank, self.n_heads * (self.nope + self.v_dim), q)
        self.o_proj = linear(self.n_heads * self.v_dim, c.hidden_size, q, c.attention_bias)
        self.layout = layout
        self.init_buffers()

    def init_buffers(self, rank: int = 0):
        if self.cp > 1:
            context_parallel.register_cp_rank(self, self.layout, rank)

    def forward(self, x, cos, sin, positions, write_slots, read_slots, kv):
        """x [T, D] -> [T, D]. Stores this step's latent + rope key at (write_slots, positions), then
        attends over the cached rows of read_slots: [1] (prefill: one sequence, shared by every
        token) or [T] (decode: one sequence per row). Key j is visible to query t when
        j <= positions[t]: the cached prefix plus causal attention inside the chunk.

        Under context parallelism a prefill chunk's x holds this rank's rows only, [T / cp, D],
        while positions and the slots are the whole chunk's [T] (models/context_parallel.py)."""
        T = x.shape[0]
        q = self.q_proj(x) if hasattr(self, "q_proj") else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_rope = q.view(T, self.n_heads, -1).split([self.nope, self.rope_dim], dim=-1)  # [T, H, n], [T, H, r]
        q_rope = apply_rope(q_rope, cos[:, None], sin[:, None], self.interleaved)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        k_rope = apply_rope(k_rope, cos, sin, self.interleaved)  # [T, r]
        new = torch.cat([self.kv_a_layernorm(latent), k_rope], dim=-1)  # [T, C]
        if self.cp > 1:
            out = self.value_heads(self.attend_striped(q_nope, q_rope, new, positions, write_slots, read_slots, kv))
        else:
            kv.index_put_((write_slots, positions), new)
            rows = kv.index_select(0, read_slots)  # [1 or T, L, C]
            visible = torch.arange(rows.shape[1], device=rows.device)[None, :] <= positions[:, None]  # [T, L]
            if self.expands(T, rows.shape[0]):
                out = self.attend_expanded(q_nope, q_rope, rows[0], visible)
            else:
                q_latent = self.query_latents(q_nope)  # [T, H, R]
                scores = self.scores(q_latent, q_rope, rows)  # [T, H, L]
                out = self.value_heads(self.weighted(self.probabilities(scores, visible[:, None, :]), rows))
        out = self.o_proj(out.flatten(1))  # (out [T, H, v])
        return torch.ops.deepinfer.all_reduce(out, "tp") if self.tp > 1 else out

    # The int-quantized model's up-projections, made from the checkpoint's kv_b_proj [H * (n + v), R]
    # as the bundle is written (models/int_weights.py float_source): each head's w_uk transposed,
    # [H, R, n], so that the kernels reduce over their rows' inputs, and w_uv, [H, v, R].
    derived_weights = {"w_uk": ("kv_b_proj.weight", lambda self, w: self.per_head(w)[:, :self.nope].transpose(1, 2)),
                       "w_uv": ("kv_b_proj.weight", lambda self, w: self.per_head(w)[:, self.nope:])}

    def int_heads(self, q: Quantization) -> bool:
        """Whether the up-projections are int codes (the recipe quantizes, and both fit a layout),
        read per head by the kernels as a stack of experts: a float kv_b_proj was 4.2 of the 52.5 MB
        an int4 decode token of the 190M read, as llama.cpp's q4_0 quantizes its attn_k_b / attn_v_b."""
        R, n, v = self.kv_lora_rank, self.nope, self.v_dim
        return isinstance(q, int_weights.IntWeights) and bool(int_weights.layer_bits(n, R, q) and int_weights.layer_bits(R, v, q))

    def per_head(self, w: torch.Tensor) -> torch.Tensor:
        """A slice of kv_b_proj's weight, [heads * (n + v), R] -> [heads, n + v, R]."""
        return w.view(-1, self.nope + self.v_dim, self.kv_lora_rank)

    def absorbed(self, dtype):
        """The up-projections absorbed into the query and the output (attention in the latent
        space instead of expanding K and V): w_uk [H, n, R], w_uv [H, v, R], in dtype however stored."""
        if hasattr(self, "kv_b_proj"):
            w_kv_b = linear_weight(self.kv_b_proj, dtype).view(self.n_heads, self.nope + self.v_dim, self.kv_lora_rank)
            return w_kv_b.split([self.nope, self.v_dim], dim=1)
        w_uk, w_uv = (expert_weights(self, name, dtype, self.quantization)() for name in ("w_uk", "w_uv"))
        w_uk, w_uv = (int_matmul.values(w.codes, w.scales, dtype) if isinstance(w, int_weights.IntExperts) else w for w in (w_uk, w_uv))
        return w_uk.transpose(1, 2), w_uv

    def query_latents(self, q_nope: torch.Tensor) -> torch.Tensor:
        """q_nope [T, H, n] -> [T, H, R], each head's through its w_uk (int codes: the kernel, the
        heads as experts)."""
        if hasattr(self, "kv_b_proj"):
            return torch.einsum("thn,hnr->thr", q_nope, self.absorbed(q_nope.dtype)[0])
        return product("ten,ern->ter", q_nope, expert_weights(self, "w_uk", q_nope.dtype, self.quantization)())

    def value_heads(self, out_latent: torch.Tensor) -> torch.Tensor:
        """The attention's latents [T, H, R] -> [T, H, v], each head's through its w_uv."""
        if hasattr(self, "kv_b_proj"):
            return torch.einsum("thr,hvr->thv", out_latent, self.absorbed(out_latent.dtype)[1])
        return product("ter,evr->tev", out_latent, expert_weights(self, "w_uv", out_latent.dtype, self.quantization)())

    def scores(self, q_latent, q_rope, rows):
        """Queries [T, H, R], [T, H, r] against the cached rows [B, L, C] (latent, then rope key) of
        B = 1 or T sequences -> [T, H, L]. One product over whole rows: a decode step's is a few
        query rows times the sequence's cache as it lies, which the few-row kernel takes (two over
        the latent and rope columns were a BLAS call and a reduction over strided rows). Grouped by
        the sequence read: a prefill's T x H queries are one product with its one cache, not T
        products with a broadcast copy of it (which bf16 matmuls materialize)."""
        B, L, C = rows.shape
        queries = torch.cat([q_latent, q_rope], dim=-1)  # [T, H, C]
        return torch.matmul(queries.reshape(B, -1, C), rows.mT).view(q_latent.shape[0], self.n_heads, L)

    def probabilities(self, scores, visible):
        """Scores over the cached rows -> their softmax in the scores' dtype (float32 inside), the rows
        a query may not see (`visible` False, broadcast to the scores) at zero."""
        scores = (scores * self.scale).masked_fill(~visible, float("-inf"))
        return scores.softmax(dim=-1, dtype=torch.float32).to(scores.dtype)

    def expands(self, queries: int, sequences: int) -> bool:
        """Whether a step's attention expands the cached latents into each head's keys and values
        (attend_expanded) rather than attending in the latent space: a prompt chunk (one sequence)
        of T queries over L rows costs T H L (n + r + v) multiply-adds that way, plus L H R (n + v)
        to expand, against T H L (2 R + r) absorbed; fewer from T > R (n + v) / (2 R - n - v), as
        vLLM and SGLang compute MLA's prefill (from 65 queries for the tiny V3, 86 for the 190M, 171 for V3)."""
        R, n, v = self.kv_lora_rank, self.nope, self.v_dim
        return sequences == 1 and queries * (2 * R - n - v) > R * (n + v)

    def attend_expanded(self, q_nope, q_rope, rows, visible):
        """A long prompt chunk's queries [T, H, n], [T, H, r] over its sequence's cached rows [L, C]
        (latent, then rope key), each head's keys and values expanded from the latents as HF's
        DeepseekV3Attention computes them -> [T, H, v]."""
        H, L = self.n_heads, rows.shape[0]
        latent, k_rope = rows.split([self.kv_lora_rank, self.rope_dim], dim=-1)  # [L, R], [L, r]
        w_uk, w_uv = self.absorbed(rows.dtype)
        keys = torch.cat([torch.einsum("lr,hnr->hln", latent, w_uk), k_rope.expand(H, L, self.rope_dim)], dim=-1)  # [H, L, n + r]
        values = torch.einsum("lr,hvr->hlv", latent, w_uv)  # [H, L, v]
        queries = torch.cat([q_nope, q_rope], dim=-1).transpose(0, 1)  # [H, T, n + r]
        probs = self.probabilities(torch.matmul(queries, keys.mT), visible[None])  # [H, T, L]
        return torch.matmul(probs, values).transpose(0, 1)

    def weighted(self, probs, rows):
        """probs [T, H, L] over the rows' latents ([B, L, C]'s first R columns) -> [T, H, R]."""
        B, L = rows.shape[:2]
        return torch.matmul(probs.view(B, -1, L), rows[..., :self.kv_lora_rank]).view(probs.shape[0], self.n_heads, -1)

    def attend_striped(self, q_nope, q_rope, new, positions, write_slots, read_slots, kv):
        """The attention under context parallelism, over this rank's stripe of the cache, merged
        with the group's -> [T, H, R] for this rank's rows (models/context_parallel.py)."""
        cp, H = self.cp, self.n_heads
        q_latent = self.query_latents(q_nope)  # [T, H, R]
        split = q_latent.shape[0] != positions.shape[0]  # a prefill chunk: this rank's rows only
        if split:  # the chunk's queries and new keys from the group
            sizes = [H * self.kv_lora_rank, H * self.rope_dim, new.shape[-1]]
            q_latent, q_rope, new = context_parallel.gather(torch.cat([q_latent.flatten(1), q_rope.flatten(1), new], dim=-1), cp).split(sizes, -1)
            q_latent, q_rope = q_latent.reshape(-1, H, self.kv_lora_rank), q_rope.reshape(-1, H, self.rope_dim)
        kv.index_put_(context_parallel.stripe(positions, write_slots, self.cp_rank, cp, kv.shape[0] - 1), new)
        rows = kv.index_select(0, read_slots)  # [1 or T, L / cp, C]
        scores = self.scores(q_latent, q_rope, rows)
        keys = context_parallel.key_positions(rows.shape[1], self.cp_rank, cp, rows.device)
        scores = (scores * self.scale).masked_fill(~(keys[None, :] <= positions[:, None])[:, None, :], float("-inf"))
        probs, lse = context_parallel.partial_softmax(scores)  # [T, H, L / cp], [T, H]
        out_latent = context_parallel.merge(self.weighted(probs.to(q_latent.dtype), rows), lse, cp)
        return context_parallel.own_rows(out_latent, self.cp_rank, cp) if split else out_latent


class MLP(nn.Module):
    """SwiGLU: the dense layers' MLP and the MoE's shared experts."""

    def __init__(self, dim: int, hidden: int, reduce_group: str | None = None, quantization: Quantization = None):
        super().__init__()
        self.gate_proj = linear(dim, hidden, quantization)
        self.up_proj = linear(dim, hidden, quantization)
        self.down_proj = linear(hidden, dim, quantization)
        self.reduce_group = reduce_group  # all-reduce the row-parallel partial sums over it

    def forward(self, x):
        out = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return torch.ops.deepinfer.all_reduce(out, self.reduce_group) if self.reduce_group else out


# The expert selection without topk: topk is a library call in a compiled region (~6-7 us each on
# CPU, a fixed cost per MoE layer that small experts feel: bench/decode_bench.py's 64x4 config,
# the trained tiny V3's decode step of ~0.4 ms), while these reductions fuse into the router's
# kernel. Same picks as topk's (ties to the lower index, where topk leaves the order open).
def top_two_sum(x):
    """x [N, G, n] -> [N, G]: the sum of the two largest of each group (topk(2)[0].sum(-1))."""
    first = x.argmax(dim=-1, keepdim=True)
    return x.amax(dim=-1) + x.scatter(-1, first, float("-inf")).amax(dim=-1)


def largest_ids(x, k: int):
    """x [N, E] -> [N, k]: the ids of each row's k largest, largest first (topk(k)[1]), as k
    argmax reductions, each taken entry then set to -inf. (A row needs k entries above -inf.)"""
    ids = []
    for _ in range(k):
        best = x.argmax(dim=-1, keepdim=True)  # [N, 1]
        ids.append(best)
        x = x.scatter(-1, best, float("-inf"))
    return torch.cat(ids, dim=-1)


def largest_mask(x, k: int):
    """x [N, G] -> bool [N, G]: each row's k largest, found by counting the entries that beat each."""
    index = torch.arange(x.shape[-1], device=x.device)
    beats = (x[:, None, :] > x[:, :, None]) | ((x[:, None, :] == x[:, :, None]) & (index[None, :] < index[:, None]))
    return beats.sum(dim=-1) < k  # beats[n, g, j]: entry j beats entry g


class Router(nn.Module):
    """Sigmoid scores, bias-corrected group-limited top-k selection (DeepSeek-V3 `noaux_tc`)."""

    def __init__(self, config: DeepseekV3Config):
        super().__init__()
        c = config
        self.top_k, self.n_group, self.topk_group = c.num_experts_per_tok, c.n_group, c.topk_group
        self.norm_topk_prob, self.routed_scaling_factor = c.norm_topk_prob, c.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(c.n_routed_experts, c.hidden_size, dtype=torch.float32))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(c.n_routed_experts, dtype=torch.float32))

    def forward(self, x):
        """x [N, D] -> routing weights [N, k] and global expert ids [N, k]."""
        N, E = x.shape[0], self.weight.shape[0]
        scores = F.linear(x.float(), self.weight.float()).sigmoid()  # [N, E]
        choice = scores + self.e_score_correction_bias  # the bias steers selection only
        group_scores = top_two_sum(choice.view(N, self.n_group, -1))  # [N, G]
        group_mask = largest_mask(group_scores, self.topk_group)  # [N, G]
        expert_mask = group_mask[:, :, None].expand(N, self.n_group, E // self.n_group).reshape(N, E)
        choice = choice.masked_fill(~expert_mask, float("-inf"))
        ids = largest_ids(choice, self.top_k)  # [N, k] (config_checks: k experts in topk_group groups)
        weights = scores.gather(1, ids)  # [N, k]
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.routed_scaling_factor, ids


class MoE(nn.Module):
    """Routed experts (stacked [E_local, out, in]) plus shared experts, in static-shape form.

    This rank holds experts [expert_offset, expert_offset + E_local) and computes the routed ones
    among [owned_begin, owned_end); a routed expert owned elsewhere contributes zero here. Those
    are buffers, not Python constants, so every rank traces the same graph (models/parallel.py)."""

    def __init__(self, config: DeepseekV3Config, layout: Layout = Layout()):
        super().__init__()
        c = config
        self.config, self.layout = c, layout
        E = self.n_local_experts = c.n_routed_experts // layout.ep
        I = c.moe_intermediate_size
        self.gate = Router(c)
        stacked_experts(self, "experts_gate_up", E, 2 * I, c.hidden_size, c.quantization)  # gate rows, then up rows
        stacked_experts(self, "experts_down", E, c.hidden_size, I, c.quantization)
        self.shared_experts = MLP(c.hidden_size, I * c.n_shared_experts // layout.tp, quantization=c.quantization)
        self.init_buffers()

    def init_buffers(self, rank: int = 0):
        with torch.device("cpu"):  # derived from the layout, also when the weights are on meta
            for name, value in moe_buffers(self.layout, self.config, rank).items():
                self.register_buffer(name, value, persistent=False)

    def forward(self, x):
        weights, ids = self.gate(x)  # [N, k], [N, k]
        gate_up = expert_weights(self, "experts_gate_up", x.dtype, self.config.quantization)
        down = expert_weights(self, "experts_down", x.dtype, self.config.quantization)
        routed = routed_experts(self, x, weights, ids, gate_up, down, swiglu, self.config.expert_capacity,
                                self.config.expert_overflow)
        out = routed + self.shared_experts(x) * self.shared_scale.to(x.dtype)  # [N, D]
        return torch.ops.deepinfer.all_reduce(out, "world") if self.layout.world_size > 1 else out


def swiglu(gate, up):
    return F.silu(gate) * up


class DecoderLayer(nn.Module):
    """Pre-norm attention + (dense MLP | MoE). `kind` names what the compiler traces once.

    The residual stream enters as `h + pending`: a layer returns its MLP/MoE output unadded, and the
    next layer (or the head) adds it first. That output ends in an all-reduce on multi-rank layouts,
    so the add joins the next region instead of being a one-op region of its own after each layer.
    """

    def __init__(self, config: DeepseekV3Config, moe: bool, layout: Layout = Layout()):
        super().__init__()
        tp = layout.tp
        self.kind = "moe" if moe else "dense"
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = MLAttention(config, layout)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if moe:
            self.mlp = MoE(config, layout)
        else:
            self.mlp = MLP(config.hidden_size, config.intermediate_size // tp, "tp" if tp > 1 else None, config.quantization)

    def forward(self, h, pending, cos, sin, positions, write_slots, read_slots, kv):
        h = h + pending
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, positions, write_slots, read_slots, kv)
        x = self.post_attention_layernorm(h)
        if self.kind == "moe" and h.shape[0] != positions.shape[0]:
            # A prefill chunk under context parallelism: every rank computes its experts for the
            # whole chunk, whose rows the cp group holds a block each.
            return h, context_parallel.over_whole_chunk(self.mlp, x, self.self_attn.cp_rank, self.self_attn.cp)
        return h, self.mlp(x)


class LMHead(nn.Module):
    """Final norm + vocabulary projection; vocabulary-parallel over tp, then one all-gather."""

    def __init__(self, config: DeepseekV3Config, tp: int = 1):
        super().__init__()
        self.tp = tp
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = head_linear(config.hidden_size, config.vocab_size // tp, config.quantization)

    def forward(self, h, pending, last_index=None):
        """h + pending [T, D] -> logits [T, V] float32, or [1, V] for row `last_index` [1] only (prefill)."""
        if last_index is not None:
            h, pending = h.index_select(0, last_index), pending.index_select(0, last_index)
        h = h + pending
        logits = self.lm_head(self.norm(h)).float()  # [T, V / tp]
        return torch.ops.deepinfer.all_gather(logits, "tp", -1, self.tp) if self.tp > 1 else logits


class HeadKeepingHidden(LMHead):
    """The head of a model with MTP modules: it also stores each row's final hidden state (after
    the norm) at (slot, position) in the MTP's `hidden` state, the input the drafts start from."""

    def forward(self, h, pending, positions, write_slots, hidden, last_index=None):
        hidden.index_put_((write_slots, positions), self.norm(h + pending))
        return super().forward(h, pending, last_index)


class MTPLayer(nn.Module):
    """One multi-token prediction (MTP) module (DeepSeek-V3 report, section 2.2): at position q it
    joins the main model's final hidden state h_q (after the final norm) with the embedding of the
    token at q + 1, and predicts the token at q + 2 through one more decoder block, which keeps
    its own KV cache like any layer:

        h'_q = block(eh_proj([enorm(embed(t_{q+1})); hnorm(h_q)])),   logits_q = shared_head(h'_q)

    A draft row (`step`) is given the token t_{q+1} at its position q + 1; it reads h_q from the
    `hidden` state and writes h'_q at q + 1, where the next draft row reads it in place of h_{q+1}
    (chained drafts: DeepSeek's sequential MTP, and vLLM's way past the checkpoint's MTP layers).
    The verify step's head overwrites those entries with the main model's own. The embedding at
    position 0 is zeroed, as vLLM's deepseek_mtp does for the released weights. Checkpoint names:
    `model.layers.{num_hidden_layers + i}.{enorm, hnorm, eh_proj, shared_head.norm,
    shared_head.head}` and the block's own names."""

    def __init__(self, config: DeepseekV3Config, embed: InputEmbedding, layout: Layout = Layout()):
        super().__init__()
        self.kind = "mtp"
        self.draft_tokens = config.draft_tokens
        self.embed = embed  # (the main model's: shared)
        self.enorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hnorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.eh_proj = linear(2 * config.hidden_size, config.hidden_size, config.quantization)
        self.block = DecoderLayer(config, config.is_moe_layer(config.num_hidden_layers), layout)
        self.shared_head = LMHead(config, layout.tp)

    def run(self, tokens, q, previous, write_slots, read_slots, latent):
        """tokens [T] at positions q + 1, previous [T, D] the hidden states at q -> (h, pending) of h'_q."""
        embedded, zeros, cos, sin = self.embed(tokens, q)
        embedded = embedded * (q != 0)[:, None].to(embedded.dtype)
        x = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(previous)], dim=-1))
        return self.block(x, zeros, cos, sin, q, write_slots, read_slots, latent)

    def step(self, tokens, positions, slots, latent, hidden):
        """Draft rows: tokens [N] at positions [N] (>= 1; each sequence's rows consecutive) ->
        logits [N, V] for positions + 1."""
        q = (positions - 1).clamp(min=0)  # (padding rows sit at position 0, in the scratch slot)
        h, pending = self.run(tokens, q, hidden[slots, q], slots, slots, latent)
        hidden.index_put_((slots, positions), h + pending)
        return self.shared_head(h, pending)

    def forward(self, tokens, positions, slots, latent, hidden):
        """A whole draft step, k = draft_tokens drafts per sequence in one program: rows [B (k + 1)]
        in blocks of k + 1 per sequence (models/speculative.py), each sequence's tokens the
        module has not seen yet. The module runs over every row, then k - 1 times more over each
        sequence's previous draft (argmax) -> draft tokens [B, k]."""
        logits = self.step(tokens, positions, slots, latent, hidden)  # [B (k + 1), V]
        return chain_drafts(partial(self.step, latent=latent, hidden=hidden), logits, positions, slots, self.draft_tokens, latent)


class MTPPrefill(nn.Module):
    """An MTP module over a prompt chunk (the prefill form: one sequence), after the head has
    stored the chunk's hidden states: row t, the token at positions[t], runs the module at
    positions[t] - 1, filling its KV cache for the prompt (a chunk starting at 0 sends its first
    row to the scratch slot). It writes no h': the hidden state at the chunk's last position is
    the main model's, which the first draft step reads."""

    def __init__(self, layer: MTPLayer):
        super().__init__()
        self.kind = "mtp_prefill"
        self.layer = layer  # (shared)

    def forward(self, tokens, positions, write_slots, read_slot, latent, hidden):
        q = (positions - 1).clamp(min=0)
        write_slots = torch.where(positions == 0, latent.shape[0] - 1, write_slots)
        previous = hidden.index_select(0, read_slot)[0, q]  # [T, D]
        h, pending = self.layer.run(tokens, q, previous, write_slots, read_slot, latent)
        return h + pending


class DeepseekV3(nn.Module):
    CONTEXT_PARALLEL = True  # parallel.cp splits the latent cache over a group (models/context_parallel.py)
    INT_HEAD = True  # model.quantize can quantize the LM head (model.quantize_head)
    # Router parameters stay float32 whatever the model dtype, as in HF.
    FLOAT32_PARAMS = ("gate.weight", "gate.e_score_correction_bias")
    # From this sub-module on a layer reads no state: under context buckets the compiler starts a
    # region there, so the MLP / MoE compiles once for every context.
    STATE_FREE_FROM = "layers.*.post_attention_layernorm"

    def __init__(self, config: DeepseekV3Config, layout: Layout = Layout()):
        super().__init__()
        layout.check(config)
        self.config, self.layout = config, layout
        self.embed = InputEmbedding(config)
        self.layers = nn.ModuleList(DecoderLayer(config, config.is_moe_layer(i), layout) for i in range(config.num_hidden_layers))
        # Speculative decoding's drafter: the checkpoint's first MTP module (models with more
        # chain the first; see MTPLayer).
        self.mtp = nn.ModuleList([MTPLayer(config, self.embed, layout)] if config.draft_tokens else [])
        self.mtp_prefill = nn.ModuleList(MTPPrefill(layer) for layer in self.mtp)
        self.head = (HeadKeepingHidden if config.draft_tokens else LMHead)(config, layout.tp)
        self.scorer = PromptScorer()
        if layout.cp > 1:  # a prefill chunk's rows, split over the cp group and gathered before the head
            self.split_rows = context_parallel.SplitRows(layout)
            self.gather_rows = context_parallel.GatherRows(layout.cp)
        self.tie_weights()

    def tie_weights(self):
        # A vocabulary-parallel head holds a slice of the embedding, so it is only tied unsharded.
        if self.config.tie_word_embeddings and self.layout.tp == 1 and isinstance(self.head.lm_head, nn.Linear):
            self.head.lm_head.weight = self.embed.weight

    @classmethod
    def param_dtype(cls, name: str, dtype: torch.dtype) -> torch.dtype:
        return torch.float32 if name.endswith(cls.FLOAT32_PARAMS) else dtype

    def state_specs(self, max_seqs: int, max_len: int) -> list[list[StateSpec]]:
        """Per layer one tensor [max_seqs + 1, max_len, C], one entry per position; slot max_seqs
        is the scratch slot. An MTP module adds its own latent cache and `hidden` [max_seqs + 1,
        max_len, D]: the hidden state its draft at each position starts from."""
        dtype, cp = self.embed.weight.dtype, self.layout.cp
        # Under context parallelism a rank keeps every cp-th position (models/context_parallel.py).
        latent = StateSpec("latent", [max_seqs + 1, max_len // cp, self.config.kv_cache_dim], dtype, positions_per_entry=cp)
        hidden = StateSpec("hidden", [max_seqs + 1, max_len, self.config.hidden_size], dtype, positions_per_entry=1)
        return [[latent] for _ in self.layers] + [[latent, hidden] for _ in self.mtp]

    def new_state(self, max_seqs: int, max_len: int) -> list[list[torch.Tensor]]:
        return allocate(self.state_specs(max_seqs, max_len))

    def prefill(self, tokens, positions, write_slots, read_slot, last_index, state):
        return self._prefill(tokens, positions, write_slots, read_slot, state, last_index)  # [1, V]

    def score(self, tokens, positions, write_slots, read_slot, last_index, targets, state):
        """A prefill chunk that also scores every row (prompt logprobs: models/prompt_scoring.py)."""
        return self.scorer(self._prefill(tokens, positions, write_slots, read_slot, state), targets, last_index)

    def _prefill(self, tokens, positions, write_slots, read_slot, state, *last_index):
        """-> logits [T, V], or [1, V] at `last_index` when given."""
        h, pending, cos, sin = self.embed(tokens, positions)
        if self.layout.cp > 1:
            h, pending, cos, sin = self.split_rows(h, pending, cos, sin)
        for layer, layer_state in zip(self.layers, state):
            h, pending = layer(h, pending, cos, sin, positions, write_slots, read_slot, *layer_state)
        if self.layout.cp > 1:
            h, pending = self.gather_rows(h, pending)
        if not self.mtp:
            return self.head(h, pending, *last_index)
        latent, hidden = state[len(self.layers)]
        logits = self.head(h, pending, positions, write_slots, hidden, *last_index)
        self.mtp_prefill[0](tokens, positions, write_slots, read_slot, latent, hidden)
        return logits

    def decode(self, tokens, positions, slots, state):
        """Also the verify step of speculative decoding: rows of one sequence at consecutive
        positions (the last token and its drafts) attend each other causally."""
        h, pending, cos, sin = self.embed(tokens, positions)
        for layer, layer_state in zip(self.layers, state):
            h, pending = layer(h, pending, cos, sin, positions, slots, slots, *layer_state)
        if not self.mtp:
            return self.head(h, pending)  # [B, V]
        return self.head(h, pending, positions, slots, state[len(self.layers)][1])

    def draft(self, tokens, positions, slots, state):
        """The next k drafts of B sequences: rows [B (k + 1)] -> tokens [B, k] (MTPLayer.forward)."""
        return self.mtp[0](tokens, positions, slots, *state[len(self.layers)])


def init_random(model: DeepseekV3, seed: int) -> DeepseekV3:
    """Deterministic random weights, scaled so logits are decisive (unlike HF's std=0.02 init,
    where nearly every greedy token is a near-tie). Norm weights stay 1."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith("e_score_correction_bias"):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
            elif name.endswith("bias"):
                param.zero_()
            else:
                fan_in = param.shape[-1] if name != "embed.weight" else 1
                param.copy_(torch.randn(param.shape, generator=generator) / math.sqrt(fan_in))
    return model


def checkpoint_keys(name: str, cfg: DeepseekV3Config, shape: tuple, saved_by_transformers: bool = True) -> list[tuple[str, tuple]]:
    """The checkpoint tensors (key, shape) our parameter `name` of full `shape` is made of, in HF's
    per-expert layout: a stacked expert weight [E, out, in] is E (or 2E) tensors. MTP module i is
    checkpoint layer num_hidden_layers + i (its block's names unprefixed, its head `shared_head.head`)."""
    if name.startswith("mtp."):
        index, _, rest = name.removeprefix("mtp.").partition(".")
        layer = f"layers.{cfg.num_hidden_layers + int(index)}"
        rest = rest.removeprefix("block.").replace("shared_head.lm_head.", "shared_head.head.")
        return checkpoint_keys(f"{layer}.{rest}", cfg, shape, saved_by_transformers)
    layer, _, rest = name.partition(".mlp.experts_")
    if rest:  # stacked routed experts [E, out, in] from model.layers.N.mlp.experts.E.*_proj.weight
        parts = ("gate_proj", "up_proj") if rest == "gate_up" else ("down_proj",)
        per_expert = (shape[1] // len(parts), shape[2])
        return [(f"model.{layer}.mlp.experts.{e}.{p}.weight", per_expert) for e in range(shape[0]) for p in parts]
    if name == "head.lm_head.weight" and cfg.tie_word_embeddings:
        name = "embed.weight"
    key = {"embed.weight": "model.embed_tokens.weight", "head.norm.weight": "model.norm.weight",
           "head.lm_head.weight": "lm_head.weight"}.get(name, f"model.{name}")
    return [(key, tuple(shape))]
