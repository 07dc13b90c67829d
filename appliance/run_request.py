"""A `run` request and the plan it makes: the inputs checked, the plan made (or read from the run directory) and
--set and --max-steps applied to it, before any stage runs."""

from __future__ import annotations

import shlex
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from appliance.errors import BadInput
from appliance.hardware.carbon import carbon_kg, resolve_profile
from appliance.hardware.profile import Hardware
from appliance.overrides import CARBON_KEYS, RUN_KEYS
from appliance.planner.cadence import cadence_for
from appliance.planner.runspec import RunSection, RunSpec, load_spec
from appliance.planner.sizing import retime
from appliance.planner.train_settings import TrainSettings
from appliance.planner.vocabulary import bytes_text
from appliance.rundir import RunDir
from appliance.train.nodes import NodeGroup

if TYPE_CHECKING:
    from appliance.train.slurm import SlurmJob


@dataclass
class RunRequest:
    corpus: list[Path]
    run_dir: Path | None = None
    model: str | None = None
    hardware: str | None = None  # a profile name/file instead of detection (planning what-ifs, tests)
    hardware_nodes: int | None = None  # --nodes: that many of the --hardware profile's one node (hardware/scaled.py)
    max_steps: int | None = None
    overrides: dict[str, Any] = field(default_factory=dict)
    prepare_only: bool = False  # stop after the data stages (a SLURM job then trains; see train/slurm.py)
    budget_s: float | None = None  # --budget: wall time for the whole run; None: default_budget_s
    nodes: NodeGroup | None = None  # --nnodes/--node-rank/--master: this node's share (appliance/train/nodes.py)
    layout: str | None = None  # --layout: these layout fields; the planner's search chooses the others
    # --preflight / --no-preflight; None: node 0 preflights a run of several nodes (--nnodes) that trains now
    preflight: bool | None = None

    @property
    def preflights(self) -> bool:
        """Whether node 0 runs the preflight stage before training (head_run.py; train/preflight_check.py)."""
        if self.preflight is not None:
            return self.preflight
        return self.nodes is not None and not self.prepare_only


def default_run_dir(model_name: str) -> Path:
    return Path("runs") / f"{time.strftime('%Y%m%d-%H%M%S')}-{model_name}"


def check_inputs(paths: list[Path]) -> None:
    if not paths:
        raise BadInput("--corpus: no input given")
    for p in paths:
        if not p.exists():
            raise BadInput(f"--corpus {p}: no such file or directory")


def is_sample_corpus(corpus: list[Path]) -> bool:
    from appliance.data.sample_corpus import SAMPLE_CORPUS_DIR

    return [Path(p).resolve() for p in corpus] == [Path(SAMPLE_CORPUS_DIR).resolve()]


def default_budget_s(has_gpus: bool, corpus: list[Path]) -> float | None:
    """The sample corpus on GPUs, without --budget: a smoke run of at most 10 minutes. Otherwise none: the data and
    compute-optimal sizing decide (CPU ranks run their smoke recipe)."""
    from appliance.planner.sizing import SMOKE_BUDGET_S

    return SMOKE_BUDGET_S if has_gpus and is_sample_corpus(corpus) else None


def make_run_plan(req: RunRequest, hardware: Hardware | None = None) -> RunSpec:
    """The plan for this run, with --max-steps and --set applied. Validates the model and hardware names. Sized to
    the budget; the corpus is not counted yet (size_to_corpus re-fixes the plan after the data stage). The plan
    `plan` prints for the same --hardware, --nodes, --model, --layout and budget (plan_command)."""
    from appliance.hardware.scaled import hardware_for
    from appliance.planner import Budget, load_model_shape, make_plan
    from appliance.planner.layout import parse_layout_fields

    if req.budget_s is not None and req.budget_s <= 0:
        raise BadInput(f"--budget {req.budget_s}: must be positive")
    hardware = hardware or hardware_for(req.hardware, req.hardware_nodes)
    shape = load_model_shape(req.model) if req.model else None
    seconds = req.budget_s if req.budget_s is not None else default_budget_s(hardware.has_gpus, req.corpus)
    plan = make_plan(
        hardware,
        shape,
        budget=Budget(seconds=seconds, train_tokens=req.overrides.get("train_tokens")),
        precision=req.overrides.get("dtype"),  # --set precision= (or dtype=)
        fixed=parse_layout_fields(req.layout) if req.layout else None,
        vocab_size=req.overrides.get("vocab_size"),
    )
    if not plan.feasible:
        reasons = "; ".join(plan.reasons) or "see `plan`"
        what = f"--layout {req.layout}: cannot run" if req.layout else f"--model {req.model}: does not fit"
        raise BadInput(f"{what}: {reasons} (`plan` with the same flags and --allow-infeasible shows the plan)")
    return apply_request(plan.spec(), req)


