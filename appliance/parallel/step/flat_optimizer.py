"""AdamW over flat buffers, for a replica that is not data-parallel: a step whose work does not grow with the number
of tensors, and that never waits for the device.

DeepSpeed's bf16 optimizer (0.19.8, runtime/bf16_optimizer.py) loops over every parameter to fold its gradient into
fp32, to take its norm and to clip it, and reads two verdicts on the host each step (`is_invalid_grad_norm`, then
`clip_coef < 1`), so the host waits for the whole backward before it can queue anything else. Without data
parallelism nothing needs its partitions or its reductions, so here the model's parameters and their gradients are
views into one flat buffer each, and a step is a fixed handful of kernels whatever the depth:

    per micro-batch   flat grads (+)= the parameters' gradients   one multi-tensor copy (first micro-batch) or add
                      fp32_grads (+)= flat bf16 grads             one copy or add
    per step          norm^2 = sum of squares of the counted gradients, all-reduced over the model-parallel group
                      skip   = loss or norm not finite                  (stays on the device)
                      scale  = max(1, (norm + 1e-6) / max_norm)       DeepSpeed's clipping, as a divisor
                      torch._fused_adamw_ per weight-decay group, with grad_scale = scale and found_inf = skip
                      bf16 weights <- fp32 masters                      one copy

The update is DeepSpeed's: the bf16 optimizer steps a torch AdamW (fused) on fp32 masters drawn from the bf16
weights, clipped by min(1, max_norm / (norm + 1e-6)); the only difference is that the fused kernel divides by the
inverse of that factor instead of multiplying by it (within one rounding). A non-finite loss or norm skips the
update inside the kernel (`found_inf`): weights, masters, moments and the step count stay as they were, as
DeepSpeed's skip leaves them. The norm counts each parameter once over the replica (grads.counted_in_norm): a
tensor-parallel slice on every TP rank, a replicated one on TP rank 0.

fp32 models keep no second copy: the weights are the masters and their gradient buffer is the fp32 one.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from appliance.parallel.step.grads import CLIP_EPS, counted_in_norm

NamedParams = Sequence[tuple[str, nn.Parameter]]


@dataclass(frozen=True)
class _Group:
    """One weight-decay group's range of the flat buffers: [start, end), of which [start, counted_end) counts in the
    gradient norm on this rank (parameters are ordered counted-first within the group)."""

    start: int
    end: int
    counted_end: int
    weight_decay: float


class FlatAdamW:
    """AdamW (decoupled weight decay, torch's fused kernel) over flat fp32 masters; see the module docstring.

    Takes ownership of the parameters' storage: each parameter's data and gradient become views into the flat
    buffers (their values are kept). `param_groups` and `state` present the two groups' flat masters as a torch
    optimizer would, for code that walks an optimizer; `param_state(param)` gives one parameter's views.
    """

    def __init__(
        self,
        named_params: NamedParams,
        *,
        lr: float,
        betas: tuple[float, float],
        eps: float,
        weight_decay: float,
        max_grad_norm: float,
        tp_rank: int = 0,
        norm_group: dist.ProcessGroup | None = None,
    ) -> None:
        params = [p for _, p in named_params]
        if not params:
            raise ValueError("FlatAdamW needs at least one parameter")
        dtypes = {p.dtype for p in params}
        devices = {p.device for p in params}
        if len(dtypes) != 1 or len(devices) != 1:
            raise ValueError(f"FlatAdamW needs one dtype and one device, got {sorted(map(str, dtypes))} on "
                             f"{sorted(map(str, devices))}")  # fmt: skip
        self.dtype, self.device = dtypes.pop(), devices.pop()
        if self.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"FlatAdamW steps fp32 or bf16 weights, got {self.dtype}")
        self.betas, self.eps, self.max_grad_norm = betas, eps, max_grad_norm
        self.norm_group = norm_group
        # Megatron's split (engine.param_groups): decay on matrices, none on biases and LayerNorm weights; within a
        # group the parameters this rank counts in the norm come first, so the counted part is one slice.
        ordered: list[nn.Parameter] = []
        groups: list[_Group] = []
        for decay, group_wd in ((True, weight_decay), (False, 0.0)):
            members = [p for p in params if (p.ndim >= 2) == decay]
            counted = [p for p in members if counted_in_norm(p, tp_rank)]
            rest = [p for p in members if not counted_in_norm(p, tp_rank)]
            start = sum(p.numel() for p in ordered)
            ordered += counted + rest
            groups.append(_Group(start, start + sum(p.numel() for p in members),
                                 start + sum(p.numel() for p in counted), group_wd))  # fmt: skip
        self._groups = [g for g in groups if g.end > g.start]
        total = sum(p.numel() for p in ordered)
        self.weights = torch.empty(total, dtype=self.dtype, device=self.device)
        self._offsets: dict[nn.Parameter, tuple[int, int]] = {}
        offset = 0
        with torch.no_grad():
            for p in ordered:
                n = p.numel()
                self.weights[offset : offset + n].copy_(p.reshape(-1))
                p.data = self.weights[offset : offset + n].view_as(p)
                p.grad = None
                self._offsets[p] = (offset, n)
                offset += n
        self._params = ordered
        # bf16: fp32 masters drawn from the bf16 weights (as DeepSpeed's bf16 optimizer draws them); fp32: the weights.
        self.master = self.weights.float() if self.dtype != torch.float32 else self.weights
        # Adam's step count, float32 on the device as the fused kernel reads it; a skipped step does not count.
        self.step_count = torch.zeros((), dtype=torch.float32, device=self.device)
        self._folded = 0  # micro-batches folded into master_grads since the last step
        self.param_groups: list[dict[str, Any]] = [
            {"params": [self.master[g.start : g.end]], "lr": lr, "weight_decay": g.weight_decay} for g in self._groups
        ]
        # The gradient buffers and Adam's moments come with the first backward and the first step (or a checkpoint's
        # state), as torch's and DeepSpeed's optimizers make theirs: building the engine holds the weights alone.
        self.grads: torch.Tensor | None = None  # the weights' dtype; for fp32 weights also the step's sum
        self.master_grads: torch.Tensor | None = None  # fp32: the gradient sum over the step's micro-batches
        self._grad_views: list[torch.Tensor] = []
        self.exp_avg: torch.Tensor | None = None
        self.exp_avg_sq: torch.Tensor | None = None
        self.state: dict[torch.Tensor, dict[str, torch.Tensor]] = {}

    def _gradient_buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(the flat gradients in the weights' dtype, the fp32 sum), made at first use."""
        if self.grads is None or self.master_grads is None:
            self.grads = torch.empty_like(self.weights)
            # bf16: an fp32 sum over the step's micro-batches (BLOOM's recipe); fp32: the flat gradients themselves.
            self.master_grads = torch.empty_like(self.master) if self.master is not self.weights else self.grads
            # Autograd hands each parameter a fresh gradient (no kernel: it keeps the tensor the backward made); a
            # defined .grad would instead be added into in place, one kernel per parameter and micro-batch (on an
            # H200 at bloom-560m, 294 of a step's 1381 launches). The fold moves them all at once.
            self._grad_views = [self.grads[o : o + n].view_as(p) for p, (o, n) in self._offsets.items()]
        return self.grads, self.master_grads

    def _moments(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Adam's (exp_avg, exp_avg_sq), fp32 zeros made at first use; `state` then presents them per group."""
        if self.exp_avg is None or self.exp_avg_sq is None:
            self.exp_avg = torch.zeros_like(self.master)
            self.exp_avg_sq = torch.zeros_like(self.master)
            for group, g in zip(self.param_groups, self._groups, strict=True):
                self.state[group["params"][0]] = {
                    "exp_avg": self.exp_avg[g.start : g.end],
                    "exp_avg_sq": self.exp_avg_sq[g.start : g.end],
                    "step": self.step_count,
                }
        return self.exp_avg, self.exp_avg_sq

    # ---- per parameter (checkpoints) ------------------------------------------------------------------------
    def parameters(self) -> Iterator[nn.Parameter]:
        return iter(self._params)

    def owns(self, param: torch.Tensor) -> bool:
        return param in self._offsets

    def param_state(self, param: nn.Parameter) -> dict[str, torch.Tensor]:
        """Views of one parameter's fp32 state: exp_avg, exp_avg_sq, master (bf16 weights only), and the shared step
        count (0-d)."""
        offset, n = self._offsets[param]
        exp_avg, exp_avg_sq = self._moments()
        views = {
            "exp_avg": exp_avg[offset : offset + n].view_as(param),
            "exp_avg_sq": exp_avg_sq[offset : offset + n].view_as(param),
        }
        if self.master is not self.weights:
            views["master"] = self.master[offset : offset + n].view_as(param)
        return views | {"step": self.step_count}

    @torch.no_grad()
    def set_master(self, param: nn.Parameter, value: torch.Tensor) -> None:
        """The fp32 master of `param` (and the weight, rounded to its dtype) from a whole fp32 tensor."""
        offset, n = self._offsets[param]
        self.master[offset : offset + n].copy_(value.reshape(-1))
        if self.master is not self.weights:
            self.weights[offset : offset + n].copy_(self.master[offset : offset + n])

    # ---- the step -----------------------------------------------------------------------------------------
    @torch.no_grad()
    def fold_micro_batch(self) -> None:
        """After a micro-batch's backward: its gradients into the flat buffer (one multi-tensor copy, or add after
        the first micro-batch of a step, for fp32 weights), and for bf16 weights from there into the fp32 sum; the
        parameters' gradients are released. A parameter the backward did not reach adds nothing."""
        flat, fp32_sum = self._gradient_buffers()
        reached = [(view, p.grad) for view, p in zip(self._grad_views, self._params, strict=True) if p.grad is not None]
        views, grads = [v for v, _ in reached], [g for _, g in reached]
        into_flat_sum = fp32_sum is flat and self._folded > 0  # fp32: the flat buffer is the sum
        if len(reached) < len(self._params) and not into_flat_sum:
            flat.zero_()  # a parameter the backward did not reach adds zero
        if views:
            if into_flat_sum:
                torch._foreach_add_(views, grads)
            else:
                torch._foreach_copy_(views, grads)
        for p in self._params:
            p.grad = None
        if fp32_sum is not flat:
            if self._folded == 0:
                fp32_sum.copy_(flat)
            else:
                fp32_sum.add_(flat)
        self._folded += 1

    @torch.no_grad()
    def step(self, loss: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Clip and update; returns (the gradient norm before clipping, 1.0 if the update was skipped else 0.0), both
        0-d fp32 tensors on the device, never read here. `loss`: the step's loss; a non-finite one skips the update
        too (its gradients are usually non-finite as well)."""
        if self._folded == 0:  # no backward since the last step: a zero gradient (the update is the weight decay)
            self._gradient_buffers()[1].zero_()
        grads = self._gradient_buffers()[1]
        exp_avg, exp_avg_sq = self._moments()
        squares = torch.stack([grads[g.start : g.counted_end].pow(2).sum() for g in self._groups]).sum()
        if self.norm_group is not None and dist.get_world_size(self.norm_group) > 1:
            dist.all_reduce(squares, group=self.norm_group)
        norm = squares.sqrt()
        bad = ~torch.isfinite(norm)
        if loss is not None:
            bad = bad | ~torch.isfinite(loss)
        skipped = bad.float()
        if self.max_grad_norm > 0 and self.max_grad_norm != float("inf"):
            # DeepSpeed multiplies by max_norm / (norm + eps) when that is below 1; the kernel divides by its inverse.
            scale = torch.clamp((norm + CLIP_EPS) / self.max_grad_norm, min=1.0)
            scale = torch.where(bad, torch.ones_like(scale), scale)  # the kernel skips anyway; keep it finite
        else:
            scale = torch.ones_like(norm)
        self.step_count.add_(1.0 - skipped)
        beta1, beta2 = self.betas
        for group, g in zip(self.param_groups, self._groups, strict=True):
            torch._fused_adamw_(
                [self.master[g.start : g.end]], [grads[g.start : g.end]],
                [exp_avg[g.start : g.end]], [exp_avg_sq[g.start : g.end]], [], [self.step_count],
                lr=float(group["lr"]), beta1=beta1, beta2=beta2, weight_decay=g.weight_decay, eps=self.eps,
                amsgrad=False, maximize=False, grad_scale=scale, found_inf=skipped,
            )  # fmt: skip
        if self.master is not self.weights:
            self.weights.copy_(self.master)
        self._folded = 0  # the next step's first micro-batch overwrites the flat gradients
        return norm, skipped

    def zero_grad(self) -> None:
        """Forget the gradients of a step that will not be taken (a step's micro-batches thrown away)."""
        for p in self._params:
            p.grad = None
        self._folded = 0
