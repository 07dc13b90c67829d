import math

import pytest

from appliance.train.schedule import BatchRampup, LRSchedule


def test_warmup_is_linear_then_cosine_reaches_min_lr():
    s = LRSchedule(lr=1e-3, min_lr=1e-4, warmup_samples=100, decay_samples=1100)
    assert s.at(0) == 0.0
    assert s.at(50) == pytest.approx(5e-4)
    assert s.at(100) == pytest.approx(1e-3)
    # halfway through the decay the cosine is at its midpoint
    assert s.at(600) == pytest.approx(1e-4 + 0.5 * (1e-3 - 1e-4))
    assert s.at(1100) == pytest.approx(1e-4)
    assert s.at(10**9) == pytest.approx(1e-4)


def test_schedule_depends_on_samples_not_on_layout():
    """The same sample count gives the same lr whatever batch split produced it (a layout change keeps it)."""
    s = LRSchedule(lr=6e-5, min_lr=6e-6, warmup_samples=183_105, decay_samples=200_000_000)
    by_big_steps = [s.at(k * 2048) for k in range(1, 50)]
    by_small_steps = [s.at(k * 512) for k in range(4, 200, 4)]
    assert by_big_steps == by_small_steps


def test_bloom_176b_rampup_16_to_2048_over_20m_samples():
    r = BatchRampup(start=16, increment=16, samples=20_000_000, final=2048)
    assert r.global_batch_at(0) == 16
    per_increment = 20_000_000 / 127  # (2048 - 16) / 16 = 127 increments
    assert r.global_batch_at(math.ceil(per_increment)) == 32
    assert r.global_batch_at(19_999_999) == 2032
    assert r.global_batch_at(20_000_000) == 2048


def test_bad_schedules_name_the_values():
    with pytest.raises(ValueError, match="min_lr"):
        LRSchedule(lr=1e-4, min_lr=1e-3, warmup_samples=0, decay_samples=10)
    with pytest.raises(ValueError, match="increment"):
        BatchRampup(start=16, increment=10, samples=100, final=2048)
