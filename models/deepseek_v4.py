"""DeepSeek-V4 in plain PyTorch, written for static-graph compilation.

The math follows HF transformers' `DeepseekV4ForCausalLM`: shared-KV MQA with attention sinks over
a sliding window plus (per layer type) compressed entries — CSA (rate m, overlapping windows,
entries picked by the Lightning indexer's top-k) or HCA (rate m', every entry) — mHC
hyper-connections around every block, and MoE layers routed by hash (`tid2eid[token]`) or top-k.

As for V3, the model is a driver that only calls sub-modules (`embed`, `layers[i]`, `head`, and
with speculative decoding `mtp[i]`), so the compiler traces each layer KIND (attention type x MLP
type, e.g. `csa.moe`) once:

    prefill(tokens [T], positions [T], slots [T], read_slot [1], last_index [1], state) -> logits [1, V]
    decode(tokens [B], positions [B], slots [B], state) -> logits [B, V]
    draft(tokens [B], positions [B], slots [B], state) -> draft tokens [B / (k + 1), k]

Inside a layer the rows are [N sequences, T tokens]: prefill is N=1 (slot read_slot, the chunk's
valid tokens first, `last_index` the last of them), decode is N=B, T=1 -- or, with k draft tokens,
blocks of T = k + 1 rows, valid rows first (models/speculative.py). A sequence's chunk starts at
position `start` and its last valid token is at `end`.

State lives outside the module, one fixed pool per layer (leading dim max_seqs + 1; the last slot
is scratch), sized from kv.max_len = L (a multiple of every compress rate):
    window [S+1, W (+ k), Dh]    ring: entry i holds the newest position q with q = i (mod W + k);
                                 k spare entries for speculative decoding's k drafts
    entries [S+1, L/m, Dh]       compressed entries (CSA, HCA), entry w pools window w
    buffer [S+1, R, 2k Dh]       ring of raw compressor (kv | gate) projections, R = m' (HCA) or
                                 2m (CSA, whose entries also pool the previous window), k = 1 or 2
    index_entries, index_buffer  the indexer's own entries [S+1, L/m, c] and ring (CSA)
Every read is gated by position (a ring slot's position is computed, not stored; an entry is
visible once its window has closed), so a slot reused by a new sequence never sees its previous
occupant and nothing is ever cleared.

Fixed shapes pay for the pool: the indexer scores all L/m CSA entries and HCA attends all L/m'
entries at every step. CSA attention itself reads only the k chosen entries at decode (a gather);
a prefill chunk attends all entries under a per-query mask (T x k gathered rows would cost more).
"""

import dataclasses
import math
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

import deepinfer.runtime.collectives  # noqa: F401  (registers torch.ops.deepinfer.*)

from . import context_parallel, deepseek_v3
from .deepseek_v3 import rope_frequencies
from .deepseek_v4_config import CSA, SLIDING, DeepseekV4Config, layer_kind
from .moe import routed_experts
from .parallel import Layout, moe_buffers
from .prompt_scoring import PromptScorer
from .quantization import absorbed_linear, expert_weights, linear, linear_weight, stacked_experts
from .speculative import blocks, chain_drafts
from .state import StateSpec, allocate


class RMSNorm(deepseek_v3.RMSNorm):
    """V4's RMSNorm: float32 weight, applied in float32, cast once at the end (as transformers)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps))).to(x.dtype)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the LAST 2 * cos.shape[-1] channels of x in interleaved pairs, keeping the layout
    (V = K here, so rotated channels reach the output projection). cos/sin [..., r/2] broadcast."""
    r = 2 * cos.shape[-1]
    nope, rope = x[..., :-r], x[..., -r:]
    cos, sin = cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1)
    rotated = torch.stack((-rope[..., 1::2], rope[..., 0::2]), dim=-1).flatten(-2)
    return torch.cat([nope, (rope.float() * cos + rotated.float() * sin).to(x.dtype)], dim=-1)


