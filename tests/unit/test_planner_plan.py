"""make_plan end to end: the CPU smoke plan, the model ladder, given layouts, plan.json and the text form."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from appliance.errors import BadInput
from appliance.hardware import Hardware, load_hardware
from appliance.planner import RunSpec, format_plan, load_model_shape, make_plan, parse_layout

TRAIN_KEYS = {
    "seq_len",
    "global_batch_size",
    "micro_batch_size",
    "train_samples",
    "lr",
    "min_lr",
    "warmup_samples",
    "decay_samples",
    "rampup",
    "weight_decay",
    "grad_clip",
    "adam_beta1",
    "adam_beta2",
    "adam_eps",
    "eval_interval",
    "eval_samples",
    "save_interval",
    "dtype",
    "seed",
}


def cpu_box(cores: int) -> Hardware:
    return replace(load_hardware("cpu-laptop-2core"), cpu_cores=cores)


def test_cpu_smoke_plan() -> None:
    plan = make_plan(load_hardware("cpu-laptop-2core"))
    lay, train = plan.layout, plan.train
    assert plan.model.name == "bloom-tiny-cpu" and plan.feasible
    assert (lay.tp, lay.pp, lay.dp, lay.zero_stage, lay.recompute) == (1, 1, 2, 0, "none")
    assert set(plan.to_json()["train"]) >= TRAIN_KEYS
    assert (train.dtype, train.global_batch_size, train.seq_len) == ("fp32", 16, 128)
    assert train.train_samples // train.global_batch_size == 200
    assert train.warmup_samples == train.train_samples // 10 and train.lr == 4e-3
    assert train.rampup is None
    assert 20 < plan.run.time_s < 180  # about a minute on 2 cores


@pytest.mark.parametrize(("cores", "dp"), [(1, 1), (2, 2), (16, 2)])
def test_cpu_ranks_follow_cores(cores: int, dp: int) -> None:
    assert make_plan(cpu_box(cores)).layout.dp == dp


@pytest.mark.parametrize(
    ("hw_name", "allowed"),
    [
        ("cpu-laptop-2core", {"bloom-tiny-cpu"}),
        ("a100-80gb-x1", {"bloom-1b7", "bloom-3b"}),
        ("a100-80gb-x8-node", {"bloom-3b", "bloom-7b1"}),
        # 20 tokens per parameter: bloom-176b's 3.5T tokens take years on 384 A100s; bloom-7b1's 141B take days.
        ("jean-zay-a100-48n", {"bloom-7b1"}),
    ],
)
def test_model_ladder(hw_name: str, allowed: set[str]) -> None:
    """Without a corpus or a budget: the largest shape that fits memory and trains 20 tokens per parameter in 120
    days."""
    plan = make_plan(load_hardware(hw_name))
    assert plan.model.name in allowed and plan.feasible
    assert plan.model_choice and plan.model_choice[-1].startswith(("chosen", "no GPU"))


def test_plan_json_has_the_design_keys() -> None:
    # At BLOOM's own length (341B tokens) the recipe's batch ramp-up is kept; a shorter sized run drops it.
    plan = make_plan(load_hardware("a100-80gb-x1"), load_model_shape("bloom-560m"), train_tokens=341_000_000_000)
    doc = json.loads(json.dumps(plan.to_json()))
    assert {"hardware", "model", "layout", "estimate", "feasible", "rejected", "train"} <= set(doc)
    assert {"tp", "pp", "dp", "micro_batch_size", "global_batch_size", "zero_stage", "recompute"} <= set(doc["layout"])
    assert {"memory_gb_per_gpu", "step_time_s", "tflops_per_gpu", "mfu", "tokens_per_s"} <= set(doc["estimate"])
    assert all({"layout", "reason"} <= set(r) for r in doc["rejected"])
    assert doc["train"]["dtype"] == "bf16" and doc["train"]["lr"] == 3e-4
    # Without [s, s] scores (flash attention) micro-batch 32 fits one A100: the ramp-up rounds to multiples of 32.
    assert doc["layout"]["micro_batch_size"] == 32
    assert doc["train"]["rampup"] == {"start": 192, "increment": 32, "samples": 9_765_625}
    assert sum(doc["memory_breakdown_gb"].values()) == pytest.approx(doc["estimate"]["memory_gb_per_gpu"])
    assert sum(doc["time_breakdown_s"].values()) == pytest.approx(doc["estimate"]["step_time_s"])


def test_given_layout_that_does_not_fit() -> None:
    plan = make_plan(
        load_hardware("jean-zay-a100-48n"),
        load_model_shape("bloom-176b"),
        layout=parse_layout("tp=4,pp=12,dp=8,mbs=2,recompute=none"),
    )
    assert not plan.feasible and plan.mode == "given"
    assert plan.reasons[0].startswith("needs ") and "> 80.0 GiB" in plan.reasons[0]
    assert plan.rejected == [{"layout": plan.layout.to_dict(), "reason": plan.reasons[0]}]
    assert "NOT FEASIBLE" in format_plan(plan)


def test_given_layout_errors_name_every_factor() -> None:
    hw, model = load_hardware("jean-zay-a100-48n"), load_model_shape("bloom-176b")
    with pytest.raises(BadInput, match=r"tp\(4\) \* pp\(12\) \* dp\(4\) = 192 != world size 384"):
        make_plan(hw, model, layout=parse_layout("tp=4,pp=12,dp=4"))
    with pytest.raises(BadInput, match="contradicts gbs=1024"):
        make_plan(hw, model, global_batch_size=2048, layout=parse_layout("tp=4,pp=12,dp=8,gbs=1024"))
    with pytest.raises(BadInput, match=r"global batch\(100\) is not divisible"):
        make_plan(hw, model, global_batch_size=100, layout=parse_layout("tp=4,pp=12,dp=8"))


def test_cpu_given_layout_takes_its_own_world() -> None:
    plan = make_plan(cpu_box(2), load_model_shape("bloom-micro-test"), layout=parse_layout("tp=2,pp=2,dp=2,mbs=1"))
    assert plan.feasible and plan.layout.world_size == 8 and plan.train.dtype == "fp32"
    assert any("time-share" in n for n in plan.notes)


def test_long_sequences_are_planned_without_megatrons_softmax_limit() -> None:
    """Megatron's fused softmax took seq_len <= 4096, and the planner used to reject 8192 for it; our flash kernel
    has no such limit, and without [s, s] scores 8192 tokens of bloom-560m fit one A100."""
    plan = make_plan(load_hardware("a100-80gb-x1"), load_model_shape("bloom-560m"), seq_len=8192)
    assert plan.feasible and plan.model.seq_len == 8192
    assert not any("softmax" in r["reason"] for r in plan.rejected)


def test_v100_trains_in_fp16() -> None:
    v100 = replace(load_hardware("a100-80gb-x1"), gpu="V100-SXM2-32GB", gpu_memory_gb=32.0)
    plan = make_plan(v100, load_model_shape("bloom-560m"))
    assert plan.train.dtype == "fp16"


def test_format_plan_explains_the_choice() -> None:
    text = format_plan(make_plan(load_hardware("a100-80gb-x8-node"), load_model_shape("bloom-1b7")), verbose=True)
    for part in (
        "Layout: tp=",
        "fastest predicted of",
        "Memory per GPU",
        "Time per step",
        "Rejected alternatives",
        "Training:",
        "Run estimate:",
        "FLOP conventions",
        "MFU",
    ):
        assert part in text, part


def test_unknown_detected_gpu_is_planned_generically() -> None:
    box = replace(load_hardware("a100-80gb-x1"), gpu="A10G", gpu_memory_gb=24.0, name="detected")
    plan = make_plan(box, load_model_shape("bloom-tiny-cpu"))
    assert plan.feasible and any("not in the specs table" in n for n in plan.notes)


def test_plan_json_round_trips_layout_and_model() -> None:
    plan = make_plan(
        load_hardware("jean-zay-a100-48n"), load_model_shape("bloom-176b"), layout=parse_layout("tp=4,pp=12,dp=8,mbs=2")
    )
    doc = json.loads(json.dumps(plan.to_json()))
    spec = RunSpec.from_json(doc, "plan.json")
    assert (spec.layout, spec.model, spec.train) == (plan.layout, plan.model, plan.train)
    assert doc["layout"]["partition_method"] == "type:transformer|embedding"
    assert doc["layout"]["layers_per_stage"] == [5, *[6] * 10, 5]
