"""Learning-rate and batch-size schedules, counted in samples as BLOOM counted them.

Counting samples instead of steps means a run keeps its schedule when the layout changes (different DP size or
micro-batch) or when the batch size ramps up: step N is not a fixed point in the schedule, consumed samples are.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class LRSchedule:
    """Linear warmup to `lr` over `warmup_samples`, then cosine decay to `min_lr` at `decay_samples`
    (Megatron's --lr-warmup-samples / --lr-decay-samples / --lr-decay-style cosine)."""

    lr: float
    min_lr: float
    warmup_samples: int
    decay_samples: int

    def __post_init__(self) -> None:
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"need 0 <= min_lr({self.min_lr}) <= lr({self.lr})")
        if self.warmup_samples < 0 or self.decay_samples < self.warmup_samples:
            raise ValueError(f"need 0 <= warmup_samples({self.warmup_samples}) <= decay_samples({self.decay_samples})")

    def at(self, consumed_samples: int) -> float:
        if self.warmup_samples > 0 and consumed_samples < self.warmup_samples:
            return self.lr * consumed_samples / self.warmup_samples
        if consumed_samples >= self.decay_samples:
            return self.min_lr
        span = self.decay_samples - self.warmup_samples
        progress = (consumed_samples - self.warmup_samples) / span if span else 1.0
        cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_lr + (self.lr - self.min_lr) * cosine


@dataclass(frozen=True)
class BatchRampup:
    """Megatron's --rampup-batch-size START INCREMENT SAMPLES: the global batch grows from `start` by
    `increment` in equal sample intervals until `final` is reached after `samples` samples.
    BLOOM-176B: 16 -> 2048 in steps of 16 over 20M samples, i.e. 127 increments, one every ~157k samples."""

    start: int
    increment: int
    samples: int
    final: int

    def __post_init__(self) -> None:
        if self.start <= 0 or self.increment <= 0 or self.final < self.start:
            raise ValueError(f"bad ramp-up start={self.start} increment={self.increment} final={self.final}")
        if (self.final - self.start) % self.increment:
            raise ValueError(
                f"final({self.final}) - start({self.start}) is not a multiple of increment({self.increment})"
            )

    def global_batch_at(self, consumed_samples: int) -> int:
        steps = (self.final - self.start) // self.increment
        if steps == 0 or consumed_samples >= self.samples:
            return self.final
        per_increment = self.samples / steps
        return min(self.final, self.start + int(consumed_samples // per_increment) * self.increment)


def global_batch_at(consumed_samples: int, final: int, rampup: BatchRampup | None) -> int:
    return rampup.global_batch_at(consumed_samples) if rampup else final
