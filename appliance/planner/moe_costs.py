"""What experts cost one rank: memory, all-to-all traffic (flat or hierarchical), compute and offload traffic.

Self-contained: the input is ``MoeShape`` (the MoE figures of one model and layout) and ``MoeLinks`` (the
hardware's rates, ``links_from_hardware``), so nothing here depends on how a model config spells its experts.

Conventions (the planner's, comm.py): bytes and messages SENT by one rank; an expert is BLOOM's MLP, h -> f -> h
with biases; tokens are the ones one rank's gate routes per micro-batch (micro-batch x sequence / cp).

- Capacity: DeepSpeed gives every expert C = ceil(top_k x capacity_factor x tokens / E) slots, so each exchange
  moves an [E, C, h] tensor, S = E C h x act bytes ~ tokens x h x top_k x capacity_factor x act bytes, whatever
  the routing (empty slots are sent as zeros).
- Exchanges per step: 2 (dispatch, combine) x 2 (forward, its adjoint backward) x MoE layers x micro-batches.
- Flat (p = ep ranks): p - 1 messages of S/p. The ep group spans N = p / G nodes with G ep ranks each (ep ranks
  sit rank_stride = tp x cp apart, since ep folds inside dp): G - 1 messages stay in the node, p - G cross it.
- Hierarchical (parallel/experts/all_to_all.py): G - 1 messages of S/G inside the node, then N - 1 of S/N across
  nodes: O(G + p/G) messages instead of O(p); the inter-node bytes are the same, (N - 1)/N S, and
  (G - 1)/G S more cross the node's fast links.
- Time (alpha-beta): every message pays the link's start-up latency, one after another, plus its bytes at the
  link's per-rank bandwidth; every rank of a node exchanges at once, so the node's fabric is shared by all of them.
- Compute: an expert's forward is 2 GEMMs, 4 h f FLOPs per slot, and the backward twice that: 12 h f per slot, for
  the E C slots a rank's local experts fill (ep sources x E/ep experts x C). Padding slots cost the same as tokens:
  the capacity factor multiplies the compute, useful / total = tokens x top_k / (E C).
- Tensor parallelism (tp > 1, parallel/experts/parallel.py): every expert is sharded over the tp group like the
  dense MLP, so its parameters (2hf + f)/tp + h, its FLOPs per slot 12 h f / tp, and each exchange's tensor
  [E, C/tp, h] (the tp ranks hold the same tokens: each sends 1/tp of the slots, C rounded up to a multiple of tp).
- Offload (experts kept in host memory or on disk, streamed to the GPU): per step the weights go up for every
  micro-batch's forward and backward and the gradients come down once; from disk the optimizer states are also
  read and written back once for the update (the host tier updates in host memory, nothing to move).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Protocol

from appliance.errors import BadInput
from appliance.hardware.profile import Hardware
from appliance.hardware.specs import CPU_SPEC, FABRIC_GBPS, GENERIC_GPU, LOOPBACK_GBPS, gpu_spec
from appliance.planner import calibration as cal

# A PCIe Gen4 NVMe drive streams ~3.5 GB/s sequentially (Samsung 980 PRO data sheet: 7.0 read / 5.0 write; one
# drive shared by a node's ranks is the usual case, so take half): the disk tier's default per-rank rate.
DEFAULT_DISK_GBS = 3.5
EXCHANGES_PER_LAYER_AND_MICROBATCH = 4  # (dispatch + combine) x (forward + backward)
WEIGHT_BYTES, GRAD_BYTES, OPTIMIZER_BYTES = 2, 4, 12  # bf16 weights, fp32 grads, fp32 master + Adam m, v


@dataclass(frozen=True)
class MoeShape:
    num_experts: int  # E, per MoE layer
    top_k: int
    capacity_factor: float
    moe_layers: int
    hidden: int
    tokens: int  # routed by one rank per micro-batch
    ep: int  # ranks the experts of a layer are split over
    ranks_per_node: int  # GPUs (or CPU ranks) per node
    ffn_hidden: int = 0  # 0: BLOOM's 4 x hidden
    micro_batches: int = 1  # per step and rank
    rank_stride: int = 1  # global ranks between ep neighbours: tp x cp
    act_bytes: int = 2
    tp: int = 1  # tensor-parallel ranks each expert is sharded over (the dense layers' tp)

    def __post_init__(self) -> None:
        counts = ("num_experts", "top_k", "moe_layers", "hidden", "tokens", "ep", "ranks_per_node", "micro_batches")
        for name in (*counts, "rank_stride", "act_bytes", "tp"):
            if getattr(self, name) < 1:
                raise BadInput(f"MoE costs: {name} must be >= 1, got {getattr(self, name)}")
        if self.capacity_factor <= 0:
            raise BadInput(f"MoE costs: capacity_factor must be > 0, got {self.capacity_factor}")
        if self.num_experts % self.ep != 0:
            raise BadInput(f"MoE costs: num_experts({self.num_experts}) % ep({self.ep}) != 0")
        if self.top_k > self.num_experts:
            raise BadInput(f"MoE costs: top_k({self.top_k}) > num_experts({self.num_experts})")

    @property
    def ffn(self) -> int:
        return self.ffn_hidden or 4 * self.hidden

    @property
    def capacity(self) -> int:
        """Slots per expert and micro-batch, as DeepSpeed's gate sizes them; at tp > 1 a multiple of tp (DeepSpeed
        rounds it up so that each tp rank keeps a whole 1/tp of the slots)."""
        slots = math.ceil(self.top_k * self.capacity_factor * self.tokens / self.num_experts)
        return math.ceil(slots / self.tp) * self.tp

    @property
    def ep_ranks_per_node(self) -> int:
        """G: ep ranks sharing a node (the ep group spans ep x rank_stride consecutive ranks)."""
        return max(1, min(self.ep, self.ranks_per_node // self.rank_stride))

    @property
    def nodes_spanned(self) -> int:
        """N: nodes one ep group spans."""
        return math.ceil(self.ep / self.ep_ranks_per_node)


@dataclass(frozen=True)
class MoeLinks:
    intra_bandwidth: float  # bytes/s one rank sends inside its node
    intra_latency: float  # seconds per message
    inter_bandwidth: float  # bytes/s one rank sends across nodes (its share of the node's fabric)
    inter_latency: float
    host_bandwidth: float  # bytes/s between a rank's device and host memory, one direction
    disk_bandwidth: float  # bytes/s between host and local disk, per rank


def links_from_hardware(hw: Hardware, disk_gbs: float = DEFAULT_DISK_GBS) -> MoeLinks:
    """The hardware profile's links as the all-to-all sees them (planner/device.py's rates and latencies)."""
    intra_kind = hw.intra_node if hw.intra_node in ("nvlink", "pcie") else "loopback"
    intra_gbps = hw.intra_node_gbps if hw.intra_node_gbps > 0 else LOOPBACK_GBPS
    intra = intra_gbps / 8 * 1e9 * cal.LINK_EFFICIENCY
    # Every rank of the node runs its ep group's exchange at the same time: they share the node's ports.
    ranks = max(1, hw.gpus_per_node)
    inter_gbps = hw.inter_node_gbps if hw.inter_node_gbps > 0 else FABRIC_GBPS["ethernet"]
    inter = min(intra, inter_gbps / 8 * 1e9 * cal.LINK_EFFICIENCY / ranks)
    if hw.has_gpus:
        host = (gpu_spec(hw.gpu) or GENERIC_GPU).pcie_gbs / 2 * 1e9 * cal.LINK_EFFICIENCY  # one direction
    else:
        host = CPU_SPEC.memory_bw_gbs_per_core * 1e9  # CPU ranks compute in host memory: a copy at its speed
    return MoeLinks(
        intra_bandwidth=intra,
        intra_latency=cal.RING_STEP_LATENCY_S[intra_kind],
        inter_bandwidth=inter,
        inter_latency=cal.RING_STEP_LATENCY_S["fabric"],
        host_bandwidth=host,
        disk_bandwidth=disk_gbs * 1e9,
    )


class ExpertModel(Protocol):
    """The MoE fields of a model shape (planner/model_shape.py's ``moe_*`` fields), read without importing it."""

    # Read-only members, so that a frozen dataclass satisfies it.
    @property
    def hidden(self) -> int: ...
    @property
    def ffn_hidden(self) -> int: ...
    @property
    def moe_num_experts(self) -> int: ...
    @property
    def moe_top_k(self) -> int: ...
    @property
    def moe_capacity_factor(self) -> float: ...
    @property
    def moe_layers(self) -> int: ...


def moe_shape_for_model(
    model: ExpertModel,
    *,
    ep: int,
    tokens: int,
    ranks_per_node: int,
    micro_batches: int = 1,
    rank_stride: int = 1,
    act_bytes: int = 2,
    tp: int = 1,
) -> MoeShape:
    """The cost model's input for a model with experts under a layout: ``tokens`` = micro-batch x sequence / cp,
    ``rank_stride`` = tp x cp, ``ranks_per_node`` = GPUs per node (the planner's Device.ranks_per_node), ``tp``
    the layout's (experts are sharded over it)."""
    return MoeShape(
        num_experts=model.moe_num_experts,
        top_k=model.moe_top_k,
        capacity_factor=model.moe_capacity_factor,
        moe_layers=model.moe_layers,
        hidden=model.hidden,
        ffn_hidden=model.ffn_hidden,
        tokens=tokens,
        ep=ep,
        ranks_per_node=ranks_per_node,
        micro_batches=micro_batches,
        rank_stride=rank_stride,
        act_bytes=act_bytes,
        tp=tp,
    )


# ---- memory and compute ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ExpertMemory:
    parameters: int  # expert parameters on one rank, all MoE layers
    weights: int  # bytes
    grads: int
    optimizer: int
    total: int


def expert_mlp_parameters(hidden: int, ffn: int, tp: int = 1) -> int:
    """One expert's (or the dense MLP's) parameters on one tp rank: the h->f weight and bias column-split and the
    f->h weight row-split over tp, 2hf/tp + f/tp, and the f->h bias h whole on every tp rank."""
    return (2 * hidden * ffn + ffn) // tp + hidden


def expert_parameters_per_rank(shape: MoeShape) -> int:
    """The E/ep experts one rank holds in every MoE layer, each sharded over tp."""
    return shape.moe_layers * (shape.num_experts // shape.ep) * expert_mlp_parameters(shape.hidden, shape.ffn, shape.tp)


def expert_memory_per_rank(
    shape: MoeShape,
    *,
    weight_bytes: int = WEIGHT_BYTES,
    grad_bytes: int = GRAD_BYTES,
    optimizer_bytes: int = OPTIMIZER_BYTES,
) -> ExpertMemory:
    """Weights, gradients and optimizer states of the E/ep experts one rank holds in every MoE layer (bytes)."""
    n = expert_parameters_per_rank(shape)
    weights, grads, optimizer = n * weight_bytes, n * grad_bytes, n * optimizer_bytes
    return ExpertMemory(n, weights, grads, optimizer, weights + grads + optimizer)


@dataclass(frozen=True)
class ExpertCompute:
    flops: float  # per rank and step, padding slots included
    useful_flops: float  # the routed tokens' share
    padding_fraction: float  # 1 - useful / flops


def expert_compute_per_step(shape: MoeShape) -> ExpertCompute:
    slots = shape.num_experts * shape.capacity  # filled on one rank: ep sources x E/ep experts x C
    # 4 h f forward (2 GEMMs), twice that backward; at tp > 1 every tp rank runs every slot through its 1/tp of
    # the expert (f/tp columns of h->f, f/tp rows of f->h).
    per_slot = 12 * shape.hidden * shape.ffn / shape.tp
    scale = shape.moe_layers * shape.micro_batches
    flops = float(per_slot * slots * scale)
    useful = float(per_slot * shape.tokens * shape.top_k * scale)
    return ExpertCompute(flops, useful, 1.0 - useful / flops)


# ---- all-to-all -----------------------------------------------------------------------------------------------
AllToAllKind = Literal["flat", "hierarchical"]


@dataclass(frozen=True)
class AllToAllCost:
    kind: AllToAllKind
    messages_per_call: int
    bytes_sent_per_call: float  # to other ranks
    inter_node_bytes_per_call: float
    seconds_per_call: float
    calls_per_step: int

    @property
    def messages_per_step(self) -> int:
        return self.messages_per_call * self.calls_per_step

    @property
    def bytes_sent_per_step(self) -> float:
        return self.bytes_sent_per_call * self.calls_per_step

    @property
    def seconds_per_step(self) -> float:
        return self.seconds_per_call * self.calls_per_step


def exchange_bytes_per_call(shape: MoeShape) -> int:
    """S: the [E, C, h] tensor one exchange moves through a rank (its own chunk included); at tp > 1, [E, C/tp, h]:
    the tp ranks hold the same tokens, so each sends only its 1/tp of the slots and gathers the rest from its tp
    group after the exchange (an all-gather over tp, inside the node, not counted here)."""
    return shape.num_experts * shape.capacity // shape.tp * shape.hidden * shape.act_bytes


def all_to_all_calls_per_step(shape: MoeShape) -> int:
    return EXCHANGES_PER_LAYER_AND_MICROBATCH * shape.moe_layers * shape.micro_batches


def all_to_all_bytes_per_step(shape: MoeShape) -> int:
    """The tensor bytes through one rank's exchanges per step: tokens x h x top_k x capacity factor (rounded up to
    whole slots) x 2 (dispatch, combine) x 2 (forward, backward) x MoE layers x micro-batches."""
    return exchange_bytes_per_call(shape) * all_to_all_calls_per_step(shape)


def all_to_all_messages(kind: AllToAllKind, ep: int, ep_ranks_per_node: int) -> int:
    """Messages one rank sends per exchange: p - 1 flat, (G - 1) + (p/G - 1) hierarchical."""
    if kind == "flat":
        return ep - 1
    return (ep_ranks_per_node - 1) + (math.ceil(ep / ep_ranks_per_node) - 1)


def flat_cost(shape: MoeShape, links: MoeLinks) -> AllToAllCost:
    p, g = shape.ep, shape.ep_ranks_per_node
    chunk = exchange_bytes_per_call(shape) / p
    intra_msgs, inter_msgs = g - 1, p - g
    seconds = intra_msgs * (links.intra_latency + chunk / links.intra_bandwidth) + inter_msgs * (
        links.inter_latency + chunk / links.inter_bandwidth
    )
    return AllToAllCost("flat", p - 1, (p - 1) * chunk, inter_msgs * chunk, seconds, all_to_all_calls_per_step(shape))


def hierarchical_cost(shape: MoeShape, links: MoeLinks) -> AllToAllCost:
    g, n = shape.ep_ranks_per_node, shape.nodes_spanned
    size = exchange_bytes_per_call(shape)
    intra_bytes, inter_bytes = (g - 1) / g * size, (n - 1) / n * size
    seconds = (
        (g - 1) * links.intra_latency
        + intra_bytes / links.intra_bandwidth
        + (n - 1) * links.inter_latency
        + inter_bytes / links.inter_bandwidth
    )
    return AllToAllCost(
        "hierarchical",
        all_to_all_messages("hierarchical", shape.ep, g),
        intra_bytes + inter_bytes,
        inter_bytes,
        seconds,
        all_to_all_calls_per_step(shape),
    )


@dataclass(frozen=True)
class AllToAllChoice:
    kind: AllToAllKind
    reason: str
    flat: AllToAllCost
    hierarchical: AllToAllCost | None  # None where the ep group cannot be split node by node


def choose_all_to_all(shape: MoeShape, links: MoeLinks) -> AllToAllChoice:
    """Flat inside one node or with one ep rank per node (a two-step exchange would have an empty step); across
    nodes, hierarchical when its modelled time is lower."""
    flat = flat_cost(shape, links)
    g, n, p = shape.ep_ranks_per_node, shape.nodes_spanned, shape.ep
    if p == 1:
        return AllToAllChoice("flat", "ep = 1: no all-to-all at all", flat, None)
    if n == 1:
        return AllToAllChoice("flat", f"the ep group's {p} ranks sit in one node: nothing to aggregate", flat, None)
    if g == 1:
        return AllToAllChoice(
            "flat", f"one ep rank per node (ep ranks {shape.rank_stride} apart): nothing to aggregate", flat, None
        )
    if p % g != 0:
        return AllToAllChoice(
            "flat", f"ep({p}) does not split into nodes of {g} ep ranks: no node-contiguous split", flat, None
        )
    hier = hierarchical_cost(shape, links)
    figures = (
        f"{hier.messages_per_call} messages ({g - 1} + {n - 1}) and {hier.seconds_per_call * 1e6:.0f} us per "
        f"exchange against {flat.messages_per_call} and {flat.seconds_per_call * 1e6:.0f} us flat, over {n} nodes "
        f"x {g} ep ranks"
    )
    if hier.seconds_per_call < flat.seconds_per_call:
        return AllToAllChoice("hierarchical", f"hierarchical: {figures}", flat, hier)
    return AllToAllChoice(
        "flat", f"flat: {figures} (the extra intra-node bytes outweigh the latency saved)", flat, hier
    )


# ---- offload --------------------------------------------------------------------------------------------------
OffloadTier = Literal["host", "disk"]


@dataclass(frozen=True)
class OffloadTraffic:
    tier: OffloadTier
    bytes_per_step: float
    seconds_per_step: float


def offload_traffic(shape: MoeShape, links: MoeLinks, tier: OffloadTier) -> OffloadTraffic:
    """Bytes one rank moves per step when its experts live in ``tier`` (module docstring), and the time at the
    tier's bandwidth (host: the device's PCIe link; disk: the drive, the slower hop of disk -> host -> device)."""
    memory = expert_memory_per_rank(shape)
    moved = 2 * memory.weights * shape.micro_batches + memory.grads
    if tier == "host":
        return OffloadTraffic(tier, float(moved), moved / links.host_bandwidth)
    if tier == "disk":
        moved += 2 * memory.optimizer
        return OffloadTraffic(tier, float(moved), moved / min(links.disk_bandwidth, links.host_bandwidth))
    raise BadInput(f"expert offload tier {tier!r}: must be host or disk")


# ---- plan notes -----------------------------------------------------------------------------------------------
def moe_plan_notes(shape: MoeShape, hw: Hardware) -> list[str]:
    """The lines a plan shows for a model with experts: expert memory, the all-to-all chosen and why, its traffic,
    and what the capacity factor costs in compute."""
    links = links_from_hardware(hw)
    memory = expert_memory_per_rank(shape)
    choice = choose_all_to_all(shape, links)
    cost = choice.hierarchical if choice.kind == "hierarchical" and choice.hierarchical else choice.flat
    compute = expert_compute_per_step(shape)
    gib = 2**30
    sharded = f", each sharded over tp={shape.tp}" if shape.tp > 1 else ""
    return [
        f"experts: {shape.num_experts // shape.ep} of {shape.num_experts} per rank in each of {shape.moe_layers} "
        f"MoE layers{sharded}, {memory.total / gib:.2f} GiB per rank (weights {memory.weights / gib:.2f}, grads "
        f"{memory.grads / gib:.2f}, optimizer {memory.optimizer / gib:.2f})",
        f"expert all-to-all: {choice.reason}",
        f"expert all-to-all per rank and step: {cost.bytes_sent_per_step / 2**20:.1f} MiB sent in "
        f"{cost.messages_per_step} messages, {cost.seconds_per_step * 1e3:.1f} ms modelled",
        f"capacity factor {shape.capacity_factor:g}: {compute.padding_fraction:.0%} of the expert FLOPs "
        f"({compute.flops / 1e12:.2f} TFLOP per rank and step) go to padding slots",
    ]
