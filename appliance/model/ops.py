"""The numerically hot operations of the BLOOM model, one thin function each.

The model calls only these for LayerNorm, bias+GeLU, bias+dropout+residual, the attention and the loss,
so a fused kernel can replace any one of them without touching model code. Each function is tensor-in tensor-out
with the shapes written in its docstring; the bodies here are the pure-torch definitions the kernels are tested
against.

Shape letters: B batch, H heads (of this tensor-parallel rank), Q query positions, K key positions, D head width,
V vocabulary (of this rank), N any number of leading dimensions.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from kernels import registry as fused  # Triton kernels on GPU tensors, their torch twins on CPU (BLOOM_KERNELS)

# sqrt(2 / pi), written as BLOOM (Megatron-DeepSpeed) writes it; transformers uses the same literal.
_SQRT_2_OVER_PI = 0.79788456
_GELU_CUBIC = 0.044715


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm over the last dimension, fp32 statistics. x: [N..., C]; weight, bias: [C]. Returns x's shape and
    dtype."""
    return fused.layer_norm(x, weight, bias, eps)


def bias_gelu(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """GeLU (tanh approximation, as BLOOM) of x + bias. x: [N..., C]; bias: [C] or None. Returns x's shape."""
    if bias is not None and fused.backend_for("bias_gelu", x) != "reference":
        return fused.bias_gelu(x, bias)  # Triton: one pass over memory instead of five (or the backend use() chose)
    if bias is not None:
        x = x + bias
    return 0.5 * x * (1.0 + torch.tanh(_SQRT_2_OVER_PI * x * (1.0 + _GELU_CUBIC * x * x)))


def bias_dropout_add(
    x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor, p: float, training: bool
) -> torch.Tensor:
    """residual + dropout(x + bias): the end of each BLOOM sub-layer. x, residual: [N..., C]; bias: [C] or None.

    The sum stays in x's dtype, as BLOOM keeps its residual stream in the compute dtype.
    """
    if bias is not None:
        x = x + bias
    if training and p > 0:  # BLOOM trained without dropout: no copy and no mask for a no-op
        x = F.dropout(x, p=p, training=True)
    return residual + x


def attention_probs(
    scores: torch.Tensor, alibi: torch.Tensor, mask: torch.Tensor | None, inv_norm_factor: float
) -> torch.Tensor:
    """softmax(scores * inv_norm_factor + alibi, masked) over keys, computed in float32 (float64 for float64
    scores) and cast back.

    scores: [B, H, Q, K], the raw q.k products in the compute dtype.
    alibi: [B or 1, H, 1, K], float32 (see alibi.alibi_bias).
    mask: [B or 1, 1 or H, Q, K] bool, True where the query may attend to the key; None attends everywhere.
    Returns [B, H, Q, K] in scores' dtype. A fully masked row (a padding query) gets a uniform distribution
    instead of NaN: masked scores are set to float32's lowest finite value, as transformers does.
    """
    # One fused pass, alibi + factor * scores, promoted to float32 (transformers fuses the same sum into baddbmm);
    # the mask then writes into that fresh tensor in place.
    # float64 inputs (reference computations) keep float64; every other dtype goes through float32.
    softmax_dtype = torch.promote_types(torch.float32, scores.dtype)
    logits = torch.add(alibi.to(softmax_dtype), scores.to(softmax_dtype), alpha=inv_norm_factor)
    if mask is not None:
        logits.masked_fill_(~mask, torch.finfo(softmax_dtype).min)
    return torch.softmax(logits, dim=-1).to(scores.dtype)


def attention_core(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    alibi: torch.Tensor,
    mask: torch.Tensor | None,
    inv_norm_factor: float,
    dropout_p: float = 0.0,
    training: bool = False,
) -> torch.Tensor:
    """Scaled dot-product attention with ALiBi and BLOOM's float32 softmax.

    q: [B, H, Q, D]; k, v: [B, H, K, D]; alibi, mask as in attention_probs. Returns the context [B, H, Q, D] in
    q's dtype. The two matmuls run in the compute dtype; only the softmax path is float32.
    """
    scores = torch.matmul(q, k.transpose(-1, -2))
    probs = attention_probs(scores, alibi, mask, inv_norm_factor)
    if training and dropout_p > 0:
        probs = F.dropout(probs, p=dropout_p, training=True)
    return torch.matmul(probs, v)


# The backends of flash_alibi_attention that never materialize [S, S] scores.
FLASH_BACKENDS = ("triton", "sdpa", "flex")


def flash_attention_available(q: torch.Tensor) -> bool:
    """Whether a fused causal ALiBi attention runs for q (Triton's flash kernel or a peer the registry chose, head
    dims up to 128)."""
    return fused.backend_for("flash_alibi_attention", q) in FLASH_BACKENDS and q.shape[-1] <= 128


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slopes: torch.Tensor,
    inv_norm_factor: float,
    doc_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention with ALiBi slopes [H] and no padding, fused: the same result as attention_core with a
    causal mask and alibi_bias(slopes, None), in O(S) memory. q, k, v: [B, H, S, D]; returns [B, H, S, D].

    doc_ids: optional integer [B, S], the document of each token when several are packed in one sequence: a query
    then sees only the keys of its own document (ALiBi is relative, so positions need no reset)."""
    return fused.flash_alibi_attention(
        q, k, v, slopes, causal=True, scale=inv_norm_factor, q_doc=doc_ids, k_doc=doc_ids
    )  # type: ignore[return-value]


# Blocked attention's budget: one block of query rows holds at most this many (query, key) scores per head, 2^23 x
# 4 bytes = 32 MiB fp32 per head and tensor (e.g. 512 queries against 16384 keys). The materialized core holds about
# five [H, S, S] tensors at its peak: at S = 16384 and 4 heads, 20 GiB; in blocks, about five [H, 512, S], 640 MiB.
BLOCK_SCORES_PER_HEAD = 2**23


def blocked_attention_pays(q: torch.Tensor) -> bool:
    """Whether a causal self-attention over q [B, H, S, D] has more scores per head than one block holds."""
    return q.shape[2] * q.shape[2] > BLOCK_SCORES_PER_HEAD


def blocked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slopes: torch.Tensor,
    inv_norm_factor: float,
    doc_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """flash_attention's result (causal, ALiBi slopes [H], no padding; q, k, v [B, H, S, D]) without the fused
    kernel and without [S, S] tensors: blocks of query rows, each against the keys up to its last query (the rest
    are masked anyway), through the kernel registry's flash_alibi_attention (on CPU its materialized twin, with the
    relative bias slope * (k_pos - q_pos), softmax-equal to BLOOM's slope * k_pos). Each block runs under activation
    checkpointing, so the backward keeps only q, k, v and recomputes one block's scores at a time."""
    seq = q.shape[2]
    rows = max(1, BLOCK_SCORES_PER_HEAD // seq)
    blocks: list[torch.Tensor] = []
    for start in range(0, seq, rows):
        end = min(start + rows, seq)
        block = functools.partial(
            fused.flash_alibi_attention,
            causal=True,
            scale=inv_norm_factor,
            q_offset=start,
            k_offset=0,
            q_doc=None if doc_ids is None else doc_ids[:, start:end],
            k_doc=None if doc_ids is None else doc_ids[:, :end],
        )
        inputs = (q[:, :, start:end], k[:, :, :end], v[:, :, :end], slopes)
        out = checkpoint(block, *inputs, use_reentrant=False) if torch.is_grad_enabled() else block(*inputs)
        blocks.append(out)  # type: ignore[arg-type]  # a tensor: no return_lse
    return torch.cat(blocks, dim=2)


def vocab_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    tp_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Token cross-entropy of the logits hidden @ weight^T, float32, computed in chunks of tokens so the full
    [N..., V] logits never exist. hidden: [N..., C]; weight: [V, C] (with tp_group, this rank's vocabulary shard
    [V / tp, C], hidden replicated over the group); labels: [N...] aligned with hidden, global token ids.

    reduction "mean" averages over the labels that are not ignore_index (0 when all are), "sum" adds them, "none"
    returns [N...] with 0 at ignored positions (evaluation: no gradient). With tp_group the hidden gradient is
    already summed over the group.
    """
    return fused.vocab_cross_entropy(
        hidden, weight, labels, ignore_index=ignore_index, tp_group=tp_group, reduction=reduction
    )


def vocab_scores(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor | None,
    *,
    tp_group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """What evaluation reads from the same chunked logits: (log p(targets) [N...] float32, or None when targets is
    None; greedy token [N...] int64, the lowest id of the largest logit). Shapes and tp_group as
    vocab_cross_entropy; no gradient."""
    return fused.vocab_scores(hidden, weight, targets, tp_group=tp_group)


def cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100, reduction: str = "mean"
) -> torch.Tensor:
    """Token cross-entropy in float32 of logits already formed (another model's, or a test's reference). logits:
    [N..., V]; labels: [N...] (already aligned with logits, no shift). Our model's loss is vocab_cross_entropy.

    reduction "mean" averages over the labels that are not ignore_index (NaN when all are ignored), "sum" adds
    them, "none" returns [N...] with 0 at ignored positions. The result is float32 whatever the logits' dtype.
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none' (got {reduction!r})")
    flat = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).to(torch.float32),
        labels.reshape(-1),
        ignore_index=ignore_index,
        reduction=reduction,
    )
    return flat.reshape(labels.shape) if reduction == "none" else flat
