"""The time model fed measured fused-op times (planner/measured_kernels.py): which terms they replace, with the
arithmetic written out, and plan.json's estimate re-priced with them at launch (train/from_spec.py reprice_plan)."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from appliance.hardware import load_hardware
from appliance.planner import calibration as cal
from appliance.planner import load_model_shape, make_plan, parse_layout
from appliance.planner.device import make_device
from appliance.planner.kernel_path import kernels_for
from appliance.planner.measured_kernels import LAYER_NORM_ELEMENTS, MeasuredKernels
from appliance.planner.reprice import reprice
from appliance.planner.runspec import load_spec
from appliance.planner.timing import block_seconds, step_time_for_device
from appliance.rundir import RunDir

HW = load_hardware("h100-sxm5-x1")
MODEL = load_model_shape("bloom-560m")
LAYOUT = parse_layout("tp=1,pp=1,dp=1,mbs=2,gbs=16,zero=1,recompute=none")
SPEC = make_plan(HW, MODEL, layout=LAYOUT).spec()
S = SPEC.train.seq_len
# One rank's fwd + bwd per micro-batch, as a `kernels` record carries them (ms); a record's other ops are ignored.
RECORD = {
    "source": "measured",
    "choices": {"flash_alibi_attention": "sdpa", "layer_norm": "compiled", "bias_gelu": "compiled",
                "vocab_cross_entropy": "triton"},
    "times_ms": {"flash_alibi_attention": {"sdpa": 3.0, "triton": 4.0}, "layer_norm": {"compiled": 0.2},
                 "bias_gelu": {"compiled": 0.5}, "vocab_cross_entropy": {"triton": 20.0}},
    "shapes": {"micro_batch_size": 2, "seq_len": S},
}  # fmt: skip
MEASURED = MeasuredKernels.from_record(RECORD)


def _device():
    return make_device(HW, HW.world_gpus, SPEC.train.dtype)


def test_the_record_gives_the_chosen_backends_seconds() -> None:
    assert (
        MeasuredKernels(
            2, S, {"flash_alibi_attention": 3e-3, "layer_norm": 2e-4, "bias_gelu": 5e-4, "vocab_cross_entropy": 2e-2}
        )
        == MEASURED
    )
    assert MeasuredKernels.from_record({"source": "default", "backend": "reference", "choices": {}}) is None


def test_measured_times_replace_the_attention_layer_norm_and_bias_gelu_terms_of_a_block() -> None:
    assert MEASURED is not None
    device = _device()
    kernels = kernels_for(device, MODEL)
    estimated = block_seconds(MODEL, LAYOUT, device, HW, S, kernels)
    priced = block_seconds(MODEL, LAYOUT, device, HW, S, kernels, MEASURED)
    # attention: forward + backward = the measured 3 ms, split as estimated (flash: backward 2.5x the forward)
    assert priced.attention + priced.attention_backward == pytest.approx(3e-3)
    assert priced.attention_backward / priced.attention == pytest.approx(2.5)
    # elementwise (a forward figure the stage counts 3x): out go the estimated 4 elements of s b h per block for the
    # LayerNorms and 2 of s b f for bias+GeLU, at act bytes each over the memory rate; in come (2 x 0.2 + 0.5) / 3 ms
    tokens, act, rate = 2 * S, device.act_bytes, device.memory_bw * device.efficiency.memory
    layer_norms = LAYER_NORM_ELEMENTS * tokens * MODEL.hidden * act / rate
    bias_gelu = cal.ELEMENTWISE_SPLIT_FFN * tokens * MODEL.ffn_hidden * act / rate
    assert priced.elementwise == pytest.approx(estimated.elementwise - layer_norms - bias_gelu + (2 * 0.2 + 0.5) / 3e3)
    assert (priced.gemm, priced.tp_allreduce) == (estimated.gemm, estimated.tp_allreduce)


def test_the_step_prices_every_block_and_the_loss_as_measured() -> None:
    device = _device()
    estimated = step_time_for_device(LAYOUT, MODEL, device, HW, S)
    priced = step_time_for_device(LAYOUT, MODEL, device, HW, S, measured=MEASURED)
    m, layers = LAYOUT.micro_batches, MODEL.layers  # pp = 1: every micro-batch runs all 24 blocks, no bubble
    assert m == 8
    assert priced.breakdown_s["attention"] == pytest.approx(m * layers * 3e-3)
    # the loss: 20 ms per micro-batch in place of the LM head's three GEMMs and the cross entropy's traffic
    head_gemms = estimated.breakdown_s["gemm"] - priced.breakdown_s["gemm"]
    assert head_gemms > 0 and priced.breakdown_s["gemm"] == pytest.approx(m * 3 * layers * block_seconds(
        MODEL, LAYOUT, device, HW, S, kernels_for(device, MODEL)).gemm)  # fmt: skip
    assert math.isclose(sum(priced.breakdown_s.values()), priced.total_s)


def test_times_measured_at_another_micro_batch_are_not_used() -> None:
    assert MEASURED is not None
    other = replace(MEASURED, micro_batch_size=4)
    device = _device()
    assert step_time_for_device(LAYOUT, MODEL, device, HW, S, measured=other) == step_time_for_device(
        LAYOUT, MODEL, device, HW, S
    )


def test_reprice_scales_every_rate_with_the_step_and_is_idempotent() -> None:
    assert MEASURED is not None
    # the device reprice builds is the plan's own: without measured times it gives the plan's step time
    assert step_time_for_device(LAYOUT, MODEL, _device(), HW, S).total_s == pytest.approx(
        SPEC.report.estimate["step_time_s"]
    )
    priced = reprice(SPEC, MEASURED)
    old, new = SPEC.report.estimate, priced.report.estimate
    step = step_time_for_device(LAYOUT, MODEL, _device(), HW, S, measured=MEASURED).total_s
    assert new["step_time_s"] == pytest.approx(step)
    for key in ("tokens_per_s", "samples_per_s", "mfu", "hfu", "tflops_per_gpu", "model_tflops_per_gpu"):
        assert new[key] == pytest.approx(old[key] * old["step_time_s"] / step)  # per-step figure / step time
    assert new["memory_gb_per_gpu"] == old["memory_gb_per_gpu"]
    assert priced.report.notes[-1].startswith("estimate priced with the fused-op times measured at launch")
    assert reprice(priced, MEASURED).report == priced.report


def test_reprice_plan_writes_only_the_estimate_and_the_budget_watch_reads_it(tmp_path: Path) -> None:
    from appliance.train.budget_watch import BudgetWatch
    from appliance.train.from_spec import reprice_plan

    run_dir = RunDir(tmp_path / "run").make()
    run_dir.plan.write_bytes(SPEC.dumps())
    before = json.loads(run_dir.plan.read_text())
    spec = reprice_plan(run_dir, load_spec(run_dir.plan), RECORD)
    after = json.loads(run_dir.plan.read_text())
    changed = {key for key in before if before[key] != after[key]}
    assert changed == {"estimate", "time_breakdown_s", "notes"}
    assert load_spec(run_dir.plan).report == spec.report == reprice(SPEC, MEASURED).report  # type: ignore[arg-type]
    assert BudgetWatch.for_spec(spec).planned_step_s == pytest.approx(spec.report.estimate["step_time_s"])
    assert spec.report.estimate["step_time_s"] != SPEC.report.estimate["step_time_s"]
    # nothing measured (CPU, forced backend), or another layout than plan.json's (an elastic re-form): unchanged
    cpu = {"source": "default", "backend": "reference", "choices": {}, "times_ms": {}}
    assert reprice_plan(run_dir, SPEC, cpu) is SPEC
    elastic = SPEC.with_layout(replace(LAYOUT, micro_batch_size=1), SPEC.report.estimate)
    assert reprice_plan(run_dir, elastic, RECORD) is elastic
