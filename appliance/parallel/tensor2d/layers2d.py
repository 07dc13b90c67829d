"""Optimus 2D tensor-parallel layers (tp2d = q): weights and activations both split q x q over the tp mesh.

Placement on the mesh (topology.py: rank (r, c) = mesh row r, mesh column c; tensor2d/summa.py for the products):

    activations [b, s, h]         rank (i, j): batch slice i, hidden slice j  -> [b/q, s, h/q]
    linear weight [out, in]       rank (r, c): W[out slice c, in slice r]     (SUMMA's B(k, j) = W(k, j)^T)
    linear bias, LayerNorm [n]    rank (r, c): slice c, the same on every row; its gradient is summed over the
                                  mesh column inside the backward pass (each row saw its own batch slice), so the
                                  rows keep equal copies without a separate reduction step
    word embedding [vocab, h]     rank (r, c): E[vocab slice c, hidden slice r]

Every linear of BLOOM is the same SUMMA product with this placement (there is no column/row distinction left: the
output of one is split over the mesh columns exactly as the input of the next expects). Attention is local: the
QKV output's slice c holds whole heads (tensor/param_splits.py), so mesh column c runs heads [c * n/q, (c+1) * n/q) with
their ALiBi slopes, on its row's batch slice. LayerNorm reduces its statistics along the mesh row (the ranks holding the
other hidden slices of the same tokens).

Embedding and tied head. Rank (i, c) all-gathers its mesh column's blocks into E[vocab slice c, :] (V/q x h, the
size of a 1D tp=q shard): the lookup of batch slice i's ids in that vocabulary slice is partial, and a
reduce-scatter along the mesh row sums the vocabulary slices and leaves hidden slice j on rank (i, j). The head is
the same product the other way round: the row's hidden slices all-gathered to [b/q, s, h] against E[vocab slice c,
:] is the vocabulary-parallel loss's input over the mesh row (tensor/cross_entropy.py, the project's one loss), whose
gradient for the gathered table reduce-scatters back along the column (SUMMA with its q broadcasts fused into one
all-gather). Each model input arrives whole (every mesh rank gets the micro-batch) and each mesh row keeps its
batch slice, so the micro-batch must divide by q.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from appliance.model import ops
from appliance.model.linear import LINEAR_ROLES, LinearFactory, default_linear_factory
from appliance.parallel.context.training import token_weighted_loss
from appliance.parallel.tensor.cross_entropy import HeadInput, vocab_parallel_loss
from appliance.parallel.tensor.mappings import Group, group_rank, group_size
from appliance.parallel.tensor.param_splits import shard_from_full_2d
from appliance.parallel.tensor2d.summa import (
    gather_partial_grad,
    gather_whole_grad,
    reduce_scatter,
    sum_grad_over,
    sum_over,
    summa_linear,
)
from appliance.parallel.topology import ParallelTopology

BATCH_DIM, HIDDEN_DIM = 0, -1


@dataclass(frozen=True)
class Mesh2D:
    """This rank's place on the q x q tp mesh and the two groups along it."""

    row_group: Group  # same mesh row: the other hidden slices of the same tokens
    col_group: Group  # same mesh column: the other batch slices of the same hidden slice

    @classmethod
    def of(cls, topology: ParallelTopology) -> Mesh2D:
        return cls(topology.tp_row_group, topology.tp_col_group)

    @classmethod
    def single(cls) -> Mesh2D:
        """The 1 x 1 mesh of a process without torch.distributed (every group helper reads None as one rank)."""
        return cls(None, None)

    @property
    def q(self) -> int:
        return group_size(self.row_group)

    @property
    def row(self) -> int:
        return group_rank(self.col_group)

    @property
    def col(self) -> int:
        return group_rank(self.row_group)

    def batch_slice(self, tensor: torch.Tensor) -> torch.Tensor:
        """This mesh row's slice of a whole micro-batch (ids, labels, document ids) along dimension 0."""
        if tensor.shape[BATCH_DIM] % self.q != 0:
            raise ValueError(f"tp2d: micro-batch({tensor.shape[BATCH_DIM]}) % tp2d({self.q}) != 0")
        return tensor.chunk(self.q, dim=BATCH_DIM)[self.row]

    def block(self, full: torch.Tensor) -> torch.Tensor:
        return shard_from_full_2d(full, self.row, self.col, self.q)


def _check_divisible(what: str, sizes: dict[str, int], q: int) -> None:
    bad = [f"{name}({size})" for name, size in sizes.items() if size % q]
    if bad:
        raise ValueError(f"{what}: {', '.join(bad)} % tp2d({q}) != 0")


