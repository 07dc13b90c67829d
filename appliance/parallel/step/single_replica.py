"""The step of a replica that is neither data- nor pipeline-parallel (dp x cp = 1, pp = 1): the model, one flat
optimizer and nothing else between them.

At one replica DeepSpeed has nothing to distribute: no gradient to reduce, no optimizer state to partition, no
pipeline to schedule. Its engine would still wrap every micro-batch in hooks, loop over the parameters to fold,
norm, clip and zero their gradients, and read its verdicts on the host. This engine runs the same arithmetic
(gradients scaled by 1 / micro-batches, fp32 accumulation in bf16, DeepSpeed's clipping, torch's fused AdamW's
update) with flat buffers and one pass over the optimizer's state (step/flat_optimizer.py, kernels/flat_adamw.py), and
leaves every figure on the device, so a step queues its work without waiting (and is what a CUDA graph could capture:
tests/distributed/test_capturable_step.py). Tensor parallelism is unaffected: it lives inside the layers, and the
gradient norm is summed over the replica's model-parallel group.

It answers the part of DeepSpeed's engine interface that ParallelEngine uses (forward, backward, step, the
accumulation boundary, train/eval, the module, the device, the optimizer, the config), so the rest of the engine
treats both alike.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from appliance.parallel.step.flat_optimizer import FlatAdamW


class SingleReplicaEngine:
    """A DeepSpeed-engine-shaped driver of `module` with `optimizer` (see the module docstring)."""

    def __init__(
        self, module: nn.Module, optimizer: FlatAdamW, *, config: dict[str, Any], micro_batch_size: int
    ) -> None:
        self.module = module
        self.optimizer = optimizer
        self.device = optimizer.device
        self.config = config  # what ds_config.json records for this launch
        self.micro_batch_size = micro_batch_size
        self._accumulation = int(config["gradient_accumulation_steps"])
        self._boundary = True
        self.global_steps = 0
        # The last step's figures on the device: (gradient norm, 1.0 when the update was skipped)
        self.last_figures: tuple[torch.Tensor, torch.Tensor] | None = None

    # ---- DeepSpeed's engine interface, as ParallelEngine uses it ------------------------------------------------
    def __call__(self, *inputs: torch.Tensor) -> Any:
        return self.module(*inputs)

    def train(self, mode: bool = True) -> None:
        self.module.train(mode)

    def eval(self) -> None:
        self.module.eval()

    def gradient_accumulation_steps(self) -> int:
        return self._accumulation

    def set_train_batch_size(self, samples: int) -> None:
        """Samples per step (one replica): the step's micro-batches follow from the micro-batch size."""
        if samples % self.micro_batch_size:
            raise ValueError(f"a step of {samples} samples is not whole micro-batches of {self.micro_batch_size}")
        self._accumulation = samples // self.micro_batch_size

    def set_gradient_accumulation_boundary(self, boundary: bool) -> None:
        self._boundary = boundary

    def backward(self, loss: torch.Tensor) -> None:
        """The micro-batch's gradient, scaled by 1 / micro-batches as DeepSpeed scales it. Before the accumulation
        boundary it is folded into the step's fp32 sum; the last micro-batch's stays where autograd left it, for the
        step to read in place."""
        (loss / self._accumulation).backward()
        if not self._boundary:
            self.optimizer.fold_micro_batch()

    def step(self, loss: torch.Tensor | None = None) -> None:
        """The update at the accumulation boundary (a no-op before it, as DeepSpeed's). `loss`: the step's loss,
        whose non-finite value skips the update like a non-finite gradient."""
        if not self._boundary:
            return
        self.last_figures = self.optimizer.step(loss)
        self.global_steps += 1

    def get_global_grad_norm(self) -> torch.Tensor | None:
        return None if self.last_figures is None else self.last_figures[0]

    def bfloat16_enabled(self) -> bool:
        return self.optimizer.dtype == torch.bfloat16

    def fp16_enabled(self) -> bool:
        return False

    def zero_optimization(self) -> bool:
        return False

    def zero_optimization_stage(self) -> int:
        return 0
