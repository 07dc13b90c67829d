"""Which nodes of an elastic launch are alive, read from the run directory every node mounts: each node beats a small
file, and the others notice, on their own clocks, when it stops.

Imports nothing beyond the standard library and the run directory's writers: a spare's standby (train/standby.py)
reads and writes these files without torch.

    control/node-beats/<node>.json   the node's beat, rewritten every `beat_s` by the process that stands for the
        node: the agent wrapper of a training node (train/agent.py: it outlives every restart of its ranks) or a
        spare's standby. Its role: "training", "standby", "joining" (a standby starting its agent) or "ended" (the
        agent finished: a silence after that is no loss). Rewritten in place, not renamed over: a reader's open()
        revalidates the one inode, where NFS may serve a renamed-over name from its directory cache for tens of
        seconds.
    control/node-beats/lost/<node>@<incarnation>.json   a silence declared (O_EXCL: one watcher declares each, and
        writes its event)
    control/node-beats/claims/<lost marker>   a spare's claim on a lost node's place (O_EXCL: two spares never take
        the same place); `grow-...` claims are places below the plan's node count
    control/node-beats/aborted/<node>-<pid>   ranks a watcher stopped because a peer fell silent (the head's log
        watcher then does not report them as crashes)

A beat is fresh while its sequence number (or its incarnation: the process that writes it) keeps changing, measured
on the watcher's monotonic clock. Only a beat's first reading trusts the writer's clock (written within the silence
timeout: alive then), so a file an earlier launch left is never declared silent, and the clocks of two nodes are
never compared again.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from appliance.atomic import FILE_MODE
from appliance.errors import BadInput
from appliance.rundir import RunDir

# A node beats every NODE_BEAT_S and is declared lost after NODE_SILENT_S without a new beat (five missed): seconds,
# where the collectives' own timeout is minutes (train/collective_timeout.py) and the rendezvous's keep-alives
# 15 s. Each watcher reads one small file per node per beat: 48 nodes read 48 files every 2 s, a load any shared file
# system carries. BLOOM_NODE_BEAT (beat_s=..,silent_s=..) sets other timings, e.g. shorter ones for a test.
NODE_BEAT_S = 2.0
NODE_SILENT_S = 10.0
NODE_BEAT_ENV = "BLOOM_NODE_BEAT"
# A beat file holds one JSON object padded to this size, rewritten with one write: a reader that catches it half
# written finds no valid JSON and keeps what it had.
BEAT_BYTES = 512

# A node's role in its beat. JOINING: a standby that claimed a place and starts its agent, whose first beat says
# TRAINING (no watcher counts it as either meanwhile).
TRAINING, STANDBY, JOINING, ENDED = "training", "standby", "joining", "ended"


@dataclass(frozen=True)
class Timings:
    beat_s: float = NODE_BEAT_S
    silent_s: float = NODE_SILENT_S


def timings(env: dict[str, str] | None = None) -> Timings:
    """The beat and silence timings, from BLOOM_NODE_BEAT when set (`beat_s=0.5,silent_s=3`)."""
    text = (os.environ if env is None else env).get(NODE_BEAT_ENV, "")
    values = asdict(Timings())
    for item in filter(None, text.split(",")):
        key, sep, value = item.partition("=")
        try:
            number = float(value)
        except ValueError:
            number = -1.0
        if not sep or key.strip() not in values or number <= 0:
            raise BadInput(f"{NODE_BEAT_ENV}={text!r}: {item!r} is not beat_s=SECONDS or silent_s=SECONDS")
        values[key.strip()] = number
    found = Timings(**values)
    if found.silent_s <= 2 * found.beat_s:
        raise BadInput(f"{NODE_BEAT_ENV}={text!r}: silent_s must exceed two beats (beat_s {found.beat_s:g})")
    return found


def beats_dir(run_dir: RunDir) -> Path:
    return run_dir.control / "node-beats"


def file_name(node: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", node)


@dataclass(frozen=True)
class Beat:
    node: str  # <host>/node<R>
    rank: int  # the node rank the user gave it
    role: str  # TRAINING, STANDBY or ENDED
    pid: int
    host: str
    since: float  # when this process began beating (with host and pid: its incarnation)
    seq: int
    t: float  # the writer's clock, for people; silence is measured on the reader's

    @property
    def incarnation(self) -> str:
        return f"{self.host}-{self.pid}-{int(self.since * 1000)}"

    @property
    def lost_name(self) -> str:
        """The name of this incarnation's lost marker (and of a claim on its place)."""
        return f"{file_name(self.node)}@{file_name(self.incarnation)}.json"


def read_beat(path: Path) -> Beat | None:
    try:
        record = json.loads(path.read_bytes().decode("utf-8", errors="replace").strip())
        return Beat(**{k: record[k] for k in Beat.__dataclass_fields__})
    except (OSError, ValueError, KeyError, TypeError):
        return None  # half written, or not a beat


