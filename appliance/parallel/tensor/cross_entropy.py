"""The tied LM head's input and the ONE vocabulary-parallel loss and scores.

The loss never forms logits: the last stage hands the final hidden states and its tied-embedding shard
(``HeadInput``) to one chunked vocabulary-parallel cross-entropy (kernels/, through ops.vocab_cross_entropy), which
evaluation scoring shares (``vocab_parallel_scores``, through ops.vocab_scores).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from appliance.model import ops
from appliance.parallel.tensor.mappings import Group, gather_from_sequence_parallel_region, group_size


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
    the vocabulary (kernels.registry.vocab_cross_entropy): the full logits are never formed, and this rank's
    [tokens, vocab / tp] only one chunk at a time (on a GPU the whole micro-batch when its logits fit 2 GiB, which
    the loss then overwrites with their gradient; kernels.chunked_ce.auto_chunk_size). The same contract as
    ``F.cross_entropy(full_logits.view(-1, V), labels.view(-1), reduction=...)``, in fp32, except that a mean over
    no token is 0, not NaN. Training's mean reads nothing back to the host."""
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
