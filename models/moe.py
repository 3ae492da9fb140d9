"""The routed experts' weighted sum in static shapes, in the form the bucket's shape calls for.

N rows (tokens) each routed to k experts; this rank holds E local experts (stacked weights) and
computes the (row, expert) pairs whose expert it owns. No form branches on values in Python:

    gathered  N * k < E           each row's k experts' weights are gathered and applied: reads
                                  only the routed experts (decode)
    grouped   C < N               pairs grouped by expert into C rows per expert ([E, C, D]), each
                                  expert run once on its group (bmm), the results scattered back
                                  weighted: ~capacity x the routed FLOPs instead of E / k x (prompts)
    dense     otherwise           every local expert on every row, masked by the routing weights

C = ceil(capacity * N * k / n_routed_experts), `capacity` times an even share of the pairs. A step
where some expert is routed more than C pairs is exact all the same: `torch.cond` runs the dense
form for that layer instead (the grouped rows are never partly dropped). The ranks of a
multi-rank bundle may take different branches in one step — neither branch holds a collective
(the MoE's all-reduce comes after both), so nothing can deadlock; each rank's partial sum is exact.
"""

import math

import torch
import torch.nn.functional as F

# Pairs an expert may take in a grouped step, in multiples of an even share. Random routing over
# 8-64 experts overflows 2x in well under 1% of layers at prompt sizes; a real checkpoint's
# routing is less even (watch the dense fallback's cost in bench/moe_bench.py and raise it).
DEFAULT_CAPACITY = 2.0


def expert_capacity(rows: int, k: int, n_routed_experts: int, capacity: float) -> int:
    """C: grouped rows per expert for a step of `rows` tokens."""
    return min(rows, math.ceil(capacity * rows * k / n_routed_experts))


def routed_experts(moe, x, weights, ids, gate_up, down, activation, capacity: float = DEFAULT_CAPACITY):
    """The routed experts' sum [N, D] for x [N, D], routing weights and global expert ids [N, k];
    stacked weights gate_up [E_local, 2I, D] (gate rows, then up rows) and down [E_local, D, I],
    given as pick(ids) functions (models/quantization.expert_weights).
    The rank's `moe` buffers say which experts it holds (expert_offset) and computes
    ([owned_begin, owned_end)); a routed expert owned elsewhere contributes zero here."""
    E = moe.n_local_experts
    N, k = ids.shape
    owned = (ids >= moe.owned_begin) & (ids < moe.owned_end)
    weights = torch.where(owned, weights, 0.0).to(x.dtype)
    local_ids = (ids - moe.expert_offset).clamp(0, E - 1)
    if N * k < E:
        return gathered(x, weights, local_ids, gate_up, down, activation)
    C = expert_capacity(N, k, moe.config.n_routed_experts, capacity)
    if C >= N:
        return dense(x, weights, local_ids, gate_up(), down(), activation)
    slot, rows, overflow = group_by_expert(local_ids, owned, E, C)

    # The branches read the expert weights themselves (a weight passed as an operand would alias
    # the parameter, which torch.cond refuses), so only the branch taken dequantizes fp8 ones.
    def grouped_branch(x, weights, local_ids, slot, rows):
        return grouped(x, weights, slot, rows, gate_up(), down(), activation)

    def dense_branch(x, weights, local_ids, slot, rows):
        return dense(x, weights, local_ids, gate_up(), down(), activation)

    return torch.cond(overflow, dense_branch, grouped_branch, (x, weights, local_ids, slot, rows))


def gathered(x, weights, local_ids, gate_up, down, activation):
    gate, up = torch.einsum("nd,nkfd->nkf", x, gate_up(local_ids)).chunk(2, dim=-1)  # [N, k, I] each
    y = torch.einsum("nki,nkdi->nkd", activation(gate, up), down(local_ids))  # [N, k, D]
    return (y * weights[..., None]).sum(dim=1)


def dense(x, weights, local_ids, w_gate_up, w_down, activation):
    combine = torch.zeros(x.shape[0], w_gate_up.shape[0], dtype=x.dtype, device=x.device)
    combine = combine.scatter_add(1, local_ids, weights)  # [N, E], zero where not routed
    gate, up = torch.einsum("nd,efd->nef", x, w_gate_up).chunk(2, dim=-1)  # [N, E, I]
    y = torch.einsum("nei,edi->ned", activation(gate, up), w_down)  # [N, E, D]
    return torch.einsum("ned,ne->nd", y, combine)


def group_by_expert(local_ids, owned, E: int, C: int):
    """Where each (row, expert) pair goes among E groups of C rows.

    -> slot [N*k]: the pair's grouped row, expert * C + its place among that expert's pairs (in row
    order), or E * C (a zero row) for a pair this rank does not compute or that found no room;
    rows [E*C]: the token each grouped row holds (N: none, a zero row); overflow []: some owned
    pair found no room."""
    N, k = local_ids.shape
    expert = torch.where(owned, local_ids, E).flatten()  # [P]; E: not computed here
    onehot = F.one_hot(expert, E + 1).to(torch.int32)  # [P, E + 1]
    place = (onehot.cumsum(0) * onehot).sum(-1) - 1  # [P]: earlier pairs of the same expert
    computed = expert < E
    fits = computed & (place < C)
    slot = torch.where(fits, expert * C + place, E * C)
    token = torch.arange(N * k, device=local_ids.device) // k
    rows = torch.full((E * C + 1,), N, dtype=torch.int64, device=local_ids.device).scatter(0, slot, token)
    return slot, rows[: E * C], (computed & ~fits).any()


def grouped(x, weights, slot, rows, w_gate_up, w_down, activation):
    (N, D), E = x.shape, w_gate_up.shape[0]
    padded = torch.cat([x, x.new_zeros(1, D)])  # row N: the zero row empty group places read
    xs = padded.index_select(0, rows).view(E, -1, D)  # [E, C, D]
    gate, up = torch.einsum("ecd,efd->ecf", xs, w_gate_up).chunk(2, dim=-1)  # [E, C, I] each
    y = torch.einsum("eci,edi->ecd", activation(gate, up), w_down).flatten(0, 1)  # [E*C, D]
    y = torch.cat([y, y.new_zeros(1, D)])  # row E*C: what pairs without a place read
    return (y.index_select(0, slot).view(N, -1, D) * weights[..., None]).sum(dim=1)