class BeatWriter:
    """One node's beat: `beat()` rewrites its file with the next sequence number."""

    def __init__(self, run_dir: RunDir, node: str, rank: int, role: str) -> None:
        self.path = beats_dir(run_dir) / f"{file_name(node)}.json"
        self.node, self.rank, self.role = node, rank, role
        self.since = time.time()
        self.seq = 0

    def beat(self, role: str | None = None) -> Beat:
        self.role = role or self.role
        self.seq += 1
        record = Beat(
            self.node, self.rank, self.role, os.getpid(), socket.gethostname(), self.since, self.seq, time.time()
        )
        data = json.dumps(asdict(record)).encode().ljust(BEAT_BYTES)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, FILE_MODE)
        try:
            os.pwrite(fd, data, 0)
        finally:
            os.close(fd)
        return record


@dataclass
class Seen:
    beat: Beat
    changed_at: float  # monotonic, on this watcher's clock
    observed: bool  # seen alive: beating when first read, or changing since


class BeatWatch:
    """What one watcher has seen of every node's beat; `poll()` reads them all again."""

    def __init__(self, run_dir: RunDir, silent_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.dir = beats_dir(run_dir)
        self.silent_s = silent_s
        self.clock = clock
        self.seen: dict[str, Seen] = {}

    def poll(self) -> None:
        now, wall = self.clock(), time.time()
        for path in self.dir.glob("*.json"):
            beat = read_beat(path)
            if beat is None:
                continue
            before = self.seen.get(beat.node)
            if before is None:
                # Alive when first read if its writer's clock says it beat within the timeout (the clocks of a
                # cluster's nodes agree to far better than that); a file left by an earlier launch is not.
                self.seen[beat.node] = Seen(beat, now, observed=abs(wall - beat.t) <= self.silent_s)
            elif (beat.incarnation, beat.seq, beat.role) != (
                before.beat.incarnation,
                before.beat.seq,
                before.beat.role,
            ):
                self.seen[beat.node] = Seen(beat, now, observed=True)

    def quiet_for(self, node: str) -> float:
        return self.clock() - self.seen[node].changed_at

    def alive(self, role: str) -> list[Beat]:
        """The nodes of `role` seen beating within the silence timeout, by node rank."""
        found = [s.beat for s in self.seen.values() if s.observed and s.beat.role == role]
        return sorted((b for b in found if self.quiet_for(b.node) <= self.silent_s), key=lambda b: (b.rank, b.node))

    def silent(self, role: str) -> list[Beat]:
        """The nodes of `role` seen alive that have not beaten for longer than the silence timeout."""
        found = [s.beat for s in self.seen.values() if s.observed and s.beat.role == role]
        return sorted((b for b in found if self.quiet_for(b.node) > self.silent_s), key=lambda b: (b.rank, b.node))

    def last_alive_at(self, node: str) -> float:
        """When, on the wall clock, this watcher last saw `node`'s beat change."""
        return time.time() - self.quiet_for(node)


def declare_lost(
    run_dir: RunDir, watch: BeatWatch, beat: Beat, by: str, silent_s: float | None = None
) -> dict[str, Any] | None:
    """Declare `beat`'s incarnation lost; the record when this call made the declaration, None when another watcher
    had made it already. `silent_s`: how long it has been silent, where this watcher never saw it beat (by default,
    since it last saw it)."""
    silent = watch.quiet_for(beat.node) if silent_s is None else silent_s
    record = {
        "node": beat.node,
        "rank": beat.rank,
        "role": beat.role,
        "incarnation": beat.incarnation,
        "last_beat_t": round(time.time() - silent, 3),
        "declared_t": round(time.time(), 3),
        "silent_s": round(silent, 3),
        "by": by,
    }
    if not create_exclusive(lost_dir(run_dir) / beat.lost_name, record):
        return None
    return record


def lost_dir(run_dir: RunDir) -> Path:
    return beats_dir(run_dir) / "lost"


def claims_dir(run_dir: RunDir) -> Path:
    return beats_dir(run_dir) / "claims"


def create_exclusive(path: Path, record: dict[str, Any]) -> bool:
    """Create `path` holding `record`, unless it exists: True for the one caller that created it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, FILE_MODE)
    except FileExistsError:
        return False
    try:
        os.write(fd, json.dumps(record).encode())
    finally:
        os.close(fd)
    return True


def read_records(directory: Path) -> dict[str, dict[str, Any]]:
    """name -> record of each marker in `directory` (a marker still being written reads as empty)."""
    found: dict[str, dict[str, Any]] = {}
    for path in sorted(directory.glob("*.json")):
        with contextlib.suppress(OSError, ValueError):
            record = json.loads(path.read_text() or "{}")
            found[path.name] = record if isinstance(record, dict) else {}
    return found


def lost_markers(run_dir: RunDir) -> dict[str, dict[str, Any]]:
    return read_records(lost_dir(run_dir))


def claims(run_dir: RunDir) -> dict[str, dict[str, Any]]:
    return read_records(claims_dir(run_dir))


class Beating:
    """A thread that calls `tick` every beat_s until stopped (a full or vanished run directory skips a tick)."""

    def __init__(self, beat_s: float, tick: Callable[[], None], name: str) -> None:
        self.beat_s = beat_s
        self.tick = tick
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)

    def start(self) -> Beating:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=self.beat_s + 1)

    def _loop(self) -> None:
        while True:
            with contextlib.suppress(OSError):
                self.tick()
            if self._stop.wait(self.beat_s):
                return
