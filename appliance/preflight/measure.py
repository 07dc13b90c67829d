"""What a built rank holds, counted from its tensors: model-state bytes by kind and the peak of the activations
autograd keeps for backward. Every count is of distinct storages, so a tensor and its views count once."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
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


def reached_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` as far as the tensors reach into each (its first byte to
    the end of the furthest view): on a CPU rank the pages past them are never written, so never resident. ZeRO's
    reduce bucket is allocated whole (planner/memory.py ZERO_BUCKET_ELEMENTS) but filled only by the gradients
    viewing it. Other devices reserve a storage whole: its bytes."""
    reach: dict[int, int] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        end = storage.nbytes()
        if tensor.device.type == "cpu":
            end = int(tensor.storage_offset() + tensor.numel()) * tensor.element_size()
        reach[storage.data_ptr()] = max(reach.get(storage.data_ptr(), 0), end)
    return sum(reach.values())


def addresses(tensors: Iterable[torch.Tensor]) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors}


# Where the optimizers keep their buffers: torch's, DeepSpeed's wrappers (bf16, ZeRO, fp16) and ours (FlatAdamW).
OPTIMIZER_PACKAGES = ("torch.optim", "deepspeed", "appliance")
WALK_DEPTH = 5  # DeepSpeed's wrapper, its torch optimizer, its state dict, a parameter's state, the tensor


def optimizer_tensors(optimizer: Any) -> list[tuple[str, torch.Tensor]]:
    """(attribute path, tensor) for every tensor an optimizer holds: in its attributes, lists, tuples and dicts
    (torch's per-parameter state included), through the optimizers it wraps, with the gradient each tensor carries
    (path ending ".grad"). The walk stays inside optimizer objects: never into a module, an engine's other parts or a
    process group, whose tensors are the model's or nobody's."""
    found: list[tuple[str, torch.Tensor]] = []
    seen: set[int] = set()

    def walk(value: Any, path: str, depth: int) -> None:
        if id(value) in seen or depth > WALK_DEPTH:
            return
        seen.add(id(value))
        if isinstance(value, torch.Tensor):
            if value.device.type == "meta":  # a shape without memory (ZeRO's round-robin bookkeeping)
                return
            found.append((path, value))
            if value.is_leaf and value.grad is not None:  # a non-leaf tensor keeps no gradient (torch warns)
                found.append((path + ".grad", value.grad))
        elif isinstance(value, dict):
            for key, item in value.items():
                walk(item, f"{path}[{key if isinstance(key, str | int) else '.'}]", depth + 1)
        elif isinstance(value, list | tuple):
            for i, item in enumerate(value):
                walk(item, f"{path}[{i}]", depth + 1)
        elif not isinstance(value, torch.nn.Module) and type(value).__module__.startswith(OPTIMIZER_PACKAGES):
            for name, item in vars(value).items() if hasattr(value, "__dict__") else ():
                walk(item, f"{path}.{name}", depth + 1)

    walk(optimizer, "optimizer", 0)
    return found


# FlatAdamW's torch twin (the CPU path) gathers the gradients into a flat buffer of its own, and its views; the
# views of its fp32 sum over micro-batches (grad_sum) are named _sum_views.
TWIN_GRADIENT_BUFFERS = ("_twin_flat", "_twin_views", "_sum_views")
# FlatAdamW keeps each parameter group's learning rate in a tensor on the device: a scalar a group, as the planner
# leaves the learning rates out.
LEARNING_RATES = ("lr",)


def is_gradient(path: str) -> bool:
    """A gradient buffer by its name: ``.grad`` itself, and the optimizers' accumulation and reduction buffers
    (bf16's fp32_groups_gradients, ZeRO's averaged_gradients and grads_in_partition, FlatAdamW's grad_sum and its
    twin's flat gradient)."""
    name = _name(path)
    return "grad" in name.lower() or name in TWIN_GRADIENT_BUFFERS


