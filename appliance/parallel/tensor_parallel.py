"""Megatron-style 1D tensor-parallel layers, the vocabulary-parallel loss, and the model's linear-layer factory.

A transformer layer needs two all-reduces forward and two backward (Megatron-LM, Shoeybi et al. 2019):

    x -> ColumnParallelLinear (QKV, MLP in: each rank owns out/tp output rows) -> local heads / local bias+GeLU
      -> RowParallelLinear (attention out, MLP out: each rank owns in/tp input columns) -> all-reduce
      -> bias+dropout+residual

The loss never forms logits: the last stage hands the final hidden states and its tied-embedding shard to one
chunked vocabulary-parallel cross-entropy (kernels/, through ops.vocab_cross_entropy), which evaluation scoring
shares (vocab_parallel_scores).

Sharded parameters carry ``tensor_model_parallel = True`` and ``partition_dim``: the attribute names Megatron
uses and DeepSpeed reads (``deepspeed.runtime.utils.is_model_parallel_parameter``), so DeepSpeed's global
gradient norm counts each replicated parameter once. Everything not marked is replicated across TP ranks and
must stay bit-identical there (drift.py checks it).

A layer built on its own initialises like the dense layer: it draws the *full* weight with the same calls, in the
same order, on the same generator as ``nn.Linear``/``nn.Embedding`` would, then keeps its slice, so with the same
seed on every TP rank a tp=2 layer starts from the same numbers as the tp=1 one. The model's layers are built on
the meta device instead, where that draw costs nothing, and each rank then draws only its own slice of BLOOM's
initial weights (shards.init_shards_).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from appliance.model import ops
from appliance.model.bloom import default_linear_factory
from appliance.parallel.mappings import (
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
from appliance.parallel.topology import ParallelTopology

TensorInit = Callable[[torch.Tensor], object]  # fills a full-size tensor in place (like nn.init.*_)
LinearFactory = Callable[[int, int, bool, str], nn.Module]  # (in_features, out_features, bias, role)

COLUMN_ROLES = ("qkv", "mlp_in")
ROW_ROLES = ("attn_out", "mlp_out")


def mark_tensor_parallel(param: nn.Parameter, partition_dim: int) -> None:
    param.tensor_model_parallel = True  # type: ignore[attr-defined]
    param.partition_dim = partition_dim  # type: ignore[attr-defined]


def is_tensor_parallel(param: torch.Tensor) -> bool:
    return bool(getattr(param, "tensor_model_parallel", False))


# ---- moving between a single-process state dict and TP shards ----
#
# How each role's [out, in] weight (and bias) is split, and why the fused QKV splits by heads.
# transformers' BloomAttention._reshape views the fused output as [b, s, heads, 3, head_dim]: output row
# (h * 3 + j) * head_dim + d is component j (q, k, v) of head h. The rows of one head, q, k and v together,
# are one contiguous block of 3 * head_dim, so cutting the rows into tp contiguous chunks gives rank r the
# whole heads [r * heads/tp, (r+1) * heads/tp), each with its own q, k and v, and the local output views as
# [b, s, heads/tp, 3, head_dim] in exactly the same way. (Megatron's GPT layout [q_all, k_all, v_all] would
# not split this way.) A test checks it against transformers' own _reshape.
_SPLIT_DIM: dict[str, tuple[int | None, int | None]] = {  # role -> (weight dim, bias dim); None: replicated
    "qkv": (0, 0),
    "mlp_in": (0, 0),
    "attn_out": (1, None),
    "mlp_out": (1, None),
    "embedding": (0, None),
    "replicated": (None, None),
}


def split_dim(role: str, *, is_bias: bool = False) -> int | None:
    """The dimension a parameter of ``role`` is split along across TP ranks, or None when replicated."""
    if role not in _SPLIT_DIM:
        raise ValueError(f"unknown tensor-parallel role {role!r}: expected one of {sorted(_SPLIT_DIM)}")
    return _SPLIT_DIM[role][1 if is_bias else 0]


def shard_from_full(
    full: torch.Tensor, role: str, tp_rank: int, tp_size: int, *, is_bias: bool = False
) -> torch.Tensor:
    """Rank ``tp_rank``'s slice of a single-process parameter (a copy; the full tensor when replicated)."""
    dim = split_dim(role, is_bias=is_bias)
    if dim is None:
        return full.detach().clone()
    if full.shape[dim] % tp_size != 0:
        raise ValueError(f"{role}: dimension {dim} of shape {tuple(full.shape)} is not divisible by tp({tp_size})")
    return full.detach().chunk(tp_size, dim=dim)[tp_rank].clone()


def gather_to_full(shards: Sequence[torch.Tensor], role: str, *, is_bias: bool = False) -> torch.Tensor:
    """The single-process parameter from all ranks' shards, in TP rank order (inverse of shard_from_full).

    Replicated parameters must agree exactly across the shards: a difference is drift, never averaged away.
    """
    dim = split_dim(role, is_bias=is_bias)
    if dim is None:
        for rank, shard in enumerate(shards[1:], start=1):
            if not torch.equal(shard, shards[0]):
                raise ValueError(f"{role} parameter differs between tp rank 0 and tp rank {rank}")
        return shards[0].detach().clone()
    return torch.cat([s.detach() for s in shards], dim=dim)


