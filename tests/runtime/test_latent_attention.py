"""deepinfer::latent_attention (runtime/latent_attention.py): the kernel built here computes its
torch reference's attention, reading each sequence's rows where they lie in the cache, whatever
split of the rows between threads; its AVX2 and plain C++ builds are test_int_matmul's CHECK."""

import pytest
import torch

from deepinfer.runtime import latent_attention

# (B sequences, M query rows each, C, values, S slots, L rows a slot, T mask rows, each's last row
# seen): a decode step's heads (B = T), a batch of sequences, a prompt chunk's rows of one
# sequence (a mask row a chunk row's heads), mask rows serving queries of two sequences, widths
# of 8 but not 16 (AVX-512's masked tails), and a query that sees no row of a block.
CASES = [(1, 8, 288, 256, 2, 640, 1, [520]), (4, 4, 80, 64, 4, 512, 4, [3, 100, 511, 0]), (1, 32, 40, 32, 1, 64, 8, list(range(10, 18))),
         (2, 3, 32, 16, 3, 50, 3, [5, 20, 49]), (1, 5, 72, 24, 3, 100, 1, [99])]


@pytest.fixture(autouse=True)
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def case(B, M, C, values, S, L, T, last_seen, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    queries, cache = torch.randn(B, M, C, generator=generator).to(dtype), torch.randn(S, L, C, generator=generator).to(dtype)
    slots = torch.randperm(S, generator=generator)[:B]
    visible = torch.arange(L)[None, :] <= torch.tensor(last_seen)[:, None]
    return queries, cache, slots, visible, 0.1, values


@pytest.mark.parametrize("shape", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_computes_the_references_attention(shape, dtype):
    args = case(*shape, dtype=dtype)
    got = torch.ops.deepinfer.latent_attention(*args)
    assert got.dtype == dtype and got.shape == (*args[0].shape[:2], args[-1])
    if dtype == torch.float32:
        torch.testing.assert_close(got, latent_attention.reference(*args), atol=2e-6, rtol=1e-5)
    else:  # (the kernel computes in float32 and rounds once; the reference rounds scores and probabilities)
        exact = latent_attention.reference(*(a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args))
        torch.testing.assert_close(got.float(), exact, atol=8e-3, rtol=8e-3)
        torch.testing.assert_close(got.float(), latent_attention.reference(*args).float(), atol=3e-2, rtol=3e-2)


def test_the_rows_are_read_where_they_lie_in_a_context_buckets_view():
    """A context bucket's cache: the first L positions of each slot, the slots further apart."""
    queries, pool, slots, _, scale, values = case(*CASES[1])
    bucket = pool[:, :128]
    visible = torch.arange(128)[None, :] <= torch.tensor([3, 100, 127, 0])[:, None]
    assert not bucket.is_contiguous()
    torch.testing.assert_close(torch.ops.deepinfer.latent_attention(queries, bucket, slots, visible, scale, values),
                               latent_attention.reference(queries, bucket.contiguous(), slots, visible, scale, values), atol=2e-6, rtol=1e-5)


def test_every_input_is_read_through_its_strides():
    """What AOTInductor may pass under the op's needs_fixed_stride_order: views of wider buffers."""
    queries, cache, slots, visible, scale, values = case(*CASES[1])
    B, M, C = queries.shape
    wide_queries = torch.randn(M, B, C + 8)[:, :, :C].transpose(0, 1)  # [B, M, C], rows C + 8 apart, sequences further
    wide_queries.copy_(queries)
    wide_cache = torch.randn(*cache.shape[:2], C + 16)[:, :, :C]  # rows C + 16 apart
    wide_cache.copy_(cache)
    wide_visible = torch.cat([visible, ~visible], dim=1)[:, : visible.shape[1]]  # rows 2L apart
    wide_slots = torch.stack([slots, slots], dim=1)[:, 0]  # 2 apart
    assert not any(t.is_contiguous() for t in (wide_queries, wide_cache, wide_visible, wide_slots))
    torch.testing.assert_close(torch.ops.deepinfer.latent_attention(wide_queries, wide_cache, wide_slots, wide_visible, scale, values),
                               latent_attention.reference(queries, cache, slots, visible, scale, values), atol=2e-6, rtol=1e-5)
    with pytest.raises(RuntimeError, match="each row's elements adjacent"):
        torch.ops.deepinfer.latent_attention(queries, torch.randn(*cache.shape[:2], 2 * C)[:, :, ::2], slots, visible, scale, values)


def test_one_thread_computes_what_two_do():
    args = case(*CASES[0])
    two = torch.ops.deepinfer.latent_attention(*args)
    torch.set_num_threads(1)
    torch.testing.assert_close(torch.ops.deepinfer.latent_attention(*args), two, atol=1e-6, rtol=1e-6)


def test_a_slot_outside_the_cache_is_refused():
    queries, cache, slots, visible, scale, values = case(*CASES[0])
    with pytest.raises(RuntimeError, match="slot 2 outside the cache's 2"):
        torch.ops.deepinfer.latent_attention(queries, cache, torch.tensor([2]), visible, scale, values)
