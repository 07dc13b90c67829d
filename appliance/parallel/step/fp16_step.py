"""DeepSpeed's ZeRO stage 1/2 optimizer step in fp16 with the dynamic loss scale and its verdicts on the device.

In fp16 DeepSpeed's DeepSpeedZeroOptimizer (0.19.8, runtime/zero/stage_1_and_2.py `step`) reads on the host about
six times a step, each a wait for the whole backward (why that matters: step/bf16_step.py): the overflow flag
(`has_overflow`, an `.item()`), the norm's validity (`is_invalid_grad_norm`, tested whenever the dtype is not bf16),
the scaler's branch on that host bool (`update_scale`), `loss_scale == 1.0` in `unscale_and_clip_grads`, and the
engine's `float(loss_scale)` and `was_step_applied()`. The scale itself is a Python float
(DynamicLossScaler.cur_scale) that the backward multiplies the loss by (`scale_if_loss` -> `scale_loss`). Here:

    scaler    DeviceLossScaler replaces the optimizer's DynamicLossScaler: its state (cur_scale, cur_hysteresis,
              cur_iter, last_overflow_iter) as 0-d tensors on the device, DeepSpeed's `update_scale` rule in
              torch.where arithmetic, so the backward multiplies the loss by a device tensor
    norm      DeepSpeed's own scaled global norm (summed over the data- and model-parallel groups, -1 where NaN or
              Inf); the true norm is it / scale, as DeepSpeed divides it
    skip      norm < 0 or not finite: the overflow. A NaN or Inf gradient on any rank makes the summed norm
              non-finite, so the norm answers `has_overflow`'s question without its all-reduce and read
    scale     grad_scale = max(1, (norm + 1e-6) / max_norm) x loss scale, handed to torch's fused AdamW with
              found_inf = skip (DeepSpeed multiplies the gradients by the inverse of the same product, the norm and
              the loss scale there taken with the scale as updated: see `_device_step`)
    step      an overflow runs the fused step skipped (fp32 masters, moments and step count unchanged; the fp16
              weights copied back from the masters, bit-identical) instead of DeepSpeed's early return; the
              gradients are consumed and cleared either way, as DeepSpeed's overflow path clears them. (Overflows
              before the first applied step leave AdamW's moments at zero and its step count at 0 where DeepSpeed
              leaves them uncreated: the same next update, and a checkpoint then holds the zeros.)
    update    the scale is updated on the device after the verdict, before the update of the weights, as DeepSpeed
              updates it

The step's figures for the late read (engine.PendingStep): the scale the step ran at and whether it overflowed above
the minimum scale (`step_figures`). Used where zero_step.py's conditions hold (the fused torch AdamW on the device, no
offload, ZenFlow, torch autocast, MoE groups or unnormed steps) for fp16 with DeepSpeed's dynamic scaler, set to skip
rather than raise at its minimum scale (precision.keep_training_at_the_minimum_scale). fp16 at ZeRO 0 runs this same
optimizer at stage 1 (step/deepspeed_config.py), and DeepSpeed's pipeline engine (pp > 1) steps it too. Anything else
keeps DeepSpeed's step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from appliance.parallel.step.bf16_step import fused_step_verdicts
from appliance.parallel.step.zero_step import VERDICTS


class DeviceLossScaler:
    """DeepSpeed's DynamicLossScaler (0.19.8, runtime/fp16/loss_scaler.py) with its state on the device; the
    attribute names are DeepSpeed's, so the optimizer's `loss_scale` and the checkpoint code read it as they read
    DeepSpeed's. The minimum scale is a device max (DeepSpeed's `raise_error_at_min_scale = False` rule)."""

    dynamic = True
    raise_error_at_min_scale = False

    def __init__(self, deepspeeds: Any, device: torch.device) -> None:
        self.scale_factor = float(deepspeeds.scale_factor)
        self.scale_window = int(deepspeeds.scale_window)
        self.min_scale = float(deepspeeds.min_scale)
        self.delayed_shift = int(deepspeeds.delayed_shift)
        self.consecutive_hysteresis = bool(deepspeeds.consecutive_hysteresis)
        self.dtype = deepspeeds.dtype
        # fp32 holds every scale the rule reaches exactly: powers of two from the start, doubled and halved.
        self.cur_scale = torch.tensor(float(deepspeeds.cur_scale), dtype=torch.float32, device=device)
        self.cur_hysteresis = torch.tensor(int(deepspeeds.cur_hysteresis), dtype=torch.int64, device=device)
        self.cur_iter = torch.tensor(int(deepspeeds.cur_iter), dtype=torch.int64, device=device)
        self.last_overflow_iter = torch.tensor(int(deepspeeds.last_overflow_iter), dtype=torch.int64, device=device)
        # The last step's [scale it ran at, overflowed above the minimum scale] (fp32), for the late read.
        self.last_step = torch.tensor([float(deepspeeds.cur_scale), 0.0], device=device)

    @property
    def loss_scale(self) -> torch.Tensor:
        return self.cur_scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.cur_scale

    def update_scale(self, overflow: torch.Tensor) -> None:
        """DeepSpeed's update_scale with `overflow` a device flag (bool or 0/1). Out of place: a caller that took
        `cur_scale` before keeps the scale its step ran at."""
        overflow = overflow.bool()
        scale, hysteresis = self.cur_scale, self.cur_hysteresis
        # An overflow halves the scale once the hysteresis is down to 1 (at once where it is configured as 1) and
        # otherwise spends one unit of it.
        shrink = overflow if self.delayed_shift == 1 else overflow & (hysteresis == 1)
        # A clean step doubles the scale when (iteration - last overflow - 1) is a positive multiple of the window:
        # one step later than torch's GradScaler, which counts the clean steps since the last change.
        stable = self.cur_iter - self.last_overflow_iter - 1
        grow = ~overflow & (stable > 0) & (torch.remainder(stable, self.scale_window) == 0)
        smaller = torch.clamp(scale / self.scale_factor, min=self.min_scale)
        self.cur_scale = torch.where(shrink, smaller, torch.where(grow, scale * self.scale_factor, scale))
        # The hysteresis refills when the scale grows, or after every clean step under consecutive_hysteresis.
        refill = ~overflow if self.consecutive_hysteresis else grow
        spent = torch.where(overflow & ~shrink, hysteresis - 1, hysteresis)
        self.cur_hysteresis = torch.where(refill, torch.full_like(hysteresis, self.delayed_shift), spent)
        self.last_overflow_iter = torch.where(overflow, self.cur_iter, self.last_overflow_iter)
        self.cur_iter = self.cur_iter + 1
        # What the engine reports as an overflow: a skip the scale can answer (above its minimum); at the minimum
        # the gradients are non-finite unscaled (precision.keep_training_at_the_minimum_scale).
        self.last_step = torch.stack([scale, (overflow & (scale > self.min_scale)).float()])


def keep_fp16_verdicts_on_device(optimizer: Any) -> bool:
    """Install DeviceLossScaler and the step of the module docstring on a DeepSpeedZeroOptimizer in fp16; False,
    with the optimizer untouched, where the conditions there do not hold."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    if not isinstance(optimizer, DeepSpeedZeroOptimizer) or optimizer.dtype != torch.float16:
        return False
    on_the_device = not (
        optimizer.cpu_offload or optimizer.zenflow or optimizer.has_moe_layers or optimizer.torch_autocast_gradscaler
    )
    scaler = optimizer.loss_scaler
    dynamic = type(scaler) is DynamicLossScaler and not scaler.raise_error_at_min_scale
    if not (on_the_device and dynamic and optimizer.compute_grad_norm) or optimizer.custom_loss_scaler:
        return False
    inner = optimizer.optimizer
    if not isinstance(inner, torch.optim.AdamW) or not all(group.get("fused") for group in inner.param_groups):
        return False
    device = optimizer.single_partition_of_fp32_groups[0].device
    optimizer.loss_scaler = DeviceLossScaler(scaler, device)
    # DeepSpeed asks `loss_scale != 1.0` (a host read of the device scale) before it asks whether a group holds a
    # Muon update; AdamW's groups never do.
    optimizer._muon_update_lacks_loss_scale = lambda group: False
    optimizer.step = _device_step(optimizer)
    return True


