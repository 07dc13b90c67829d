"""How much to train: the corpus and the time budget fix the token count (and, through the ladder, the model size).

Three limits, the tightest wins, and the plan names it (docs/PLANNER.md, "Sizing: the data and the budget"):

- compute-optimal: about 20 training tokens per parameter (Hoffmann et al. 2022, "Training Compute-Optimal Large
  Language Models"); a model larger than its data and time can feed at that rate is passed over for a smaller one;
- data: at most 4 epochs of the corpus (Muennighoff et al. 2023, "Scaling Data-Constrained Language Models": up to
  about 4 epochs repeated tokens are worth almost as much as new ones; beyond, the return falls quickly);
- time: the run, its evaluations and its checkpoints included, within the budget: the user's `--budget`, else
  BLOOM-176B's ~120 days of wall time. With a budget the user gave, the run uses it (tokens past 20 per
  parameter, data permitting): the user asked for that much time.

CPU ranks run a smoke test: the model's own recipe (200 steps of the tiny model), cut by the data and by a budget.
The time a run takes is `run_seconds`: steps at the predicted step time, plus each evaluation and checkpoint as
`overheads` estimates them. The trainer's budget watch (appliance/train/budget_watch.py) uses the same function
with the measured step time.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from appliance.errors import BadInput
from appliance.hardware.profile import Hardware
from appliance.planner.cadence import cadence_for, eval_seconds, evaluations, saves
from appliance.planner.layout import Layout
from appliance.planner.model_shape import ModelShape
from appliance.planner.recipe import CHINCHILLA_TOKENS_PER_PARAM
from appliance.planner.runspec import RunSection
from appliance.planner.train_settings import TrainSettings

MAX_EPOCHS = 4
DEFAULT_TIME_BUDGET_DAYS = 120.0  # about BLOOM-176B's own wall time (March 11 to early July 2022)
SMOKE_BUDGET_S = 600.0  # the sample corpus on GPUs, no budget given: a smoke run of at most 10 minutes
# Below this many steps warmup and decay have no room: when the tokens allow no more, the batch shrinks (powers of
# two) until they do. The CPU smoke recipe's own length.
MIN_STEPS = 200

# Overhead estimates (the plan's run.eval_s and run.checkpoint_s):
# - an evaluation runs eval_samples per language forward only, at a third of a step per global batch
#   (planner/cadence.py, eval_seconds);
# - a checkpoint writes about 16 bytes per parameter (fp32 weights 4, Adam's m and v 8, and the RNG and manifest
#   files; the trainer checks free space for the same 4 x fp32 weights) at 1 GB/s per node (a local NVMe or a
#   parallel file system's share), plus a fixed 2 s for the gathers, barrier, fsync and manifest.
CHECKPOINT_BYTES_PER_PARAM = 16
CHECKPOINT_BYTES_PER_S_PER_NODE = 1e9
CHECKPOINT_FIXED_S = 2.0

# What bound the plan (plan.json run.limit).
COMPUTE_OPTIMAL, DATA, TIME, MEMORY, RECIPE, USER = "compute-optimal", "data", "time", "memory", "recipe", "user"

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*$")
_UNIT_S = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "": 3600.0}


def parse_duration(text: str, flag: str = "--budget") -> float:
    """'6h', '90m', '2d', '1.5h', '45s' (a bare number is hours) -> seconds; BadInput naming the flag otherwise."""
    match = _DURATION.match(text)
    if not match or float(match.group(1)) <= 0:
        raise BadInput(f"{flag} {text!r}: expected a positive duration such as 45m, 6h or 2d")
    return float(match.group(1)) * _UNIT_S[match.group(2)]


@dataclass(frozen=True)
class Budget:
    """What the run may use: wall time, the corpus, or an explicit token count that overrides both."""

    seconds: float | None = None  # the user's (or the smoke default); None: DEFAULT_TIME_BUDGET_DAYS caps it
    corpus_tokens: int | None = None  # known after the data stage
    corpus_bytes: int | None = None  # the prepared corpus's bytes, known after the prep stage (the vocabulary's size)
    train_tokens: int | None = None  # --set train_tokens: the user's count, not sized
    languages: int | None = None  # validation sets, known after the data stage

    @property
    def time_cap_s(self) -> float:
        return self.seconds if self.seconds is not None else DEFAULT_TIME_BUDGET_DAYS * 86400

    @property
    def data_cap_tokens(self) -> int | None:
        return MAX_EPOCHS * self.corpus_tokens if self.corpus_tokens else None


@dataclass(frozen=True)
class Overheads:
    eval_s: float  # one evaluation
    checkpoint_s: float  # one checkpoint


def overheads(
    model: ModelShape, layout: Layout, hardware: Hardware, step_s: float, eval_samples: int, languages: int | None
) -> Overheads:
    """Seconds one evaluation and one checkpoint take (the module docstring gives the arithmetic)."""
    eval_s = eval_seconds(languages, eval_samples, layout.global_batch_size, step_s)
    write_rate = CHECKPOINT_BYTES_PER_S_PER_NODE * max(1, hardware.nodes)
    checkpoint_s = CHECKPOINT_FIXED_S + CHECKPOINT_BYTES_PER_PARAM * model.parameters() / write_rate
    return Overheads(eval_s, checkpoint_s)


def run_seconds(
    steps: int,
    step_s: float,
    ov: Overheads,
    eval_interval: int,
    save_interval: int,
    save_interval_minutes: float | None = None,
) -> float:
    """Wall time of `steps` steps: evaluations at step 0, every eval_interval and at the last step (the trainer's
    rule), saves by step count or by time and at the last step (planner/cadence.py, `saves`)."""
    busy = steps * step_s + evaluations(steps, eval_interval) * ov.eval_s
    return busy + saves(steps, busy, save_interval, save_interval_minutes) * ov.checkpoint_s


def planned_seconds(
    steps: int,
    step_s: float,
    ov: Overheads,
    recipe_eval: int | None,
    recipe_save: int | None,
    devices: int = 1,
) -> float:
    """run_seconds with the cadences the plan would give a sized run of `steps` steps on `devices` devices."""
    c = cadence_for(
        steps,
        step_s,
        ov.eval_s,
        ov.checkpoint_s,
        devices=devices,
        eval_samples=0,
        recipe_eval=recipe_eval,
        recipe_save=recipe_save,
    )
    return run_seconds(steps, step_s, ov, c.eval_interval, c.save_interval, c.save_interval_minutes)


def steps_within(
    seconds: float,
    step_s: float,
    ov: Overheads,
    recipe_eval: int | None = None,
    recipe_save: int | None = None,
    devices: int = 1,
) -> int:
    """The most steps whose planned_seconds fit in `seconds` (0 when not even one does). Bisection: the intervals
    depend on the step count, so there is no closed form, and the time grows with the steps."""
    if planned_seconds(1, step_s, ov, recipe_eval, recipe_save, devices) > seconds:
        return 0
    lo, hi = 1, max(2, int(seconds / step_s) + 1)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if planned_seconds(mid, step_s, ov, recipe_eval, recipe_save, devices) <= seconds:
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclass(frozen=True)
class Sized:
    tokens: int | None  # None: the model's own recipe (the CPU smoke run)
    bound: str  # COMPUTE_OPTIMAL, DATA, TIME, RECIPE or USER
    optimal_tokens: int  # 20 per parameter


def optimal_tokens(model: ModelShape) -> int:
    return CHINCHILLA_TOKENS_PER_PARAM * model.parameters()


def time_cap_tokens(model: ModelShape, layout: Layout, step_s: float, ov: Overheads, budget: Budget) -> int:
    r = model.recipe
    steps = steps_within(budget.time_cap_s, step_s, ov, r.eval_interval, r.save_interval, layout.world_size)
    return steps * layout.global_batch_size * model.seq_len


def size_tokens(
    model: ModelShape, layout: Layout, step_s: float, ov: Overheads, budget: Budget, *, smoke: bool
) -> Sized:
    """The token count for `model` at `layout`: the user's, else the tightest of the target (20 per parameter; a
    smoke run's recipe; with a user budget, as much as the time allows), the data and the time."""
    optimal = optimal_tokens(model)
    if budget.train_tokens is not None:
        return Sized(budget.train_tokens, USER, optimal)
    limits: list[tuple[float, str]] = [(time_cap_tokens(model, layout, step_s, ov, budget), TIME)]
    if budget.data_cap_tokens is not None:
        limits.append((budget.data_cap_tokens, DATA))
    recipe = model.recipe.train_samples * model.seq_len if model.recipe.train_samples else None
    if smoke and recipe and budget.seconds is None:
        limits.append((recipe, RECIPE))
    elif budget.seconds is None:
        limits.append((optimal, COMPUTE_OPTIMAL))
    tokens, bound = min(limits, key=lambda x: x[0])  # ties go to the first listed: time, then data
    if bound == RECIPE:
        return Sized(None, RECIPE, optimal)
    # At least one full batch: a run too short for one step is still planned as one, and the plan says so.
    return Sized(max(int(tokens), layout.global_batch_size * model.seq_len), bound, optimal)


