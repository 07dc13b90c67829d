"""The communication at the borders of tensor-parallel regions, as autograd functions (Megatron's "mappings").

Each one is a pair: what the forward pass does, and its adjoint in the backward pass.

    copy_to       fwd: identity            bwd: all-reduce (sum)       input of a column-parallel linear
    reduce_from   fwd: all-reduce (sum)    bwd: identity               output of a row-parallel linear
    scatter_to    fwd: keep my last-dim chunk   bwd: all-gather last dim
    gather_from   fwd: all-gather last dim      bwd: keep my last-dim chunk

Sequence parallelism keeps the LayerNorm/dropout regions split along the sequence, [s/tp, b, h] per rank:

    scatter_to_sequence     fwd: keep my sequence chunk    bwd: all-gather along sequence
    gather_from_sequence    fwd: all-gather along sequence bwd: reduce-scatter (consumer was TP-split) or split
    reduce_scatter_to_seq   fwd: reduce-scatter            bwd: all-gather along sequence

An all-reduce moves the same bytes as a reduce-scatter followed by an all-gather, which is why sequence
parallelism costs no extra communication: it replaces each all-reduce by that pair and runs the elementwise
regions in between on 1/tp of the activations.

With a group of one rank (or no process group at all) every function is the identity, so tp=1 pays nothing.

Algorithms that write their own autograd Function (SUMMA in tensor2d/summa.py) use the plain collectives under them:
``broadcast_from`` and ``reduce_to``, in place, for one source or one root of a group.

Every collective here is counted: inside a ``count_traffic()`` block ``_count`` adds the payload bytes this rank
hands to the backend and the call, by kind; outside one (the default) the cost is one test of a global, before any
group lookup or view the count would need. A
broadcast counts its bytes on the source only, a reduce on the members that are not the root, a reduce-scatter the
other members' chunks; all-reduce and all-gather count what this rank contributes. Ring and chain algorithms forward
more than that; the payload is the unit the planner's formulas (planner/tp2d.py) start from.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

Group = dist.ProcessGroup | None  # None: the default (world) group

# torch 2.13 renamed the tensor-in/tensor-out collectives; older releases only have the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def group_size(group: Group) -> int:
    """Ranks in ``group``; 1 in a single process without torch.distributed, so tp=1 code needs no setup."""
    return dist.get_world_size(group) if dist.is_initialized() else 1


def group_rank(group: Group) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


def collective_device(group: Group = None) -> torch.device:
    """Where a tensor for a collective over ``group`` must live: NCCL moves CUDA tensors only, gloo CPU ones."""
    if dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# ---- traffic accounting -----------------------------------------------------------------------------------------
@dataclass
class Traffic:
    """What this rank's collectives moved inside a ``count_traffic()`` block, by kind ("broadcast", "all_reduce"...)."""

    bytes: Counter[str] = field(default_factory=Counter)  # payload this rank sent (module docstring's conventions)
    calls: Counter[str] = field(default_factory=Counter)  # collectives this rank took part in, sender or not


_traffic: Traffic | None = None  # None: not counting, the default


@contextmanager
def count_traffic() -> Iterator[Traffic]:
    """Count the collectives of this module for the block: ``with count_traffic() as sent: ...; sent.bytes``.
    Blocks nest: the inner one counts alone and the outer one resumes after it."""
    global _traffic
    before, _traffic = _traffic, Traffic()
    try:
        yield _traffic
    finally:
        _traffic = before


def _count(traffic: Traffic, kind: str, payload: torch.Tensor, sends: bool = True) -> None:
    traffic.calls[kind] += 1
    if sends:
        traffic.bytes[kind] += payload.numel() * payload.element_size()


# ---- plain collectives (no autograd) ------------------------------------------------------------------------------
def _global_rank(group: Group, member: int) -> int:
    return dist.get_global_rank(group, member) if group is not None else member


def broadcast_from(tensor: torch.Tensor, source: int, group: Group) -> torch.Tensor:
    """``tensor`` of group member ``source`` on every member, in place (the others' tensor is the buffer)."""
    if _traffic is not None:
        _count(_traffic, "broadcast", tensor, sends=group_rank(group) == source)
    dist.broadcast(tensor, src=_global_rank(group, source), group=group)
    return tensor


def reduce_to(tensor: torch.Tensor, root: int, group: Group) -> torch.Tensor:
    """The sum of every member's ``tensor`` on member ``root``, in place (the others' result is undefined)."""
    if _traffic is not None:
        _count(_traffic, "reduce", tensor, sends=group_rank(group) != root)
    dist.reduce(tensor, dst=_global_rank(group, root), op=dist.ReduceOp.SUM, group=group)
    return tensor


