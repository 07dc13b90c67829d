"""Failures injected into real runs (two gloo ranks through the elastic agent), each recovered automatically or, when
a retry would only repeat it, stopped cleanly. Faults come from BLOOM_FAULTS (appliance/train/faults.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from prepared_runs import copy_run, events, explain, prepare_run, step_losses, train

from appliance.rundir import RunDir
from appliance.train import checkpoint as ckpt

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

HANG_TIMEOUT_S = 4.0


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> RunDir:
    return prepare_run(
        tmp_path_factory.mktemp("failures") / "base",
        "tp=1,pp=1,dp=2,mbs=2,gbs=8,zero=0,recompute=none",
        train_samples=8 * 10,
        warmup_samples=16,
        decay_samples=80,
        eval_interval=100,
        eval_samples=4,
        save_interval=2,
        keep_last=10,
        eval_task_limit=1,
    )


def _agent_attempts(run_dir: RunDir) -> set[str]:
    return {p.name for p in run_dir.logs.glob("*/attempt_*")}


def test_a_hung_rank_is_detected_within_the_timeout_named_and_restarted(base: RunDir, tmp_path: Any) -> None:
    """Pass: rank 1 SIGSTOPs itself at step 7; within the hang timeout (+ one heartbeat and a margin for the step
    in flight) a failure event names rank 1 as hung, the group restarts from step 4 and the run finishes. (Step 6's
    save made step 4's commit first, one save in flight; step 6's own commit needed step 7's boundary, which the
    stopped rank never reached.)"""
    run_dir = copy_run(base, tmp_path / "hang", max_restarts=1, hang_timeout_s=HANG_TIMEOUT_S, heartbeat_interval_s=0.5)
    result = train(run_dir, faults="hang@step=7:rank=1")
    assert result.returncode == 0, explain(result)
    failures = events(run_dir, "failure")
    # Exactly one hang report; the agent's report of the killed process is not a second failure. A peer blocked in a
    # collective with the killed rank may see its connection break and exit before the agent stops it (a race that
    # shows under load): the agent then reports that exit too, after the hang, as a restartable death, never fatal.
    (failure,) = [f for f in failures if "hung" in f["reason"]]
    assert failure["rank"] == 1 and failure["detected_by"] == 0
    for other in failures:
        if other is not failure:
            assert other["t"] > failure["t"] and "died" in other["reason"] and not other.get("fatal"), other
    assert len(failures) <= 2, failures
    last_step_before = max(e["t"] for e in events(run_dir, "step") if e["t"] < failure["t"])
    assert failure["t"] - last_step_before < HANG_TIMEOUT_S + 4.0
    (recovery,) = events(run_dir, "recovery")
    assert recovery["restart"] == 1 and recovery["resumed_step"] == 4 and recovery["lost_seconds"] > HANG_TIMEOUT_S
    assert max(step_losses(run_dir)) == 10
    assert _agent_attempts(run_dir) == {"attempt_0", "attempt_1"}


def test_non_finite_losses_are_skipped_on_all_ranks_then_rolled_back_past_their_data(
    base: RunDir, tmp_path: Any
) -> None:
    """Pass: a NaN loss at step 3 is skipped by every rank (the run goes on); NaN at steps 6-8 (3 in a row) rolls
    the run back to step 4's checkpoint, whose replay of step 5 repeats its loss exactly, and steps 6-8's data is
    skipped on the second pass; the run then finishes and the skip window is in its checkpoints."""
    run_dir = copy_run(base, tmp_path / "nan", save_interval=4, nan_rollback_after=3)
    result = train(run_dir, faults="nan@step=3,nan@step=6-8")
    assert result.returncode == 0, explain(result)
    steps = events(run_dir, "step")
    assert [e["step"] for e in steps if e["skipped"]] == [3, 6, 7, 8]
    first_pass = {e["step"]: e["loss"] for e in steps[:5]}
    assert steps[5]["step"] == 6  # the first pass reached step 8, then went back
    (recovery,) = events(run_dir, "recovery")
    assert recovery["resumed_step"] == 4 and "skipping steps 6-8" in recovery["reason"]
    second_pass = [e for e in steps if e["t"] > recovery["t"]]
    assert [e["step"] for e in second_pass] == [5, 9, 10]
    assert second_pass[0]["loss"] == first_pass[5]
    assert not any(e["skipped"] for e in second_pass)
    manifest = json.loads((run_dir.checkpoints / "step-00000010" / ckpt.MANIFEST).read_text())
    assert manifest["skip_windows"] == [[6, 8]]
    warnings = [e["message"] for e in events(run_dir, "warning")]
    assert sum("data skipped" in w for w in warnings) == 3


def test_a_crash_during_a_save_leaves_the_previous_checkpoint_as_the_one_loaded(base: RunDir, tmp_path: Any) -> None:
    """Pass: rank 1 dies after writing its files for step 4 but before the commit; the restart resumes from step 2
    (the half-written step 4 is invisible), saves step 4 properly this time and finishes."""
    run_dir = copy_run(base, tmp_path / "save_crash", max_restarts=1)
    result = train(run_dir, faults="save_crash@step=4:rank=1")
    assert result.returncode == 0, explain(result)
    # The agent reports the first worker it saw exit: the killed rank 1, or rank 0 whose collective broke at once.
    (failure,) = events(run_dir, "failure")
    assert failure["rank"] in (0, 1) and "died" in failure["reason"]
    (recovery,) = events(run_dir, "recovery")
    assert recovery["resumed_step"] == 2
    assert [e["step"] for e in events(run_dir, "checkpoint")] == [2, 4, 6, 8, 10]
    assert ckpt.verify(run_dir.checkpoints / "step-00000004", verify_hashes=True) == []


def test_a_kill_during_a_background_write_leaves_the_previous_checkpoint_as_the_one_loaded(
    base: RunDir, tmp_path: Any
) -> None:
    """Pass: rank 1 is killed halfway through writing its files of step 4, in the background, once step 5 has run on
    every rank meanwhile; step 4 never commits, so the restart resumes from step 2, saves step 4 properly this time
    and finishes."""
    run_dir = copy_run(base, tmp_path / "write_crash", max_restarts=1)
    result = train(run_dir, faults="write_crash@step=4:rank=1")
    assert result.returncode == 0, explain(result)
    (failure,) = events(run_dir, "failure")
    assert failure["rank"] in (0, 1) and "died" in failure["reason"]
    (recovery,) = events(run_dir, "recovery")
    assert recovery["resumed_step"] == 2
    first_attempt = [e["step"] for e in events(run_dir, "step") if e["t"] < recovery["t"]]
    assert max(first_attempt) == 5, first_attempt  # training went on while step 4's files were being written
    assert [e["step"] for e in events(run_dir, "checkpoint")] == [2, 4, 6, 8, 10]
    assert ckpt.verify(run_dir.checkpoints / "step-00000004", verify_hashes=True) == []


def test_a_full_disk_during_a_save_fails_cleanly_on_all_ranks_and_keeps_the_previous_checkpoint(
    base: RunDir, tmp_path: Any
) -> None:
    """Pass: rank 1's background write for step 4 fails with ENOSPC; every rank stops at the first step boundary
    that finds every rank's writer done (one fatal failure event naming the cause, no restart), the command exits 1
    naming the disk error, step 4 stays invisible and step 2 remains the verified newest checkpoint."""
    run_dir = copy_run(base, tmp_path / "enospc", max_restarts=2)
    result = train(run_dir, faults="enospc@step=4:rank=1")
    assert result.returncode == 1, explain(result)
    assert "No space left on device" in result.stderr and "not retried" in result.stderr
    (failure,) = events(run_dir, "failure")
    assert failure["fatal"] is True and "No space left on device" in failure["reason"] and "rank 1" in failure["reason"]
    assert _agent_attempts(run_dir) == {"attempt_0"}  # the agent did not retry into the same wall
    # Step 5's boundary learns it, or step 6's when rank 0 was still writing at step 5's (the save at step 6 waits
    # for every writer): step 6 reads its figures after that boundary, so it never reports.
    assert max(step_losses(run_dir)) in (4, 5)
    assert ckpt.find_latest(run_dir.checkpoints) == run_dir.checkpoints / "step-00000002"
    assert not (run_dir.checkpoints / "step-00000004" / ckpt.MANIFEST).exists()


def test_save_switch_and_kill_switch_files_are_obeyed_at_the_next_step(base: RunDir, tmp_path: Any) -> None:
    """Pass: `control/checkpoint` present at launch makes every rank save after step 1 (not a save step otherwise),
    and the file is consumed; `control/save-and-exit` makes the next launch save and stop after its first step
    (exit 3, the run event naming the request), and a third launch goes on from there."""
    run_dir = copy_run(base, tmp_path / "switches", save_interval=4)
    run_dir.request_checkpoint.touch()
    first = train(run_dir, "--stop-at-step", "2")
    assert first.returncode == 3, explain(first)
    assert [e["step"] for e in events(run_dir, "checkpoint")] == [1, 2]
    assert not run_dir.request_checkpoint.exists()
    run_dir.request_stop.touch()
    second = train(run_dir)
    assert second.returncode == 3, explain(second)
    assert [e["step"] for e in events(run_dir, "checkpoint")] == [1, 2, 3]
    stops = [e for e in events(run_dir, "run") if e["state"] == "preempted"]
    assert stops[-1]["step"] == 3 and stops[-1]["reason"] == "save-and-exit requested"
    assert not run_dir.request_stop.exists()
    assert max(step_losses(run_dir)) == 3
