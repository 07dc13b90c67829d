"""Moving between a single-process (Hugging Face-named) state dict and tensor-parallel shards.

Each parameter has a role (``role_of_parameter``: qkv, attn_out, mlp_in, mlp_out, embedding, replicated) and each
role one split dimension for its weight and one for its bias (``split_dim``); ``shard_from_full`` and
``gather_to_full`` cut and rejoin along it. Checkpoints (shards.py), the layers' init-from-full (layers.py) and
the tests all go through these, so a split is defined in one place.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

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
    if ".mlp.experts." in name or name.endswith(".mlp.gate.weight"):
        return "replicated", is_bias  # BLOOM-MoE: experts and gates are whole on every TP rank (docs/MOE.md)
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
