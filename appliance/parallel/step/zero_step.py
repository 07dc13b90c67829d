"""DeepSpeed's ZeRO stage 1/2 optimizer step in bf16 with its verdicts left on the device.

DeepSpeed's DeepSpeedZeroOptimizer (0.19.8, runtime/zero/stage_1_and_2.py `step`), which bf16 runs through at ZeRO
stage 2, reads on the host every step: whether any gradient is NaN or Inf (`has_overflow`, an `.item()` of the flag
all-reduced over the data- and model-parallel groups), whether the global norm is valid (`is_invalid_grad_norm`, a
`bool()` of a device tensor, once in `step` and once per parameter group in `unscale_and_clip_grads`). Each read
waits for the whole backward, as in DeepSpeed's bf16 optimizer (step/bf16_step.py, which says why that matters and
how torch's fused AdamW takes the decisions instead: `grad_scale` and `found_inf`). Two changes to the instance:

    check_grad_overflow = False   the `has_overflow` pass is not run; in bf16 that also drops `step`'s validity read
                                  (it tests the norm only where `dtype != bfloat16 or check_grad_overflow`). The norm
                                  answers the same question: a NaN or Inf gradient on any rank makes DeepSpeed's norm
                                  (summed over the data- and model-parallel groups) NaN or Inf, which it reports as
                                  -1 per group and Inf combined
    unscale_and_clip_grads        hands the fused AdamW the verdicts (bf16_step.fused_step_verdicts) for the group
                                  DeepSpeed steps next, instead of multiplying the gradient partition by
                                  1 / max(1, (norm + 1e-6) / max_norm) (the loss scale is 1 in bf16):
                                      skip   norm < 0 or not finite                             -> found_inf
                                      scale  max(1, (norm + 1e-6) / max_norm), 1 where skipped  -> grad_scale

Everything else is DeepSpeed's own step: the norm, the fp32 gradient partitions, the fused AdamW (a skipped step
changes neither the fp32 masters, the moments nor the step count), the copy of the masters into the bf16 partition
(bit-identical after a skip) and the all-gather of the updated partitions into the bf16 weights. The reported norm
is Inf for a skipped step, as DeepSpeed reports it. `step` removes the two verdicts from the inner AdamW when it
returns, so nothing else that steps it (a checkpoint load) inherits them.

Used for bf16 where the inner optimizer is torch's fused AdamW (build.adamw_kernel) and DeepSpeed steps it on the
device: no optimizer offload, ZenFlow, torch autocast's GradScaler, MoE expert groups or unnormed steps
(compute_grad_norm = false). Anything else keeps DeepSpeed's step. fp16 has a step of its own (step/fp16_step.py):
there DeepSpeed's backward multiplies the loss by the dynamic loss scale, a Python float, so the scale itself becomes
a device tensor first.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from appliance.parallel.step.bf16_step import fused_step_verdicts

# What the verdicts are called on torch's optimizers (the attributes torch's GradScaler sets before a fused step).
VERDICTS = ("grad_scale", "found_inf")


def keep_zero_verdicts_on_device(optimizer: Any) -> bool:
    """Make a DeepSpeedZeroOptimizer's step read nothing on the host (see the module docstring); False, with the
    optimizer untouched, where the conditions there do not hold."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    if not isinstance(optimizer, DeepSpeedZeroOptimizer):
        return False
    on_the_device = not (
        optimizer.cpu_offload or optimizer.zenflow or optimizer.has_moe_layers or optimizer.torch_autocast_gradscaler
    )
    if optimizer.dtype != torch.bfloat16 or not on_the_device or not optimizer.compute_grad_norm:
        return False
    inner = optimizer.optimizer
    if not isinstance(inner, torch.optim.AdamW) or not all(group.get("fused") for group in inner.param_groups):
        return False
    optimizer.check_grad_overflow = False
    optimizer.unscale_and_clip_grads = _hand_verdicts_to_the_fused_step(optimizer)
    optimizer.step = _step_then_clear_verdicts(optimizer)
    return True


def _hand_verdicts_to_the_fused_step(optimizer: Any) -> Callable[[list[torch.Tensor], torch.Tensor], None]:
    def unscale_and_clip_grads(grad_groups_flat: list[torch.Tensor], total_norm: torch.Tensor) -> None:
        # The gradients stay as they are: the fused kernel divides them by grad_scale.
        skip, scale = fused_step_verdicts(total_norm, optimizer.clip_grad)
        inner = optimizer.optimizer
        inner.grad_scale, inner.found_inf = scale, skip

    return unscale_and_clip_grads


def _step_then_clear_verdicts(optimizer: Any) -> Callable[..., None]:
    deepspeeds_step = optimizer.step

    def step(closure: Any = None) -> None:
        try:
            deepspeeds_step(closure)
        finally:
            inner = optimizer.optimizer
            for name in VERDICTS:
                inner.__dict__.pop(name, None)

    return step
