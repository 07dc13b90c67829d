"""Training settings: the plan's "train" section, counted in samples as BLOOM counted them.

The planner computes them (recipe.py), plan.json carries them (runspec.py), the trainer runs them. They live at the
planner's level so both sides import one definition (appliance/train/settings.py re-exports it with the schedule
objects built from it). Fields without a default must be in every plan; the defaults below are the documented
values of the optional ones (docs/PLANNER.md, "plan.json").
"""

from __future__ import annotations

from dataclasses import dataclass

DTYPES = ("bf16", "fp16", "fp32")
LR_DECAY_STYLES = ("cosine",)  # the one decay appliance/train/schedule.py implements
RAMPUP_KEYS = ("start", "increment", "samples")  # Megatron --rampup-batch-size START INCREMENT SAMPLES
DRIFT_CHECK_INTERVAL = 50  # steps between TP-replica drift checks (appliance/parallel/tensor/drift.py)
# Regional torch.compile of the transformer blocks (appliance/parallel/parallelize.py, compile_blocks): auto is on
# for CUDA ranks and off on CPU ones.
COMPILE_MODES = ("auto", "on", "off")


def engine_zero_stage(zero_stage: int, dtype: str) -> int:
    """The ZeRO stage DeepSpeed runs for a layout's ``zero_stage`` in ``dtype``: bf16 and fp16 at 0 run stage 1.
    bf16: BLOOM's BF16_Optimizer (fp32 master weights and Adam states sharded over DP, fp32 gradient accumulation)
    is what DeepSpeed selects for bf16 + fp32 accumulation at stage 1, and its stage 0 has no bf16 path with fp32
    accumulation. fp16: in DeepSpeed 0.19.8 engine.backward scales the loss for ZeRO optimizers only
    (deepspeedai/DeepSpeed PR #8393, open), so stage 0's fp16 optimizers would divide unscaled gradients by the
    scale. The DeepSpeed config (parallel/step/deepspeed_config.py) and the planner's memory and time both use this."""
    return max(zero_stage, 1) if dtype in ("bf16", "fp16") else zero_stage


def overlap_comm(zero_stage: int, dtype: str) -> bool:
    """Whether the run's DeepSpeed config turns ZeRO's overlap_comm on: never, for now.
    parallel/step/deepspeed_config.py writes this into the config and planner/timing.py credits overlap only where it is
    on, so both say the same.

    Off is DeepSpeed 0.19.8's default below stage 3. bf16 at stage 1 runs the BF16_Optimizer, which has no
    overlap_comm at all; where ZeRO's own optimizer runs (fp16, bf16 ZeRO-2) it would reduce gradient buckets on a
    side CUDA stream during backward, at extra bucket memory. Nothing here can measure that: gloo ranks have no CUDA
    streams, so a CPU run would show equal numbers and no overlap. What hides communication instead is the
    engine's cross-step parameter all-gather (parallel/zero/param_gather.py).
    """
    del zero_stage, dtype  # the arguments a measured GPU policy would decide on
    return False


