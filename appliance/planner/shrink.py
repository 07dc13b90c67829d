"""The layout for the ranks an elastic launch actually has: the plan's own, or re-planned over fewer (or again all)
nodes.

With `--nnodes MIN:MAX`, or `--spares K` once the spares are used, the agents re-form without a lost node and start
the workers with a smaller world. When the world is the plan's again (the node came back), the plan's layout is the
answer: that is the grow-back. Either way the global batch stays the plan's, so the learning-rate and batch-size
schedules (counted in samples) stay too. Checkpoints are layout-independent (train/checkpoint.py), so the ranks load
the newest one at whichever layout this returns.

GPU plans: the step-down is planned, not only divided. Fewer data-parallel ranks share the ZeRO partitions, so dp
refitted alone can need more memory than a GPU has: BLOOM-176B's tp4 pp12 dp8 ZeRO-1 plan (75.5 of 80 GiB) needs
81.9 GiB at dp4 on 24 nodes and 120.3 GiB at dp1 on 6. A world's layout is the planner's search (planner/search.py:
the memory and time models and the fit rule `plan` uses: the fullest stage, allocator margin and fixed overhead
included, within the GPU's memory) over that world's nodes, with the plan's tp kept. Checkpoints reshard across pp,
dp, micro-batch, ZeRO stage and recompute, but a new tp pads the vocabulary to other rows than the checkpoint's
(train/relayout.py), so tp stays. The plan's layout with dp refitted is a candidate too (a given layout the search
does not propose, e.g. 2D TP). The fastest candidate that fits wins, as in `plan`; a world where none fits is not
usable. `usable_node_counts` (what MIN may be, and how many nodes train) and `layout_for_world` (what they train
with) ask the same question, so the ranks never step into a layout the planner has not fitted. BLOOM-176B on fewer
than 48 nodes: 40 (tp4 pp10 dp8, 74.2 GiB), 36, 35, 32, 28, 24 (tp4 pp24 dp2, 68.2 GiB), ..., down to 9; 6 nodes, a
single replica of the plan's pipeline, fit no layout.

CPU ranks (the tests' loopback nodes, hardware without GPUs) have no device memory to prove: only dp changes,

    dp = world / (tp * pp * cp)          micro-batches per step = gbs / (mbs * dp)

e.g. tp1 pp1 dp3, gbs 6, mbs 1 on three nodes: 2 micro-batches per step; on two nodes dp2 and 3 micro-batches.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Any

from appliance.errors import BadInput
from appliance.hardware.profile import Hardware
from appliance.planner.device import make_device
from appliance.planner.layout import Layout
from appliance.planner.model_shape import ModelShape
from appliance.planner.runspec import RunSpec
from appliance.planner.search import Evaluated, evaluate, search_layouts


@dataclass(frozen=True)
class StepDown:
    """A node count a GPU run carries on with once a loss finds no spare, its layout and the planner's figures."""

    nodes: int
    layout: Layout
    memory_gb: float  # per GPU on the fullest stage, margins included (planner/memory.py)
    capacity_gb: float  # the GPU's memory
    step_s: float
    tokens_per_s: float

    def to_json(self) -> dict[str, Any]:
        return {
            "nodes": self.nodes,
            "layout": self.layout.describe(),
            "memory_gb_per_gpu": self.memory_gb,
            "memory_capacity_gb": self.capacity_gb,
            "step_time_s": self.step_s,
            "tokens_per_s": self.tokens_per_s,
        }


@dataclass(frozen=True)
class _Basis:
    """What a world's layout depends on: the plan's hardware, model, layout and precision, and the expert store's
    budgets Layout.validate checks. Hashable (a RunSpec's report is not), so each world is searched once."""

    hardware: Hardware
    model: ModelShape
    layout: Layout
    dtype: str
    expert_device_budget_mb: int
    expert_host_budget_mb: int

    @classmethod
    def of(cls, spec: RunSpec) -> _Basis:
        train = spec.train
        return cls(
            spec.hardware,
            spec.model,
            spec.layout,
            train.dtype,
            train.expert_device_budget_mb,
            train.expert_host_budget_mb,
        )

    def valid(self, layout: Layout, world: int) -> bool:
        """Every rule the ranks hold a layout to (the search's candidates skip the precision and store ones)."""
        model = self.model
        try:
            layout.validate(
                world,
                model.heads,
                model.layers,
                model.seq_len,
                moe_num_experts=model.moe_num_experts,
                dtype=self.dtype,
                expert_device_budget_mb=self.expert_device_budget_mb,
                expert_host_budget_mb=self.expert_host_budget_mb,
            )
        except BadInput:
            return False
        return True


