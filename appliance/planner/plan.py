"""make_plan: hardware (+ model, batch, layout) -> Plan, the object plan.json serializes."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any

from appliance.errors import BadInput
from appliance.hardware.profile import Hardware
from appliance.hardware.specs import GENERIC_GPU, gpu_spec
from appliance.planner.cp_reasons import best_without_cp, exchange_note, why_note
from appliance.planner.device import Device, default_precision, make_device
from appliance.planner.ladder import choose_model
from appliance.planner.layout import Layout, completes_layout, layout_text, pipeline_partition
from appliance.planner.memory import MemoryEstimate, stage_moe_blocks
from appliance.planner.model_shape import ModelShape
from appliance.planner.moe_costs import moe_plan_notes, moe_shape_for_model
from appliance.planner.node_losses import planned_restarts
from appliance.planner.recipe import default_global_batch_size, run_estimate, train_section
from appliance.planner.rejections import rejections
from appliance.planner.runspec import PlanDevice, PlanReport, RunSection, RunSpec
from appliance.planner.search import Evaluated, SearchResult, evaluate, search_layouts
from appliance.planner.sizing import (
    COMPUTE_OPTIMAL,
    MIN_STEPS,
    Budget,
    Sized,
    explain,
    overheads,
    run_seconds,
    size_tokens,
    tokens_text,
)
from appliance.planner.timing import StepTime
from appliance.planner.tp2d import TensorParallelComparison, tensor_parallel_comparison
from appliance.planner.train_settings import TrainSettings
from appliance.planner.vocabulary import sized_model

CONVENTIONS = {
    "model_flops": "6N + 6*L*s*h per token (Narayanan et al. 2021, causal attention counted as computed): N ="
    " weights in matrix multiplies, the tied LM head once; attention over half the s x s square. mfu and"
    " model_tflops_per_gpu use these, as do the step events and `bench`.",
    "hardware_flops": "model FLOPs plus recomputed work (full: every block's forward again; selective: the"
    " attention core again), as Megatron-DeepSpeed's throughput log counts them. tflops_per_gpu uses these.",
    "peak": "dense (no sparsity) bf16 tensor-core peak from the GPU specs table; fp32 FMA peak for CPU ranks",
    "memory_gb": "GiB (2^30 bytes, as nvidia-smi's MiB / 1024) on the fullest pipeline stage, allocator margin and"
    " fixed per-process overhead included",
    "train_units": "train/warmup/decay/rampup counted in samples; eval_interval and save_interval in steps",
    "communication": "bytes sent per rank and step, as ring all-reduce / reduce-scatter / all-gather send them",
}


@dataclass
class Plan:
    hardware: Hardware
    model: ModelShape
    layout: Layout
    feasible: bool
    memory: MemoryEstimate
    time: StepTime
    device: Device
    mode: str  # "searched", "given" (--layout named every field) or "completed" (--layout named some)
    train: TrainSettings
    run: RunSection
    reasons: list[str] = field(default_factory=list)  # why it cannot run (empty when feasible)
    rejected: list[dict[str, Any]] = field(default_factory=list)
    rejected_counts: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    model_choice: list[str] = field(default_factory=list)  # the ladder's reasoning when no model was named
    sizing: list[str] = field(default_factory=list)  # the token count, the limit that bound it, what more would buy
    vocabulary: list[str] = field(default_factory=list)  # the tokenizer's size and why (planner/vocabulary.py)
    # 1D (with and without sequence parallelism) against Optimus 2D tensor parallelism (planner/tp2d.py), GPUs only
    tensor_parallel: TensorParallelComparison | None = None
    candidates: int = 0
    search_seconds: float = 0.0
    # The notes a reader must not miss (an unrated GPU, a given layout's costs, nothing fits): `plan` prints them
    # without --verbose; they are among `notes` too.
    warnings: list[str] = field(default_factory=list)
    fixed: dict[str, Any] = field(default_factory=dict)  # the fields a partial --layout fixed (mode "completed")

    @property
    def estimate(self) -> dict[str, float]:
        lay, model = self.layout, self.model
        tokens = lay.global_batch_size * model.seq_len
        step, world = self.time.total_s, lay.world_size
        model_flops = model.flops_per_token() * tokens
        hardware_flops = model.flops_per_token(recompute=lay.recompute, tp=lay.tp) * tokens
        return {
            "memory_gb_per_gpu": self.memory.total_gb,
            "memory_capacity_gb": self.memory.capacity_gb,
            "step_time_s": step,
            "tflops_per_gpu": hardware_flops / (step * world) / 1e12,
            "model_tflops_per_gpu": model_flops / (step * world) / 1e12,
            "mfu": model_flops / (step * world * self.device.peak_flops),
            "hfu": hardware_flops / (step * world * self.device.peak_flops),
            "tokens_per_s": tokens / step,
            "samples_per_s": lay.global_batch_size / step,
        }

    def spec(self) -> RunSpec:
        """The plan as the run spec every consumer reads (plan.json is its serialised form)."""
        return RunSpec(
            hardware=self.hardware,
            model=self.model,
            layout=self.layout,
            train=self.train,
            run=self.run,
            device=PlanDevice(
                kind=self.device.kind,
                name=self.device.name,
                dtype=self.device.dtype,
                peak_tflops=self.device.peak_flops / 1e12,
            ),
            report=PlanReport(
                estimate=self.estimate,
                feasible=self.feasible,
                reasons=list(self.reasons),
                rejected=list(self.rejected),
                rejected_counts=dict(self.rejected_counts),
                memory_breakdown_gb=dict(self.memory.breakdown_gb),
                memory_stage=self.memory.stage,
                in_flight_micro_batches=self.memory.in_flight,
                time_breakdown_s=dict(self.time.breakdown_s),
                bottleneck_stage=self.time.bottleneck_stage,
                conventions=dict(CONVENTIONS),
                mode=self.mode,
                candidates=self.candidates,
                search_seconds=self.search_seconds,
                notes=list(self.notes),
                model_choice=list(self.model_choice),
                sizing=list(self.sizing),
                vocabulary=list(self.vocabulary),
                tensor_parallel=self.tensor_parallel,
            ),
        )

    def to_json(self) -> dict[str, Any]:
        return self.spec().to_json()


def _world_for(hardware: Hardware, layout: Layout) -> int:
    """GPUs in the allocation; on CPU the layout's own rank count (ranks are processes there)."""
    return hardware.world_gpus if hardware.has_gpus else layout.world_size


