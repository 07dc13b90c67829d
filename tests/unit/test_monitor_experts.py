"""The reducer's MoE part: step events' moe_aux_loss, expert_load and expert_tier into RunState.experts."""

from __future__ import annotations

from typing import Any

import pytest

from appliance.monitor.events import make_event
from appliance.monitor.state import RunState, reduce

TIER = {"hits": 30, "fetches": 10, "evictions": 12, "bytes_in": 10 * 8832, "bytes_out": 12 * 8832}


def step(n: int, **extra: Any) -> dict[str, Any]:
    fields = dict(step=n, loss=3.0, lr=1e-4, grad_norm=1.0, tokens_per_s=1.0, tflops_per_gpu=1.0, mfu=0.1)
    return make_event("step", t=1000.0 + n, consumed_samples=8 * n, **fields, **extra)


def test_dense_steps_leave_the_experts_panel_off() -> None:
    state = RunState()
    reduce(state, step(1))
    assert state.experts is None


def test_moe_fields_fold_into_experts() -> None:
    state = RunState()
    state.take_changed()
    reduce(state, step(1, moe_aux_loss=1.5, expert_load=[[0.25] * 4, [0.7, 0.1, 0.1, 0.1]], expert_tier=TIER))
    assert "experts" in state.take_changed()
    experts = state.experts
    assert experts is not None and experts.step == 1 and experts.aux_loss == 1.5
    # max/mean: a balanced layer is 1.0; one expert with 70% of 4 experts' tokens is 0.7 / 0.25 = 2.8
    assert experts.imbalance() == [pytest.approx(1.0), pytest.approx(2.8)]
    assert experts.hit_rate == pytest.approx(30 / 40)  # hits / (hits + fetches)
    # A later event without the tier field keeps the counters; a new load replaces the old one
    reduce(state, step(2, moe_aux_loss=1.2, expert_load=[[0.5, 0.5, 0.0, 0.0]]))
    assert experts.tier == TIER and experts.imbalance() == [pytest.approx(2.0)] and experts.aux_series.count == 2


def test_malformed_moe_fields_do_not_stop_the_reader() -> None:
    state = RunState()
    reduce(state, step(1, moe_aux_loss="nan?", expert_load=[[], "x", [0.0, 0.0]], expert_tier=[1, 2]))
    assert state.experts is not None and state.experts.aux_loss is None
    assert state.experts.imbalance() == [None, None] and state.experts.hit_rate is None