def rope_at(positions: torch.Tensor, inv_freq: torch.Tensor, scale: float, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    angles = positions[..., None].float() * inv_freq  # [..., r/2]
    return (angles.cos() * scale).to(dtype), (angles.sin() * scale).to(dtype)


def ring_positions(last: torch.Tensor, size: int) -> torch.Tensor:
    """[N, size]: the position ring entry i holds once positions up to `last` [N] are written
    (negative: never written by this sequence)."""
    i = torch.arange(size, device=last.device)
    return last[:, None] - torch.remainder(last[:, None] - i, size)


def take_positions(ring: torch.Tensor, chunk: torch.Tensor, q: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
    """Rows at positions q [N, ...]: from the ring [N, R, C] below `start` [N], else from this
    step's chunk [N, T, C]."""
    N, R, C = ring.shape
    flat = q.reshape(N, -1)
    in_chunk = flat >= start[:, None]
    from_ring = ring.gather(1, torch.remainder(flat, R)[..., None].expand(-1, -1, C))
    from_chunk = chunk.gather(1, (flat - start[:, None]).clamp(0, chunk.shape[1] - 1)[..., None].expand(-1, -1, C))
    return torch.where(in_chunk[..., None], from_chunk, from_ring).view(*q.shape, C)


def update_ring(pool: torch.Tensor, ring: torch.Tensor, chunk: torch.Tensor, start, end, seq_slots):
    """Write back ring [N, R, C] holding the newest positions up to `end` of each sequence."""
    q = ring_positions(end, ring.shape[1])
    pool.index_put_((seq_slots,), take_positions(ring, chunk, q, start))


class Compressor(nn.Module):
    """Pools every `rate` positions into one entry: per channel, a softmax over the window of
    (gate + ape) weights kv; then RMSNorm and the compress rope at the window's first position.
    `overlap` (CSA): projections are two series wide, and entry w pools the first series over
    window w-1 with the second over window w (2 * rate slots). Under context parallelism rank c of
    the group keeps the entries w with w % cp == c, at w // cp (models/context_parallel.py)."""

    def __init__(self, config: DeepseekV4Config, width: int, rate: int, overlap: bool, layout: Layout = Layout()):
        super().__init__()
        series = 2 if overlap else 1
        self.width, self.rate, self.overlap, self.layout = width, rate, overlap, layout
        self.wkv = nn.Linear(config.hidden_size, series * width, bias=False)
        self.wgate = nn.Linear(config.hidden_size, series * width, bias=False)
        self.ape = nn.Parameter(torch.empty(rate, series * width, dtype=torch.float32))
        self.norm = RMSNorm(width, config.rms_norm_eps)
        self.rope = config.compress_rope
        self.rope_dim = config.qk_rope_head_dim
        self.init_buffers()

    def init_buffers(self, rank: int = 0):
        with torch.device("cpu"):  # derived from the config, also when the weights are on meta
            inv_freq, self.rope_scale = rope_frequencies(self.rope, self.rope_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        if self.layout.cp > 1:
            context_parallel.register_cp_rank(self, self.layout, rank)

    def entry_ids(self, n: int, device) -> torch.Tensor:
        """[n]: which entry of the sequence each of this rank's n entries is."""
        if self.layout.cp == 1:
            return torch.arange(n, device=device)
        return context_parallel.key_positions(n, self.cp_rank, self.layout.cp, device)

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """x [R, D] -> the raw (kv | gate) projections [R, 2kC] the windows pool."""
        return torch.cat([self.wkv(x), self.wgate(x)], dim=-1)

    def ring_size(self) -> int:
        return 2 * self.rate if self.overlap else self.rate

    def forward(self, raw, start, end, seq_slots, entries, buffer) -> torch.Tensor:
        """raw [N*T, 2kC] (`project`). Writes the entries of every window this step closes; returns
        the sequences' entries [N, L/rate (/ cp), width] (read after the write)."""
        N, m, C = seq_slots.shape[0], self.rate, self.width
        raw = raw.view(N, -1, raw.shape[-1])  # [N, T, 2kC]
        T = raw.shape[1]
        ring = buffer.index_select(0, seq_slots)  # [N, R, 2kC], before this step
        windows = start[:, None] // m + torch.arange(-(-T // m), device=raw.device)  # [N, K] candidates
        first = windows * m - (m if self.overlap else 0)
        q = first[..., None] + torch.arange(self.ring_size(), device=raw.device)  # [N, K, S] pooled positions
        kv, gate = take_positions(ring, raw, q, start).split(self.wkv.out_features, dim=-1)  # [N, K, S, kC]
        gate = gate + (self.ape.repeat(2, 1) if self.overlap else self.ape)
        if self.overlap:  # slots [0, m): series a of window w-1; [m, 2m): series b of window w
            kv = torch.cat([kv[..., :m, :C], kv[..., m:, C:]], dim=-2)
            gate = torch.cat([gate[..., :m, :C], gate[..., m:, C:]], dim=-2)
            gate = gate.masked_fill((q < 0)[..., None], float("-inf"))  # window -1 does not exist
        pooled = self.norm((kv * gate.softmax(dim=-2, dtype=torch.float32).to(kv.dtype)).sum(dim=-2))  # [N, K, C]
        cos, sin = rope_at(windows * m, self.inv_freq, self.rope_scale, pooled.dtype)
        pooled = apply_rope(pooled, cos, sin)
        closed = (windows + 1) * m - 1 <= end[:, None]  # [N, K]; unclosed candidates write the scratch slot
        scratch = entries.shape[0] - 1
        rows, at = torch.where(closed, seq_slots[:, None], scratch), windows
        if self.layout.cp > 1:  # (another rank's entries: the scratch slot)
            rows, at = context_parallel.stripe(windows, rows, self.cp_rank, self.layout.cp, scratch)
        entries.index_put_((rows, at.clamp(max=entries.shape[1] - 1)), pooled)
        update_ring(buffer, ring, raw, start, end, seq_slots)
        return entries.index_select(0, seq_slots)


class Indexer(nn.Module):
    """Lightning indexer: scores every compressed entry for each query,
    sum_h w_h * ReLU(q_h . k_e) * c^-0.5, and keeps the top `index_topk` visible ones. Under
    context parallelism each rank scores its own entries and the group's top-k is merged from
    every rank's (models/context_parallel.top_k)."""

    def __init__(self, config: DeepseekV4Config, layout: Layout = Layout()):
        super().__init__()
        c = config
        self.n_heads, self.head_dim, self.topk, self.cp = c.index_n_heads, c.index_head_dim, c.index_topk, layout.cp
        self.wq_b = linear(c.q_lora_rank, c.index_n_heads * c.index_head_dim, c.quantization)
        self.weights_proj = nn.Linear(c.hidden_size, c.index_n_heads, bias=False)
        self.compressor = Compressor(c, c.index_head_dim, c.compress_rate_csa, overlap=True, layout=layout)

    def project(self, x, q_residual) -> list[torch.Tensor]:
        """The per-row projections [R, ...]: the compressor's raw rows, the queries, the head weights."""
        return [self.compressor.project(x), self.wq_b(q_residual), self.weights_proj(x)]

    def forward(self, raw, q, weights, cos, sin, start, end, seq_slots, visible, entries, buffer):
        """-> the top-k entry ids of each query [N, T, k], and which of them it may see (`visible`
        [N, T, E (/ cp)]: fewer than k windows may have closed)."""
        keys = self.compressor(raw, start, end, seq_slots, entries, buffer)  # [N, E (/ cp), c]
        N, T = visible.shape[:2]
        q = apply_rope(q.view(N * T, self.n_heads, self.head_dim), cos[:, None], sin[:, None])
        scores = torch.einsum("nthc,nec->nthe", q.view(N, T, self.n_heads, -1).float(), keys.float())
        weights = weights.float().view(N, T, self.n_heads, 1) * self.n_heads**-0.5
        scores = (F.relu(scores) * self.head_dim**-0.5 * weights).sum(dim=2)  # [N, T, E (/ cp)]
        scores = scores.masked_fill(~visible, float("-inf"))
        if self.cp > 1:
            return context_parallel.top_k(scores, self.topk, self.compressor.cp_rank, self.cp)
        chosen = scores.topk(min(self.topk, scores.shape[-1]), dim=-1).indices  # [N, T, k]
        return chosen, visible.gather(-1, chosen)


class Attention(nn.Module):
    """Shared-KV MQA with sinks over the sliding window (+ compressed entries), partial interleaved
    rope on the last channels (undone on the output), grouped low-rank output projection."""

    def __init__(self, config: DeepseekV4Config, attention_type: str, layout: Layout = Layout()):
        super().__init__()
        c = config
        # Under tensor parallelism this rank holds n_heads / tp query heads, in o_groups / tp whole
        # output groups (a group's heads are consecutive): wq_b and wo_a by rows, wo_b by columns
        # (row-parallel: partial sums all-reduced over tp). The shared K=V head, the compressors and
        # the indexer are every head's: each rank computes them whole (models/parallel.py).
        # Under context parallelism CSA's entries (and its indexer's) are striped over the cp group:
        # they are the state that grows with the context. HCA's entries (one per 128 positions), the
        # window, the compressors' rings and the sinks are every rank's (models/context_parallel.py),
        # so only CSA layers need collectives.
        self.tp, self.cp, self.layout = layout.tp, layout.cp, layout
        self.stripes_entries = layout.cp > 1 and attention_type == CSA
        self.n_heads, self.head_dim, self.window, self.eps = c.num_attention_heads // layout.tp, c.head_dim, c.sliding_window, c.rms_norm_eps
        self.rate, self.groups = c.compress_rate(attention_type), c.o_groups // layout.tp
        # Speculative decoding writes up to k drafts past the accepted tokens: rings keep k spare
        # entries, so a rejected draft's write evicts only positions no later step reads.
        self.spare = c.draft_tokens
        q = c.quantization  # fp8 in DeepSeek's release; the compressors and the indexer's scoring stay bf16
        self.wq_a = linear(c.hidden_size, c.q_lora_rank, q)
        self.q_norm = RMSNorm(c.q_lora_rank, c.rms_norm_eps)
        self.wq_b = linear(c.q_lora_rank, self.n_heads * c.head_dim, q)
        self.wkv = linear(c.hidden_size, c.head_dim, q)
        self.norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.wo_a = absorbed_linear(c.num_attention_heads * c.head_dim // c.o_groups, self.groups * c.o_lora_rank, q)
        self.wo_b = linear(self.groups * c.o_lora_rank, c.hidden_size, q)
        self.attn_sink = nn.Parameter(torch.empty(self.n_heads, dtype=torch.float32))
        if self.rate:
            whole = dataclasses.replace(layout, cp=1)  # (HCA: every rank keeps every entry)
            self.compressor = Compressor(c, c.head_dim, self.rate, overlap=attention_type == CSA,
                                         layout=layout if self.stripes_entries else whole)
        if attention_type == CSA:
            self.indexer = Indexer(c, layout)
        self.init_buffers()

    def init_buffers(self, rank: int = 0):
        if self.cp > 1:
            context_parallel.register_cp_rank(self, self.layout, rank)

    def state_specs(self, max_seqs: int, max_len: int, dtype: torch.dtype) -> list[StateSpec]:
        """The window and the compressors' rings are fixed; the entries grow with the context (a
        rank of a cp group keeps every cp-th entry)."""
        S, per_entry = max_seqs + 1, self.rate * (self.cp if self.stripes_entries else 1)
        specs = [StateSpec("window", [S, self.window + self.spare, self.head_dim], dtype)]
        if self.rate:
            specs += [StateSpec("entries", [S, max_len // per_entry, self.head_dim], dtype, per_entry),
                      StateSpec("buffer", [S, self.compressor.ring_size() + self.spare, 2 * self.compressor.wkv.out_features], dtype)]
        if hasattr(self, "indexer"):
            index = self.indexer.compressor
            specs += [StateSpec("index_entries", [S, max_len // per_entry, index.width], dtype, per_entry),
                      StateSpec("index_buffer", [S, index.ring_size() + self.spare, 2 * index.wkv.out_features], dtype)]
        return specs

    def forward(self, x, cos, sin, start, end, seq_slots, window, *compressed_state):
        """x [N*T, D] -> [N*T, D]. Under context parallelism a prefill chunk's x holds this rank's
        rows only, [T / cp, D], and so does the result, while cos/sin are the whole chunk's: the
        rows' projections are gathered, the attention runs for every row and each rank keeps its own."""
        N, H, Dh = seq_slots.shape[0], self.n_heads, self.head_dim
        split = x.shape[0] != cos.shape[0]
        q_residual = self.q_norm(self.wq_a(x))
        rows = [self.wq_b(q_residual), self.wkv(x)]
        if self.rate:
            rows.append(self.compressor.project(x))
        if hasattr(self, "indexer"):
            rows += self.indexer.project(x, q_residual)
        if split:
            rows = context_parallel.gather_rows(rows, self.cp)
        q, kv, *compressor_rows = rows
        T = q.shape[0] // N
        q = unweighted_rms_norm(q.view(N * T, H, Dh), self.eps)
        q = apply_rope(q, cos[:, None], sin[:, None]).view(N, T, H, Dh)
        kv = apply_rope(self.norm(kv), cos, sin).view(N, T, Dh)

        # Sliding keys: the ring as it was before this step, then this step's tokens. Under a split
        # chunk this rank's block of rows attends them, over the chunk rows its window reaches.
        p = start[:, None] + torch.arange(T, device=x.device)  # [N, T] query positions
        ring = window.index_select(0, seq_slots)  # [N, W, Dh]
        q_rows, p_rows, rope_rows, chunk_keys, chunk_pos, block = q, p, (cos, sin), kv, p, None
        if split:
            block = self.cp_rank * (T // self.cp) + torch.arange(T // self.cp, device=x.device)
            q_rows, p_rows = q.index_select(1, block), p.index_select(1, block)
            rope_rows = cos.index_select(0, block), sin.index_select(0, block)
            reach = block[0] - self.window + torch.arange(self.window + block.shape[0], device=x.device)  # (< 0: none)
            chunk_keys = kv.index_select(1, reach.clamp(min=0))
            chunk_pos = torch.where(reach >= 0, start[:, None] + reach, -1)
        key_pos = torch.cat([ring_positions(start - 1, ring.shape[1]), chunk_pos], dim=1)  # [N, W (+ spare) + T (split: W + T / cp)]
        keys = torch.cat([ring, chunk_keys], dim=1)
        visible = (key_pos[:, None, :] >= 0) & (key_pos[:, None, :] <= p_rows[..., None]) & (key_pos[:, None, :] > p_rows[..., None] - self.window)
        update_ring(window, ring, kv, start, end, seq_slots)

        if self.rate:
            entry_keys = self.compressor(compressor_rows[0], start, end, seq_slots, *compressed_state[:2])  # [N, E (/ cp), Dh]
            entry_ids = self.compressor.entry_ids(entry_keys.shape[1], x.device)
            closed = entry_ids < (((p if self.stripes_entries else p_rows) + 1) // self.rate)[..., None]  # [N, T, E (/ cp)]
            if hasattr(self, "indexer"):
                chosen, seen = self.indexer(*compressor_rows[1:], cos, sin, start, end, seq_slots, closed, *compressed_state[2:])
                entry_keys, closed = self.chosen_entries(entry_keys, entry_ids, closed, chosen, seen)
            if not self.stripes_entries:  # one softmax over the window and the entries
                keys = torch.cat([keys, entry_keys], dim=1)  # [N, W + T + E (or k), Dh]
                visible = torch.cat([visible, closed], dim=2)

        scores = torch.einsum("nthd,nkd->nthk", q_rows, keys) * Dh**-0.5
        scores = scores.masked_fill(~visible[:, :, None, :], float("-inf"))
        sinks = self.attn_sink.to(scores.dtype).view(1, 1, H, 1).expand(*scores.shape[:3], 1)
        if self.stripes_entries:  # entries striped over the group (models/context_parallel.py)
            out = self.striped(q, scores, sinks, keys, entry_keys, closed, block)
        else:
            probs = torch.cat([scores, sinks], dim=-1).softmax(dim=-1)[..., :-1].to(keys.dtype)  # the sink absorbs mass
            out = torch.einsum("nthk,nkd->nthd", probs, keys)
        out = out.reshape(-1, H, Dh)
        out = apply_rope(out, rope_rows[0][:, None], -rope_rows[1][:, None])  # V carried the keys' rotation: undo it at the query
        grouped = out.view(out.shape[0], self.groups, -1)  # [R, g, H Dh / g]
        w = linear_weight(self.wo_a, grouped.dtype).view(self.groups, -1, grouped.shape[-1])  # [g, o_lora, H Dh / g]
        out = self.wo_b(torch.einsum("rgi,goi->rgo", grouped, w).flatten(1))
        return torch.ops.deepinfer.all_reduce(out, "tp") if self.tp > 1 else out

    def striped(self, q, scores, sinks, keys, entry_keys, closed, block):
        """Attention whose compressed entries are striped over the cp group: this rank's partial
        over the window (and the sink), for its rows (`block` under a split chunk, else None: every
        row), merged by log-sum-exp with every rank's partial over its entries (for every row:
        gathered) -> [N, rows, H, Dh]."""
        window_probs, window_lse = context_parallel.partial_softmax(torch.cat([scores, sinks], dim=-1))
        window_out = torch.einsum("nthk,nkd->nthd", window_probs[..., :-1].to(keys.dtype), keys)
        entry_scores = torch.einsum("nthd,nkd->nthk", q, entry_keys) * self.head_dim**-0.5
        entry_probs, entry_lse = context_parallel.partial_softmax(entry_scores.masked_fill(~closed[:, :, None, :], float("-inf")))
        entry_out = torch.einsum("nthk,nkd->nthd", entry_probs.to(entry_keys.dtype), entry_keys)
        outs, lses = context_parallel.gather_partials(entry_out, entry_lse, self.cp)  # [cp, N, T, H, Dh], [cp, N, T, H]
        if block is not None:
            outs, lses = outs.index_select(2, block), lses.index_select(2, block)
        outs, lses = torch.cat([outs, window_out[None].float()]), torch.cat([lses, window_lse[None]])
        return context_parallel.merge_partials(outs, lses).to(q.dtype)

    def chosen_entries(self, entry_keys, entry_ids, closed, chosen, seen):
        """The indexer's choice (entry ids [N, T, k], `seen` where visible) -> the entry keys and
        their mask: at decode (T = 1) only the k chosen entries are read, whatever max_len is; a
        chunk reads every entry, each query masked to its own choice. Under context parallelism
        the ids are the group's and this rank reads those it holds."""
        N, T, E = closed.shape
        if T == 1:
            at, mine = chosen, seen
            if self.cp > 1:
                at, mine = (chosen // self.cp).clamp(max=E - 1), seen & (chosen % self.cp == self.cp_rank)
            return entry_keys.gather(1, at[:, 0, :, None].expand(-1, -1, self.head_dim)), mine  # [N, k, Dh]
        if self.cp == 1:
            return entry_keys, torch.zeros_like(closed).scatter(-1, chosen, True) & closed
        wanted = closed.new_zeros(N, T, E * self.cp).scatter(-1, chosen, seen)  # over the group's entries
        return entry_keys, wanted.index_select(-1, entry_ids) & closed


def hyper_connection(h, fn, base, scale, iters: int, eps: float, norm_eps: float):
    """mHC weights from the n streams h [R, n, D]: post [R, n], comb [R, n, n] (doubly stochastic by
    Sinkhorn-Knopp) and the block input x = sum_j pre_j h_j [R, D]."""
    n = h.shape[1]
    flat = h.flatten(1).float()
    mixes = F.linear(unweighted_rms_norm(flat, norm_eps), fn.float())  # [R, (2 + n) n]
    pre, post, comb = mixes.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.split([n, n, n * n])
    pre = torch.sigmoid(pre * scale[0] + pre_b) + eps
    post = 2 * torch.sigmoid(post * scale[1] + post_b)
    comb = torch.softmax(comb.view(-1, n, n) * scale[2] + comb_b.view(n, n), dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    x = (pre[..., None] * h).sum(dim=1).to(h.dtype)
    return post, comb, x


class Gate(nn.Module):
    """Routing: `moe` picks the top-k of score + bias; `hash_moe` takes tid2eid[token]. The weights
    are the picked scores, normalised, times routed_scaling_factor (as transformers and DeepSeek)."""

    def __init__(self, config: DeepseekV4Config, hashed: bool):
        super().__init__()
        c = config
        self.top_k, self.scaling, self.scoring = c.num_experts_per_tok, c.routed_scaling_factor, c.scoring_func
        self.weight = nn.Parameter(torch.empty(c.n_routed_experts, c.hidden_size))
        if hashed:
            self.tid2eid = nn.Parameter(torch.zeros(c.vocab_size, c.num_experts_per_tok, dtype=torch.int64), requires_grad=False)
        else:
            self.bias = nn.Parameter(torch.zeros(c.n_routed_experts, dtype=torch.float32))

    def forward(self, x, tokens):
        """x [R, D], tokens [R] -> weights [R, k], global expert ids [R, k]."""
        logits = F.linear(x, self.weight)
        scores = F.softplus(logits).sqrt() if self.scoring == "sqrtsoftplus" else logits.sigmoid()  # [R, E]
        if hasattr(self, "tid2eid"):
            ids = self.tid2eid[tokens]
        else:
            ids = deepseek_v3.largest_ids(scores + self.bias, self.top_k)
        weights = scores.gather(1, ids)
        return weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * self.scaling, ids


def clamped_swiglu(gate, up, limit: float):
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


class SharedExpert(nn.Module):
    """Clamped SwiGLU, its hidden dim split over tp (row-parallel w2: a partial sum per rank)."""

    def __init__(self, config: DeepseekV4Config, tp: int = 1):
        super().__init__()
        self.limit = config.swiglu_limit
        hidden = config.moe_intermediate_size // tp
        self.w1 = linear(config.hidden_size, hidden, config.quantization)  # gate
        self.w3 = linear(config.hidden_size, hidden, config.quantization)  # up
        self.w2 = linear(hidden, config.hidden_size, config.quantization)  # down

    def forward(self, x):
        return self.w2(clamped_swiglu(self.w1(x), self.w3(x), self.limit))


class MoE(nn.Module):
    """Routed experts (stacked [E_local, out, in]) plus the shared expert, in static-shape form;
    the expert split over ranks is V3's (models/parallel.py): buffers say which experts this rank
    holds and computes, and the partial sums meet in one all-reduce over "world"."""

    def __init__(self, config: DeepseekV4Config, hashed: bool, layout: Layout = Layout()):
        super().__init__()
        c = config
        self.config, self.layout, self.limit = c, layout, c.swiglu_limit
        E, I = c.n_routed_experts // layout.ep, c.moe_intermediate_size
        self.n_local_experts = E
        self.gate = Gate(c, hashed)
        stacked_experts(self, "experts_w13", E, 2 * I, c.hidden_size, c.quantization)  # w1 (gate) rows, then w3 (up) rows
        stacked_experts(self, "experts_w2", E, c.hidden_size, I, c.quantization)
        self.shared_experts = SharedExpert(c, layout.tp)
        self.init_buffers()

    def init_buffers(self, rank: int = 0):
        with torch.device("cpu"):
            for name, value in moe_buffers(self.layout, self.config, rank).items():
                self.register_buffer(name, value, persistent=False)

    def forward(self, x, tokens):
        weights, ids = self.gate(x, tokens)  # [R, k] each
        activation = partial(clamped_swiglu, limit=self.limit)
        q = self.config.quantization
        w13, w2 = expert_weights(self, "experts_w13", x.dtype, q), expert_weights(self, "experts_w2", x.dtype, q)
        routed = routed_experts(self, x, weights, ids, w13, w2, activation, self.config.expert_capacity,
                                self.config.expert_overflow)
        out = routed + self.shared_experts(x) * self.shared_scale.to(x.dtype)
        return torch.ops.deepinfer.all_reduce(out, "world") if self.layout.world_size > 1 else out


class InputEmbedding(nn.Module):
    """Token embedding copied to the hc_mult streams, both rope tables at this step's positions,
    each sequence's [start, end] positions, and the first layer's (zero) pending MoE output."""

    def __init__(self, config: DeepseekV4Config):
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.empty(config.vocab_size, config.hidden_size))
        self.init_buffers()

    def init_buffers(self):
        with torch.device("cpu"):
            r = self.config.qk_rope_head_dim
            main, self.main_scale = rope_frequencies(self.config.rope, r)
            compress, self.compress_scale = rope_frequencies(self.config.compress_rope, r)
        self.register_buffer("main_inv_freq", main, persistent=False)
        self.register_buffer("compress_inv_freq", compress, persistent=False)

    def forward(self, tokens, positions, slots=None, last_index=None):
        """Prefill (`last_index`): one sequence, valid tokens first -> ..., start, end. Decode
        (`slots`): blocks of draft_tokens + 1 rows per sequence (models/speculative.py; one row
        without speculative decoding) -> ..., start, end, each block's slot."""
        x = F.embedding(tokens, self.weight)  # [R, D]
        h = x[:, None, :].expand(-1, self.config.hc_mult, -1).contiguous()  # [R, n, D]
        post = h.new_zeros(h.shape[:2], dtype=torch.float32)  # [R, n]: float32, as every layer's mHC weights
        pending = torch.zeros_like(x)
        main = rope_at(positions, self.main_inv_freq, self.main_scale, x.dtype)
        compress = rope_at(positions, self.compress_inv_freq, self.compress_scale, x.dtype)
        if last_index is not None:
            return h, post, pending, *main, *compress, positions[:1], positions.index_select(0, last_index)
        seq_slots, start, last = blocks(positions, slots, self.config.draft_tokens + 1)
        return h, post, pending, *main, *compress, start.clone(), start + last, seq_slots.clone()  # (a unit may not return its input)


class DecoderLayer(nn.Module):
    """mHC around attention and MoE. The residual streams enter as `mixed + post * pending`: the
    layer returns its MoE output unmixed, and the next layer (or the head) mixes it first, so the
    MoE's all-reduce ends the layer's last region instead of standing between two small ones."""

    def __init__(self, config: DeepseekV4Config, attention_type: str, mlp_type: str, layout: Layout = Layout()):
        super().__init__()
        c = config
        self.kind = layer_kind(attention_type, mlp_type)
        self.sliding = attention_type == SLIDING
        self.iters, self.hc_eps, self.eps = c.hc_sinkhorn_iters, c.hc_eps, c.rms_norm_eps
        n, D = c.hc_mult, c.hidden_size
        for block in ("attn", "ffn"):
            setattr(self, f"hc_{block}_fn", nn.Parameter(torch.empty((2 + n) * n, n * D, dtype=torch.float32)))
            setattr(self, f"hc_{block}_base", nn.Parameter(torch.empty((2 + n) * n, dtype=torch.float32)))
            setattr(self, f"hc_{block}_scale", nn.Parameter(torch.empty(3, dtype=torch.float32)))
        self.attn_norm = RMSNorm(D, c.rms_norm_eps)
        self.attn = Attention(c, attention_type, layout)
        self.ffn_norm = RMSNorm(D, c.rms_norm_eps)
        self.ffn = MoE(c, mlp_type == "hash_moe", layout)

    def forward(self, h, post, pending, cos_main, sin_main, cos_compress, sin_compress, tokens, start, end, seq_slots, *state):
        h = h + post.to(h.dtype)[..., None] * pending[:, None, :]  # [R, n, D]
        cos, sin = (cos_main, sin_main) if self.sliding else (cos_compress, sin_compress)
        post, comb, x = hyper_connection(h, self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale, self.iters, self.hc_eps, self.eps)
        a = self.attn(self.attn_norm(x), cos, sin, start, end, seq_slots, *state)
        h = post.to(h.dtype)[..., None] * a[:, None, :] + torch.matmul(comb.to(h.dtype).mT, h)
        post, comb, x = hyper_connection(h, self.hc_ffn_fn, self.hc_ffn_base, self.hc_ffn_scale, self.iters, self.hc_eps, self.eps)
        h, x = torch.matmul(comb.to(h.dtype).mT, h), self.ffn_norm(x)
        if h.shape[0] != tokens.shape[0]:
            # A prefill chunk under context parallelism: every rank computes its experts for the
            # whole chunk, whose rows the cp group holds a block each (as DeepSeek-V3's layer).
            return h, post, context_parallel.over_whole_chunk(self.ffn, x, self.attn.cp_rank, self.attn.cp, tokens)
        return h, post, self.ffn(x, tokens)


class LMHead(nn.Module):
    """Mixes the last pending MoE output in, collapses the streams (hyper-head), final norm and the
    vocabulary projection; vocabulary-parallel over tp, then one all-gather (as V3)."""

    def __init__(self, config: DeepseekV4Config, tp: int = 1):
        super().__init__()
        n, D = config.hc_mult, config.hidden_size
        self.tp, self.hc_eps, self.eps = tp, config.hc_eps, config.rms_norm_eps
        self.hc_fn = nn.Parameter(torch.empty(n, n * D, dtype=torch.float32))
        self.hc_base = nn.Parameter(torch.empty(n, dtype=torch.float32))
        self.hc_scale = nn.Parameter(torch.empty(1, dtype=torch.float32))
        self.norm = RMSNorm(D, config.rms_norm_eps)
        self.weight = nn.Parameter(torch.empty(config.vocab_size // tp, D))

    def forward(self, h, post, pending, last_index=None):
        """-> logits [R, V] float32, or [1, V] for row `last_index` [1] only (prefill)."""
        if last_index is not None:
            h, post, pending = (t.index_select(0, last_index) for t in (h, post, pending))
        return self.logits(mixed_streams(h, post, pending))

    def logits(self, streams):
        """The residual streams [R, n, D] -> logits [R, V] float32."""
        return self.project(self.norm(hyper_head(streams, self.hc_fn, self.hc_base, self.hc_scale, self.eps, self.hc_eps)))

    def project(self, x):
        """Normed x [R, D] -> logits [R, V] float32."""
        logits = F.linear(x, self.weight).float()  # [R, V / tp]
        return torch.ops.deepinfer.all_gather(logits, "tp", -1, self.tp) if self.tp > 1 else logits


def mixed_streams(h, post, pending):
    """The residual streams [R, n, D] once a layer's unmixed MoE output is mixed in (DecoderLayer)."""
    return h + post.to(h.dtype)[..., None] * pending[:, None, :]


def hyper_head(h, fn, base, scale, eps: float, hc_eps: float):
    """The n streams h [R, n, D] collapsed to one [R, D] by sigmoid weights (mHC's head)."""
    mixes = F.linear(unweighted_rms_norm(h.flatten(1).float(), eps), fn.float())  # [R, n]
    pre = torch.sigmoid(mixes * scale.float() + base.float()) + hc_eps
    return (pre[..., None] * h).sum(dim=1).to(h.dtype)


class HeadKeepingHidden(LMHead):
    """The head of a model with MTP modules: it also stores each row's last streams [n D] at
    (slot, position) in the MTP's `hidden` state, the input the drafts start from."""

    def forward(self, h, post, pending, positions, write_slots, hidden, last_index=None):
        streams = mixed_streams(h, post, pending)  # [R, n, D]
        hidden.index_put_((write_slots, positions), streams.flatten(1))
        return self.logits(streams if last_index is None else streams.index_select(0, last_index))


class MTPBlock(DecoderLayer):
    """DeepSeek-V4's multi-token prediction module (DeepSeek's inference code, `MTPBlock`): a
    sliding-window, top-k routed V4 block over the streams

        x_q = e_proj(enorm(embed(t_{q+1})))[None] + h_proj(hnorm(h_q))      [n, D]

    for the main model's last streams h_q at position q, its output collapsed by its own
    hyper-head and final norm, then the main head's vocabulary projection (embedding and head
    shared). State: its window and `hidden`, the streams a draft at each position starts from
    (chained drafts write theirs there, as V3's MTPLayer). Rows are in blocks of T per sequence
    (models/speculative.py): a draft step's first pass and a prompt chunk run a sequence's rows
    together, at positions q = position - 1 (a prompt's first row, at q = -1, is read by
    nothing: every read is gated by position). Checkpoint names: DeepSeek's `mtp.{i}.*`."""

    def __init__(self, config: DeepseekV4Config, embed: InputEmbedding, head: LMHead, layout: Layout = Layout()):
        super().__init__(config, SLIDING, "moe", layout)
        c, D, n = config, config.hidden_size, config.hc_mult
        self.kind, self.draft_tokens, self.n = "mtp", config.draft_tokens, n
        self.embed, self.head = embed, head  # (the main model's: shared)
        self.e_proj = linear(D, D, c.quantization)
        self.h_proj = linear(D, D, c.quantization)
        self.enorm, self.hnorm, self.norm = (RMSNorm(D, c.rms_norm_eps) for _ in range(3))
        self.hc_head_fn = nn.Parameter(torch.empty(n, n * D, dtype=torch.float32))
        self.hc_head_base = nn.Parameter(torch.empty(n, dtype=torch.float32))
        self.hc_head_scale = nn.Parameter(torch.empty(1, dtype=torch.float32))

    def run(self, tokens, q, previous, slots, T: int, window):
        """tokens [R] at positions q + 1, in blocks of T; previous [R, n, D] the streams at q ->
        the module's output streams [R, n, D]."""
        seq_slots, start, last = blocks(q, slots, T)
        x = self.e_proj(self.enorm(F.embedding(tokens, self.embed.weight)))[:, None, :] + self.h_proj(self.hnorm(previous))
        cos, sin = rope_at(q, self.embed.main_inv_freq, self.embed.main_scale, x.dtype)  # (a sliding block: the main rope)
        post, pending = torch.zeros_like(x[..., 0]), torch.zeros_like(x[:, 0])
        h, post, pending = super().forward(x, post, pending, cos, sin, cos, sin, tokens, start, start + last, seq_slots, window)
        return mixed_streams(h, post, pending)

    def step(self, tokens, positions, slots, window, hidden, T: int = 1):
        """Draft rows -> logits [R, V] for positions + 1; each row's streams stored at its position."""
        streams = self.run(tokens, positions - 1, self.previous(positions, slots, hidden), slots, T, window)
        hidden.index_put_((slots, positions), streams.flatten(1))
        return self.logits(streams)

    def logits(self, streams):
        """Streams [R, n, D] -> logits [R, V]: the module's own hyper-head and norm, the shared projection."""
        x = hyper_head(streams, self.hc_head_fn, self.hc_head_base, self.hc_head_scale, self.head.eps, self.head.hc_eps)
        return self.head.project(self.norm(x))

    def previous(self, positions, slots, hidden):
        """The streams [R, n, D] the rows at `positions` start from: `hidden` at positions - 1."""
        return hidden[slots, (positions - 1).clamp(min=0)].view(positions.shape[0], self.n, -1)

    def forward(self, tokens, positions, slots, window, hidden):
        """A whole draft step: rows [B (k + 1)] -> draft tokens [B, k] (as V3's MTPLayer.forward)."""
        k = self.draft_tokens
        logits = self.step(tokens, positions, slots, window, hidden, T=k + 1)
        return chain_drafts(partial(self.step, window=window, hidden=hidden), logits, positions, slots, k, hidden)


class MTPPrefill(nn.Module):
    """The MTP module over a prompt chunk (one block), after the head stored the chunk's streams:
    fills its window for the prompt. It writes no streams: the chunk's last position keeps the
    main model's, which the first draft reads."""

    def __init__(self, layer: MTPBlock):
        super().__init__()
        self.kind = "mtp_prefill"
        self.layer = layer  # (shared)

    def forward(self, tokens, positions, slots, window, hidden):
        previous = self.layer.previous(positions, slots, hidden)
        return self.layer.run(tokens, positions - 1, previous, slots, tokens.shape[0], window)


class DeepseekV4(nn.Module):
    CONTEXT_PARALLEL = True  # parallel.cp stripes the compressed entries over a group (models/context_parallel.py)
    INT_HEAD = False  # model.quantize keeps the LM head (a hyper-head's projection) in the recipe's dtype
    STATE_FREE_FROM = "layers.*.ffn_norm"  # as DeepseekV3's: the MoE after it reads no state

    def __init__(self, config: DeepseekV4Config, layout: Layout = Layout()):
        super().__init__()
        layout.check(config)
        self.config, self.layout = config, layout
        self.embed = InputEmbedding(config)
        self.layers = nn.ModuleList(DecoderLayer(config, config.layer_types[i], config.mlp_layer_types[i], layout)
                                    for i in range(config.num_hidden_layers))
        self.head = (HeadKeepingHidden if config.draft_tokens else LMHead)(config, layout.tp)
        # Speculative decoding's drafter: the checkpoint's first MTP module (chained past it, as V3's).
        self.mtp = nn.ModuleList([MTPBlock(config, self.embed, self.head, layout)] if config.draft_tokens else [])
        self.mtp_prefill = nn.ModuleList(MTPPrefill(layer) for layer in self.mtp)
        self.scorer = PromptScorer()
        if layout.cp > 1:  # a prefill chunk's rows, split over the cp group and gathered before the head
            self.split_rows = context_parallel.SplitRows(layout)
            self.gather_rows = context_parallel.GatherRows(layout.cp)
        self.tie_weights()

    @staticmethod
    def param_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
        """Norms, mHC, sinks, compressor biases and the router bias stay float32 (as transformers)."""
        if name.endswith("tid2eid"):
            return torch.int64
        leaf = name.rpartition(".")[2]
        if name.endswith(("norm.weight", ".attn_sink", ".ape", "gate.bias")) or leaf.startswith("hc_"):
            return torch.float32
        return dtype

    def tie_weights(self):
        if self.config.tie_word_embeddings and self.layout.tp == 1:
            self.head.weight = self.embed.weight

    def state_specs(self, max_seqs: int, max_len: int) -> list[list[StateSpec]]:
        """Per layer, the named state tensors it keeps (see the module docstring)."""
        dtype = self.embed.weight.dtype
        hidden = StateSpec("hidden", [max_seqs + 1, max_len, self.config.hc_mult * self.config.hidden_size], dtype, 1)
        return ([layer.attn.state_specs(max_seqs, max_len, dtype) for layer in self.layers]
                + [[*mtp.attn.state_specs(max_seqs, max_len, dtype), hidden] for mtp in self.mtp])

    def new_state(self, max_seqs: int, max_len: int) -> list[list[torch.Tensor]]:
        return allocate(self.state_specs(max_seqs, max_len))

    def prefill(self, tokens, positions, slots, read_slot, last_index, state):
        return self._prefill(tokens, positions, slots, read_slot, last_index, state, last_index)  # [1, V]

    def score(self, tokens, positions, slots, read_slot, last_index, targets, state):
        """A prefill chunk that also scores every row (prompt logprobs: models/prompt_scoring.py)."""
        return self.scorer(self._prefill(tokens, positions, slots, read_slot, last_index, state), targets, last_index)

    def _prefill(self, tokens, positions, slots, read_slot, last_index, state, *head_row):
        """-> logits [T, V], or [1, V] at `head_row` when given."""
        h, post, pending, *rope, start, end = self.embed(tokens, positions, slots, last_index)  # (positional: traced)
        if self.layout.cp > 1:  # (the rope tables stay whole: attention runs for every row of the chunk)
            h, post, pending = self.split_rows(h, post, pending)
        for layer, layer_state in zip(self.layers, state):
            h, post, pending = layer(h, post, pending, *rope, tokens, start, end, read_slot, *layer_state)
        if self.layout.cp > 1:
            h, post, pending = self.gather_rows(h, post, pending)
        if not self.mtp:
            return self.head(h, post, pending, *head_row)
        mtp_state = state[len(self.layers)]
        logits = self.head(h, post, pending, positions, slots, mtp_state[-1], *head_row)
        self.mtp_prefill[0](tokens, positions, slots, *mtp_state)
        return logits

    def decode(self, tokens, positions, slots, state):
        """Also the verify step of speculative decoding: each sequence's block of rows (its last
        token and its drafts) runs as one chunk."""
        h, post, pending, *rope, start, end, seq_slots = self.embed(tokens, positions, slots)
        for layer, layer_state in zip(self.layers, state):
            h, post, pending = layer(h, post, pending, *rope, tokens, start, end, seq_slots, *layer_state)
        if not self.mtp:
            return self.head(h, post, pending)  # [B, V]
        return self.head(h, post, pending, positions, slots, state[len(self.layers)][-1])

    def draft(self, tokens, positions, slots, state):
        """The next k drafts of B sequences: rows [B (k + 1)] -> tokens [B, k] (MTPBlock.forward)."""
        return self.mtp[0](tokens, positions, slots, *state[len(self.layers)])


def init_random(model: DeepseekV4, seed: int) -> DeepseekV4:
    """Deterministic random weights with decisive logits (see V3's init_random); hash tables
    route token t to distinct experts; mHC scales 1 and bases 0 as transformers initialises them."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            leaf = name.rpartition(".")[2]
            if name.endswith("norm.weight") or leaf.endswith("_scale"):
                param.fill_(1.0)
            elif leaf.endswith("_base"):
                param.zero_()
            elif name.endswith("tid2eid"):
                experts = model.config.n_routed_experts
                param.copy_(torch.stack([torch.randperm(experts, generator=generator)[: param.shape[1]]
                                         for _ in range(param.shape[0])]))
            elif name.endswith(("gate.bias", ".attn_sink", ".ape")):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
            else:
                fan_in = param.shape[-1] if name != "embed.weight" else 1
                param.copy_(torch.randn(param.shape, generator=generator) / math.sqrt(fan_in))
    return model


_TOP_LEVEL = {  # our name -> (DeepSeek's upstream key, transformers' save_pretrained key)
    "embed.weight": ("embed.weight", "model.embed_tokens.weight"),
    "head.weight": ("head.weight", "head.weight"),
    "head.norm.weight": ("norm.weight", "model.norm.weight"),
    "head.hc_fn": ("hc_head_fn", "model.hc_head.hc_fn"),
    "head.hc_base": ("hc_head_base", "model.hc_head.hc_base"),
    "head.hc_scale": ("hc_head_scale", "model.hc_head.hc_scale"),
}


def checkpoint_keys(name: str, config: DeepseekV4Config, shape: tuple, saved_by_transformers: bool) -> list[tuple[str, tuple]]:
    """The checkpoint tensors (key, shape) our parameter `name` of full `shape` is made of. Layer
    weights carry DeepSeek's upstream names (`layers.3.attn.wq_a.weight`), which transformers'
    save_pretrained writes too under `model.`; routed experts are one tensor per expert."""
    if name == "head.weight" and config.tie_word_embeddings:
        name = "embed.weight"
    if name in _TOP_LEVEL:
        return [(_TOP_LEVEL[name][saved_by_transformers], tuple(shape))]
    prefix = "model." if saved_by_transformers and not name.startswith("mtp.") else ""  # (transformers keeps no MTP module)
    layer, _, rest = name.partition(".ffn.experts_")
    if rest:  # stacked [E, out, in] from layers.N.ffn.experts.E.w{1,3,2}.weight
        parts = ("w1", "w3") if rest == "w13" else ("w2",)
        per_expert = (shape[1] // len(parts), shape[2])
        return [(f"{prefix}{layer}.ffn.experts.{e}.{p}.weight", per_expert) for e in range(shape[0]) for p in parts]
    return [(prefix + name, tuple(shape))]
