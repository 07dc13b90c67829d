"""A spare node's wait, outside the training rendezvous: the node's launcher itself, before it imports torch,
DeepSpeed or numpy (~30 MB resident, no GPU opened, no process group, no socket).

Who stands by (`node_role`): the spares the user named (node ranks N..N+K-1 of `--nnodes N --spares K`, or the
hostfile's last K lines), and a node other than 0 whose run already trains without it (control/nodes.json lists
training nodes that all beat, and not this one: a node back from a loss whose place a spare took). Node 0 never
does. The agents' rendezvous holds the training nodes only, so a standby coming, going or dying restarts no rank,
and no exit barrier waits for it.

Every beat_s the standby beats its file (role standby) and reads the others' (train/node_beats.py). It leaves its
wait (`Standby.wait`):

- to take a lost node's place: the nodes that train declared a training node lost (train/peer_watch.py) while it is
  still one of the run's training nodes. The standby with the lowest node rank among those beating claims the place
  (O_EXCL: one spare per place), so spares are used in the order the user gave them; another claims it only when
  that one has not within CLAIM_GRACE_BEATS. The launcher then starts the node's agent, which joins the agents as
  they re-form, and its ranks take the lost node's place at the plan's layout: the loss costs what any loss does
  (the steps since the newest checkpoint, the detection, the re-forming, the ranks' start) and nothing after;
- to grow the run back: the run trains on fewer nodes than the plan's (a loss found no spare). The standby joins right
  after the next checkpoint commits: the agents stop their ranks for the new member (SIGTERM, then SIGKILL after 30 s)
  and resume from that checkpoint, so the join costs at most the step in flight;
- when the run is over: the training nodes have ended (their last beat says so: done, stopped or failed for good), or
  none has beaten for ORPHAN_BEATS silences (the run is gone: node 0 and its store, or every node, lost).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from appliance.monitor.events import EventWriter
from appliance.rundir import RunDir
from appliance.train.node_beats import (
    ENDED,
    JOINING,
    STANDBY,
    TRAINING,
    BeatWatch,
    BeatWriter,
    Timings,
    claims_dir,
    create_exclusive,
    lost_markers,
)

if TYPE_CHECKING:
    from appliance.train.nodes import NodeGroup

# A standby that is not first in line claims a lost node's place when the first has not within this many beats.
CLAIM_GRACE_BEATS = 3
# No training node beating for this many silence timeouts: the run is gone.
ORPHAN_BEATS = 3
METRICS_TAIL_BYTES = 1 << 16  # the end of metrics.jsonl read for the newest checkpoint event

TAKE_OVER, OVER, GONE = "take_over", "over", "gone"


def node_role(
    run_dir: RunDir, group: NodeGroup, timings: Timings, *, sleep: Callable[[float], None] = time.sleep
) -> str:
    """STANDBY or TRAINING for this node's launcher (module docstring). A node other than 0 and below N watches the
    beats for two beats first, to see which training nodes are alive."""
    if group.node_rank >= group.nnodes:
        return STANDBY
    if group.is_head:
        return TRAINING
    try:
        listed = [str(n) for n in json.loads((run_dir.control / "nodes.json").read_text())["nodes"]]
    except (OSError, ValueError, KeyError, TypeError):
        return TRAINING
    me = group.node_name()
    if me in listed or not listed:
        return TRAINING  # the run expects this node (a relaunch), or has no record to go by
    watch = BeatWatch(run_dir, timings.silent_s)
    watch.poll()
    sleep(2 * timings.beat_s + 0.1)
    watch.poll()
    alive = {b.node for b in watch.alive(TRAINING)}
    return STANDBY if set(listed) <= alive else TRAINING


class Standby:
    def __init__(self, run_dir: RunDir, group: NodeGroup, timings: Timings) -> None:
        self.run_dir = run_dir
        self.group = group
        self.node = group.node_name()
        self.timings = timings
        self.writer = BeatWriter(run_dir, self.node, group.node_rank, STANDBY)
        self.watch = BeatWatch(run_dir, timings.silent_s)
        self.first_seen: dict[str, float] = {}  # lost marker -> when this standby first saw it (monotonic)
        self.old_markers: set[str] = set()  # declared before this standby watched: not its to claim
        self.last_training = 0.0  # when a training node was last seen beating (the watch's clock)
        self.seen_training = False
        self.grow_after_step: int | None = None  # growing back: the checkpoint step to wait past

    def wait(self) -> str:
        """Beat and watch until this node takes a place (TAKE_OVER) or the run ends (OVER) or is gone (GONE)."""
        self.writer.beat()
        self.watch.poll()
        self.old_markers = set(lost_markers(self.run_dir))
        print(f"{self.node} stands by as a spare (outside the training rendezvous)", flush=True)
        while True:
            time.sleep(self.timings.beat_s)
            self.writer.beat()
            outcome = self.step()
            if outcome == TAKE_OVER:
                self.writer.beat(JOINING)  # not a silent standby while its agent starts
            if outcome is not None:
                return outcome

    def step(self) -> str | None:
        """One beat's decisions; None: stand by on."""
        self.watch.poll()
        now = self.watch.clock()
        training = self.watch.alive(TRAINING)
        if training:
            self.last_training, self.seen_training = now, True
        elif self.seen_training and any(s.beat.role == ENDED for s in self.watch.seen.values() if s.observed):
            return OVER
        elif self.seen_training and now - self.last_training > ORPHAN_BEATS * self.timings.silent_s:
            print(f"{self.node}: no training node has beaten for {now - self.last_training:.0f} s", file=sys.stderr)
            return GONE
        record = _training_nodes(self.run_dir)
        if self._claim_lost(record, now):
            return TAKE_OVER
        if training and self._grow_back(record):
            return TAKE_OVER
        return None

    def _first_in_line(self) -> bool:
        ranks = [b.rank for b in self.watch.alive(STANDBY) if b.node != self.node]
        return all(self.group.node_rank < r for r in ranks)

    def _claim_lost(self, record: dict[str, Any] | None, now: float) -> bool:
        training = set(record.get("nodes", [])) if isinstance(record, dict) else set()
        for name, marker in sorted(lost_markers(self.run_dir).items()):
            if name in self.old_markers or marker.get("role") != TRAINING or marker.get("node") not in training:
                continue
            if (claims_dir(self.run_dir) / name).exists():
                continue
            seen = self.first_seen.setdefault(name, now)
            if not self._first_in_line() and now - seen < CLAIM_GRACE_BEATS * self.timings.beat_s:
                continue
            claim = {"spare": self.node, "replaces": marker.get("node"), "t": round(time.time(), 3)}
            if create_exclusive(claims_dir(self.run_dir) / name, claim):
                self._announce(str(marker.get("node")))
                return True
        return False

    def _grow_back(self, record: dict[str, Any] | None) -> bool:
        if not isinstance(record, dict) or not self._first_in_line():
            self.grow_after_step = None
            return False
        nodes = record.get("nodes", [])
        missing = self.group.nnodes - len(nodes) if isinstance(nodes, list) else 0
        if missing <= 0:
            self.grow_after_step = None
            return False
        newest = newest_checkpoint_step(self.run_dir.metrics)
        if self.grow_after_step is None:
            self.grow_after_step = newest or 0
            return False
        if newest is None or newest <= self.grow_after_step:
            return False
        for slot in range(missing):  # one claim per missing place of this start
            name = f"grow-{record.get('t')}-{slot}.json"
            if create_exclusive(claims_dir(self.run_dir) / name, {"spare": self.node, "t": round(time.time(), 3)}):
                self._announce(None)
                return True
        return False

    def _announce(self, replaces: str | None) -> None:
        """The `nodes` event of this node leaving its wait: which nodes train, which still stand by."""
        record = _training_nodes(self.run_dir) or {}
        spares = [b.node for b in self.watch.alive(STANDBY) if b.node != self.node]
        with EventWriter(self.run_dir.metrics) as events:
            events.emit(
                "nodes",
                nodes=list(record.get("nodes", [])),
                spares=spares,
                change="taking_over" if replaces else "joining",
                node=self.node,
                **({"replaces": replaces} if replaces else {}),
            )


def _training_nodes(run_dir: RunDir) -> dict[str, Any] | None:
    try:
        found = json.loads((run_dir.control / "nodes.json").read_text())
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None


def newest_checkpoint_step(metrics: Path) -> int | None:
    """The step of the newest `checkpoint` event (committed saves) at metrics.jsonl's end, or None."""
    try:
        with open(metrics, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - METRICS_TAIL_BYTES))
            lines = f.read().decode("utf-8", errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and event.get("kind") == "checkpoint":
            return int(event.get("step", 0))
    return None