def _name(path: str) -> str:
    """The attribute a tensor's path ends in: ``optimizer.ipg_buckets[.].grads[0]`` -> ``grads``."""
    return path.rsplit(".", 1)[-1].split("[", 1)[0]


@dataclass
class StateBytes:
    """Model-state bytes of one rank. ``parameters``: the module's parameters. ``gradients``: every gradient alive
    when the optimizer steps (the module's, and the optimizer's gradient buffers: bf16's fp32 accumulation, ZeRO's
    partitions, FlatAdamW's fp32 sum). ``optimizer``: every other tensor the optimizer holds that is not a parameter
    of the module: Adam's moments, fp32 master weights (the 0-d step counters and learning rates are left out, as
    the planner leaves them out)."""

    parameters: int = 0
    gradients: int = 0
    optimizer: int = 0


# ZeRO-2's optimizer (DeepSpeed 0.19.8) frees its reduce bucket here, at the end of each backward, after copying
# the bucket's last gradients into its partition: the one moment both are alive.
RELEASE_BUCKETS = "_release_ipg_buffers"


class StateMeter:
    """Counts ``StateBytes`` of a module and its optimizer: the gradients when the optimizer's step begins, when ZeRO
    is about to free its reduce bucket (RELEASE_BUCKETS) and, while ``watching_backward``, after each parameter's
    gradient is accumulated (ZeRO reduces and frees the module's gradients during backward, so their peak lies
    there); the largest count seen. The rest whenever ``count`` is called (after a step, when the optimizer's state
    exists)."""

    def __init__(self, module: torch.nn.Module, optimizer: Any) -> None:
        self.module = module
        self.optimizer = optimizer
        self.gradients = 0
        for name in ("step", RELEASE_BUCKETS):
            if callable(getattr(optimizer, name, None)):
                setattr(optimizer, name, self._counted_before(getattr(optimizer, name)))

    def _counted_before(self, method: Any) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.gradients = max(self.gradients, self._gradient_bytes())
            return method(*args, **kwargs)

        return counted

    @contextlib.contextmanager
    def watching_backward(self) -> Iterator[None]:
        """The gradients counted after every accumulation into a parameter's .grad, for the block (a walk of the
        optimizer's tensors each time: for an untimed step)."""

        def counted(_: torch.Tensor) -> None:
            self.gradients = max(self.gradients, self._gradient_bytes())

        handles = [p.register_post_accumulate_grad_hook(counted) for p in self.module.parameters() if p.requires_grad]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def _gradient_bytes(self) -> int:
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        grads += [t for path, t in optimizer_tensors(self.optimizer) if is_gradient(path) and t.dim() > 0]
        return reached_bytes(grads)

    def count(self) -> StateBytes:
        params = list(self.module.parameters())
        module = addresses(params)
        held = [
            t
            for path, t in optimizer_tensors(self.optimizer)
            if not is_gradient(path) and t.dim() > 0 and _name(path) not in LEARNING_RATES
        ]
        return StateBytes(storage_bytes(params), self.gradients, storage_bytes(held, module))


class _Saved:
    """A tensor autograd keeps for backward, counted while this holder lives (autograd frees it once the node that
    saved it has run backward, or the graph is dropped).

    It holds the tensor detached: the same storage and version counter, no grad_fn. Held with its grad_fn, a saved
    output (GeLU's, softmax's) would point back at the node that saved it, a cycle through autograd's C++ graph that
    nothing collects. Backward frees a node's saved tensors and breaks it, but a node a backward passes with
    retain_graph=True keeps them, and DeepSpeed's pipeline backpropagates a stage's several outputs so, all but the
    last (a BLOOM-MoE stage's hidden states and load-balancing loss): their graphs would stay counted, step after
    step."""

    def __init__(self, meter: ActivationMeter, tensor: torch.Tensor, address: int, size: int) -> None:
        self.tensor, self._meter, self._address = tensor.detach(), meter, address
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