def make_sbatch_plan(req: RunRequest, *, smoke: bool) -> RunSpec:
    """`sbatch`'s plan: make_run_plan's. The sample corpus without --budget plans its 10-minute smoke run (a global
    batch of a few samples), which is no use to an allocation of several nodes: refused there unless `smoke`
    (--smoke), which only that smoke run takes."""
    from appliance.hardware.scaled import hardware_for
    from appliance.planner.sizing import duration_text

    hardware = hardware_for(req.hardware, req.hardware_nodes)
    seconds = default_budget_s(hardware.has_gpus, req.corpus) if req.budget_s is None else None
    if smoke and seconds is None:
        raise BadInput("--smoke: only for the sample corpus's smoke run (no --corpus, no --budget)")
    if seconds is not None and hardware.nodes > 1 and not smoke:
        raise BadInput(
            f"sbatch: the sample corpus (no --corpus) without --budget plans a smoke run of {duration_text(seconds)},"
            f" not a job for {hardware.nodes} nodes: give --corpus PATH (and --budget), or --smoke to send the smoke"
            " run anyway"
        )
    return make_run_plan(req, hardware)


def sbatch_summary(spec: RunSpec, req: RunRequest, job: SlurmJob, *, planned: bool) -> list[str]:
    """What `sbatch` prints under "wrote SCRIPT": the allocation and the time it asks for, the layout, the budget,
    the corpus and its tokens, and the `plan` command that prints the same plan (`planned`: sbatch made the plan;
    else it is the run directory's own)."""
    from appliance.planner.sizing import DEFAULT_TIME_BUDGET_DAYS, duration_text, tokens_text

    train, run = spec.train, spec.run
    if run.budget_s is None:
        budget = f"none given: 20 tokens per parameter, at most 4 epochs and {DEFAULT_TIME_BUDGET_DAYS:g} days"
    elif req.budget_s is None and is_sample_corpus(req.corpus):
        budget = f"{duration_text(run.budget_s)}, the sample corpus's smoke run"
    else:
        budget = duration_text(run.budget_s)
    if run.corpus_tokens is not None:
        corpus = f"{tokens_text(run.corpus_tokens)}, counted"
    else:
        files, size = _corpus_size(req.corpus)
        what = "the sample corpus" if is_sample_corpus(req.corpus) else ", ".join(str(p) for p in req.corpus)
        corpus = (
            f"{what} ({files} file(s), {bytes_text(size)} on disk); tokens not counted yet: the job's data stage counts"
            " them and re-sizes the plan to them"
        )
    source = f"the same plan: {plan_command(req, run.budget_s)}" if planned else "plan: the run directory's plan.json"
    return [
        f"SLURM: {job.nodes} nodes x {job.gpus_per_node} GPUs, --time={job.time_limit} per job (requeued until done)",
        f"layout: {spec.layout.describe()}",
        f"model: {spec.model.name}, {train.steps_at_full_batch:,} steps x {train.global_batch_size} x"
        f" {train.seq_len} tokens = {tokens_text(train.train_samples * train.seq_len)}, ~{duration_text(run.time_s)}",
        f"budget: {budget}",
        f"corpus: {corpus}",
        source,
    ]


def _corpus_size(paths: list[Path]) -> tuple[int, int]:
    """The files `prep` would read under the corpus paths (data/walk.py) and their bytes on disk (compressed ones
    compressed)."""
    from appliance.data.walk import plan_units

    units, _ = plan_units(paths, strict=False)
    files = sorted({unit.path for unit in units})
    return len(files), sum(p.stat().st_size for p in files)


def plan_command(req: RunRequest, budget_s: float | None) -> str:
    """The `plan` command line that prints the plan make_run_plan makes for `req` before its corpus is counted
    (`budget_s`: the budget it planned with, the sample corpus's smoke default included), every word quoted."""
    words = ["./bloom_appliance.py", "plan"]
    for flag, value in (("--hardware", req.hardware), ("--nodes", req.hardware_nodes), ("--model", req.model)):
        words += [flag, str(value)] if value is not None else []
    words += ["--layout", req.layout] if req.layout else []
    words += ["--budget", duration_flag(budget_s)] if budget_s is not None else []
    return " ".join(shlex.quote(word) for word in words)


