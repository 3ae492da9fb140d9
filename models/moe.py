"""The routed experts' weighted sum in static shapes, in the form the bucket's shape calls for.

N rows (tokens) each routed to k experts; this rank holds E local experts (stacked weights) and
computes the (row, expert) pairs whose expert it owns. No form branches on values in Python:

    gathered  N * k <= E          each row's k experts' weights are gathered and applied: reads
                                  only the routed experts (decode)
    exact     N >= 32             pairs sorted by expert, each expert run on exactly its rows by
                                  one grouped product (runtime/grouped_matmul.py's custom ops;
                                  int experts: their kernel by id), the results put back
                                  weighted: the routed FLOPs (prompts; the default where the
                                  backend runs the ops: `expert_overflow: exact`)
    grouped   N >= 32 and C < N   pairs grouped by expert into C rows per expert ([E, C, D]), each
                                  expert run once on its group (bmm), the results scattered back
                                  weighted: ~capacity x the routed FLOPs instead of E / k x (prompts,
                                  where the backend takes no custom ops: StableHLO, neuronx-cc)
    dense     otherwise           every local expert on every row, masked by the routing weights

The switch points are measured (bench/moe_bench.py: one MoE layer, ms by rows, eager ATen — the
BLAS calls AOTInductor makes for these einsums — weights cache-hot):
    16 experts top-4   rows 16: grouped 5.17, dense 4.57; rows 32: grouped 6.55, dense 6.44;
                       rows 64: grouped 7.36, dense 10.5; rows 512: grouped 22.3, dense 70.9
    64 experts top-4   rows 8: grouped 7.08, dense 12.3; rows 32: grouped 11.3, dense 18.0;
                       rows 512: grouped 25.2, dense 186
Grouping wins from 32 rows on both. The exact form reads the same weights as the grouped one
for half its FLOPs at capacity 2, and never takes an overflow pass: bench/moe_bench.py compares
them in bundles, runtime/grouped_matmul.py its kernels. Below 32 rows a step is a decode batch,
whose cost is reading weights from memory, not FLOPs: gathering reads one expert per (row,
expert) pair, the dense form reads each expert once, and grouping reads each once per pass (an
uneven small batch takes several), so decode batches keep gathered and dense. Gathering wins while the pairs are at most
E (bench/moe_decode_bench.py: compiled by the inductor backend, weights cold, us per layer):
    pairs / E            0.5          1.0          1.5          2.0
    8 experts top-2      863 / 1638   1587 / 2016  2250 / 2208  2952 / 2321   (gathered / dense)
    16 top-4             1595 / 3091  3107 / 3830  4475 / 4181  5836 / 4355
    64 top-4 of 256      2946 / 8288  5637 / 13510 8192 / 15296 (rows 32: grouped)
(64 small experts keep gathering ahead past E: the dense form's 9-31-row products are slow BLAS
shapes; at the power-of-two batch buckets recipes use, pairs <= E picks the faster form.)

C = ceil(capacity * N * k / n_routed_experts), `capacity` times an even share of the pairs. An
expert routed more than C pairs in a step is exact all the same: its later pairs go to further
grouped passes, places [C, 2C), [2C, 4C) and [4C, N), each run only when some expert reaches
it (`torch.cond`), so uneven routing costs a pass or two more, not the dense form. For
compilers that take no control flow (StableHLO through torch-mlir, neuronx-cc), the recipe's
`model.expert_overflow: always` runs every pass unconditionally instead: the same sums, static,
at the cost of the passes' FLOPs on every prompt chunk. The
ranks of a multi-rank bundle may run different passes in one step — no pass holds a collective
(the MoE's all-reduce comes after), so nothing can deadlock; each rank's partial sum is exact.
"""

import math

import torch
import torch.nn.functional as F

from deepinfer.runtime import grouped_matmul, int_matmul  # (registers torch.ops.deepinfer.grouped_*)

from .int_weights import IntExperts

# Places per expert in the first grouped pass, in multiples of an even share; an expert routed
# more takes further passes (bench/moe_bench.py counts them).
DEFAULT_CAPACITY = 2.0
# A prompt chunk's form: exact (no capacity, nothing overflows); grouped, its overflow passes run
# when needed (torch.cond) or always.
OVERFLOW_FORMS = ("exact", "branch", "always")
GROUPED_FROM_ROWS = 32  # (measured: see the module docstring)


def expert_capacity(rows: int, k: int, n_routed_experts: int, capacity: float) -> int:
    """C: grouped rows per expert for a step of `rows` tokens."""
    return min(rows, math.ceil(capacity * rows * k / n_routed_experts))


