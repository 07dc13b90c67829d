"""fp16 under DeepSpeed: whether this machine can train in it, and the dynamic loss scaler's state.

DeepSpeed decides whether a device can train in fp16 by asking its accelerator (``is_fp16_supported``), inside
``deepspeed.initialize`` on every rank, and answers "Type fp16 is not supported on your device." there, once per
rank and agent restart. ``check_fp16_supported`` asks the same accelerator the same question before any rank
starts, and names the device and the fix.

The loss scaler (DeepSpeed's DynamicLossScaler, held by ZeRO's optimizer, which fp16 always uses here:
step/deepspeed_config.py) keeps its scale, the hysteresis left and its iteration counters. None of that is in the
optimizer state our checkpoints take (checkpoint/optimizer_state.py: Adam's moments and the masters), so the trainer
saves it with each checkpoint: a resumed run continues at the scale it had reached instead of starting over at 2^12 (and
overflowing its way back down, or climbing back up one doubling per 500 clean steps).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from appliance.errors import BadInput

# The scaler's state, under the names a checkpoint manifest keeps them (DynamicLossScaler's attribute names in
# DeepSpeed 0.19.8 on the right).
SCALER_FIELDS = {
    "scale": "cur_scale",
    "hysteresis_left": "cur_hysteresis",
    "iteration": "cur_iter",
    "last_overflow_iteration": "last_overflow_iter",
}
FIX = "train in fp32 (`--set dtype=fp32`), or in bf16 (`--set dtype=bf16`) where the device has it"


def _accelerator() -> Any:
    from deepspeed.accelerator import get_accelerator

    return get_accelerator()


def fp16_refusal(accelerator: Any) -> str | None:
    """Why DeepSpeed's `accelerator` cannot train in fp16 (the device named), or None when it can."""
    if accelerator.is_fp16_supported():
        return None
    kind = accelerator.device_name()
    if kind == "cpu":
        import torch

        # DeepSpeed's CPU accelerator: fp16 only where oneDNN has fp16 kernels (AVX512-FP16 or AMX-FP16).
        best = torch.backends.cpu.get_cpu_capability()
        return (
            "this CPU (DeepSpeed's CPU accelerator needs oneDNN fp16 kernels, AVX512-FP16 or AMX-FP16; "
            f"the best this CPU has is {best})"
        )
    if kind == "cuda":
        import torch

        major, minor = torch.cuda.get_device_capability()
        return f"{torch.cuda.get_device_name()} (compute capability {major}.{minor}; DeepSpeed needs 7.0 for fp16)"
    return f"DeepSpeed's {kind} accelerator (it reports no fp16 support)"


def check_fp16_supported(dtype: str, source: str, accelerator: Any = None) -> None:
    """BadInput naming the device and the fix when the plan trains in fp16 and DeepSpeed's accelerator on this
    machine (`accelerator`, default: the one the ranks will get) cannot. Nothing to check for bf16 and fp32."""
    if dtype != "fp16":
        return
    refusal = fp16_refusal(accelerator if accelerator is not None else _accelerator())
    if refusal is not None:
        raise BadInput(
            f"{source}: the plan trains in fp16 (train.dtype), which DeepSpeed cannot do on {refusal}: {FIX}"
        )


def loss_scaler_state(optimizer: Any) -> dict[str, float]:
    """The dynamic loss scaler's state in ZeRO's fp16 `optimizer`, as a checkpoint manifest keeps it (DeepSpeed's
    scaler or the device one of step/fp16_step.py, whose tensors this reads on the host)."""
    scaler = optimizer.loss_scaler
    return {key: float(getattr(scaler, attr)) for key, attr in SCALER_FIELDS.items()}


def load_loss_scaler_state(optimizer: Any, state: Mapping[str, float]) -> None:
    """Set the scaler from what ``loss_scaler_state`` returned (every rank the same, so they agree on overflows)."""
    import torch

    scaler = optimizer.loss_scaler
    missing = [key for key in SCALER_FIELDS if key not in state]
    if missing:
        raise ValueError(f"loss scaler state lacks {missing}")
    for key, attr in SCALER_FIELDS.items():
        value = float(state[key]) if key == "scale" else int(state[key])
        current = getattr(scaler, attr)
        if isinstance(current, torch.Tensor):
            current.fill_(value)  # the device scaler's state (step/fp16_step.py), in place on its device
        else:
            setattr(scaler, attr, value)


def keep_training_at_the_minimum_scale(optimizer: Any) -> float:
    """Make the scaler skip, rather than raise, when the gradients overflow at its minimum scale; returns that
    minimum. DeepSpeed would stop the rank with a bare Exception, and the elastic agent restart into the same
    step. At the minimum scale an overflow is no scaling accident: the gradients are non-finite unscaled, and the
    trainer treats the step as it treats a NaN loss (skipped, and rolled back after nan_rollback_after in a row)."""
    scaler = optimizer.loss_scaler
    scaler.raise_error_at_min_scale = False
    return float(scaler.min_scale)
