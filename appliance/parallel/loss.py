"""The training and evaluation loss of every layout: the vocabulary-parallel cross-entropy against the tied embedding
shard (tensor/cross_entropy.py), combined with context parallelism's token weighting (context/training.py), the 2D
mesh's per-row share (tensor2d/layers2d.py) and BLOOM-MoE's load-balancing loss. The pipeline's last stage and the
pp = 1 stack (pipeline/stack.py) both end in it.
"""

from __future__ import annotations

import torch

from appliance.parallel.context.training import token_weighted_loss
from appliance.parallel.tensor.cross_entropy import HeadInput, vocab_parallel_loss
from appliance.parallel.tensor.mappings import Group, group_size
from appliance.parallel.tensor2d.layers2d import Mesh2D, loss_2d

IGNORE_INDEX = -100  # labels that count no loss (vocab_parallel_loss's default)


class VocabParallelLoss:
    """loss_fn(HeadInput, labels): mean token cross-entropy for training; ``reduction = "sum"`` for evaluation
    (a padded evaluation micro-batch may hold no token at all). Chunked and vocabulary-parallel
    (cross_entropy.vocab_parallel_loss): the logits are computed chunk by chunk against the tied embedding
    shard, whose gradient comes out of the same pass. With context parallelism (a ``cp_group`` of more than one
    rank) the training loss is this rank's token-weighted share of the micro-batch mean
    (context.training.token_weighted_loss); the evaluation sum is its slice's sum."""

    def __init__(
        self,
        tp_group: Group,
        cp_group: Group | None = None,
        mesh: Mesh2D | None = None,
        moe_aux_loss_coef: float = 0.0,
    ) -> None:
        self.tp_group, self.cp_group = tp_group, cp_group
        self.mesh = mesh  # tp2d: this mesh row's share of the micro-batch (layers2d.loss_2d)
        self.reduction = "mean"
        self.inject_nan = False  # a recovery drill's non-finite loss (appliance/train/faults.py)
        self.moe_aux_loss_coef = moe_aux_loss_coef
        # BLOOM-MoE, per training micro-batch since the engine last read them: the language-model loss and the
        # summed (unweighted) MoE load-balancing loss, detached.
        self.lm_losses: list[torch.Tensor] = []
        self.aux_losses: list[torch.Tensor] = []

    def __call__(self, head: HeadInput | tuple[HeadInput, torch.Tensor], labels: torch.Tensor) -> torch.Tensor:
        aux = None
        if not isinstance(head, HeadInput):
            head, aux = head  # an MoE model's training output: (HeadInput, the travelling MoE loss)
        loss = self._lm_loss(head, labels)
        if aux is not None:
            self.lm_losses.append(loss.detach())
            self.aux_losses.append(aux.detach().sum())
            loss = loss + self.moe_aux_loss_coef * aux.sum().to(loss.dtype)
        return loss

    def _lm_loss(self, head: HeadInput, labels: torch.Tensor) -> torch.Tensor:
        if self.mesh is not None:
            loss = loss_2d(head, labels, self.mesh, ignore_index=IGNORE_INDEX, reduction=self.reduction)
        elif self.reduction == "mean" and self.cp_group is not None and group_size(self.cp_group) > 1:
            loss_sum = vocab_parallel_loss(head, labels, self.tp_group, reduction="sum")
            loss = token_weighted_loss(loss_sum, labels, self.cp_group, IGNORE_INDEX)
        else:
            loss = vocab_parallel_loss(head, labels, self.tp_group, reduction=self.reduction)
        return loss * float("nan") if self.inject_nan else loss
