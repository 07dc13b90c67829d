"""Cadences sized to the run (appliance/planner/cadence.py): evaluations within 5% of the time in steps, saves at the
end and by Young's interval, none in the last 5% of the steps but the final one."""

from __future__ import annotations

import math

import pytest

from appliance.data.sample_corpus import SAMPLE_CORPUS_DIR
from appliance.hardware import load_hardware
from appliance.planner import Budget, load_model_shape, make_plan
from appliance.planner.cadence import (
    DEVICE_HOURS_BETWEEN_FAILURES,
    cadence_for,
    eval_interval_for,
    save_due,
    save_minutes_for,
    saves,
)
from appliance.planner.sizing import Overheads, run_seconds
from appliance.run_request import RunRequest, make_run_plan


def test_young_interval_from_llama3_failure_rate() -> None:
    # 54 days x 24 h x 16,384 GPUs / 419 interruptions = 50,677 device-hours between failures.
    assert round(DEVICE_HOURS_BETWEEN_FAILURES) == 50_677
    # 384 devices: 50,677 / 384 = 131.97 h = 475,097 s; a 61 s save: sqrt(2 x 61 x 475,097) = 7,613 s = 126.9 min.
    assert save_minutes_for(61.0, 384) == pytest.approx(126.9, abs=0.1)
    # One device: sqrt(2 x 11 x 50,677 x 3600) = 63,322 s, past the 180-minute ceiling (BLOOM's 3 hours).
    assert save_minutes_for(11.0, 1) == 180.0
    # 16,384 devices: 3.09 h; a 1 s save: sqrt(2 x 1 x 11,135) = 149 s, under the 10-minute floor.
    assert save_minutes_for(1.0, 16_384) == 10.0


def test_eval_interval_keeps_evaluations_within_five_percent() -> None:
    # 336 steps of 0.2 s = 67.2 s; 5% = 3.36 s of evaluations at 0.8 s each: 4 evaluations (step 0 + 3 intervals),
    # so m = floor(3.36 / 0.8) - 1 = 3 intervals of ceil(336 / 3) = 112 steps: evaluations at 0, 112, 224, 336.
    assert eval_interval_for(336, 0.2, 0.8, frequent=16) == 112
    # Cheap evaluations: the wanted frequency stands (0.01 s each: m = 335, every step would do; 16 is wanted).
    assert eval_interval_for(336, 0.2, 0.01, frequent=16) == 16
    # Not even step 0 and the last fit in 5% (3.36 s < 2 x 2 s): those two alone.
    assert eval_interval_for(336, 0.2, 2.0, frequent=16) == 336


def test_saves_count_the_end_the_steps_and_the_clock_but_not_the_tail() -> None:
    # Every 250 steps of a 1,000-step run: 250, 500, 750 (950 < 1000 is the tail's start), then 1,000.
    assert saves(1000, 0.0, 250) == 4
    # Every 10 steps of 200: multiples up to 190 = 200 x 0.95 (19 of them), then 200: 20.
    assert saves(200, 0.0, 10) == 20
    # By time: 10 hours busy, every 180 minutes: 3 h, 6 h, 9 h are before 9.5 h (95%), + the end = 4.
    assert saves(1000, 36_000.0, 1000, 180.0) == 4
    # A run shorter than the interval saves once, at the end.
    assert saves(200, 90.0, 200, 180.0) == 1


def test_save_due_skips_the_tail() -> None:
    assert save_due(100, 200, 100, 0.0, 180.0)
    assert not save_due(99, 200, 100, 0.0, 180.0)
    assert save_due(99, 200, 1000, 181 * 60.0, 180.0)  # the clock
    # Step 191 of 200 is past 190 (95%): neither its step count nor the clock saves; step 200 saves anyway.
    assert not save_due(191, 200, 1, 1e9, 180.0)
    assert save_due(190, 200, 1, 0.0, 180.0)


def test_the_recipe_keeps_its_step_interval_when_no_more_frequent_than_youngs() -> None:
    # BLOOM-176B: 100 steps x 105 s = 175 minutes >= Young's 126.9 minutes (61 s save, 384 GPUs): kept, with the
    # clock as a safety net at twice the interval's planned time (350 minutes).
    c = cadence_for(
        95_000, 105.0, 300.0, 61.0, devices=384, eval_samples=2048, recipe_eval=1000, recipe_save=100, own_recipe=True
    )
    assert (c.eval_interval, c.save_interval) == (1000, 100)
    assert c.save_interval_minutes == pytest.approx(350.0)
    # The CPU smoke recipe: 100 steps x 0.43 s = 43 s, far under the 10-minute floor: the end and the clock only.
    c = cadence_for(200, 0.43, 1.7, 2.0, devices=2, eval_samples=16, recipe_eval=100, recipe_save=100, own_recipe=True)
    assert c.save_interval == 200 and c.save_interval_minutes == 180.0


