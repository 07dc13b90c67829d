"""Megatron-style 1D tensor-parallel layers and the model's linear-layer factory.

A transformer layer needs two all-reduces forward and two backward (Megatron-LM, Shoeybi et al. 2019):

    x -> ColumnParallelLinear (QKV, MLP in: each rank owns out/tp output rows) -> local heads / local bias+GeLU
      -> RowParallelLinear (attention out, MLP out: each rank owns in/tp input columns) -> all-reduce
      -> bias+dropout+residual

The loss and evaluation scores never form logits: they live in tensor/cross_entropy.py. How a parameter's shard is cut
from the whole tensor is tensor/param_splits.py's.

Sharded parameters carry ``tensor_model_parallel = True`` and ``partition_dim``: the attribute names Megatron
uses and DeepSpeed reads (``deepspeed.runtime.utils.is_model_parallel_parameter``), so DeepSpeed's global
gradient norm counts each replicated parameter once. Everything not marked is replicated across TP ranks and
must stay bit-identical there (tensor/drift.py checks it).

A layer built on its own initialises like the dense layer: it draws the *full* weight with the same calls, in the
same order, on the same generator as ``nn.Linear``/``nn.Embedding`` would, then keeps its slice, so with the same
seed on every TP rank a tp=2 layer starts from the same numbers as the tp=1 one. The model's layers are built on
the meta device instead, where that draw costs nothing, and each rank then draws only its own slice of BLOOM's
initial weights (checkpoint.weight_shards.init_shards_).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from appliance.model.linear import default_linear_factory
from appliance.parallel.tensor.mappings import (
    Group,
    copy_to_tensor_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_parallel_region,
    group_rank,
    group_size,
    reduce_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_parallel_region,
)
from appliance.parallel.tensor.param_splits import shard_from_full, split_dim
from appliance.parallel.topology import ParallelTopology

TensorInit = Callable[[torch.Tensor], object]  # fills a full-size tensor in place (like nn.init.*_)
LinearFactory = Callable[[int, int, bool, str], nn.Module]  # (in_features, out_features, bias, role)

COLUMN_ROLES = ("qkv", "mlp_in")
ROW_ROLES = ("attn_out", "mlp_out")


def mark_tensor_parallel(param: nn.Parameter, partition_dim: int) -> None:
    param.tensor_model_parallel = True  # type: ignore[attr-defined]
    param.partition_dim = partition_dim  # type: ignore[attr-defined]


def is_tensor_parallel(param: torch.Tensor) -> bool:
    """Split over TP: a 1D shard, or any tp2d block (a vector's block is DeepSpeed-unmarked on mesh rows > 0 so that
    DeepSpeed's gradient norm counts it once, layers2d._mark_2d, but it is still this column's slice)."""
    return bool(getattr(param, "tensor_model_parallel", False) or getattr(param, "tp2d_row_replica", False))


def _linear_weight_init(weight: torch.Tensor, generator: torch.Generator | None) -> None:
    # nn.Linear.reset_parameters: kaiming-uniform with a=sqrt(5), i.e. U(-1/sqrt(in), 1/sqrt(in)).
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5), generator=generator)


def _linear_bias_init(bias: torch.Tensor, fan_in: int, generator: torch.Generator | None) -> None:
    bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0.0
    nn.init.uniform_(bias, -bound, bound, generator=generator)


class _ParallelLinear(nn.Module):
    """Shared state of the column and row layers: the group, full shape, and init-from-full."""

    shard_role: str  # a role with this layer's split: "qkv" (split by output rows) or "attn_out" (input columns)

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        group: Group,
        *,
        sequence_parallel: bool,
        sequence_dim: int,
        full_weight: torch.Tensor | None,
        full_bias: torch.Tensor | None,
        dtype: torch.dtype | None,
        device: torch.device | str | None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.group = group
        self.tp_size, self.tp_rank = group_size(group), group_rank(group)
        self.sequence_parallel, self.sequence_dim = sequence_parallel, sequence_dim
        dim = split_dim(self.shard_role)
        assert dim is not None
        shape = [out_features, in_features]
        if shape[dim] % self.tp_size != 0:
            side = ("out_features", "in_features")[dim]
            raise ValueError(f"{type(self).__name__}: {side}({shape[dim]}) % tp({self.tp_size}) != 0")
        shape[dim] //= self.tp_size
        self.weight = nn.Parameter(torch.empty(shape, dtype=dtype, device=device))
        mark_tensor_parallel(self.weight, dim)
        if bias:
            bias_dim = split_dim(self.shard_role, is_bias=True)
            bias_size = out_features if bias_dim is None else out_features // self.tp_size
            self.bias: nn.Parameter | None = nn.Parameter(torch.empty(bias_size, dtype=dtype, device=device))
            if bias_dim is not None:
                mark_tensor_parallel(self.bias, bias_dim)
            elif sequence_parallel:
                # Added to this rank's sequence chunk only: its gradient is partial until summed over TP.
                self.bias.sequence_parallel = True  # type: ignore[attr-defined]
        else:
            self.register_parameter("bias", None)
        if full_weight is None:
            self.reset_parameters()
        else:
            self.load_full(full_weight, full_bias)

    @torch.no_grad()
    def load_full(self, full_weight: torch.Tensor, full_bias: torch.Tensor | None = None) -> None:
        """Keep this rank's slice of a single-process [out, in] weight (and bias)."""
        if tuple(full_weight.shape) != (self.out_features, self.in_features):
            raise ValueError(
                f"full weight has shape {tuple(full_weight.shape)}, expected ({self.out_features}, {self.in_features})"
            )
        self.weight.copy_(shard_from_full(full_weight, self.shard_role, self.tp_rank, self.tp_size))
        if self.bias is not None:
            if full_bias is None:
                raise ValueError("a full weight was given without the full bias this layer has")
            self.bias.copy_(shard_from_full(full_bias, self.shard_role, self.tp_rank, self.tp_size, is_bias=True))

    @torch.no_grad()
    def reset_parameters(
        self,
        weight_init: TensorInit | None = None,
        bias_init: TensorInit | None = None,
        generator: torch.Generator | None = None,
    ) -> None:
        """Draw the full weight (then bias) as the dense layer would, and keep this rank's slice.

        The defaults repeat ``nn.Linear.reset_parameters``; a model with its own init passes its functions,
        e.g. ``weight_init=lambda w: nn.init.normal_(w, std=0.02)``, ``bias_init=nn.init.zeros_``.
        """
        full_weight = torch.empty(
            self.out_features, self.in_features, dtype=self.weight.dtype, device=self.weight.device
        )
        if weight_init is None:
            _linear_weight_init(full_weight, generator)
        else:
            weight_init(full_weight)
        full_bias = None
        if self.bias is not None:
            full_bias = torch.empty(self.out_features, dtype=self.bias.dtype, device=self.bias.device)
            if bias_init is None:
                _linear_bias_init(full_bias, self.in_features, generator)
            else:
                bias_init(full_bias)
        self.load_full(full_weight, full_bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"tp={self.tp_size}, sequence_parallel={self.sequence_parallel}"
        )


