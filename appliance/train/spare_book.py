"""Rank 0's account of the spares while a start trains (an elastic launch): which standbys beat (train/standby.py),
kept in control/nodes.json's `spares` and told to the dashboard.

Every beat_s it reads the beats (train/node_beats.py). A standby that appears (a spare started late, a node back from a
loss) and one that falls silent for silent_s (its machine died, or its launcher was stopped) each change the spares:
the book rewrites `spares` and emits a `nodes` event whose `change` says which (`spare_joined`, `spare_lost`, with
`node`). A silent standby is declared lost once (O_EXCL), so it leaves the count for good; a standby that left its wait
to train (its beat now says so) leaves the spares without being lost. Between two starts no book runs: a standby of
the last start's spares that stopped beating meanwhile is declared lost as the next book begins.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from appliance.monitor.events import EventWriter
from appliance.rundir import RunDir
from appliance.train.node_beats import STANDBY, Beating, BeatWatch, Timings, declare_lost
from appliance.train.node_record import read_nodes, update_nodes


class SpareBook:
    def __init__(
        self,
        run_dir: RunDir,
        events: EventWriter,
        timings: Timings,
        *,
        idle: Callable[[], list[str]],
        by: str,
        expected: Sequence[str] = (),
    ) -> None:
        self.run_dir = run_dir
        self.events = events
        self.idle = idle  # this start's in-world idle nodes (train/elastic.py), once they said so
        self.by = by  # this node's name, for the declarations it makes
        self.expected = set(expected)  # the last start's spares: each still standing by, or lost since
        self.watch = BeatWatch(run_dir, timings.silent_s)
        self.known: set[str] = set()  # the standbys last reported
        self.settled_at = self.watch.clock() + 2 * timings.beat_s  # every live standby has beaten by then
        self._beating = Beating(timings.beat_s, self.tick, "bloom-spare-book")

    def start(self) -> SpareBook:
        self.watch.poll()
        self._beating.start()
        return self

    def stop(self) -> None:
        self._beating.stop()

    def standbys(self) -> list[str]:
        """The standbys beating now, by node rank."""
        return [b.node for b in self.watch.alive(STANDBY)]

    def tick(self) -> None:
        self.watch.poll()
        for beat in self.watch.silent(STANDBY):
            if declare_lost(self.run_dir, self.watch, beat, by=self.by) is not None:
                self._changed("spare_lost", beat.node)
        for node in sorted(self.expected):  # once: standbys of the last start that fell silent between the starts
            seen = self.watch.seen.get(node)
            if seen is None or seen.beat.role != STANDBY or seen.observed:
                continue  # gone without a trace, training now, or standing by
            if declare_lost(self.run_dir, self.watch, seen.beat, by=self.by, silent_s=time.time() - seen.beat.t):
                self._changed("spare_lost", node)
        self.expected.clear()
        alive = set(self.standbys())
        if self.watch.clock() >= self.settled_at:  # before, the start's own `nodes` event lists them
            for node in sorted(alive - self.known):
                self._changed("spare_joined", node)
        self.known = alive

    def _changed(self, change: str, node: str) -> None:
        spares = sorted(set(self.standbys()) | set(self.idle()))
        update_nodes(self.run_dir, spares=spares)
        nodes = (read_nodes(self.run_dir) or {}).get("nodes", [])
        self.events.emit("nodes", nodes=nodes, spares=spares, change=change, node=node)
