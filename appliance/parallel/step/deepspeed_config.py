"""The DeepSpeed config for a plan. Each key says where it comes from; nothing here is a free setting."""

from __future__ import annotations

from typing import Any

from appliance.planner.train_settings import DTYPES, engine_zero_stage, overlap_comm

# Dynamic loss scaling for fp16, as BigScience's fp16 runs configured it (bigscience-workshop/bigscience,
# train/tr1-13B-base/tr1-13B-round1.slurm: 13B on Jean Zay's V100-32GB, ZeRO stage 1): start at 2^12, halve
# on an overflow once `hysteresis` overflows have been absorbed, double after `loss_scale_window` clean steps,
# never below `min_loss_scale`. loss_scale 0 is DeepSpeed's switch for dynamic (rather than static) scaling.
FP16_LOSS_SCALING: dict[str, int] = {
    "loss_scale": 0,
    "initial_scale_power": 12,
    "loss_scale_window": 500,
    "hysteresis": 2,
    "min_loss_scale": 1,
}


def deepspeed_config(
    *,
    global_batch_size: int,
    micro_batch_size: int,
    dp: int,
    zero_stage: int,
    dtype: str,
    grad_clip: float,
    pipeline: bool = False,
) -> dict[str, Any]:
    if global_batch_size % (micro_batch_size * dp):
        raise ValueError(f"global batch({global_batch_size}) % (micro-batch({micro_batch_size}) * dp({dp})) != 0")
    if zero_stage not in (0, 1, 2):
        raise ValueError(f"zero stage {zero_stage} is not one of 0, 1, 2")
    if pipeline and zero_stage == 2:
        raise ValueError("ZeRO stage 2 does not combine with pipeline parallelism (DeepSpeed's pipeline engine)")
    # e.g. BLOOM-176B: 2048 global / (2 micro * 8 dp) = 128 micro-batches per step on each pipeline.
    accumulation = global_batch_size // (micro_batch_size * dp)
    config: dict[str, Any] = {
        "train_batch_size": global_batch_size,
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": accumulation,
        "gradient_clipping": grad_clip,
        # train_settings.overlap_comm says why it stays off; the planner credits overlap from the same function.
        "zero_optimization": {"stage": zero_stage, "overlap_comm": overlap_comm(zero_stage, dtype)},
        # We log our own step events; DeepSpeed's periodic prints would interleave with them.
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
    if pipeline:
        # Each TP rank sends the whole activation to the next stage (what the planner counts), rather than
        # 1/tp of it followed by an all-gather inside the next stage's TP group.
        config["pipeline"] = {"pipe_partitioned": False, "grad_partitioned": False}
    if dtype == "bf16":
        # bf16 weights and activations; gradients accumulate in fp32 across micro-batches (BLOOM's recipe:
        # bf16 loses too many low bits to sum 128 micro-batch gradients in place).
        config["bf16"] = {"enabled": True}
        config["data_types"] = {"grad_accum_dtype": "fp32"}
        # ...and are summed over DP in fp32 too: DeepSpeed would otherwise cast the fp32 accumulation buffers to
        # bf16 for the all-reduce, rounding away what the fp32 accumulation kept.
        config["communication_data_type"] = "fp32"
        # BLOOM's optimizer: DeepSpeed's BF16_Optimizer, at stage 1 (engine_zero_stage: 0 and 1 both mean it).
        config["zero_optimization"]["stage"] = engine_zero_stage(zero_stage, dtype)
    elif dtype == "fp16":
        # fp16 weights and activations, fp32 master weights and Adam states in ZeRO's optimizer, the loss scaled
        # before backward and every step whose scaled gradients overflow skipped (DeepSpeed counts them).
        config["fp16"] = {"enabled": True, **FP16_LOSS_SCALING}
        # ZeRO's optimizer, as BigScience's fp16 runs used it; stage 0's fp16 optimizers would get unscaled
        # gradients divided by the scale: updates 4096x too small, clipping that never acts, no overflow ever
        # detected (engine_zero_stage). So 0 and 1 both mean stage 1 here, as for bf16.
        config["zero_optimization"]["stage"] = engine_zero_stage(zero_stage, dtype)
    elif dtype != "fp32":
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    return config
