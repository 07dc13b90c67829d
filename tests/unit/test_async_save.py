"""Checkpoints written in the background (appliance/train/async_save.py), on one process: a save returns once its
files are in host memory, commits only after the next step-boundary poll finds them written, keeps one save in
flight, reports a failed write as the synchronous save did, and a kill during the write leaves the previous
checkpoint as `latest`. Then the trainer's side: the checkpoint event's write time and stall, and what the budget
watch sees."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from test_trainer_late_reads import OK, LateEngine, RecordedStep, events, make_trainer

from appliance.parallel.checkpoint.engine_io import HostFile
from appliance.rundir import RunDir
from appliance.train import checkpoint as ckpt
from appliance.train.async_save import FAILED, WRITING, AsyncCheckpointer, Committed, Snapshot, written_file
from appliance.train.faults import FaultInjector

GATE_S = 0.3  # how long a gated write is held: long beside a commit's fsyncs on a loaded machine (~10-50 ms)


class GatedFile:
    """A checkpoint file whose write waits for `gate`, or fails with `error`."""

    def __init__(self, name: str, gate: threading.Event | None = None, error: OSError | None = None) -> None:
        self.name, self.gate, self.error = name, gate, error

    def write(self, step_dir: Path) -> Path:
        if self.gate is not None:
            assert self.gate.wait(30), "the test never opened the gate"
        if self.error is not None:
            raise self.error
        (step_dir / self.name).write_bytes(b"weights of " + step_dir.name.encode())
        return step_dir / self.name


def checkpointer(root: Path, commits: list[Committed], *, keep_last: int = 5, background: bool = True) -> Any:
    return AsyncCheckpointer(
        root,
        rank=0,
        world_size=1,
        group=None,
        faults=FaultInjector(rank=0, faults=[], attempt=0),
        keep_last=keep_last,
        on_commit=commits.append,
        background=background,
    )


def files(*pending: GatedFile) -> Any:
    return lambda step_dir: Snapshot(list(pending), {"consumed_samples": 0})


def open_later(gate: threading.Event, seconds: float) -> None:
    threading.Timer(seconds, gate.set).start()


def written(saver: AsyncCheckpointer) -> None:
    deadline = time.monotonic() + 30
    while saver.writing() and time.monotonic() < deadline:
        time.sleep(0.01)


def test_a_save_returns_before_its_files_are_written_and_commits_after_a_poll_finds_them_written(
    tmp_path: Path,
) -> None:
    root, commits = tmp_path / "checkpoints", []
    saver = checkpointer(root, commits, keep_last=1)
    saver.save(1, 0, files(GatedFile("model.safetensors")), wait=True)
    assert [c.step for c in commits] == [1] and ckpt.find_latest(root) == root / "step-00000001"

    gate = threading.Event()
    saver.save(2, 0, files(GatedFile("model.safetensors", gate)), wait=False)
    assert saver.writing() == 1.0
    saver.poll(saver.writing())  # this rank still writes: nothing is agreed
    assert not (root / "step-00000002" / ckpt.MANIFEST).exists()
    assert ckpt.find_latest(root) == root / "step-00000001"  # still latest, and not pruned (keep_last 1)
    time.sleep(GATE_S)
    gate.set()
    written(saver)
    saver.poll(saver.writing())  # every rank done: rank 0 commits in the background
    saver.wait()
    assert [c.step for c in commits] == [1, 2]
    assert ckpt.find_latest(root) == root / "step-00000002"
    assert ckpt.verify(root / "step-00000002", verify_hashes=True) == []
    assert not (root / "step-00000001").exists()  # pruned once step 2 committed
    assert not (root / "step-00000002" / written_file(0)).exists()  # the records reached the manifest, then went
    done = commits[-1]
    # The write took the gate and more; the loop waited only for the snapshot and the tail of the commit.
    assert done.seconds >= GATE_S and done.stall_s < done.seconds - GATE_S + 0.1, done
    assert done.bytes == (root / "step-00000002" / "model.safetensors").stat().st_size


def test_the_next_save_waits_for_the_previous_to_commit_and_the_wait_counts_as_stall(tmp_path: Path) -> None:
    root, commits = tmp_path / "checkpoints", []
    saver = checkpointer(root, commits)
    gate = threading.Event()
    saver.save(2, 0, files(GatedFile("model.safetensors", gate)), wait=False)
    committed_at_snapshot: list[list[int]] = []

    def snapshot(step_dir: Path) -> Snapshot:
        committed_at_snapshot.append([c.step for c in commits])
        return Snapshot([GatedFile("model.safetensors")], {})

    open_later(gate, GATE_S)
    saver.save(3, 0, snapshot, wait=True)
    assert committed_at_snapshot == [[2]]  # step 2 was committed before step 3 was even copied
    assert [c.step for c in commits] == [2, 3]
    assert commits[0].stall_s >= GATE_S - 0.05  # the steps waited out step 2's write in step 3's save


def test_a_failed_background_write_fails_every_rank_at_the_next_poll_and_keeps_the_previous(tmp_path: Path) -> None:
    root, commits = tmp_path / "checkpoints", []
    saver = checkpointer(root, commits)
    saver.save(1, 0, files(GatedFile("model.safetensors")), wait=True)
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    saver.save(2, 0, files(GatedFile("rank00000.pt"), GatedFile("model.safetensors", error=full)), wait=False)
    written(saver)
    assert saver.writing() == FAILED  # outranks WRITING in the loop's MAX all-reduce
    with pytest.raises(ckpt.CheckpointError, match=r"step 2 failed, previous one kept: rank 0: .*No space left"):
        saver.poll(saver.writing())
    assert [c.step for c in commits] == [1]
    assert ckpt.find_latest(root) == root / "step-00000001"
    assert not (root / "step-00000002" / ckpt.MANIFEST).exists()


def test_without_background_the_files_are_written_at_once_and_the_commit_still_waits_for_a_poll(
    tmp_path: Path,
) -> None:
    root, commits = tmp_path / "checkpoints", []
    saver = checkpointer(root, commits, background=False)
    saver.save(4, 0, files(GatedFile("model.safetensors")), wait=False)
    assert (root / "step-00000004" / "model.safetensors").is_file() and saver.writing() == 0.0
    saver.poll(WRITING)  # another rank still writes
    assert commits == [] and not (root / "step-00000004" / ckpt.MANIFEST).exists()
    saver.poll(saver.writing())
    assert [c.step for c in commits] == [4] and ckpt.find_latest(root) == root / "step-00000004"


KILLED_MID_WRITE = """
import os, signal, sys, time
from pathlib import Path
from appliance.train.async_save import AsyncCheckpointer, Snapshot
from appliance.train.faults import FaultInjector