def _all_reduce(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Sum over the group into a fresh tensor (the caller's tensor may be aliased elsewhere in the graph)."""
    out = x.clone(memory_format=torch.contiguous_format)
    if _traffic is not None:
        _count(_traffic, "all_reduce", out)
    dist.all_reduce(out, group=group)
    return out


def _split(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    size = group_size(group)
    if x.shape[dim] % size != 0:
        raise ValueError(f"cannot split dimension {dim} of size {x.shape[dim]} into {size} equal parts")
    return x.chunk(size, dim=dim)[group_rank(group)].contiguous()


def _gather(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    # The collective concatenates along dim 0, so move ``dim`` there and back.
    front = x.movedim(dim, 0).contiguous()
    out = front.new_empty((front.shape[0] * group_size(group), *front.shape[1:]))
    if _traffic is not None:
        _count(_traffic, "all_gather", front)
    _all_gather_single(out, front, group=group)
    return out.movedim(0, dim).contiguous()


def _reduce_scatter(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    size = group_size(group)
    if x.shape[dim] % size != 0:
        raise ValueError(f"cannot reduce-scatter dimension {dim} of size {x.shape[dim]} over {size} ranks")
    front = x.movedim(dim, 0).contiguous()
    out = front.new_empty((front.shape[0] // size, *front.shape[1:]))
    if _traffic is not None:
        _count(_traffic, "reduce_scatter", front[: front.shape[0] - out.shape[0]])  # the other members' chunks
    _reduce_scatter_single(out, front, group=group)
    return out.movedim(0, dim).contiguous()


class _CopyToTensorParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        # Every rank's partial product contributed to the loss: the input's gradient is their sum.
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTensorParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _ScatterToTensorParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return _split(x, -1, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _gather(grad, -1, ctx.group), None


class _GatherFromTensorParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return _gather(x, -1, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _split(grad, -1, ctx.group), None


class _ScatterToSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return _split(x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _gather(grad, ctx.dim, ctx.group), None, None


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group, dim: int, tensor_parallel_output_grad: bool) -> torch.Tensor:
        ctx.group, ctx.dim, ctx.tp_output_grad = group, dim, tensor_parallel_output_grad
        return _gather(x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        # When the gathered tensor feeds a TP-split computation (a column-parallel linear), each rank holds
        # only its partial gradient for the whole sequence: sum them and keep my chunk (reduce-scatter).
        # When it feeds a replicated computation, every rank already holds the full gradient: just split.
        if ctx.tp_output_grad:
            return _reduce_scatter(grad, ctx.dim, ctx.group), None, None, None
        return _split(grad, ctx.dim, ctx.group), None, None, None


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return _reduce_scatter(x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _gather(grad, ctx.dim, ctx.group), None, None


def copy_to_tensor_parallel_region(x: torch.Tensor, group: Group = None) -> torch.Tensor:
    if group_size(group) == 1:
        return x
    return _CopyToTensorParallelRegion.apply(x, group)


def reduce_from_tensor_parallel_region(x: torch.Tensor, group: Group = None) -> torch.Tensor:
    if group_size(group) == 1:
        return x
    return _ReduceFromTensorParallelRegion.apply(x, group)


def scatter_to_tensor_parallel_region(x: torch.Tensor, group: Group = None) -> torch.Tensor:
    if group_size(group) == 1:
        return x
    return _ScatterToTensorParallelRegion.apply(x, group)


def gather_from_tensor_parallel_region(x: torch.Tensor, group: Group = None) -> torch.Tensor:
    if group_size(group) == 1:
        return x
    return _GatherFromTensorParallelRegion.apply(x, group)


def scatter_to_sequence_parallel_region(x: torch.Tensor, group: Group = None, *, dim: int = 0) -> torch.Tensor:
    if group_size(group) == 1:
        return x
    return _ScatterToSequenceParallelRegion.apply(x, group, dim)


def gather_from_sequence_parallel_region(
    x: torch.Tensor, group: Group = None, *, dim: int = 0, tensor_parallel_output_grad: bool = True
) -> torch.Tensor:
    if group_size(group) == 1:
        return x
    return _GatherFromSequenceParallelRegion.apply(x, group, dim, tensor_parallel_output_grad)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group: Group = None, *, dim: int = 0) -> torch.Tensor:
    if group_size(group) == 1:
        return x
    return _ReduceScatterToSequenceParallelRegion.apply(x, group, dim)