def role_of_parameter(name: str) -> tuple[str, bool]:
    """(role, is_bias) of a parameter from its Hugging Face Bloom name, e.g.
    ``transformer.h.3.self_attention.query_key_value.weight`` -> ("qkv", False)."""
    *path, leaf = name.split(".")
    module = ".".join(path[-2:])
    is_bias = leaf == "bias"
    if path and path[-1] == "query_key_value":
        return "qkv", is_bias
    if module == "self_attention.dense":
        return "attn_out", is_bias
    if path and path[-1] == "dense_h_to_4h":
        return "mlp_in", is_bias
    if path and path[-1] == "dense_4h_to_h":
        return "mlp_out", is_bias
    if path and path[-1] in ("word_embeddings", "lm_head"):
        return "embedding", is_bias
    return "replicated", is_bias


def shard_state_dict(full: Mapping[str, torch.Tensor], tp_rank: int, tp_size: int) -> dict[str, torch.Tensor]:
    """A single-process (Hugging Face-named) state dict cut down to one TP rank's shards."""
    out = {}
    for name, tensor in full.items():
        role, is_bias = role_of_parameter(name)
        out[name] = shard_from_full(tensor, role, tp_rank, tp_size, is_bias=is_bias)
    return out


def gather_state_dicts(shards: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The single-process state dict from every TP rank's state dict, in TP rank order."""
    out = {}
    for name in shards[0]:
        role, is_bias = role_of_parameter(name)
        out[name] = gather_to_full([sd[name] for sd in shards], role, is_bias=is_bias)
    return out


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


class HeadInput(NamedTuple):
    """What the last pipeline stage hands the loss (and scoring): the final hidden states of the whole sequence,
    replicated over TP, and the tied word-embedding shard the logits are taken against. No logits yet."""

    hidden: torch.Tensor  # [batch, seq, hidden]
    weight: torch.Tensor  # [vocab / tp, hidden], this TP rank's rows of the tied embedding


def lm_head_input(
    hidden: torch.Tensor,
    embedding_weight: torch.Tensor,
    group: Group = None,
    *,
    sequence_parallel: bool = False,
    sequence_dim: int = 0,
) -> HeadInput:
    """The tied LM head's input on this rank: with sequence parallelism the sequence chunks are all-gathered.

    The chunked loss all-reduces the hidden gradient over TP itself (each rank's vocabulary shard contributes a
    part), so the gather's backward only keeps this rank's chunk of that full gradient.
    """
    if sequence_parallel:
        hidden = gather_from_sequence_parallel_region(
            hidden, group, dim=sequence_dim, tensor_parallel_output_grad=False
        )
    # A view, not the parameter itself. DeepSpeed's engine (0.19.8, runtime/utils.py register_output_backward_hooks)
    # runs its backward prologue from hooks on the forward's outputs that have a grad_fn; a leaf parameter among the
    # outputs has none, so its gradient can reach the parameter outside that bracket. Measured with the parameter
    # itself: the pp=2 bf16 losses left the fp32 reference from step 2 on (4.5e-2 against a 2.2e-3 bound). The
    # view's gradient reaches the parameter through autograd like any other.
    return HeadInput(hidden, embedding_weight.view_as(embedding_weight))


def _loss_group(group: Group) -> dist.ProcessGroup | None:
    # The chunked loss reads None as "no tensor parallelism"; for the mappings None is the world group.
    if group_size(group) == 1:
        return None
    return group if group is not None else dist.group.WORLD


def vocab_parallel_loss(
    head: HeadInput,
    labels: torch.Tensor,
    group: Group = None,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> torch.Tensor:
    """Cross-entropy of the tied head's logits against labels [batch, seq], chunked over tokens and split over
    the vocabulary (kernels.registry.vocab_cross_entropy): neither the full nor this rank's [tokens, vocab / tp]
    logits are ever formed at once. The same contract as ``F.cross_entropy(full_logits.view(-1, V),
    labels.view(-1), reduction=...)``, in fp32, except that a mean over no token is 0, not NaN."""
    if head.hidden.shape[:-1] != labels.shape:
        raise ValueError(f"hidden states {tuple(head.hidden.shape)} and labels {tuple(labels.shape)} do not match")
    return ops.vocab_cross_entropy(
        head.hidden, head.weight, labels, ignore_index=ignore_index, reduction=reduction, tp_group=_loss_group(group)
    )


def vocab_parallel_scores(
    head: HeadInput, targets: torch.Tensor | None, group: Group = None
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(log p(targets) or None, greedy token) per position of the head's hidden states, over the whole vocabulary
    (ops.vocab_scores; the same on every TP rank)."""
    return ops.vocab_scores(head.hidden, head.weight, targets, tp_group=_loss_group(group))


def tp_linear_factory(
    topology: ParallelTopology, *, sequence_parallel: bool = False, sequence_dim: int = 0
) -> LinearFactory:
    """The model's linear-layer injection point: ``BloomForCausalLM(config, linear_factory=...)``.

    qkv and mlp_in become column-parallel (outputs stay split: each rank runs its own heads / GeLU slice),
    attn_out and mlp_out row-parallel (inputs arrive split). With tp=1 it returns the single-device layers
    (``model.bloom.default_linear_factory``). At every tp, mlp_in, attn_out and mlp_out skip their bias add
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
