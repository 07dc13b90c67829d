"""The layout for the ranks an elastic launch actually has: the plan's own, or re-planned over fewer (or again all)
nodes.

With `--nnodes MIN:MAX` the agents may re-form without a lost node and start the workers with a smaller world.
Model parallelism cannot change without re-cutting every layer, and need not: a node holds whole TP groups of a
stage, so losing it removes whole data-parallel replicas. What changes is dp, and with it the gradient
accumulation, so that the global batch (and with it the learning-rate and batch-size schedules, counted in
samples) stays the plan's:

    dp = world / (tp * pp * cp)          micro-batches per step = gbs / (mbs * dp)

e.g. tp1 pp1 dp3, gbs 6, mbs 1 on three nodes: 2 micro-batches per step; on two nodes dp2 and 3 micro-batches.
When the world is the plan's again (the node came back), the plan's layout is the answer: that is the grow-back.
Checkpoints are layout-independent (train/checkpoint.py), so the ranks load the newest one at whichever layout this
returns. Layout's own checks decide what is valid; this module adds no rule of its own beyond the division.
"""

from __future__ import annotations

from dataclasses import replace

from appliance.errors import BadInput
from appliance.planner.layout import Layout


def layout_for_world(planned: Layout, world_size: int, *, heads: int, layers: int, seq_len: int) -> Layout:
    """The plan's layout with dp refitted to `world_size` ranks (tp, pp, cp, mbs and gbs kept), validated against
    the model; BadInput naming every factor when no such layout exists."""
    if world_size == planned.world_size:
        return planned
    model_ranks = planned.tp * planned.pp * planned.cp
    shown = planned.factors.replace(f"dp({planned.dp})", "dp")
    if world_size < model_ranks or world_size % model_ranks:
        raise BadInput(
            f"elastic re-plan: {world_size} ranks cannot hold {shown}: the world is not a multiple of the"
            f" {model_ranks} ranks of one model replica (plan {planned.factors} = {planned.world_size});"
            " bring back the lost node or lower MIN in --nnodes MIN:MAX so the agents wait for it"
        )
    dp = world_size // model_ranks
    gbs, mbs = planned.global_batch_size, planned.micro_batch_size
    if gbs % (mbs * dp):
        raise BadInput(
            f"elastic re-plan: {world_size} ranks give dp({dp}), but global batch({gbs}) is not divisible by"
            f" mbs({mbs}) * dp({dp}) = {mbs * dp} (plan {planned.factors}); the same global batch needs a dp that"
            f" divides {gbs // mbs}: raise MIN in --nnodes MIN:MAX to the nodes such a dp fills"
        )
    try:
        shrunk = replace(planned, dp=dp)
        shrunk.validate(world_size, heads, layers, seq_len)
    except BadInput as e:
        raise BadInput(f"elastic re-plan for {world_size} ranks (plan {planned.factors}): {e}") from None
    return shrunk


def usable_node_counts(planned: Layout, max_nodes: int) -> list[int]:
    """Node counts, 1..max_nodes, on which the plan can carry on (ranks per node = plan ranks / max_nodes): what
    MIN in --nnodes MIN:MAX may be. A count missing here would stop the run with layout_for_world's error."""
    per_node = planned.world_size // max_nodes
    usable = []
    for nodes in range(1, max_nodes + 1):
        world = nodes * per_node
        model_ranks = planned.tp * planned.pp * planned.cp
        dp, rest = divmod(world, model_ranks)
        if dp and not rest and planned.global_batch_size % (planned.micro_batch_size * dp) == 0:
            usable.append(nodes)
    return usable
