"""Typed events, one JSON object per line in metrics.jsonl.

Ranks and the head process write; the dashboard and the headless printer read. Kinds and keys are public
(docs/ARCHITECTURE.md, "Events"): extend, never rename. Every event carries "t" (unix time) and "kind".
Each writer also hands its events to its sinks: copies for other tools (TensorBoard files, an offline W&B run;
appliance/monitor/sinks.py), after the line is written, so metrics.jsonl stays the source of truth.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from appliance.monitor.event_kinds import EVENT_KINDS

# The keys each kind must carry, from the one declaration of each kind (event_kinds.py).
REQUIRED_KEYS: dict[str, tuple[str, ...]] = {name: kind.required for name, kind in EVENT_KINDS.items()}

STAGE_STATES = ("started", "running", "done", "skipped", "failed", "stopped")  # stopped: preempted, resumable


def make_event(kind: str, **fields: Any) -> dict[str, Any]:
    """Build an event dict, checking the kind and its required keys so a typo fails where it is made."""
    if kind not in REQUIRED_KEYS:
        raise ValueError(f"unknown event kind {kind!r}; known: {sorted(REQUIRED_KEYS)}")
    missing = [k for k in REQUIRED_KEYS[kind] if k not in fields]
    if missing:
        raise ValueError(f"event {kind!r} lacks {missing}")
    if kind == "stage" and fields["state"] not in STAGE_STATES:
        raise ValueError(f"stage state {fields['state']!r} is not one of {STAGE_STATES}")
    return {"t": fields.pop("t", time.time()), "kind": kind, **fields}


class EventSink(Protocol):
    """Receives every event its writer wrote; must never raise (sinks.py's sinks turn themselves off instead)."""

    def write(self, event: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class EventWriter:
    """Appends events to metrics.jsonl. Each event is one write() of a whole line, so concurrent writers
    (head process and rank 0) never interleave inside a line on a local or NFS-with-O_APPEND file.

    sinks: each receives every event after its line is written. The processes that write figures (rank 0, the
    nodes' samplers) get TensorBoard and W&B copies through sinks.writer_with_sinks; this module knows no sink."""

    def __init__(self, path: Path, echo: bool = False, sinks: list[EventSink] | None = None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640)
        self.echo = echo
        self.sinks: list[EventSink] = list(sinks or [])

    def emit(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = make_event(kind, **fields)
        line = json.dumps(event, separators=(",", ":"), allow_nan=True) + "\n"
        os.write(self._fd, line.encode("utf-8"))
        for sink in self.sinks:
            sink.write(event)
        return event

    def warn(self, message: str) -> None:
        """A warning event (what a sink says when it turns itself off)."""
        self.emit("warning", message=message)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> EventWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class EventTail:
    """Reads new complete lines from metrics.jsonl, incrementally.

    Copes with what a live run does to the file: it may not exist yet, its last line may be half-written
    (kept in a buffer until its newline arrives), and it may be replaced (a new inode or a shorter file
    restarts from the beginning).
    """

    path: Path
    _offset: int = 0
    _inode: int | None = None
    _partial: bytes = b""
    bad_lines: int = field(default=0)
    bytes_read: int = field(default=0)  # read from the file by this tail, in all: what an attach costs

    def start_at(self, offset: int) -> None:
        """Read from byte `offset` (a line boundary) on: the end of what a loaded snapshot covers."""
        self._offset, self._partial, self._inode = offset, b"", None

    @property
    def complete_offset(self) -> int:
        """Where the complete lines read so far end (a half-written last line is not covered)."""
        return self._offset - len(self._partial)

    def read_new(self) -> list[dict[str, Any]]:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return []
        if self._inode is not None and (st.st_ino != self._inode or st.st_size < self._offset):
            self._offset, self._partial = 0, b""
        self._inode = st.st_ino
        if st.st_size == self._offset:
            return []
        with open(self.path, "rb") as f:
            f.seek(self._offset)
            chunk = f.read(st.st_size - self._offset)
        self._offset += len(chunk)
        self.bytes_read += len(chunk)
        data = self._partial + chunk
        lines = data.split(b"\n")
        self._partial = lines.pop()  # b"" when the chunk ended on a newline
        events = []
        for raw in lines:
            if not raw.strip():
                continue
            try:
                events.append(json.loads(raw))
            except json.JSONDecodeError:
                self.bad_lines += 1
        return events


def read_events(path: Path) -> Iterator[dict[str, Any]]:
    """All complete events of a finished (or live) run, in order."""
    yield from EventTail(Path(path)).read_new()


def read_events_backwards(path: Path, block_bytes: int = 1 << 16) -> Iterator[dict[str, Any]]:
    """The complete events of metrics.jsonl, newest first, read from the end of the file in blocks: finding a recent
    event costs a block or two, not the whole file (days of a 384-GPU run)."""
    try:
        f = open(path, "rb")  # noqa: SIM115 (the generator holds it open between yields)
    except FileNotFoundError:
        return
    with f:
        end = f.seek(0, os.SEEK_END)
        cut = b""  # the start of a line whose beginning lies in the block before
        while end > 0:
            start = max(0, end - block_bytes)
            f.seek(start)
            lines = (f.read(end - start) + cut).split(b"\n")
            end = start
            cut = lines.pop(0) if start > 0 else b""
            for raw in reversed(lines):
                event = _parse_line(raw)
                if event is not None:
                    yield event


def _parse_line(raw: bytes) -> dict[str, Any] | None:
    """One event, or None for a blank, half-written or foreign line."""
    if not raw.strip():
        return None
    try:
        event = json.loads(raw)
    except json.JSONDecodeError:
        return None
    return event if isinstance(event, dict) else None


def finite(value: Any) -> float | None:
    """A finite float, or None for missing, null, NaN or non-numeric values."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None
