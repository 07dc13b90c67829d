"""The reducers: one function per event kind (named by its declaration in event_kinds.py) that folds the event into
the fields of RunState (monitor/state.py), which the dashboard and the headless printer both render.

Pure: no I/O and no wall clock. Every time-derived figure (rates, ETAs, "elapsed") is measured on the events' own
"t", so a finished run reads the same today as tomorrow, and replaying hours of a 384-GPU run costs only the
JSON parsing (bench/tui_tail.py measures it).

Optional keys this reader understands beyond the required ones of events.py (all "extend, never rename"):
  step:        total_steps, step_time_s, samples_per_s; fp16 runs: loss_scale, skipped_steps (steps the loss
               scaler skipped for an overflow, over the run) and overflow (this step was one of them: its gradient
               norm is the overflow's inf, not a model figure, so the grad norm curve leaves it out)
  stage:       error (of a failed stage)
  checkpoint:  every_steps (the configured interval), stall_s (what the training loop waited for the save; its
               files were written in the background: seconds is the write, emitted when the save committed)
  gpu/energy:  node (one sampler per node; the totals sum the latest event of each node)
  energy:      gpu_kwh, cpu_kwh, attempt_kwh, source, gpu_source, cpu_source, pue, grid_g_per_kwh (kwh and the
               split are the node's totals for the whole run, restarts included: monitor/energy.py)
  eval:        any numeric metric, nested dicts of them (per_source, per_source_bits_per_byte, tasks), sample /
               prompt (a generated text); per_source, valid_bits_per_byte, per_source_bits_per_byte and tasks are
               also read as a report (monitor/eval_report.py: a row per language with its loss, perplexity and
               bits per byte, a row per task with its standard errors)
  plan:        the plan.json object (or {"plan": {...}}): estimate.*, train.steps, train.save_interval,
               run.energy_kwh / run.co2_kg (the pre-run estimate for the whole run)
  run:         state (started, done, failed, preempted), name, reason
  kernels:     source, choices, times_ms (and backend when nothing was chosen per op): the newest is kept
  startup:     phases ({phase: seconds}), total_s, from, restart, step: the newest launch's start is kept
  preflight:   roles (preflight.json's: role, stages, fits, total_bytes, capacity_bytes, ms_per_micro_batch
               {measured, planned}, ...), model, hardware, layout: the newest is kept (the dashboard also reads
               preflight.json itself, as this kind)
  step (MoE):  moe_aux_loss (the load-balancing loss), expert_load (per MoE layer, each expert's fraction of the
               tokens), expert_tier (the tiered expert store's counters: parallel/experts/store.py
               expert_tier_event); any of them makes `experts` non-None and shows the experts panel
"""

from __future__ import annotations

from collections import deque
from typing import Any

from appliance.monitor.eval_report import eval_report
from appliance.monitor.events import finite
from appliance.monitor.state_fields import (
    EVAL_BOOKKEEPING,
    MOE_STEP_KEYS,
    CheckpointInfo,
    ExpertsInfo,
    RunFields,
    StageInfo,
    TimelineEntry,
    first_of,
)


def on_run(run: RunFields, e: dict[str, Any], t: float) -> None:
    run.run_state = str(e.get("state"))
    run.run_name = e.get("name") or run.run_name
    if run.run_state == "failed" and not any(x.where.startswith("stage") for x in run.timeline):
        fail(run, t, "run", str(e.get("reason", "")))  # a failure no stage has reported already


def on_step(run: RunFields, e: dict[str, Any], t: float) -> None:
    step = finite(e.get("step"))
    if step is None:
        return
    run.step = int(step)
    run.total_steps = int(e["total_steps"]) if finite(e.get("total_steps")) else run.total_steps
    run.loss, run.lr, run.grad_norm = finite(e.get("loss")), finite(e.get("lr")), finite(e.get("grad_norm"))
    run.tokens_per_s, run.tflops_per_gpu = finite(e.get("tokens_per_s")), finite(e.get("tflops_per_gpu"))
    run.mfu = finite(e.get("mfu"))
    consumed = finite(e.get("consumed_samples"))
    run.consumed_samples = int(consumed) if consumed is not None else run.consumed_samples
    run.loss_scale = finite(e.get("loss_scale"))
    skipped = finite(e.get("skipped_steps"))
    run.skipped_steps = int(skipped) if skipped is not None else None
    norm = None if e.get("overflow") is True else e.get("grad_norm")
    for series, value in (
        (run.loss_series, e.get("loss")),
        (run.lr_series, e.get("lr")),
        (run.grad_norm_series, norm),
    ):
        series.add(step, value)
    run.tokens_series.add(step, e.get("tokens_per_s"))
    if run._steps and step < run._steps[-1][1]:
        run._steps.clear()  # a restart rewound the step counter: old rates no longer apply
    run._steps.append((t, int(step), consumed))
    # Step time and samples/s: the trainer's own figures when it sends them, else from the window:
    # (t_new - t_old) / (step_new - step_old), since step events may be logged every N steps.
    first_t, first_step, first_consumed = run._steps[0]
    span_t, span_steps = t - first_t, step - first_step
    if span_steps > 0 and span_t > 0:
        run.wall_s_per_step = span_t / span_steps
    run.step_time_s = finite(e.get("step_time_s")) or run.wall_s_per_step
    window_rate = None
    if consumed is not None and first_consumed is not None and span_t > 0:
        window_rate = (consumed - first_consumed) / span_t
    run.samples_per_s = finite(e.get("samples_per_s")) or window_rate or run.samples_per_s
    run.changed.update(("throughput", "curves", "stages", "checkpoints", "energy"))
    if any(key in e for key in MOE_STEP_KEYS):
        on_moe_step(run, e, int(step))


