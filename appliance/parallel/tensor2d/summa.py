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

Every collective of the 2D layers is one of tensor/mappings.py's: the SUMMA steps use its plain ``broadcast_from`` and
``reduce_to``, and the other 2D regions below are its Megatron regions under the names of what they do on the mesh.
``mappings.count_traffic()`` counts them all (payload bytes and calls by kind): one patch point for benchmarks of
bytes moved. Buffers are created on the operand's device (the layers' tensors live on the engine's device, the one
the group's backend moves).
"""

from __future__ import annotations

from typing import Any

import torch

from appliance.parallel.tensor.mappings import (
    Group,
    broadcast_from,
    copy_to_tensor_parallel_region,
    gather_from_sequence_parallel_region,
    group_rank,
    group_size,
    reduce_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    reduce_to,
)


# ---- SUMMA ------------------------------------------------------------------------------------------------------
def _summa_forward(x: torch.Tensor, weight: torch.Tensor, row: Group, col: Group) -> torch.Tensor:
    """y(i, j) = sum_k x(i, k) W(k, j)^T; x [..., in/q] of this rank's block, weight [out/q, in/q]."""
    q, me_in_row, me_in_col = group_size(row), group_rank(row), group_rank(col)
    y = x.new_zeros((*x.shape[:-1], weight.shape[0]))
    for k in range(q):
        x_k = broadcast_from(x.detach().clone() if me_in_row == k else torch.empty_like(x), k, row)
        w_k = broadcast_from(weight.detach().clone() if me_in_col == k else torch.empty_like(weight), k, col)
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
                w_k = broadcast_from(weight.detach().clone() if me_in_col == k else torch.empty_like(weight), k, col)
                part = reduce_to((grad @ w_k).contiguous(), k, row)
                if me_in_row == k:
                    grad_x = part
            if ctx.needs_input_grad[1]:
                # dW(k, j) = sum_i dy(i, j)^T x(i, k): x(i, k) along row i, the partials summed along column j.
                x_k = broadcast_from(x.detach().clone() if me_in_row == k else torch.empty_like(x), k, row)
                part = reduce_to(flat_grad.t() @ x_k.reshape(-1, x_k.shape[-1]), k, col)
                if me_in_col == k:
                    grad_w = part
        return grad_x, grad_w, None, None


def summa_linear(x: torch.Tensor, weight: torch.Tensor, row: Group, col: Group) -> torch.Tensor:
    """This rank's block of x W^T on the mesh whose rows are ``row`` groups and columns ``col`` groups (see the
    module docstring). x: [..., in/q], batch slice of this mesh row and input slice of this mesh column;
    weight: [out/q, in/q], block (r, c) = W[out slice c, in slice r]. Returns [..., out/q]."""
    return _Summa.apply(x, weight, row, col)


# ---- the other 2D regions: tensor/mappings.py's, named for their use on the mesh -------------------------------------
def sum_over(x: torch.Tensor, group: Group) -> torch.Tensor:
    """The sum of ``x`` over the group on every member, differentiably (LayerNorm statistics along a mesh row).
    Every member uses the sum for its own hidden slice, so the input's gradient is the sum of theirs: all-reduce
    both ways, which is reduce_from (fwd all-reduce, bwd identity) followed by copy_to (fwd identity, bwd
    all-reduce)."""
    return copy_to_tensor_parallel_region(reduce_from_tensor_parallel_region(x, group), group)


def sum_grad_over(param: torch.Tensor, group: Group) -> torch.Tensor:
    """``param`` itself, whose gradient is summed over the group (biases and norms along a mesh column: each member
    used it on its own batch slice, and every member keeps the same value). Megatron's copy_to."""
    return copy_to_tensor_parallel_region(param, group)


def gather_partial_grad(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """All-gather along ``dim``; the backward reduce-scatters (each member used the whole for its own work, so its
    gradient of the whole is partial)."""
    return gather_from_sequence_parallel_region(x, group, dim=dim, tensor_parallel_output_grad=True)


def gather_whole_grad(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """All-gather along ``dim``; the backward keeps this member's chunk (its gradient arrives whole)."""
    return gather_from_sequence_parallel_region(x, group, dim=dim, tensor_parallel_output_grad=False)


def reduce_scatter(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """Sum over the group and keep this member's chunk along ``dim``; the backward all-gathers."""
    return reduce_scatter_to_sequence_parallel_region(x, group, dim=dim)
