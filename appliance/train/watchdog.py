"""Hung-rank detection: each rank beats a heartbeat file; its same-host peers notice when it falls silent.

A rank that is alive but frozen (SIGSTOP, a wedged driver call, a GIL-holding deadlock) fails nothing by itself:
its peers wait in their next collective, and the elastic agent, which only watches exit codes, waits with them.
So every rank runs a thread that, every `interval_s`:
  1. writes control/heartbeat/<attempt>/rankNNNNN.json (pid, host, time, step) atomically;
  2. reads the heartbeats of the ranks on its own host (the only processes it may signal) and, when one is older
     than `timeout_s`, names it in a `failure` event and SIGKILLs it.
The agent then sees a worker die and restarts the group, which resumes from the newest checkpoint.

A frozen process freezes its heartbeat thread too, which is the point: the beat proves the process runs, not that
it makes progress. Ranks blocked in a collective keep beating (the wait releases the GIL), so only the frozen one
goes stale. A real deadlock among live ranks is caught by the process group's own collective timeout instead.
One rank per host acts: a marker created with O_EXCL decides which, so the event is written once.
Heartbeats of ranks on other hosts are left to those hosts' ranks.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from appliance.atomic import write_atomic

ATTEMPT_FILE = "attempt.json"
KEEP_ATTEMPTS = 8  # heartbeat directories kept for post-mortems; older ones are removed at the next start


def attempt_id() -> str:
    """The agent's run id and restart count: heartbeats of an earlier attempt are never compared with this one."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "local")
    return f"{run_id}-{int(os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')):03d}"


class Watchdog:
    def __init__(
        self,
        directory: Path,
        rank: int,
        *,
        interval_s: float,
        timeout_s: float,
        on_hung: Callable[[int, str], None],
        attempt: str | None = None,
        host: str | None = None,
    ) -> None:
        self.dir = Path(directory) / (attempt or attempt_id())
        self.rank = rank
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.on_hung = on_hung  # (rank, reason): emits the failure event
        self.host = host or socket.gethostname()
        self.step = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="bloom-watchdog", daemon=True)

    def start(self) -> Watchdog:
        self.dir.mkdir(parents=True, exist_ok=True)
        try:  # the first rank up records when this attempt began (recovery's lost_seconds counts from it)
            fd = os.open(self.dir / ATTEMPT_FILE, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o640)
            os.write(fd, json.dumps({"t": time.time()}).encode())
            os.close(fd)
        except FileExistsError:
            pass
        self.beat()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.interval_s + 1)

    def set_step(self, step: int) -> None:
        """The step this rank is working on, shown in its heartbeat (a plain int: the thread only reads it)."""
        self.step = step

    def _file(self, rank: int) -> Path:
        return self.dir / f"rank{rank:05d}.json"

    def beat(self) -> None:
        record = {"rank": self.rank, "pid": os.getpid(), "host": self.host, "t": time.time(), "step": self.step}
        write_atomic(self._file(self.rank), json.dumps(record).encode(), sync=False)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.beat()
                self.check_peers()
            except OSError:
                pass  # a full or vanished run directory must not kill training from this thread

    def check_peers(self, now: float | None = None) -> list[int]:
        """Kill the stale ranks of this host; returns the ranks this call acted on."""
        now = time.time() if now is None else now
        acted = []
        for path in sorted(self.dir.glob("rank*.json")):
            beat = _read(path)
            if beat is None or beat["rank"] == self.rank or beat["host"] != self.host:
                continue
            silent = now - beat["t"]
            if silent <= self.timeout_s:
                continue
            try:  # one rank of the host acts on each hung process
                os.close(os.open(self.dir / f"hung-{beat['pid']}", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o640))
            except FileExistsError:
                continue
            reason = (
                f"rank {beat['rank']} (pid {beat['pid']} on {beat['host']}) hung: no heartbeat for {silent:.1f} s "
                f"(timeout {self.timeout_s:g} s) in step {beat['step']}; killed so the group restarts"
            )
            self.on_hung(beat["rank"], reason)
            with contextlib.suppress(ProcessLookupError):
                os.kill(beat["pid"], signal.SIGKILL)
            acted.append(beat["rank"])
        return acted


def was_killed_as_hung(directory: Path, pid: int) -> bool:
    """Whether a watchdog already reported and killed this pid (any attempt): its death is no news."""
    return any(Path(directory).glob(f"*/hung-{pid}"))


def _attempt_start(directory: Path) -> float | None:
    try:
        return float(json.loads((directory / ATTEMPT_FILE).read_text())["t"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def attempts(root: Path) -> list[tuple[float, Path]]:
    """Every attempt's heartbeat directory under root with its start time, oldest first."""
    found = [(_attempt_start(d), d) for d in Path(root).glob("*") if d.is_dir()]
    return sorted((t, d) for t, d in found if t is not None)


def prune_attempts(root: Path, keep: int = KEEP_ATTEMPTS) -> None:
    import shutil

    for _, directory in attempts(root)[:-keep]:
        shutil.rmtree(directory, ignore_errors=True)


def lost_seconds(root: Path, current: str, checkpoint_time: float, resumed_step: int, now: float) -> float:
    """The wall time a failure cost, seen from the attempt that resumes at `resumed_step`:
    - a restart within the same launch (the agent's): everything since the later of the checkpoint's commit and
      the failed attempt's start, i.e. the steps redone plus detection and restart;
    - a new launch (a requeued job, a rerun by hand): only the previous launch's steps past the checkpoint, as
      its last heartbeat shows them (time spent waiting in a queue is not the run's failure).
    A clean stop (preemption, save-and-exit) loses nothing: its last heartbeat is at the checkpoint's step."""
    previous = [(t, d) for t, d in attempts(root) if d.name != current]
    if not previous:
        return 0.0
    started, directory = previous[-1]
    if directory.name.rsplit("-", 1)[0] == current.rsplit("-", 1)[0]:
        return max(0.0, now - max(checkpoint_time, started))
    beats = [b for b in map(_read, directory.glob("rank*.json")) if b is not None and b["step"] > resumed_step]
    return max((max(0.0, b["t"] - checkpoint_time) for b in beats), default=0.0)


def _read(path: Path) -> dict[str, Any] | None:
    try:
        beat = json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # being replaced right now, or torn by a crash: the next round reads it
    return beat if isinstance(beat, dict) and {"rank", "pid", "host", "t", "step"} <= beat.keys() else None
