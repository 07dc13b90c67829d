"""AdamW over flat buffers, for a replica that is not data-parallel: a step whose work does not grow with the number
of tensors, that never waits for the device, and that moves each byte of optimizer state once.

DeepSpeed's bf16 optimizer (0.19.8, runtime/bf16_optimizer.py) loops over every parameter to fold its gradient into
fp32, to take its norm and to clip it, and reads two verdicts on the host each step (`is_invalid_grad_norm`, then
`clip_coef < 1`), so the host waits for the whole backward before it can queue anything else. Without data
parallelism nothing needs its partitions or its reductions, so here the model's parameters are views into one flat
buffer, the fp32 masters and Adam's moments are flat buffers beside it, and a step is a fixed handful of kernels
whatever the depth (kernels/flat_adamw.py on a GPU; the torch twins in kernels/reference.py elsewhere):

    per micro-batch but the last   grad_sum (+)= the parameters' gradients, in fp32       one fold, read in place
    per step        norm^2 = sum of squares of (grad_sum +) the last micro-batch's gradients over the counted ones,
                             all-reduced over the model-parallel group                    one read-only pass
                    skip   = loss or norm not finite                                      (stays on the device)
                    clip   = min(1, max_norm / (norm + 1e-6))                             DeepSpeed's clipping factor
                    AdamW of masters and moments from (grad_sum +) gradients x clip, bf16 weights rounded from the
                    masters, nothing written where skip                                   one pass

The update is DeepSpeed's: the bf16 optimizer steps torch's fused AdamW on fp32 masters drawn from the bf16 weights,
the gradients (summed in fp32 over the step's micro-batches) multiplied by DeepSpeed's factor when it is below 1. A
non-finite loss or norm skips the update on the device: weights, masters, moments and the step count stay as they
were, as DeepSpeed's skip leaves them. The norm counts each parameter once over the replica (grads.counted_in_norm): a
tensor-parallel slice on every TP rank, a replicated one on TP rank 0.

Bytes moved per parameter with bf16 weights and one micro-batch a step: the norm reads the bf16 gradient (2); the
update reads it again (2) and the fp32 master and moments (12), and writes those (12) and the bf16 weight (2): 30,
against about 60 before (a copy of the gradients into a flat bf16 buffer and then an fp32 one, a norm through a
gradient-sized temporary, torch's fused AdamW, which writes the clipped gradients back, and a separate cast). With
more micro-batches the earlier ones are folded into an fp32 sum (6 bytes for the first, 10 for each next), which the
norm and the update read too (4 each). tests/unit/test_optimizer_bytes.py counts them from the loads and stores made.
Each parameter starts at a multiple of 16 elements in the flat buffers, so the kernels' loads are whole vectors.

What a CUDA graph needs of the step holds here (tests/distributed/test_capturable_step.py): nothing is read on the
host; the learning rate is a device tensor (setting `param_groups[i]["lr"]` writes it, between steps), as are the
step count and the verdicts; the kernels' other arguments are the run's constants; the flat buffers and the kernels'
tables are made once. The gradients' addresses go to the device before each launch that reads them (one small
host-to-device copy; FlatGradients.point_at): a capture records that copy, and autograd's gradients keep their
addresses from one replay to the next, as a graph's allocations do.

fp32 models keep no second copy: the weights are the masters.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from appliance.parallel.step.grads import CLIP_EPS, counted_in_norm
from kernels import reference, registry
from kernels.launch import gpu_target
from kernels.reference import FLAT_ALIGNMENT

NamedParams = Sequence[tuple[str, nn.Parameter]]


@dataclass(frozen=True)
class _Group:
    """One weight-decay group's range of the flat buffers: [start, end), of which [start, counted_end) counts in the
    gradient norm on this rank (parameters are ordered counted-first within the group)."""

    start: int
    end: int
    counted_end: int
    weight_decay: float


class ParamGroup(dict[str, Any]):
    """A torch-style parameter group whose learning rate also lives on the device: setting "lr" writes the device
    copy the step reads, so the step itself takes no host scalar (what a captured step needs) and a schedule's change
    is one small write between steps."""

    def __init__(self, values: dict[str, Any], device_lr: torch.Tensor) -> None:
        super().__init__(values)
        self._device_lr = device_lr
        device_lr.fill_(float(values["lr"]))

    def __setitem__(self, key: str, value: Any) -> None:
        super().__setitem__(key, value)
        if key == "lr":
            self._device_lr.fill_(float(value))


def one_pass_backend(t: torch.Tensor) -> str:
    """The optimizer's backend for state on t's device: "triton" (kernels/flat_adamw.py) or "reference" (the torch
    twins), as the kernel registry answers for the model's ops (CUDA: Triton; BLOOM_KERNELS may force either). Under
    kernels.launch.recording for a GPU, on meta tensors, the Triton launches are recorded."""
    if t.device.type == "meta" and gpu_target(t) is not None:
        return "triton"
    return registry.get_backend(t)


class FlatAdamW:
    """AdamW (decoupled weight decay, DeepSpeed's arithmetic) over flat fp32 masters; see the module docstring.

    Takes ownership of the parameters' storage: each parameter's data becomes a view into the flat weights (its values
    kept). `param_groups` and `state` present the two groups' flat masters as a torch optimizer would, for code that
    walks an optimizer; `param_state(param)` gives one parameter's views.
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
        offsets: list[int] = []
        groups: list[_Group] = []
        end = 0
        for decay, group_wd in ((True, weight_decay), (False, 0.0)):
            members = [p for p in params if (p.ndim >= 2) == decay]
            counted = [p for p in members if counted_in_norm(p, tp_rank)]
            rest = [p for p in members if not counted_in_norm(p, tp_rank)]
            start = end
            for p in counted:
                offsets.append(end)
                end += -(-p.numel() // FLAT_ALIGNMENT) * FLAT_ALIGNMENT
            counted_end = end
            for p in rest:
                offsets.append(end)
                end += -(-p.numel() // FLAT_ALIGNMENT) * FLAT_ALIGNMENT
            ordered += counted + rest
            if end > start:
                groups.append(_Group(start, end, counted_end, group_wd))
        self._groups = groups
        # Empty, not zeros: pages of a large CPU buffer are touched only when written, so moving each parameter in and
        # dropping its old storage at once keeps the peak near one model (zeros first held two: 788 MiB against 388
        # for tests/distributed/test_init_shards.py's model). The padding between parameters is zeroed alone, so it
        # stays zero and finite in every buffer drawn from this one.
        self.weights = torch.empty(end, dtype=self.dtype, device=self.device)
        self._offsets: dict[nn.Parameter, tuple[int, int]] = {}
        with torch.no_grad():
            for p, offset, pad_end in zip(ordered, offsets, [*offsets[1:], end], strict=True):
                n = p.numel()
                self.weights[offset : offset + n].copy_(p.reshape(-1))
                self.weights[offset + n : pad_end].zero_()
                p.data = self.weights[offset : offset + n].view_as(p)
                p.grad = None
                self._offsets[p] = (offset, n)
        self._params = ordered
        self._tensor_groups = [next(i for i, g in enumerate(groups) if g.start <= o < g.end) for o in offsets]
        self._counted = [counted_in_norm(p, tp_rank) for p in ordered]
        self._counted_spans = [(g.start, g.counted_end) for g in groups]  # the padding between adds zeros
        # bf16: fp32 masters drawn from the bf16 weights (as DeepSpeed's bf16 optimizer draws them); fp32: the weights.
        self.master = self.weights.float() if self.dtype != torch.float32 else self.weights
        # Adam's step count, float32 on the device as the fused kernels read it; a skipped step does not count.
        self.step_count = torch.zeros((), dtype=torch.float32, device=self.device)
        self._folded = 0  # micro-batches folded into grad_sum since the last step
        # The learning rate of each group on the device, written when a group's "lr" is set (ParamGroup).
        self.lr = torch.zeros(len(groups), dtype=torch.float32, device=self.device)
        self.param_groups: list[dict[str, Any]] = [
            ParamGroup({"params": [self.master[g.start : g.end]], "lr": lr, "weight_decay": g.weight_decay},
                       self.lr[i])
            for i, g in enumerate(groups)
        ]  # fmt: skip
        # The fp32 sum over a step's micro-batches before its last, and Adam's moments, come with their first use (or a
        # checkpoint's state), as torch's and DeepSpeed's optimizers make theirs: building the engine holds the
        # weights alone. With one micro-batch a step there is no gradient buffer at all.
        self.grad_sum: torch.Tensor | None = None
        self.exp_avg: torch.Tensor | None = None
        self.exp_avg_sq: torch.Tensor | None = None
        self.state: dict[torch.Tensor, dict[str, torch.Tensor]] = {}
        self._kernel_map: Any = None  # kernels.flat_adamw.FlatGradients, made at the first Triton launch
        self._twin_flat: torch.Tensor | None = None  # the torch twins' step gradient (_twin_gradient)
        self._twin_views: list[torch.Tensor] = []
        self._sum_views: list[torch.Tensor] = []

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

    def _gradients(self) -> list[torch.Tensor | None]:
        """The parameters' gradients as autograd left them (None where the backward did not reach one)."""
        return [p.grad for p in self._params]

    def _twin_gradient(self) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The torch twins' fp32 gradient buffer and its view per parameter, made once (the kernels need neither:
        they read each gradient where autograd left it)."""
        if self._twin_flat is None:
            self._twin_flat = torch.zeros_like(self.master)
            self._twin_views = self._views(self._twin_flat)
        return self._twin_flat, self._twin_views

    def _views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [flat[o : o + n].view_as(p) for p, (o, n) in self._offsets.items()]

    def _release_gradients(self) -> None:
        for p in self._params:
            p.grad = None

    def _map(self) -> Any:
        """The Triton kernels' tables (kernels/flat_adamw.py), made once."""
        if self._kernel_map is None:
            from kernels.flat_adamw import FlatGradients

            self._kernel_map = FlatGradients(
                [self._offsets[p][0] for p in self._params], [p.numel() for p in self._params], self._tensor_groups,
                self._counted, [g.weight_decay for g in self._groups], self.dtype, self.device,
            )  # fmt: skip
        return self._kernel_map

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
        """After the backward of a micro-batch that is not the step's last: its gradients into the fp32 sum (one
        pass, reading them where autograd left them), then released. The last micro-batch's gradients stay for
        `step`, which reads them in place. A parameter the backward did not reach adds nothing."""
        if self.grad_sum is None:
            self.grad_sum = torch.zeros_like(self.master)
            self._sum_views = self._views(self.grad_sum)
        grads = self._gradients()
        if one_pass_backend(self.master) == "triton":
            from kernels import flat_adamw

            self._map().point_at(grads)
            flat_adamw.fold_(self._map(), self.grad_sum, accumulate=self._folded > 0)
        else:
            folded = self.grad_sum if self._folded > 0 else None
            reference.flat_gradient_(self.grad_sum, self._sum_views, grads, folded)
        self._release_gradients()
        self._folded += 1

    @torch.no_grad()
    def step(self, loss: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Clip and update from the gradients the parameters hold (the step's last micro-batch) plus those folded
        before; returns (the gradient norm before clipping, 1.0 if the update was skipped else 0.0), both 0-d fp32
        tensors on the device, never read here. `loss`: the step's loss; a non-finite one skips the update too (its
        gradients are usually non-finite as well). With no backward since the last step the gradient is zero (the
        update is the weight decay)."""
        exp_avg, exp_avg_sq = self._moments()
        grads = self._gradients()
        grad_sum = self.grad_sum if self._folded > 0 else None
        weights = self.weights if self.master is not self.weights else None
        triton = one_pass_backend(self.master) == "triton"
        if triton:
            from kernels import flat_adamw

            self._map().point_at(grads)
            squares = flat_adamw.sum_of_squares(self._map(), grad_sum)
        else:
            flat_grad = reference.flat_gradient_(*self._twin_gradient(), grads, grad_sum)
            squares = reference.flat_sum_of_squares(flat_grad, self._counted_spans)
        norm, clip, skip = self._verdicts(squares, loss)
        self.step_count.add_(1.0 - skip)
        settings: dict[str, Any] = {"lr": self.lr, "step": self.step_count, "clip": clip, "skip": skip,
                                    "betas": self.betas, "eps": self.eps}  # fmt: skip
        if triton:
            flat_adamw.adamw_(self._map(), grad_sum, self.master, exp_avg, exp_avg_sq, weights, **settings)
        else:
            groups = [(g.start, g.end, g.weight_decay) for g in self._groups]
            reference.flat_adamw_(self.master, exp_avg, exp_avg_sq, weights, flat_grad, groups, **settings)
        self._release_gradients()
        self._folded = 0  # the next step's first fold overwrites the sum
        return norm, skip

    def _verdicts(
        self, squares: torch.Tensor, loss: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(norm, clip, skip) on the device from this rank's sum of squares: the norm over the replica, DeepSpeed's
        clipping factor min(1, max_norm / (norm + 1e-6)) (its expression, so the same rounding), and 1.0 where the
        norm or the loss is not finite."""
        if self.norm_group is not None and dist.get_world_size(self.norm_group) > 1:
            dist.all_reduce(squares, group=self.norm_group)
        norm = squares.sqrt()
        bad = ~torch.isfinite(norm)
        if loss is not None:
            bad = bad | ~torch.isfinite(loss)
        if 0 < self.max_grad_norm < float("inf"):
            clip = torch.clamp(self.max_grad_norm / (norm + CLIP_EPS), max=1.0)
        else:
            clip = torch.ones_like(norm)
        return norm, clip, bad.float()

    def zero_grad(self) -> None:
        """Forget the gradients of a step that will not be taken (a step's micro-batches thrown away)."""
        self._release_gradients()
        self._folded = 0
