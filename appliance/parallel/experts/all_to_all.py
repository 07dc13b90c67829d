"""The all-to-all that sends tokens to their experts and back, flat or hierarchical, as autograd functions.

DeepSpeed's MoE layer (``deepspeed.moe.sharded_moe.MOELayer``) exchanges its dispatched tokens, an [E, C, M]
tensor (E = ep x local experts, C slots each), with ``_AllToAll.apply(ep_group, x)``: dim 0 is split into p = ep
equal chunks, chunk j goes to ep rank j, and the output holds, in source-rank order, the chunk every rank sent
here. The combine after the experts is the same exchange. Both functions below have exactly those semantics.

    flat          one all-to-all over the p ranks: p - 1 messages per rank, each of S/p bytes
    hierarchical  p = N nodes x G ranks per node, the ep ranks of a node contiguous (ep rank = n G + g):
                  1. all-to-all inside the node (G ranks): local rank g' gets every chunk bound for local
                     index g' on any node                       G - 1 messages of S/G bytes
                  2. all-to-all across nodes between the ranks with the same local index (N ranks): node n'
                     gets the chunks bound for it               N - 1 messages of S/N bytes

With r = n G + g, view the input as [dest node n', dest local g', chunk]. Step 1 sends along g' after moving it in
front ([g', n', chunk]) and receives [src local s, dest node n', chunk]; step 2 sends along n' ([n', s, chunk]) and
receives [src node m, src local s, chunk] = [source rank m G + s, chunk]: the flat output, element for element
(data are only moved, never summed, so the results are bitwise equal). Messages per rank fall from p - 1 to
(G - 1) + (N - 1), O(G + p/G) instead of O(p); inter-node bytes stay (N - 1)/N S, and (G - 1)/G S more cross the
node's fast links. planner/moe_costs.py models both and picks one.

The exchange is a permutation of chunks that is its own inverse (chunk j of rank i lands as chunk i of rank j),
so the backward of either function is the same exchange applied to the gradient.

``use_all_to_all(kind, ...)`` is the one place that makes DeepSpeed's MoE layers use these: it replaces
``sharded_moe._AllToAll``, which ``MOELayer.forward`` looks up at every call (``make_all_to_all`` builds the
same stand-in for code that installs it through a seam of its own). Each exchange adds its messages
and bytes to an ``AllToAllCounter`` (bytes and messages SENT to other ranks by this rank, the planner's convention).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist

from appliance.errors import BadInput

AllToAllKind = Literal["flat", "hierarchical"]
KINDS: tuple[AllToAllKind, ...] = ("flat", "hierarchical")


@dataclass
class AllToAllCounter:
    """What this rank sent in the exchanges it ran: ``calls`` (one per flat or hierarchical exchange, forward and
    backward alike), ``collectives`` (all_to_all_single calls: 1 per flat exchange, 2 per hierarchical one),
    ``messages`` (to ranks other than itself) and ``bytes_sent`` (to them)."""

    calls: int = 0
    collectives: int = 0
    messages: int = 0
    bytes_sent: int = 0

    def reset(self) -> None:
        self.calls = self.collectives = self.messages = self.bytes_sent = 0


@dataclass(frozen=True)
class HierarchicalGroups:
    """The two sub-groups of one ep group that the hierarchical exchange runs over, as seen by one of its ranks.
    A side of one rank has no group (None) and no exchange."""

    ep_ranks: tuple[int, ...]  # the ep group's global ranks, in ep order
    ep_ranks_per_node: int  # G: ep ranks on each node
    nodes: int  # N: nodes the ep group spans
    intra: dist.ProcessGroup | None  # my node's G ep ranks
    inter: dist.ProcessGroup | None  # the N ep ranks with my local index, one per node


def ranks_per_node_from_launcher(explicit: int | None = None) -> int:
    """``explicit`` if given, else the launcher's LOCAL_WORLD_SIZE (torchrun and DeepSpeed's launcher set it)."""
    if explicit is not None:
        if explicit < 1:
            raise BadInput(f"all-to-all: ranks_per_node must be >= 1, got {explicit}")
        return explicit
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    if not local.isdigit() or int(local) < 1:
        raise BadInput(
            f"hierarchical all-to-all: ranks per node unknown (LOCAL_WORLD_SIZE={local!r} and no ranks_per_node "
            "argument); launch with torchrun/deepspeed or pass ranks_per_node"
        )
    return int(local)


def _split_by_node(ep_ranks: Sequence[int], ranks_per_node: int) -> list[list[int]]:
    """The ep group's ranks node by node. Ranks are laid out node by node (rank // ranks_per_node is the node), so
    ascending ep ranks are node-contiguous; the exchange needs the same count on every node."""
    nodes: dict[int, list[int]] = {}
    for rank in ep_ranks:
        nodes.setdefault(rank // ranks_per_node, []).append(rank)
    per_node = {len(members) for members in nodes.values()}
    if len(per_node) != 1 or list(ep_ranks) != sorted(ep_ranks):
        counts = {node: len(members) for node, members in nodes.items()}
        raise BadInput(
            f"hierarchical all-to-all: ep group {list(ep_ranks)} with {ranks_per_node} ranks per node has "
            f"{counts} members per node; every node must hold the same number, in ascending rank order"
        )
    return [nodes[node] for node in sorted(nodes)]


def hierarchical_groups(ep_groups: Sequence[Sequence[int]], ranks_per_node: int | None = None) -> HierarchicalGroups:
    """Create the intra- and inter-node sub-groups of every ep group (``topology.groups("ep")``); return this
    rank's. Collective over the world: every rank must call it with the same arguments (``dist.new_group`` is)."""
    per_node = ranks_per_node_from_launcher(ranks_per_node)
    me = dist.get_rank()
    mine: HierarchicalGroups | None = None
    for ep_ranks in ep_groups:
        by_node = _split_by_node(ep_ranks, per_node)
        local = len(by_node[0])
        intra_lists = by_node
        inter_lists = [[node[g] for node in by_node] for g in range(local)]
        intra = _new_groups(intra_lists, me)
        inter = _new_groups(inter_lists, me)
        if me in ep_ranks:
            mine = HierarchicalGroups(tuple(ep_ranks), local, len(by_node), intra, inter)
    if mine is None:
        raise BadInput(f"hierarchical all-to-all: rank {me} is in none of the ep groups {list(map(list, ep_groups))}")
    return mine


