"""control/nodes.json: which nodes train and which stand by, start by start, and what changed between two starts.

Rank 0 of each start of an elastic launch writes it: `ranks` (every training rank's node, gathered over the training
world, in rank order), `nodes` (those nodes), `layout` (factors) and `t`. At the first step it adds `idle` (the
in-world spares of a step-down, train/elastic.py `placement`), and while the start trains its spare book
(train/spare_book.py) keeps `spares` equal to the nodes standing by: the standbys beating (train/standby.py) and the
idle nodes. `claims_seen` and `lost_seen` name the spares' claims and the declared silences (train/node_beats.py)
known at this start, so the next start tells the new ones apart without comparing the clocks of two nodes.

A start against the last one (`NodeChange`): the nodes lost, those joined, the spares that took a lost node's place
(`took_over`: a standby that claimed it, or an idle node of the last start), the layouts, and how long the lost nodes
were silent before they were declared (`detection_s`). Rank 0 reports it as the start's first step starts: a `nodes`
event always, a `recovery` event when the nodes changed, with the lost seconds (from the last step completed before
the change to the start of the first step after it) and the restarts of the budget left (train/restart_budget.py).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from appliance.atomic import write_atomic
from appliance.monitor.events import EventWriter
from appliance.rundir import RunDir
from appliance.train.node_beats import TRAINING, claims, lost_markers
from appliance.train.restart_budget import Budget

# How much of metrics.jsonl's end is read for the last step before a loss (a step event is a few hundred bytes).
TAIL_BYTES = 1 << 20
# The rank-0 process writes the record from its main thread (starts, first step) and its spare book's thread.
_WRITING = threading.Lock()


def nodes_record(run_dir: RunDir) -> Path:
    return run_dir.control / "nodes.json"


def read_nodes(run_dir: RunDir) -> dict[str, Any] | None:
    try:
        found = json.loads(nodes_record(run_dir).read_text())
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None


def update_nodes(run_dir: RunDir, **changes: Any) -> None:
    """Rewrite some keys of the record (rank 0's process only: its threads take turns)."""
    with _WRITING:
        record = read_nodes(run_dir)
        if record is not None:
            _write(run_dir, {**record, **changes})


def _write(run_dir: RunDir, record: dict[str, Any]) -> None:
    run_dir.make_control()
    write_atomic(nodes_record(run_dir), (json.dumps(record) + "\n").encode())


@dataclass(frozen=True)
class NodeChange:
    """The nodes of this start against the last one's. The idle nodes of this start are known once they said so
    (train/elastic.py `spares_of_start`), so the lost and joined nodes are final at the first step (`resolve`)."""

    before_nodes: list[str]
    before_idle: list[str]
    before_spares: list[str]  # the last start's spares, standbys and idle nodes, as it last knew them
    nodes: list[str]
    old_layout: str  # factors, e.g. "tp(1) * pp(1) * dp(3)"
    new_layout: str
    last_step: int | None  # the last step completed before the change, and when
    last_step_time: float | None
    took_over: list[str]  # nodes training now in a lost node's place: a spare that claimed it, or an idle node
    detection_s: float | None  # the longest silence before a declaration since the last start (None: none)
    idle: list[str] = field(default_factory=list)  # this start's idle nodes, once resolved

    def resolve(self, idle: list[str]) -> NodeChange:
        return replace(self, idle=sorted(idle))

    @property
    def lost(self) -> list[str]:
        return sorted((set(self.before_nodes) | set(self.before_idle)) - set(self.nodes) - set(self.idle))

    @property
    def joined(self) -> list[str]:
        before = set(self.before_nodes) | set(self.before_idle)
        return sorted((set(self.nodes) | set(self.idle)) - before - set(self.took_over))

    @property
    def changed(self) -> bool:
        return bool(self.lost or self.joined or self.took_over) or self.old_layout != self.new_layout


def note_nodes(run_dir: RunDir, nodes: list[str], factors: str) -> NodeChange | None:
    """Rank 0 at a start: record this start's training nodes and layout; the change against the last start's, or
    None on the first start."""
    before = read_nodes(run_dir)
    now = sorted(set(nodes))
    claimed, declared = claims(run_dir), lost_markers(run_dir)
    with _WRITING:
        _write(
            run_dir,
            {
                "nodes": now,
                "ranks": list(nodes),  # each rank's node, in rank order: the training world
                "idle": [],
                "spares": [],
                "layout": factors,
                "t": time.time(),
                "claims_seen": sorted(claimed),
                "lost_seen": sorted(declared),
            },
        )
    if before is None:
        return None
    came = set(now) - set(before.get("nodes", []))
    new_claims = [c for name, c in claimed.items() if name not in set(before.get("claims_seen", []))]
    takers = {str(c.get("spare")) for c in new_claims if c.get("replaces")} | set(before.get("idle", []))
    silences = [
        float(m.get("silent_s", 0.0))
        for name, m in declared.items()
        if name not in set(before.get("lost_seen", [])) and m.get("role") == TRAINING
    ]
    last = last_step_event(run_dir.metrics)
    return NodeChange(
        before_nodes=sorted(before.get("nodes", [])),
        before_idle=sorted(before.get("idle", [])),
        before_spares=sorted(before.get("spares", [])),
        nodes=now,
        old_layout=str(before.get("layout", "")),
        new_layout=factors,
        last_step=None if last is None else int(last["step"]),
        last_step_time=None if last is None else float(last["t"]),
        took_over=sorted(came & takers),
        detection_s=round(max(silences), 3) if silences else None,
    )


def last_step_event(metrics: Path) -> dict[str, Any] | None:
    """The newest `step` event of metrics.jsonl (its end only), or None."""
    try:
        with open(metrics, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - TAIL_BYTES))
            lines = f.read().decode("utf-8", errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            event = json.loads(line)
        except ValueError:
            continue  # the first, cut line of the tail, or one torn by a crash
        if isinstance(event, dict) and event.get("kind") == "step":
            return event
    return None


@dataclass(frozen=True)
class StartReport:
    """What rank 0 says at the first step of a start: its idle nodes and standbys are read then."""

    change: NodeChange | None
    resumed_step: int
    budget: Budget
    spent: bool  # this start spent a restart of the budget


def report_at_first_step(
    events: EventWriter,
    run_dir: RunDir,
    report: StartReport,
    *,
    idle: Callable[[], list[str]],
    standbys: Callable[[], list[str]],
    then: Callable[[int], None],
    otherwise: Callable[[], None] | None = None,
) -> Callable[[int], None]:
    """An on_step callback that, as the first step of this start starts (the end of the lost time): records this
    start's idle nodes and spares, emits a `nodes` event (which nodes train, which stand by, the restarts left) and,
    when the nodes changed, the change's `recovery` event (else calls `otherwise`, the ordinary recovery event of a
    restart); then hands every step to `then` (the watchdog's heartbeat)."""
    done = False

    def on_step(step: int) -> None:
        nonlocal done
        if not done:
            done = True
            now = time.time()
            idle_now = sorted(idle())
            spares = sorted(set(idle_now) | set(standbys()))
            update_nodes(run_dir, idle=idle_now, spares=spares)
            change = report.change
            nodes = change.nodes if change is not None else (read_nodes(run_dir) or {}).get("nodes", [])
            left = {"restarts_left": report.budget.left, "restart_budget": report.budget.budget}
            events.emit("nodes", nodes=nodes, spares=spares, spares_expected=len(spares), change="start", **left)
            resolved = None if change is None else change.resolve(idle_now)
            if resolved is not None and resolved.changed:
                since = resolved.last_step_time
                detected = {} if resolved.detection_s is None else {"detection_s": resolved.detection_s}
                events.emit(
                    "recovery",
                    restart=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
                    resumed_step=report.resumed_step,
                    lost_seconds=round(now - since, 3) if since is not None else 0.0,
                    lost_nodes=resolved.lost,
                    joined_nodes=resolved.joined,
                    took_over=resolved.took_over,
                    spares_left=len(spares),
                    layout_from=resolved.old_layout,
                    layout_to=resolved.new_layout,
                    redone_steps=max(0, (resolved.last_step or 0) - report.resumed_step),
                    restart_spent=report.spent,
                    reason=_reason(resolved, len(spares), report.budget.left),
                    **detected,
                    **left,
                )
            elif otherwise is not None:
                otherwise()
        then(step)

    return on_step


def _reason(change: NodeChange, spares_left: int, restarts_left: int) -> str:
    parts = []
    if change.lost:
        parts.append(f"lost {', '.join(change.lost)}")
    if change.took_over:
        parts.append(f"spare {', '.join(change.took_over)} took over")
    if change.joined:
        parts.append(f"{', '.join(change.joined)} joined")
    layouts = (
        f"layout kept, {change.new_layout}"
        if change.old_layout == change.new_layout
        else f"{change.old_layout} -> {change.new_layout}"
    )
    left = f"{spares_left} spare{'s' if spares_left != 1 else ''} left"
    return f"{' and '.join(parts) or 'nodes changed'}: {layouts}; {left}, {restarts_left} restarts left"
