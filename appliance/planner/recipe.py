"""The plan's training hyperparameters ("train" section) and the run's estimated time, energy and cost.

Schedules are counted in samples, as BLOOM's Megatron-DeepSpeed runs counted them (--train-samples,
--lr-warmup-samples, --lr-decay-samples, --rampup-batch-size), so they survive a change of layout; intervals
(eval_interval, save_interval) are in steps, as Megatron's are. A shape's [train] table (BLOOM's published recipe
for the BLOOM sizes) is used as is; anything it leaves out follows BLOOM's choices scaled to the run.
"""

from __future__ import annotations

import math

from appliance.hardware.carbon import carbon_kg, resolve_profile, site_profile
from appliance.hardware.profile import Hardware
from appliance.hardware.specs import gpu_spec
from appliance.planner import calibration as cal
from appliance.planner.cadence import cadence_for, eval_samples_cap, eval_seconds
from appliance.planner.device import Device
from appliance.planner.layout import Layout
from appliance.planner.model_shape import ModelShape
from appliance.planner.runspec import RunSection
from appliance.planner.train_settings import TrainSettings

# BLOOM's optimizer settings (tr11-176B-ml README, "Optimizer"): AdamW (0.9, 0.95), eps 1e-8, weight decay 0.1,
# clipping at global norm 1.0; seed 42 as in every tr11 script.
BLOOM_OPTIMIZER = {"weight_decay": 0.1, "grad_clip": 1.0, "adam_beta1": 0.9, "adam_beta2": 0.95, "adam_eps": 1e-8}
BLOOM_SEED = 42
BLOOM_WARMUP_TOKENS = 375_000_000
CHINCHILLA_TOKENS_PER_PARAM = 20  # Hoffmann et al. 2022: the compute-optimal budget when a shape has no recipe
TOKENS_PER_STEP = 2**19  # default global batch for a shape without a recipe: ~0.5M tokens, as BLOOM's small models
MAX_LR = 1e-3


def size_rule_lr(parameters: int) -> float:
    """Peak LR for a shape without a recipe: 3e-4 * (559M / N)^0.3 runs through BLOOM's published values within
    ~15% (560m 3e-4, 1b7 2e-4, 7b1 1.2e-4, 176b 6e-5) and is capped at 1e-3 for tiny models."""
    return min(MAX_LR, 3e-4 * (559e6 / parameters) ** 0.3)


def default_global_batch_size(model: ModelShape, hardware: Hardware) -> int:
    """The recipe's global batch, else 16 on CPU ranks, else ~0.5M tokens per step (a power of two)."""
    if model.recipe.global_batch_size:
        return model.recipe.global_batch_size
    if not hardware.has_gpus:
        return 16
    return max(1, 2 ** round(math.log2(max(1, TOKENS_PER_STEP / model.seq_len))))