def on_moe_step(run: RunFields, e: dict[str, Any], step: int) -> None:
    experts = run.experts = run.experts or ExpertsInfo()
    experts.step = step
    if "moe_aux_loss" in e:
        experts.aux_loss = finite(e["moe_aux_loss"])
        experts.aux_series.add(step, e["moe_aux_loss"])
    load = e.get("expert_load")
    if isinstance(load, list):
        experts.load = [[finite(x) or 0.0 for x in layer] for layer in load if isinstance(layer, list)]
    if isinstance(e.get("expert_tier"), dict):
        experts.tier = dict(e["expert_tier"])
    run.changed.add("experts")


def on_stage(run: RunFields, e: dict[str, Any], t: float) -> None:
    name, state = str(e.get("name")), str(e.get("state"))
    progress = min(1.0, max(0.0, finite(e.get("progress")) or 0.0))
    info = run.stages.get(name)
    if info is None or (state == "started" and info.state in ("done", "failed", "skipped", "stopped")):
        info = run.stages[name] = StageInfo(name, state, progress, t, t)
    info.state, info.progress, info.updated_t = state, progress, t
    if state in ("done", "skipped"):
        info.progress = 1.0
    info.finished_t = t if state in ("done", "skipped", "failed", "stopped") else None
    if state == "failed":
        fail(run, t, f"stage {name}", str(e.get("error") or e.get("reason") or ""))
    run.changed.add("stages")


def on_checkpoint(run: RunFields, e: dict[str, Any], t: float) -> None:
    step = finite(e.get("step"))
    run.checkpoints.append(
        CheckpointInfo(
            step=int(step or 0),
            t=t,
            seconds=finite(e.get("seconds")) or 0.0,
            bytes=int(finite(e.get("bytes")) or 0),
            path=str(e.get("path", "")),
            stall_s=finite(e.get("stall_s")),
        )
    )
    run.checkpoint_count += 1
    every = finite(e.get("every_steps"))
    run.checkpoint_every_steps = int(every) if every else run.checkpoint_every_steps
    run.changed.add("checkpoints")


def on_gpu(run: RunFields, e: dict[str, Any], t: float) -> None:
    # Kept raw: most gpu events are superseded by the node's next one before anyone looks (replaying a long
    # run), so the devices are parsed only when `nodes` is read.
    node = str(e.get("node") or "local")
    run._gpu_raw[node] = (t, e.get("devices"))
    run._nodes.pop(node, None)
    run.changed.add("gpus")


def on_energy(run: RunFields, e: dict[str, Any], t: float) -> None:
    node = str(e.get("node") or "local")
    run.energy_by_node[node] = e
    kwh = finite(e.get("kwh"))
    marks = run._energy_marks.setdefault(node, deque(maxlen=32))
    if kwh is not None and (not marks or t - marks[-1][0] >= 60.0):
        marks.append((t, kwh))  # one mark a minute per node: the projection's rate over the last ~30 min
    run.changed.add("energy")


def on_failure(run: RunFields, e: dict[str, Any], t: float) -> None:
    # A node declared lost (train/peer_watch.py) names the node, not a rank.
    where = f"node {e.get('node')}" if e.get("rank") is None and e.get("node") else f"rank {e.get('rank')}"
    fail(run, t, where, str(e.get("reason", "")), rank=e.get("rank"))


def fail(run: RunFields, t: float, where: str, reason: str, rank: Any = None) -> None:
    run.failures += 1
    run.timeline.append(TimelineEntry(t, "failure", where=where, rank=rank, reason=reason))
    run.changed.add("timeline")


