"""The routed experts' static forms agree: gathered, exact, grouped (one pass, or more where an
expert is routed past its capacity) and dense give one result, on one rank and summed over ranks that each
own part of the experts. Compiled bundles whose prompt chunks take every extra pass
(expert_capacity 0.25): test_context_buckets (world size 1) and test_multirank (world size 2);
every other compiled bundle's prompts take the exact form."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from deepinfer.models import TINY_CONFIG, build_model
from deepinfer.models.moe import dense, expert_places, grouped_passes, routed_experts
from deepinfer.models.parallel import Layout, moe_buffers
from deepinfer.models.deepseek_v3 import swiglu
from deepinfer.models.quantization import expert_weights
from deepinfer.runtime.grouped_matmul import gemm_from_rows
from deepinfer.runtime.int_matmul import DECODED_FROM_ROWS

CONFIG = {**TINY_CONFIG, "n_routed_experts": 16, "n_group": 4, "topk_group": 4, "num_experts_per_tok": 4}


@pytest.fixture(scope="module")
def moe():
    return build_model(config=CONFIG, seed=1).layers[1].mlp


def forms(moe, x, capacity: float, rank_of: tuple[int, int] | None = None,
          overflow: str = "branch") -> tuple[torch.Tensor, torch.Tensor]:
    """(routed_experts in form `overflow` at `capacity`, the dense form) for rows x, on the rank `rank_of` = (rank,
    world_size) owns (all experts when None)."""
    if rank_of is not None:
        for name, value in moe_buffers(Layout(rank_of[1], 1, 1), moe.config, rank_of[0]).items():
            setattr(moe, name, value)
    weights, ids = moe.gate(x)
    gate_up = expert_weights(moe, "experts_gate_up", x.dtype, None)
    down = expert_weights(moe, "experts_down", x.dtype, None)
    ours = routed_experts(moe, x, weights, ids, gate_up, down, swiglu, capacity, overflow)
    owned = (ids >= moe.owned_begin) & (ids < moe.owned_end)
    reference = dense(x, torch.where(owned, weights, 0.0), ids, gate_up(), down(), swiglu)
    return ours, reference


FORMS = [("branch", 0.5), ("branch", 2.0), ("exact", 2.0)]  # (expert_overflow, expert_capacity)


@pytest.mark.parametrize("rows", [1, 3, 4, 16, 32, 64])
@pytest.mark.parametrize("overflow, capacity", FORMS)
def test_every_form_gives_the_dense_result(moe, rows, overflow, capacity):
    x = torch.randn(rows, CONFIG["hidden_size"], generator=torch.Generator().manual_seed(rows))
    with torch.no_grad():
        ours, reference = forms(moe, x, capacity, overflow=overflow)
    torch.testing.assert_close(ours, reference, atol=1e-5, rtol=1e-5)


def test_places_count_each_experts_earlier_pairs():
    ids = torch.tensor([[0, 2], [2, 1], [2, 0], [3, 1]])
    owned = ids != 3  # expert 3 is computed elsewhere
    expert, place = expert_places(ids, owned, 4)
    assert expert.tolist() == [0, 2, 2, 1, 2, 0, 4, 1]
    assert place.tolist() == [0, 0, 1, 0, 2, 1, -1, 1]


def test_passes_cover_every_place_once():
    assert grouped_passes(3, 16) == [(0, 3), (3, 3), (6, 6), (12, 4)]
    assert grouped_passes(2, 64) == [(0, 2), (2, 2), (4, 4), (8, 56)]
    assert grouped_passes(40, 64) == [(0, 40), (40, 24)]
    for C, N in [(1, 1), (1, 16), (5, 64), (7, 512)]:
        places = [p for start, size in grouped_passes(C, N) for p in range(start, start + size)]
        assert places == list(range(N))


@pytest.mark.parametrize("overflow, capacity", FORMS)
def test_ranks_owning_part_of_the_experts_sum_to_one_rank(moe, overflow, capacity):
    """Each rank groups only the pairs of the experts it owns (running its own number of passes: no
    collective inside any), and the partial sums add up to one rank's result."""
    x = torch.randn(64, CONFIG["hidden_size"], generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        whole, _ = forms(moe, x, capacity, (0, 1), overflow)
        parts = [forms(moe, x, capacity, (rank, 4), overflow)[0] for rank in range(4)]
        forms(moe, x, capacity, (0, 1))  # (restore the one-rank buffers for the other tests)
    torch.testing.assert_close(sum(parts), whole, atol=1e-5, rtol=1e-5)


class OpCalls(TorchDispatchMode):
    """The names of the ops run under it."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.name())
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("rows", [32, 64])
def test_a_short_chunks_float_experts_are_one_kernel_call(moe, rows):
    """A chunk of fewer tokens than gemm_from_rows(w) gives no expert rows enough for a GEMM (a
    token picks an expert once): its experts are the few-row kernel's call in the graph, without the
    grouped op's host-side setup; a longer chunk's take the grouped op. Both the dense result."""
    x = torch.randn(rows, CONFIG["hidden_size"], generator=torch.Generator().manual_seed(rows))
    with torch.no_grad(), OpCalls() as calls:
        ours, reference = forms(moe, x, 2.0, overflow="exact")
    gate_up = expert_weights(moe, "experts_gate_up", x.dtype, None)()
    short = rows < gemm_from_rows(gate_up)
    assert calls.names.count("deepinfer::float_matmul") == (2 if short else 0), calls.names
    assert calls.names.count("deepinfer::grouped_matmul") == (0 if short else 2), calls.names
    torch.testing.assert_close(ours, reference, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("quantize", ["int8", "int4"])
@pytest.mark.parametrize("rows", [32, 64])
def test_int_experts_in_the_exact_form_give_the_dense_result(quantize, rows):
    """Int experts' exact form: one kernel call by id (int8 always; int4 in a chunk of fewer than
    DECODED_FROM_ROWS tokens), else the grouped op; the dense form runs each expert on every row
    (int4 from DECODED_FROM_ROWS rows as a bf16 GEMM: its activations are not rounded to 8 bits)."""
    model = build_model(config=CONFIG, seed=1, quantize=quantize)
    moe = model.layers[1].mlp
    x = torch.randn(rows, CONFIG["hidden_size"], generator=torch.Generator().manual_seed(rows))
    with torch.no_grad():
        weights, ids = moe.gate(x)
        gate_up, down = (expert_weights(moe, name, x.dtype, moe.config.quantization) for name in ("experts_gate_up", "experts_down"))
        ours = routed_experts(moe, x, weights, ids, gate_up, down, swiglu, overflow="exact")
        reference = dense(x, weights, ids, gate_up(), down(), swiglu)
    if quantize == "int4" and rows >= DECODED_FROM_ROWS:
        assert (ours - reference).norm() < 0.02 * reference.norm()
    else:
        torch.testing.assert_close(ours, reference, atol=1e-5, rtol=1e-5)
