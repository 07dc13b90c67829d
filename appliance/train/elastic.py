"""Losing a node and carrying on (`--nnodes MIN:MAX`, `--spares K`): the ranks' side.

The agents (torch.distributed.run, c10d rendezvous) hold the training nodes only: the plan's N (MAX of MIN:MAX).
Spares stand by outside them, in a process that imports no torch (train/standby.py), and start their agent when a
node is lost; a node lost for good leaves the agents to re-form with fewer. Each start, the ranks:

1. place themselves (`placement`): the agents' world holds M nodes of the same ranks each; the plan trains on N of
   them (its world divided by the ranks per node). With M = N every rank trains; with fewer, the largest usable
   count below (planner/shrink.py `usable_node_counts`) trains, and the rest stand by inside the world: idle ranks
   that build nothing (no process group, no device, no data) and wait on the host (`stand_by`) until the training
   ranks of their start release them, or their agent restarts them when the agents re-form. The training ranks form
   a world of their own (WORLD_SIZE set to theirs before the process group forms), so an idle rank is in none of
   their groups and none of their collectives. Which of the survivors idle is the rendezvous's order (torch sorts
   the agents by address and pid): the last nodes of it;
2. take the layout for the ranks that train from the planner (planner/shrink.py: on GPUs the fastest layout the
   planner fits in the GPU's memory, tp kept and pp, dp, micro-batch, ZeRO stage and recompute free; on CPU ranks
   the same tp, pp and cp with dp refitted; the global batch kept either way), or stop with its error naming the
   factors;
3. learn which nodes they are on (every training rank's node name, gathered) and compare them with the nodes of
   the last start, which rank 0 keeps in control/nodes.json (train/node_record.py);
4. resume from the newest checkpoint as always; checkpoints load at any layout (train/checkpoint.py).

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
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from appliance.atomic import write_atomic
from appliance.errors import BadInput
from appliance.planner.runspec import RunSpec
from appliance.planner.shrink import layout_for_world, usable_node_counts
from appliance.rundir import RunDir
from appliance.train.nodes import ELASTIC_ENV, NODE_NAME_ENV

if TYPE_CHECKING:
    from appliance.train.nodes import NodeGroup

# How often an idle rank looks for its release: a file check a second costs nothing, and one released a second late
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
    """This start's directory of idle ranks: the agents' run id and the worker store's address, which every worker of a
    rendezvous round shares and a new round replaces (the agents pick a fresh port for each)."""
    found = os.environ if env is None else env
    start = "-".join(found.get(k, "") for k in ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT"))
    return run_dir.control / "spares" / re.sub(r"[^A-Za-z0-9_.-]", "_", start)


def stand_by(run_dir: RunDir, place: Placement, *, poll_s: float = STAND_BY_POLL_S) -> int:
    """An idle rank's whole life (a step-down's survivor beyond the usable count): say which node idles (its local
    rank 0), then wait on the host, holding no process group, device memory or data, until the training ranks of
    this start release it (they ended: done, stopped or failed for good). A loss ends it sooner: the agents re-form
    and its agent stops it and starts it again with a new rank. Exits 0: the agent must not count its end as a
    failure."""
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
    """Rank 0, as the training ranks end this start: its idle ranks may exit (else the agents' exit barrier would
    wait for them)."""
    here = start_dir(run_dir)
    here.mkdir(parents=True, exist_ok=True)
    write_atomic(here / "released", b"")


def clear_old_starts(run_dir: RunDir) -> None:
    """Rank 0 at a start: the directories of earlier starts (their idle ranks were restarted or released)."""
    here = start_dir(run_dir)
    for old in (run_dir.control / "spares").glob("*"):
        if old != here:
            shutil.rmtree(old, ignore_errors=True)


def idle_of_start(run_dir: RunDir) -> list[str]:
    """The nodes idling in this start, as they said so (read by rank 0 at the first step, long after their ranks
    wrote it: they build nothing)."""
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
