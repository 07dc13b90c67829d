"""`--set` on a run that has started: the keys that may change mid-run change plan.json (only their values, atomically)
and are recorded as a `settings` event; the others are refused with the reason, and nothing is written."""

from __future__ import annotations

import difflib
import json
import math
from dataclasses import replace

import pytest

from appliance.cli import main
from appliance.errors import BadInput
from appliance.hardware import load_hardware
from appliance.head_run import check_resumed_settings
from appliance.monitor.events import EventWriter, read_events
from appliance.overrides import known_keys, parse_overrides
from appliance.planner import load_model_shape, make_plan, parse_layout
from appliance.planner.runspec import load_spec
from appliance.planner.train_settings import CHANGEABLE_MID_RUN, FIXED_MID_RUN
from appliance.run_request import RunRequest
from appliance.rundir import RunDir
from appliance.train import checkpoint as ckpt
from appliance.train.live_settings import change_settings, plan_change

# The run's schedule: warmup to 1e-3 over 80 samples, cosine to 1e-4 at 800; the checkpoint is at step 10 of a global
# batch of 8, i.e. 80 samples in (the end of the warmup). The next step consumes samples 80..88.
GBS, STEP, CONSUMED = 8, 10, 80
LR, MIN_LR, WARMUP, DECAY = 1e-3, 1e-4, 80, 800


@pytest.fixture
def run_dir(tmp_path) -> RunDir:
    run = RunDir(tmp_path / "run").make()
    layout = parse_layout(f"tp=1,pp=1,dp=1,mbs=8,gbs={GBS},zero=1")
    spec = make_plan(load_hardware("cpu-laptop-2core"), load_model_shape("bloom-micro-test"), layout=layout).spec()
    train = replace(
        spec.train,
        lr=LR,
        min_lr=MIN_LR,
        warmup_samples=WARMUP,
        decay_samples=DECAY,
        train_samples=1600,
        eval_interval=10,  # the recipe's; stated here so the checks below do not follow the planner's cadence rule
    )
    run.plan.write_bytes(replace(spec, train=train).dumps())
    # Stand-ins for the tokenizer and the data, which `train` looks for before anything else (cli_train.py).
    run.tokenizer.mkdir()
    run.tokenizer_json.write_text("{}")
    run.data.mkdir()
    (run.data / "datasets.json").write_text("{}")
    step_dir = ckpt.prepare_step_dir(run.checkpoints, STEP)
    ckpt.commit(run.checkpoints, STEP, [], {"consumed_samples": CONSUMED})
    assert step_dir.is_dir()
    return run


def settings_events(run: RunDir) -> list[dict]:
    return [e for e in read_events(run.metrics) if e["kind"] == "settings"]


def apply(run: RunDir, *items: str) -> None:
    with EventWriter(run.metrics) as events:
        change_settings(run, parse_overrides(list(items)), events, command="train")


def cosine(lr: float, min_lr: float, warmup: int, decay: int, samples: int) -> float:
    """Megatron's warmup + cosine, written out again for the check."""
    if samples < warmup:
        return lr * samples / warmup
    if samples >= decay:
        return min_lr
    return min_lr + (lr - min_lr) * 0.5 * (1 + math.cos(math.pi * (samples - warmup) / (decay - warmup)))


def test_every_key_set_accepts_is_decided_once_with_a_reason():
    keys = set(known_keys())
    assert not set(CHANGEABLE_MID_RUN) & set(FIXED_MID_RUN)
    assert keys == set(CHANGEABLE_MID_RUN) | set(FIXED_MID_RUN), "a --set key without a mid-run decision"
    assert all(len(why) > 20 for why in {**CHANGEABLE_MID_RUN, **FIXED_MID_RUN}.values())


def test_a_change_rewrites_only_its_values_and_is_recorded(run_dir):
    before = run_dir.plan.read_text().splitlines()
    apply(run_dir, "eval_interval=7", "lr=5e-4", "hang_timeout_s=60")
    after = run_dir.plan.read_text().splitlines()
    changed = sorted((line[0], line[2:].strip()) for line in difflib.ndiff(before, after) if line[:2] in ("- ", "+ "))
    assert changed == sorted(
        [
            ("-", '"lr": 0.001,'),
            ("+", '"lr": 0.0005,'),
            ("-", '"eval_interval": 10,'),
            ("+", '"eval_interval": 7,'),
            ("-", '"hang_timeout_s": 300.0,'),
            ("+", '"hang_timeout_s": 60.0,'),
        ]
    ), changed
    spec = load_spec(run_dir.plan)  # the ranks' reader sees the new values
    assert (spec.train.lr, spec.train.eval_interval, spec.train.hang_timeout_s) == (5e-4, 7, 60.0)
    (event,) = settings_events(run_dir)
    assert event["step"] == STEP and event["consumed_samples"] == CONSUMED and event["command"] == "train"
    assert event["changes"] == [
        {"key": "eval_interval", "old": 10, "new": 7},
        {"key": "lr", "old": LR, "new": 5e-4},
        {"key": "hang_timeout_s", "old": 300.0, "new": 60.0},
    ]
    # the next step ends at 88 samples: the lr it gets under each schedule (fp64 arithmetic, same formula)
    assert event["lr_at_step"]["old"] == pytest.approx(cosine(LR, MIN_LR, WARMUP, DECAY, 88), rel=1e-12)
    assert event["lr_at_step"]["new"] == pytest.approx(cosine(5e-4, MIN_LR, WARMUP, DECAY, 88), rel=1e-12)