class ColumnParallelLinear(_ParallelLinear):
    """y = x W^T + b with W split by output rows: each rank computes out_features / tp of the outputs.

    Input: the full activation (replicated), or with ``sequence_parallel`` this rank's sequence chunk, which
    is all-gathered first (its gradient reduce-scattered back). Output: this rank's slice of the features,
    or all of them with ``gather_output``. With ``skip_bias_add`` (Megatron's convention) the bias slice is left
    to the caller, which adds it inside the next fused op (bias+GeLU).
    """

    shard_role = "qkv"

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        gather_output: bool = False,
        sequence_parallel: bool = False,
        sequence_dim: int = 0,
        skip_bias_add: bool = False,
        group: Group = None,
        full_weight: torch.Tensor | None = None,
        full_bias: torch.Tensor | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        if skip_bias_add and gather_output:
            raise ValueError(
                "ColumnParallelLinear: skip_bias_add leaves this rank's bias slice to the caller, "
                "which gather_output would not match"
            )
        super().__init__(
            in_features,
            out_features,
            bias,
            group,
            sequence_parallel=sequence_parallel,
            sequence_dim=sequence_dim,
            full_weight=full_weight,
            full_bias=full_bias,
            dtype=dtype,
            device=device,
        )
        self.gather_output = gather_output
        self.skip_bias_add = skip_bias_add

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            x = gather_from_sequence_parallel_region(x, self.group, dim=self.sequence_dim)
        else:
            x = copy_to_tensor_parallel_region(x, self.group)
        y = F.linear(x, self.weight, None if self.skip_bias_add else self.bias)
        return gather_from_tensor_parallel_region(y, self.group) if self.gather_output else y


