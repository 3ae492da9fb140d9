"""The inductor backend reads one sequence's cache rows where they lie (one_row_views.py): a gather
of one slot becomes a view at the slot read at run time, with the gather's results and checks."""

import pytest
import torch

from deepinfer.compiler.backends import one_row_views


class CacheRead(torch.nn.Module):
    """An attention's cache traffic: store this step's row, read the sequences' rows, a product."""

    def forward(self, kv, write_slots, positions, new, read_slots, q):
        kv.index_put_((write_slots, positions), new)
        rows = kv.index_select(0, read_slots)  # [B, L, C]
        return q @ rows.mT  # [B, H, L]


def exported(read_slots, store=CacheRead, kv=None):
    kv = torch.randn(3, 16, 8) if kv is None else kv
    args = (kv, torch.tensor([1]), torch.tensor([5]), torch.randn(1, 8), read_slots, torch.randn(len(read_slots), 4, 8))
    return torch.export.export(store(), args)


def targets(program):
    return [node.target for node in program.graph.nodes if node.op == "call_function"]


def test_one_slot_is_read_as_a_view_at_the_slot_given_at_run_time():
    program = one_row_views.apply(exported(torch.tensor([1])))
    assert torch.ops.aten.index_select.default not in targets(program)
    assert torch.ops.aten.select.int in targets(program)
    for slot in (0, 2):
        kv, new, q = torch.randn(3, 16, 8), torch.randn(1, 8), torch.randn(1, 4, 8)
        expected_kv = kv.clone()
        expected = CacheRead()(expected_kv, torch.tensor([slot]), torch.tensor([5]), new, torch.tensor([slot]), q)
        got = program.module()(kv, torch.tensor([slot]), torch.tensor([5]), new, torch.tensor([slot]), q)
        torch.testing.assert_close(got, expected)
        torch.testing.assert_close(kv, expected_kv)  # (the store, still in place)
    with pytest.raises(RuntimeError):  # a slot past the cache, refused as the gather refused it
        program.module()(torch.randn(3, 16, 8), torch.tensor([1]), torch.tensor([5]), torch.randn(1, 8), torch.tensor([3]),
                         torch.randn(1, 4, 8))


def test_several_slots_stay_a_gather():
    program = one_row_views.apply(exported(torch.tensor([0, 2])))
    assert torch.ops.aten.index_select.default in targets(program)


class CopyRead(torch.nn.Module):
    """CacheRead storing with index_copy_ (another model's way)."""

    def forward(self, kv, write_slots, positions, new, read_slots, q):
        kv.index_copy_(0, write_slots, new[None].expand(1, kv.shape[1], -1))
        return q @ kv.index_select(0, read_slots).mT


@pytest.mark.parametrize("store", [CacheRead, CopyRead])
def test_a_context_buckets_view_of_the_cache_stays_a_gather(store):
    """(inductor would copy the whole cache in and out around a view of it at a run-time offset)"""
    with_gaps = exported(torch.tensor([1]), store, kv=torch.randn(3, 64, 8).narrow(1, 0, 16))
    assert torch.ops.aten.index_select.default in targets(one_row_views.apply(with_gaps))
    whole = exported(torch.tensor([1]), store)  # (the same store into a whole cache: a view)
    assert torch.ops.aten.index_select.default not in targets(one_row_views.apply(whole))
