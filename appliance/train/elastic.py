"""Losing a node and carrying on (`--nnodes MIN:MAX`, `--spares K`): the ranks' side.

The agents (torch.distributed.run, c10d rendezvous) re-form without a node whose agent stopped answering, and start
every worker again with the smaller WORLD_SIZE; when the node comes back, its agent joins and the next restart has
the plan's world again. Each start, the ranks:

1. place themselves (`placement`): the agents' world holds M nodes of the same ranks each; the plan trains on N of
   them (its world divided by the ranks per node). With M >= N the first N nodes' ranks train and the others are
   spares; with fewer, the largest usable count below (planner/shrink.py `usable_node_counts`) trains, and the
   rest stand by as spares too. A spare's worker builds nothing: no process group, no device, no data; it waits on
   the host (`stand_by`) until the training ranks of its start release it, or its agent restarts it when the
   agents re-form. The training ranks form a world of their own (WORLD_SIZE set to theirs before the process group
   forms), so a spare is in none of their groups and in none of their collectives;
2. take the layout for the ranks that train from the planner (planner/shrink.py: on GPUs the fastest layout the
   planner fits in the GPU's memory, tp kept and pp, dp, micro-batch, ZeRO stage and recompute free; on CPU ranks
   the same tp, pp and cp with dp refitted; the global batch kept either way), or stop with its error naming the
   factors;
3. learn which nodes they are on (every training rank's node name, gathered) and compare them with the nodes of
   the last start, which rank 0 keeps in control/nodes.json, with the spares of that start;
4. resume from the newest checkpoint as always; checkpoints load at any layout (train/checkpoint.py).

Global ranks are numbered node by node in the order the rendezvous gives the agents (torch sorts them by host and
pid), so the spares are whole nodes, the last ones of that order: which machines stand by is the rendezvous's
choice, and after a loss a spare simply gets ranks below the training world.

When the nodes changed, rank 0 reports the change as the `recovery` event of this start, with the lost (or
returned) nodes, the spare that took a lost node's place (`took_over`), the spares left, the old and new layouts,
and the lost seconds: from the last step completed before the loss to the start of the first step after it
(detection, re-rendezvous, restart, loading); the steps past the checkpoint that are trained again are named too
(`redone_steps`). Every elastic start also says which nodes train and which stand by (a `nodes` event).

Node 0 hosts the rendezvous store (train/nodes.py): losing node 0 ends the run, unless the store runs on a machine
that does not train (--store-elsewhere); then node 0 is lost like any node.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from appliance.atomic import write_atomic
from appliance.errors import BadInput
from appliance.monitor.events import EventWriter
from appliance.planner.runspec import RunSpec
from appliance.planner.shrink import layout_for_world, usable_node_counts
from appliance.rundir import RunDir
from appliance.train.nodes import ELASTIC_ENV, NODE_NAME_ENV

if TYPE_CHECKING:
    from appliance.train.nodes import NodeGroup

# How much of metrics.jsonl's end is read for the last step before a loss (a step event is a few hundred bytes).
TAIL_BYTES = 1 << 20
# How often a spare looks for its release: a file check a second costs nothing, and a spare released a second late
# only delays the agents' exit barrier by that second.
STAND_BY_POLL_S = 1.0


def spec_for_world(spec: RunSpec, world_size: int, env: dict[str, str] | None = None) -> RunSpec:
    """The run spec the ranks train with: the plan's, or, under agents started with --nnodes MIN:MAX, its layout
    re-planned for `world_size` ranks. Any other launch keeps the plan's layout, whose check then names a world that
    does not fit it."""
    if world_size == spec.layout.world_size or not launched_elastic(env):
        return spec
    return spec.with_layout(layout_for_world(spec, world_size), spec.report.estimate)


def launched_elastic(env: dict[str, str] | None = None) -> bool:
    """These ranks' agents were started with --nnodes MIN:MAX (appliance/train/launch.py sets ELASTIC_ENV)."""
    return bool((os.environ if env is None else env).get(ELASTIC_ENV))