class RowParallelLinear(_ParallelLinear):
    """y = sum over ranks of x_r W_r^T, then + b: W split by input columns; the bias is replicated and added
    once, after the all-reduce (adding it on every rank before the sum would count it tp times).

    With ``sequence_parallel`` the sum is a reduce-scatter, leaving this rank's sequence chunk. With
    ``skip_bias_add`` the caller adds the bias (inside bias+dropout+residual), after the sum all the same; with
    sequence parallelism it then still meets only this rank's chunk, so it stays marked ``sequence_parallel``
    (its gradient is partial until summed over TP).
    """

    shard_role = "attn_out"

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        input_is_parallel: bool = True,
        sequence_parallel: bool = False,
        sequence_dim: int = 0,
        skip_bias_add: bool = False,
        group: Group = None,
        full_weight: torch.Tensor | None = None,
        full_bias: torch.Tensor | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        if sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear: sequence_parallel needs input_is_parallel=True")
        super().__init__(
            in_features,
            out_features,
            bias,
            group,
            sequence_parallel=sequence_parallel,
            sequence_dim=sequence_dim,
            full_weight=full_weight,
            full_bias=full_bias,
            dtype=dtype,
            device=device,
        )
        self.input_is_parallel = input_is_parallel
        self.skip_bias_add = skip_bias_add

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tensor_parallel_region(x, self.group)
        y = F.linear(x, self.weight)
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(y, self.group, dim=self.sequence_dim)
        else:
            y = reduce_from_tensor_parallel_region(y, self.group)
        return y if self.bias is None or self.skip_bias_add else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Embedding with the vocabulary split into tp contiguous row ranges.

    Each rank looks up the ids in its range, writes zeros for the others, and the sum over ranks (an
    all-reduce, or a reduce-scatter into sequence chunks with ``sequence_parallel``) is the full embedding.
    The vocabulary must be divisible by tp (the tokenizer pads it to a multiple of 128 * tp).
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        group: Group = None,
        sequence_parallel: bool = False,
        sequence_dim: int = 0,
        full_weight: torch.Tensor | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.group = group
        self.tp_size, self.tp_rank = group_size(group), group_rank(group)
        self.sequence_parallel, self.sequence_dim = sequence_parallel, sequence_dim
        if num_embeddings % self.tp_size != 0:
            raise ValueError(f"VocabParallelEmbedding: vocab({num_embeddings}) % tp({self.tp_size}) != 0")
        per_rank = num_embeddings // self.tp_size
        self.vocab_start, self.vocab_end = self.tp_rank * per_rank, (self.tp_rank + 1) * per_rank
        self.weight = nn.Parameter(torch.empty(per_rank, embedding_dim, dtype=dtype, device=device))
        mark_tensor_parallel(self.weight, 0)
        if full_weight is None:
            self.reset_parameters()
        else:
            self.load_full(full_weight)

    @torch.no_grad()
    def load_full(self, full_weight: torch.Tensor) -> None:
        if tuple(full_weight.shape) != (self.num_embeddings, self.embedding_dim):
            raise ValueError(
                f"full embedding has shape {tuple(full_weight.shape)}, "
                f"expected ({self.num_embeddings}, {self.embedding_dim})"
            )
        self.weight.copy_(shard_from_full(full_weight, "embedding", self.tp_rank, self.tp_size))

    @torch.no_grad()
    def reset_parameters(self, weight_init: TensorInit | None = None, generator: torch.Generator | None = None) -> None:
        """Draw the full table as ``nn.Embedding`` would (N(0, 1) unless ``weight_init`` says otherwise)."""
        full = torch.empty(self.num_embeddings, self.embedding_dim, dtype=self.weight.dtype, device=self.weight.device)
        if weight_init is None:
            nn.init.normal_(full, generator=generator)
        else:
            weight_init(full)
        self.load_full(full)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local_ids = (ids - self.vocab_start).masked_fill(outside, 0)
        # masked_fill (not in place) also zeroes the gradient that would otherwise reach local row 0.
        partial = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(partial, self.group, dim=self.sequence_dim)
        return reduce_from_tensor_parallel_region(partial, self.group)

    def extra_repr(self) -> str:
        rows = f"[{self.vocab_start}, {self.vocab_end})"
        return f"{self.num_embeddings}, {self.embedding_dim}, tp={self.tp_size}, rows={rows}"


