"""A plan as a person reads it (`plan` without --json): the answer in under 25 lines (the layout, whether it runs,
its speed, memory and time, the runner-up, the training, the run's time and cost), and with --verbose the reasoning
behind it (every note, the memory and time breakdowns, 1D against 2D tensor parallelism, the rejected alternatives,
the failure model's step-downs).

Every layout is printed in --layout's syntax (layout.layout_text), so any of them can be given back to --layout.
Memory is in GiB (2^30 bytes: the memory model's unit, and nvidia-smi's MiB / 1024); rates and byte counts sent
over links in powers of ten. CPU ranks get no MFU: their peak is an assumed figure (hardware/specs.py CPU_SPEC), not
a measured one, so a utilisation against it would be made up.
"""

from __future__ import annotations

from appliance.planner.failures import FailureCost, plan_failure_cost
from appliance.planner.layout import layout_text, pipeline_partition
from appliance.planner.node_losses import RESTART_MARGIN
from appliance.planner.plan import CONVENTIONS, Plan
from appliance.planner.sizing import duration_text, tokens_text
from appliance.planner.tp2d import comparison_lines

SHOWN_TERMS = 4  # memory and time terms on the short output's one line each; --verbose lists all
SHOWN_WARNINGS = 3
BRIEF_SIZING = ("tokens:", "corpus:", "limit:")  # the Sizing lines the short output keeps


def _si(value: float, unit: str) -> str:
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"


def format_plan(plan: Plan, *, spares: int = 0, verbose: bool = False) -> str:
    """`spares`: the hot spare nodes the run would have (`--spares`), for the cost of failures. Without `verbose`
    the answer fits 24 lines."""
    failures = plan_failure_cost(plan, spares)
    lines = _verbose(plan, failures) if verbose else _brief(plan, failures)
    return "\n".join(lines)


def _unit(plan: Plan) -> str:
    return "GPU" if plan.device.kind == "gpu" else "rank"


def _header(plan: Plan) -> str:
    hw, model, lay = plan.hardware, plan.model, plan.layout
    if hw.has_gpus:
        per_node = f"{hw.gpus_per_node} {hw.gpu}" if hw.nodes > 1 else f"{hw.gpus_per_node} x {hw.gpu}"
        nodes = f"{hw.nodes} nodes x " if hw.nodes > 1 else ""
        where = f"{nodes}{per_node} ({hw.world_gpus} GPUs)"
    else:
        where = f"{lay.world_size} CPU ranks on {hw.cpu_cores * hw.nodes} cores"
    return f"Plan: {model.name} ({_count(model.parameters())} parameters) on {hw.name or 'this machine'}: {where}"


def _count(n: float) -> str:
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= scale:
            return f"{n / scale:.3g}{suffix}"
    return f"{n:.0f}"


def _source(plan: Plan) -> str:
    if plan.mode == "given":
        return "as --layout gave it"
    fixed = f" with {layout_text(plan.fixed)} (--layout; the planner chose the rest)" if plan.fixed else ""
    if not plan.feasible:
        return f"the leanest of {plan.candidates:,} layouts{fixed}: none fits"
    fits = plan.rejected_counts.get("slower", 0) + 1  # the others that fit lost for speed
    return f"fastest predicted of {fits:,} layouts{fixed} that fit ({plan.candidates:,} evaluated)"


def _layout_lines(plan: Plan) -> list[str]:
    lay, model = plan.layout, plan.model
    part = pipeline_partition(model.layers, lay.pp)
    detail = [_source(plan), f"{lay.micro_batches} micro-batch(es) per pipeline"]
    if lay.pp > 1:
        detail.append(f"blocks per stage {_runs(part.layers_per_stage)}")
    if lay.cp > 1:
        detail.append(f"{lay.sequence_chunks} pieces per sequence ({lay.cp_mode})")
    detail.append(f"{plan.device.dtype} on {plan.device.name}")
    return [f"Layout: {lay.describe()}", "  " + "; ".join(detail)]


def _runs(values: tuple[int, ...]) -> str:
    """5,6,6,6,6,5 as "5,6x4,5": a pipeline's stages hold the same block count but at its ends."""
    out: list[str] = []
    for value in values:
        if out and out[-1].split("x")[0] == str(value):
            count = int(out[-1].split("x")[1]) + 1 if "x" in out[-1] else 2
            out[-1] = f"{value}x{count}"
        else:
            out.append(str(value))
    return ",".join(out)


