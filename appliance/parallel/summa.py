"""Optimus 2D tensor parallelism's communication: SUMMA products and the collectives of a q x q mesh.

The tp ranks of a ``tp2d = q`` layout form a q x q mesh (topology.py: mesh row r, mesh column c, tp rank
r * q + c). Two groups run along it: ``tp_row``, the q ranks of one mesh row (same r, every c), and ``tp_col``, the
q ranks of one mesh column (same c, every r). An activation [b, s, h] sits on the mesh as block (i, j): batch slice
i on mesh row i, hidden slice j on mesh column j. A linear's weight W [out, in] sits as block (r, c) = W[out slice c,
in slice r], so that y = x W^T is the block product

    y(i, j) = sum_k x(i, k) W(k, j)^T          W(k, j) = W[out slice j, in slice k], held by rank (k, j)

SUMMA (van de Geijn and Watts 1997; Optimus, Xu et al. 2021) computes it in q steps: in step k, rank (i, k)
broadcasts x(i, k) along its mesh row and rank (k, j) broadcasts W(k, j) along its mesh column, and every rank
accumulates the product of what it received. No rank ever holds more than one block of each operand. The backward
pass is the two transposed products, again in q steps:

    dx(i, k) = sum_j dy(i, j) W(k, j)      step k: broadcast W(k, j) along column j, reduce the partial along row i
                                           to rank (i, k)
    dW(k, j) = sum_i dy(i, j)^T x(i, k)    step k: broadcast x(i, k) along row i, reduce the partial along column j
                                           to rank (k, j)

Every collective of the 2D layers goes through this module's few functions (``_broadcast``, ``_reduce``,
``_all_reduce``, ``_all_gather``, ``_reduce_scatter``), which count what they send in ``traffic`` when a
``count_traffic()`` block is open: one patch point for benchmarks of bytes moved. Buffers are created on the
operand's device (the layers' tensors live on the engine's device, the one the group's backend moves).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from appliance.parallel.mappings import Group, group_rank, group_size

# Bytes each collective kind handed to the backend on this rank while a count_traffic() block is open (None: off).
# A broadcast counts its tensor on the sender only, a reduce on the senders (not the root); the all-* count what
# this rank contributes. Ring algorithms forward more than that; this is the payload, the planner's unit.
traffic: Counter[str] | None = None


@contextmanager
def count_traffic() -> Iterator[Counter[str]]:
    """Count the 2D layers' payload bytes by collective kind for the block: ``with count_traffic() as sent: ...``."""
    global traffic
    before, traffic = traffic, Counter()
    try:
        yield traffic
    finally:
        traffic = before


def _count(kind: str, tensor: torch.Tensor, sends: bool = True) -> None:
    if traffic is not None and sends:
        traffic[kind] += tensor.numel() * tensor.element_size()


def _global(group: Group, member: int) -> int:
    return dist.get_global_rank(group, member) if group is not None else member


def _broadcast(tensor: torch.Tensor, source: int, group: Group) -> torch.Tensor:
    """``tensor`` of group member ``source`` on every member (in place; the others' tensor is the buffer)."""
    _count("broadcast", tensor, group_rank(group) == source)
    dist.broadcast(tensor, src=_global(group, source), group=group)
    return tensor


def _reduce(tensor: torch.Tensor, root: int, group: Group) -> torch.Tensor:
    """The sum of every member's ``tensor``, on member ``root`` (the others' result is undefined)."""
    _count("reduce", tensor, group_rank(group) != root)
    dist.reduce(tensor, dst=_global(group, root), op=dist.ReduceOp.SUM, group=group)
    return tensor


def _all_reduce(tensor: torch.Tensor, group: Group) -> torch.Tensor:
    out = tensor.clone(memory_format=torch.contiguous_format)
    _count("all_reduce", out)
    dist.all_reduce(out, group=group)
    return out


