"""summary.json: what a run did, computed from its events and eval.json."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from appliance.monitor.event_kinds import EVENT_KINDS
from appliance.monitor.events import read_events
from appliance.monitor.state import RunState
from appliance.rundir import RunDir


def energy_summary(state: RunState) -> dict[str, Any]:
    """The energy part of summary.json: the sum over nodes of each node's newest energy event, which holds that
    node's total for the whole run, earlier attempts included (monitor/energy.py)."""
    return {
        "energy_kwh": state.energy_kwh,
        "co2_kg": state.energy_sum("co2_kg"),
        "gpu_kwh": state.energy_sum("gpu_kwh"),
        "cpu_kwh": state.energy_sum("cpu_kwh"),
        "energy_source": state.energy_field("source"),
        "pue": state.energy_field("pue"),
        "grid_g_per_kwh": state.energy_field("grid_g_per_kwh"),
    }


STAGE_ENDS = ("done", "failed", "stopped")


def train_stage_time(events: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Where the newest train stage's wall time went, from its events: the launches' starts (the head's own part,
    then each `startup` event's phases, which end with a launch's first step), the steps after each first step (the
    trainer's step times), the checkpoints, and the rest (evaluations, the final evaluation, the ranks' and the
    agent's exit). None when no train stage ran in the file."""
    starts = [
        i for i, e in enumerate(events) if e["kind"] == "stage" and e["name"] == "train" and e["state"] == "started"
    ]
    if not starts:
        return None
    begin = events[starts[-1]]
    window = events[starts[-1] + 1 :]
    end = next((e for e in window if e["kind"] == "stage" and e["name"] == "train" and e["state"] in STAGE_ENDS), None)
    if end is not None:
        window = window[: window.index(end)]
    last = end if end is not None else (window[-1] if window else begin)  # a live stage: up to its newest event
    stage_s = last["t"] - begin["t"]
    startups = [e for e in window if e["kind"] == "startup"]
    steps = [e for e in window if e["kind"] == "step"]
    # A launch's first step is in its startup (first_step phase); the others are the steps proper.
    step_s = sum(float(e.get("step_time_s") or 0.0) for e in steps) - sum(
        float(e.get("first_step_time_s") or 0.0) for e in startups
    )
    first = startups[0] if startups else None
    head_s = first["t"] - first["total_s"] - begin["t"] if first is not None and first.get("from") == "launch" else None
    startup_s = sum(float(e["total_s"]) for e in startups) + (head_s or 0.0)
    checkpoint_s = sum(float(e.get("seconds") or 0.0) for e in window if e["kind"] == "checkpoint")
    return {
        "stage_s": stage_s,
        "head_s": head_s,  # the train stage's start to the first launch of the agent (the plan read and checked)
        "startup_s": startup_s,  # head_s and every launch's start, to the end of its first step
        "steps_s": step_s,  # every other step, by the trainer's own step times
        "checkpoints_s": checkpoint_s,
        "other_s": stage_s - startup_s - step_s - checkpoint_s,  # evaluations, final evaluation, exit
        "steps_share": step_s / stage_s if stage_s > 0 else None,
        "launches": len(startups),
    }


def summarize(run_dir: RunDir, *, state: str, wall_seconds: float, stage_seconds: dict[str, float]) -> dict[str, Any]:
    # Each kind's events, in the list its declaration names (event_kinds.py).
    collected: dict[str, list[dict[str, Any]]] = {k.summary: [] for k in EVENT_KINDS.values() if k.summary is not None}
    state_of_run = RunState()  # the dashboard's reducer: energy summed over every node's latest reading
    every_event = list(read_events(run_dir.metrics))
    for e in every_event:
        state_of_run.apply(e)
        declared = EVENT_KINDS.get(e["kind"])
        if declared is not None and declared.summary is not None:
            collected[declared.summary].append(e)
    steps, evals, failures = collected["steps"], collected["evals"], collected["failures"]
    recoveries, checkpoints = collected["recoveries"], collected["checkpoints"]
    stage_states = {e["name"]: e["state"] for e in collected["stages"]}
    plan = json.loads(run_dir.plan.read_text()) if run_dir.plan.exists() else {}
    seq_len = plan.get("train", {}).get("seq_len", 0)
    # Skip the first steps in throughput figures: they include warm-up (allocations, first collectives).
    steady = steps[len(steps) // 5 :] if len(steps) >= 5 else steps

    def median(key: str) -> float | None:
        values = [s[key] for s in steady if s.get(key) is not None]
        return statistics.median(values) if values else None

    last_consumed = steps[-1]["consumed_samples"] if steps else 0
    eval_result = json.loads(run_dir.eval.read_text()) if run_dir.eval.exists() else None
    valid_curve = [(e["step"], e["valid_loss"]) for e in evals if "valid_loss" in e]
    # Comparable across tokenizers, where the loss per token is not (train/validation.py).
    bits_per_byte = [e["valid_bits_per_byte"] for e in evals if e.get("valid_bits_per_byte") is not None]
    return {
        "state": state,
        "run_dir": str(run_dir.root),
        "wall_seconds": wall_seconds,
        "stages": {name: {"state": stage_states.get(name), "seconds": s} for name, s in stage_seconds.items()},
        "steps": steps[-1]["step"] if steps else 0,
        "consumed_samples": last_consumed,
        "tokens": last_consumed * seq_len,
        "first_loss": steps[0]["loss"] if steps else None,
        "last_loss": steps[-1]["loss"] if steps else None,
        "first_valid_loss": valid_curve[0][1] if valid_curve else None,
        "last_valid_loss": valid_curve[-1][1] if valid_curve else None,
        "first_valid_bits_per_byte": bits_per_byte[0] if bits_per_byte else None,
        "last_valid_bits_per_byte": bits_per_byte[-1] if bits_per_byte else None,
        "throughput": {
            "tokens_per_s": median("tokens_per_s"),
            "tflops_per_gpu": median("tflops_per_gpu"),
            "mfu": median("mfu"),
            "step_time_s": median("step_time_s"),
        },
        **energy_summary(state_of_run),
        "checkpoints": len(checkpoints),
        "startup": state_of_run.startup,  # the newest launch's start, by phase (train/startup.py)
        "train_time": train_stage_time([e for e in every_event if "t" in e]),
        "eval": eval_result,
        "failures": failures,
        "recoveries": recoveries,
        "node_losses": node_losses(recoveries),
        "spares_left": None if state_of_run.spare_nodes is None else len(state_of_run.spare_nodes),
        "restarts_left": state_of_run.restarts_left,
        "export": str(run_dir.export) if Path(run_dir.export).exists() else None,
    }


def node_losses(recoveries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What each change of nodes cost (--nnodes MIN:MAX, --spares K): the nodes lost, the spare that took over, the
    time and steps lost, the layouts either side and the spares left (train/elastic.py)."""
    keys: tuple[str, ...] = ("lost_nodes", "joined_nodes", "took_over", "lost_seconds", "redone_steps")
    keys += ("resumed_step", "layout_from", "layout_to", "spares_left", "detection_s", "restart_spent")
    return [{k: e.get(k) for k in keys} for e in recoveries if e.get("lost_nodes") or e.get("joined_nodes")]