def layout_for_world(spec: RunSpec, world_size: int) -> Layout:
    """The layout the plan trains with on `world_size` ranks: its own on its own world; otherwise, on GPUs the
    fastest layout that fits (tp kept, the global batch kept), on CPU ranks its own with dp refitted. BadInput
    naming every factor when there is none: the run stops, and resumes from its newest checkpoint once enough
    nodes are back."""
    planned = spec.layout
    if world_size == planned.world_size:
        return planned
    if not spec.hardware.has_gpus:
        model = spec.model
        return _refit(planned, world_size, heads=model.heads, layers=model.layers, seq_len=model.seq_len)
    found = _planned_world(_Basis.of(spec), world_size)
    if isinstance(found, Evaluated):
        return found.layout
    per_node = spec.hardware.gpus_per_node
    usable = usable_node_counts(spec, planned.world_size // per_node)
    raise BadInput(
        f"elastic re-plan for {world_size} ranks (plan {planned.factors} on {planned.world_size // per_node}"
        f" nodes): {found}; the run stops here, resumable: it resumes from its newest checkpoint on {usable[0]} or"
        f" more nodes (node counts with a layout that fits: {usable})"
    )


def usable_node_counts(spec: RunSpec, max_nodes: int) -> list[int]:
    """Node counts, 1..max_nodes, on which the plan can carry on (ranks per node = plan ranks / max_nodes), each
    by layout_for_world's own test: what MIN in --nnodes MIN:MAX may be, and which count trains when fewer nodes
    than the plan's are left. The plan's own count is always one."""
    planned = spec.layout
    per_node = planned.world_size // max_nodes
    return [nodes for nodes in range(1, max_nodes + 1) if _usable(spec, nodes * per_node)]


def step_downs(spec: RunSpec, nodes: int) -> list[StepDown]:
    """A GPU plan on `nodes` nodes: each usable count below it, largest first, with the layout it trains and that
    layout's memory and speed: what the run steps down to once a loss finds no spare. Empty on CPU ranks."""
    if not spec.hardware.has_gpus:
        return []
    basis, per_node = _Basis.of(spec), spec.layout.world_size // nodes
    out = []
    for count in range(nodes - 1, 0, -1):
        found = _planned_world(basis, count * per_node)
        if isinstance(found, Evaluated):
            est = found.memory
            tokens = found.layout.global_batch_size * spec.model.seq_len
            step = found.time.total_s
            out.append(StepDown(count, found.layout, est.total_gb, est.capacity_gb, step, tokens / step))
    return out


def _usable(spec: RunSpec, world: int) -> bool:
    if world == spec.layout.world_size:
        return True
    if spec.hardware.has_gpus:
        return isinstance(_planned_world(_Basis.of(spec), world), Evaluated)
    model = spec.model
    try:
        _refit(spec.layout, world, heads=model.heads, layers=model.layers, seq_len=model.seq_len)
    except BadInput:
        return False
    return True


@functools.lru_cache(maxsize=256)
def _planned_world(basis: _Basis, world: int) -> Evaluated | str:
    """The fastest layout for `world` GPUs that fits, or why there is none, every factor named. Cached: every rank
    asks at every start, once for its world and once for each count it might train on."""
    hw, planned, model = basis.hardware, basis.layout, basis.model
    nodes, rest = divmod(world, hw.gpus_per_node)
    if rest or not nodes:
        return f"{world} ranks do not fill whole nodes of {hw.gpus_per_node} GPUs"
    hardware = replace(hw, nodes=nodes)
    gbs = planned.global_batch_size
    candidates: list[Evaluated] = []
    constraints: list[str] = []
    if planned.tp2d == 1:  # the search places 1D TP only
        result = search_layouts(hardware, model, gbs, basis.dtype, only_tp=planned.tp)
        candidates += result.evaluated
        constraints += [reason for _, reason in result.constraint_rejections]
    try:
        refit = _refit(planned, world, heads=model.heads, layers=model.layers, seq_len=model.seq_len)
    except BadInput as e:
        constraints.append(str(e))
    else:
        if all(e.layout != refit for e in candidates):
            candidates.append(evaluate(refit, model, hardware, make_device(hardware, world, basis.dtype)))
    valid = [e for e in candidates if basis.valid(e.layout, world)]
    fitting = [e for e in valid if e.feasible]
    if fitting:
        return min(fitting, key=Evaluated.rank_key)
    where = (
        f"{nodes} nodes x {hw.gpus_per_node} GPUs hold no layout of {model.name} at global batch({gbs}) with"
        f" tp({planned.tp}) kept (a new tp would pad the vocabulary to other rows than the checkpoint's)"
    )
    if not valid:
        return f"{where}: {'; '.join(constraints) or 'no candidate layout'}"
    leanest = min(valid, key=lambda e: e.memory.total_gb)
    mem = leanest.memory
    return (
        f"{where} that fits {mem.capacity_gb:g} GiB per GPU: the leanest of {len(valid)} candidates (any pp, dp,"
        f" micro-batch, ZeRO stage and recompute), {leanest.layout.describe()} = {leanest.layout.factors}, needs"
        f" {mem.total_gb:.1f} GiB (stage {mem.stage})"
    )


def _refit(planned: Layout, world_size: int, *, heads: int, layers: int, seq_len: int) -> Layout:
    """The plan's layout with dp refitted to `world_size` ranks (tp, pp, cp, mbs and gbs kept), validated against
    the model; BadInput naming every factor when no such layout exists."""
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
