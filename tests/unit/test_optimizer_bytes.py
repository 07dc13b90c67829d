"""Bytes the single-replica optimizer region moves per parameter, counted from what runs, not from a formula.

Torch ops are counted by a dispatch mode from their schemas: every tensor an op takes is read, every one it mutates
or returns is written (a copy or fill only writes its target; views and allocations move nothing). Triton kernels run
in the interpreter, and every element a `tl.load` or `tl.store` touches is counted at its type's size (masked-out
elements are not). The region is FlatAdamW's, bf16 weights, after the backward: with one micro-batch a step, the
step alone (the gradients read where autograd left them); with two, the fold of the first micro-batch and the step.

Positive control: the same counter over the region as it ran before the one-pass kernels
(bench/optimizer_step.py's step_before_one_pass: the gradient copies into flat bf16 and fp32 buffers, the norm
through a gradient-sized temporary, torch's fused AdamW writing the gradients back, the cast) counts about 60.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from appliance.model.bloom import BloomForCausalLM
from appliance.model.config import BloomConfig
from appliance.parallel.step.flat_optimizer import FlatAdamW
from bench.optimizer_step import step_before_one_pass
from kernels import flat_adamw

CONFIG = BloomConfig(vocab_size=256, hidden_size=64, n_layer=2, n_head=4)
WRITE_ONLY = frozenset({"aten::copy_", "aten::_foreach_copy_", "aten::zero_", "aten::fill_", "aten::_foreach_zero_"})


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _size(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class Traffic(TorchDispatchMode):
    """Bytes read and written by torch ops (see the module docstring) and by Triton kernels in the interpreter."""

    def __init__(self) -> None:
        super().__init__()
        self.torch_read = self.torch_written = self.kernel_read = self.kernel_written = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        schema, name = func._schema, func._schema.name
        if func.is_view or name.startswith("aten::empty"):
            return out  # a view or an allocation moves no data
        for i, argument in enumerate(schema.arguments):
            value = args[i] if i < len(args) else kwargs.get(argument.name)
            size = _size(_tensors(value))
            written = argument.alias_info is not None and argument.alias_info.is_write
            self.torch_written += size if written else 0
            self.torch_read += 0 if written and name in WRITE_ONLY else size
        fresh = [r for r in schema.returns if r.alias_info is None]
        if fresh:
            self.torch_written += _size(_tensors(out))
        return out

    @property
    def total(self) -> int:
        return self.torch_read + self.torch_written + self.kernel_read + self.kernel_written


@contextmanager
def counting_traffic(monkeypatch: pytest.MonkeyPatch) -> Iterator[Traffic]:
    from triton.runtime import interpreter

    traffic = Traffic()
    builder = interpreter.InterpreterBuilder
    load, store = builder.create_masked_load, builder.create_masked_store

    def counted(ptrs: Any, mask: Any) -> int:
        return int(np.count_nonzero(np.broadcast_to(mask.data, ptrs.data.shape))) * (
            ptrs.get_element_ty().primitive_bitwidth // 8
        )

    def masked_load(self: Any, ptrs: Any, mask: Any, *args: Any) -> Any:
        traffic.kernel_read += counted(ptrs, mask)
        return load(self, ptrs, mask, *args)

    def masked_store(self: Any, ptrs: Any, value: Any, mask: Any, *args: Any) -> Any:
        traffic.kernel_written += counted(ptrs, mask)
        return store(self, ptrs, value, mask, *args)

    launch = flat_adamw.launch

    def launch_outside_the_mode(*args: Any, **options: Any) -> None:
        # The interpreter copies each argument's whole storage in and out with torch ops: not the kernel's traffic.
        with _disable_current_modes():
            launch(*args, **options)

    monkeypatch.setattr(builder, "create_masked_load", masked_load)
    monkeypatch.setattr(builder, "create_masked_store", masked_store)
    monkeypatch.setattr(flat_adamw, "launch", launch_outside_the_mode)
    with traffic:
        yield traffic


def _optimizer() -> tuple[FlatAdamW, list[torch.Tensor], int]:
    torch.manual_seed(0)
    model = BloomForCausalLM(CONFIG).to(torch.bfloat16)
    named = list(model.named_parameters())
    optimizer = FlatAdamW(named, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, max_grad_norm=1.0)
    params = [p for _, p in named]
    return optimizer, params, sum(p.numel() for p in params)


def _give_gradients(params: list[torch.Tensor]) -> None:
    for p in params:
        p.grad = torch.randn(p.shape).to(torch.bfloat16)  # as autograd leaves them: one tensor per parameter


def _per_parameter(traffic: Traffic, count: int) -> dict[str, float]:
    return {"total": traffic.total / count, "torch": (traffic.torch_read + traffic.torch_written) / count,
            "kernels": (traffic.kernel_read + traffic.kernel_written) / count}  # fmt: skip


def _one_pass(monkeypatch: pytest.MonkeyPatch, micro_batches: int) -> dict[str, float]:
    monkeypatch.setenv("BLOOM_KERNELS", "triton")  # the GPU's path, in the interpreter
    optimizer, params, count = _optimizer()
    _give_gradients(params)
    optimizer.step()  # the first step makes the moments (and the kernels' tables): not a step's traffic
    if micro_batches > 1:
        _give_gradients(params)
        optimizer.fold_micro_batch()
        optimizer.step()  # and the fp32 sum
    loss = torch.tensor(2.5)
    with counting_traffic(monkeypatch) as traffic:
        for micro in range(micro_batches):
            with _disable_current_modes():  # the backward's work, not the optimizer's
                _give_gradients(params)
            if micro < micro_batches - 1:
                optimizer.fold_micro_batch()
        optimizer.step(loss)
    return _per_parameter(traffic, count)


def test_one_micro_batch_step_moves_at_most_32_bytes_per_parameter(monkeypatch: pytest.MonkeyPatch) -> None:
    """Norm (the bf16 gradient read once) and update (read again, fp32 master and moments read and written, bf16
    weight written): 30 bytes, plus the kernels' tables and the verdicts' scalars; nothing gradient-sized in torch."""
    counted = _one_pass(monkeypatch, micro_batches=1)
    print(f"one micro-batch a step: {counted}")
    assert counted["total"] <= 32, counted
    assert counted["torch"] < 0.5, counted  # no torch op the size of the gradients


def test_two_micro_batches_add_the_fp32_sum_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first micro-batch folded into an fp32 sum (read 2, write 4), then the norm and the update read the sum
    beside the last micro-batch's gradient (4 each): 44 bytes, where the path before moved about 74."""
    counted = _one_pass(monkeypatch, micro_batches=2)
    print(f"two micro-batches a step: {counted}")
    assert counted["total"] <= 46, counted
    assert counted["torch"] < 0.5, counted


def test_the_counter_counts_the_path_before_at_about_60(monkeypatch: pytest.MonkeyPatch) -> None:
    """Positive control: the region as it ran before, counted the same way, moves about 60 bytes per parameter
    (copies 4 + 6, norm 12, fused AdamW 32, cast 6), far over the bound the one-pass step meets."""
    optimizer, params, count = _optimizer()
    flat_grads = torch.empty(optimizer.weights.numel(), dtype=torch.bfloat16)
    fp32_grads = torch.empty(optimizer.weights.numel(), dtype=torch.float32)
    optimizer._moments()
    _give_gradients(params)
    with counting_traffic(monkeypatch) as traffic:
        step_before_one_pass(optimizer, flat_grads, fp32_grads)
    counted = _per_parameter(traffic, count)
    print(f"the path before: {counted}")
    assert 56 <= counted["total"] <= 64, counted
    assert counted["total"] > 32