def test_cpu_default_plan_evaluates_within_five_percent() -> None:
    """The CPU smoke run: 200 steps at global batch 16, 12 languages. Its recipe's 32 samples per language would make
    an evaluation 12 x 32 / 16 / 3 = 8 steps' time, and the two every run makes 16 of 200 (8%); at most
    0.05 x 200 x 16 x 3 / (2 x 12) = 20 samples, in units of mbs 8 x dp 2 = 16, keep them at 2 x 4 = 8 steps (4%).
    Then m = floor(0.05 x 200 / 4) - 1 = 1 interval: evaluations at step 0 and 200."""
    plan = make_plan(load_hardware("cpu-laptop-2core"), budget=Budget(corpus_tokens=2_532_916, languages=12))
    train, run = plan.train, plan.run
    assert (plan.layout.micro_batch_size, plan.layout.dp, train.global_batch_size) == (8, 2, 16)
    assert train.eval_samples == 16 and train.eval_interval == 200
    step_s = plan.time.total_s
    assert run.eval_s == pytest.approx(12 * 16 / 16 * step_s / 3)
    evaluations = 1 + math.ceil(200 / train.eval_interval)
    assert evaluations * run.eval_s <= 0.05 * 200 * step_s
    assert train.save_interval == 200  # saves: at the end (and by the clock, which 200 steps never reach)
    assert any(line.startswith("evaluations: every 200 steps") for line in plan.sizing)
    assert any(line.startswith("saves: at the end") for line in plan.sizing)


def test_one_gpu_sample_corpus_plan_no_longer_evaluates_twenty_times() -> None:
    """bloom-560m on one GPU, 10 minutes, the sample corpus as BLOOM's tokenizer counts it (1,377,972 tokens, 12
    languages): 336 steps of 8 x 2048, the run the issue measured with 21 evaluations every 16 steps. One evaluation:
    12 x 8 / 8 / 3 = 4 steps' time; 5% of 336 steps is 16.8: m = floor(16.8 / 4) - 1 = 3 intervals of 112 steps (4
    evaluations, 4.8%). One save, at the end: 336 steps take a minute or two, and Young's interval on one GPU is the
    180-minute ceiling."""
    plan = make_plan(load_hardware("h100-sxm5-x1"), budget=Budget(seconds=600, corpus_tokens=1_377_972, languages=12))
    train, run = plan.train, plan.run
    assert train.steps_at_full_batch == 336 and train.eval_samples == 8
    assert train.eval_interval == 112 and train.save_interval == 336 and train.save_interval_minutes == 180.0
    ov = Overheads(run.eval_s, run.checkpoint_s)
    step_s = plan.time.total_s
    assert run.time_s == pytest.approx(336 * step_s + 4 * run.eval_s + 1 * run.checkpoint_s)
    assert run.time_s == pytest.approx(run_seconds(336, step_s, ov, 112, 336, 180.0))


def test_max_steps_resizes_the_cadences_and_a_users_interval_stays() -> None:
    """--max-steps 60 on the CPU default: one evaluation (4 steps' time) is past 5% of 60 steps (3), so step 0 and
    step 60 alone; one save at the end."""
    spec = make_run_plan(RunRequest(corpus=[SAMPLE_CORPUS_DIR], hardware="cpu-laptop-2core", max_steps=60))
    assert (spec.train.eval_interval, spec.train.save_interval) == (60, 60)
    mine = make_run_plan(
        RunRequest(
            corpus=[SAMPLE_CORPUS_DIR], hardware="cpu-laptop-2core", max_steps=60, overrides={"eval_interval": 20}
        )
    )
    assert mine.train.eval_interval == 20


def test_bloom_176b_on_blooms_cluster_evaluates_as_bloom_and_saves_by_youngs_interval() -> None:
    """--model bloom-176b on 48 x 8 A100s: every 1,000 steps, BLOOM's (1,000 < its run's steps / 20). A save writes
    16 B x 176,247,271,424 parameters at 48 x 1 GB/s, + 2 s: 60.75 s; 384 GPUs fail every 50,677 / 384 = 131.97 h:
    sqrt(2 x 60.75 x 475,097) = 7,598 s = 126.6 minutes between saves by time."""
    plan = make_plan(load_hardware("jean-zay-a100-48n"), load_model_shape("bloom-176b"), global_batch_size=2048)
    assert plan.model.parameters() == 176_247_271_424
    assert plan.run.checkpoint_s == pytest.approx(2 + 16 * 176_247_271_424 / 48e9)
    assert plan.train.eval_interval == 1000 and plan.train.save_interval == plan.train.steps_at_full_batch
    assert plan.train.save_interval_minutes == pytest.approx(126.6, abs=0.1)