def _resolve_batch(given: int, requested: int | None, default: int) -> int:
    """The global batch: --layout's gbs (`given`, 0 when it names none), else --global-batch-size, else `default`."""
    if given:
        if requested and requested != given:
            raise BadInput(f"--global-batch-size {requested} contradicts gbs={given} in --layout")
        return given
    gbs = requested or default
    if gbs < 1:
        raise BadInput(f"--global-batch-size must be a positive integer, got {gbs}")
    return gbs


def make_plan(
    hardware: Hardware,
    model: ModelShape | None = None,
    *,
    global_batch_size: int | None = None,
    seq_len: int | None = None,
    layout: Layout | None = None,
    train_tokens: int | None = None,
    budget: Budget | None = None,
    precision: str | None = None,
    vocab_size: int | None = None,
    fixed: dict[str, Any] | None = None,
) -> Plan:
    """Plan a run: with `layout`, evaluate it (BadInput if it does not match the hardware or model; feasible=False
    with reasons if it cannot run); without, search for the fastest feasible layout, among those with the `fixed`
    fields when given (a partial --layout, parse_layout_fields; fields that leave nothing to choose are evaluated
    as a given layout). With model=None, the ladder picks the largest BLOOM shape the budget's time and data train
    compute-optimally; the budget then fixes the token count (planner/sizing.py). `precision` (bf16, fp16, fp32;
    `--set precision=`) overrides the hardware's default (device.default_precision). The model's vocabulary is sized
    to the budget's corpus (planner/vocabulary.py) unless vocab_size fixes it (`--set vocab_size`, or a tokenizer
    already trained)."""
    started = time.perf_counter()
    budget = budget or Budget()
    if train_tokens is not None:
        budget = replace(budget, train_tokens=train_tokens)
    if seq_len is not None and seq_len < 1:
        raise BadInput(f"--seq-len must be a positive integer, got {seq_len}")
    choice_lines: list[str] = []
    search: SearchResult | None = None
    model_bound: str | None = None
    if model is None:
        choice = choose_model(
            hardware,
            global_batch_size=global_batch_size,
            seq_len=seq_len,
            budget=budget,
            precision=precision,
            vocab_size=vocab_size,
        )
        model, choice_lines, model_bound = choice.model, choice.lines, choice.bound
        vocabulary = choice.vocabulary
        search = choice.search if layout is None and not fixed else None  # same model, batch and sequence: reuse
    else:
        corpus = {"corpus_bytes": budget.corpus_bytes, "corpus_tokens": budget.corpus_tokens}
        model, vocabulary = sized_model(model, **corpus, user=vocab_size)
    model = model.with_seq_len(seq_len)
    fixed = dict(fixed or {})
    if layout is None and fixed and completes_layout(fixed, moe=bool(model.moe_num_experts)):
        layout, fixed = Layout(**fixed), {}  # nothing left to choose
    given_gbs = layout.global_batch_size if layout is not None else int(fixed.get("global_batch_size", 0))
    gbs = _resolve_batch(given_gbs, global_batch_size, default_global_batch_size(model, hardware))
    notes: list[str] = []
    if hardware.has_gpus and gpu_spec(hardware.gpu) is None:
        notes.append(
            f"GPU {hardware.gpu!r} is not in the specs table: planned as a generic {GENERIC_GPU.peak_tflops:g}-TFLOPs,"
            f" {GENERIC_GPU.memory_bw_gbs:g} GB/s GPU with {hardware.gpu_memory_gb:g} GiB"
        )
    if hardware.has_gpus and model.hidden % 128:
        notes.append(f"hidden({model.hidden}) is not a multiple of 128: tensor-core GEMMs lose some rate")
    smoke = not hardware.has_gpus  # CPU ranks run the model's smoke recipe unless data or a budget cut it

    if fixed:
        search = search_layouts(hardware, model, gbs, precision, fixed=fixed)
        if not search.evaluated:
            layout, fixed = _unbuildable(hardware, model, gbs, fixed, search), {}  # BadInput, or a given layout
    if layout is not None:
        chosen, device, rejected, counts = _evaluate_given(hardware, model, layout, gbs, notes, precision)
        mode, candidates, warnings = "given", 1, list(notes)
    else:
        search = search or search_layouts(hardware, model, gbs, precision)
        if global_batch_size is None and not given_gbs:
            gbs, search = _batch_for_few_tokens(hardware, model, gbs, search, budget, smoke, notes, precision, fixed)
        warnings = list(notes)
        chosen, device, rejected, counts = _pick_searched(hardware, model, gbs, search, notes, precision, fixed)
        mode, candidates = "completed" if fixed else "searched", search.candidates
        warnings += [] if search.best is not None else notes[:1]  # "none of N layouts fits"
        asked = _asked_for(hardware, chosen.layout) if fixed else []
        notes += asked
        warnings += asked
    layout = chosen.layout
    notes.extend(chosen.notes)
    if layout.cp > 1:
        notes.append(exchange_note(chosen, model, device, hardware))
    if model.moe_num_experts:
        notes.extend(_expert_notes(model, chosen, device, hardware))
    step_s = chosen.time.total_s

    sized = _size(model, layout, hardware, step_s, budget, smoke)
    checkpoint_s = overheads(model, layout, hardware, step_s, 0, budget.languages).checkpoint_s
    cadence: list[str] = []
    train = train_section(
        model,
        layout,
        device,
        step_s,
        train_tokens=sized.tokens,
        notes=notes,
        languages=budget.languages,
        checkpoint_s=checkpoint_s,
        reasons=cadence,
    )
    ov = overheads(model, layout, hardware, step_s, train.eval_samples, budget.languages)
    steps = train.steps_at_full_batch
    seconds = run_seconds(steps, step_s, ov, train.eval_interval, train.save_interval, train.save_interval_minutes)
    limit = model_bound if sized.bound == COMPUTE_OPTIMAL and model_bound else sized.bound
    run = replace(
        run_estimate(hardware, device, layout, step_s, steps, seconds - steps * step_s),
        eval_s=ov.eval_s,
        checkpoint_s=ov.checkpoint_s,
        budget_s=budget.seconds,
        corpus_tokens=budget.corpus_tokens,
        corpus_bytes=budget.corpus_bytes,
        limit=limit,
    )
    gpus = layout.world_size if hardware.has_gpus else 0
    run = replace(run, max_restarts=planned_restarts(gpus, hardware.nodes, run.time_s))  # planner/node_losses.py
    tokens = train.train_samples * train.seq_len
    sizing = (
        explain(model, sized, budget, tokens=tokens, steps=steps, step_s=step_s, ov=ov, seconds=seconds, limit=limit)
        + cadence
    )
    return Plan(
        hardware=hardware,
        model=model,
        layout=layout,
        feasible=chosen.feasible,
        memory=chosen.memory,
        time=chosen.time,
        device=device,
        mode=mode,
        reasons=list(chosen.problems),
        rejected=rejected,
        rejected_counts=counts,
        notes=notes,
        model_choice=choice_lines,
        sizing=sizing,
        vocabulary=[vocabulary],
        tensor_parallel=tensor_parallel_comparison(model, layout, device, hardware) if hardware.has_gpus else None,
        train=train,
        run=run,
        candidates=candidates,
        search_seconds=time.perf_counter() - started,
        warnings=warnings,
        fixed=fixed,
    )


