"""Moving between a single-process (Hugging Face-named) state dict and tensor-parallel shards.

Each parameter has a role (``role_of_parameter``: qkv, attn_out, mlp_in, mlp_out, embedding, replicated) and each
role one split dimension for its weight and one for its bias (``split_dim``); ``shard_from_full`` and
``gather_to_full`` cut and rejoin along it. Checkpoints (checkpoint/weight_shards.py), the layers' init-from-full
(tensor/layers.py) and the tests all go through these, so a split is defined in one place.
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
    if name.endswith(".mlp.gate.weight"):
        return "replicated", is_bias  # BLOOM-MoE: the gate is whole on every TP rank; experts split as the MLP's
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


# ---- 2D tensor parallel (tp2d = q, parallel/tensor2d/summa.py) -------------------------------------------------------
#
# On a q x q mesh rank (row r, column c) holds, whatever the role:
#   a matrix [dim0, dim1] (a linear's [out, in], the embedding's [vocab, hidden]): block [dim0 slice c, dim1 slice r]
#   a vector [n] (biases, LayerNorm weights and biases): slice c, the same on every row of the mesh
# The linears' block is SUMMA's W(r, c) = W[out slice c, in slice r]; the embedding's makes the tied head's product
# (hidden @ E^T, E^T block [hidden slice r, vocab slice c]) one of the same shape. Cutting the fused QKV's output
# rows into q slices gives each column whole heads, exactly as in 1D (see above). Rejoined vectors must agree
# exactly across the rows; a difference is drift, as for replicated parameters in 1D.


def shard_from_full_2d(full: torch.Tensor, row: int, col: int, q: int) -> torch.Tensor:
    """Mesh rank (``row``, ``col``)'s block of a single-process parameter (a copy)."""
    if not (0 <= row < q and 0 <= col < q):
        raise ValueError(f"mesh position ({row}, {col}) is outside a {q} x {q} mesh")
    if full.dim() not in (1, 2) or any(size % q for size in full.shape):
        raise ValueError(
            f"tp2d({q}) cannot cut a parameter of shape {tuple(full.shape)}: every dimension % q must be 0"
        )
    block = full.detach().chunk(q, dim=0)[col]
    if full.dim() == 2:
        block = block.chunk(q, dim=1)[row]
    return block.clone()


def gather_to_full_2d(blocks: Sequence[Sequence[torch.Tensor]]) -> torch.Tensor:
    """The single-process parameter from ``blocks[row][col]`` of every mesh rank (inverse of shard_from_full_2d)."""
    q = len(blocks)
    if any(len(row) != q for row in blocks):
        raise ValueError(f"a 2D mesh needs q x q blocks, got rows of {[len(row) for row in blocks]}")
    if blocks[0][0].dim() == 1:
        for row in range(1, q):
            for col in range(q):
                if not torch.equal(blocks[row][col], blocks[0][col]):
                    raise ValueError(f"vector slice {col} differs between mesh row 0 and mesh row {row}")
        return torch.cat([b.detach() for b in blocks[0]], dim=0)
    columns = [torch.cat([blocks[row][col].detach() for row in range(q)], dim=1) for col in range(q)]
    return torch.cat(columns, dim=0)


def shard_state_dict_2d(full: Mapping[str, torch.Tensor], row: int, col: int, q: int) -> dict[str, torch.Tensor]:
    """A single-process state dict cut down to mesh rank (``row``, ``col``)'s blocks."""
    return {name: shard_from_full_2d(tensor, row, col, q) for name, tensor in full.items()}


def gather_state_dicts_2d(shards: Sequence[Mapping[str, torch.Tensor]], q: int) -> dict[str, torch.Tensor]:
    """The single-process state dict from the q * q mesh ranks' state dicts, in tp rank order (row * q + col)."""
    if len(shards) != q * q:
        raise ValueError(f"tp2d({q}) needs {q * q} state dicts, got {len(shards)}")
    return {
        name: gather_to_full_2d([[shards[row * q + col][name] for col in range(q)] for row in range(q)])
        for name in shards[0]
    }