def routed_experts(moe, x, weights, ids, gate_up, down, activation, capacity: float = DEFAULT_CAPACITY,
                   overflow: str = "exact"):
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
    if N * k <= E:
        return gathered(x, weights, local_ids, gate_up, down, activation)
    if overflow == "exact" and N >= GROUPED_FROM_ROWS:
        return exact(x, weights, local_ids, owned, gate_up(), down(), activation)
    C = expert_capacity(N, k, moe.config.n_routed_experts, capacity)
    if N < GROUPED_FROM_ROWS or C >= N:
        return dense(x, weights, local_ids, gate_up(), down(), activation)
    expert, place = expert_places(local_ids, owned, E)
    busiest = place.max() + 1  # pairs of the busiest expert

    # A pass reads the expert weights itself (a weight passed as a torch.cond operand would alias
    # the parameter, which cond refuses), so only passes that run dequantize fp8 ones.
    def grouped_pass(start: int, size: int):
        return lambda x, weights, expert, place: grouped(x, weights, expert, place, start, size, gate_up(), down(), activation)

    def skipped(x, weights, expert, place):
        return torch.zeros_like(x)

    passes = grouped_passes(C, N)
    out = grouped_pass(*passes[0])(x, weights, expert, place)
    for start, size in passes[1:]:
        if overflow == "always":
            out = out + grouped_pass(start, size)(x, weights, expert, place)
        else:
            out = out + torch.cond(busiest > start, grouped_pass(start, size), skipped, (x, weights, expert, place))
    return out


def grouped_passes(C: int, N: int) -> list[tuple[int, int]]:
    """(first place, places) of each grouped pass: [0, C), [C, 2C), [2C, 4C), [4C, N). Four at
    most: each is a traced and compiled branch, and an expert past 4x its capacity is rare
    enough to pay for nearly all rows in the last."""
    passes, start = [], 0
    for size in (C, C, 2 * C, N):
        size = min(size, N - start)
        if size > 0:
            passes.append((start, size))
            start += size
    return passes


def gathered(x, weights, local_ids, gate_up, down, activation):
    gate, up = product("nd,nkfd->nkf", x, gate_up(local_ids)).chunk(2, dim=-1)  # [N, k, I] each
    y = product("nki,nkdi->nkd", activation(gate, up), down(local_ids))  # [N, k, D]
    return (y * weights[..., None]).sum(dim=1)


def dense(x, weights, local_ids, w_gate_up, w_down, activation):
    combine = torch.zeros(x.shape[0], w_gate_up.shape[0], dtype=x.dtype, device=x.device)
    combine = combine.scatter_add(1, local_ids, weights)  # [N, E], zero where not routed
    gate, up = product("nd,efd->nef", x, w_gate_up).chunk(2, dim=-1)  # [N, E, I]
    y = product("nei,edi->ned", activation(gate, up), w_down)  # [N, E, D]
    return torch.einsum("ned,ne->nd", y, combine)


def product(equation: str, x, w):
    """torch.einsum(equation, x, w) over x's last dim, with the experts' weights w as
    models/int_weights.py gives them: int8 and int4 experts by their kernel (int_product). A
    weight in another dtype (bf16 for a prompt chunk's GEMMs) takes x in its dtype."""
    if isinstance(w, IntExperts):
        return int_product(equation, x, w)
    return torch.einsum(equation, x.to(w.dtype), w).to(x.dtype)


