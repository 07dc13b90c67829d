"""Context parallelism (cp) in the training path: which tokens a CP rank keeps, its attention core, and its loss.

The cp ranks of one data-parallel rank take the same sequences (the sampler deals samples by the dp coordinate
only) and each keeps its own ``sequence_chunks`` of every one (``local_batch``: ulysses a contiguous slice, ring
the zigzag pieces r and 2cp-1-r; context.attention.split_sequence says which). The labels are cut the same way: they
were shifted by one token before the split (trainer.to_batch), so every kept position still predicts its own next
token, even the last one of a slice. ALiBi is relative, so no position ids travel: the attention core
(context.attention.context_parallel_attention) knows the global positions from (seq_len, cp, cp_rank, mode).

The loss (arithmetic). The mean over the micro-batch's tokens is sum_r L_r / sum_r n_r over the cp ranks r (L_r:
the summed token losses of rank r's slice, n_r its counted tokens). DeepSpeed averages gradients over dp x cp, i.e.
divides the sum over the cp ranks by cp, so each rank's loss is

    loss_r = L_r * cp / N,   N = sum_r n_r  (an all-reduce of counts over the cp group, no gradient)

and (1/cp) * sum_r loss_r = sum_r L_r / N, the single-process mean; DP on top averages micro-batch means as it
does at cp = 1. Slices with different token counts (ignored labels) are weighted by their tokens, not equally.

Scoring and generation (parallel/step/scoring.py) run whole sequences on every CP rank with the context-parallel core
switched off (``whole_sequences``): the weights are identical across cp, scoring batches are short and uneven
(generation grows one token at a time, which no fixed cut divides), and each CP rank then holds every answer
without gathering logits or hidden states over cp; the price is that cp ranks repeat each other's scoring work.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn

from appliance.parallel.context.attention import context_parallel_attention, split_sequence
from appliance.parallel.tensor.mappings import Group, collective_device, group_size

# (input ids, labels), each [micro_batch, seq], and under reset_attention_mask the inputs' document ids third.
Batch = tuple[torch.Tensor, ...]


def local_batch(batch: Batch, cp: int, cp_rank: int, mode: str) -> Batch:
    """This CP rank's tokens of a whole-sequence micro-batch (the identity at cp = 1). Document ids were counted
    over the whole sequence (trainer.to_batch_with_documents) and are cut like the tokens they belong to."""
    if cp == 1:
        return batch
    return tuple(split_sequence(t, cp, cp_rank, mode) for t in batch)


class ContextParallelCore:
    """A BloomAttention core over a sequence split across the ``group``'s ranks: (q, k, v [B, H, S/cp, D], this TP
    rank's ALiBi slopes [H], scale[, doc_ids [B, S/cp] of packed documents]) -> context [B, H, S/cp, D]. Set on each
    block by parallelize.py."""

    def __init__(self, group: Group, mode: str) -> None:
        self.group, self.mode = group, mode
        self.cp = group_size(group)

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        slopes: torch.Tensor,
        scale: float,
        doc_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return context_parallel_attention(
            q, k, v, slopes, scale, group=self.group, mode=self.mode, seq_len=q.shape[2] * self.cp, doc_ids=doc_ids
        )

    def __repr__(self) -> str:
        return f"ContextParallelCore(cp={self.cp}, mode={self.mode!r})"


def token_weighted_loss(loss_sum: torch.Tensor, labels: torch.Tensor, group: Group, ignore_index: int) -> torch.Tensor:
    """This CP rank's share of the micro-batch mean: loss_sum * cp / (tokens over the cp group); see the module
    docstring. At cp = 1 it is the plain mean (0 for no token, like the chunked loss's mean)."""
    cp = group_size(group)
    tokens = (labels != ignore_index).sum().to(device=collective_device(group), dtype=torch.float64)
    if cp > 1:
        dist.all_reduce(tokens, group=group)
    return loss_sum * (cp / max(float(tokens), 1.0))


@contextmanager
def whole_sequences(module: nn.Module) -> Iterator[None]:
    """Run ``module``'s attention on whole sequences inside the block (every CP rank alone, as at cp = 1): for
    scoring, see the module docstring."""
    from appliance.model.bloom import BloomAttention

    attentions = [m for m in module.modules() if isinstance(m, BloomAttention) and m.context_parallel is not None]
    saved = [m.context_parallel for m in attentions]
    for m in attentions:
        m.context_parallel = None
    try:
        yield
    finally:
        for m, core in zip(attentions, saved, strict=True):
            m.context_parallel = core
