"""The single-process reference the layout tests compare against: a plain BloomForCausalLM and torch's AdamW, no
DeepSpeed and no process group, trained step by step the way the Trainer does (lr for the samples a step consumes
taken at their end, gradient mean over the step's micro-batches, global-norm clipping).

Its summation order is a parameter (``noise_floor.Order``), so the same function gives the reference and the
reorderings that measure the noise floor; it runs at a pinned thread count, so the pytest process's own thread
count never enters.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from noise_floor import BASE, Order, pinned_threads

from appliance.model.bloom import BloomForCausalLM
from appliance.model.config import BloomConfig
from appliance.model.ops import cross_entropy
from appliance.parallel.step.build import param_groups


@dataclass(frozen=True)
class Recipe:
    """What the layouts train: model, seed, optimizer, clipping, micro-batch size, and per step the first sample
    and the number of samples (samples are consecutive rows of the token stream)."""

    config: BloomConfig
    seed: int
    micro_batch_size: int
    steps: Sequence[tuple[int, int]]  # (consumed before the step, samples in the step)
    lr_at: Callable[[int], float]  # consumed samples -> lr
    weight_decay: float
    betas: tuple[float, float]
    eps: float
    grad_clip: float


def batch(tokens: torch.Tensor, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    sample = tokens[list(indices)]
    return sample[:, :-1].contiguous(), sample[:, 1:].contiguous()


def train(
    recipe: Recipe,
    tokens: torch.Tensor,
    order: Order = BASE,
    *,
    dtype: str = "fp32",
    lr_scale: float = 1.0,
    drop_micro_batch: int | None = None,
) -> tuple[BloomForCausalLM, dict[str, Any]]:
    """Train; return the model and its trace: per-step "losses" and "norms", and the "weights".

    bf16 is DeepSpeed's recipe: bf16 weights and activations, gradients accumulated in fp32 into fp32 master
    weights, which AdamW steps. ``lr_scale`` and ``drop_micro_batch`` (a step whose last micro-batch is lost) are
    bugs, for the tests that show the bounds have teeth. Every sample has as many labels as the others, so the
    mean of the micro-batch means is the batch mean however the step is cut into micro-batches."""
    with pinned_threads(order.threads):
        model = BloomForCausalLM(recipe.config)
        model.init_weights(torch.Generator().manual_seed(recipe.seed))
        named = list(model.named_parameters())  # the tied head appears once
        optimizer = torch.optim.AdamW(
            param_groups(named, recipe.weight_decay), lr=0.0, betas=recipe.betas, eps=recipe.eps
        )
        compute = copy.deepcopy(model).to(torch.bfloat16) if dtype == "bf16" else model
        losses, norms = [], []
        for step, (consumed, samples) in enumerate(recipe.steps):
            for group in optimizer.param_groups:
                group["lr"] = recipe.lr_at(consumed + samples) * lr_scale
            optimizer.zero_grad()
            size = 1 if order.split_micro_batches else recipe.micro_batch_size
            micro = [range(i, i + size) for i in range(consumed, consumed + samples, size)]
            scale = len(micro)
            if step == drop_micro_batch:
                micro = micro[: -recipe.micro_batch_size // size]
            total = 0.0
            for indices in reversed(micro) if order.reverse_micro_batches else micro:
                inputs, labels = batch(tokens, indices)
                loss = cross_entropy(compute(inputs), labels)
                (loss / scale).backward()
                total += loss.item() / scale
                if compute is not model:
                    _accumulate_in_fp32(compute, model)
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.grad_clip)))
            optimizer.step()
            if compute is not model:
                with torch.no_grad():
                    for low, master in zip(compute.parameters(), model.parameters(), strict=True):
                        low.copy_(master)
            losses.append(total)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    return model, {"losses": losses, "norms": norms, "weights": weights}


def _accumulate_in_fp32(low: torch.nn.Module, master: torch.nn.Module) -> None:
    for p, m in zip(low.parameters(), master.parameters(), strict=True):
        if p.grad is not None:
            m.grad = p.grad.float() if m.grad is None else m.grad + p.grad.float()
            p.grad = None