def _mark_2d(param: nn.Parameter, mesh: Mesh2D) -> None:
    """Each mesh rank holds its own block (tensor/param_splits.py cuts and rejoins), so the drift check over tp leaves
    it alone.

    A vector's slice (biases, LayerNorms) is the same on every mesh row, and every gradient norm must count it once.
    Ours (grads.counted_in_norm) reads ``tp2d_row_replica``. DeepSpeed's bf16 and ZeRO optimizers count a parameter on
    every tensor rank when ``is_model_parallel_parameter`` (its ``tensor_model_parallel``) says split, and on tensor
    rank 0 only otherwise. So the vector is marked split on mesh row 0 only (its q column slices differ) and
    replicated on rows > 0, whose tensor ranks row * q + col are all > 0: DeepSpeed then counts row 0's copies,
    once each, as ours does. ``is_tensor_parallel`` reads both attributes, so our own code sees every block as split.
    """
    param.partition_dim = 0  # type: ignore[attr-defined]
    if param.ndim == 1:
        param.tp2d_row_replica = True  # type: ignore[attr-defined]
        param.tensor_model_parallel = mesh.row == 0  # type: ignore[attr-defined]
    else:
        param.tensor_model_parallel = True  # type: ignore[attr-defined]


class Linear2D(nn.Module):
    """y = x W^T + b by SUMMA; x and y are this rank's [..., in/q] and [..., out/q] activation blocks."""

    skip_bias_add = False  # the bias is added here, where its gradient is summed over the mesh column

    def __init__(
        self, in_features: int, out_features: int, bias: bool, mesh: Mesh2D, *, dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:  # fmt: skip
        super().__init__()
        _check_divisible("Linear2D", {"in_features": in_features, "out_features": out_features}, mesh.q)
        self.in_features, self.out_features, self.mesh = in_features, out_features, mesh
        q = mesh.q
        self.weight = nn.Parameter(torch.empty(out_features // q, in_features // q, dtype=dtype, device=device))
        _mark_2d(self.weight, mesh)
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features // q, dtype=dtype, device=device))
            _mark_2d(self.bias, mesh)

    @torch.no_grad()
    def load_full(self, full_weight: torch.Tensor, full_bias: torch.Tensor | None = None) -> None:
        self.weight.copy_(self.mesh.block(full_weight))
        if self.bias is not None:
            if full_bias is None:
                raise ValueError("Linear2D: a full weight was given without the full bias this layer has")
            self.bias.copy_(self.mesh.block(full_bias))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = summa_linear(x, self.weight, self.mesh.row_group, self.mesh.col_group)
        return y if self.bias is None else y + sum_grad_over(self.bias, self.mesh.col_group)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, tp2d={self.mesh.q}"


class LayerNorm2D(nn.LayerNorm):
    """LayerNorm of [..., h/q] blocks over the whole hidden dimension: the mean and variance sum along the mesh row.
    Statistics in float32 at least (float64 stays float64), as ops.layer_norm; weight and bias hold slice c.
    A subclass of nn.LayerNorm so that it sits where the model's LayerNorms are (model/bloom.py runs any other
    norm module through its own forward)."""

    def __init__(
        self, hidden: int, eps: float, mesh: Mesh2D, *, dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:  # fmt: skip
        _check_divisible("LayerNorm2D", {"hidden": hidden}, mesh.q)
        super().__init__(hidden // mesh.q, eps=eps, dtype=dtype, device=device)
        self.hidden, self.mesh = hidden, mesh
        _mark_2d(self.weight, mesh)
        _mark_2d(self.bias, mesh)

    @torch.no_grad()
    def load_full(self, full_weight: torch.Tensor, full_bias: torch.Tensor) -> None:
        self.weight.copy_(self.mesh.block(full_weight))
        self.bias.copy_(self.mesh.block(full_bias))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        math_dtype = torch.promote_types(x.dtype, torch.float32)
        xm = x.to(math_dtype)
        row = self.mesh.row_group
        mean = sum_over(xm.sum(-1, keepdim=True), row) / self.hidden
        centred = xm - mean
        # Two passes (centre, then square) as F.layer_norm: the one-pass E[x^2] - E[x]^2 cancels badly.
        variance = sum_over((centred * centred).sum(-1, keepdim=True), row) / self.hidden
        normed = centred * torch.rsqrt(variance + self.eps)
        col = self.mesh.col_group
        weight, bias = sum_grad_over(self.weight, col), sum_grad_over(self.bias, col)
        return (normed * weight.to(math_dtype) + bias.to(math_dtype)).to(x.dtype)

    def extra_repr(self) -> str:
        return f"hidden={self.hidden}, eps={self.eps}, tp2d={self.mesh.q}"


class Embedding2D(nn.Module):
    """The tied word embedding on the mesh: ids of the whole micro-batch -> this rank's [b/q, s, h/q] block, and
    the head's input (see the module docstring). Block (r, c) = E[vocab slice c, hidden slice r]."""

    def __init__(
        self, vocab: int, hidden: int, mesh: Mesh2D, *, dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:  # fmt: skip
        super().__init__()
        _check_divisible("Embedding2D", {"vocab": vocab, "hidden": hidden}, mesh.q)
        self.vocab, self.hidden, self.mesh = vocab, hidden, mesh
        self.weight = nn.Parameter(torch.empty(vocab // mesh.q, hidden // mesh.q, dtype=dtype, device=device))
        _mark_2d(self.weight, mesh)
        per_col = vocab // mesh.q
        self.vocab_start, self.vocab_end = mesh.col * per_col, (mesh.col + 1) * per_col

    @torch.no_grad()
    def load_full(self, full_weight: torch.Tensor) -> None:
        self.weight.copy_(self.mesh.block(full_weight))

    def vocab_slice(self) -> torch.Tensor:
        """E[vocab slice c, :] gathered along the mesh column; its gradient is reduce-scattered back."""
        return gather_partial_grad(self.weight, HIDDEN_DIM, self.mesh.col_group)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        ids = self.mesh.batch_slice(ids)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local_ids = (ids - self.vocab_start).masked_fill(outside, 0)
        # masked_fill (not in place) also zeroes the gradient that would otherwise reach local row 0.
        partial = F.embedding(local_ids, self.vocab_slice()).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_scatter(partial, HIDDEN_DIM, self.mesh.row_group)

    def head_input(self, hidden: torch.Tensor) -> HeadInput:
        """[b/q, s, h/q] final hidden block -> the loss's input over the mesh row: the row's whole hidden states
        (their gradient arrives whole from the loss, which sums it over the row) and E[vocab slice c, :]."""
        whole = gather_whole_grad(hidden, HIDDEN_DIM, self.mesh.row_group)
        return HeadInput(whole, self.vocab_slice())

    def extra_repr(self) -> str:
        return f"{self.vocab}, {self.hidden}, tp2d={self.mesh.q}, vocab rows=[{self.vocab_start}, {self.vocab_end})"


def loss_2d(
    head: HeadInput, labels: torch.Tensor, mesh: Mesh2D, *, ignore_index: int = -100, reduction: str = "mean"
) -> torch.Tensor:
    """The micro-batch's loss from this mesh row: the one vocabulary-parallel loss over the row (labels: the whole
    micro-batch, this row's slice is taken here). For "mean", this row's share sum_i / (tokens of the whole
    micro-batch): the rows' shares add up to the micro-batch mean and each row's backward carries its share into the
    SUMMA reductions, which sum over the rows. "sum" is this row's sum. Report ``sum_over_rows(loss)``."""
    labels = mesh.batch_slice(labels)
    if reduction != "mean" or mesh.q == 1:
        return vocab_parallel_loss(head, labels, mesh.row_group, ignore_index=ignore_index, reduction=reduction)
    loss_sum = vocab_parallel_loss(head, labels, mesh.row_group, ignore_index=ignore_index, reduction="sum")
    # token_weighted_loss is the context-parallel share, loss_sum * ranks / tokens (DeepSpeed then averages over
    # those ranks); the mesh rows are summed, not averaged, so drop the factor q.
    return token_weighted_loss(loss_sum, labels, mesh.col_group, ignore_index) / mesh.q


def sum_over_rows(loss: torch.Tensor, mesh: Mesh2D) -> torch.Tensor:
    """The whole micro-batch's loss from the rows' shares (no gradient: for reports)."""
    return sum_over(loss.detach(), mesh.col_group)


def tp2d_linear_factory(mesh: Mesh2D, **tensor_kwargs: Any) -> LinearFactory:
    """The model's linear-layer injection point: every role is the same SUMMA linear; on a 1 x 1 mesh the
    single-device layers themselves (model.linear.default_linear_factory), so q = 1 is the plain model exactly."""

    def make(in_features: int, out_features: int, bias: bool, role: str) -> nn.Module:
        if role not in LINEAR_ROLES:
            raise ValueError(f"unknown linear role {role!r}: expected one of {LINEAR_ROLES}")
        if mesh.q == 1:
            return default_linear_factory(in_features, out_features, bias, role).to(**tensor_kwargs)
        return Linear2D(in_features, out_features, bias, mesh, **tensor_kwargs)

    return make


def layer_norm_2d(hidden: int, eps: float, mesh: Mesh2D, **tensor_kwargs: Any) -> nn.LayerNorm:
    """LayerNorm2D, or on a 1 x 1 mesh the model's own nn.LayerNorm (run through ops.layer_norm)."""
    if mesh.q == 1:
        return nn.LayerNorm(hidden, eps=eps, **tensor_kwargs)
    return LayerNorm2D(hidden, eps, mesh, **tensor_kwargs)


def apply_norm(norm: nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
    """A norm as the model runs it (model/bloom.py): nn.LayerNorm through ops.layer_norm, LayerNorm2D itself."""
    if type(norm) is nn.LayerNorm:
        return ops.layer_norm(x, norm.weight, norm.bias, norm.eps)
    return norm(x)
