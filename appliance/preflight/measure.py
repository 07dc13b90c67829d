"""What a built rank holds, counted from its tensors: model-state bytes by kind and the peak of the activations
autograd keeps for backward. Every count is of distinct storages, so a tensor and its views count once."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch


def storage_bytes(tensors: Iterable[torch.Tensor], exclude: set[int] | None = None) -> int:
    """Bytes of the distinct storages behind ``tensors``, leaving out those whose address is in ``exclude``."""
    seen = set(exclude or ())
    total = 0
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
        # a zero-size storage has address 0: it is counted once, as 0 bytes
    return total


def addresses(tensors: Iterable[torch.Tensor]) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors}


def torch_optimizer(optimizer: Any, depth: int = 3) -> torch.optim.Optimizer | None:
    """The torch optimizer that steps the parameters: ``optimizer`` itself, or the one DeepSpeed's wrappers (its
    bf16, ZeRO and fp16 optimizers) hold as ``.optimizer``; None when there is none within ``depth`` wrappers (the
    single-replica engine's flat AdamW keeps its own buffers: see ``StateBytes``)."""
    for _ in range(depth + 1):
        if isinstance(optimizer, torch.optim.Optimizer):
            return optimizer
        optimizer = getattr(optimizer, "optimizer", None)
    return None


@dataclass
class StateBytes:
    """Model-state bytes of one rank. ``parameters``: the module's parameters. ``gradients``: every gradient alive
    when the optimizer steps (the module's, and those of the optimizer's own fp32 copies: bf16's accumulation
    buffer, ZeRO's partitions). ``optimizer``: the optimizer's per-parameter state (Adam's moments; the 0-d step
    counters, 4 bytes per tensor, are left out as the planner leaves them out) and its parameters that are not the
    module's (fp32 master weights)."""

    parameters: int = 0
    gradients: int = 0
    optimizer: int = 0


class StateMeter:
    """Counts ``StateBytes`` of a module and its optimizer: the gradients at the moment the torch optimizer steps
    (a step pre-hook), the rest whenever ``count`` is called (after a step, when the optimizer's state exists)."""

    def __init__(self, module: torch.nn.Module, optimizer: Any) -> None:
        self.module = module
        self.optimizer = torch_optimizer(optimizer)
        self.gradients = 0
        if self.optimizer is not None:
            self.optimizer.register_step_pre_hook(self._at_step)

    def _params(self) -> list[torch.Tensor]:
        return [p for p in self.module.parameters()]

    def _optimizer_params(self) -> list[torch.Tensor]:
        if self.optimizer is None:
            return []
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def _at_step(self, *_: Any) -> None:
        grads = [p.grad for p in (*self._params(), *self._optimizer_params()) if p.grad is not None]
        self.gradients = storage_bytes(grads)

    def count(self) -> StateBytes:
        params = self._params()
        module = addresses(params)
        states: list[torch.Tensor] = []
        if self.optimizer is not None:
            for state in self.optimizer.state.values():
                states += [v for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
        master = [p for p in self._optimizer_params() if p.untyped_storage().data_ptr() not in module]
        return StateBytes(storage_bytes(params), self.gradients, storage_bytes([*states, *master], module))


class _Saved:
    """A tensor autograd keeps for backward, counted while this holder lives (autograd frees it once the node that
    saved it has run backward, or the graph is dropped)."""

    def __init__(self, meter: ActivationMeter, tensor: torch.Tensor, address: int, size: int) -> None:
        self.tensor, self._meter, self._address = tensor, meter, address
        meter.hold(address, size)

    def __del__(self) -> None:
        self._meter.release(self._address)


class ActivationMeter:
    """The peak bytes of the tensors autograd keeps for backward (torch.autograd.graph.saved_tensors_hooks), over
    every micro-batch the schedule keeps in flight: each distinct storage counted once while any saved reference to
    it lives. The parameters (saved by every matmul) are the model states', not activations: left out."""

    def __init__(self, parameters: Iterable[torch.Tensor]) -> None:
        self._excluded = addresses(parameters)
        self._holders: dict[int, int] = {}
        self._sizes: dict[int, int] = {}
        self.live = 0
        self.peak = 0

    def hold(self, address: int, size: int) -> None:
        if address not in self._holders:
            self._holders[address] = 0
            self._sizes[address] = size
            self.live += size
            self.peak = max(self.peak, self.live)
        self._holders[address] += 1

    def release(self, address: int) -> None:
        self._holders[address] -= 1
        if not self._holders[address]:
            del self._holders[address]
            self.live -= self._sizes.pop(address)

    def _pack(self, tensor: torch.Tensor) -> Any:
        storage = tensor.untyped_storage()
        if storage.data_ptr() in self._excluded or storage.nbytes() == 0:
            return tensor
        return _Saved(self, tensor, storage.data_ptr(), storage.nbytes())

    @staticmethod
    def _unpack(saved: Any) -> torch.Tensor:
        return saved.tensor if isinstance(saved, _Saved) else saved

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        """The context under which the step's forward passes run."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