def _new_groups(rank_lists: list[list[int]], me: int) -> dist.ProcessGroup | None:
    """Create every list as a group (all ranks take part in each creation); return the one holding ``me``. Lists of
    one rank make no group: there is nothing to exchange."""
    found = None
    for ranks in rank_lists:
        if len(ranks) > 1:
            group = dist.new_group(ranks)
            if me in ranks:
                found = group
    return found


def _exchange(x: torch.Tensor, group: dist.ProcessGroup | None, size: int, counter: AllToAllCounter) -> torch.Tensor:
    """One all_to_all_single over ``group`` of ``size`` ranks: dim 0 in ``size`` chunks, chunk j to rank j."""
    if size == 1:
        return x
    if x.shape[0] % size != 0:
        raise ValueError(f"all-to-all: dimension 0 of size {x.shape[0]} does not split into {size} equal chunks")
    x = x.contiguous()
    out = torch.empty_like(x)  # on x's device: the group's, since the caller's tensor lives there
    dist.all_to_all_single(out, x, group=group)
    counter.collectives += 1
    counter.messages += size - 1
    counter.bytes_sent += x.numel() * x.element_size() * (size - 1) // size
    return out


def _flat(x: torch.Tensor, group: dist.ProcessGroup | None, counter: AllToAllCounter) -> torch.Tensor:
    counter.calls += 1
    return _exchange(x, group, dist.get_world_size(group), counter)


def _hierarchical(x: torch.Tensor, groups: HierarchicalGroups, counter: AllToAllCounter) -> torch.Tensor:
    nodes, local = groups.nodes, groups.ep_ranks_per_node
    if x.shape[0] % (nodes * local) != 0:
        raise ValueError(
            f"all-to-all: dimension 0 of size {x.shape[0]} does not split into {nodes} nodes x {local} ranks"
        )
    counter.calls += 1
    # [dest node n', dest local g', chunk...] -> [g', n', ...]: step 1 sends along the local index.
    blocks = x.reshape(nodes, local, -1, *x.shape[1:]).transpose(0, 1)
    received = _exchange(blocks.contiguous(), groups.intra, local, counter)  # [src local s, dest node n', ...]
    received = _exchange(received.transpose(0, 1).contiguous(), groups.inter, nodes, counter)  # [src node m, s]
    return received.reshape(x.shape)  # [source rank m G + s, ...]: the flat exchange's order


class _FlatAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup | None, counter: AllToAllCounter) -> torch.Tensor:
        ctx.group, ctx.counter = group, counter
        return _flat(x, group, counter)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _flat(grad, ctx.group, ctx.counter), None, None  # the exchange is its own inverse


