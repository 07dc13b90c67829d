"""A saved reducer state, so that attaching to a months-long run reads only the newest events, not all of them.

A BLOOM-176B run on 48 nodes writes ~19 events/s (every node's gpu and energy samples every 5 s): over a gigabyte
of metrics.jsonl a day, which the reducer folds at 15-40k events/s, i.e. a minute or more per day of run. Yet the
RunState that comes out is bounded (curves as min/max buckets, the newest sample per node, short deques), so a
process that follows the run anyway (the head's headless follower, the dashboard) saves it every few minutes,
with the byte offset of metrics.jsonl it covers; an attaching reader loads it and folds only the bytes after that
offset. metrics.jsonl stays the source of truth: the snapshot is a cache, and any doubt about it means a full read.

The file, `metrics.snapshot` beside metrics.jsonl: one JSON header line, then the RunState as JSON
(monitor/snapshot_codec.py).
  header: format, version, shape (a hash of every reducer class's field names), offset (where the covered events
          end, at a line boundary), head_sha256 (the file's first bytes) and edge_sha256 (the bytes just before
          offset): the metrics.jsonl it was taken from, payload_sha256 and payload_bytes (corruption), saved_t.
A snapshot is used only when every check holds; otherwise `load_snapshot` says why (and `attach` logs it as a
warning, when there was a snapshot to refuse) and the caller re-reads the whole file (never a wrong dashboard).
Written atomically (a temporary file, then os.replace), so a reader never sees half of one, and two savers
(follower and dashboard) only replace each other's complete files.

The checksums only catch damage: whoever writes the file writes them too, and a run directory is what people copy
between machines. So the payload is data and nothing else: JSON, read by code that knows each class a RunState
holds and checks every field's type (snapshot_codec.py), never a pickle, so a crafted file can at worst be refused.
Version 1 was a pickle: it is refused like any other version. A change to what a field means without a change to
the fields' names must bump VERSION.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from appliance.monitor import eval_report, gpu, snapshot_codec, state, state_fields
from appliance.monitor.events import EventTail
from appliance.monitor.state import RunState

log = logging.getLogger(__name__)

FORMAT = "bloom-appliance reducer snapshot"
VERSION = 2  # 1: the payload was a pickle
SNAPSHOT_NAME = "metrics.snapshot"
FINGERPRINT_BYTES = 4096  # hashed at the file's start and before the offset: a replaced or rewritten file differs
SAVE_EVERY_S = 300.0  # a follower saves every 5 min: an attach then folds at most ~5,800 events of 48 nodes
SAVE_MIN_NEW_BYTES = 1 << 20  # and only after 1 MB of new events (~70 s at 48 nodes): small runs read fast anyway

_REDUCER_MODULES = (state, state_fields, gpu, eval_report)


def snapshot_path(metrics: Path) -> Path:
    return Path(metrics).with_name(SNAPSHOT_NAME)


def reducer_shape() -> str:
    """A hash of the field names of every class a RunState holds: a snapshot from code with another shape is
    refused instead of being read into objects that lack (or misread) a field."""
    shapes = []
    for module in _REDUCER_MODULES:
        for name, obj in sorted(vars(module).items()):
            if isinstance(obj, type) and obj.__module__ == module.__name__:
                names = [f.name for f in dataclasses.fields(obj)] if dataclasses.is_dataclass(obj) else []
                shapes.append(f"{module.__name__}.{name}:{','.join(names)}:{','.join(getattr(obj, '__slots__', ()))}")
    return hashlib.sha256("\n".join(shapes).encode()).hexdigest()[:16]


def _fingerprints(metrics: Path, offset: int) -> tuple[str, str]:
    """sha256 of the first bytes of metrics.jsonl and of the bytes just before `offset`."""
    with open(metrics, "rb") as f:
        head = f.read(min(offset, FINGERPRINT_BYTES))
        start = max(0, offset - FINGERPRINT_BYTES)
        f.seek(start)
        edge = f.read(offset - start)
    if len(edge) != offset - start:
        raise ValueError(f"{metrics} is shorter than the snapshot's offset {offset}")
    return hashlib.sha256(head).hexdigest(), hashlib.sha256(edge).hexdigest()


def save_snapshot(metrics: Path, run_state: RunState, offset: int) -> Path:
    """Write the snapshot of `run_state`, which folded exactly the events of metrics.jsonl before byte `offset`
    (a line boundary). Atomic. Raises OSError when the run directory is not writable, ValueError when
    metrics.jsonl no longer holds `offset` bytes or the state holds a value the codec cannot write."""
    metrics = Path(metrics)
    head, edge = _fingerprints(metrics, offset)
    payload = snapshot_codec.encode(run_state)
    header = {
        "format": FORMAT,
        "version": VERSION,
        "shape": reducer_shape(),
        "offset": offset,
        "head_sha256": head,
        "edge_sha256": edge,
        "payload_sha256": hashlib.sha256(payload).hexdigest(),
        "payload_bytes": len(payload),
        "saved_t": time.time(),
    }
    target = snapshot_path(metrics)
    tmp = target.with_name(f".{SNAPSHOT_NAME}.{os.getpid()}.{id(run_state)}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(json.dumps(header).encode() + b"\n" + payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


@dataclass
class Loaded:
    """What load_snapshot found: a state and the offset it covers, or None and why not."""

    state: RunState | None
    offset: int
    reason: str  # "" when the snapshot was used
    refused: bool = False  # there was a snapshot, and a check failed (not merely no file)


def load_snapshot(metrics: Path) -> Loaded:
    """The saved state of metrics.jsonl if it is there and every check holds, else Loaded(None, 0, why)."""
    metrics = Path(metrics)
    path = snapshot_path(metrics)
    try:
        with open(path, "rb") as f:
            header = json.loads(f.readline())
            payload = f.read()
        problem = _header_problem(metrics, path, header, payload)
        if problem:
            return Loaded(None, 0, problem, refused=True)
        loaded = snapshot_codec.decode(payload)
    except FileNotFoundError:
        return Loaded(None, 0, f"no {path.name}")
    except (OSError, ValueError) as exc:  # SnapshotDataError and json's errors are ValueErrors
        return Loaded(None, 0, f"{path} cannot be read: {type(exc).__name__}: {exc}", refused=True)
    loaded.changed = set(state_fields.SECTIONS)  # everything is new to the reader that loads it
    return Loaded(loaded, header["offset"], "")


def _header_problem(metrics: Path, path: Path, header: Any, payload: bytes) -> str:
    """Why the header rules the payload out ("" when it does not): another format, version or reducer, another
    metrics.jsonl, or damage."""
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        return f"{path} is not a reducer snapshot"
    if header.get("version") != VERSION or header.get("shape") != reducer_shape():
        return f"{path} was written by another version of the reducer"
    offset = header.get("offset")
    if not isinstance(offset, int) or offset < 0 or metrics.stat().st_size < offset:
        return f"{path} covers {offset} bytes, more than {metrics} holds"
    if _fingerprints(metrics, offset) != (header.get("head_sha256"), header.get("edge_sha256")):
        return f"{path} was taken from another {metrics.name} (its bytes differ)"
    if len(payload) != header.get("payload_bytes") or hashlib.sha256(payload).hexdigest() != header.get(
        "payload_sha256"
    ):
        return f"{path} is damaged (its checksum does not match)"
    return ""


def attach(metrics: Path) -> tuple[RunState, EventTail, Loaded]:
    """A state and a tail positioned after it: from the snapshot when it is valid, else empty at byte 0 (with a
    warning naming why, when a snapshot was there)."""
    loaded = load_snapshot(metrics)
    tail = EventTail(Path(metrics))
    if loaded.state is None:
        if loaded.refused:
            log.warning("%s; reading all of %s instead", loaded.reason, Path(metrics).name)
        return RunState(), tail, loaded
    tail.start_at(loaded.offset)
    return loaded.state, tail, loaded


class SnapshotSaver:
    """Saves the state of a reader that follows metrics.jsonl, every `every_s` seconds once `min_new_bytes`
    arrived. Best effort: a read-only run directory (a viewer without write access) turns it off, silently, since
    the snapshot only saves time; so does a state holding a value the codec cannot write (with a warning)."""

    def __init__(self, metrics: Path, every_s: float = SAVE_EVERY_S, min_new_bytes: int = SAVE_MIN_NEW_BYTES) -> None:
        self.metrics, self.every_s, self.min_new_bytes = Path(metrics), every_s, min_new_bytes
        self.saved_offset = 0
        self._saved_at = time.monotonic()
        self.enabled = True

    def maybe_save(self, run_state: RunState, tail: EventTail, *, force: bool = False) -> bool:
        """Save when due (or `force`, at the end of a follow); True when a snapshot was written."""
        offset = tail.complete_offset
        if not self.enabled or offset - self.saved_offset < self.min_new_bytes:
            return False
        if not force and time.monotonic() - self._saved_at < self.every_s:
            return False
        try:
            save_snapshot(self.metrics, run_state, offset)
        except snapshot_codec.SnapshotDataError as exc:
            log.warning("%s: not saving %s: %s", self.metrics.parent, SNAPSHOT_NAME, exc)
            self.enabled = False  # the state keeps what the codec cannot write: trying at every poll would only spin
            return False
        except ValueError:
            return False  # metrics.jsonl shrank under the reader (replaced): the next save tries again
        except OSError:
            self.enabled = False
            return False
        self.saved_offset, self._saved_at = offset, time.monotonic()
        return True
