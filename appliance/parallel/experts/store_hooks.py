"""The hooks that make an MoE model's experts follow the expert store through forward and backward.

For each MoE layer's experts container (DeepSpeed's `deepspeed.moe.experts.Experts`, or any module whose forward
runs that layer's experts):

- a forward pre-hook fetches the layer's experts to the device and pins them (and prefetches the next layer);
  a forward hook unpins them, so the next layers may evict them;
- while the forward runs, autograd's saved-tensor hooks replace every saved tensor that is a view of an expert's
  weight (a linear saves `weight.t()`) by (expert, parameter, size, stride, offset). An evicted expert then holds
  no device memory until its backward, whose first unpack fetches it again and rebuilds the same view on the
  fetched weight: the backward reads the same values, so the gradients are the same bits;
- each expert parameter's post-accumulate-grad hook tells the store when the expert's gradients are in, after
  which it may leave the device again.

Activations (the tokens each expert saw) are saved as usual; only weights move.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from appliance.parallel.experts.store import ExpertStore
from appliance.parallel.experts.store_slots import ExpertSlot


class _SavedWeight:
    """What autograd keeps instead of a view of an expert's weight."""

    __slots__ = ("forward_id", "offset", "param", "size", "slot", "stride")

    def __init__(self, slot: ExpertSlot, param: int, tensor: torch.Tensor, forward_id: int) -> None:
        self.slot, self.param, self.forward_id = slot, param, forward_id
        self.size, self.stride, self.offset = tensor.size(), tensor.stride(), tensor.storage_offset()


class _LayerHooks:
    def __init__(self, store: ExpertStore, layer: int) -> None:
        self.store, self.layer = store, layer
        self._context: Any = None
        self._weights: dict[int, tuple[ExpertSlot, int]] = {}
        self._forward_id = 0

    def before_forward(self, module: nn.Module, args: Any) -> None:
        self.store.begin_forward(self.layer)
        if not torch.is_grad_enabled():
            return
        self._forward_id += 1
        # Storage addresses of this layer's weights, valid while they are pinned (this forward)
        self._weights = {
            p.untyped_storage().data_ptr(): (slot, i)
            for slot in self.store.layers[self.layer]
            for i, p in enumerate(slot.params)
        }
        self._context = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._context.__enter__()

    def after_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._context is not None:
            self._context.__exit__(None, None, None)
            self._context, self._weights = None, {}
        self.store.end_forward(self.layer)

    def _pack(self, tensor: torch.Tensor) -> Any:
        owner = self._weights.get(tensor.untyped_storage().data_ptr()) if tensor.numel() else None
        if owner is None:
            return tensor
        return _SavedWeight(owner[0], owner[1], tensor, self._forward_id)

    def _unpack(self, saved: Any) -> torch.Tensor:
        if not isinstance(saved, _SavedWeight):
            return saved
        self.store.begin_backward_use(saved.slot, saved.forward_id)
        weight = saved.slot.params[saved.param].data
        return weight.as_strided(saved.size, saved.stride, saved.offset)


def attach_expert_store(store: ExpertStore, containers: Sequence[nn.Module]) -> list[RemovableHandle]:
    """Hook each MoE layer's experts container (in the store's layer order); returns the handles to remove."""
    if len(containers) != len(store.layers):
        raise ValueError(f"{len(containers)} expert containers for the store's {len(store.layers)} MoE layers")
    handles: list[RemovableHandle] = []
    for layer, container in enumerate(containers):
        hooks = _LayerHooks(store, layer)
        handles.append(container.register_forward_pre_hook(hooks.before_forward))
        handles.append(container.register_forward_hook(hooks.after_forward, always_call=True))
        for slot in store.layers[layer]:
            for p in slot.params:
                handles.append(p.register_post_accumulate_grad_hook(_accumulated(store, slot)))
    return handles


def _accumulated(store: ExpertStore, slot: ExpertSlot) -> Any:
    def hook(param: torch.Tensor) -> None:
        store.gradient_accumulated(slot)

    return hook
