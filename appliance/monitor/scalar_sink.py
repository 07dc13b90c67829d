"""What the TensorBoard and W&B sinks share (tensorboard.py, wandb_sink.py): the step their node samples are plotted
at, one lock, and the rule that a monitoring copy never stops training (a failing sink turns itself off with one
warning)."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from appliance.monitor.events import read_events_backwards


class StepClock:
    """The training step that node samples (`gpu`, `energy`: they carry none) are plotted at. The process that
    writes `step` events knows it; a sampler on another node reads the newest `step` event of metrics.jsonl, from
    the end of the file, at most once per `refresh_s` (a few blocks read, not the whole file)."""

    def __init__(self, metrics: Path, refresh_s: float = 30.0, max_events: int = 2000) -> None:
        self.metrics, self.refresh_s, self.max_events = metrics, refresh_s, max_events
        self.step: int | None = None  # from this process's own step events
        self._read_step = 0
        self._read_at = -math.inf

    def saw(self, event: dict[str, Any]) -> None:
        if event.get("kind") == "step":
            self.step = int(event["step"])

    def now(self) -> int:
        if self.step is not None:
            return self.step
        if time.monotonic() - self._read_at >= self.refresh_s:
            self._read_at = time.monotonic()
            for seen, event in enumerate(read_events_backwards(self.metrics)):
                if event.get("kind") == "step":
                    self._read_step = int(event["step"])
                    break
                if seen >= self.max_events:  # no step among the newest events: keep the last one found
                    break
        return self._read_step


class ScalarSink:
    """An EventSink (events.py) that copies the figures of the events it is given somewhere else. A subclass says
    how (`copy`) and what its warning names when it stops (`stopped`); `write` never raises."""

    def __init__(self, run_root: Path, warn: Callable[[str], None]) -> None:
        self.warn = warn
        self.clock = StepClock(Path(run_root) / "metrics.jsonl")
        self.off = False
        self._lock = threading.RLock()  # re-entered: a warning goes through the writer back here

    def write(self, event: dict[str, Any]) -> None:
        # Rank 0's writer is shared by the training loop and its node's sampler thread.
        with self._lock:
            if self.off:
                return
            try:
                self.copy(event)
            except Exception as exc:  # a monitoring copy must never stop training
                self.off = True
                self.warn(f"{self.stopped()}: {type(exc).__name__}: {exc}")

    def copy(self, event: dict[str, Any]) -> None:
        raise NotImplementedError

    def stopped(self) -> str:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError
