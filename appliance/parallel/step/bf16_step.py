"""DeepSpeed's bf16 optimizer step with its verdicts left on the device.

DeepSpeed's BF16_Optimizer (0.19.8, runtime/bf16_optimizer.py `step`) reads two answers on the host every step:
whether the global gradient norm is valid (`is_invalid_grad_norm`, a `bool()` of a device tensor) and whether
clipping applies (`clip_coef < 1` in `clip_tensors_by_global_norm`). Each read waits for the whole backward, so the
host cannot queue the next step's work while this one finishes, and the trainer's one-step-late read of the loss
gains nothing. The same decisions can stay on the device: the inner torch AdamW is fused (engine.adamw_kernel), and a
fused step takes a `grad_scale` to divide the gradients by and a `found_inf` flag that skips the update inside the
kernel (what torch's GradScaler hands it, through the optimizer's `grad_scale` / `found_inf` attributes).

    norm      DeepSpeed's own global norm (its per-tensor norms, summed over the model-parallel group); it marks a
              NaN or Inf norm as -1
    skip      norm < 0 or not finite                                   (a 0-d float on the device)
    scale     max(1, (norm + 1e-6) / max_norm), 1 where skipped        (clipping: DeepSpeed multiplies by its inverse
                                                                         when below 1)
    step      the fused AdamW with grad_scale = scale, found_inf = skip (a skipped step changes neither the fp32
              masters, the moments nor the step count)
    then      DeepSpeed's own tail: bf16 weights from the masters (bit-identical after a skip), gradients cleared

The reported norm is Inf for a skipped step, as DeepSpeed reports it. Used for dense models whose inner optimizer is
fused; anything else (MoE's expert groups, Muon, a non-fused AdamW) keeps DeepSpeed's step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from appliance.parallel.step.grads import CLIP_EPS


def fused_step_verdicts(norm: torch.Tensor, max_norm: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(skip, scale) for torch's fused AdamW from the global gradient norm, both 0-d fp32 on the norm's device: the
    `found_inf` and `grad_scale` of the module docstring's arithmetic. `max_norm` <= 0: no clipping."""
    bad = (norm < 0) | ~torch.isfinite(norm)  # DeepSpeed masks a NaN or Inf norm as -1
    if max_norm > 0:
        scale = torch.clamp((norm + CLIP_EPS) / max_norm, min=1.0)
        scale = torch.where(bad, torch.ones_like(scale), scale)
    else:
        scale = torch.ones_like(norm)
    return bad.float(), scale.float()


def keep_verdicts_on_device(optimizer: Any) -> bool:
    """Replace `optimizer.step` (a DeepSpeed BF16_Optimizer) by one that reads nothing on the host; False, with the
    optimizer untouched, where the conditions in the module docstring do not hold."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

    if not isinstance(optimizer, BF16_Optimizer) or optimizer.has_moe_layers or getattr(optimizer, "_uses_muon", False):
        return False
    inner = optimizer.optimizer
    if not all(group.get("fused") for group in inner.param_groups):
        return False
    optimizer.step = _device_step(optimizer)
    return True


def _device_step(optimizer: Any) -> Callable[..., None]:
    from deepspeed.runtime.utils import get_global_norm_of_tensors

    @torch.no_grad()
    def step(closure: Any = None) -> None:
        if closure is not None:
            raise NotImplementedError(f"{type(optimizer).__name__} does not support closure.")
        optimizer.overflow = False  # the engine's host-side flag: the verdict itself stays on the device
        grads, _ = optimizer.get_grads_for_norm()
        norm = get_global_norm_of_tensors(input_tensors=grads, mpu=optimizer.mpu, norm_type=optimizer.norm_type)
        skip, scale = fused_step_verdicts(norm, optimizer.clip_grad)
        optimizer._global_grad_norm = torch.where(skip.bool(), torch.full_like(norm, float("inf")), norm)
        for param_partition, grad_partition in zip(
            optimizer.fp32_groups_flat_partition, optimizer.fp32_groups_gradient_flat_partition, strict=True
        ):
            param_partition.grad = (
                grad_partition.to(param_partition.dtype)
                if grad_partition.dtype != param_partition.dtype
                else grad_partition
            )
        inner = optimizer.optimizer
        inner.grad_scale, inner.found_inf = scale, skip
        try:
            inner.step()
        finally:
            del inner.grad_scale, inner.found_inf
        if optimizer.grad_acc_dtype is not torch.float32:
            for param_partition in optimizer.fp32_groups_flat_partition:
                param_partition.grad = None
        optimizer._lazy_init_hp_params_optimizer_state()
        optimizer.update_lp_params()
        optimizer.clear_hp_grads()

    return step
