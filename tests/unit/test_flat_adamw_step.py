"""FlatAdamW (parallel/step/flat_optimizer.py) on a real model's gradients: through the one-pass Triton kernels
(kernels/flat_adamw.py, in Triton's interpreter on CPU), through their torch twins, and as DeepSpeed's bf16 optimizer
steps (fp32 sums of the micro-batches' bf16 gradients, DeepSpeed's own norm and clipping functions, torch's fused
AdamW on fp32 masters, bf16 weights rounded from them), three steps of two micro-batches each, clipping active.

Every optimizer gets the same gradients: one model runs the forward and backward, and its gradients are copied to
the others, so the comparison is of the optimizers alone (a forward on weights one bf16 rounding apart would part the
runs at bf16's noise level, which test_single_replica_step.py bounds for the whole engine).

Floors, measured on the 2-core CPU VM after the three steps, in units of the last place of each buffer's largest
term (ulps_apart): kernels against twins 1.0 on masters, 0.4 on first and second moments, and 0.001% of the bf16
weights one rounding apart. Either against DeepSpeed's arithmetic: 1.0, 1.7 and 6.5. DeepSpeed takes each tensor's
2-norm, one running fp32 sum per tensor on CPU, where both here sum squares in blocks; its norm differed from theirs
by 1.6e-7 relative, its clipping factor carries that and the second moment squares it. (The learning rate is also an
fp32 tensor on the device here where DeepSpeed passes a double.) Bound: 16 units, and one bf16 step (2^-7 relative)
on the weights; a wrong beta, learning rate, clipping or a lost micro-batch moves them by orders more.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from appliance.model.bloom import BloomForCausalLM
from appliance.model.config import BloomConfig
from appliance.parallel.step.flat_optimizer import FlatAdamW

CONFIG = BloomConfig(vocab_size=256, hidden_size=64, n_layer=2, n_head=4)
LR, BETAS, EPS, WEIGHT_DECAY, MAX_NORM = 1e-3, (0.9, 0.95), 1e-8, 0.1, 0.5
STEPS, MICRO_BATCHES = 3, 2
FP32_ULP = torch.finfo(torch.float32).eps


@contextmanager
def _kernels(backend: str) -> Iterator[None]:
    """BLOOM_KERNELS for the optimizer's calls only (the model's forward runs as it would anyway)."""
    saved = os.environ.get("BLOOM_KERNELS")
    os.environ["BLOOM_KERNELS"] = backend
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("BLOOM_KERNELS")
        else:
            os.environ["BLOOM_KERNELS"] = saved


def _model(device: torch.device) -> BloomForCausalLM:
    torch.manual_seed(0)
    return BloomForCausalLM(CONFIG).to(device=device, dtype=torch.bfloat16)


def _optimizer(model: BloomForCausalLM) -> FlatAdamW:
    return FlatAdamW(list(model.named_parameters()), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY,
                     max_grad_norm=MAX_NORM)  # fmt: skip


class DeepSpeedBf16:
    """DeepSpeed's BF16_Optimizer step (0.19.8, runtime/bf16_optimizer.py) for one replica, with its own functions:
    fp32 gradients accumulated per micro-batch, get_global_norm_of_tensors, clip_tensors_by_global_norm, the inner
    torch AdamW (fused, Megatron's decay groups) on fp32 masters, bf16 weights from the masters."""

    def __init__(self, model: BloomForCausalLM) -> None:
        self.params = [p for _, p in model.named_parameters()]
        self.masters = [p.detach().float().clone().requires_grad_() for p in self.params]
        decay = [m for m, p in zip(self.masters, self.params, strict=True) if p.ndim >= 2]
        no_decay = [m for m, p in zip(self.masters, self.params, strict=True) if p.ndim < 2]
        self.inner = torch.optim.AdamW([{"params": decay, "weight_decay": WEIGHT_DECAY},
                                        {"params": no_decay, "weight_decay": 0.0}],
                                       lr=LR, betas=BETAS, eps=EPS, fused=True)  # fmt: skip
        self.sums: list[torch.Tensor | None] = [None] * len(self.params)

    def accumulate(self) -> None:
        for i, p in enumerate(self.params):
            if p.grad is not None:
                g = p.grad.float()
                self.sums[i] = g if self.sums[i] is None else self.sums[i] + g
            p.grad = None

    def step(self) -> torch.Tensor:
        from deepspeed.runtime.utils import clip_tensors_by_global_norm, get_global_norm_of_tensors

        grads = [torch.zeros_like(m) if s is None else s for m, s in zip(self.masters, self.sums, strict=True)]
        norm = get_global_norm_of_tensors(grads)
        clip_tensors_by_global_norm(grads, MAX_NORM, global_norm=norm)
        for master, grad in zip(self.masters, grads, strict=True):
            master.grad = grad
        self.inner.step()
        with torch.no_grad():
            for p, master in zip(self.params, self.masters, strict=True):
                p.copy_(master)
        self.sums = [None] * len(self.params)
        return norm


def _run(device: torch.device) -> dict[str, Any]:
    """Three steps of the model's gradients through the kernels, the twins and DeepSpeed's arithmetic."""
    source = _model(device)
    models = {"triton": _model(device), "reference": _model(device)}
    optimizers = {name: _optimizer(m) for name, m in models.items()}
    deepspeed = DeepSpeedBf16(_model(device)) if device.type == "cpu" else None
    generator = torch.Generator().manual_seed(1)
    norms: dict[str, list[float]] = {name: [] for name in (*models, "deepspeed")}
    for _ in range(STEPS):
        for micro in range(MICRO_BATCHES):
            ids = torch.randint(0, CONFIG.vocab_size, (2, 17), generator=generator).to(device)
            (source.loss(ids[:, :-1], ids[:, 1:]) / MICRO_BATCHES).backward()
            targets = [*(m.parameters() for m in models.values()), *([deepspeed.params] if deepspeed else [])]
            for params in targets:
                for p, q in zip(source.parameters(), params, strict=True):
                    q.grad = None if p.grad is None else p.grad.clone()
            source.zero_grad(set_to_none=True)
            if micro < MICRO_BATCHES - 1:
                for name, optimizer in optimizers.items():
                    with _kernels(name):
                        optimizer.fold_micro_batch()
            if deepspeed is not None:
                deepspeed.accumulate()
        for name, optimizer in optimizers.items():
            with _kernels(name):
                norm, skipped = optimizer.step()
            assert float(skipped) == 0.0
            norms[name].append(float(norm))
        if deepspeed is not None:
            norms["deepspeed"].append(float(deepspeed.step()))
        with torch.no_grad():  # the source follows the kernels' weights
            for p, q in zip(source.parameters(), models["triton"].parameters(), strict=True):
                p.copy_(q)
    # Which path each took: the kernels' tables exist once they have launched.
    ran = {name: optimizer._kernel_map is not None for name, optimizer in optimizers.items()}
    out: dict[str, Any] = {"norms": norms, "kernels_ran": ran}
    for name, optimizer in optimizers.items():
        out[name] = {"master": optimizer.master, "exp_avg": optimizer.exp_avg, "exp_avg_sq": optimizer.exp_avg_sq,
                     "weights": optimizer.weights}  # fmt: skip
    if deepspeed is not None:
        flat = optimizers["reference"]
        state = {"master": torch.zeros_like(flat.master), "exp_avg": torch.zeros_like(flat.master),
                 "exp_avg_sq": torch.zeros_like(flat.master), "weights": torch.zeros_like(flat.weights)}  # fmt: skip
        for p, master, model_param in zip(deepspeed.params, deepspeed.masters, models["reference"].parameters(),
                                          strict=True):  # fmt: skip
            offset, n = flat._offsets[model_param]
            moments = deepspeed.inner.state[master]
            state["master"][offset : offset + n] = master.detach().reshape(-1)
            state["exp_avg"][offset : offset + n] = moments["exp_avg"].reshape(-1)
            state["exp_avg_sq"][offset : offset + n] = moments["exp_avg_sq"].reshape(-1)
            state["weights"][offset : offset + n] = p.detach().reshape(-1)
        out["deepspeed"] = state
    return out


def ulps_apart(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per fp32 buffer, the largest difference in units of the last place of its largest term: the largest value for
    masters and second moments; for the first moment the largest of its values and of sqrt(exp_avg_sq), which bounds
    the (1 - beta1) g every step adds (a sign change cancels much of a moment, not the rounding of its terms)."""
    out = {}
    for key in ("master", "exp_avg", "exp_avg_sq"):
        scale = float(want[key].abs().max())
        if key == "exp_avg":
            scale = max(scale, float(want["exp_avg_sq"].sqrt().max()))
        out[key] = float((got[key] - want[key]).abs().max()) / (FP32_ULP * scale)
    return out


def _assert_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], ulps: float, what: str) -> None:
    apart = ulps_apart(got, want)
    assert max(apart.values()) <= ulps, f"{what}: {apart} units in the last place"
    torch.testing.assert_close(got["weights"].float(), want["weights"].float(), rtol=2**-7, atol=1e-30,
                               msg=lambda m: f"{what} weights: {m}")  # fmt: skip


@pytest.fixture(scope="module")
def runs() -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return _run(device)


def test_kernels_step_as_their_twins(runs: dict) -> None:
    assert runs["kernels_ran"] == {"triton": True, "reference": False}
    _assert_close(runs["triton"], runs["reference"], 16, "kernels against twins")
    torch.testing.assert_close(runs["norms"]["triton"], runs["norms"]["reference"], rtol=1e-6, atol=0)


def test_both_step_as_deepspeeds_bf16_optimizer(runs: dict) -> None:
    if "deepspeed" not in runs:
        pytest.skip("DeepSpeed's reference runs on CPU")
    pytest.importorskip("deepspeed")
    for name in ("triton", "reference"):
        _assert_close(runs[name], runs["deepspeed"], 16, f"{name} against DeepSpeed")
        torch.testing.assert_close(runs["norms"][name], runs["norms"]["deepspeed"], rtol=1e-6, atol=0)
    assert runs["norms"]["deepspeed"][0] > MAX_NORM  # the clipping was exercised