def training_nodes(usable: list[int], plan_nodes: int, nodes: int) -> int | None:
    """Of `nodes` nodes present, how many train: the plan's own count when they are enough (the rest are spares),
    else the largest usable count below (the rest stand by); None when not even the smallest is there."""
    if nodes >= plan_nodes:
        return plan_nodes
    fitting = [n for n in usable if n <= nodes]
    return max(fitting) if fitting else None


def min_agents(spec: RunSpec, nodes: NodeGroup) -> int:
    """The fewest agents the rendezvous carries on with: MIN of --nnodes MIN:MAX when given; with spares and no MIN,
    the plan's smallest usable node count (the run steps down rather than stopping); else all of the plan's."""
    if nodes.min_nodes is not None:
        return nodes.min_nodes
    if nodes.spares:
        return usable_node_counts(spec, nodes.nnodes)[0]
    return nodes.nnodes


def check_node_range(spec: RunSpec, min_nodes: int, max_nodes: int, source: str) -> dict[int, int]:
    """Before launching with --nnodes MIN:MAX: BadInput when the plan cannot train on MIN nodes or any fewer;
    otherwise, for each node count between MIN and MAX that holds no layout itself, the count that would train
    there (the agents may re-form with any count in the range; the other nodes then stand by)."""
    usable = usable_node_counts(spec, max_nodes)
    if training_nodes(usable, max_nodes, min_nodes) is None:
        per_node, lay = spec.layout.world_size // max_nodes, spec.layout
        how = (
            f"in a layout with tp({lay.tp}) that fits the GPUs' memory (`plan --spares K` lists the step-downs)"
            if spec.hardware.has_gpus
            else f"and mbs({lay.micro_batch_size})"
        )
        raise BadInput(
            f"--nnodes {min_nodes}:{max_nodes}: {min_nodes} nodes x {per_node} ranks cannot carry the plan's"
            f" {lay.factors} with global batch({lay.global_batch_size}) {how} ({source}); node counts that can:"
            f" {usable}"
        )
    return {
        n: trains
        for n in range(min_nodes, max_nodes)
        if n not in usable and (trains := training_nodes(usable, max_nodes, n)) is not None
    }


@dataclass(frozen=True)
class Placement:
    """Where this rank stands in the agents' world: it trains (global rank below `train_world`) or stands by."""

    rank: int
    agent_world: int  # every rank the agents started, spares included
    train_world: int  # the ranks that train: whole nodes, the first ones
    per_node: int

    @property
    def spare(self) -> bool:
        return self.rank >= self.train_world

    @property
    def spare_nodes(self) -> int:
        return (self.agent_world - self.train_world) // self.per_node


