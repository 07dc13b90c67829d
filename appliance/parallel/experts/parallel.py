"""Expert parallelism (ep) for BLOOM-MoE: DeepSpeed's MoE machinery wired to our topology, and the step's MoE
figures.

One source of truth for the groups. DeepSpeed's MoE layers and engine look their groups up by name
(``ep_size_<E>``) in ``deepspeed.utils.groups``, and create them there on first use with their own rank arithmetic.
``register_expert_groups`` fills those tables with OUR topology's ``ep`` and ``edp`` groups before DeepSpeed looks
(topology.py: ep folds inside dp, dp = edp x ep, the ep ranks of one expert group consecutive dp ranks), so
DeepSpeed's all-to-all runs over our ``ep`` group and its expert-gradient reduction over our ``edp`` group:
dense parameters are averaged over dp, expert parameters summed over edp and divided by dp (every token of the dp
group reached its expert through the all-to-all, so that is the same average), which DeepSpeed does itself in
``_reduce_expert_gradients`` once the groups are ours.

The optimizer needs the expert parameters in param groups of their own (``moe_param_groups``: DeepSpeed's
``split_params_into_different_moe_groups_for_optimizer``), which ZeRO partitions over edp instead of dp.

Context parallelism (cp > 1). Each CP rank holds a slice of every sequence and routes its own tokens; the experts
are replicated over cp like every other weight, so their gradients are partial sums over cp: DeepSpeed's
expert-data-parallel group is our ``edp_cp`` (edp x cp; ``edp`` itself at cp = 1). DeepSpeed divides by its
data-parallel world, which ``TopologyMPU`` answers with ``dp_cp`` (dp x cp), so an expert's gradient is the sum
over its edp x cp replicas (each already holding its ep group's tokens) over dp x cp: the average of every rank's
loss, as for the dense ones. The load-balancing loss and the capacity are per CP slice (docs/MOE.md).

Experts over tensor parallelism (ep x tp, docs/MOE.md): at tp > 1 each expert is sharded over the tp group like
the dense MLP (model/moe.py: dense_h_to_4h column-, dense_4h_to_h row-parallel). The MoE block's input is
replicated over tp, so DeepSpeed's MOELayer keeps 1/tp of the [E, C, h] capacity slots on each tp rank before the
ep all-to-all and, because ``register_expert_groups`` sets ``expert_tensor_parallel_world_size`` = tp, gathers
them over tp after it, so every tp rank runs all the slots through its 1/tp of the experts; the same again around
the return exchange. Per rank: expert parameters (2hf + f)/tp + h, expert FLOPs / tp, all-to-all bytes / tp, plus
two all-gathers of [E, C, h] over tp (inside the node) per exchange pair. The drop and gather run over our tp group
(``install_tp_token_split``). Sequence parallelism would hand the block different tokens on each tp rank, so
``check_moe_layout`` refuses it with experts, and 2D tp.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from appliance.errors import BadInput
from appliance.model.config import BloomConfig
from appliance.model.moe import BloomMoE
from appliance.parallel.tensor.mappings import (
    collective_device,
    gather_from_sequence_parallel_region,
    group_size,
    scatter_to_sequence_parallel_region,
)
from appliance.parallel.topology import ParallelTopology
from appliance.planner.layout_rules import moe_problems


def check_moe_layout(config: BloomConfig, topology: ParallelTopology, *, sequence_parallel: bool = False) -> None:
    """BadInput naming every factor when the layout cannot run this model's experts (the rules and their words are
    the planner's, planner/layout_rules.py, which Layout.validate states too)."""
    problems = moe_problems(
        moe_num_experts=config.moe_num_experts,
        ep=topology.ep,
        tp=topology.tp,
        tp2d=topology.tp2d,
        sequence_parallel=sequence_parallel,
    )
    if problems:
        raise BadInput(f"parallel layout {topology.factors}, ep({topology.ep}): " + "; ".join(problems))


def expert_group_name(ep: int) -> str:
    """DeepSpeed's key for the expert groups of an ep-way split (deepspeed.moe.layer.MoE.expert_group_name)."""
    return f"ep_size_{ep}"


def register_expert_groups(topology: ParallelTopology) -> None:
    """Make DeepSpeed's expert-parallel and expert-data-parallel groups our topology's (module docstring).
    Local: the groups exist already (topology.init_process_groups)."""
    from deepspeed.utils import groups

    name = expert_group_name(topology.ep)
    rank = dist.get_rank()
    groups._EXPERT_PARALLEL_GROUP[name] = topology.group("ep")
    groups._EXPERT_PARALLEL_GROUP_RANKS[name] = topology.group_ranks("ep", rank)
    # edp x cp: the experts' replicas (module docstring); the edp group's own handle at cp = 1.
    groups._EXPERT_DATA_PARALLEL_GROUP[name] = topology.group("edp_cp")
    groups._EXPERT_DATA_PARALLEL_GROUP_RANKS[name] = topology.group_ranks("edp_cp", rank)
    # Experts are sharded over the dense layers' tp group (model/moe.py): MOELayer gathers the tokens it dropped
    # as tp duplicates again after the all-to-all when this is > 1 (DeepSpeed's own group creation sets it).
    groups.expert_tensor_parallel_world_size = topology.tp
    install_tp_token_split(topology.tp_group)


