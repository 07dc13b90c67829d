"""A training node's side of the cross-node heartbeat, run by its agent wrapper (train/agent.py) beside torch's agent.

A node that hangs or drops off the network fails nothing by itself: the ranks of the other nodes wait in their next
collective, for the collectives' own timeout (minutes: train/collective_timeout.py), and their agents wait with them.
So every beat_s this watch:

1. beats the node's file (train/node_beats.py), from the process that outlives every restart of the node's ranks, so
   a node restarting its ranks never reads as silent, and a node whose agent froze or died does;
2. reads every beat; a training peer silent for silent_s is declared lost, once for the run (the first watcher to
   see it writes the declaration and a `failure` event naming the node and how long it was silent);
3. for each declared peer, SIGKILLs this node's ranks that were already running when that peer last beat: they share
   its collectives and wait in one. The agent sees them die and re-forms (a spare's standby, seeing the declaration,
   has started its agent meanwhile: train/standby.py). A rank started since cannot share a world with that peer and
   is left alone, so a peer found dead by its closed connections first costs no second restart;
4. when this node itself was declared lost (it was frozen or cut off long enough for a spare to take its place), stops
   its ranks and exits with EXIT_REPLACED: its head then stands by as a spare instead of re-joining (train/launch.py).
   Not node 0, which never stands by.

Only this process's own children are signalled: the ranks its agent started on this node.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Callable
from pathlib import Path

from appliance.monitor.events import EventWriter
from appliance.rundir import RunDir
from appliance.train.node_beats import (
    ENDED,
    TRAINING,
    Beat,
    Beating,
    BeatWatch,
    BeatWriter,
    Timings,
    beats_dir,
    declare_lost,
    file_name,
    lost_markers,
)

# The agent wrapper's exit code when its node was declared lost while it lived: the head stands by instead.
EXIT_REPLACED = 75


def aborted_dir(run_dir: RunDir) -> Path:
    return beats_dir(run_dir) / "aborted"


def was_aborted(run_dir: RunDir, node: str, pid: int) -> bool:
    """Whether a peer watch stopped this rank (its death is then no crash of its own)."""
    return (aborted_dir(run_dir) / f"{file_name(node)}-{pid}").exists()


def child_pids(parent: int) -> list[int]:
    """The processes whose parent is `parent`, from /proc."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == parent:
                found.append(int(stat.parent.name))
    return found


class PeerWatch:
    def __init__(
        self,
        run_dir: RunDir,
        node: str,
        node_rank: int,
        timings: Timings,
        *,
        parent: int | None = None,
        may_leave: bool = True,
        leave: Callable[[int], object] = os._exit,
    ) -> None:
        self.run_dir = run_dir
        self.node = node
        self.parent = os.getpid() if parent is None else parent  # the agent: its children are this node's ranks
        self.may_leave = may_leave
        self.leave = leave  # os._exit: torch's agent is this process, and nothing of it must run on
        self.writer = BeatWriter(run_dir, node, node_rank, TRAINING)
        self.watch = BeatWatch(run_dir, timings.silent_s)
        self.started: dict[int, float] = {}  # this process's children (its ranks) -> when first seen (monotonic)
        self.handled: set[str] = set()  # lost markers acted on
        self.incarnation = ""
        self._beating = Beating(timings.beat_s, self.tick, "bloom-peer-watch")

    def start(self) -> PeerWatch:
        self.incarnation = self.writer.beat().incarnation
        self._beating.start()
        return self

    def end(self) -> None:
        """The agent finished its run: the last beat says so, and a silence after it is no loss."""
        self._beating.stop()
        with contextlib.suppress(OSError):
            self.writer.beat(ENDED)

    def tick(self) -> None:
        self.writer.beat()
        now = self.watch.clock()
        children = set(child_pids(self.parent))
        self.started = {pid: self.started.get(pid, now) for pid in children}
        self.watch.poll()
        for peer in self.watch.silent(TRAINING):
            if peer.node == self.node:
                continue
            declared = declare_lost(self.run_dir, self.watch, peer, by=self.node)
            if declared is not None:
                self._report(peer, declared["silent_s"])
        markers = lost_markers(self.run_dir)
        for name, record in markers.items():
            if name in self.handled:
                continue
            if record.get("incarnation") == self.incarnation and self.may_leave:
                self._leave()
            seen = self.watch.seen.get(str(record.get("node")))
            if seen is not None and seen.beat.incarnation == record.get("incarnation") and seen.beat.role == TRAINING:
                self.handled.add(name)
                self._stop_ranks_older_than(seen.changed_at)

    def _stop_ranks_older_than(self, peer_alive_at: float) -> None:
        # A rank is first seen up to a beat after it started; a round without the peer forms only after the
        # rendezvous's keep-alives expired (several beats), so the margin never reaches the ranks of that round.
        for pid, first_seen in self.started.items():
            if first_seen <= peer_alive_at + self._beating.beat_s:
                self._kill(pid)

    def _kill(self, pid: int) -> None:
        marker = aborted_dir(self.run_dir) / f"{file_name(self.node)}-{pid}"
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.touch()
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)

    def _leave(self) -> None:
        for pid in self.started:
            self._kill(pid)
        self.leave(EXIT_REPLACED)

    def _report(self, peer: Beat, silent_s: float) -> None:
        with EventWriter(self.run_dir.metrics) as events:
            events.emit(
                "failure",
                rank=None,
                node=peer.node,
                detected_by=self.node,
                silent_s=silent_s,
                reason=(
                    f"node {peer.node} silent for {silent_s:.1f} s (no beat; timeout {self.watch.silent_s:g} s):"
                    " declared lost; the other nodes' ranks stop so that the agents re-form without it"
                ),
            )
