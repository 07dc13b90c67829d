"""Idempotent stages: rerunning a run directory skips every stage whose outputs are complete and unchanged.

stages.json records, per stage, a hash of what went in (input files and settings) and of what came out, and when
it was done (`done_t`, which a rerun's `skipped` event repeats). A stage is skipped only when both hashes still
match, so an interrupted stage (no record), an edited input, or a damaged output runs again; a crashed or preempted
run continues where it stopped.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Protocol

from appliance.atomic import write_atomic
from appliance.errors import Preempted
from appliance.monitor.events import EventWriter

# Above this size a file is fingerprinted by size and modification time instead of content: hashing a
# terabyte of .bin files on every rerun would cost more than the stage it protects.
FULL_HASH_LIMIT = 256 << 20


class Progress(Protocol):
    def __call__(self, fraction: float, message: str = "") -> None: ...


def fingerprint(paths: Iterable[Path]) -> str:
    digest = hashlib.sha256()
    for root in sorted(Path(p) for p in paths):
        files = sorted(f for f in root.rglob("*") if f.is_file()) if root.is_dir() else [root]
        for f in files:
            if not f.exists():
                digest.update(f"missing:{f}".encode())
                continue
            st = f.stat()
            digest.update(f"{f.relative_to(root.parent) if root.is_dir() else f.name}:{st.st_size}".encode())
            if st.st_size > FULL_HASH_LIMIT:
                digest.update(str(st.st_mtime_ns).encode())
                continue
            with open(f, "rb") as fh:
                while block := fh.read(1 << 20):
                    digest.update(block)
    return digest.hexdigest()


def settings_key(**settings: Any) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()


class Stages:
    def __init__(self, manifest: Path, events: EventWriter) -> None:
        self.manifest = manifest
        self.events = events
        self.records: dict[str, Any] = json.loads(manifest.read_text()) if manifest.exists() else {}

    def is_complete(self, name: str, key: str, outputs: list[Path]) -> bool:
        rec = self.records.get(name)
        if not rec or rec["key"] != key or not all(p.exists() for p in outputs):
            return False
        return bool(rec["outputs"] == fingerprint(outputs))

    def run(self, name: str, *, key: str, outputs: list[Path], work: Callable[[Progress], Any]) -> bool:
        """Runs `work(progress)` unless the stage is complete. Returns True when it ran."""
        if self.is_complete(name, key, outputs):
            # When it was done, for a rerun's "plan: done <date>, skipped" (records older than done_t have none).
            done = self.records[name].get("done_t")
            self.events.emit("stage", name=name, state="skipped", progress=1.0, **({"done_t": done} if done else {}))
            return False
        started = time.time()
        self.events.emit("stage", name=name, state="started", progress=0.0)
        last_emit, last_fraction = [0.0], [0.0]

        def progress(fraction: float, message: str = "") -> None:
            last_fraction[0] = min(max(fraction, 0.0), 1.0)
            now = time.time()
            if now - last_emit[0] >= 1.0:  # at most one event a second per stage
                last_emit[0] = now
                detail = {"message": message} if message else {}
                self.events.emit("stage", name=name, state="running", progress=round(last_fraction[0], 4), **detail)

        try:
            work(progress)
        except Preempted:
            self.events.emit("stage", name=name, state="stopped", progress=last_fraction[0])
            raise
        except BaseException as e:
            self.events.emit("stage", name=name, state="failed", progress=last_fraction[0], error=str(e)[:500])
            raise
        done = time.time()
        self.records[name] = {"key": key, "outputs": fingerprint(outputs), "seconds": done - started, "done_t": done}
        write_atomic(self.manifest, json.dumps(self.records, indent=1, sort_keys=True).encode())
        self.events.emit("stage", name=name, state="done", progress=1.0, seconds=done - started)
        return True

    def refix(self, name: str, *, key: str, outputs: list[Path]) -> None:
        """Record a completed stage's new key and outputs after a later step rewrote them on purpose (the plan, once
        the corpus has sized it), so that a rerun skips the stage instead of redoing it under the new settings."""
        if name in self.records:
            self.records[name] = {**self.records[name], "key": key, "outputs": fingerprint(outputs)}
            write_atomic(self.manifest, json.dumps(self.records, indent=1, sort_keys=True).encode())

    def seconds(self) -> dict[str, float]:
        return {name: rec.get("seconds", 0.0) for name, rec in self.records.items()}