def install_tp_token_split(tp_group: dist.ProcessGroup | None) -> None:
    """MOELayer's drop of the tokens duplicated over tp (before the all-to-all) and their gather (after it), over
    ``tp_group``: DeepSpeed's own (deepspeed/moe/mappings.py) gather into a flat buffer, which gloo refuses; ours
    (tensor/mappings.py) run on gloo and NCCL alike. Drop: this tp rank's 1/tp of the capacity slots forward, the slots
    gathered back in the backward pass; gather: the reverse (every tp rank's gradient is whole there, so the
    backward keeps this rank's slots, no sum)."""
    from deepspeed.moe import sharded_moe

    def drop_tokens(x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        tp = group_size(tp_group)
        if x.shape[dim] % tp:
            # Without token dropping DeepSpeed rounds the capacity up to a multiple of tp; with it, the capacity is
            # ceil(top_k x capacity_factor x tokens / experts) (or the floor moe_min_capacity) as it comes.
            raise BadInput(
                f"MoE capacity({x.shape[dim]}) slots per expert % tp({tp}) != 0: each tp rank sends 1/tp of them; "
                "set model moe_drop_tokens = false, or choose micro-batch x seq_len, moe_capacity_factor and "
                "moe_min_capacity so the capacity is a multiple of tp"
            )
        return scatter_to_sequence_parallel_region(x, tp_group, dim=dim)

    def gather_tokens(x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        return gather_from_sequence_parallel_region(x, tp_group, dim=dim, tensor_parallel_output_grad=False)

    sharded_moe.drop_tokens = drop_tokens
    sharded_moe.gather_tokens = gather_tokens


def set_expert_offsets(module: nn.Module, topology: ParallelTopology) -> None:
    """Tell every MoE layer which global experts it holds: ep rank r holds [r * E/ep, (r + 1) * E/ep)."""
    ep_rank = topology.coordinate("ep", dist.get_rank())
    for layer in module.modules():
        if isinstance(layer, BloomMoE):
            layer.expert_offset = ep_rank * layer.num_local_experts


def moe_param_groups(param_groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The expert parameters of each group moved into groups of their own, marked ``moe`` (what DeepSpeed's
    engine and ZeRO look for)."""
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    # DeepSpeed names each expert group after the group it came from.
    named = [{"name": f"group{i}", **group} for i, group in enumerate(param_groups)]
    return split_params_into_different_moe_groups_for_optimizer(named)


def is_expert_parameter(param: torch.Tensor) -> bool:
    """DeepSpeed's Experts mark their parameters ``allreduce = False`` (reduced over edp, not dp)."""
    return getattr(param, "allreduce", True) is False


def moe_step_figures(
    module: nn.Module, config: BloomConfig, topology: ParallelTopology, aux_losses: Iterable[torch.Tensor]
) -> tuple[float, list[list[float]]]:
    """(moe_aux_loss, expert_load) of the step just trained, the same on every rank (collective over dp x cp and
    pp).

    moe_aux_loss: the summed load-balancing loss of the MoE blocks, unweighted, averaged over the step's
    micro-batches and dp x cp ranks (``aux_losses``: the last stage's, one per micro-batch; empty on other stages;
    each CP rank's is its own slice's, and DeepSpeed averages the optimized loss over dp x cp the same way).
    expert_load: per MoE block in block order, the fraction of routed tokens each expert got over the step, every
    dp and cp rank's tokens together (each rank's gate counts its own tokens for all experts)."""
    from appliance.parallel.pipeline.specs import TransformerLayerPipe

    blocks = config.moe_blocks
    device = collective_device(topology.dp_cp_group)
    aux = list(aux_losses)
    figures = torch.zeros(1 + len(blocks) * config.moe_num_experts, dtype=torch.float64, device=device)
    if aux:
        figures[0] = torch.stack([a.double() for a in aux]).mean().to(device)
    counts = figures[1:].view(len(blocks), config.moe_num_experts)
    for layer in module.modules():
        if isinstance(layer, TransformerLayerPipe) and isinstance(layer.mlp, BloomMoE):
            if layer.mlp.step_counts is not None:
                counts[blocks.index(layer.layer_number)] += layer.mlp.step_counts.to(device, torch.float64)
            layer.mlp.step_counts = None
    if group_size(topology.dp_cp_group) > 1:
        dist.all_reduce(figures, group=topology.dp_cp_group)
    figures[0] /= topology.dp * topology.cp
    if group_size(topology.pp_group) > 1:  # each stage filled its own blocks' rows, the last stage the loss
        dist.all_reduce(figures, group=topology.pp_group)
    totals = counts.sum(dim=1, keepdim=True).clamp(min=1.0)
    return float(figures[0]), (counts / totals).tolist()
