"""Gradients across the 3D layout: the model-parallel unit DeepSpeed asks for, the global gradient norm, and the
gradient all-reduce sequence parallelism needs.

The global norm is the 2-norm of the one gradient vector a single process would hold. After the DP reduction every
replica (one TP x PP slice of the ranks) holds that whole vector, spread over its ranks:

    norm^2 = sum over the ranks of one replica of  sum over their parameters of ||grad||^2

counting each parameter once: a TP-split parameter on every TP rank (each holds a different slice), a TP-replicated
one (LayerNorms, row-parallel biases) on TP rank 0 only, and the tied embedding on the first stage only (the last
stage's copy is marked ``ds_pipe_replicated`` by DeepSpeed's PipelineModule). One all-reduce over the replica's
group (``topology.mp_group``) gives every rank the same number; no collective over the whole world is needed.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from appliance.parallel.tensor.layers import is_tensor_parallel
from appliance.parallel.tensor.mappings import Group, collective_device, group_size
from appliance.parallel.topology import ParallelTopology

# DeepSpeed's clipping formula (runtime/utils.py clip_grad_norm_, bf16 and ZeRO optimizers alike).
CLIP_EPS = 1e-6


class TopologyMPU:
    """The "mpu" (model-parallel unit) DeepSpeed's engine and optimizers query, answered from our topology.

    DeepSpeed's names mean: *model parallel* = every rank of one replica (TP x PP, as its PipelineParallelGrid
    has it), *tensor/slice parallel* = TP, *data parallel* = the ranks that reduce gradients, DP x CP (the
    ``dp_cp`` group; the ``dp`` group itself while cp = 1). The bf16 and ZeRO optimizers sum the squared gradient
    norm over the model-parallel group and count replicated parameters on tensor rank 0 only, which is the
    arithmetic in this module's docstring. Every answer is a size, coordinate or group of the topology's.
    """

    def __init__(self, topology: ParallelTopology) -> None:
        self.topology = topology
        self._rank = dist.get_rank()

    def get_model_parallel_rank(self) -> int:
        return dist.get_rank(self.topology.mp_group)

    def get_model_parallel_world_size(self) -> int:
        return self.topology.size("mp")

    def get_model_parallel_group(self) -> dist.ProcessGroup:
        return self.topology.mp_group

    def get_tensor_model_parallel_rank(self) -> int:
        return self.topology.tp_rank(self._rank)

    def get_tensor_model_parallel_world_size(self) -> int:
        return self.topology.tp

    def get_tensor_model_parallel_group(self) -> dist.ProcessGroup:
        return self.topology.tp_group

    get_slice_parallel_rank = get_tensor_model_parallel_rank
    get_slice_parallel_world_size = get_tensor_model_parallel_world_size
    get_slice_parallel_group = get_tensor_model_parallel_group

    def get_data_parallel_rank(self) -> int:
        # dp and cp are adjacent in the rank order, so the rank inside dp_cp is dp_rank * cp + cp_rank.
        return dist.get_rank(self.topology.dp_cp_group)

    def get_data_parallel_world_size(self) -> int:
        return self.topology.size("dp_cp")

    def get_data_parallel_group(self) -> dist.ProcessGroup:
        return self.topology.dp_cp_group

    def get_pipe_parallel_rank(self) -> int:
        return self.topology.pp_rank(self._rank)

    def get_pipe_parallel_world_size(self) -> int:
        return self.topology.pp

    def get_pipe_parallel_group(self) -> dist.ProcessGroup:
        return self.topology.pp_group


def counted_in_norm(param: torch.Tensor, tp_rank: int, mesh_row: int = 0) -> bool:
    """Whether this rank counts `param`'s gradient in the global norm (the module docstring's rule)."""
    if getattr(param, "ds_pipe_replicated", False):
        return False  # the last stage's copy of the tied embedding: the first stage counts it
    if getattr(param, "tp2d_row_replica", False):
        return mesh_row == 0  # tp2d: a vector's slice, the same on every mesh row (tensor2d/layers2d.py)
    return is_tensor_parallel(param) or tp_rank == 0


def global_grad_norm(
    params: Iterable[torch.Tensor], topology: ParallelTopology, store_squares: float | None = None
) -> float:
    """The 2-norm of the whole model's gradient, the same on every rank (collective over ``topology.mp_group``).

    Call it once the gradients are reduced over DP (every replica then holds the same vector). ``store_squares``:
    the sum of squares of the experts the tiered store holds on this rank (experts/store.py; those parameters are
    left out of ``params``), counted like the other experts: summed over the ep group.
    """
    params = list(params)
    tp_rank = topology.tp_rank(dist.get_rank())
    mesh_row = tp_rank // topology.tp2d if topology.tp2d > 1 else 0  # tp2d: tp rank = mesh row * q + mesh column
    grads = [p.grad.detach() for p in params if p.grad is not None and counted_in_norm(p, tp_rank, mesh_row)]
    # Summed on the gradients' device in fp32, one number per parameter, then one collective. A rank that counts no
    # gradient (a TP rank > 0 of a stage holding only replicated parameters) still joins the collective with a zero
    # on its parameters' device: a CPU zero would fail under NCCL.
    if grads:
        squares = torch.stack([g.float().pow(2).sum() for g in grads]).sum()
    else:
        squares = torch.zeros((), device=params[0].device if params else collective_device())
    if store_squares is not None and getattr(topology, "ep", 1) == 1:
        squares = squares + store_squares
    if getattr(topology, "ep", 1) > 1:  # (a layout without expert parallelism may be a stand-in without ep)
        # BLOOM-MoE: each ep rank of a replica holds other experts (marked allreduce=False by DeepSpeed), so their
        # squares are summed over the ep group too before the replica's sum.
        # At tp > 1 the experts' tp-sharded weights count on every tp rank, their replicated biases on tp rank 0
        # (counted_in_norm, as `squares` counted them); the mp all-reduce below sums the tp ranks.
        experts = [
            p.grad.detach()
            for p in params
            if p.grad is not None and getattr(p, "allreduce", True) is False and counted_in_norm(p, tp_rank, mesh_row)
        ]
        expert_squares = torch.zeros((), device=squares.device)
        if experts:
            expert_squares = torch.stack([g.float().pow(2).sum() for g in experts]).sum()
        squares = squares - expert_squares
        if store_squares is not None:  # not in `squares`: added after the subtraction
            expert_squares = expert_squares + (store_squares if tp_rank == 0 else 0.0)
        dist.all_reduce(expert_squares, group=topology.group("ep"))
        squares = squares + expert_squares
    if group_size(topology.mp_group) > 1:
        dist.all_reduce(squares, group=topology.mp_group)
    return math.sqrt(float(squares))


def clip_coefficient(norm: float, max_norm: float) -> float | None:
    """The factor clipping multiplies every gradient by, min(1, max_norm / (norm + 1e-6)); None when it is 1."""
    coefficient = max_norm / (norm + CLIP_EPS)
    return coefficient if max_norm > 0 and coefficient < 1.0 else None


def clip_by_global_norm(
    params: Iterable[torch.Tensor], max_norm: float, topology: ParallelTopology, store_squares: float | None = None
) -> float:
    """Scale every gradient by min(1, max_norm / (norm + 1e-6)); returns the norm before clipping. The tiered
    expert store's gradients (``store_squares``, global_grad_norm) are its own to scale (clip_coefficient)."""
    params = list(params)
    norm = global_grad_norm(params, topology, store_squares)
    coefficient = clip_coefficient(norm, max_norm)
    if coefficient is not None:
        for p in params:
            if p.grad is not None:
                p.grad.detach().mul_(coefficient)
    return norm