def _expert_notes(model: ModelShape, chosen: Evaluated, device: Device, hardware: Hardware) -> list[str]:
    """BLOOM-MoE: the ep chosen and the MoE cost model's lines (expert memory, the all-to-all the engine will pick
    and why, its traffic, the capacity factor's padding) for a rank of the stage with the most MoE blocks."""
    layout = chosen.layout
    partition = pipeline_partition(model.layers, layout.pp)
    moe_blocks = max(stage_moe_blocks(model, stage, partition) for stage in range(layout.pp))
    shape = moe_shape_for_model(
        model,
        ep=layout.ep,
        tokens=max(1, layout.micro_batch_size * model.seq_len // layout.cp),
        ranks_per_node=device.ranks_per_node,
        micro_batches=layout.micro_batches,
        rank_stride=layout.tp * layout.cp,
        act_bytes=device.act_bytes,
        tp=layout.tp,
    )
    shape = replace(shape, moe_layers=max(1, moe_blocks))  # a stage's MoE blocks, not the model's
    why = (
        "the smallest ep that fits (a larger one only adds all-to-all traffic)"
        if chosen.feasible
        else f"the largest ep the search offers (divisors of dp({layout.dp}) that divide the experts)"
    )
    ep_line = (
        f"expert parallelism ep={layout.ep}: {model.moe_num_experts // layout.ep} of {model.moe_num_experts} experts "
        f"per rank and MoE block, {why}; {moe_blocks} MoE block(s) on the fullest stage"
    )
    return [ep_line, *moe_plan_notes(shape, hardware)]


def _size(model: ModelShape, layout: Layout, hardware: Hardware, step_s: float, budget: Budget, smoke: bool) -> Sized:
    eval_samples = min(model.recipe.eval_samples or layout.global_batch_size, layout.global_batch_size)
    ov = overheads(model, layout, hardware, step_s, eval_samples, budget.languages)
    return size_tokens(model, layout, step_s, ov, budget, smoke=smoke)


def _batch_for_few_tokens(
    hardware: Hardware,
    model: ModelShape,
    gbs: int,
    search: SearchResult,
    budget: Budget,
    smoke: bool,
    notes: list[str],
    precision: str | None,
    fixed: dict[str, Any],
) -> tuple[int, SearchResult]:
    """When the tokens make fewer than MIN_STEPS steps at the default batch, the largest power-of-two batch that
    gives MIN_STEPS (at least 1), if a layout fits it: a schedule needs steps to warm up and decay over. The time
    limit is re-applied at the new batch's step time."""
    if search.best is None:
        return gbs, search
    sized = _size(model, search.best.layout, hardware, search.best.time.total_s, budget, smoke)
    samples = (sized.tokens or 0) // model.seq_len
    if sized.tokens is None or samples // gbs >= MIN_STEPS:
        return gbs, search
    small = 1 << max(0, (samples // MIN_STEPS).bit_length() - 1) if samples >= MIN_STEPS else 1
    if small >= gbs:
        return gbs, search
    retry = search_layouts(hardware, model, small, precision, fixed=fixed)
    if retry.best is None:
        return gbs, search
    notes.append(
        f"global batch {gbs} -> {small}: {tokens_text(sized.tokens)} make {samples // gbs} steps at {gbs};"
        f" at least {MIN_STEPS} give the schedule room to warm up and decay"
    )
    return small, retry


Outcome = tuple[Evaluated, Device, list[dict[str, Any]], dict[str, int]]


def _evaluate_given(
    hardware: Hardware, model: ModelShape, layout: Layout, gbs: int, notes: list[str], precision: str | None
) -> Outcome:
    """`plan --layout`: shape errors are bad input; a layout that cannot run is a plan with feasible=False."""
    world = _world_for(hardware, layout)
    dtype = precision or default_precision(hardware)  # what make_device below trains in
    layout.validate(world, model.heads, model.layers, model.seq_len, moe_num_experts=model.moe_num_experts, dtype=dtype)
    if not layout.global_batch_size:
        layout = replace(layout, global_batch_size=gbs)
    device = make_device(hardware, world, precision)
    chosen = evaluate(layout, model, hardware, device)
    rejected = [] if chosen.feasible else [{"layout": layout.to_dict(), "reason": "; ".join(chosen.problems)}]
    notes += _asked_for(hardware, layout)
    return chosen, device, rejected, {"constraint": 0, "memory": 0, "slower": 0}


def _asked_for(hardware: Hardware, layout: Layout) -> list[str]:
    """What a layout --layout asked for costs that the search would not have chosen: groups over nodes, more CPU
    ranks than cores."""
    notes = []
    if hardware.has_gpus and layout.tp > hardware.gpus_per_node:
        notes.append(f"tp({layout.tp}) spans nodes: its all-reduces run over {hardware.inter_node}")
    if hardware.has_gpus and layout.cp > 1 and layout.tp * layout.cp > hardware.gpus_per_node:
        notes.append(
            f"tp({layout.tp}) * cp({layout.cp}) = {layout.tp * layout.cp} > {hardware.gpus_per_node} GPUs per node:"
            f" the {layout.cp_mode} exchange of context parallelism runs over {hardware.inter_node}"
        )
    cores = hardware.cpu_cores * hardware.nodes
    if not hardware.has_gpus and layout.world_size > cores:
        notes.append(f"{layout.world_size} ranks share {cores} cores: they time-share")
    return notes


def _pick_searched(
    hardware: Hardware,
    model: ModelShape,
    gbs: int,
    search: SearchResult,
    notes: list[str],
    precision: str | None,
    fixed: dict[str, Any],
) -> Outcome:
    """The search's best; when nothing fits, the leanest candidate, so the plan shows why."""
    if search.best is not None:
        chosen = search.best
        notes.insert(0, _why(chosen, search, fixed))
        plain = best_without_cp(search) if chosen.layout.cp > 1 else None
        if plain is not None:
            notes.insert(1, why_note(chosen, plain, model.seq_len))
    elif search.evaluated:
        chosen = min(search.evaluated, key=lambda e: e.memory.total_gb)
        among = f" with {layout_text(fixed)}" if fixed else ""
        notes.insert(0, f"none of {search.candidates} layouts{among} fits; showing the leanest")
    else:
        reasons = "; ".join(r for _, r in search.constraint_rejections) or "no candidate layouts"
        raise BadInput(
            f"no layout can run {model.name} at global batch {gbs} on {hardware.name}: {reasons}"
            + _batch_hint(search, gbs)
        )
    rejected, counts = rejections(search, search.best)
    return chosen, make_device(hardware, chosen.layout.world_size, precision), rejected, counts


def _why(best: Evaluated, search: SearchResult, fixed: dict[str, Any]) -> str:
    fits = sum(1 for e in search.evaluated if e.feasible)
    among = f" with {layout_text(fixed)} (--layout; the planner chose the rest)" if fixed else ""
    return (
        f"fastest predicted of {fits} layouts{among} that fit ({search.candidates} evaluated): {best.layout.describe()}"
        f" at {best.time.total_s:.3g} s per step, {best.memory.total_gb:.1f} of {best.memory.capacity_gb:g} GiB"
    )


def _batch_hint(search: SearchResult, gbs: int) -> str:
    """When the global batch is what no data-parallel degree divides (an odd node count, say): the nearest larger
    batch one of them does, as --global-batch-size."""
    dps = [where["dp"] for where, reason in search.constraint_rejections if reason.startswith("global batch(")]
    if not dps:
        return ""
    batch, dp = min((-(-gbs // d) * d, d) for d in dps)
    return f" (--global-batch-size {batch} divides over dp({dp}))"


def _unbuildable(
    hardware: Hardware, model: ModelShape, gbs: int, fixed: dict[str, Any], search: SearchResult
) -> Layout:
    """--layout's fields admit no layout at all here. With tp, pp and dp among them, they are evaluated as a given
    layout (the rest at Layout's defaults), whose checks name the broken rule as the training ranks would; without,
    BadInput with the search's reasons."""
    if {"tp", "pp", "dp"} <= fixed.keys():
        return Layout(**fixed)
    reasons = "; ".join(dict.fromkeys(r for _, r in search.constraint_rejections)) or "no candidate layouts"
    raise BadInput(
        f"--layout {layout_text(fixed)}: no layout with these fields can train {model.name} at global batch {gbs}"
        f" on {hardware.name or 'this machine'}: {reasons}"
    )
