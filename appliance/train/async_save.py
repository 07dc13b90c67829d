"""Checkpoints written in the background: a step waits only for host copies of its shards.

One save, on every rank (docs/RELIABILITY.md, "Asynchronous saves", says why it is built this way):

    foreground, at a step boundary every rank agreed on (`save`)
        the previous save commits first, if it has not yet: one save in flight
        rank 0 checks the free space and makes a fresh step directory; every rank learns the verdict (host all-reduce)
        `snapshot(step_dir)`: host copies of this rank's files (the optimizer's gather over DP is collective, so it
        stays here, in step with the other ranks) and the manifest's fields as of this step
    background, the writer thread: no collective, so it never races the training loop's own
        each file written, fsynced, hashed (FileRecord.of)
    foreground, at the first step-boundary poll that finds every rank's writer done (`poll`): the training loop's
    own host all-reduce carries this rank's `writing()` flag, so learning when to agree costs no collective
        every rank's file records to rank 0 (all_gather_object on the host group); a failed write on any rank: the
        same CheckpointError on every rank, nothing committed
    background again, rank 0 only
        manifest, `latest`, pruning (checkpoint.commit, checkpoint.prune); the training thread calls `on_commit`
        at the first poll (or wait) that finds it done

A process killed at any point before the manifest's rename leaves the previous checkpoint as `latest`. `wait` does
the rest of a save at once (a stop, the last save, a rollback, the next save) and returns when every rank knows it
committed. Collectives run on `group` (the trainer's gloo host group), from the calling thread only.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from appliance.train import checkpoint as ckpt
from appliance.train.faults import FaultInjector


class PendingFile(Protocol):
    """A checkpoint file held in host memory: `write` puts it in the step directory and returns its path."""

    def write(self, step_dir: Path) -> Path: ...


@dataclass(frozen=True)
class TorchFile:
    """A file of `torch.save` (loaded back with weights_only=True): the per-rank RNG states."""

    name: str
    payload: dict[str, Any]

    def write(self, step_dir: Path) -> Path:
        torch.save(self.payload, step_dir / self.name)
        return step_dir / self.name


@dataclass(frozen=True)
class Snapshot:
    """One rank's share of a checkpoint, taken in the foreground: its files, in the order they are written, and the
    manifest's fields as of the save's step (rank 0 commits them)."""

    files: Sequence[PendingFile]
    manifest: dict[str, Any]


@dataclass(frozen=True)
class Committed:
    """A save that rank 0 has committed: what the `checkpoint` event says."""

    step: int
    path: Path
    seconds: float  # the write: host copies, the slowest rank's files, and rank 0's commit
    stall_s: float  # what the training loop waited for it, on the slowest rank
    bytes: int


@dataclass
class _Save:
    step: int
    step_dir: Path
    started: float
    manifest: dict[str, Any]
    stall_s: float = 0.0  # foreground seconds so far
    records: list[ckpt.FileRecord] = field(default_factory=list)
    error: str = ""
    write_s: float = 0.0  # from `started` until this rank's files were synced
    commit_s: float = 0.0  # rank 0: manifest, latest and pruning


class AsyncCheckpointer:
    """Saves of one rank, one in flight at a time. Every method but `writing` is collective over `group`: every rank
    calls it at the same point of training.

    background=False writes the files and commits in the calling thread, at once, but keeps the protocol (the
    commit still waits for the next poll), so tests can fix the timing."""

    def __init__(
        self,
        root: Path,
        *,
        rank: int,
        world_size: int,
        group: dist.ProcessGroup | None,
        faults: FaultInjector,
        keep_last: int,
        on_commit: Callable[[Committed], None],
        background: bool = True,
    ) -> None:
        self.root = root
        self.rank, self.world_size, self.group = rank, world_size, group
        self.faults = faults
        self.keep_last = keep_last
        self.on_commit = on_commit
        self.background = background
        self._writing: _Save | None = None  # files being written, or written and not yet agreed on
        self._committing: _Save | None = None  # rank 0: agreed, commit running or done and not yet reported
        self._thread: threading.Thread | None = None
        self._commit_error: BaseException | None = None

    # ---- what the training loop calls -------------------------------------------------------------------
    def save(self, step: int, needed_bytes: int, snapshot: Callable[[Path], Snapshot], *, wait: bool) -> Path:
        """Start a save of this step (after the previous one commits); with `wait`, return once it has committed."""
        self._finish(barrier=False)  # one save in flight: rank 0 commits the previous before it makes a new directory
        started = time.time()
        ok, error = 1.0, ""
        if self.rank == 0:
            try:
                ckpt.check_free_space(self.root.parent, needed_bytes)
                ckpt.prepare_step_dir(self.root, step)
            except (OSError, ckpt.CheckpointError) as e:
                ok, error = 0.0, str(e)
        prepared = time.time()
        if not self._all_agree(ok):
            self._raise_failure(step, error)
        agreed = time.time()
        step_dir = self.root / ckpt.step_dir_name(step)
        taken = snapshot(step_dir)
        save = _Save(step, step_dir, started, taken.manifest)
        self._writing = save
        self._run(lambda: self._write(save, taken.files))
        # The wait inside the verdict's all-reduce is left out: it is rank 0's preparing, counted on rank 0, plus
        # how far apart the ranks reached this step, which the loop's next collective would absorb without a save.
        save.stall_s = (prepared - started) + (time.time() - agreed)
        if wait:
            self.wait()
        return step_dir

    def writing(self) -> float:
        """1.0 while this rank's writer is still on the save in flight, else 0.0: for the loop's MAX all-reduce."""
        return float(self._writing is not None and self._busy())

    def poll(self, *, writing_anywhere: bool) -> None:
        """At a step boundary, after the all-reduce of `writing()`: agree on a save whose files every rank has written
        (rank 0 then commits it in the background), and report a commit that has finished."""
        if self._writing is not None and not writing_anywhere:
            self._agree()
        if self._committing is not None and not self._busy():
            self._report_commit()

    def wait(self) -> None:
        """Finish the save in flight, if any: every rank returns once it has committed (or raises, as `poll`)."""
        self._finish(barrier=True)

    def _finish(self, *, barrier: bool) -> None:
        """The rest of the save in flight, at once. `barrier`: no rank returns before rank 0 has committed it."""
        if self._writing is not None:  # the same on every rank: saves start and agree collectively
            self._writing.stall_s += self._timed_join()
            self._agree()
        if self._committing is not None:  # rank 0
            self._committing.stall_s += self._timed_join()
        if barrier and dist.is_initialized():
            began = time.time()
            dist.barrier(group=self.group)
            if self._committing is not None:
                self._committing.stall_s += time.time() - began
        if self._committing is not None:
            self._report_commit()

    # ---- the steps of one save -----------------------------------------------------------------------------
    def _write(self, save: _Save, files: Sequence[PendingFile]) -> None:
        """The writer thread's part (or the caller's, without background): no collective here."""
        try:
            self.faults.before_write(save.step)
            for index, pending in enumerate(files):
                if index > 0:
                    self.faults.during_write(save.step)
                save.records.append(ckpt.FileRecord.of(pending.write(save.step_dir)))
            self.faults.in_save(save.step)
        except Exception as e:  # ENOSPC, EIO...: every rank learns it when the ranks agree, and nobody commits
            save.error = f"rank {self.rank}: {e}"
        save.write_s = time.time() - save.started

    def _agree(self) -> None:
        """Every rank's writer is done: gather the records and the errors; rank 0 commits in the background."""
        save, self._writing = self._writing, None
        assert save is not None
        self._join()
        began = time.time()
        mine = (save.records, save.error, save.write_s, save.stall_s)
        gathered: list[Any] = [mine]
        if dist.is_initialized():
            gathered = [None] * self.world_size
            dist.all_gather_object(gathered, mine, group=self.group)
        causes = [error for _, error, _, _ in gathered if error]
        if causes:
            raise ckpt.CheckpointError(f"checkpoint at step {save.step} failed, previous one kept: {'; '.join(causes)}")
        save.records = [record for records, _, _, _ in gathered for record in records]
        save.write_s = max(write_s for _, _, write_s, _ in gathered)
        save.stall_s = max(stall_s for _, _, _, stall_s in gathered) + time.time() - began
        if self.rank == 0:
            self._committing = save
            self._run(lambda: self._commit(save))

    def _commit(self, save: _Save) -> None:
        began = time.time()
        try:
            ckpt.commit(self.root, save.step, save.records, save.manifest)
            ckpt.prune(self.root, self.keep_last)
        except BaseException as e:  # raised by the next `wait` or `poll` in the training thread
            self._commit_error = e
        save.commit_s = time.time() - began

    def _report_commit(self) -> None:
        save, self._committing = self._committing, None
        assert save is not None
        if self._commit_error is not None:
            raise self._commit_error
        self.on_commit(
            Committed(
                step=save.step,
                path=save.step_dir,
                seconds=save.write_s + save.commit_s,
                stall_s=save.stall_s,
                bytes=sum(r.bytes for r in save.records),
            )
        )

    # ---- plumbing ------------------------------------------------------------------------------------------
    def _run(self, job: Callable[[], None]) -> None:
        if not self.background:
            job()
            return
        # A daemon: a rank that fails mid-run exits without finishing a write nobody will commit.
        self._thread = threading.Thread(target=job, name="checkpoint-writer", daemon=True)
        self._thread.start()

    def _busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _join(self) -> None:
        if self._thread is not None:
            self._thread.join()

    def _timed_join(self) -> float:
        began = time.time()
        self._join()
        return time.time() - began

    def _all_agree(self, ok: float) -> bool:
        t = torch.tensor([ok], dtype=torch.float64)
        if dist.is_initialized():
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return bool(t.item())

    def _raise_failure(self, step: int, error: str) -> None:
        """Every rank raises the same message, naming each rank's own cause."""
        causes = [error]
        if dist.is_initialized():
            causes = [""] * self.world_size
            dist.all_gather_object(causes, error, group=self.group)
        reason = "; ".join(c for c in causes if c)
        raise ckpt.CheckpointError(f"checkpoint at step {step} failed, previous one kept: {reason}")
