"""Runs the contenders on the workload: builds each, runs its warm-up and timed steps, profiles PROFILE_STEPS more
when asked, and releases it exactly once.

On CPU (Workload.interleaved) all are built first and take turns, one step each, so that a neighbour's burst on a
shared machine slows them alike; on a GPU one after the other, each released (and the allocator's cache emptied)
before the next is built, its peak memory read in between. A contender that runs out of memory (while building,
warming up or timing) is recorded as such, released, and the others go on.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from appliance.benchmark.profile import PROFILE_STEPS, profile_steps, trace_path
from appliance.benchmark.workload import Batch, Progress, StepTimes, Workload


class Running(Protocol):
    """A built contender: one training step per call, and release() to drop its model and optimizer state."""

    def __call__(self, micro_batches: list[Batch]) -> Any: ...

    def release(self) -> None: ...


@dataclass(frozen=True)
class Contender:
    key: str  # a short name for file names: trainer, hf-eager, hf-compile
    name: str  # the name the JSON and the table give it
    build: Callable[[], Running]  # called in order: a later contender may use what an earlier one built


@dataclass
class Outcome:
    """What one contender's run gave: its step times, or the out-of-memory error that stopped it."""

    times: StepTimes | None = None
    out_of_memory: str | None = None
    skipped: bool = False  # not asked for (bench --contenders)
    peak_memory_gb: float | None = None  # torch.cuda.max_memory_allocated over its run; None on CPU
    profile: dict[str, Any] | None = None

    def to_json(self, work: Workload) -> dict[str, Any]:
        if self.times is not None:
            record = self.times.to_json()
        elif self.skipped:
            record = {"status": "skipped"}
        else:
            record = {"status": "out_of_memory", "micro_batch_size": work.spec.train.micro_batch_size,
                      "tokens_per_step": work.tokens_per_step, "error": self.out_of_memory}  # fmt: skip
        record["peak_memory_gb"] = self.peak_memory_gb
        if self.profile is not None:
            record["profile"] = self.profile
        return record


def run_contenders(contenders: list[Contender], work: Workload, batches: list[list[Batch]], progress: Progress,
                   *, profile_out: Path | None = None) -> dict[str, Outcome]:  # fmt: skip
    """Each contender's Outcome, by name. `profile_out`: the JSON result's path; each contender's trace is written
    beside it (profile.trace_path)."""
    runner = _Runner(work, batches, progress, profile_out)
    if work.interleaved:
        runner.taking_turns(contenders)
    else:
        for contender in contenders:
            runner.one_after_the_other(contender)
    return runner.outcomes


class _Runner:
    def __init__(self, work: Workload, batches: list[list[Batch]], progress: Progress, profile_out: Path | None):
        self.work, self.batches, self.progress, self.profile_out = work, batches, progress, profile_out
        self.cuda = work.device.type == "cuda"
        self.outcomes: dict[str, Outcome] = {}
        self.seconds: dict[str, list[float]] = {}
        self.last: dict[str, float] = {}  # each contender's latest step, for the progress lines

    def one_after_the_other(self, contender: Contender) -> None:
        self.seconds[contender.name] = []
        self._reset_peak_memory()
        built: Running | None = None
        try:
            self.progress(f"  building {contender.name}")
            built = contender.build()
            for i, micro_batches in enumerate(self.batches):
                self._step(contender.name, built, i, micro_batches)
                self._report(i, [contender.name])
            self._finish(contender, built)
        except torch.OutOfMemoryError as e:
            self._out_of_memory(contender.name, e)
        finally:
            if built is not None:
                built.release()
            del built
            self._free_memory()
        self.outcomes[contender.name].peak_memory_gb = self._peak_memory_gb()

    def taking_turns(self, contenders: list[Contender]) -> None:
        running: dict[str, tuple[Contender, Running]] = {}
        for contender in contenders:
            self.seconds[contender.name] = []
            self.progress(f"  building {contender.name}")
            try:
                running[contender.name] = (contender, contender.build())
            except torch.OutOfMemoryError as e:
                self._out_of_memory(contender.name, e)
        for i, micro_batches in enumerate(self.batches):
            for name, (_, built) in list(running.items()):
                try:
                    self._step(name, built, i, micro_batches)
                except torch.OutOfMemoryError as e:
                    self._out_of_memory(name, e)
                    running.pop(name)[1].release()
                    self._free_memory()
            self._report(i, list(running))
        for contender, built in running.values():
            self._finish(contender, built)
            built.release()
        self._free_memory()

    def _step(self, name: str, built: Running, i: int, micro_batches: list[Batch]) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        built(micro_batches)
        if self.cuda:
            torch.cuda.synchronize()
        self.last[name] = time.perf_counter() - start
        if i >= self.work.warmup_steps:
            self.seconds[name].append(self.last[name])

    def _finish(self, contender: Contender, built: Running) -> None:
        outcome = self.outcomes[contender.name] = Outcome(StepTimes(self.seconds[contender.name],
                                                                   self.work.tokens_per_step))  # fmt: skip
        if self.profile_out is None:
            return
        path = trace_path(self.profile_out, contender.key)
        self.progress(f"  profiling {PROFILE_STEPS} steps of {contender.name} -> {path}")
        steps = [self.batches[-1 - i % len(self.batches)] for i in range(PROFILE_STEPS)]
        try:
            outcome.profile = profile_steps(built, steps, self.work.device, path)
        except torch.OutOfMemoryError as e:  # the profiler's buffers on top of the steps': the times stand
            outcome.profile = {"status": "out_of_memory", "error": " ".join(str(e).split())[:400]}

    def _out_of_memory(self, name: str, error: torch.OutOfMemoryError) -> None:
        message = " ".join(str(error).split())[:400]  # the allocator's first lines: asked, total, free, reserved
        self.progress(f"  {name}: out of memory at micro-batch {self.work.spec.train.micro_batch_size}: {message}")
        self.outcomes[name] = Outcome(out_of_memory=message)

    def _report(self, i: int, names: list[str]) -> None:
        n = i - self.work.warmup_steps + 1
        if names and (n <= 0 or n % 5 == 0 or i == len(self.batches) - 1):
            what = "warm-up" if n <= 0 else f"{n}/{self.work.steps}"
            self.progress(f"  step {what}: " + ", ".join(f"{name} {self.last[name]:.3f} s" for name in names))

    def _reset_peak_memory(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.work.device)

    def _peak_memory_gb(self) -> float | None:
        return torch.cuda.max_memory_allocated(self.work.device) / 2**30 if self.cuda else None

    def _free_memory(self) -> None:
        """What a released contender held goes back to the device (the caching allocator keeps it otherwise)."""
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()