def int_product(equation: str, x, w: IntExperts):
    """`product` for int8 and int4 experts, by the kernel: x [N, D] times each row's experts (w.ids
    [N, k], or all E: the dense form) -> [N, k or E, F]; or x [A, B, I] with an expert a row (the
    pairs of a decode step [N, k, I], the dense form's [N, E, I], the grouped form's [E, C, I]) ->
    [A, B, F]. A run of rows with the same expert reads its weight once: the dense form's rows go
    expert by expert. int4 experts of int_matmul.DECODED_FROM_ROWS rows or more are decoded to
    bfloat16 for GEMMs."""
    E, rows = w.codes.shape[:2]
    x_axes = equation.split(",")[0]
    many = (x.shape[0] if x.dim() == 2 else x[..., 0].numel() // E) >= int_matmul.DECODED_FROM_ROWS
    if w.ids is None and int_matmul.is_int4(w.codes) and many:
        return product(equation, x, w.values(torch.bfloat16))  # (rows enough an expert for a GEMM)
    every = torch.arange(E, device=x.device)
    if x.dim() == 2:
        ids = w.ids if w.ids is not None else every.expand(x.shape[0], E)
        return int_matmul.matmul(x, w.codes, w.scales, ids).to(x.dtype)
    ids = w.ids if w.ids is not None else every.view([E if axis == "e" else 1 for axis in x_axes[:2]]).expand(x.shape[:2])
    by_expert = w.ids is None and x_axes.index("e") == 1  # (the dense form's [N, E, I]: run each expert's rows together)
    if by_expert:
        x, ids = x.transpose(0, 1), ids.transpose(0, 1)
    out = int_matmul.matmul(x.reshape(-1, x.shape[-1]), w.codes, w.scales, ids.reshape(-1, 1))
    out = out.to(x.dtype).view(*x.shape[:2], rows)
    return out.transpose(0, 1) if by_expert else out


def exact(x, weights, local_ids, owned, w_gate_up, w_down, activation):
    """Every pair this rank computes, sorted by expert, each expert's products on exactly its rows."""
    (N, D), k, E = x.shape, local_ids.shape[1], w_gate_up.shape[0]
    expert = torch.where(owned, local_ids, E).flatten()  # [P]; E: a pair another rank computes (sorted last)
    order = torch.argsort(expert, stable=True)  # [P]: the pairs by expert
    counts = torch.zeros(E + 1, dtype=torch.int64, device=x.device).scatter_add(0, expert, torch.ones_like(expert))
    ends = counts[:E].cumsum(0).to(torch.int32)  # [E]: where each expert's rows end
    xs = x.index_select(0, order // k)  # [P, D]
    by_expert = expert.index_select(0, order)  # [P]: each sorted row's expert (for the kernel in the graph)
    gate, up = grouped_product(xs, w_gate_up, ends, by_expert, N).chunk(2, dim=-1)  # [P, I] each
    y = grouped_product(activation(gate, up), w_down, ends, by_expert, N)  # [P, D], zeros past ends[-1]
    back = torch.empty_like(order).scatter(0, order, torch.arange(order.shape[0], device=x.device))
    return (y.index_select(0, back).view(N, k, D) * weights[..., None]).sum(dim=1)


def grouped_product(x, w, ends, experts, tokens: int):
    """x [P, D] (rows sorted by expert: `experts` [P] each row's, E for none here; `ends` [E]
    where each expert's rows end; `tokens` the chunk's) times its expert's weight from w as
    models/int_weights.py gives them (see `product`) -> [P, F] in x's dtype. Experts none of which
    takes a GEMM (int8's never do; int4's from int_matmul.DECODED_FROM_ROWS rows, float ones from
    grouped_matmul.gemm_from_rows(w): more than a chunk of fewer tokens gives one, as a token picks
    an expert once) are one kernel call in the graph, not the grouped op (whose host-side setup took
    0.8 of a 32-token int4 prompt's ~17 ms, and half the trained tiny V3's float32 one, profiled)."""
    if isinstance(w, IntExperts):
        if tokens < int_matmul.DECODED_FROM_ROWS or not int_matmul.is_int4(w.codes):
            return int_matmul.matmul(x, w.codes, w.scales, experts[:, None]).squeeze(1).to(x.dtype)
        return torch.ops.deepinfer.grouped_int4_matmul(x, w.codes, w.scales, ends)
    if tokens < grouped_matmul.gemm_from_rows(w):
        return torch.ops.deepinfer.float_matmul(x.float(), w, experts[:, None]).squeeze(1).to(x.dtype)
    return torch.ops.deepinfer.grouped_matmul(x.to(w.dtype), w, ends).to(x.dtype)


def expert_places(local_ids, owned, E: int):
    """expert [N*k]: each (row, expert) pair's local expert, E for a pair this rank does not
    compute; place [N*k]: how many pairs of the same expert come before it (in row order)."""
    expert = torch.where(owned, local_ids, E).flatten()
    onehot = F.one_hot(expert, E + 1).to(torch.int32)  # [P, E + 1]
    place = (onehot.cumsum(0) * onehot).sum(-1) - 1
    return expert, torch.where(expert < E, place, -1)


def grouped(x, weights, expert, place, start: int, size: int, w_gate_up, w_down, activation):
    """The pairs with places [start, start + size): gathered into `size` rows per expert, each
    expert run on its rows, the results scattered back weighted."""
    (N, D), E = x.shape, w_gate_up.shape[0]
    k = expert.shape[0] // N
    here = (place >= start) & (place < start + size)  # (not computed: place -1)
    slot = torch.where(here, expert * size + place - start, E * size)  # E * size: a zero row
    token = torch.arange(N * k, device=x.device) // k
    rows = torch.full((E * size + 1,), N, dtype=torch.int64, device=x.device).scatter(0, slot, token)[: E * size]
    padded = torch.cat([x, x.new_zeros(1, D)])  # row N: the zero row empty places read
    xs = padded.index_select(0, rows).view(E, size, D)
    gate, up = product("ecd,efd->ecf", xs, w_gate_up).chunk(2, dim=-1)  # [E, size, I] each
    y = product("eci,edi->ecd", activation(gate, up), w_down).flatten(0, 1)  # [E*size, D]
    y = torch.cat([y, y.new_zeros(1, D)])
    return (y.index_select(0, slot).view(N, k, D) * weights[..., None]).sum(dim=1)