def _verdict(plan: Plan) -> str:
    return "Verdict: " + ("FEASIBLE" if plan.feasible else "NOT FEASIBLE: " + "; ".join(plan.reasons))


def _speed(plan: Plan) -> str:
    est, unit = plan.estimate, _unit(plan)
    model = _si(est["model_tflops_per_gpu"] * 1e12, "FLOP/s")
    hardware = _si(est["tflops_per_gpu"] * 1e12, "FLOP/s")
    recomputed = f"; {hardware} with recompute" if plan.layout.recompute != "none" else ""
    flops = f"{model} per {unit} (model FLOPs{recomputed})"
    if plan.device.kind == "gpu":
        peak = _si(plan.device.peak_flops, "FLOP/s")
        utilisation = f"MFU {est['mfu']:.1%} of the {peak} dense {plan.device.dtype} peak"
    else:
        utilisation = "no MFU on CPU ranks (no measured peak)"
    return f"Step: {est['step_time_s']:.3g} s, {est['tokens_per_s']:,.0f} tokens/s, {flops}, {utilisation}"


def _memory_line(plan: Plan) -> str:
    mem, unit = plan.memory, _unit(plan)
    terms = sorted(((gb, key) for key, gb in mem.breakdown_gb.items() if gb > 0), reverse=True)
    shown = ", ".join(f"{key} {gb:.3g}" for gb, key in terms[:SHOWN_TERMS])
    rest = sum(gb for gb, _ in terms[SHOWN_TERMS:])
    shown += f", other {rest:.3g}" if rest > 0 else ""
    return f"Memory: {mem.total_gb:.3g} of {mem.capacity_gb:.3g} GiB per {unit} (stage {mem.stage}): {shown} GiB"


def _time_line(plan: Plan) -> str:
    total = plan.time.total_s
    terms = sorted(((s, key) for key, s in plan.time.breakdown_s.items() if s > 0), reverse=True)
    shown = ", ".join(f"{key} {s / total:.1%}" for s, key in terms[:SHOWN_TERMS])
    rest = sum(s for s, _ in terms[SHOWN_TERMS:])
    shown += f", other {rest / total:.1%}" if rest >= 0.0005 * total else ""
    return f"Time per step (stage {plan.time.bottleneck_stage}): {shown}"


def _rejected_line(item: dict[str, object]) -> str:
    fields = item["layout"]
    assert isinstance(fields, dict)
    shown = {k: v for k, v in fields.items() if k != "global_batch_size"}  # the plan's own, the same for all
    return f"{layout_text(shown)}: {item['reason']}"


def _alternatives(plan: Plan) -> list[str]:
    if not plan.rejected:
        return []
    counts = ", ".join(f"{n:,} {k}" for k, n in plan.rejected_counts.items() if n)
    runner_up = next((r for r in plan.rejected if str(r["reason"]).startswith("fits")), plan.rejected[0])
    return [f"Rejected: {counts or len(plan.rejected)} (--verbose lists them); e.g. {_rejected_line(runner_up)}"]


def _training(plan: Plan) -> str:
    t = plan.train
    return (
        f"Training: {t.steps_at_full_batch:,} steps x {t.global_batch_size} x {t.seq_len} tokens ="
        f" {tokens_text(t.train_samples * t.seq_len)}; lr {t.lr:.3g} -> {t.min_lr:.3g} {t.lr_decay_style},"
        f" warmup {t.warmup_samples:,} samples; {t.dtype}"
    )


def _run_line(plan: Plan) -> str:
    r, hw = plan.run, plan.hardware
    cost = f", ${r.cost_usd:,.0f} at ${r.usd_per_gpu_hour:.2f} per GPU-hour" if hw.has_gpus else ""
    # whole GPU-hours for real runs; two digits for the minutes-long runs a small corpus or budget plans
    hours = f"{r.gpu_hours:,.0f}" if r.gpu_hours >= 10 else f"{r.gpu_hours:.2g}"
    gpu_hours = f", {hours} GPU-hours" if hw.has_gpus else ""
    return (
        f"Run estimate: {duration_text(r.time_s)}{gpu_hours}, {_si(r.energy_kwh * 1000, 'Wh')} (PUE {r.pue:g}),"
        f" {r.co2_kg:,.3g} kg CO2 at {r.kg_co2_per_kwh:g} kg/kWh{cost}"
    )


