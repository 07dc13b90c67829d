"""A plan as a person reads it (`plan` without --json): the choice, its memory and time, what lost and why, the
training recipe, and the run's estimated time, energy and cost."""

from __future__ import annotations

from appliance.planner.failures import plan_failure_cost
from appliance.planner.layout import pipeline_partition
from appliance.planner.node_losses import RESTART_MARGIN
from appliance.planner.plan import CONVENTIONS, Plan
from appliance.planner.sizing import duration_text
from appliance.planner.tp2d import comparison_lines


def _si(value: float, unit: str) -> str:
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"


def _layout_line(plan: Plan) -> str:
    lay = plan.layout
    cp = f"cp={lay.cp} ({lay.cp_mode}, {lay.sequence_chunks} pieces per sequence)" if lay.cp > 1 else "cp=1"
    cp += f" ep={lay.ep}" if lay.ep > 1 else ""  # BLOOM-MoE's expert parallelism (inside dp)
    return (
        f"tp={lay.tp} pp={lay.pp} dp={lay.dp} {cp}, micro-batch {lay.micro_batch_size}, global batch"
        f" {lay.global_batch_size} ({lay.micro_batches} micro-batch(es) per pipeline), ZeRO-{lay.zero_stage},"
        f" recompute {lay.recompute}, sequence parallel {'on' if lay.sequence_parallel else 'off'}"
    )


def format_plan(plan: Plan, *, spares: int = 0) -> str:
    """`spares`: the hot spare nodes the run would have (`--spares`), for the cost of failures."""
    hw, model, lay, est = plan.hardware, plan.model, plan.layout, plan.estimate
    unit = "GPU" if plan.device.kind == "gpu" else "rank"
    where = f"{hw.world_gpus} x {hw.gpu}" if hw.has_gpus else f"{lay.world_size} CPU ranks on {hw.cpu_cores} cores"
    out = [f"Plan: {model.name} ({model.parameters() / 1e6:,.1f}M parameters) on {hw.name or 'this machine'} ({where})"]
    if plan.model_choice:
        out.append("Model choice:")
        out += [f"  {line}" for line in plan.model_choice]
    source = "given layout" if plan.mode == "given" else f"searched {plan.candidates} layouts"
    out.append(f"Layout ({source}): {_layout_line(plan)}")
    part = pipeline_partition(model.layers, lay.pp)
    if lay.pp > 1:
        out.append(f"  pipeline partition {part.method}: blocks per stage {','.join(map(str, part.layers_per_stage))}")
    out.append(f"  precision {plan.device.dtype} on {plan.device.name}")
    verdict = "FEASIBLE" if plan.feasible else "NOT FEASIBLE: " + "; ".join(plan.reasons)
    out.append(f"Verdict: {verdict}")
    out.append(
        f"Estimate: {est['step_time_s']:.3g} s per step, {_si(est['tflops_per_gpu'] * 1e12, 'FLOP/s')} per {unit}"
        f" (hardware FLOPs), {_si(est['model_tflops_per_gpu'] * 1e12, 'FLOP/s')} (model FLOPs), MFU {est['mfu']:.1%},"
        f" {est['tokens_per_s']:,.0f} tokens/s, {est['memory_gb_per_gpu']:.1f} of {est['memory_capacity_gb']:.1f} GB"
        f" per {unit}"
    )
    out += [f"  {note}" for note in plan.notes]

    out.append(f"Memory per {unit} (stage {plan.memory.stage}, {plan.memory.in_flight} micro-batch(es) in flight):")
    for key, gb in plan.memory.breakdown_gb.items():
        if gb > 0:
            out.append(f"  {key:<18} {gb:9.2f} GB")
    out.append(f"  {'total':<18} {plan.memory.total_gb:9.2f} GB of {plan.memory.capacity_gb:.1f} GB")

    total = plan.time.total_s
    out.append(f"Time per step (slowest stage {plan.time.bottleneck_stage}; bubble = (p-1)/m of the work):")
    for key, seconds in plan.time.breakdown_s.items():
        if seconds > 0:
            out.append(f"  {key:<18} {seconds:9.3g} s {seconds / total:6.1%}")
    out.append(f"  {'total':<18} {total:9.3g} s")

    if plan.tensor_parallel is not None:
        out.append("Tensor parallel: 1D vs 2D (a comparison only: the search places 1D groups):")
        out += [f"  {line}" for line in comparison_lines(plan.tensor_parallel)]

    if plan.rejected:
        counts = ", ".join(f"{n} {k}" for k, n in plan.rejected_counts.items() if n)
        out.append(f"Rejected alternatives ({counts or 'see below'}):")
        for item in plan.rejected:
            shown = {k: v for k, v in item["layout"].items() if k != "global_batch_size"}
            if shown.get("cp", 1) == 1:
                shown.pop("cp_mode", None)  # no exchange runs: its mode means nothing
            layout = ",".join(f"{k}={v}" for k, v in shown.items())
            out.append(f"  {layout}: {item['reason']}")

    t = plan.train
    ramp = t.rampup
    ramp_text = f", batch ramp-up {ramp['start']}+{ramp['increment']} over {ramp['samples']:,} samples" if ramp else ""
    out.append(
        f"Training: {t.steps_at_full_batch:,} steps x {t.global_batch_size} x {t.seq_len} tokens ="
        f" {_si(t.train_samples * t.seq_len, 'tokens')}; lr {t.lr:.3g} -> {t.min_lr:.3g} {t.lr_decay_style} over"
        f" {t.decay_samples:,} samples, warmup {t.warmup_samples:,} samples{ramp_text}; AdamW"
        f" ({t.adam_beta1}, {t.adam_beta2}), wd {t.weight_decay}, clip {t.grad_clip}, {t.dtype}, seed {t.seed},"
        f" init std {plan.model.init_std:g}"
    )
    if plan.sizing or plan.vocabulary:
        out.append("Sizing:")
        out += [f"  {line}" for line in [*plan.sizing, *plan.vocabulary]]
    r = plan.run
    cost = f", ${r.cost_usd:,.0f} at ${r.usd_per_gpu_hour:.2f} per GPU-hour" if hw.has_gpus else ""
    # whole GPU-hours for real runs; two digits for the minutes-long runs a small corpus or budget plans
    hours = f"{r.gpu_hours:,.0f}" if r.gpu_hours >= 10 else f"{r.gpu_hours:.2g}"
    gpu_hours = f", {hours} GPU-hours" if hw.has_gpus else ""
    out.append(
        f"Run estimate: {duration_text(r.time_s)}{gpu_hours}, {_si(r.energy_kwh * 1000, 'Wh')} (PUE {r.pue:g}),"
        f" {r.co2_kg:,.3g} kg CO2 at {r.kg_co2_per_kwh:g} kg/kWh{cost}"
    )
    failures = plan_failure_cost(plan, spares)
    if failures is not None:
        out.append("Failures (lost nodes; planner/failures.py):")
        out += [f"  {line}" for line in failures.lines()]
        out.append(
            f"  restart budget: max_restarts {r.max_restarts} (each loss spends one: the losses' 99th percentile, at"
            f" least the suggested spares, plus {RESTART_MARGIN} for other failures; planner/node_losses.py; --set"
            " max_restarts=N)"
        )
    out.append("FLOP conventions:")
    out.append(f"  model FLOPs (MFU): {CONVENTIONS['model_flops']}")
    out.append(f"  hardware FLOPs (TFLOPs per GPU): {CONVENTIONS['hardware_flops']}")
    return "\n".join(out)