def placement(spec: RunSpec, env: dict[str, str] | None = None) -> Placement:
    """This rank's place, from the agent's environment (RANK, WORLD_SIZE, LOCAL_WORLD_SIZE) and the plan. Any launch
    but an elastic one trains with every rank (a misfit is then named by the layout's own check)."""
    env = dict(os.environ if env is None else env)
    world = int(env.get("WORLD_SIZE", "1"))
    rank = int(env.get("RANK", "0"))
    per_node = int(env.get("LOCAL_WORLD_SIZE", str(world)))
    train_world = world
    plan_world = spec.layout.world_size
    if launched_elastic(env) and world != plan_world and per_node and not plan_world % per_node:
        plan_nodes = plan_world // per_node
        trains = training_nodes(usable_node_counts(spec, plan_nodes), plan_nodes, world // per_node)
        if trains is not None:  # None: too few nodes; all train, and the re-plan names the factors
            train_world = trains * per_node
    return Placement(rank=rank, agent_world=world, train_world=train_world, per_node=per_node)


def start_dir(run_dir: RunDir, env: dict[str, str] | None = None) -> Path:
    """This start's spares directory: the agents' run id and the worker store's address, which every worker of a
    rendezvous round shares and a new round replaces (the agents pick a fresh port for each)."""
    found = os.environ if env is None else env
    start = "-".join(found.get(k, "") for k in ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT"))
    return run_dir.control / "spares" / re.sub(r"[^A-Za-z0-9_.-]", "_", start)


def stand_by(run_dir: RunDir, place: Placement, *, poll_s: float = STAND_BY_POLL_S) -> int:
    """A spare rank's whole life: say which node stands by (its local rank 0), then wait on the host, holding no
    process group, device memory or data, until the training ranks of this start release it (they ended: done,
    stopped or failed for good). A loss ends it sooner: the agents re-form and its agent stops it with SIGTERM and
    starts it again with a new rank. Exits 0: the agent must not count a spare's end as a failure."""
    here = start_dir(run_dir)
    here.mkdir(parents=True, exist_ok=True)
    if place.rank % place.per_node == 0:
        first = place.rank
        record = {"node": this_node(), "ranks": [first, first + place.per_node - 1], "pid": os.getpid()}
        write_atomic(here / f"{_file_name(this_node())}.json", (json.dumps(record) + "\n").encode())
    print(f"rank {place.rank} stands by: the first {place.train_world} of {place.agent_world} ranks train", flush=True)
    while not (here / "released").exists():
        time.sleep(poll_s)
    return 0


def release_spares(run_dir: RunDir) -> None:
    """Rank 0, as the training ranks end this start: its spares may exit (else the agents' exit barrier would wait
    for them)."""
    here = start_dir(run_dir)
    here.mkdir(parents=True, exist_ok=True)
    write_atomic(here / "released", b"")


def clear_old_starts(run_dir: RunDir) -> None:
    """Rank 0 at a start: the spares directories of earlier starts (their spares were restarted or released)."""
    here = start_dir(run_dir)
    for old in (run_dir.control / "spares").glob("*"):
        if old != here:
            shutil.rmtree(old, ignore_errors=True)


def spares_of_start(run_dir: RunDir) -> list[str]:
    """The nodes standing by in this start, as they said so (read by rank 0 at the first step, long after the
    spares wrote it: they build nothing)."""
    found = []
    for path in sorted(start_dir(run_dir).glob("*.json")):
        try:
            found.append(str(json.loads(path.read_text())["node"]))
        except (OSError, ValueError, KeyError):
            continue  # a record being written (write_atomic renames, so only a foreign file)
    return sorted(found)


def _file_name(node: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", node)


def this_node() -> str:
    return os.environ.get(NODE_NAME_ENV) or socket.gethostname()


@dataclass(frozen=True)
class NodeChange:
    """The nodes of this start against the last one's. The spares of this start are known only once they said so
    (`spares_of_start`), so the lost and joined nodes are worked out at the first step (`resolve`)."""

    before_nodes: list[str]  # the last start's training nodes and spares
    before_spares: list[str]
    nodes: list[str]  # this start's training nodes
    old_layout: str  # factors, e.g. "tp(1) * pp(1) * dp(3)"
    new_layout: str
    last_step: int | None  # the last step completed before the change, and when
    last_step_time: float | None
    spares: list[str] = field(default_factory=list)  # this start's spares, once resolved

    def resolve(self, spares: list[str]) -> NodeChange:
        return NodeChange(**{**self.__dict__, "spares": sorted(spares)})

    @property
    def lost(self) -> list[str]:
        return sorted((set(self.before_nodes) | set(self.before_spares)) - set(self.nodes) - set(self.spares))

    @property
    def joined(self) -> list[str]:
        return sorted((set(self.nodes) | set(self.spares)) - set(self.before_nodes) - set(self.before_spares))

    @property
    def took_over(self) -> list[str]:
        """Spares of the last start that train in this one."""
        return sorted(set(self.nodes) & set(self.before_spares))

    @property
    def changed(self) -> bool:
        return bool(self.lost or self.joined or self.took_over) or self.old_layout != self.new_layout


def nodes_record(run_dir: RunDir) -> Path:
    return run_dir.control / "nodes.json"


def note_nodes(run_dir: RunDir, nodes: list[str], factors: str) -> NodeChange | None:
    """Rank 0: record this start's training nodes and layout; against the last start's, or None on the first
    start. The spares are added at the first step (`note_spares`)."""
    path = nodes_record(run_dir)
    try:
        before = json.loads(path.read_text())
    except (OSError, ValueError):
        before = None
    now = sorted(set(nodes))
    # "ranks": each rank's node, in rank order: the training world, which no spare is part of.
    _write_nodes(run_dir, {"nodes": now, "ranks": list(nodes), "spares": [], "layout": factors, "t": time.time()})
    if not isinstance(before, dict):
        return None
    last = last_step_event(run_dir.metrics)
    return NodeChange(
        before_nodes=sorted(before.get("nodes", [])),
        before_spares=sorted(before.get("spares", [])),
        nodes=now,
        old_layout=str(before.get("layout", "")),
        new_layout=factors,
        last_step=None if last is None else int(last["step"]),
        last_step_time=None if last is None else float(last["t"]),
    )


def note_spares(run_dir: RunDir, spares: list[str]) -> None:
    """Rank 0 at the first step: this start's spares into control/nodes.json, for the next start to compare."""
    try:
        record = json.loads(nodes_record(run_dir).read_text())
    except (OSError, ValueError):
        return
    _write_nodes(run_dir, {**record, "spares": sorted(spares)})


def _write_nodes(run_dir: RunDir, record: dict[str, Any]) -> None:
    run_dir.make_control()
    write_atomic(nodes_record(run_dir), (json.dumps(record) + "\n").encode())


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
    events: EventWriter,
    run_dir: RunDir,
    change: NodeChange | None,
    *,
    resumed_step: int,
    spare_nodes: int,
    then: Callable[[int], None],
    otherwise: Callable[[], None] | None = None,
) -> Callable[[int], None]:
    """An on_step callback that, as the first step of this start starts (the end of the lost time): records this
    start's spares, emits a `nodes` event (which nodes train, which stand by) and, when the nodes changed, the
    change's `recovery` event (else calls `otherwise`, the ordinary recovery event of a restart); then hands every
    step to `then` (the watchdog's heartbeat). `spare_nodes`: how many nodes this start has standing by."""
    done = False

    def on_step(step: int) -> None:
        nonlocal done
        if not done:
            done = True
            now = time.time()
            spares = spares_of_start(run_dir)
            note_spares(run_dir, spares)
            nodes = change.nodes if change is not None else _recorded_nodes(run_dir)
            events.emit("nodes", nodes=nodes, spares=spares, spares_expected=spare_nodes)
            resolved = None if change is None else change.resolve(spares)
            if resolved is not None and resolved.changed:
                since = resolved.last_step_time
                events.emit(
                    "recovery",
                    restart=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
                    resumed_step=resumed_step,
                    lost_seconds=round(now - since, 3) if since is not None else 0.0,
                    lost_nodes=resolved.lost,
                    joined_nodes=resolved.joined,
                    took_over=resolved.took_over,
                    spares_left=len(spares),
                    layout_from=resolved.old_layout,
                    layout_to=resolved.new_layout,
                    redone_steps=max(0, (resolved.last_step or 0) - resumed_step),
                    reason=_reason(resolved),
                )
            elif otherwise is not None:
                otherwise()
        then(step)

    return on_step


def _recorded_nodes(run_dir: RunDir) -> list[str]:
    try:
        return [str(n) for n in json.loads(nodes_record(run_dir).read_text()).get("nodes", [])]
    except (OSError, ValueError):
        return []


def _reason(change: NodeChange) -> str:
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
    left = f"{len(change.spares)} spare{'s' if len(change.spares) != 1 else ''} left"
    return f"{' and '.join(parts) or 'nodes changed'}: {layouts}; {left}"