def test_the_schedule_after_a_tail_change_is_the_plans_shape_with_the_new_numbers(run_dir):
    from appliance.train.settings import lr_schedule

    apply(run_dir, "lr=6e-4", "min_lr=6e-5", "decay_samples=400")
    schedule = lr_schedule(load_spec(run_dir.plan).train)
    for samples in (88, 120, 240, 399, 400, 1000):
        assert schedule.at(samples) == pytest.approx(cosine(6e-4, 6e-5, WARMUP, 400, samples), rel=1e-12)
    assert schedule.at(400) == 6e-5  # the new decay end reaches the new floor


def test_a_value_that_does_not_change_writes_nothing(run_dir):
    before = run_dir.plan.stat()
    apply(run_dir, "eval_interval=10")
    assert run_dir.plan.stat().st_ino == before.st_ino and not settings_events(run_dir)


@pytest.mark.parametrize(
    ("item", "why"),
    [
        ("seq_len=64", "consumed samples"),
        ("global_batch_size=16", "gradient accumulation"),
        ("micro_batch_size=4", "--layout"),
        ("train_samples=3200", "data blend"),
        ("warmup_samples=40", "warmup"),
        ("precision=bf16", "fp32 masters"),
        ("seed=1", "RNG"),
        ("adam_beta2=0.99", "second moments"),
        ("vocab_size=1024", "embedding"),
    ],
)
def test_a_key_that_may_not_change_is_refused_with_the_reason_and_nothing_written(run_dir, item, why):
    before = run_dir.plan.read_bytes()
    key = item.split("=")[0]
    with pytest.raises(BadInput, match=rf"{key if key != 'precision' else 'dtype'}: .*{why}"):
        apply(run_dir, "eval_interval=3", item)  # the allowed key in the same request is not written either
    assert run_dir.plan.read_bytes() == before and not settings_events(run_dir)


def test_every_refused_key_of_a_request_is_named(run_dir):
    with pytest.raises(BadInput) as refused:
        plan_change(run_dir, parse_overrides(["seq_len=64", "seed=3", "lr=1e-4"]))
    assert "seq_len:" in str(refused.value) and "seed:" in str(refused.value) and "lr:" not in str(refused.value)


@pytest.mark.parametrize("item", ["tp=2", "layers=4"])
def test_layout_and_model_keys_say_where_they_change(item):
    with pytest.raises(BadInput, match=r"--layout|shape"):
        parse_overrides([item])


def test_a_decay_end_already_passed_is_refused(run_dir):
    with pytest.raises(BadInput, match=f"consumed {CONSUMED} samples"):
        plan_change(run_dir, parse_overrides(["decay_samples=60"]))


def test_min_lr_above_lr_is_refused(run_dir):
    with pytest.raises(BadInput, match="min_lr"):
        plan_change(run_dir, parse_overrides(["min_lr=2e-3"]))


def test_train_set_of_a_fixed_key_exits_2_naming_it(run_dir, capsys):
    before = run_dir.plan.read_bytes()
    assert main(["train", "--run-dir", str(run_dir.root), "--set", "seq_len=64"]) == 2
    assert "seq_len: the data position" in capsys.readouterr().err
    assert run_dir.plan.read_bytes() == before


def test_run_set_on_a_finished_run_is_refused(run_dir):
    run_dir.manifest.write_text(json.dumps({"plan": {"key": "k", "outputs": "o"}, "train": {"key": "k"}}))
    with pytest.raises(BadInput, match="finished training"):
        check_resumed_settings(RunRequest(corpus=[], run_dir=run_dir.root, overrides={"lr": 1e-4}))


def test_run_set_on_a_started_run_is_checked_before_the_run_starts(run_dir):
    run_dir.manifest.write_text(json.dumps({"plan": {"key": "k", "outputs": "o"}}))
    with pytest.raises(BadInput, match="seq_len"):
        check_resumed_settings(RunRequest(corpus=[], run_dir=run_dir.root, overrides={"seq_len": 64}))
    check_resumed_settings(RunRequest(corpus=[], run_dir=run_dir.root, overrides={"lr": 1e-4}))  # accepted
    assert load_spec(run_dir.plan).train.lr == LR  # checked, not applied: the run applies it


def test_a_headless_log_shows_the_change(run_dir):
    import io

    from appliance.monitor.headless import HeadlessPrinter

    apply(run_dir, "eval_interval=7", "lr=5e-4")
    out = io.StringIO()
    HeadlessPrinter(out).handle(settings_events(run_dir)[0])
    assert out.getvalue().endswith("settings changed after step 10: eval_interval 10 -> 7, lr 0.001 -> 0.0005\n")


def test_a_refused_run_set_writes_no_event(run_dir):
    from appliance.head_run import run

    run_dir.manifest.write_text(json.dumps({"plan": {"key": "k", "outputs": "o"}}))
    with pytest.raises(BadInput, match="seq_len"):
        run(RunRequest(corpus=[run_dir.root], run_dir=run_dir.root, overrides={"seq_len": 64}))
    assert not run_dir.metrics.exists()
