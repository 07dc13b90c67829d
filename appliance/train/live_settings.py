"""`--set` on a run that has started: the keys that may change mid-run, written into plan.json between two launches.

plan.json is the run's one typed spec; the ranks read it when they start and a later resume reads it again, so a
change written there before a launch is what every rank runs. Which keys may change, and why the others may not, is
a table (appliance/planner/train_settings.py: CHANGEABLE_MID_RUN, FIXED_MID_RUN). A refused key fails the whole
request before anything is written. An accepted change rewrites only the changed values: the file is parsed, the
values replaced in place and the same JSON written back (indent 1, as RunSpec.dumps writes it), so every other byte
of a plan the appliance wrote stays as it was; the result must still read as a RunSpec, and it replaces the old file
atomically (temp, fsync, rename). Each change is recorded as a `settings` event: the checkpoint step the run resumes
from, {key, old, new} per key, and, when the lr schedule changes, the lr the next step gets under the old and the new
schedule (lr_at_step): the step in the lr that the change asks for, stated where the loss curve is read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

from appliance.atomic import write_atomic
from appliance.errors import BadInput
from appliance.monitor.events import EventWriter
from appliance.planner.runspec import RunSpec, load_spec
from appliance.planner.train_settings import CHANGEABLE_MID_RUN, FIXED_MID_RUN, NOT_SETTINGS
from appliance.rundir import RunDir
from appliance.train import checkpoint as ckpt
from appliance.train.schedule import global_batch_at
from appliance.train.settings import batch_rampup, lr_schedule

RUN_SECTION_KEYS = ("max_restarts", "workers")  # plan.json's "run" section; every other changeable key is in "train"
LR_KEYS = ("lr", "min_lr", "decay_samples")


@dataclass(frozen=True)
class ResumePoint:
    """Where the next launch starts: the newest checkpoint's step and consumed samples (0, 0 before the first)."""

    step: int
    consumed_samples: int


@dataclass(frozen=True)
class SettingsChange:
    point: ResumePoint
    changes: list[dict[str, Any]]  # [{key, old, new}], only the keys whose value changes
    lr_at_step: dict[str, float] | None  # the first step's lr after the change, old and new schedule, when it moves
    plan_bytes: bytes
    spec: RunSpec


def resume_point(run_dir: RunDir) -> ResumePoint:
    newest = ckpt.find_latest(run_dir.checkpoints, verify_hashes=False)
    if newest is None:
        return ResumePoint(0, 0)
    manifest = json.loads((newest / ckpt.MANIFEST).read_text())
    return ResumePoint(int(manifest["step"]), int(manifest.get("consumed_samples", 0)))


def refuse_fixed_keys(keys: list[str]) -> None:
    """BadInput naming every key that may not change on a started run, each with its reason."""
    reasons = {**FIXED_MID_RUN, **NOT_SETTINGS}
    fixed = [k for k in keys if k not in CHANGEABLE_MID_RUN]
    if fixed:
        why = "; ".join(f"{k}: {reasons.get(k, 'not a setting that may change mid-run')}" for k in fixed)
        raise BadInput(f"--set: may not change on a run that has started: {why}")


def plan_change(run_dir: RunDir, overrides: dict[str, Any]) -> SettingsChange:
    """The change `overrides` make to the run's plan, checked; nothing is written."""
    refuse_fixed_keys(list(overrides))
    source = str(run_dir.plan)
    spec = load_spec(run_dir.plan)
    data = json.loads(run_dir.plan.read_text())
    point = resume_point(run_dir)
    changes = []
    for key, new in overrides.items():
        section = "run" if key in RUN_SECTION_KEYS else "train"
        old = getattr(spec.run if section == "run" else spec.train, key)
        if old != new:
            changes.append({"key": key, "old": old, "new": new})
            data[section][key] = new
    train_sets = {c["key"]: c["new"] for c in changes if c["key"] not in RUN_SECTION_KEYS}
    if "decay_samples" in train_sets and train_sets["decay_samples"] < point.consumed_samples:
        raise BadInput(
            f"--set decay_samples={train_sets['decay_samples']}: the run has consumed {point.consumed_samples} samples"
            f" (checkpoint step {point.step}); a decay end already passed would drop the lr to min_lr at once"
        )
    try:
        new_train = replace(spec.train, **train_sets)
        new_schedule = lr_schedule(new_train)
    except ValueError as e:
        raise BadInput(f"--set: {e}") from None
    lr_at_step = None
    if any(k in train_sets for k in LR_KEYS):
        # The first step after the change, as the trainer computes it: the lr at the end of the samples it consumes.
        end = point.consumed_samples + global_batch_at(
            point.consumed_samples, spec.train.global_batch_size, batch_rampup(spec.train)
        )
        lr_at_step = {"old": lr_schedule(spec.train).at(end), "new": new_schedule.at(end)}
    changed = RunSpec.from_json(data, source)  # the spec's own checks, as on any read of plan.json
    return SettingsChange(point, changes, lr_at_step, json.dumps(data, indent=1).encode(), changed)


def change_settings(run_dir: RunDir, overrides: dict[str, Any], events: EventWriter, *, command: str) -> SettingsChange:
    """Write the change into plan.json (atomically) and record it as a `settings` event; no write and no event when
    no value changes. `command` names what asked (`train` or `run`), for the event."""
    change = plan_change(run_dir, overrides)
    if change.changes:
        write_atomic(run_dir.plan, change.plan_bytes)
        extra = {} if change.lr_at_step is None else {"lr_at_step": change.lr_at_step}
        events.emit(
            "settings",
            step=change.point.step,
            consumed_samples=change.point.consumed_samples,
            changes=change.changes,
            command=command,
            **extra,
        )
    return change


def describe(change: SettingsChange) -> str:
    """One line for the terminal."""
    if not change.changes:
        return "--set: no value changes"
    items = ", ".join(f"{c['key']} {c['old']} -> {c['new']}" for c in change.changes)
    return f"settings from step {change.point.step + 1} on: {items}"