def on_nodes(run: RunFields, e: dict[str, Any], t: float) -> None:
    run.training_nodes = [str(n) for n in e.get("nodes", [])]
    run.spare_nodes = [str(n) for n in e.get("spares", [])]
    _restarts_left(run, e)
    if e.get("change") == "spare_lost":  # a standby stopped beating: one spare fewer (train/spare_book.py)
        reason = f"spare {e.get('node')} stopped beating: {len(run.spare_nodes)} spares left"
        fail(run, t, f"node {e.get('node')}", reason)
    run.changed.add("timeline")


def _restarts_left(run: RunFields, e: dict[str, Any]) -> None:
    left = finite(e.get("restarts_left"))
    if left is not None:
        run.restarts_left = int(left)


def on_recovery(run: RunFields, e: dict[str, Any], t: float) -> None:
    run.restarts += 1
    _restarts_left(run, e)
    lost = finite(e.get("lost_seconds")) or 0.0
    run.lost_seconds += lost
    restart, resumed = finite(e.get("restart")), finite(e.get("resumed_step"))
    run.timeline.append(
        TimelineEntry(
            t,
            "recovery",
            restart=int(restart) if restart is not None else None,
            resumed_step=int(resumed) if resumed is not None else None,
            lost_seconds=lost,
            reason=str(e.get("reason", "")),
            nodes=bool(e.get("lost_nodes") or e.get("joined_nodes")),
        )
    )
    run._steps.clear()  # the time spent down is not step time
    run.changed.add("timeline")


def on_warning(run: RunFields, e: dict[str, Any], t: float) -> None:
    run.warnings.append((t, str(e.get("message", ""))))
    run.changed.add("timeline")
    if isinstance(e.get("budget"), dict):
        run.budget = dict(e["budget"])
        run.changed.add("throughput")


def on_kernels(run: RunFields, e: dict[str, Any], t: float) -> None:
    run.kernels = {k: v for k, v in e.items() if k not in ("t", "kind")}
    run.changed.add("throughput")


def on_startup(run: RunFields, e: dict[str, Any], t: float) -> None:
    phases = {str(k): float(v) for k, v in dict(e["phases"]).items()}
    run.startup = {k: v for k, v in e.items() if k not in ("t", "kind")} | {"phases": phases}
    run.changed.add("throughput")


def on_preflight(run: RunFields, e: dict[str, Any], t: float) -> None:
    if not isinstance(e.get("roles"), list):
        raise TypeError("a preflight event's roles are a list")
    roles = [dict(r) for r in e["roles"] if isinstance(r, dict)]
    run.preflight = {k: v for k, v in e.items() if k not in ("t", "kind", "roles")} | {"roles": roles}
    run.changed.add("preflight")


def on_eval(run: RunFields, e: dict[str, Any], t: float) -> None:
    results: dict[str, Any] = {}
    for key, value in e.items():
        if key in EVAL_BOOKKEEPING:
            continue
        if key in ("sample", "generated", "generation", "samples"):
            take_sample(run, value)
        elif key == "prompt" and isinstance(value, str):
            run.sample_prompt = value
        elif isinstance(value, dict):
            results.update(_flatten(value, key))
        elif finite(value) is not None or isinstance(value, str):
            results[key] = value
    if results:  # the newest evaluation replaces the previous one (an event with only a sample keeps it)
        run.eval_results = results
        report = eval_report(e)
        run.eval_report = None if report.empty else report
    run.changed.add("eval")


def take_sample(run: RunFields, value: Any) -> None:
    if isinstance(value, list) and value:
        value = value[0]
    if isinstance(value, dict):
        run.sample_prompt = value.get("prompt", run.sample_prompt)
        value = first_of(value, "text", "completion", "output", "generated")
    if isinstance(value, str):
        run.sample_text = value


def on_plan(run: RunFields, e: dict[str, Any], t: float) -> None:
    nested = e.get("plan")
    plan: dict[str, Any] = nested if isinstance(nested, dict) else e
    run.plan.update({k: v for k, v in plan.items() if k not in ("t", "kind")})
    places = [run.plan, *(run.plan.get(k) for k in ("train", "run", "estimate"))]
    for place in (p for p in places if isinstance(p, dict)):
        # plan.json's train and run sections call the total "steps"; at the top level that name is too vague
        steps_keys = ("total_steps", "train_steps", "max_steps") + (("steps",) if place is not run.plan else ())
        total = finite(first_of(place, *steps_keys))
        run.total_steps = int(total) if total else run.total_steps
        every = finite(first_of(place, "checkpoint_every_steps", "save_interval"))
        run.checkpoint_every_steps = int(every) if every else run.checkpoint_every_steps
    run.changed.update(("plan", "throughput", "energy", "checkpoints"))


def _flatten(mapping: dict[str, Any], prefix: str) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for key, value in mapping.items():
        name = f"{prefix}.{key}"
        if isinstance(value, dict):
            out.extend(_flatten(value, name))
        elif finite(value) is not None:
            out.append((name, value))
    return out