def duration_flag(seconds: float) -> str:
    """Seconds as --budget takes them back exactly: whole days, hours or minutes where they are whole, else s."""
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds!r}s"


def existing_plan(req: RunRequest) -> RunSpec | None:
    """The plan.json of the request's run directory, when it has one (a rerun, or a directory `import` or `sbatch`
    prepared): that plan runs, whatever --model or --hardware say; --set applies to it until a run has used it."""
    if req.run_dir is None or not RunDir(req.run_dir).plan.exists():
        return None
    return load_spec(RunDir(req.run_dir).plan)


def apply_request(spec: RunSpec, req: RunRequest) -> RunSpec:
    """--set and --max-steps on a plan (a new one, or one `import` or `sbatch` wrote and no run has used yet).
    Keys the plan states twice (global and micro batch in train and layout, seq_len in train and model) change in
    both places; the spec checks the result as it checks a plan read from disk."""
    sets = req.overrides
    if req.max_steps is not None and req.max_steps <= 0:
        raise BadInput(f"--max-steps {req.max_steps}: must be positive")
    try:
        model = replace(spec.model, **{k: sets[k] for k in ("vocab_size",) if k in sets})
        layout = replace(spec.layout, **{k: sets[k] for k in ("global_batch_size", "micro_batch_size") if k in sets})
        run = replace(spec.run, **{k: sets[k] for k in ("max_restarts", "workers") if k in sets})
        train = replace(spec.train, **{k: v for k, v in sets.items() if k not in RUN_KEYS})
        if "train_tokens" in sets:
            train = replace(train, train_samples=max(1, sets["train_tokens"] // train.seq_len))
        if req.max_steps is not None:
            train = replace(train, train_samples=req.max_steps * train.global_batch_size)
        # A shortened run keeps its schedule's shape: warmup and decay fit inside the samples it will see.
        decay = min(train.decay_samples, train.train_samples)
        train = replace(
            train,
            decay_samples=decay,
            warmup_samples=min(train.warmup_samples, decay // 2),
            eval_interval=max(1, min(train.eval_interval, train.train_samples // train.global_batch_size)),
        )
        if train.train_samples != spec.train.train_samples or train.global_batch_size != spec.train.global_batch_size:
            train = _cadence_for_length(spec, train, sets)
            run = retime(run, train, spec.report.estimate["step_time_s"])  # the user's length: time it, limit "user"
        return replace(
            spec,
            model=model.with_seq_len(sets.get("seq_len")),
            layout=layout,
            train=train,
            run=_carbon_overrides(run, sets),
        )
    except ValueError as e:
        raise BadInput(f"--set: {e}") from None


CADENCE_KEYS = ("eval_interval", "save_interval", "save_interval_minutes")


def _cadence_for_length(spec: RunSpec, train: TrainSettings, sets: dict[str, Any]) -> TrainSettings:
    """A length the user set (--max-steps, --set train_tokens, ...) gets the cadences the planner gives a run of that
    length (planner/cadence.py), from the plan's step time and its estimates of one evaluation and one save; the
    cadences the user set stay as set."""
    if any(key in sets for key in CADENCE_KEYS):
        return train
    step_s = float(spec.report.estimate["step_time_s"])
    planned_samples = max(1, spec.train.eval_samples)
    cadence = cadence_for(
        train.steps_at_full_batch,
        step_s,
        spec.run.eval_s * train.eval_samples / planned_samples,
        spec.run.checkpoint_s,
        devices=spec.layout.world_size,
        eval_samples=train.eval_samples,
        recipe_eval=spec.model.recipe.eval_interval,
        recipe_save=spec.model.recipe.save_interval,
    )
    return replace(
        train,
        eval_interval=cadence.eval_interval,
        save_interval=cadence.save_interval,
        save_interval_minutes=cadence.save_interval_minutes,
    )


def _carbon_overrides(run: RunSection, overrides: dict[str, Any]) -> RunSection:
    """--set carbon_profile/grid_g_per_kwh/pue: the plan's carbon estimate and the meters use the same profile."""
    if not any(k in overrides for k in CARBON_KEYS):
        return run
    carbon = resolve_profile(
        overrides.get("carbon_profile"),
        grid_g_per_kwh=overrides.get("grid_g_per_kwh"),
        pue=overrides.get("pue"),
        site=run.carbon,
    )
    return replace(
        run,
        carbon=carbon,
        pue=carbon.pue,
        kg_co2_per_kwh=carbon.grid_g_per_kwh / 1000.0,
        co2_kg=carbon_kg(run.energy_kwh, carbon.grid_g_per_kwh, carbon.pue),
    )