def _brief(plan: Plan, failures: FailureCost | None) -> list[str]:
    """At most 24 lines: every section one or two lines, the notes only those a reader must not miss."""
    out = [_header(plan)]
    if plan.model_choice:
        out.append(f"Model: {plan.model_choice[-1]}")
    out += [*_layout_lines(plan), _verdict(plan), _speed(plan), _memory_line(plan), _time_line(plan)]
    warnings = plan.warnings[:SHOWN_WARNINGS]
    out += [f"  note: {w}" for w in warnings]
    if len(plan.warnings) > len(warnings):
        out.append(f"  ... {len(plan.warnings) - len(warnings)} more notes (--verbose)")
    out += _alternatives(plan)
    out.append(_training(plan))
    sizing = [line for line in plan.sizing if line.startswith(BRIEF_SIZING)]
    out += [f"Sizing: {sizing[0]}", *(f"  {line}" for line in sizing[1:])] if sizing else []
    out.append(_run_line(plan))
    if failures is not None:
        out.append(f"Failures: {failures.summary()}")
    out.append("More: --verbose (the search, every term, the alternatives, failure step-downs); --json (all of it)")
    return out


def _verbose(plan: Plan, failures: FailureCost | None) -> list[str]:
    unit = _unit(plan)
    out = [_header(plan)]
    if plan.model_choice:
        out.append("Model choice:")
        out += [f"  {line}" for line in plan.model_choice]
    out += [*_layout_lines(plan), _verdict(plan), _speed(plan)]
    out += [f"  {note}" for note in plan.notes]

    out.append(f"Memory per {unit} (stage {plan.memory.stage}, {plan.memory.in_flight} micro-batch(es) in flight):")
    for key, gb in plan.memory.breakdown_gb.items():
        if gb > 0:
            out.append(f"  {key:<18} {gb:9.2f} GiB")
    out.append(f"  {'total':<18} {plan.memory.total_gb:9.2f} GiB of {plan.memory.capacity_gb:.1f} GiB")

    total = plan.time.total_s
    out.append(f"Time per step (slowest stage {plan.time.bottleneck_stage}; bubble = (p-1)/m of the work):")
    for key, seconds in plan.time.breakdown_s.items():
        if seconds > 0:
            out.append(f"  {key:<18} {seconds:9.3g} s {seconds / total:6.1%}")
    out.append(f"  {'total':<18} {total:9.3g} s")

    if plan.tensor_parallel is not None:
        out.append("Tensor parallel: 1D vs 2D (a comparison only: the search places 1D groups):")
        out += [f"  {line}" for line in comparison_lines(plan.tensor_parallel, tp2d=plan.layout.tp2d)]

    if plan.rejected:
        counts = ", ".join(f"{n} {k}" for k, n in plan.rejected_counts.items() if n)
        out.append(f"Rejected alternatives ({counts or 'see below'}):")
        out += [f"  {_rejected_line(item)}" for item in plan.rejected]

    t = plan.train
    ramp = t.rampup
    ramp_text = f", batch ramp-up {ramp['start']}+{ramp['increment']} over {ramp['samples']:,} samples" if ramp else ""
    out.append(
        f"Training: {t.steps_at_full_batch:,} steps x {t.global_batch_size} x {t.seq_len} tokens ="
        f" {tokens_text(t.train_samples * t.seq_len)}; lr {t.lr:.3g} -> {t.min_lr:.3g} {t.lr_decay_style} over"
        f" {t.decay_samples:,} samples, warmup {t.warmup_samples:,} samples{ramp_text}; AdamW"
        f" ({t.adam_beta1}, {t.adam_beta2}), wd {t.weight_decay}, clip {t.grad_clip}, {t.dtype}, seed {t.seed},"
        f" init std {plan.model.init_std:g}"
    )
    if plan.sizing or plan.vocabulary:
        out.append("Sizing:")
        out += [f"  {line}" for line in [*plan.sizing, *plan.vocabulary]]
    out.append(_run_line(plan))
    if failures is not None:
        out.append("Failures (lost nodes; planner/failures.py):")
        out += [f"  {line}" for line in failures.lines()]
        out.append(
            f"  restart budget: max_restarts {plan.run.max_restarts} (each loss spends one: the losses' 99th"
            f" percentile, at least the suggested spares, plus {RESTART_MARGIN} for other failures;"
            " planner/node_losses.py; --set max_restarts=N)"
        )
    out.append("FLOP conventions:")
    out.append(f"  model FLOPs (MFU): {CONVENTIONS['model_flops']}")
    out.append(f"  hardware FLOPs (TFLOPs per GPU): {CONVENTIONS['hardware_flops']}")
    return out
