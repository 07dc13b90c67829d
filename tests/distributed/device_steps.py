"""What the tests of the steps that keep their verdicts on the device share (test_zero_device_step.py,
test_fp16_device_step.py): the batches a rank trains on, the same samples as one-sample micro-batches (the noise
floor: the same step with its sums over samples in another order), and a copy of what a step changes."""

from __future__ import annotations

from typing import Any

import torch

Batches = list[tuple[torch.Tensor, ...]]


def random_micro_batches(vocab_size: int, *, rank: int, step: int, mbs: int, seq: int, count: int) -> Batches:
    """`count` micro-batches of `mbs` samples of `seq` tokens, the same for a (rank, step) in every run."""
    generator = torch.Generator().manual_seed(1000 * step + rank)
    tokens = [torch.randint(0, vocab_size, (mbs, seq + 1), generator=generator) for _ in range(count)]
    return [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens]


def one_sample_each(micro_batches: Batches) -> Batches:
    """The same samples as one-sample micro-batches."""
    return [tuple(t[i : i + 1] for t in batch) for batch in micro_batches for i in range(len(batch[0]))]


def engine_snapshot(engine: Any) -> dict[str, dict[str, torch.Tensor]]:
    """The weights (Hugging Face names, fp32) and the optimizer state, copied."""
    return {
        "weights": {n: p.detach().float().clone() for n, p in engine.named_parameters()},
        "state": {k: v.detach().clone() for k, v in engine.optimizer_state().items()},
    }
