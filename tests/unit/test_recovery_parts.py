"""The pieces of automatic recovery, each alone: fault plans, the hang watchdog, the cost of a failure, and the agent's
report of a dead worker."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from appliance.errors import BadInput
from appliance.monitor.events import EventWriter
from appliance.rundir import RunDir
from appliance.train.faults import Fault, FaultInjector, parse_faults
from appliance.train.launch import AgentLogWatcher, worker_env
from appliance.train.watchdog import ATTEMPT_FILE, Watchdog, lost_seconds, prune_attempts, was_killed_as_hung


def test_fault_plan_parses_kinds_ranges_ranks_and_attempts() -> None:
    faults = parse_faults("kill@step=5:rank=1, nan@step=7-9,hang@step=3:rank=0:attempt=1")
    assert faults == [
        Fault("kill", 5, 5, rank=1),
        Fault("nan", 7, 9),
        Fault("hang", 3, 3, rank=0, attempt=1),
    ]
    injector = FaultInjector(rank=1, faults=faults, attempt=0)
    assert injector.due("kill", 5) and not injector.due("kill", 6)
    assert injector.due("nan", 8) and not injector.due("hang", 3)  # the hang is for rank 0's second attempt
    assert not FaultInjector(rank=1, faults=faults, attempt=1).due("kill", 5)  # restarted workers run clean


@pytest.mark.parametrize("text", ["boom@step=1", "kill@rank=1", "kill@step=x", "kill@step=1:node=2", "kill@step"])
def test_a_wrong_fault_plan_names_the_variable_and_the_entry(text: str) -> None:
    with pytest.raises(BadInput, match="BLOOM_FAULTS"):
        parse_faults(text)


def test_enospc_fault_raises_the_error_a_full_disk_gives() -> None:
    injector = FaultInjector(rank=0, faults=parse_faults("enospc@step=4"), attempt=0)
    injector.before_write(3)
    with pytest.raises(OSError, match="No space left on device"):
        injector.before_write(4)


def _beat(directory: Path, rank: int, pid: int, t: float, step: int, host: str = "node1") -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"rank{rank:05d}.json").write_text(
        json.dumps({"rank": rank, "pid": pid, "host": host, "t": t, "step": step})
    )


def test_watchdog_kills_a_stopped_peer_once_names_it_and_spares_live_and_remote_ones(tmp_path: Path) -> None:
    """Pass: the stale rank on this host is named in one report and SIGKILLed; a fresh peer and a stale peer on
    another host are left alone, and a second watchdog does not report the same process again."""
    stopped = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        stopped.send_signal(signal.SIGSTOP)
        now = time.time()
        reports: list[tuple[int, str]] = []
        dog = Watchdog(
            tmp_path, 0, interval_s=1, timeout_s=5, on_hung=lambda r, why: reports.append((r, why)), attempt="a-000"
        )
        dog.host = "node1"
        _beat(dog.dir, 1, stopped.pid, now - 6, 7)  # silent for 6 s > 5 s
        _beat(dog.dir, 2, 999999, now - 1, 7)  # alive
        _beat(dog.dir, 3, 999998, now - 60, 7, host="node2")  # another host's business
        assert dog.check_peers(now) == [1]
        assert stopped.wait(timeout=10) == -signal.SIGKILL
        ((rank, reason),) = reports
        assert rank == 1 and f"pid {stopped.pid}" in reason and "step 7" in reason and "hung" in reason
        other = Watchdog(tmp_path, 2, interval_s=1, timeout_s=5, on_hung=lambda r, why: reports.append((r, why)))
        other.dir, other.host = dog.dir, "node1"
        assert other.check_peers(now) == []
        assert was_killed_as_hung(tmp_path, stopped.pid)
    finally:
        stopped.kill()
        stopped.wait()


def test_watchdog_thread_beats_with_the_current_step(tmp_path: Path) -> None:
    dog = Watchdog(tmp_path, 4, interval_s=0.05, timeout_s=5, on_hung=lambda r, why: None, attempt="x-001").start()
    try:
        dog.set_step(12)
        deadline = time.time() + 5
        while json.loads((tmp_path / "x-001" / "rank00004.json").read_text())["step"] != 12:
            assert time.time() < deadline
            time.sleep(0.05)
    finally:
        dog.stop()
    assert (tmp_path / "x-001" / ATTEMPT_FILE).is_file()


def _attempt(root: Path, name: str, started: float, beats: list[tuple[float, int]]) -> None:
    directory = root / name
    directory.mkdir(parents=True)
    (directory / ATTEMPT_FILE).write_text(json.dumps({"t": started}))
    for rank, (t, step) in enumerate(beats):
        _beat(directory, rank, 100 + rank, t, step)


def test_lost_seconds_counts_redone_work_and_restart_time_but_not_a_clean_stop(tmp_path: Path) -> None:
    # Same launch: checkpoint at t=1000 (step 6), the failed attempt began at 900 and died at 1040: all of it since
    # the checkpoint is lost, up to the restart at 1050.
    _attempt(tmp_path / "a", "run1-000", 900.0, [(1040.0, 9), (1039.0, 9)])
    assert lost_seconds(tmp_path / "a", "run1-001", 1000.0, 6, 1050.0) == pytest.approx(50.0)
    # A new launch after a crash: only the steps done past the checkpoint (queue time is not counted).
    _attempt(tmp_path / "b", "run1-000", 900.0, [(1040.0, 9)])
    assert lost_seconds(tmp_path / "b", "run2-000", 1000.0, 6, 5000.0) == pytest.approx(40.0)
    # A new launch after a clean stop at the checkpoint's step: nothing lost.
    _attempt(tmp_path / "c", "run1-000", 900.0, [(1001.0, 6)])
    assert lost_seconds(tmp_path / "c", "run2-000", 1000.0, 6, 5000.0) == 0.0
    assert lost_seconds(tmp_path / "empty", "run1-000", 1000.0, 6, 5000.0) == 0.0


def test_old_attempt_directories_are_pruned(tmp_path: Path) -> None:
    for i in range(5):
        _attempt(tmp_path, f"run-{i:03d}", float(i), [])
    prune_attempts(tmp_path, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run-003", "run-004"]


def test_agent_log_watcher_reports_a_killed_worker_once_and_skips_a_hung_one(tmp_path: Path) -> None:
    """Pass: the agent's "failed (exitcode: -9) local_rank: 1" line becomes one failure event naming rank 1 and
    SIGKILL, a half-written line waits for its end, and a worker the watchdog killed is not reported twice."""
    run_dir = RunDir(tmp_path).make()
    log = run_dir.logs / "agent.log"
    log.parent.mkdir(parents=True)
    log.write_text("old line from an earlier launch\n")
    with EventWriter(run_dir.metrics) as events:
        watcher = AgentLogWatcher(run_dir, log, events)
        line = "E1122 api.py:1002] failed (exitcode: -9) local_rank: 1 (pid: 4242) of binary: /usr/bin/python\n"
        with open(log, "a") as f:
            f.write(line[:40])
        assert watcher.poll() == 0
        with open(log, "a") as f:
            f.write(line[40:])
            f.write("E1122 api.py:1002] failed (exitcode: 1) local_rank: 0 (pid: 77) of binary: python\n")
        (run_dir.heartbeats / "r-000").mkdir(parents=True)
        (run_dir.heartbeats / "r-000" / "hung-77").touch()
        assert watcher.poll() == 1
        assert watcher.poll() == 0
    (failure,) = [json.loads(x) for x in run_dir.metrics.read_text().splitlines()]
    assert failure["kind"] == "failure" and failure["rank"] == 1 and "SIGKILL" in failure["reason"]


def test_restarted_workers_get_a_fresh_rendezvous_store() -> None:
    # Without it the agent's shared store still holds the dead workers' addresses and a restart cannot connect.
    assert worker_env({})["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"


def test_a_cpu_plans_ranks_see_no_gpu() -> None:
    """A plan made for CPU ranks (no GPUs in its hardware) run on a GPU node: its ranks must not each take
    cuda:<local rank> (a second rank finds no second GPU), nor DeepSpeed its CUDA accelerator."""
    env = worker_env({"CUDA_VISIBLE_DEVICES": "0,1"}, cpu_plan=True)
    assert env["CUDA_VISIBLE_DEVICES"] == "" and env["DS_ACCELERATOR"] == "cpu"
    assert worker_env({"CUDA_VISIBLE_DEVICES": "0,1"})["CUDA_VISIBLE_DEVICES"] == "0,1"  # a GPU plan's are kept