def install_global_norm_clipping(engine: Any, topology: ParallelTopology) -> None:
    """Make a DeepSpeed engine's fp32 (no ZeRO, no bf16) path clip by the global norm, and report it.

    On that path DeepSpeed calls ``engine.clip_fp32_gradients()``, whose norm counts replicated parameters by
    model-parallel rank 0 of the TP x PP group (so a LayerNorm on a later pipeline stage is never counted), counts
    the tied embedding twice, and is then thrown away. The bf16 and ZeRO optimizers compute it correctly and keep
    it; this gives the plain path the same behaviour, and the norm ``get_global_grad_norm()`` returns.
    """

    optimizer = engine.optimizer
    optimizer.overflow = False  # DeepSpeed reads it after the step: a skipped step counts in engine.skipped_steps
    apply_update = optimizer.step

    def clip_fp32_gradients() -> None:
        norm = clip_by_global_norm(engine.module.parameters(), engine.gradient_clipping(), topology)
        engine._global_grad_norm = norm
        # The norm is global, so every rank sees the same verdict. A NaN or Inf gradient skips the update, as the bf16
        # and ZeRO optimizers do: the parameters and Adam's moments stay as they were, and the gradients are zeroed
        # after the step as always.
        optimizer.overflow = not math.isfinite(float(norm))

    def step(*args: Any, **kwargs: Any) -> Any:
        return None if optimizer.overflow else apply_update(*args, **kwargs)

    engine.clip_fp32_gradients = clip_fp32_gradients
    optimizer.step = step


def register_sequence_parallel_grad_hooks(module: nn.Module, group: Group) -> int:
    """With sequence parallelism, sum over TP the gradient of every TP-replicated parameter; returns how many.

    Those parameters (LayerNorms, row-parallel biases) act on this rank's sequence chunk only, so each rank's
    gradient is a partial sum over the sequence. A hook on the parameter completes it as soon as autograd
    produces it, before any optimizer (plain, bf16 or ZeRO) accumulates or reduces it, so the same code serves
    every engine. It costs one small all-reduce per replicated parameter and micro-batch.
    """
    if group_size(group) == 1:
        return 0

    def complete(grad: torch.Tensor) -> torch.Tensor:
        total = grad.clone()
        dist.all_reduce(total, group=group)
        return total

    count = 0
    for param in module.parameters():
        if param.requires_grad and not is_tensor_parallel(param):
            param.register_hook(complete)
            count += 1
    return count
