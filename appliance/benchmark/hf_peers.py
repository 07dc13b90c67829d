"""The peers a user would pick instead of the trainer: transformers' BloomForCausalLM, eager and under torch.compile.

What is equal, so the ratio measures the training path and nothing else:
- weights: the trainer engine's first weights, loaded unchanged (our names are transformers' own);
- the work per step: the same micro-batches (same tokens), the loss averaged over them, one optimizer step;
- the optimizer: torch.optim.AdamW with the plan's lr, betas, eps and weight decay, split as the trainer splits it
  (no decay on biases and LayerNorm weights, as transformers' Trainer also does), and gradient clipping at the
  plan's global norm, as the trainer does (transformers' Trainer clips at 1.0 by default);
- precision: fp32 in fp32 plans; in bf16/fp16 plans fp32 weights under torch.autocast (what transformers' Trainer
  does with --bf16/--fp16; the trainer keeps fp32 master weights too);
- mode and dropout: train mode, with the dropout rates of the model's config (BLOOM's: 0), on both sides;
- attention: transformers' default attention implementation for Bloom (not forced to eager), the causal mask it
  builds itself; no padding.
transformers shifts the labels inside its loss, so it is given the inputs as labels and scores s - 1 positions per
sample where the trainer scores s: the forward and backward work is the same.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch

from appliance.benchmark.workload import Batch, Workload

AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


def compile_backend(work: Workload) -> str:
    """inductor, torch.compile's default; --quick on CPU (a smoke run) only captures the graph ("eager" backend),
    which spares the C++ build of the generated kernels. --quick on a GPU keeps inductor: its Triton kernels are the
    peer worth measuring there, and they build in the warm-up."""
    return "eager" if work.quick and work.device.type == "cpu" else "inductor"


def hf_model(work: Workload, weights: dict[str, torch.Tensor] | None) -> Any:
    """transformers' Bloom for the workload's model on its device, with `weights` (None: transformers' own
    initialisation, when the trainer ran out of memory before it had any)."""
    import transformers

    from appliance.train.from_spec import model_config

    config = model_config(work.spec, work.spec.model.vocab_size)  # as the trainer's engine was built
    model: Any = transformers.BloomForCausalLM(transformers.BloomConfig(**config.to_hf_dict()))
    if weights is not None:
        missing, unexpected = model.load_state_dict(weights, strict=False)
        if unexpected or [k for k in missing if k != "lm_head.weight"]:  # the LM head is tied to the embedding
            raise RuntimeError(
                f"bench: transformers' Bloom did not take our weights: missing {missing}, unexpected {unexpected}"
            )
    model.to(work.device)
    return model.train()


def training_step(model: Any, work: Workload) -> Callable[[list[Batch]], float]:
    """One optimizer step over a step's micro-batches, as the trainer's engine takes it (see the docstring)."""
    from appliance.parallel.step.build import param_groups

    train = work.spec.train
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(param_groups(params, train.weight_decay), lr=train.lr,
                                  betas=(train.adam_beta1, train.adam_beta2), eps=train.adam_eps)  # fmt: skip
    dtype = AUTOCAST.get(train.dtype)
    scaler = torch.amp.GradScaler(work.device.type) if train.dtype == "fp16" else None

    def autocast() -> Any:
        return torch.autocast(work.device.type, dtype=dtype) if dtype is not None else nullcontext()

    def step(micro_batches: list[Batch]) -> float:
        total = torch.zeros((), device=work.device)
        for inputs, _ in micro_batches:
            ids = inputs.to(work.device)
            with autocast():
                loss = model(input_ids=ids, labels=ids).loss / len(micro_batches)
            (scaler.scale(loss) if scaler else loss).backward()
            total += loss.detach().float()
        if scaler:
            scaler.unscale_(optimizer)
        if train.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), train.grad_clip)
        if scaler:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(total)  # one host sync per step, as the trainer's engine

    return step


class PeerContender:
    """transformers' Bloom with its optimizer, one training step per call (training_step)."""

    def __init__(self, work: Workload, weights: dict[str, torch.Tensor] | None, *, compiled: bool) -> None:
        model = hf_model(work, weights)
        self.attention = str(model.config._attn_implementation)  # the implementation transformers chose
        self.compiled = compiled
        if compiled:
            model = torch.compile(model, backend=compile_backend(work))
        self.step: Callable[[list[Batch]], float] | None = training_step(model, work)

    def __call__(self, micro_batches: list[Batch]) -> float:
        if self.step is None:
            raise RuntimeError("bench: this transformers contender was released")
        return self.step(micro_batches)

    def release(self) -> None:
        """Drop the model and its optimizer state (the step's closure holds both); compiled: dynamo's caches too."""
        self.step = None
        if self.compiled:
            torch.compiler.reset()
