"""Training settings as the plan's "train" section states them (counted in samples, as BLOOM did)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from appliance.train.schedule import BatchRampup, LRSchedule


@dataclass(frozen=True)
class TrainSettings:
    seq_len: int
    global_batch_size: int
    micro_batch_size: int
    train_samples: int
    lr: float
    min_lr: float
    warmup_samples: int
    decay_samples: int
    weight_decay: float
    grad_clip: float
    adam_beta1: float
    adam_beta2: float
    adam_eps: float
    eval_interval: int  # steps
    eval_samples: int  # per language, per evaluation
    save_interval: int  # steps
    dtype: str
    seed: int
    save_interval_minutes: float = 180.0  # BLOOM-176B saved about every 3 hours of wall time
    keep_last: int = 3
    eval_task_limit: int | None = None  # documents per evaluation task (0: all; None: 32 on CPU, all on GPUs)
    rampup: dict[str, int] | None = None
    # Recovery. A rank silent for hang_timeout_s is killed and the group restarts (appliance/train/watchdog.py); the
    # same timeout bounds every collective. After nan_rollback_after skipped steps in a row the run goes back to
    # its newest checkpoint and skips the data of those steps, at most max_rollbacks times.
    hang_timeout_s: float = 300.0
    heartbeat_interval_s: float = 5.0
    nan_rollback_after: int = 3
    max_rollbacks: int = 5

    @classmethod
    def from_plan(cls, plan: dict[str, Any]) -> TrainSettings:
        section = dict(plan["train"])
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in section.items() if k in known})

    @property
    def lr_schedule(self) -> LRSchedule:
        return LRSchedule(self.lr, self.min_lr, self.warmup_samples, self.decay_samples)

    @property
    def batch_rampup(self) -> BatchRampup | None:
        if not self.rampup:
            return None
        return BatchRampup(final=self.global_batch_size, **self.rampup)

    @property
    def train_steps(self) -> int:
        return self.train_samples // self.global_batch_size