@dataclass(frozen=True)
class TrainSettings:
    seq_len: int
    global_batch_size: int
    micro_batch_size: int
    train_samples: int
    lr: float
    min_lr: float
    warmup_samples: int
    decay_samples: int
    weight_decay: float
    grad_clip: float  # global gradient norm; 0 turns clipping off
    adam_beta1: float
    adam_beta2: float
    adam_eps: float
    eval_interval: int  # steps
    eval_samples: int  # per language, per evaluation
    save_interval: int  # steps
    dtype: str
    seed: int
    lr_decay_style: str = "cosine"
    rampup: dict[str, int] | None = None
    save_interval_minutes: float = 180.0  # BLOOM-176B saved about every 3 hours of wall time
    keep_last: int = 3
    # Checkpoints written in the background (appliance/train/async_save.py): a step waits only for host copies of
    # its shards. False: every save blocks until committed, as a stop's does (no second host copy of the shards).
    async_checkpoints: bool = True
    eval_task_limit: int | None = None  # documents per evaluation task (0: all; None: 32 on CPU, all on GPUs)
    drift_check_interval: int = DRIFT_CHECK_INTERVAL  # 0 turns the check off
    # ZeRO's all-gather of the updated weights, per layer in the background of the next step's forward rather than
    # at the end of the step (appliance/parallel/zero/param_gather.py). Acts only with dp > 1 and ZeRO >= 1.
    overlap_param_gather: bool = True
    # Megatron's --reset-attention-mask: each token attends only to the earlier tokens of its own document within a
    # packed sample (documents end at the EOD token; appliance/data/documents.py), and the data-parallel ranks get
    # the step's samples balanced by their attention cost (appliance/data/balance.py). Off: attention runs across
    # the documents of a sample, as BLOOM-176B trained, which keeps every loss curve recorded so far.
    reset_attention_mask: bool = False
    # Recovery. A rank silent for hang_timeout_s is killed and the group restarts (appliance/train/watchdog.py); the
    # same timeout bounds every collective. After nan_rollback_after skipped steps in a row the run goes back to
    # its newest checkpoint and skips the data of those steps, at most max_rollbacks times.
    hang_timeout_s: float = 300.0
    heartbeat_interval_s: float = 5.0
    nan_rollback_after: int = 3
    max_rollbacks: int = 5
    # MoE runs: the bytes of experts (weights, gradients, AdamW moments) each rank keeps on its device, the rest in
    # host memory, moved by LRU with prefetch (appliance/parallel/experts/store.py); 0 keeps every expert resident.
    expert_device_budget_mb: int = 0
    # ... and the bytes of them each rank keeps in host memory; the rest go to local disk, one safetensors file per
    # expert under run_dir/expert_store/rank<N>/. 0: host memory holds every expert the device does not. Only with
    # expert_device_budget_mb > 0, for host memory is the second tier: experts go to disk when it is full.
    expert_host_budget_mb: int = 0
    # torch.compile of each transformer block, in place (parallelize.py, compile_blocks): auto is on for CUDA ranks
    # and off on CPU, where compiling costs more than it saves (docs/PERFORMANCE.md, "compile").
    compile: str = "auto"

    def __post_init__(self) -> None:
        problems = []
        for key in (
            "seq_len",
            "global_batch_size",
            "micro_batch_size",
            "train_samples",
            "eval_interval",
            "save_interval",
        ):
            if getattr(self, key) < 1:
                problems.append(f"{key} must be at least 1, got {getattr(self, key)!r}")
        for key in (
            "warmup_samples",
            "decay_samples",
            "eval_samples",
            "seed",
            "keep_last",
            "drift_check_interval",
            "expert_device_budget_mb",
            "expert_host_budget_mb",
        ):
            if getattr(self, key) < 0:
                problems.append(f"{key} must not be negative, got {getattr(self, key)!r}")
        if self.expert_host_budget_mb > 0 and self.expert_device_budget_mb == 0:
            problems.append(
                f"expert_host_budget_mb({self.expert_host_budget_mb}) needs expert_device_budget_mb > 0 (got 0: every"
                " expert stays on the device, so none would reach host memory or disk)"
            )
        if not 0 <= self.min_lr <= self.lr:
            problems.append(f"need 0 <= min_lr({self.min_lr}) <= lr({self.lr})")
        for key in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, key) < 1:
                problems.append(f"{key} must be in [0, 1), got {getattr(self, key)!r}")
        if not self.adam_eps > 0:
            problems.append(f"adam_eps must be > 0, got {self.adam_eps!r}")
        if self.weight_decay < 0 or self.grad_clip < 0:
            problems.append(f"weight_decay({self.weight_decay}) and grad_clip({self.grad_clip}) must not be negative")
        if self.global_batch_size % self.micro_batch_size:
            problems.append(
                f"global_batch_size({self.global_batch_size}) is not a multiple of"
                f" micro_batch_size({self.micro_batch_size})"
            )
        if self.compile not in COMPILE_MODES:
            problems.append(f"compile must be one of {', '.join(COMPILE_MODES)}, got {self.compile!r}")
        if self.dtype not in DTYPES:
            problems.append(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.lr_decay_style not in LR_DECAY_STYLES:
            problems.append(f"lr_decay_style must be one of {', '.join(LR_DECAY_STYLES)}, got {self.lr_decay_style!r}")
        if self.rampup is not None and (
            sorted(self.rampup) != sorted(RAMPUP_KEYS) or not all(v > 0 for v in self.rampup.values())
        ):
            problems.append(f"rampup must be {{start, increment, samples}} of positive integers, got {self.rampup!r}")
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def train_steps(self) -> int:
        return self.train_samples // self.global_batch_size

    @property
    def steps_at_full_batch(self) -> int:
        """Steps at the full batch, at least one (a ramp-up's smaller first steps not counted)."""
        return max(1, self.train_steps)


# ---- settings on a running run ------------------------------------------------------------------------------
# `--set` on `train --run-dir D` or on a resumed `run --run-dir D` changes plan.json between two launches: the ranks
# read it when they start, and the newest checkpoint holds the weights, the optimizer's moments, the data position
# (consumed samples) and the RNG states. A key may change there only when nothing in that checkpoint was made under
# the old value in a way the new one would contradict. Each key --set accepts is in exactly one of the two tables
# below (tests/unit/test_live_settings.py checks it), so a new setting has to be decided here, with its reason.
#
# The learning rate is a function of consumed samples (appliance/train/schedule.py), recomputed every step from the
# plan; nothing of it is in a checkpoint. A new lr, min_lr or decay_samples therefore takes effect at the resume
# point as the plan's own schedule with the new numbers: where warmup ends stays, the cosine runs from the new lr to
# the new min_lr and ends at the new decay_samples. The next step's lr moves from old(c) to new(c) at once (c: the
# samples consumed at the end of that step): that step is the change asked for, and the `settings` event states it
# (lr_at_step: {old, new}). E.g. halving lr during warmup halves the warmup's slope from there on.
CHANGEABLE_MID_RUN: dict[str, str] = {
    "lr": "the schedule's peak: the cosine from here on runs from the new lr to min_lr; the step at the resume point"
    " is in the event (lr_at_step)",
    "min_lr": "the schedule's floor: the cosine from here on ends at the new min_lr (at most lr)",
    "decay_samples": "where the cosine ends: it must lie at or after the samples already consumed (an end already"
    " passed would drop the lr to min_lr at once) and after the warmup",
    "weight_decay": "the optimizer's param groups are built from the plan at each launch; the checkpoint holds the"
    " moments, not the groups",
    "grad_clip": "the engine reads it at each launch and applies it to the steps still to come",
    "eval_interval": "when to evaluate; read by the trainer at each launch",
    "eval_samples": "validation samples per language from the next evaluation on; the validation split is fixed by the"
    " data, so training data is untouched (earlier results used the old count)",
    "eval_task_limit": "documents per evaluation task from the next evaluation on",
    "save_interval": "when to save; read by the trainer at each launch",
    "save_interval_minutes": "when to save by wall time; read by the trainer at each launch",
    "keep_last": "how many checkpoints pruning keeps; the next save prunes to the new count",
    "async_checkpoints": "when a save's files are written, not what they hold; read by the trainer at each launch",
    "drift_check_interval": "how often the TP replicas are compared; a check, not a change of state",
    "hang_timeout_s": "the watchdog's and the collectives' timeout, set when the ranks start",
    "heartbeat_interval_s": "how often ranks report alive, set when the ranks start",
    "nan_rollback_after": "the recovery policy for non-finite steps, read at each launch",
    "max_rollbacks": "the recovery policy for non-finite steps, read at each launch",
    "max_restarts": "the elastic agent's restart budget, given to it at each launch",
    "workers": "data-stage processes; the data stages are done and keep their outputs",
    "overlap_param_gather": "when ZeRO's post-step weight all-gather runs, not what it computes: on and off train bit"
    " for bit alike (tests/distributed/test_overlap_param_gather.py); read at each launch",
    "expert_device_budget_mb": "where experts wait between uses, not what is computed: the tiered run trains bit for"
    " bit like the all-resident one (tests/unit/test_expert_store.py); read at each launch",
    "expert_host_budget_mb": "where experts wait between uses (host memory or disk), not what is computed: the disk"
    " tier trains bit for bit like the all-resident run (tests/distributed/test_moe_parallel.py); read at each launch",
    "compile": "how the blocks run, not what they compute: compiled blocks train like eager ones within float rounding"
    " (tests/distributed/test_compile.py); applied when the ranks build the model, at each launch",
}
FIXED_MID_RUN: dict[str, str] = {
    "seq_len": "the data position (consumed samples) counts samples of this length, the data index is cut into"
    " them, and the layout's activation memory was planned for it: a new length is a new run (export, then"
    " `import --seq-len`)",
    "global_batch_size": "the layout's gradient accumulation (global batch / (micro batch x dp)) and the planned"
    " schedule and step count are built on it; BLOOM changed it only through the planned ramp-up",
    "micro_batch_size": "a layout setting whose memory the planner checks: continue with `train --layout ...,mbs=M`",
    "train_samples": "the data blend's sample index (appliance/data/blend.py) is built for the run's length: a new"
    " length re-orders the samples still to come and can repeat ones already trained on",
    "train_tokens": "sets train_samples, whose data index is built for the run's length (see train_samples)",
    "warmup_samples": "the warmup is the start of the schedule, already (partly) behind the run: a new one would"
    " rewrite the lr the run trained with; change lr, min_lr or decay_samples instead",
    "lr_decay_style": "the shape of the schedule already followed; cosine is the one implemented",
    "adam_beta1": "the checkpoint's first moments are averages under the old beta1 and the bias correction counts"
    " steps under it",
    "adam_beta2": "the checkpoint's second moments are averages under the old beta2 and the bias correction counts"
    " steps under it",
    "adam_eps": "part of the update rule the optimizer state was built under; BLOOM never changed it mid-run",
    "dtype": "the precision the weights, fp32 masters and loss scaler in the checkpoint were made in and the memory"
    " plan assumes",
    "precision": "the plan's train.dtype (see dtype)",
    "seed": "the data order, initialisation and dropout streams derive from it; the checkpoint's RNG states continue"
    " the old ones",
    "vocab_size": "the embedding's rows in the checkpoint and the tokenizer's ids",
    "carbon_profile": "the energy meters carry one CO2 total across resumes; a new intensity would mix two in it",
    "grid_g_per_kwh": "the energy meters carry one CO2 total across resumes; a new intensity would mix two in it",
    "pue": "the energy meters carry one CO2 total across resumes; a new PUE would mix two in it",
    "reset_attention_mask": "which keys every token attends to, and with it where each step's samples are placed over"
    " the DP ranks: the weights so far were trained under one rule, and a resumed run would no longer repeat the"
    " uninterrupted one; start a new run with it",
}
# Keys of other plan sections a user may try mid-run: not --set keys at all, but the refusal says where they change.
NOT_SETTINGS: dict[str, str] = {
    **{
        key: "a layout key: continue at another layout with `train --run-dir D --layout tp=T,pp=P,dp=D`"
        for key in ("tp", "pp", "dp", "cp", "cp_mode", "zero_stage", "recompute", "sequence_parallel")
    },
    **{
        key: "the model's shape: the checkpoint's weights have this shape"
        for key in ("layers", "hidden", "heads", "ffn_hidden")
    },
}
