"""ALiBi (Press et al. 2021) as BLOOM uses it: a per-head linear penalty on key distance, no position embeddings.

BLOOM adds `slope[h] * position(key)` to every attention score. Because softmax is shift-invariant along the key
axis, this equals the paper's `-slope * (query - key)` on the causal part, and it needs no [query, key] tensor:
the bias has shape [batch, heads, 1, keys] and broadcasts over queries.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch


@lru_cache(maxsize=64)
def _slopes(n_head: int) -> tuple[float, ...]:
    # For a power of two n, the slopes are the geometric sequence r, r^2, ..., r^n with r = 2^(-8/n)
    # (n=8: 1/2, 1/4, ..., 1/256). Written as BLOOM writes it: base = 2^(-(2^-(log2(n) - 3))) = 2^(-8/n).
    # The powers are taken in float32 from a float32 base, as BLOOM does, so the slopes agree to the bit.
    # On the CPU by name: models are built under torch.device("meta"), which would otherwise capture these tensors.
    cpu = torch.device("cpu")
    closest = 2 ** math.floor(math.log2(n_head))
    base = torch.tensor(2.0 ** (-(2.0 ** -(math.log2(closest) - 3))), dtype=torch.float32, device=cpu)
    slopes = torch.pow(base, torch.arange(1, closest + 1, dtype=torch.int32, device=cpu))
    if closest != n_head:
        # The remaining heads take every other slope of the sequence for 2*closest heads (odd powers of its
        # ratio), so they fall between the ones already used: 12 heads = the 8-head slopes + 4 of the 16-head ones.
        extra_base = torch.tensor(2.0 ** (-(2.0 ** -(math.log2(2 * closest) - 3))), dtype=torch.float32, device=cpu)
        n_extra = min(closest, n_head - closest)
        extra = torch.pow(extra_base, torch.arange(1, 1 + 2 * n_extra, 2, dtype=torch.int32, device=cpu))
        slopes = torch.cat([slopes, extra])
    return tuple(slopes.tolist())


# A constant to torch.compile: traced, _slopes's .tolist() would end the graph, and the tuple is fixed per head count.
@torch.compiler.assume_constant_result
def _slope_values(n_head: int) -> tuple[float, ...]:
    return _slopes(n_head)


def alibi_slopes(n_head: int) -> torch.Tensor:
    """Per-head ALiBi slopes, float32 [n_head], on CPU, for any head count (BLOOM's rule)."""
    if isinstance(n_head, bool) or not isinstance(n_head, int) or n_head <= 0:
        raise ValueError(f"n_head must be a positive integer (got {n_head!r})")
    return torch.tensor(_slope_values(n_head), dtype=torch.float32, device="cpu")


def alibi_slopes_for_rank(n_head: int, tp_rank: int, tp_size: int) -> torch.Tensor:
    """The slopes of the heads a tensor-parallel rank owns: heads are split into tp_size contiguous blocks."""
    if tp_size <= 0 or not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank({tp_rank}) must be in [0, tp_size({tp_size}))")
    if n_head % tp_size != 0:
        raise ValueError(f"n_head({n_head}) % tp_size({tp_size}) = {n_head % tp_size}, must be 0")
    per_rank = n_head // tp_size
    return alibi_slopes(n_head)[tp_rank * per_rank : (tp_rank + 1) * per_rank]


def key_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position of each key counting only real tokens: [batch, keys] int64, 0 at the first real token, 0 on padding.

    attention_mask: [batch, keys], 1 for a real token and 0 for padding. With left padding the first real token is
    position 0, as if the padding were not there.
    """
    mask = attention_mask.to(torch.int64)
    return (mask.cumsum(dim=-1) - 1) * mask


def alibi_bias(
    slopes: torch.Tensor, attention_mask: torch.Tensor | None, key_length: int | None = None
) -> torch.Tensor:
    """The ALiBi bias, float32 [batch, heads, 1, keys] (batch is 1 without a mask), on the slopes' device.

    slopes: [heads] (all heads, or one tensor-parallel rank's). attention_mask: [batch, keys] of 0/1, or None for
    an unpadded batch, in which case key_length gives the number of keys and positions are 0..keys-1.
    """
    slopes = slopes.to(torch.float32)
    if attention_mask is None:
        if key_length is None:
            raise ValueError("alibi_bias needs attention_mask or key_length")
        positions = torch.arange(key_length, device=slopes.device, dtype=torch.float32)[None, :]
    else:
        positions = key_positions(attention_mask.to(slopes.device)).to(torch.float32)
    return slopes[None, :, None, None] * positions[:, None, None, :]


@lru_cache(maxsize=16)
def _unpadded_inputs(
    n_head: int, tp_rank: int, tp_size: int, seq_len: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    slopes = alibi_slopes_for_rank(n_head, tp_rank, tp_size).to(device)
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()[None, None]
    return alibi_bias(slopes, None, seq_len), causal


class RankAlibi:
    """ALiBi for the heads one tensor-parallel rank owns: the slopes (all the fused flash attention needs), and the
    bias and causal mask (with padding and packed documents where given) that only the materialized attention path
    needs, built when it asks.

    An unpadded batch's bias [1, H, 1, S] and mask [1, 1, S, S] depend only on (heads, rank, length, device), so
    they are built once and shared by every block and step (a small LRU cache: evaluation and generation bring a
    few lengths). A padded batch's depend on its mask and are built per call. Not a module and not buffers: the
    slopes stay out of the state_dict and out of .to(dtype) (bf16 slopes would shift every ALiBi bias).
    """

    def __init__(self, n_head: int, tp_rank: int = 0, tp_size: int = 1) -> None:
        self.n_head, self.tp_rank, self.tp_size = n_head, tp_rank, tp_size
        self._slopes = {torch.device("cpu"): alibi_slopes_for_rank(n_head, tp_rank, tp_size)}

    def slopes(self, device: torch.device) -> torch.Tensor:
        """This rank's slopes, float32 [H], on device (copied there once)."""
        if device not in self._slopes:
            self._slopes[device] = self._slopes[torch.device("cpu")].to(device)
        return self._slopes[device]

    def bias_and_mask(
        self,
        attention_mask: torch.Tensor | None,
        seq_len: int,
        device: torch.device,
        doc_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """ALiBi bias [B or 1, H, 1, S] (float32) and the causal, padding and document mask [B or 1, 1, S, S]
        (bool). doc_ids: int [B, S], the document of each token (appliance/data/documents.py), or None: with it a
        query sees only the keys of its own document.

        The bias needs no change for packed documents. It is `slope * position(key)`, and every key a query may see
        is then in its document, which starts at some position p: `slope * (p + j)` for the document's j-th token
        is `slope * j` plus `slope * p`, the same for the whole row, and softmax drops a constant added to a row. So
        each document gets the ALiBi distances it would get alone (tests/unit/test_packed_documents.py runs each
        document alone and compares).
        """
        if attention_mask is not None and attention_mask.shape[-1] != seq_len:
            raise ValueError(f"attention_mask covers {attention_mask.shape[-1]} positions, the input {seq_len}")
        if doc_ids is not None and doc_ids.shape[-1] != seq_len:
            raise ValueError(f"doc_ids cover {doc_ids.shape[-1]} positions, the input {seq_len}")
        if attention_mask is None:
            bias, mask = _unpadded_inputs(self.n_head, self.tp_rank, self.tp_size, seq_len, device)
        else:
            attention_mask = attention_mask.to(device)
            causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()[None, None]
            bias = alibi_bias(self.slopes(device), attention_mask, seq_len)
            mask = causal & attention_mask.bool()[:, None, None, :]
        if doc_ids is not None:
            mask = mask & same_document(doc_ids.to(device))
        return bias, mask


def same_document(doc_ids: torch.Tensor) -> torch.Tensor:
    """[B, S] document ids -> bool [B, 1, S, S], True where query and key belong to the same document."""
    return (doc_ids[:, :, None] == doc_ids[:, None, :])[:, None]
