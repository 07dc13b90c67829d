"""Training settings as the trainer runs them: the plan's "train" section (one definition, in
appliance/planner/train_settings.py, which the planner writes and the run spec reads) and the schedules built
from it."""

from __future__ import annotations

from appliance.planner.train_settings import TrainSettings
from appliance.train.schedule import BatchRampup, LRSchedule

__all__ = ["TrainSettings", "batch_rampup", "lr_schedule"]


def lr_schedule(settings: TrainSettings) -> LRSchedule:
    return LRSchedule(settings.lr, settings.min_lr, settings.warmup_samples, settings.decay_samples)


def batch_rampup(settings: TrainSettings) -> BatchRampup | None:
    if not settings.rampup:
        return None
    return BatchRampup(final=settings.global_batch_size, **settings.rampup)
