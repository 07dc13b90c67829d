"""The host term's launch count (planner/host_time.py) against the bloom-560m profile on one H200
(bench/results/2026-11-26-h200-bloom-560m-mb2-trainer.json), and where the term applies."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from appliance.hardware import load_hardware
from appliance.planner import host_time, load_model_shape, parse_layout
from appliance.planner.device import make_device
from appliance.planner.kernel_path import kernels_for
from appliance.planner.memory import stage_parameters
from appliance.planner.timing import step_time

PROFILE = Path(__file__).resolve().parents[2] / "bench" / "results" / "2026-11-26-h200-bloom-560m-mb2-trainer.json"
# Launches the profiled step issued that the code issues no more (flat_optimizer.py): AccumulateGrad's in-place add
# per parameter (879 evaluate_function calls over 3 steps), and the old fold's zero of the flat gradients.
REMOVED_ADDS, REMOVED_ZERO = 293, 1


def _launches(mb: int, **layout_keys: str) -> int:
    hardware, model = load_hardware("h200-x1"), load_model_shape("bloom-560m")
    keys = {"tp": "1", "pp": "1", "dp": "1", "mbs": str(mb), "gbs": str(mb), "recompute": "none", "zero": "0"}
    layout = parse_layout(",".join(f"{k}={v}" for k, v in (keys | layout_keys).items()))
    device = make_device(hardware, 1, "bf16")
    return host_time.launches_per_step(
        model, layout, device, kernels_for(device, model), layers=model.layers,
        params=stage_parameters(model, layout, 0), last_stage=True, tokens=mb * 2048,
    )  # fmt: skip


def test_launch_count_is_the_profiles_less_what_was_removed() -> None:
    """1,381 launches a step were profiled at micro-batch 2; the code now issues 1,381 - 293 - 1 + the fold's
    multi-tensor copy (27 launches for 559M gradients) + 1 cast in place of the old cast."""
    profile = json.loads(PROFILE.read_text())["contenders"]["trainer (the run's engine)"]["profile"]
    fold_now = host_time.multi_tensor_launches(load_model_shape("bloom-560m").parameters()) + 1
    old_fold = REMOVED_ZERO + 1  # the old fold: one cast and one zero
    expected = profile["launches_per_step"] - REMOVED_ADDS - old_fold + fold_now
    assert _launches(2) == expected == 1114


def test_adamw_launches_match_the_profile() -> None:
    """The fused AdamW kernel ran 84 times over the profile's 3 steps: 27 launches for the decayed matrices and 1
    for the biases and LayerNorm weights, 65,536-element chunks, 320 a launch."""
    profile = json.loads(PROFILE.read_text())["contenders"]["trainer (the run's engine)"]["profile"]
    adam = next(k for k in profile["top_kernels"] if "FusedAdamMathFunctor" in k["name"])
    model = load_model_shape("bloom-560m")
    no_decay = model.layers * 13 * model.hidden + 2 * model.hidden + 2 * model.hidden
    decayed = model.parameters() - no_decay
    assert host_time.multi_tensor_launches(decayed) + host_time.multi_tensor_launches(no_decay) == adam["calls"] / 3


def test_more_loss_chunks_and_micro_batches_launch_more() -> None:
    """Micro-batch 16's logits exceed 2 GiB: 8 loss chunks of 4 launches where micro-batch 2 has 1."""
    assert _launches(16) - _launches(2) == 7 * host_time.LAUNCHES_PER_LOSS_CHUNK
    two = _launches(2, gbs="4")  # two micro-batches a step: the blocks, edges, loss and fold twice
    assert two - _launches(2) == _launches(2) - host_time.STEP_LAUNCHES - 28


def test_no_host_term_on_cpu_or_off_the_compiled_path() -> None:
    """CPU ranks' host time is their compute (the fitted CPU rates); paths whose blocks stay eager were not measured."""
    model = load_model_shape("bloom-560m")
    layout = parse_layout("tp=1,pp=1,dp=1,mbs=2,gbs=2,recompute=none,zero=0")
    cpu = step_time(layout, load_model_shape("bloom-micro-test"), load_hardware("cpu-laptop-2core"))
    assert cpu.breakdown_s["host"] == 0.0
    device = make_device(load_hardware("h200-x1"), 1, "bf16")
    kernels = kernels_for(device, model)
    assert host_time.host_term_applies(model, layout, device, kernels)
    assert not host_time.host_term_applies(model, layout, device, replace(kernels, compiled_blocks=False))
    assert not host_time.host_term_applies(model, replace(layout, cp=2), device, kernels)