def fits_optimally(
    model: ModelShape, layout: Layout, step_s: float, ov: Overheads, budget: Budget
) -> tuple[bool, str, float]:
    """Whether the ladder may take `model`: its target tokens (the user's, else 20 per parameter) fit the time and
    the data. Returns (fits, the limit that failed or "", the seconds the target takes)."""
    target = budget.train_tokens if budget.train_tokens is not None else optimal_tokens(model)
    steps = max(1, target // (layout.global_batch_size * model.seq_len))
    r = model.recipe
    seconds = planned_seconds(steps, step_s, ov, r.eval_interval, r.save_interval, layout.world_size)
    if seconds > budget.time_cap_s:
        return False, TIME, seconds
    data = budget.data_cap_tokens
    if budget.train_tokens is None and data is not None and target > data:
        return False, DATA, seconds
    return True, "", seconds


def tokens_text(tokens: float) -> str:
    for scale, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if tokens >= scale:
            return f"{tokens / scale:.3g}{unit} tokens"
    return f"{tokens:.0f} tokens"


def duration_text(seconds: float) -> str:
    if seconds >= 2 * 86400:
        return f"{seconds / 86400:.1f} days"
    if seconds >= 2 * 3600:
        return f"{seconds / 3600:.1f} hours"
    if seconds >= 120:
        return f"{seconds / 60:.0f} minutes"
    return f"{seconds:.0f} s"


def explain(
    model: ModelShape,
    sized: Sized,
    budget: Budget,
    *,
    tokens: int,
    steps: int,
    step_s: float,
    ov: Overheads,
    seconds: float,
    limit: str,
) -> list[str]:
    """The plan's "Sizing" lines: the token count and why, the epochs, the limit, and what more would buy."""
    per_param = f"{tokens / model.parameters():.2g} per parameter"
    why = {
        COMPUTE_OPTIMAL: f"{CHINCHILLA_TOKENS_PER_PARAM} per parameter, compute-optimal (Hoffmann et al. 2022)",
        DATA: f"{MAX_EPOCHS} epochs of the corpus, the most that pays (Muennighoff et al. 2023); {per_param}",
        TIME: f"what the time allows at {step_s:.3g} s per step, evaluations and checkpoints included; {per_param}",
        RECIPE: f"the model's smoke recipe; {per_param}",
        USER: f"as --set train_tokens (or --max-steps) asked; {per_param}",
    }[sized.bound]
    lines = [f"tokens: {tokens_text(tokens)} in {steps:,} steps: {why}"]
    if budget.corpus_tokens:
        lines.append(f"corpus: {tokens_text(budget.corpus_tokens)}, trained {tokens / budget.corpus_tokens:.3g} times")
        if tokens > MAX_EPOCHS * budget.corpus_tokens:
            lines.append(f"warning: more than {MAX_EPOCHS} epochs: repeated tokens return little past that")
    else:
        lines.append("corpus: size not known yet; the run re-sizes the plan once the data stage has counted it")
    allowed = "" if budget.seconds is None else f" (budget {duration_text(budget.seconds)})"
    overhead = f"{duration_text(seconds - steps * step_s)} of it evaluations ({ov.eval_s:.3g} s each) and"
    lines.append(f"time: {duration_text(seconds)}{allowed}, {overhead} checkpoints ({ov.checkpoint_s:.3g} s each)")
    lines.append(f"limit: {limit}" + _more(sized, budget, tokens, limit))
    return lines


def _more(sized: Sized, budget: Budget, tokens: int, limit: str) -> str:
    """What more data, time or memory would buy, for the limit that bound."""
    optimal = sized.optimal_tokens
    if sized.bound == COMPUTE_OPTIMAL:  # the tokens are optimal: the limit is the ladder's, on the model size
        if limit == MEMORY:
            return "; the next size up does not fit this GPU memory: more GPUs or larger ones would allow it"
        return f"; the next size up needs more {limit} (see the model choice)" if limit in (DATA, TIME) else ""
    if limit == DATA and tokens < optimal:
        more = tokens_text(optimal / MAX_EPOCHS)
        return f"; {more} of corpus would allow {tokens_text(optimal)} ({CHINCHILLA_TOKENS_PER_PARAM} per parameter)"
    if limit == TIME:
        target = min(optimal, budget.data_cap_tokens or optimal)
        if target > tokens:
            return f"; {tokens_text(target)} would take about {target / tokens:.3g} times as long"
    return ""


def retime(run: RunSection, train: TrainSettings, step_s: float) -> RunSection:
    """The run estimate for a length the user set (--max-steps, --set train_tokens or train_samples): the plan's
    step time and overheads over the new step count; energy, carbon and cost scale with the time."""
    steps = train.steps_at_full_batch
    seconds = run_seconds(
        steps,
        step_s,
        Overheads(run.eval_s, run.checkpoint_s),
        train.eval_interval,
        train.save_interval,
        train.save_interval_minutes,
    )
    scale = seconds / run.time_s if run.time_s > 0 else 0.0
    return replace(
        run,
        steps=steps,
        time_s=seconds,
        time_days=seconds / 86400,
        gpu_hours=run.gpu_hours * scale,
        energy_kwh=run.energy_kwh * scale,
        co2_kg=run.co2_kg * scale,
        cost_usd=run.cost_usd * scale,
        overhead_s=seconds - steps * step_s,
        limit=USER,
    )