def train_samples_for(model: ModelShape, train_tokens: int | None = None) -> int:
    """The training budget in samples: explicit tokens, else the recipe's, else 20 tokens per parameter."""
    if train_tokens is not None:
        return max(1, train_tokens // model.seq_len)
    if model.recipe.train_samples:
        return model.recipe.train_samples
    if model.recipe.train_tokens:
        return max(1, model.recipe.train_tokens // model.seq_len)
    return max(1, CHINCHILLA_TOKENS_PER_PARAM * model.parameters() // model.seq_len)


def _rampup(model: ModelShape, layout: Layout, samples: int, notes: list[str]) -> dict[str, int] | None:
    """BLOOM's ramp-up where it applies: same global batch as the recipe, every step a multiple of mbs x dp, and a
    run at least twice as long as the ramp-up (BLOOM-176B ramped over 5% of its samples)."""
    ramp = model.recipe.rampup
    gbs = layout.global_batch_size
    if ramp is None or model.recipe.global_batch_size != gbs:
        return None
    if ramp.samples > samples // 2:
        notes.append(f"batch ramp-up over {ramp.samples:,} samples dropped: the run trains {samples:,}")
        return None
    unit = layout.micro_batch_size * layout.dp
    start, increment = math.ceil(ramp.start / unit) * unit, math.ceil(ramp.increment / unit) * unit
    if start >= gbs or (gbs - start) % increment:
        notes.append(f"batch ramp-up {ramp.start}+{ramp.increment} dropped: cannot step in multiples of mbs*dp={unit}")
        return None
    if (start, increment) != (ramp.start, ramp.increment):
        notes.append(f"batch ramp-up rounded to multiples of mbs*dp={unit}: start {start}, increment {increment}")
    return {"start": start, "increment": increment, "samples": ramp.samples}


def train_section(
    model: ModelShape,
    layout: Layout,
    device: Device,
    step_time_s: float,
    *,
    train_tokens: int | None = None,
    notes: list[str] | None = None,
    languages: int | None = None,
    checkpoint_s: float = 0.0,
    reasons: list[str] | None = None,
) -> TrainSettings:
    """The "train" section of plan.json: what the trainer needs, in samples. The cadences follow the run's length
    and the cost of one evaluation (of `languages` validation sets) and one save (checkpoint_s), planner/cadence.py;
    their reasons are appended to `reasons`."""
    notes = [] if notes is None else notes
    r = model.recipe
    gbs = layout.global_batch_size
    samples = train_samples_for(model, train_tokens)
    own_budget = train_tokens is None and bool(r.train_samples or r.train_tokens)
    lr = r.lr if r.lr is not None else size_rule_lr(model.parameters())
    warmup_default = max(1, BLOOM_WARMUP_TOKENS // model.seq_len)
    warmup = r.warmup_samples if r.warmup_samples is not None else warmup_default
    warmup = warmup if own_budget else min(warmup, max(1, samples // 10))  # at most 10% of a shorter run
    decay = r.decay_samples if (own_budget and r.decay_samples) else samples
    steps = max(1, samples // gbs)
    # A run of the recipe's own length keeps its evaluation size, a sized run evaluates at most one global batch per
    # language (the recipe's "--eval-iters 1" at its batch); either at most what keeps the two evaluations every run
    # makes within the evaluation share.
    wanted = r.eval_samples if (own_budget and r.eval_samples) else min(r.eval_samples or gbs, gbs)
    unit = layout.micro_batch_size * layout.dp  # one micro-batch per data-parallel rank
    eval_samples = min(wanted, eval_samples_cap(steps, gbs, languages, unit))
    cadence = cadence_for(
        steps,
        step_time_s,
        eval_seconds(languages, eval_samples, gbs, step_time_s),
        checkpoint_s,
        devices=layout.world_size,
        eval_samples=eval_samples,
        recipe_eval=r.eval_interval,
        recipe_save=r.save_interval,
        own_recipe=own_budget,
    )
    if reasons is not None:
        reasons.extend(cadence.reasons)
    optimizer: dict[str, float] = {
        k: getattr(r, k) if getattr(r, k) is not None else v for k, v in BLOOM_OPTIMIZER.items()
    }
    return TrainSettings(
        seq_len=model.seq_len,
        global_batch_size=gbs,
        micro_batch_size=layout.micro_batch_size,
        train_samples=samples,
        lr=lr,
        min_lr=r.min_lr if r.min_lr is not None else lr / 10,
        lr_decay_style="cosine",
        warmup_samples=warmup,
        decay_samples=decay,
        rampup=_rampup(model, layout, samples, notes),
        weight_decay=optimizer["weight_decay"],
        grad_clip=optimizer["grad_clip"],
        adam_beta1=optimizer["adam_beta1"],
        adam_beta2=optimizer["adam_beta2"],
        adam_eps=optimizer["adam_eps"],
        eval_interval=cadence.eval_interval,
        eval_samples=eval_samples,
        save_interval=cadence.save_interval,
        save_interval_minutes=cadence.save_interval_minutes,
        dtype=device.dtype,
        seed=r.seed if r.seed is not None else BLOOM_SEED,
    )


def run_estimate(
    hardware: Hardware, device: Device, layout: Layout, step_time_s: float, steps: int, overhead_s: float = 0.0
) -> RunSection:
    """Wall time, energy, carbon and cost of `steps` steps at full batch (a ramp-up's slower start not counted) and
    `overhead_s` of evaluations and checkpoints (planner/sizing.py estimates them)."""
    ranks = layout.world_size
    seconds = steps * step_time_s + overhead_s
    hours = seconds / 3600
    energy_kwh = hours * ranks * device.watts / 1000  # IT energy, as the meters measure it
    carbon = resolve_profile(site=site_profile(hardware.name, hardware.pue, hardware.kg_co2_per_kwh))
    if hardware.usd_per_gpu_hour is not None:
        price = hardware.usd_per_gpu_hour
    elif hardware.has_gpus:
        spec = gpu_spec(hardware.gpu)
        price = cal.USD_PER_GPU_HOUR.get(spec.family if spec else "", cal.DEFAULT_USD_PER_GPU_HOUR)
    else:
        price = 0.0
    return RunSection(
        steps=steps,
        time_s=seconds,
        time_days=seconds / 86400,
        gpu_hours=hours * ranks if hardware.has_gpus else 0.0,
        energy_kwh=energy_kwh,
        co2_kg=carbon_kg(energy_kwh, carbon.grid_g_per_kwh, carbon.pue),
        cost_usd=hours * ranks * price if hardware.has_gpus else 0.0,
        watts_per_rank=device.watts,
        pue=carbon.pue,
        kg_co2_per_kwh=carbon.grid_g_per_kwh / 1000.0,
        carbon=carbon,
        usd_per_gpu_hour=price if hardware.has_gpus else 0.0,
        overhead_s=overhead_s,
    )