class _HierarchicalAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, groups: HierarchicalGroups, counter: AllToAllCounter) -> torch.Tensor:
        ctx.groups, ctx.counter = groups, counter
        return _hierarchical(x, groups, counter)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _hierarchical(grad, ctx.groups, ctx.counter), None, None


def flat_all_to_all(
    x: torch.Tensor, group: dist.ProcessGroup | None, counter: AllToAllCounter | None = None
) -> torch.Tensor:
    """DeepSpeed's ``_AllToAll``: dim 0 in ep equal chunks, chunk i to ep rank i; differentiable."""
    return _FlatAllToAll.apply(x, group, counter if counter is not None else AllToAllCounter())


def hierarchical_all_to_all(
    x: torch.Tensor, groups: HierarchicalGroups, counter: AllToAllCounter | None = None
) -> torch.Tensor:
    """The same exchange in two steps, inside the node then across nodes (module docstring); differentiable."""
    return _HierarchicalAllToAll.apply(x, groups, counter if counter is not None else AllToAllCounter())


class MoeAllToAll:
    """Stands in for ``sharded_moe._AllToAll``: ``apply(group, x)`` as DeepSpeed calls it, counting into
    ``counter``."""

    def __init__(self, kind: AllToAllKind, groups: HierarchicalGroups | None, counter: AllToAllCounter) -> None:
        self.kind, self.groups, self.counter = kind, groups, counter

    def apply(self, group: dist.ProcessGroup, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "flat" or self.groups is None:
            return flat_all_to_all(x, group, self.counter)
        ranks = tuple(dist.get_process_group_ranks(group))
        if ranks != self.groups.ep_ranks:
            raise BadInput(
                f"hierarchical all-to-all: the MoE layer's ep group {list(ranks)} is not the ep group "
                f"{list(self.groups.ep_ranks)} given to use_all_to_all"
            )
        return hierarchical_all_to_all(x, self.groups, self.counter)


def make_all_to_all(
    kind: AllToAllKind,
    *,
    ep_groups: Sequence[Sequence[int]] = (),
    ranks_per_node: int | None = None,
    counter: AllToAllCounter | None = None,
) -> MoeAllToAll:
    """The stand-in for DeepSpeed's ``_AllToAll`` (what ``use_all_to_all`` installs), for code that installs it
    itself. "hierarchical" creates its sub-groups here: call it on every rank (arguments as ``use_all_to_all``)."""
    if kind not in KINDS:
        raise BadInput(f"all-to-all kind {kind!r}: must be one of {', '.join(KINDS)}")
    groups = None
    if kind == "hierarchical":
        if not ep_groups:
            raise BadInput("hierarchical all-to-all: needs ep_groups (topology.groups('ep'))")
        groups = hierarchical_groups(ep_groups, ranks_per_node)
    return MoeAllToAll(kind, groups, counter if counter is not None else AllToAllCounter())


_DEEPSPEED_ALL_TO_ALL: Any = None  # DeepSpeed's own _AllToAll, kept while ours is installed


def use_all_to_all(
    kind: AllToAllKind,
    *,
    ep_groups: Sequence[Sequence[int]] = (),
    ranks_per_node: int | None = None,
    counter: AllToAllCounter | None = None,
) -> AllToAllCounter:
    """Make every DeepSpeed MoE layer in this process exchange tokens with ``kind``; return the counter.

    ``ep_groups``: every ep group's ranks (``topology.groups("ep")``), needed by "hierarchical", whose sub-groups
    are created here: call it on every rank, after the process groups exist and before the first forward.
    ``ranks_per_node``: None reads LOCAL_WORLD_SIZE. Calling it again replaces the previous choice."""
    from deepspeed.moe import sharded_moe  # late: importing DeepSpeed costs seconds and picks an accelerator

    global _DEEPSPEED_ALL_TO_ALL
    if _DEEPSPEED_ALL_TO_ALL is None:
        _DEEPSPEED_ALL_TO_ALL = sharded_moe._AllToAll
    installed = make_all_to_all(kind, ep_groups=ep_groups, ranks_per_node=ranks_per_node, counter=counter)
    sharded_moe._AllToAll = installed
    return installed.counter


def restore_deepspeed_all_to_all() -> None:
    """Put DeepSpeed's own ``_AllToAll`` back (undo ``use_all_to_all``)."""
    global _DEEPSPEED_ALL_TO_ALL
    if _DEEPSPEED_ALL_TO_ALL is not None:
        from deepspeed.moe import sharded_moe

        sharded_moe._AllToAll = _DEEPSPEED_ALL_TO_ALL
        _DEEPSPEED_ALL_TO_ALL = None
