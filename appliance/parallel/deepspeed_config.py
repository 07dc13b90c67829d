"""The DeepSpeed config for a plan. Each key says where it comes from; nothing here is a free setting."""

from __future__ import annotations

from typing import Any


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
        "zero_optimization": {"stage": zero_stage},
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
        # BLOOM's optimizer: DeepSpeed's BF16_Optimizer (fp32 master weights and Adam states sharded over DP,
        # fp32 gradient accumulation), which DeepSpeed selects for bf16 + fp32 accumulation at ZeRO stage 1. Its
        # stage 0 has no bf16 path with fp32 accumulation, so 0 and 1 both mean that optimizer.
        config["zero_optimization"]["stage"] = max(zero_stage, 1)
    elif dtype != "fp32":
        raise ValueError(f"dtype {dtype!r} is not one of bf16, fp32")
    return config
