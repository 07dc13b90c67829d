"""Checkpoints written in the background: a step waits only for host copies of its shards.

One save, on every rank (docs/RELIABILITY.md, "Asynchronous saves", says why it is built this way):

    foreground, at a step boundary every rank agreed on (`save`)
        the previous save commits first, if it has not yet: one save in flight
        rank 0 checks the free space and makes a fresh step directory; every rank learns the verdict (host all-reduce)
        `snapshot(step_dir)`: host copies of this rank's files (the optimizer's gather over DP is collective, so it
        stays here, in step with the other ranks) and the manifest's fields as of this step
    background, the writer thread: no collective, so it never races the training loop's own
        each file written, fsynced, hashed (FileRecord.of); last, the records (names, sizes, SHA-256) in a small
        file of the step directory for rank 0 (`written_file`): the checkpoint's directory is shared by every rank
        already, and this way the commit needs no collective to gather them
    foreground, at each step boundary (`poll`): the training loop's own host all-reduce carries every rank's
    `writing()` state (MAX: a failure outranks a write still going on)
        every rank done: the ranks agree, at no cost of their own; a failed write on any rank: the same
        CheckpointError on every rank, nothing committed
    background again, rank 0 only
        the records read, then manifest, `latest`, pruning (checkpoint.commit, checkpoint.prune); the training
        thread calls `on_commit` at the first poll (or wait) that finds it done

A process killed at any point before the manifest's rename leaves the previous checkpoint as `latest`. `wait` does
the rest of a save at once (a stop, the last save, a rollback, the next save) and returns when every rank knows it
committed. Collectives run on `group` (the trainer's gloo host group), from the calling thread only.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from appliance.atomic import write_atomic
from appliance.train import checkpoint as ckpt
from appliance.train.faults import FaultInjector

# What `writing()` says, all-reduced with MAX over the ranks at each step boundary: a failed write anywhere outranks
# one still going on elsewhere, so every rank learns of a failure at the same boundary.
DONE, WRITING, FAILED = 0.0, 1.0, 2.0


def written_file(rank: int) -> str:
    """A rank's file records for rank 0's commit, in the step directory (hidden; the commit removes it)."""
    return f".written-rank{rank:05d}.json"


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
    stall_s: float  # what the training loop waited for it: the slowest rank's host copies, and later waits
    bytes: int


@dataclass
class _Save:
    step: int
    step_dir: Path
    started: float
    manifest: dict[str, Any]
    copy_s: float = 0.0  # the foreground of `save` on this rank (rank 0: the slowest rank's, once committed)
    later_s: float = 0.0  # rank 0: what the loop waited for the save afterwards (the next save, a stop, the end)
    records: list[ckpt.FileRecord] = field(default_factory=list)
    error: str = ""
    write_s: float = 0.0  # from `started` until this rank's files were synced (rank 0: the slowest rank's)
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
        # The wait inside the verdict's all-reduce is left out: it is rank 0's preparing, counted on rank 0, plus
        # how far apart the ranks reached this step, which the loop's next collective would absorb without a save.
        save = _Save(step, step_dir, started, taken.manifest, copy_s=(prepared - started) + (time.time() - agreed))
        self._writing = save
        handing_over = time.time()
        self._run(lambda: self._write(save, taken.files))
        save.later_s += time.time() - handing_over  # the writer's start: well under a millisecond, rank 0's only
        if wait:
            self.wait()
        return step_dir

    def writing(self) -> float:
        """This rank's part of the save in flight: WRITING, FAILED, or DONE (also with none), for a MAX all-reduce."""
        if self._writing is None:
            return DONE
        if self._busy():
            return WRITING
        return FAILED if self._writing.error else DONE

    def poll(self, state: float) -> None:
        """At a step boundary, with `writing()`'s MAX over the ranks: a save that every rank has written goes to rank
        0's commit (in the background), a failed one raises on every rank, and a finished commit is reported."""
        if self._writing is not None and state == FAILED:
            self._fail()
        if self._writing is not None and state == DONE:
            self._agreed(later_s=0.0)
        if self._committing is not None and not self._busy():
            self._report_commit()

    def wait(self) -> None:
        """Finish the save in flight, if any: every rank returns once it has committed (or raises, as `poll`)."""
        self._finish(barrier=True)

    def _finish(self, *, barrier: bool) -> None:
        """The rest of the save in flight, at once. `barrier`: no rank returns before rank 0 has committed it."""
        if self._writing is not None:  # the same on every rank: saves start and agree collectively
            began = time.time()
            self._join()
            state = self._all_max(self.writing())
            if state == FAILED:
                self._fail()
            self._agreed(later_s=time.time() - began)  # rank 0's wait covers the slowest writer, via the all-reduce
        if self._committing is not None:  # rank 0
            self._committing.later_s += self._timed_join()
        if barrier and dist.is_initialized():
            began = time.time()
            dist.barrier(group=self.group)
            if self._committing is not None:
                self._committing.later_s += time.time() - began
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
            save.write_s = time.time() - save.started
            written = {"files": [r.__dict__ for r in save.records], "write_s": save.write_s, "copy_s": save.copy_s}
            # No fsync: rank 0 reads it while this save is alive, and a crash voids the save anyway.
            write_atomic(save.step_dir / written_file(self.rank), json.dumps(written).encode(), sync=False)
        except Exception as e:  # ENOSPC, EIO...: every rank learns it at the next step boundary, and nobody commits
            save.error = f"rank {self.rank}: {e}"

    def _fail(self) -> None:
        """A write failed on some rank: every rank raises the same error (this rank's writer ended first)."""
        save, self._writing = self._writing, None
        assert save is not None
        self._join()
        self._raise_failure(save.step, save.error)

    def _agreed(self, *, later_s: float) -> None:
        """Every rank's writer is done: rank 0 commits in the background."""
        save, self._writing = self._writing, None
        assert save is not None
        self._join()  # done already: its thread may only be ending
        if self.rank == 0:
            save.later_s += later_s
            self._committing = save
            self._run(lambda: self._commit(save))

    def _commit(self, save: _Save) -> None:
        """Rank 0's writer thread: every rank's records, then the manifest and `latest`, then pruning."""
        began = time.time()
        try:
            shares = []
            for rank in range(self.world_size):
                path = save.step_dir / written_file(rank)
                shares.append(json.loads(path.read_text()))
                path.unlink()
            save.records = [ckpt.FileRecord(**record) for share in shares for record in share["files"]]
            save.write_s = max(share["write_s"] for share in shares)
            save.copy_s = max(share["copy_s"] for share in shares)
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
                stall_s=save.copy_s + save.later_s,
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
        return -self._all_max(-ok) > 0

    def _all_max(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64, device="cpu")  # a host value on the gloo host group
        if dist.is_initialized():
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return float(t.item())

    def _raise_failure(self, step: int, error: str) -> None:
        """Every rank raises the same message, naming each rank's own cause."""
        causes = [error]
        if dist.is_initialized():
            causes = [""] * self.world_size
            dist.all_gather_object(causes, error, group=self.group)
        reason = "; ".join(c for c in causes if c)
        raise ckpt.CheckpointError(f"checkpoint at step {step} failed, previous one kept: {reason}")
