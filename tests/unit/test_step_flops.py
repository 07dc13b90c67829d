"""The step events' FLOPs use the bench's convention: causal attention counted as computed (6 L s h per token)."""

from __future__ import annotations

import pytest

from appliance.hardware import load_hardware
from appliance.planner import load_model_shape, make_plan
from appliance.train.metrics import step_flops


def test_step_flops_count_causal_attention_once_halved() -> None:
    spec = make_plan(load_hardware("cpu-laptop-2core"), load_model_shape("bloom-micro-test")).spec()
    L, h, s, f, V = 2, 64, 32, 256, 512
    n = L * (4 * h * h + 2 * h * f) + V * h  # weights in matrix multiplies, the tied LM head once
    tokens = spec.train.global_batch_size * s
    flops = step_flops(spec)
    # 12 L s h would count the full s x s square; a causal kernel computes half of it
    assert flops.model == pytest.approx((6 * n + 6 * L * s * h) * tokens, rel=1e-12)
    # recomputed forward work: the blocks' matmuls and the causal attention again (full), the attention (selective)
    extra = {"none": 0, "selective": 2 * L * s * h, "full": 2 * L * (4 * h * h + 2 * h * f) + 2 * L * s * h}
    assert flops.hardware == pytest.approx(flops.model + extra[spec.layout.recompute] * tokens, rel=1e-12)