def _all_gather(tensor: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """Every member's ``tensor`` concatenated along ``dim`` in member order."""
    parts = [torch.empty_like(tensor, memory_format=torch.contiguous_format) for _ in range(group_size(group))]
    local = tensor.contiguous()
    _count("all_gather", local)
    dist.all_gather(parts, local, group=group)
    return torch.cat(parts, dim=dim)


def _reduce_scatter(tensor: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """The sum over members of ``tensor``, cut into ``group_size`` chunks along ``dim``: this member's chunk.
    As a reduce of each chunk to its owner (gloo has no reduce-scatter of unequal layouts; q is small)."""
    size, me = group_size(group), group_rank(group)
    if tensor.shape[dim] % size != 0:
        raise ValueError(f"cannot reduce-scatter dimension {dim} of size {tensor.shape[dim]} over {size} ranks")
    mine = tensor
    for owner, chunk in enumerate(tensor.chunk(size, dim=dim)):
        summed = _reduce(chunk.contiguous(), owner, group)
        if owner == me:
            mine = summed
    return mine


# ---- SUMMA ------------------------------------------------------------------------------------------------------
def _summa_forward(x: torch.Tensor, weight: torch.Tensor, row: Group, col: Group) -> torch.Tensor:
    """y(i, j) = sum_k x(i, k) W(k, j)^T; x [..., in/q] of this rank's block, weight [out/q, in/q]."""
    q, me_in_row, me_in_col = group_size(row), group_rank(row), group_rank(col)
    y = x.new_zeros((*x.shape[:-1], weight.shape[0]))
    for k in range(q):
        x_k = _broadcast(x.detach().clone() if me_in_row == k else torch.empty_like(x), k, row)
        w_k = _broadcast(weight.detach().clone() if me_in_col == k else torch.empty_like(weight), k, col)
        y += x_k @ w_k.t()
    return y


class _Summa(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, row: Group, col: Group) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.row, ctx.col = row, col
        return _summa_forward(x, weight, row, col)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None]:
        x, weight = ctx.saved_tensors
        row, col = ctx.row, ctx.col
        q, me_in_row, me_in_col = group_size(row), group_rank(row), group_rank(col)
        grad = grad.contiguous()
        flat_grad = grad.reshape(-1, grad.shape[-1])  # [tokens of batch slice i, out/q]
        grad_x = grad_w = None
        for k in range(q):
            if ctx.needs_input_grad[0]:
                # dx(i, k) = sum_j dy(i, j) W(k, j): W(k, j) along column j, the partials summed along row i.
                w_k = _broadcast(weight.detach().clone() if me_in_col == k else torch.empty_like(weight), k, col)
                part = _reduce((grad @ w_k).contiguous(), k, row)
                if me_in_row == k:
                    grad_x = part
            if ctx.needs_input_grad[1]:
                # dW(k, j) = sum_i dy(i, j)^T x(i, k): x(i, k) along row i, the partials summed along column j.
                x_k = _broadcast(x.detach().clone() if me_in_row == k else torch.empty_like(x), k, row)
                part = _reduce(flat_grad.t() @ x_k.reshape(-1, x_k.shape[-1]), k, col)
                if me_in_col == k:
                    grad_w = part
        return grad_x, grad_w, None, None


def summa_linear(x: torch.Tensor, weight: torch.Tensor, row: Group, col: Group) -> torch.Tensor:
    """This rank's block of x W^T on the mesh whose rows are ``row`` groups and columns ``col`` groups (see the
    module docstring). x: [..., in/q], batch slice of this mesh row and input slice of this mesh column;
    weight: [out/q, in/q], block (r, c) = W[out slice c, in slice r]. Returns [..., out/q]."""
    return _Summa.apply(x, weight, row, col)


# ---- the other 2D regions ---------------------------------------------------------------------------------------
class _SumOverGroup(torch.autograd.Function):
    """fwd: all-reduce (every member gets the sum); bwd: all-reduce (each input fed every member's output)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_reduce(grad, ctx.group), None


class _SumGradOverGroup(torch.autograd.Function):
    """fwd: identity; bwd: all-reduce. For a parameter replicated over ``group`` whose members each use it on
    their own batch slice: its gradient is the sum of theirs, and every member keeps the same value."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_reduce(grad, ctx.group), None


class _GatherSummedGrad(torch.autograd.Function):
    """fwd: all-gather along ``dim``; bwd: reduce-scatter (the gathered tensor fed different work on each member,
    so each member's gradient of the whole is partial)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return _all_gather(x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _reduce_scatter(grad.contiguous(), ctx.dim, ctx.group), None, None


class _GatherWholeGrad(torch.autograd.Function):
    """fwd: all-gather along ``dim``; bwd: keep this member's chunk (every member's gradient is already whole)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return _all_gather(x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        chunk = grad.chunk(group_size(ctx.group), dim=ctx.dim)[group_rank(ctx.group)]
        return chunk.contiguous(), None, None


class _ReduceScatter(torch.autograd.Function):
    """fwd: reduce-scatter along ``dim``; bwd: all-gather."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return _reduce_scatter(x.contiguous(), dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _all_gather(grad, ctx.dim, ctx.group), None, None


def sum_over(x: torch.Tensor, group: Group) -> torch.Tensor:
    """The sum of ``x`` over the group on every member, differentiably (LayerNorm statistics along a mesh row)."""
    return x if group_size(group) == 1 else _SumOverGroup.apply(x, group)


def sum_grad_over(param: torch.Tensor, group: Group) -> torch.Tensor:
    """``param`` itself, whose gradient is summed over the group (biases and norms along a mesh column)."""
    return param if group_size(group) == 1 else _SumGradOverGroup.apply(param, group)


def gather_partial_grad(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """All-gather along ``dim``; the backward reduce-scatters (each member used the whole for its own work)."""
    return x if group_size(group) == 1 else _GatherSummedGrad.apply(x, dim, group)


def gather_whole_grad(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """All-gather along ``dim``; the backward keeps this member's chunk (its gradient arrives whole)."""
    return x if group_size(group) == 1 else _GatherWholeGrad.apply(x, dim, group)


def reduce_scatter(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """Sum over the group and keep this member's chunk along ``dim``; the backward all-gathers."""
    return x if group_size(group) == 1 else _ReduceScatter.apply(x, dim, group)
