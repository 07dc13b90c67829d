"""BLOOM-MoE's mixture-of-experts MLP, built on DeepSpeed's MoE layer (``deepspeed.moe.layer.MoE``).

An MoE block (config.is_moe_block) keeps BLOOM's attention and replaces its MLP by ``BloomMoE``: a top-k gate
(DeepSpeed's TopKGate, a [experts, hidden] linear without bias, softmax in fp32) sends each token to k of
``moe_num_experts`` experts, each one BLOOM's own MLP (dense_h_to_4h, tanh GeLU, dense_4h_to_h, biases added in
place). DeepSpeed computes GShard's load-balancing loss (mean over experts of token fraction x mean gate
probability, times experts^2) and the tokens each expert got; the block keeps both from its last forward
(``aux_loss``, ``expert_counts``) for the model's loss and for the step events.

Expert parallelism: with ep > 1 each rank of an ``ep`` group holds experts [ep_rank * E/ep, (ep_rank + 1) * E/ep)
and DeepSpeed exchanges tokens over the group with two all-to-alls per layer and pass. Which all-to-all is used is
chosen in one place, ``select_all_to_all``: the hierarchical one (parallel/moe_all_to_all.py) where the ep group
spans nodes and the planner's cost model (planner/moe_costs.py ``choose_all_to_all``) prefers it, else DeepSpeed's.

Names. DeepSpeed names its parameters ``deepspeed_moe.gate.wg.weight`` and
``deepspeed_moe.experts.deepspeed_experts.<local index>.<linear>.<leaf>``; checkpoints, initial weights and exports
use the layout-free names ``mlp.gate.weight`` and ``mlp.experts.<global index>.<linear>.<leaf>``
(``canonical_moe_name``), so the same expert has the same name and the same initial values at every ep.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

import torch
from deepspeed.moe import sharded_moe
from deepspeed.moe.layer import MoE
from torch import nn

from appliance.model.config import BloomConfig

_GATE = re.compile(r"(^|\.)deepspeed_moe\.gate\.wg\.")
_EXPERT = re.compile(r"(^|\.)deepspeed_moe\.experts\.deepspeed_experts\.(\d+)\.")
_CANONICAL_GATE = re.compile(r"(^|\.)gate\.(?=weight$)")
_CANONICAL_EXPERT = re.compile(r"(^|\.)experts\.(\d+)\.")

# DeepSpeed's own autograd all-to-all, kept before anything replaces it.
DEEPSPEED_ALL_TO_ALL: type[torch.autograd.Function] = sharded_moe._AllToAll


def canonical_moe_name(name: str, expert_offset: int = 0) -> str:
    """DeepSpeed's parameter name -> the layout-free one; ``expert_offset`` is this rank's first global expert
    (ep_rank * experts / ep). Names of non-MoE parameters come back unchanged."""
    name = _GATE.sub(r"\1gate.", name)
    match = _EXPERT.search(name)
    if match:
        index = int(match.group(2)) + expert_offset
        name = f"{name[: match.start()]}{match.group(1)}experts.{index}.{name[match.end() :]}"
    return name


def deepspeed_moe_name(name: str, expert_offset: int = 0) -> str:
    """The inverse of ``canonical_moe_name`` (for ``load_state_dict``)."""
    name = _CANONICAL_GATE.sub(r"\1deepspeed_moe.gate.wg.", name)
    match = _CANONICAL_EXPERT.search(name)
    if match:
        local = int(match.group(2)) - expert_offset
        inner = f"deepspeed_moe.experts.deepspeed_experts.{local}."
        name = f"{name[: match.start()]}{match.group(1)}{inner}{name[match.end() :]}"
    return name


@dataclass(frozen=True)
class AllToAllSelection:
    """The exchange the MoE layers use and why: ``exchange`` is what ``install_all_to_all`` puts in DeepSpeed's place
    (an object with DeepSpeed's ``apply(group, x)``), ``kind`` "flat" or "hierarchical", ``reason`` the cost model's
    words (planner/moe_costs.py ``choose_all_to_all``, the planner's own decision)."""

    kind: str
    reason: str
    exchange: Any

    def record(self) -> dict[str, str]:
        """What run_dir/ds_config.json records of it (beside DeepSpeed's settings, as the run's other choices)."""
        return {"kind": self.kind, "reason": self.reason}


# The sequence the choice assumes when the caller gives none: BLOOM's 2048. The choice weighs message start-up
# latency against bytes, so the length matters near the crossover only.
CHOICE_SEQUENCE = 2048
_selected: AllToAllSelection | None = None


def select_all_to_all(
    config: BloomConfig,
    topology: Any,
    *,
    micro_batch_size: int = 1,
    seq_len: int | None = None,
    hardware: Any = None,
    ranks_per_node: int | None = None,
) -> AllToAllSelection:
    """The all-to-all every MoE layer exchanges tokens with, by topology. Collective: every rank calls it (the
    hierarchical exchange creates its sub-groups here).

    The ep groups (``topology.groups("ep")``) are cut into nodes of ``ranks_per_node`` ranks (None: the
    ``hardware`` profile's GPUs per node, else the launcher's LOCAL_WORLD_SIZE, else one node of the whole world).
    Where an ep group spans nodes and ``choose_all_to_all`` (the planner's cost model, over ``hardware``'s links, or
    those of a profile of this launch's nodes) says hierarchical, the hierarchical exchange over those groups;
    otherwise DeepSpeed's flat one. The exchange's size is micro_batch_size x seq_len / cp tokens (seq_len None:
    2048, BLOOM's)."""
    import torch.distributed as dist

    from appliance.parallel.moe_all_to_all import make_all_to_all
    from appliance.planner.moe_costs import choose_all_to_all, links_from_hardware, moe_shape_for_model

    global _selected
    world = topology.world_size
    if ranks_per_node is None:
        local = os.environ.get("LOCAL_WORLD_SIZE", "")
        if hardware is not None and hardware.gpus_per_node > 0:
            ranks_per_node = hardware.gpus_per_node
        elif local.isdigit() and int(local) > 0:
            ranks_per_node = int(local)
        else:
            ranks_per_node = world
    ranks_per_node = max(1, min(ranks_per_node, world))
    if not config.is_moe or topology.ep == 1:
        _selected = AllToAllSelection("flat", "ep = 1: no all-to-all at all", DEEPSPEED_ALL_TO_ALL)
        return _selected
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
    _selected = AllToAllSelection(kind, reason, exchange)
    if dist.is_initialized() and dist.get_rank() == 0:
        print(f"expert all-to-all: {reason}", flush=True)
    return _selected


def _node_aligned(ep_groups: list[list[int]], ranks_per_node: int) -> bool:
    """Every ep group holds the same number of ranks on every node it touches, in ascending order."""
    for ranks in ep_groups:
        counts: dict[int, int] = {}
        for rank in ranks:
            counts[rank // ranks_per_node] = counts.get(rank // ranks_per_node, 0) + 1
        if len(set(counts.values())) != 1 or list(ranks) != sorted(ranks):
            return False
    return True


def selected_all_to_all() -> AllToAllSelection | None:
    """The last ``select_all_to_all`` answer in this process (None before any)."""
    return _selected


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
    from appliance.hardware.profile import Hardware

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


def install_all_to_all(exchange: Any) -> None:
    """Make DeepSpeed's MoE layers use ``exchange`` (an object with ``apply(group, x)``, DeepSpeed's own
    ``_AllToAll`` or ``moe_all_to_all.MoeAllToAll``): MOELayer.forward looks up the module-level ``_AllToAll``."""
    sharded_moe._AllToAll = exchange


def _plain_linear(in_features: int, out_features: int, bias: bool, role: str) -> nn.Module:
    # Experts are whole on every rank they live on (replicated over tp, DeepSpeed's default), and DeepSpeed's
    # Experts drops a returned bias: a plain nn.Linear adds its own.
    return nn.Linear(in_features, out_features, bias=bias)


class BloomMoE(MoE):
    """The MoE MLP of a BLOOM block: forward(x [..., hidden]) -> (y [..., hidden], None), as BloomMLP's
    (output, bias still to add). ``ep_size`` ranks share the experts (1: all of them here)."""

    def __init__(self, config: BloomConfig, ep_size: int = 1) -> None:
        from appliance.model.bloom import BloomMLP  # bloom.py builds this module

        if not config.is_moe:
            raise ValueError("BloomMoE needs moe_num_experts > 0")
        if config.moe_num_experts % ep_size:
            raise ValueError(
                f"moe_num_experts({config.moe_num_experts}) % ep({ep_size}) = {config.moe_num_experts % ep_size}, "
                "must be 0 so every expert-parallel rank holds the same number of experts"
            )
        super().__init__(
            config.hidden_size,
            BloomMLP(config, _plain_linear),
            num_experts=config.moe_num_experts,
            ep_size=ep_size,
            k=config.moe_top_k,
            capacity_factor=config.moe_capacity_factor,
            eval_capacity_factor=config.moe_eval_capacity_factor,
            min_capacity=config.moe_min_capacity,
            drop_tokens=config.moe_drop_tokens,
            use_rts=config.moe_random_routing,
            top2_2nd_expert_sampling=config.moe_random_routing,
        )
        self.min_capacity = config.moe_min_capacity
        self.expert_offset = 0  # this rank's first global expert; the parallel layer sets it
        self.aux_loss: torch.Tensor | None = None  # the last forward's load-balancing loss (scalar, fp32)
        self.expert_counts: torch.Tensor | None = None  # the last forward's tokens per expert, [experts]
        # Tokens per expert summed over the training forwards since the trainer last read them (a recomputed
        # forward counts again, every micro-batch alike, so the fractions hold).
        self.step_counts: torch.Tensor | None = None
        self._register_state_dict_hook(_canonical_state_dict)
        self._register_load_state_dict_pre_hook(_deepspeed_state_dict, with_module=True)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        # DeepSpeed's top-1 gate refuses fewer tokens than min_capacity (a short prompt in greedy decoding): such a
        # call's floor is its token count. Every rank of an ep group passes as many tokens, so they still agree.
        gate = self.deepspeed_moe.gate
        gate.min_capacity = min(self.min_capacity, x.numel() // x.shape[-1])
        out, aux_loss, counts = super().forward(x)
        self.aux_loss, self.expert_counts = aux_loss, counts
        if self.training:
            self.step_counts = counts if self.step_counts is None else self.step_counts + counts
        return out.to(x.dtype), None


def _canonical_state_dict(module: BloomMoE, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    for key in [k for k in state_dict if k.startswith(prefix)]:
        new = prefix + canonical_moe_name(key[len(prefix) :], module.expert_offset)
        if new != key:
            state_dict[new] = state_dict.pop(key)


def _deepspeed_state_dict(module: BloomMoE, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
    for key in [k for k in state_dict if k.startswith(prefix)]:
        new = prefix + deepspeed_moe_name(key[len(prefix) :], module.expert_offset)
        if new != key:
            state_dict[new] = state_dict.pop(key)


def moe_layers(model: nn.Module) -> list[BloomMoE]:
    """The model's MoE MLPs, in block order."""
    return [m for m in model.modules() if isinstance(m, BloomMoE)]


def aux_loss_sum(layers: list[BloomMoE], like: torch.Tensor) -> torch.Tensor:
    """The summed load-balancing loss of ``layers``' last forward (0 on ``like``'s device when there is none)."""
    total = torch.zeros((), dtype=torch.float32, device=like.device)
    for layer in layers:
        if layer.aux_loss is not None:
            total = total + layer.aux_loss.float()
    return total


def expert_load(counts: list[torch.Tensor]) -> list[list[float]]:
    """Per MoE layer, the fraction of routed tokens each expert got (the step events' ``expert_load``)."""
    out = []
    for c in counts:
        total = float(c.sum())
        out.append([float(x) / total if total else 0.0 for x in c.tolist()])
    return out