def step_figures(optimizer: Any) -> torch.Tensor:
    """[scale the last step ran at, 1.0 where it overflowed above the minimum scale], fp32 on the device, unread."""
    return optimizer.loss_scaler.last_step


def _device_step(optimizer: Any) -> Callable[..., None]:
    # The module, not its function: the overlapped parameter gather (zero/param_gather.py) swaps the module's
    # all_gather_dp_groups for its own, and this step must end through whichever is installed.
    from deepspeed import comm
    from deepspeed.runtime.zero import stage_1_and_2

    scaler: DeviceLossScaler = optimizer.loss_scaler

    @torch.no_grad()
    def step(closure: Any = None) -> None:
        if closure is not None:
            raise NotImplementedError(f"{type(optimizer).__name__} does not support closure.")
        optimizer.micro_step_id = stage_1_and_2.INITIAL_MICRO_STEP_ID
        optimizer.overflow = False  # the engine's host-side flag: the verdict itself stays on the device
        ran_at = scaler.cur_scale
        scaled_norm = optimizer.scaled_global_norm()  # -1 where DeepSpeed marks it invalid: < 0 at any scale
        norm = scaled_norm / ran_at
        skip = fused_step_verdicts(norm, optimizer.clip_grad)[0]
        optimizer._global_grad_norm = torch.where(skip.bool(), torch.full_like(norm, float("inf")), norm)
        scaler.update_scale(skip)
        # DeepSpeed unscales and clips with the scale as updated (`unscale_and_clip_grads` reads `loss_scale` after
        # `_update_scale`): on a step that doubles it the gradients are divided by twice the scale the loss was
        # multiplied by, and clipped against half their norm (deepspeedai/DeepSpeed PR #8588's discussion). Kept, so
        # that this step trains as DeepSpeed's own does.
        unscale_by = scaler.cur_scale
        clip = fused_step_verdicts(scaled_norm / unscale_by, optimizer.clip_grad)[1]
        inner = optimizer.optimizer
        inner.grad_scale, inner.found_inf = clip * unscale_by, skip
        try:
            for group in range(len(optimizer.bit16_groups)):
                _step_group(optimizer, group, comm)
        finally:
            for name in VERDICTS:
                inner.__dict__.pop(name, None)
        stage_1_and_2.all_gather_dp_groups(
            groups_flat=optimizer.bit16_groups_flat,
            partitioned_param_groups=optimizer.parallel_partitioned_bit16_groups,
            dp_process_group=optimizer.real_dp_process_group,
            start_alignment_factor=optimizer.nccl_start_alignment_factor,
            allgather_bucket_size=optimizer.allgather_bucket_size,
        )
        for group in range(len(optimizer.bit16_groups)):
            optimizer._update_model_bit16_weights(group)

    return step


