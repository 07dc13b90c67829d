"""Losing a node and carrying on (`--nnodes MIN:MAX`): the ranks' side.

The agents (torch.distributed.run, c10d rendezvous) re-form without a node whose agent stopped answering, and start
every worker again with the smaller WORLD_SIZE; when the node comes back, its agent joins and the next restart has
the plan's world again. Each start, the ranks:

1. take the layout for the world they have from the planner (planner/shrink.py: same tp, pp and cp, dp refitted,
   the global batch kept through more gradient accumulation), or stop with its error naming the factors;
2. learn which nodes they are on (every rank's node name, gathered) and compare them with the nodes of the last
   start, which rank 0 keeps in control/nodes.json;
3. resume from the newest checkpoint as always; checkpoints load at any layout (train/checkpoint.py).

When the nodes changed, rank 0 reports the change as the `recovery` event of this start, with the lost (or
returned) nodes, the old and new layouts, and the lost seconds: from the last step completed before the loss to the
start of the first step after it (detection, re-rendezvous, restart, loading); the steps past the checkpoint that
are trained again are named too (`redone_steps`).

Node 0 hosts the rendezvous store (train/nodes.py): losing node 0 ends the run, as before.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from appliance.errors import BadInput
from appliance.monitor.events import EventWriter
from appliance.planner.runspec import RunSpec
from appliance.planner.shrink import layout_for_world, usable_node_counts
from appliance.rundir import RunDir
from appliance.train.atomic import write_atomic
from appliance.train.launch import ELASTIC_ENV, NODE_NAME_ENV

# How much of metrics.jsonl's end is read for the last step before a loss (a step event is a few hundred bytes).
TAIL_BYTES = 1 << 20


def spec_for_world(spec: RunSpec, world_size: int, env: dict[str, str] | None = None) -> RunSpec:
    """The run spec the ranks train with: the plan's, or, under agents started with --nnodes MIN:MAX, its layout
    re-planned for `world_size` ranks. Any other launch keeps the plan's layout, whose check then names a world that
    does not fit it."""
    if world_size == spec.layout.world_size or not launched_elastic(env):
        return spec
    model = spec.model
    layout = layout_for_world(spec.layout, world_size, heads=model.heads, layers=model.layers, seq_len=model.seq_len)
    return spec.with_layout(layout, spec.report.estimate)


def launched_elastic(env: dict[str, str] | None = None) -> bool:
    """These ranks' agents were started with --nnodes MIN:MAX (appliance/train/launch.py sets ELASTIC_ENV)."""
    return bool((os.environ if env is None else env).get(ELASTIC_ENV))


def check_node_range(spec: RunSpec, min_nodes: int, max_nodes: int, source: str) -> list[int]:
    """Before launching with --nnodes MIN:MAX: BadInput when the plan cannot train on MIN nodes; otherwise the node
    counts between MIN and MAX on which it could not (the agents may re-form with any count in the range)."""
    usable = usable_node_counts(spec.layout, max_nodes)
    if min_nodes not in usable:
        per_node = spec.layout.world_size // max_nodes
        raise BadInput(
            f"--nnodes {min_nodes}:{max_nodes}: {min_nodes} nodes x {per_node} ranks cannot carry the plan's"
            f" {spec.layout.factors} with global batch({spec.layout.global_batch_size}) and"
            f" mbs({spec.layout.micro_batch_size}) ({source}); node counts that can: {usable}"
        )
    return [n for n in range(min_nodes, max_nodes) if n not in usable]


def this_node() -> str:
    return os.environ.get(NODE_NAME_ENV) or socket.gethostname()


@dataclass(frozen=True)
class NodeChange:
    """The nodes of this start against the last one's."""

    lost: list[str]
    joined: list[str]
    old_layout: str  # factors, e.g. "tp(1) * pp(1) * dp(3)"
    new_layout: str
    last_step: int | None  # the last step completed before the change, and when
    last_step_time: float | None


def nodes_record(run_dir: RunDir) -> Path:
    return run_dir.control / "nodes.json"


def note_nodes(run_dir: RunDir, nodes: list[str], factors: str) -> NodeChange | None:
    """Rank 0: record this start's nodes and layout; the change from the last start's, or None (first start, same
    nodes)."""
    path = nodes_record(run_dir)
    try:
        before = json.loads(path.read_text())
    except (OSError, ValueError):
        before = None
    now = sorted(set(nodes))
    run_dir.control.mkdir(parents=True, exist_ok=True)
    write_atomic(path, (json.dumps({"nodes": now, "layout": factors, "t": time.time()}) + "\n").encode())
    if not isinstance(before, dict) or sorted(before.get("nodes", [])) == now:
        return None
    last = last_step_event(run_dir.metrics)
    return NodeChange(
        lost=sorted(set(before["nodes"]) - set(now)),
        joined=sorted(set(now) - set(before["nodes"])),
        old_layout=str(before.get("layout", "")),
        new_layout=factors,
        last_step=None if last is None else int(last["step"]),
        last_step_time=None if last is None else float(last["t"]),
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


def report_at_first_step(
    events: EventWriter, change: NodeChange, *, resumed_step: int, then: Callable[[int], None]
) -> Callable[[int], None]:
    """An on_step callback that emits the change's `recovery` event as the first step after the resume starts (the
    end of the lost time), then hands every step to `then` (the watchdog's heartbeat)."""
    done = False

    def on_step(step: int) -> None:
        nonlocal done
        if not done:
            done = True
            now = time.time()
            since = change.last_step_time
            events.emit(
                "recovery",
                restart=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
                resumed_step=resumed_step,
                lost_seconds=round(now - since, 3) if since is not None else 0.0,
                lost_nodes=change.lost,
                joined_nodes=change.joined,
                layout_from=change.old_layout,
                layout_to=change.new_layout,
                redone_steps=max(0, (change.last_step or 0) - resumed_step),
                reason=_reason(change),
            )
        then(step)

    return on_step


def _reason(change: NodeChange) -> str:
    parts = []
    if change.lost:
        parts.append(f"lost {', '.join(change.lost)}")
    if change.joined:
        parts.append(f"{', '.join(change.joined)} joined")
    return f"{' and '.join(parts)}: {change.old_layout} -> {change.new_layout}"
