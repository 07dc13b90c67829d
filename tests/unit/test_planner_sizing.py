"""Sizing: the corpus and the time budget fix the model size and the token count (appliance/planner/sizing.py)."""

from __future__ import annotations

import pytest

from appliance.data.sample_corpus import SAMPLE_CORPUS_DIR
from appliance.errors import BadInput
from appliance.hardware import load_hardware
from appliance.planner import Budget, format_plan, load_model_shape, make_plan
from appliance.planner.sizing import (
    MAX_EPOCHS,
    MIN_STEPS,
    Overheads,
    optimal_tokens,
    parse_duration,
    planned_seconds,
    run_seconds,
    steps_within,
)
from appliance.run_request import RunRequest, make_run_plan

H100 = "h100-sxm5-x1"
# The sample corpus as the data stage counts it with BLOOM's 250,680-entry tokenizer trained on it (measured:
# `run --prepare-only --hardware h100-sxm5-x1`, data/datasets.json, 12 languages).
SAMPLE_TOKENS_GPU = 1_377_972


def tokens(plan) -> int:
    return plan.train.train_samples * plan.train.seq_len


@pytest.mark.parametrize(
    ("text", "seconds"), [("45s", 45), ("90m", 5400), ("6h", 21600), ("1.5h", 5400), ("2d", 172800), ("3", 10800)]
)
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "0h", "-1h", "6 hours", "h", "1w"])
def test_parse_duration_refuses_what_is_not_one(text: str) -> None:
    with pytest.raises(BadInput, match="--budget"):
        parse_duration(text)


def test_default_one_gpu_run_on_the_sample_corpus_is_a_ten_minute_smoke_run() -> None:
    """Before the data stage: the 10-minute default budget bounds it; the plan includes evaluations and saves."""
    spec = make_run_plan(RunRequest(corpus=[SAMPLE_CORPUS_DIR], hardware=H100))
    assert spec.run.budget_s == 600 and spec.run.time_s <= 600
    assert spec.model.name == "bloom-560m" and spec.run.limit == "time"
    assert spec.run.overhead_s > 0 and spec.train.steps_at_full_batch >= MIN_STEPS
    # The old plan: bloom-1b1 for 650,405 steps, 100 days, whatever the corpus.


def test_the_sample_corpus_bounds_the_tokens_at_four_epochs() -> None:
    plan = make_plan(load_hardware(H100), budget=Budget(seconds=600, corpus_tokens=SAMPLE_TOKENS_GPU, languages=12))
    assert plan.run.limit == "data" and plan.run.time_s <= 600
    assert SAMPLE_TOKENS_GPU * (MAX_EPOCHS - 0.1) <= tokens(plan) <= MAX_EPOCHS * SAMPLE_TOKENS_GPU
    # Too few tokens for 200 steps at the recipe's 256 x 2048: the batch shrinks so the schedule has room.
    assert plan.train.global_batch_size < 256 and plan.train.steps_at_full_batch >= MIN_STEPS
    assert any(line.startswith("limit: data") and "would allow" in line for line in plan.sizing)


def test_compute_optimal_with_plenty_of_data_and_time() -> None:
    """1 x H100, 100B corpus tokens, no budget: the largest shape that fits memory, at 20 tokens per parameter."""
    plan = make_plan(load_hardware(H100), budget=Budget(corpus_tokens=100_000_000_000))
    target = optimal_tokens(plan.model)
    assert target - plan.train.global_batch_size * plan.train.seq_len < tokens(plan) <= target
    assert plan.run.limit == "memory"  # bloom-7b1 and bloom-176b do not fit one H100


def test_a_small_corpus_gets_a_smaller_model_than_a_large_one() -> None:
    hw = load_hardware("h100-sxm5-x8-node")
    small = make_plan(hw, budget=Budget(corpus_tokens=5_000_000_000))  # 20B tokens at 4 epochs: bloom-560m/1b1
    large = make_plan(hw, budget=Budget(corpus_tokens=100_000_000_000))
    assert small.model.parameters() < large.model.parameters()
    assert optimal_tokens(small.model) <= MAX_EPOCHS * 5_000_000_000
    assert small.run.limit == "data"  # the next size up would need more than 4 epochs


@pytest.mark.parametrize("budget", ["30m", "6h", "2d"])
def test_a_budget_is_honoured_and_used(budget: str) -> None:
    seconds = parse_duration(budget)
    plan = make_plan(load_hardware(H100), budget=Budget(seconds=seconds, corpus_tokens=10**12))
    assert plan.run.time_s <= seconds
    # The user's time is used: the steps are as many as fit (one more step would not).
    assert plan.run.time_s > 0.9 * seconds and plan.run.limit == "time"
    train = plan.train
    ov = Overheads(plan.run.eval_s, plan.run.checkpoint_s)
    step_s = plan.time.total_s
    seconds = run_seconds(
        train.steps_at_full_batch, step_s, ov, train.eval_interval, train.save_interval, train.save_interval_minutes
    )
    assert seconds == pytest.approx(plan.run.time_s)


