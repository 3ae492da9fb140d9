"""DeepSeek-V3's group and expert selection written without topk picks what topk picks."""

import torch

from deepinfer.models.deepseek_v3 import largest_ids, largest_mask, top_two_sum


def test_top_two_sum_equals_topk_sum_with_repeated_maxima():
    torch.manual_seed(0)
    x = torch.randint(0, 4, (64, 8, 8)).float()  # few distinct values: groups with a repeated maximum
    assert (x == x.amax(-1, keepdim=True)).sum(-1).max() > 1
    torch.testing.assert_close(top_two_sum(x), x.topk(2, dim=-1)[0].sum(-1), rtol=0, atol=0)


def test_largest_mask_selects_the_topk_set():
    torch.manual_seed(0)
    x = torch.randn(256, 8)
    for k in (1, 4, 8):
        expected = torch.zeros_like(x, dtype=torch.bool).scatter(1, x.topk(k, dim=-1)[1], True)
        assert torch.equal(largest_mask(x, k), expected)


def test_largest_mask_breaks_ties_to_the_lower_index():
    x = torch.tensor([[1.0, 3.0, 3.0, 3.0, 0.0]])
    assert largest_mask(x, 2).tolist() == [[False, True, True, False, False]]


def test_largest_ids_are_topks_largest_first_with_masked_entries():
    torch.manual_seed(0)
    x = torch.randn(256, 16).masked_fill(torch.rand(256, 16) < 0.5, float("-inf"))
    x[:, :8] = torch.randn(256, 8)  # (at least k entries above -inf in every row)
    for k in (1, 2, 8):
        assert torch.equal(largest_ids(x, k), x.topk(k, dim=-1)[1])


def test_largest_ids_break_ties_to_the_lower_index():
    x = torch.tensor([[1.0, 3.0, 3.0, 3.0, 0.0]])
    assert largest_ids(x, 3).tolist() == [[1, 2, 3]]