class Half:
    def write(self, step_dir):
        path = step_dir / "model.safetensors"
        with open(path, "wb") as f:
            f.write(b"x" * 4096)
            f.flush()
            os.kill(os.getpid(), signal.SIGKILL)

class Whole:
    def write(self, step_dir):
        (step_dir / "model.safetensors").write_bytes(b"y" * 8192)
        return step_dir / "model.safetensors"

saver = AsyncCheckpointer(Path(sys.argv[1]), rank=0, world_size=1, group=None,
                          faults=FaultInjector(rank=0, faults=[], attempt=0), keep_last=5,
                          on_commit=lambda done: None)
saver.save(1, 0, lambda d: Snapshot([Whole()], {}), wait=True)
saver.save(2, 0, lambda d: Snapshot([Half()], {}), wait=False)
print("saved", flush=True)  # the loop went on: the kill comes from the writer thread
time.sleep(60)
"""


def test_a_kill_during_the_background_write_leaves_the_previous_checkpoint_as_latest(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    env = os.environ | {"PYTHONPATH": os.pathsep.join(sys.path)}
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(KILLED_MID_WRITE), str(root)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert result.returncode == -9, result.stderr
    assert (root / "step-00000002" / "model.safetensors").is_file()  # half written, never committed
    assert not (root / "step-00000002" / ckpt.MANIFEST).exists()
    assert ckpt.find_latest(root) == root / "step-00000001"
    assert (root / ckpt.LATEST).read_text().strip() == "step-00000001"


STEP_S, WRITE_S = 0.2, 0.3  # a checkpoint's write spans two of the steps that follow it


class SlowEngine(LateEngine):
    """Steps take STEP_S; the model file takes WRITE_S to write."""

    def train_batch_async(self, micro_batches: list[Any]) -> RecordedStep:
        time.sleep(STEP_S)
        return super().train_batch_async(micro_batches)

    def model_snapshot(self, metadata: Any) -> Any:
        file = super().model_snapshot(metadata)

        class SlowFile(HostFile):
            def write(self, step_dir: Path) -> Path:
                time.sleep(WRITE_S)
                return super().write(step_dir)

        return SlowFile(file.name, file.tensors, file.metadata)


class BudgetRecorder:
    def __init__(self) -> None:
        self.checkpoints: list[float] = []

    def observe_checkpoint(self, seconds: float) -> None:
        self.checkpoints.append(seconds)

    def observe_eval(self, seconds: float) -> None:
        pass

    def after_step(self, step: int, seconds: float, total_steps: int) -> None:
        return None


def test_the_checkpoint_event_has_the_write_time_and_the_stall_and_the_budget_sees_the_stall(tmp_path: Path) -> None:
    """Step 3's save is written during steps 4 and 5 and commits at step 5's boundary: its event names the write
    (>= WRITE_S) and a stall far below it; the last save (step 6) is awaited, so the steps wait out its write."""
    run_dir = RunDir(tmp_path / "run").make()
    trainer = make_trainer(run_dir, SlowEngine([OK] * 6), steps=6, late=False, background=True, save_interval=3)
    budget = BudgetRecorder()
    trainer.budget = budget  # type: ignore[assignment]
    assert trainer.fit() == "done"
    found = [(e["kind"], e.get("step")) for e in events(run_dir) if e["kind"] in ("step", "checkpoint")]
    assert found.index(("checkpoint", 3)) > found.index(("step", 4))  # emitted at commit, after training went on
    middle, last = [e for e in events(run_dir) if e["kind"] == "checkpoint"]
    assert middle["seconds"] >= WRITE_S and middle["stall_s"] < 0.1 * middle["seconds"], middle
    assert last["stall_s"] > 0.5 * WRITE_S, last  # fit returns once the last save committed
    assert budget.checkpoints == [middle["stall_s"], last["stall_s"]]


def test_with_async_checkpoints_off_every_save_blocks_until_committed(tmp_path: Path) -> None:
    run_dir = RunDir(tmp_path / "run").make()
    trainer = make_trainer(
        run_dir, SlowEngine([OK] * 6), steps=6, late=False, background=True, save_interval=3, async_checkpoints=False
    )
    assert trainer.fit() == "done"
    found = [(e["kind"], e.get("step")) for e in events(run_dir) if e["kind"] in ("step", "checkpoint")]
    assert found.index(("checkpoint", 3)) == found.index(("step", 3)) + 1  # committed before step 4 began
    middle, _ = [e for e in events(run_dir) if e["kind"] == "checkpoint"]
    assert middle["stall_s"] >= WRITE_S, middle  # the steps waited out the write