def tp_linear_factory(
    topology: ParallelTopology, *, sequence_parallel: bool = False, sequence_dim: int = 0
) -> LinearFactory:
    """The model's linear-layer injection point: ``BloomForCausalLM(config, linear_factory=...)``.

    qkv and mlp_in become column-parallel (outputs stay split: each rank runs its own heads / GeLU slice),
    attn_out and mlp_out row-parallel (inputs arrive split). With tp=1 it returns the single-device layers
    (``model.linear.default_linear_factory``). At every tp, mlp_in, attn_out and mlp_out skip their bias add
    (``skip_bias_add``): the model folds it into bias+GeLU and bias+dropout+residual.
    With ``sequence_parallel`` the activations between the layers are sequence chunks; ``sequence_dim`` says
    where the sequence axis is: 0 for Megatron's [s, b, h], 1 for the [b, s, h] layout of transformers.
    """
    tp = topology.tp

    def make(in_features: int, out_features: int, bias: bool, role: str) -> nn.Module:
        if role not in COLUMN_ROLES + ROW_ROLES:
            raise ValueError(f"unknown linear role {role!r}: expected one of {COLUMN_ROLES + ROW_ROLES}")
        if tp == 1:
            return default_linear_factory(in_features, out_features, bias, role)
        layer = ColumnParallelLinear if role in COLUMN_ROLES else RowParallelLinear
        return layer(
            in_features,
            out_features,
            bias,
            sequence_parallel=sequence_parallel,
            sequence_dim=sequence_dim,
            skip_bias_add=role != "qkv",
            group=topology.tp_group,
        )

    return make


def allreduce_sequence_parallel_grads(model: nn.Module, group: Group = None) -> int:
    """Sum over TP the gradients of the replicated parameters; call after backward, before the optimizer step,
    only when sequence parallelism is on. Returns the number of gradients reduced.

    In a sequence-parallel BLOOM every TP-replicated parameter (the LayerNorms, embedding and final
    LayerNorms included, and the row-parallel biases) acts on this rank's sequence chunk only, so its
    gradient is a partial sum over the sequence. One flat all-reduce per dtype keeps it to a few collectives.
    """
    if group_size(group) == 1:
        return 0
    grads = [p.grad for p in model.parameters() if p.grad is not None and not is_tensor_parallel(p)]
    for dtype in sorted({g.dtype for g in grads}, key=str):
        same = [g for g in grads if g.dtype == dtype]
        flat = torch.cat([g.reshape(-1) for g in same])
        dist.all_reduce(flat, group=group)
        offset = 0
        for g in same:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
    return len(grads)
