"""Which all-to-all BLOOM-MoE's layers exchange tokens with, chosen once per engine by the planner's cost model.

DeepSpeed's MoE layer dispatches and combines tokens over the ``ep`` group with its module-level ``_AllToAll``
(model/moe.py ``install_all_to_all`` replaces it). ``select_all_to_all`` decides which exchange goes there: where an
ep group spans nodes and ``planner/moe_costs.py``'s ``choose_all_to_all`` (latency O(G + p/G) against O(p)
messages, the bytes on each link) prefers it, the hierarchical exchange of ``parallel/experts/all_to_all.py``; else
DeepSpeed's flat one. The engine keeps the answer (``ParallelEngine.all_to_all``), and ``train/from_spec.py`` records
it from there in the run directory (ds_config.json).

Where the nodes are cut (``node_size``): the run's hardware profile, the plan's, is the one source, so the engine
decides with the same ranks per node and links as the plan that printed the choice (planner/device.py
``ranks_per_node``). The launcher's LOCAL_WORLD_SIZE stands in only where no profile is given (tests, benches, the
engine built by hand), and without either the whole world is one node.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from appliance.hardware.profile import Hardware
from appliance.model.config import BloomConfig
from appliance.model.moe import DEEPSPEED_ALL_TO_ALL
from appliance.parallel.experts.all_to_all import make_all_to_all
from appliance.planner.device import ranks_per_node as planned_ranks_per_node
from appliance.planner.moe_costs import choose_all_to_all, links_from_hardware, moe_shape_for_model


@dataclass(frozen=True)
class NodeSize:
    """How many consecutive ranks share a node, where that number came from, and a warning when the launcher
    disagrees with the plan."""

    ranks_per_node: int
    source: str  # "hardware profile", "LOCAL_WORLD_SIZE" or "one node"
    warning: str = ""


def node_size(world: int, hardware: Hardware | None, environ: Mapping[str, str] | None = None) -> NodeSize:
    """The ranks per node the exchange is cut by: the profile's (planner/device.py ``ranks_per_node``) when
    ``hardware`` is given, else the launcher's LOCAL_WORLD_SIZE, else the whole world; at most ``world``.

    With both known and different, the profile's count is kept and ``warning`` names both. Not refused: the
    hierarchical exchange moves the same bytes to the same ranks whatever node size it assumes (it only splits each
    ep group into sub-groups, and groups that do not split evenly fall back to flat, ``_node_aligned``), so a
    wrong count costs speed (its intra-node step may cross the fabric, or a split is missed), never the result:
    tests/distributed/test_moe_parallel.py runs one host as 2 "nodes" bitwise equal to the flat exchange."""
    env = os.environ if environ is None else environ
    local = env.get("LOCAL_WORLD_SIZE", "")
    launched = min(int(local), world) if local.isdigit() and int(local) > 0 else None
    if hardware is None:
        if launched is not None:
            return NodeSize(launched, "LOCAL_WORLD_SIZE")
        return NodeSize(world, "one node")
    planned = max(1, min(planned_ranks_per_node(hardware, world), world))
    warning = ""
    if launched is not None and launched != planned:
        warning = (
            f"expert all-to-all: the plan's hardware profile puts {planned} of the {world} ranks on each node, the "
            f"launcher {launched} (LOCAL_WORLD_SIZE); the exchange follows the plan's {planned}, which may cost "
            f"speed: launch {planned} ranks per node or re-plan for these nodes"
        )
    return NodeSize(planned, "hardware profile", warning)


@dataclass(frozen=True)
class AllToAllSelection:
    """The exchange the MoE layers use and why: ``exchange`` is what ``install_all_to_all`` puts in DeepSpeed's place
    (an object with DeepSpeed's ``apply(group, x)``), ``kind`` "flat" or "hierarchical", ``reason`` the cost model's
    words (planner/moe_costs.py ``choose_all_to_all``, the planner's own decision), ``nodes`` the node size it
    assumed."""

    kind: str
    reason: str
    exchange: Any
    nodes: NodeSize

    def record(self) -> dict[str, Any]:
        """What run_dir/ds_config.json records of it (beside DeepSpeed's settings, as the run's other choices)."""
        record: dict[str, Any] = {
            "kind": self.kind,
            "reason": self.reason,
            "ranks_per_node": self.nodes.ranks_per_node,
            "ranks_per_node_from": self.nodes.source,
        }
        if self.nodes.warning:
            record["warning"] = self.nodes.warning
        return record


# The sequence the choice assumes when the caller gives none: BLOOM's 2048. The choice weighs message start-up
# latency against bytes, so the length matters near the crossover only.
CHOICE_SEQUENCE = 2048


def select_all_to_all(
    config: BloomConfig,
    topology: Any,
    *,
    micro_batch_size: int = 1,
    seq_len: int | None = None,
    hardware: Hardware | None = None,
    environ: Mapping[str, str] | None = None,
) -> AllToAllSelection:
    """The all-to-all every MoE layer exchanges tokens with, by topology. Collective: every rank calls it (the
    hierarchical exchange creates its sub-groups here).

    The ep groups (``topology.groups("ep")``) are cut into nodes as ``node_size`` says (``hardware``: the run's
    profile; None: LOCAL_WORLD_SIZE from ``environ``, os.environ by default). Where an ep group spans nodes and
    ``choose_all_to_all`` (the planner's cost model, over ``hardware``'s links, or those of a profile of this
    launch's nodes) says hierarchical, the hierarchical exchange over those groups; otherwise DeepSpeed's flat one.
    The exchange's size is micro_batch_size x seq_len / cp tokens (seq_len None: 2048, BLOOM's)."""
    world = topology.world_size
    nodes = node_size(world, hardware, environ)
    if nodes.warning and _is_rank_zero():
        print(f"warning: {nodes.warning}", file=sys.stderr, flush=True)
    if not config.is_moe or topology.ep == 1:
        return AllToAllSelection("flat", "ep = 1: no all-to-all at all", DEEPSPEED_ALL_TO_ALL, nodes)
    ranks_per_node = nodes.ranks_per_node
    if hardware is None:
        hardware = _launch_hardware(world, ranks_per_node)
    shape = moe_shape_for_model(
        _ExpertFigures(config),
        ep=topology.ep,
        tokens=max(1, micro_batch_size * (seq_len or CHOICE_SEQUENCE) // topology.cp),
        ranks_per_node=ranks_per_node,
        rank_stride=topology.tp * topology.cp,  # ep neighbours sit tp x cp ranks apart (topology.py)
    )
    choice = choose_all_to_all(shape, links_from_hardware(hardware))
    kind, reason = choice.kind, choice.reason
    ep_groups = topology.groups("ep")
    if kind == "hierarchical" and not _node_aligned(ep_groups, ranks_per_node):
        # The cost model assumes every ep group holds the same number of ranks on each node it spans; a pipeline
        # stage that starts mid-node breaks that, and the two-step exchange cannot split such a group.
        kind, reason = "flat", f"flat: the ep groups {ep_groups} do not hold equally many ranks on each node"
    exchange: Any = DEEPSPEED_ALL_TO_ALL
    if kind == "hierarchical":
        exchange = make_all_to_all("hierarchical", ep_groups=ep_groups, ranks_per_node=ranks_per_node)
    if _is_rank_zero():
        print(f"expert all-to-all: {reason}", flush=True)
    return AllToAllSelection(kind, reason, exchange, nodes)


def _is_rank_zero() -> bool:
    return dist.is_initialized() and dist.get_rank() == 0


def _node_aligned(ep_groups: list[list[int]], ranks_per_node: int) -> bool:
    """Every ep group holds the same number of ranks on every node it touches, in ascending order."""
    for ranks in ep_groups:
        counts: dict[int, int] = {}
        for rank in ranks:
            counts[rank // ranks_per_node] = counts.get(rank // ranks_per_node, 0) + 1
        if len(set(counts.values())) != 1 or list(ranks) != sorted(ranks):
            return False
    return True


@dataclass(frozen=True)
class _ExpertFigures:
    """A BloomConfig's expert figures under the names the cost model reads (moe_costs.ExpertModel)."""

    config: BloomConfig

    @property
    def hidden(self) -> int:
        return self.config.hidden_size

    @property
    def ffn_hidden(self) -> int:
        return 4 * self.config.hidden_size  # BLOOM's MLP

    @property
    def moe_num_experts(self) -> int:
        return self.config.moe_num_experts

    @property
    def moe_top_k(self) -> int:
        return self.config.moe_top_k

    @property
    def moe_capacity_factor(self) -> float:
        return self.config.moe_capacity_factor

    @property
    def moe_layers(self) -> int:
        return len(self.config.moe_blocks)


def _launch_hardware(world: int, ranks_per_node: int) -> Any:
    """A profile of this launch's nodes when no hardware profile is given: the devices DeepSpeed runs on, the
    fabric unknown (the cost model's Ethernet default)."""
    gpus = ranks_per_node if torch.cuda.is_available() else 0
    return Hardware(
        nodes=max(1, world // ranks_per_node),
        gpus_per_node=gpus,
        gpu="generic" if gpus else "none",
        gpu_memory_gb=0.0,
        intra_node="nvlink" if gpus else "loopback",
        intra_node_gbps=0.0,
        inter_node="ethernet",
        inter_node_gbps=0.0,
        cpu_cores=1,
        ram_gb=0.0,
    )