def test_a_longer_budget_buys_a_larger_model() -> None:
    hw = load_hardware("h100-sxm5-x8-node")
    sizes = [make_plan(hw, budget=Budget(seconds=parse_duration(b), corpus_tokens=10**12)) for b in ("6h", "30d")]
    assert sizes[0].model.parameters() < sizes[1].model.parameters()


def test_model_and_train_tokens_still_override() -> None:
    spec = make_run_plan(
        RunRequest(corpus=[SAMPLE_CORPUS_DIR], hardware=H100, model="bloom-1b1", overrides={"train_tokens": 2**30})
    )
    assert spec.model.name == "bloom-1b1" and spec.train.train_samples == 2**30 // 2048
    assert spec.run.limit == "user"


def test_max_steps_retimes_the_plan() -> None:
    spec = make_run_plan(RunRequest(corpus=[SAMPLE_CORPUS_DIR], hardware=H100, max_steps=20))
    assert spec.train.steps_at_full_batch == 20 and spec.run.steps == 20 and spec.run.limit == "user"
    assert spec.run.time_s < 20 * spec.report.estimate["step_time_s"] + 60


def test_cpu_keeps_its_smoke_recipe_until_data_or_a_budget_cut_it() -> None:
    cpu = load_hardware("cpu-laptop-2core")
    recipe = make_plan(cpu, budget=Budget(corpus_tokens=2_532_916))  # the sample corpus with the 8,192 tokenizer
    assert recipe.train.steps_at_full_batch == 200 and recipe.run.limit == "recipe"
    tiny_corpus = make_plan(cpu, budget=Budget(corpus_tokens=50_000))
    assert tokens(tiny_corpus) <= MAX_EPOCHS * 50_000 and tiny_corpus.run.limit == "data"
    budget = make_plan(cpu, budget=Budget(seconds=600, corpus_tokens=10**9))
    assert budget.run.limit == "time" and 540 < budget.run.time_s <= 600


def test_steps_within_is_the_largest_count_that_fits() -> None:
    ov = Overheads(eval_s=3.0, checkpoint_s=20.0)
    for seconds in (10.0, 600.0, 86_400.0):
        n = steps_within(seconds, 0.5, ov)
        assert planned_seconds(n, 0.5, ov, None, None) <= seconds < planned_seconds(n + 1, 0.5, ov, None, None)
    assert steps_within(1.0, 0.5, ov) == 0  # not even one step with its evaluation and checkpoint


def test_the_plan_says_what_bound_it() -> None:
    text = format_plan(make_plan(load_hardware(H100), load_model_shape("bloom-560m"), budget=Budget(seconds=3600)))
    assert "Sizing:" in text and "limit: time" in text and "would take about" in text


def test_size_to_corpus_refixes_a_fresh_plan_once_and_never_under_a_resume(tmp_path) -> None:
    import json

    from appliance.head_run import size_to_corpus
    from appliance.monitor.events import EventWriter
    from appliance.rundir import RunDir
    from appliance.stages import Stages

    req = RunRequest(corpus=[SAMPLE_CORPUS_DIR], hardware=H100)
    first = make_run_plan(req)
    run_dir = RunDir(tmp_path / "run").make()
    run_dir.data.mkdir(parents=True, exist_ok=True)
    langs = {f"l{i}": {"prefix": f"l{i}_text_document", "documents": 10, "tokens": 114_831} for i in range(12)}
    (run_dir.data / "datasets.json").write_text(json.dumps(langs))
    stages = Stages(run_dir.manifest, EventWriter(run_dir.metrics))

    sized = size_to_corpus(first, req, run_dir, stages)
    assert sized is not None and sized.run.corpus_tokens == 12 * 114_831 and sized.run.limit == "data"
    assert sized.train.train_samples < first.train.train_samples and sized.run.time_s <= 600
    assert size_to_corpus(sized, req, run_dir, stages) is None  # fixed once sized

    stages.records["train"] = {"key": "k", "outputs": "o", "seconds": 1.0}
    assert size_to_corpus(first, req, run_dir, stages) is None  # a run trained under it: kept
    del stages.records["train"]
    (run_dir.checkpoints / "step-00000010").mkdir(parents=True)
    assert size_to_corpus(first, req, run_dir, stages) is None  # an older run directory with checkpoints: kept
