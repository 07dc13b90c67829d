"""The pretraining sampler: Megatron's split of each global micro step by DP rank, resumable, DP-size independent."""

from __future__ import annotations

import pytest

from appliance.data.sampler import PretrainingSampler


def global_order(total: int, consumed: int, mbs: int, dp: int, steps: int | None = None) -> list[int]:
    """The samples all ranks consume, micro step by micro step, rank 0 first."""
    per_rank = [iter(PretrainingSampler(total, consumed, mbs, rank, dp)) for rank in range(dp)]
    order: list[int] = []
    step = 0
    while steps is None or step < steps:
        batches = [next(it, None) for it in per_rank]
        if batches[0] is None:
            assert all(b is None for b in batches)  # every rank stops at the same step
            break
        for batch in batches:
            assert batch is not None and len(batch) == mbs
            order += batch
        step += 1
    return order


def test_megatron_split_by_rank() -> None:
    rank0 = list(PretrainingSampler(20, 0, 2, 0, 2))
    rank1 = list(PretrainingSampler(20, 0, 2, 1, 2))
    assert rank0 == [[0, 1], [4, 5], [8, 9], [12, 13], [16, 17]]
    assert rank1 == [[2, 3], [6, 7], [10, 11], [14, 15], [18, 19]]
    assert len(PretrainingSampler(20, 0, 2, 0, 2)) == 5
    assert list(PretrainingSampler(10, 0, 3, 0, 1)) == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]  # last partial dropped


def test_resume_continues_the_same_sequence() -> None:
    full = global_order(1000, 0, 4, 2)
    assert full == list(range(1000))
    head = global_order(1000, 0, 4, 2, steps=7)
    tail = global_order(1000, len(head), 4, 2)
    assert head + tail == full
    assert PretrainingSampler(1000, len(head), 4, 1, 2).__iter__().__next__() == [60, 61, 62, 63]


def test_dp_size_change_keeps_the_global_sequence() -> None:
    # dp=4 (mbs 1) for 3 steps, then resumed on dp=2 (mbs 3), then on dp=3 (mbs 2).
    a = global_order(600, 0, 1, 4, steps=3)
    b = global_order(600, len(a), 3, 2, steps=5)
    c = global_order(600, len(a) + len(b), 2, 3)
    assert a + b + c == list(range(600))


def test_end_of_data_and_drop_last() -> None:
    assert list(PretrainingSampler(8, 8, 2, 0, 2)) == []  # finished run resumes to nothing
    keep = [list(PretrainingSampler(11, 0, 2, r, 2, drop_last=False)) for r in range(2)]
    assert keep[0][-1] == [8, 9] and keep[1][-1] == [10]
    assert len(PretrainingSampler(11, 0, 2, 1, 2, drop_last=False)) == 3
    assert list(PretrainingSampler(9, 0, 2, 1, 2, drop_last=False))[-1] == [6, 7]  # rank 1 gets nothing of 8


@pytest.mark.parametrize(
    "args",
    [(0, 0, 1, 0, 1), (10, 11, 1, 0, 1), (10, 0, 0, 0, 1), (10, 0, 1, 2, 2), (10, 0, 1, 0, 0), (10, -1, 1, 0, 1)],
)
def test_rejects_impossible_arguments(args: tuple[int, int, int, int, int]) -> None:
    with pytest.raises(ValueError):
        PretrainingSampler(*args)
