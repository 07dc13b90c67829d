"""ALiBi slopes and bias against transformers' build_alibi_tensor."""

from __future__ import annotations

import pytest
import torch
from transformers.models.bloom.modeling_bloom import build_alibi_tensor

from appliance.model.alibi import alibi_bias, alibi_slopes, alibi_slopes_for_rank, key_positions


def transformers_slopes(n_head: int) -> torch.Tensor:
    # With a one-token mask, position 1 carries exactly the slope: bias[h] = slope[h] * 1.
    return build_alibi_tensor(torch.ones(1, 2, dtype=torch.int64), n_head, torch.float32)[:, 0, 1]


@pytest.mark.parametrize("n_head", range(1, 41))
def test_slopes_equal_transformers(n_head):
    assert torch.equal(alibi_slopes(n_head), transformers_slopes(n_head))


def test_slopes_follow_the_paper_for_powers_of_two():
    # 8 heads: 1/2, 1/4, ..., 1/256 (Press et al.); 12 heads add the odd powers of 2^-0.5 between them.
    assert torch.equal(alibi_slopes(8), torch.tensor([2.0**-i for i in range(1, 9)]))
    extra = alibi_slopes(12)[8:]
    assert torch.allclose(extra, torch.tensor([2.0 ** (-i / 2) for i in (1, 3, 5, 7)]))


def test_bias_equals_transformers_with_left_and_right_padding():
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0], [0, 0, 0, 1, 1, 1]])
    n_head = 12
    expected = build_alibi_tensor(mask, n_head, torch.float32).view(3, n_head, 1, 6)
    got = alibi_bias(alibi_slopes(n_head), mask)
    assert got.shape == (3, n_head, 1, 6) and got.dtype == torch.float32
    assert torch.equal(got, expected)
    assert key_positions(mask)[2].tolist() == [0, 0, 0, 0, 1, 2]


def test_bias_without_mask_counts_every_key():
    got = alibi_bias(alibi_slopes(4), None, key_length=5)
    expected = build_alibi_tensor(torch.ones(1, 5, dtype=torch.int64), 4, torch.float32).view(1, 4, 1, 5)
    assert torch.equal(got, expected)
    with pytest.raises(ValueError, match="key_length"):
        alibi_bias(alibi_slopes(4), None)


def test_rank_slices_cover_all_heads_in_order():
    full = alibi_slopes(12)
    parts = [alibi_slopes_for_rank(12, rank, 4) for rank in range(4)]
    assert all(part.shape == (3,) for part in parts)
    assert torch.equal(torch.cat(parts), full)
    assert torch.equal(alibi_slopes_for_rank(12, 0, 1), full)


@pytest.mark.parametrize(
    ("args", "message"),
    [((12, 0, 5), r"n_head\(12\) % tp_size\(5\)"), ((12, 4, 4), r"tp_rank\(4\)"), ((12, 0, 0), "tp_size")],
)
def test_rank_slices_reject_bad_layouts(args, message):
    with pytest.raises(ValueError, match=message):
        alibi_slopes_for_rank(*args)


def test_slopes_reject_non_positive_head_count():
    with pytest.raises(ValueError, match="n_head"):
        alibi_slopes(0)
