"""A rank's evaluations in the training loop: every eval_interval steps and at the end, the figures the same as one
process evaluating everything (train/trainer.py's Trainer is made of this part, the checkpoints and the loop)."""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from appliance.data.blend import SampleSource
from appliance.parallel.loss import IGNORE_INDEX
from appliance.parallel.step.engine import ParallelEngine
from appliance.train.budget_watch import BudgetWatch
from appliance.train.settings import TrainSettings
from appliance.train.trainer_checkpoints import Position
from appliance.train.validation import SourceSums, Validation, label_bytes


class TrainerEvaluation:
    """The Trainer's evaluations: validation loss and bits per byte per source, spread over the DP ranks, and their
    events. A part of Trainer (train/trainer.py), whose __init__ sets the attributes below."""

    engine: ParallelEngine
    s: TrainSettings
    valid_data: Mapping[str, SampleSource]
    token_bytes: torch.Tensor | None
    rank: int
    dp_rank: int
    dp_size: int
    budget: BudgetWatch | None
    pos: Position
    first_valid_loss: float | None
    last_eval: tuple[int, Validation] | None

    if TYPE_CHECKING:  # Trainer's own (train/trainer.py)

        def _all_reduce(self, values: list[float], op: Any = None) -> list[float]: ...

        def to_batch(self, source: SampleSource, indices: Sequence[int]) -> tuple[torch.Tensor, ...]: ...

        def _emit(self, kind: str, **fields: Any) -> None: ...

    @torch.no_grad()
    def evaluate(self) -> Validation:
        """Mean next-token loss and bits per byte per validation set. Each DP rank takes every dp_size-th sample;
        sums are all-reduced, so the figures are the same as one process evaluating everything."""
        names = sorted(self.valid_data)
        mbs = self.s.micro_batch_size
        # The bytes of a DP rank's samples are counted on one of its ranks (the others count none).
        byte_lengths = self.token_bytes if self.token_bytes is not None and self._first_rank_of_dp_rank() else None
        sums: list[float] = []
        for name in names:
            data = self.valid_data[name]
            count = min(len(data), self.s.eval_samples)
            mine = list(range(self.dp_rank, count, self.dp_size))
            # Every rank runs the same number of full micro-batches (ceil(count / dp_size) samples, rounded up to
            # micro-batches): the extra rows repeat sample 0 with their labels ignored. Collectives inside a
            # forward (tensor-parallel all-reduces, pipeline sends, ZeRO-3 gathers) then always pair up.
            per_rank = math.ceil(count / self.dp_size)
            rows = math.ceil(per_rank / mbs) * mbs
            padded = mine + [0] * (rows - len(mine))
            micro_batches = []
            text_bytes = 0
            for i in range(0, rows, mbs):
                inputs, labels, *doc_ids = self.to_batch(data, padded[i : i + mbs])
                labels = labels.clone()  # a one-sample batch's labels are a view of its inputs
                labels[max(0, len(mine) - i) :] = IGNORE_INDEX
                micro_batches.append((inputs, labels, *doc_ids))
                if byte_lengths is not None:
                    text_bytes += label_bytes(labels, byte_lengths)
            loss_nats, tokens = self.engine.eval_sums(micro_batches)
            sums += SourceSums(loss_nats, tokens, float(text_bytes)).as_list()
        # One reduction for every figure: the byte counts ride with the loss sums and token counts.
        return Validation.from_reduced(names, self._all_reduce(sums))

    def _first_rank_of_dp_rank(self) -> bool:
        """Whether this rank counts its DP rank's bytes: every rank of a DP rank (its tp, pp and cp ranks) sees the
        same whole samples, and one of them, at tp = pp = cp = 0, counts them once."""
        return self.engine.topology.rank_with(self.rank, tp=0, pp=0, cp=0) == self.rank

    def _timed_evaluate(self) -> Validation:
        started = time.time()
        validation = self.evaluate()
        if self.budget is not None:
            self.budget.observe_eval(time.time() - started)
        return validation

    # ---- checkpoints -------------------------------------------------------------------------------------
    def evaluation_at_current_step(self) -> Validation:
        """The newest evaluation if it was taken at this step (the last training step evaluates), else a new one."""
        if self.last_eval is not None and self.last_eval[0] == self.pos.step:
            return self.last_eval[1]
        return self.evaluate()

    def _record_eval(self, validation: Validation) -> None:
        self.last_eval = (self.pos.step, validation)
        loss = validation.overall_loss
        if self.first_valid_loss is None:
            self.first_valid_loss = loss
        bits_per_byte: dict[str, Any] = {}
        if validation.overall_bits_per_byte is not None:
            bits_per_byte = {
                "valid_bits_per_byte": validation.overall_bits_per_byte,
                "per_source_bits_per_byte": validation.per_source_bits_per_byte(),
            }
        self._emit(
            "eval",
            step=self.pos.step,
            consumed_samples=self.pos.consumed_samples,
            valid_loss=loss,
            valid_ppl=math.exp(min(loss, 50.0)),
            per_source=validation.per_source_loss(),
            **bits_per_byte,
        )