def _step_group(optimizer: Any, group: int, comm: Any) -> None:
    """DeepSpeed's step of one parameter group, without offload (0.19.8 `step`, its `else` branch): this rank's fp32
    gradient partition from the reduced fp16 gradients, the fused AdamW (which unscales, clips and skips), the
    updated fp32 partition copied into this rank's fp16 partition."""
    dp_group = optimizer.real_dp_process_group[group]
    partition_id = comm.get_rank(group=dp_group)
    optimizer.free_grad_in_param_list(optimizer.params_not_in_partition[group])
    flat = optimizer._get_preflattened_grad_partition(group)
    if flat is None and partition_id == comm.get_world_size(group=dp_group) - 1:
        # The last partition is padded to the partition size.
        flat = optimizer.flatten_dense_tensors_aligned(
            optimizer.averaged_gradients[group], int(optimizer.partition_size[group])
        )
    elif flat is None:
        flat = optimizer.flatten(optimizer.averaged_gradients[group])
    masters = optimizer.single_partition_of_fp32_groups[group]
    masters.grad = flat.to(masters.dtype)
    del flat
    optimizer.free_grad_in_param_list(optimizer.params_in_partition[group])
    optimizer._release_preflattened_grad_buffers(group)
    optimizer.averaged_gradients[group] = None
    optimizer.all_grad_tensors[group] = None
    optimizer._optimizer_step(group)
    masters.grad = None
    optimizer.parallel_partitioned_bit16_groups[group][partition_id].data.copy_(masters.data)
