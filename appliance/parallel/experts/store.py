"""Tiered expert storage: each MoE expert's weights, gradients and AdamW state live on the compute device, in host
memory or on local disk, moved by a least-recently-used policy under byte budgets, so a model whose experts do
not fit in device memory still trains.

What moves together. An expert is a unit: its parameters, their gradients and AdamW's exp_avg and exp_avg_sq, so its
bytes are 4 x its parameter bytes (fp32: 16 bytes per parameter) in whichever tier it is. bf16 experts also carry an
fp32 master per parameter, which AdamW steps and whose fp32 gradient sums the micro-batches' bf16 ones (DeepSpeed's bf16
optimizer's arithmetic), and the bf16 gradient of the micro-batch in progress: 2 + 2 + 4 x 4 = 20 bytes per parameter.
The step count is a 4-byte CPU scalar (as torch's AdamW keeps it) that stays in host memory whatever the tier. The store
owns the experts' optimizer: one torch AdamW per expert (foreach=False: the per-tensor loop, whose arithmetic is
elementwise, so stepping experts one at a time in any order gives the same bits as one AdamW over all of them).
Gradients are allocated once (zeros) and accumulate in place, so an expert's bytes never change and a gradient computed
on the device follows its expert into host memory or onto disk between micro-batches.

The policy (deterministic: the same run moves the same experts in the same order, which the bitwise test needs):
- `fetch` brings an expert to the device, evicting the least recently used unpinned device experts to host
  (and, when the host budget is full, the least recently used host experts to disk).
- A layer's experts are pinned while its forward runs, and an expert is pinned from the moment its backward
  needs its weights until all its gradients have accumulated (`experts/store_hooks.py` does both). The device
  budget must therefore hold one layer's experts; a smaller one is refused with the arithmetic.
- Prefetch: before a layer's forward, the next `prefetch_layers` layers are fetched too when they fit without
  evicting a pinned expert (all of a layer or none of it); in backward the previous layer likewise.

Counters per tier (`counters()`): hits (an expert needed on the device was there), fetches (experts brought from
this tier to the device), evictions (experts moved out of this tier to the next one), bytes_in, bytes_out. Each
move is whole experts, so bytes = moves x expert bytes. `expert_tier_event` sums them into a step event's field.

In an engine (fp32 or bf16 expert weights; after deepspeed.initialize, whose broadcast of the weights needs them
whole; experts/store_engine.py does this for the training engine):
    store = expert_store_for_run([list(c.deepspeed_experts) for c in containers], device=device,
                                 settings=train_settings, disk_dir=run_dir / "experts")   # None: budget 0
    attach_expert_store(store, containers)          # containers: each MoE layer's deepspeed_moe.experts
    # leave store.parameters() out of the param groups given to DeepSpeed's optimizer; then each step, after the
    # micro-batches' backward: store.all_reduce_grads(edp_group) when edp > 1; clip with
    # coefficient = clip / max(clip, sqrt(dense_norm_sq + store.grad_norm_sq() summed over the ranks that hold
    # other experts)); store.step(lr, grad_scale=coefficient). Checkpoints: read_expert / load_expert per expert.
    # Step events: the trainer adds expert_step_fields(engine.expert_store).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from appliance.errors import BadInput
from appliance.parallel.experts.store_slots import (
    STATE_KEYS,
    TIERS,
    AdamWSettings,
    ExpertKey,
    ExpertSlot,
    TierCounters,
)
from appliance.parallel.experts.store_tiers import DiskTier, Tensors, tensors_bytes, to_device, to_host
from appliance.planner.train_settings import TrainSettings


class ExpertStore:
    """The experts of `layers` (one sequence of expert modules per MoE layer, in forward order), placed under the
    byte budgets. None means unlimited; `disk_dir` None means no disk tier (then the host budget must hold the
    rest). The modules must already be on `device`."""

    def __init__(
        self,
        layers: Sequence[Sequence[nn.Module]],
        *,
        device: torch.device | str,
        device_budget_bytes: int | None = None,
        host_budget_bytes: int | None = None,
        disk_dir: Path | None = None,
        adamw: AdamWSettings | None = None,
        prefetch_layers: int = 1,
    ) -> None:
        self.device = torch.device(device)
        self.device_budget, self.host_budget = device_budget_bytes, host_budget_bytes
        self.disk = DiskTier(disk_dir) if disk_dir is not None else None
        self.adamw = adamw or AdamWSettings()
        self.prefetch_layers = prefetch_layers
        self.counters_by_tier = {tier: TierCounters() for tier in TIERS}
        self.layers: list[list[ExpertSlot]] = [
            [self._register((li, ei), module) for ei, module in enumerate(experts)] for li, experts in enumerate(layers)
        ]
        self.slots = {slot.key: slot for layer in self.layers for slot in layer}
        self._on_device: OrderedDict[ExpertKey, ExpertSlot] = OrderedDict((k, s) for k, s in self.slots.items())
        self._on_host: OrderedDict[ExpertKey, ExpertSlot] = OrderedDict()
        self._check_budgets()
        # Settle into the budgets from the last layer back, so the first layers (the first forward's) stay.
        if self.device_budget is not None:
            for slot in reversed(list(self.slots.values())):
                if self._device_used() <= self.device_budget:
                    break
                self._evict_from_device(slot)

    # ---- registration ---------------------------------------------------------------------------------------
    def _register(self, key: ExpertKey, module: nn.Module) -> ExpertSlot:
        names, params = zip(*module.named_parameters(), strict=True) if list(module.parameters()) else ((), ())
        if not params:
            raise BadInput(f"expert store: expert {key} (layer, index) has no parameters")
        mixed = any(p.dtype != torch.float32 for p in params)
        for name, p in zip(names, params, strict=True):
            if p.device != self.device:
                raise BadInput(f"expert store: expert {key} parameter {name} is on {p.device}, not {self.device}")
            # Each parameter owns its storage (a view into a flat buffer would keep the buffer alive when evicted)
            p.data = p.data.clone(memory_format=torch.contiguous_format)
            # Allocated once, so an expert's bytes never change. bf16: it holds one micro-batch's gradient, summed in
            # bf16 over that micro-batch's backward passes, until fold_grads adds it into the master's fp32 one.
            p.grad = torch.zeros_like(p)
        # bf16: the fp32 masters start as the bf16 weights widened, as DeepSpeed's BF16_Optimizer makes its own
        masters = [nn.Parameter(p.data.float()) for p in params] if mixed else []
        for master in masters:
            master.grad = torch.zeros_like(master)
        trained = masters or list(params)
        a = self.adamw
        decay = [p for p in trained if a.decay_vectors or p.ndim >= 2]
        groups = [{"params": decay, "weight_decay": a.weight_decay}]
        if len(decay) < len(trained):
            groups.append({"params": [p for p in trained if not any(p is d for d in decay)], "weight_decay": 0.0})
        kernel = {"fused": True} if a.fused else {"foreach": False}
        optimizer = torch.optim.AdamW(groups, lr=a.lr, betas=a.betas, eps=a.eps, **kernel)
        for p in trained:
            # torch's own first-step state, made now so every expert has the same bytes from the start
            optimizer.state[p] = {"step": torch.tensor(0.0), **{k: torch.zeros_like(p) for k in STATE_KEYS}}
        slot = ExpertSlot(key, module, list(names), list(params), optimizer, nbytes=0, masters=masters)
        slot.nbytes = tensors_bytes(self._gather(slot))
        return slot

    def _check_budgets(self) -> None:
        widest = max(sum(s.nbytes for s in layer) for layer in self.layers)
        if self.device_budget is not None and self.device_budget < widest:
            sizes = ", ".join(f"layer {i}: {len(layer)} x {layer[0].nbytes:,} B" for i, layer in enumerate(self.layers))
            raise BadInput(
                f"expert store: the device budget ({self.device_budget:,} B) must hold one MoE layer's experts "
                f"(params + grads + AdamW state), the largest being {widest:,} B ({sizes})"
            )
        if self.disk is None and self.host_budget is not None and self.device_budget is not None:
            total = sum(s.nbytes for s in self.slots.values())
            if self.device_budget + self.host_budget < total:
                raise BadInput(
                    f"expert store: device budget {self.device_budget:,} B + host budget {self.host_budget:,} B < "
                    f"all experts' {total:,} B, and no disk directory was given"
                )

    # ---- the expert's tensors ---------------------------------------------------------------------------------
    def _gather(self, slot: ExpertSlot) -> Tensors:
        tensors: Tensors = {}
        for name, p, t in zip(slot.names, slot.params, slot.trained, strict=True):
            assert t.grad is not None and p.grad is not None
            tensors[name], tensors[f"{name}.grad"] = p.data, t.grad
            if slot.masters:
                tensors[f"{name}.master"], tensors[f"{name}.lp_grad"] = t.data, p.grad
            state = slot.optimizer.state[t]
            tensors.update({f"{name}.{k}": state[k] for k in STATE_KEYS})
        return tensors

    def _install(self, slot: ExpertSlot, tensors: Tensors) -> None:
        for name, p, t in zip(slot.names, slot.params, slot.trained, strict=True):
            p.data = tensors[name]
            if slot.masters:
                t.data = tensors[f"{name}.master"]
                p.grad = tensors[f"{name}.lp_grad"]
            t.grad = tensors[f"{name}.grad"]  # after .data: the grad must match the parameter's shape
            state = slot.optimizer.state[t]
            state.update({k: tensors[f"{name}.{k}"] for k in STATE_KEYS})

    def _release(self, slot: ExpertSlot) -> None:
        """Drop the device tensors: empty placeholders, so a use of an evicted expert fails on its shape."""
        for p, t in zip(slot.params, slot.trained, strict=True):
            p.grad, t.grad = None, None
            p.data = torch.empty(0, dtype=p.dtype, device=self.device)
            if slot.masters:
                t.data = torch.empty(0, dtype=t.dtype, device=self.device)
            state = slot.optimizer.state[t]
            state.update({k: torch.empty(0, dtype=t.dtype, device=self.device) for k in STATE_KEYS})

    # ---- moves ------------------------------------------------------------------------------------------------
    def _device_used(self) -> int:
        return sum(s.nbytes for s in self._on_device.values())

    def _host_used(self) -> int:
        return sum(s.nbytes for s in self._on_host.values())

    def _evict_from_device(self, slot: ExpertSlot) -> None:
        tensors = self._gather(slot)
        if self.host_budget is not None:
            while self._host_used() + slot.nbytes > self.host_budget and self._on_host:
                self._evict_from_host(next(iter(self._on_host.values())))
        slot.host = to_host(tensors)
        self._release(slot)
        del self._on_device[slot.key]
        self._on_host[slot.key], slot.tier = slot, "host"
        self._count("device", evictions=1, bytes_out=slot.nbytes)
        self._count("host", bytes_in=slot.nbytes)

    def _evict_from_host(self, slot: ExpertSlot) -> None:
        if self.disk is None:
            raise BadInput(
                f"expert store: the host budget ({self.host_budget:,} B) is full and no disk directory was given"
            )
        assert slot.host is not None
        self.disk.write(slot.key, slot.host)
        slot.host = None
        del self._on_host[slot.key]
        slot.tier = "disk"
        self._count("host", evictions=1, bytes_out=slot.nbytes)
        self._count("disk", bytes_in=slot.nbytes)

    def _room_on_device(self, nbytes: int, *, evict: bool) -> bool:
        """Whether `nbytes` fit on the device after evicting unpinned experts (evicting them when `evict`)."""
        if self.device_budget is None:
            return True
        free = self.device_budget - self._device_used()
        victims = [s for s in self._on_device.values() if not s.pinned]  # least recently used first
        if free + sum(s.nbytes for s in victims) < nbytes:
            return False
        if evict:
            while free < nbytes:
                victim = victims.pop(0)
                self._evict_from_device(victim)
                free += victim.nbytes
        return True

    def fetch(self, slot: ExpertSlot, *, count_use: bool = True) -> None:
        """Make `slot` resident on the device and most recently used; a use counts a hit when it was there."""
        if slot.tier == "device":
            self._on_device.move_to_end(slot.key)
            if count_use:
                self._count("device", hits=1)
            return
        if not self._room_on_device(slot.nbytes, evict=True):
            pinned = sum(s.nbytes for s in self._on_device.values() if s.pinned)
            raise BadInput(
                f"expert store: expert {slot.key} ({slot.nbytes:,} B) does not fit in the device budget "
                f"({self.device_budget:,} B) beside the {pinned:,} B of experts in use"
            )
        source = slot.tier
        if source == "host":
            assert slot.host is not None
            tensors = to_device(slot.host, self.device)
            slot.host = None
            del self._on_host[slot.key]
        else:
            assert self.disk is not None
            tensors = self.disk.read(slot.key, self.device)
        self._install(slot, tensors)
        self._on_device[slot.key], slot.tier = slot, "device"
        self._count(source, fetches=1, bytes_out=slot.nbytes)
        self._count("device", bytes_in=slot.nbytes)

    def prefetch(self, layer: int) -> bool:
        """Fetch all of `layer`'s experts if they fit without evicting a pinned expert; False when skipped."""
        if not 0 <= layer < len(self.layers):
            return False
        missing = [s for s in self.layers[layer] if s.tier != "device"]
        if not self._room_on_device(sum(s.nbytes for s in missing), evict=False):
            return False
        for slot in missing:
            self.fetch(slot, count_use=False)
        return True

    # ---- the training step ----------------------------------------------------------------------------------
    def begin_forward(self, layer: int) -> None:
        for slot in self.layers[layer]:
            self.fetch(slot)
            slot.forward_pinned = True
        for ahead in range(layer + 1, layer + 1 + self.prefetch_layers):
            self.prefetch(ahead)

    def end_forward(self, layer: int) -> None:
        for slot in self.layers[layer]:
            slot.forward_pinned = False

    def begin_backward_use(self, slot: ExpertSlot, forward_id: int) -> None:
        """The backward needs `slot`'s weights: fetch it and pin it until its gradients have accumulated."""
        if forward_id not in slot.backward_uses:
            slot.backward_uses.add(forward_id)
            self.fetch(slot)
            # A gradient that needs no weight (a bias's) may have arrived already: pin only for the rest
            slot.grads_pending, slot.grads_early = max(0, len(slot.params) - slot.grads_early), 0
            layer = slot.key[0]
            if all(forward_id in s.backward_uses for s in self.layers[layer]):
                for behind in range(layer - 1, layer - 1 - self.prefetch_layers, -1):
                    self.prefetch(behind)
        elif slot.tier != "device":
            self.fetch(slot, count_use=False)  # evicted after its gradients accumulated, needed again

    def gradient_accumulated(self, slot: ExpertSlot) -> None:
        slot.unfolded = bool(slot.masters)  # bf16: fold_grads has a micro-batch's gradient to add
        if slot.grads_pending > 0:
            slot.grads_pending -= 1
            if slot.grads_pending == 0:
                slot.grads_early = 0
        else:
            slot.grads_early += 1

    def fold_grads(self) -> None:
        """bf16 experts, after each micro-batch's backward: add the bf16 gradient it left (summed in bf16 over its
        backward passes: a pipeline's first stage runs one for the hidden states and one for the carried MoE loss)
        into the master's fp32 gradient and zero it, where DeepSpeed's BF16_Optimizer does the same for its
        parameters (update_hp_grads): the same fp32 sum of bf16 micro-batch gradients. Moves nothing: an expert
        evicted since is folded in host memory or in its file."""
        for slot in self.slots.values():
            if not slot.unfolded:
                continue
            if slot.tier == "device":
                tensors = self._gather(slot)
            elif slot.tier == "host":
                assert slot.host is not None
                tensors = slot.host
            else:
                assert self.disk is not None
                tensors = self.disk.peek(slot.key)
            for name in slot.names:
                tensors[f"{name}.grad"].add_(tensors[f"{name}.lp_grad"].to(tensors[f"{name}.grad"].dtype))
                tensors[f"{name}.lp_grad"].zero_()
            if slot.tier == "disk":
                assert self.disk is not None
                self.disk.write(slot.key, tensors)
            slot.unfolded = False

    def step(self, lr: float, grad_scale: float | None = None) -> None:
        """AdamW on every expert, then its gradients zeroed: resident experts first (no move), then the rest in
        layer order. `grad_scale` multiplies the gradients first (a clipping coefficient)."""
        self.fold_grads()  # bf16: a gradient not folded yet (a caller without per-micro-batch folds) counts too
        for slot in self.slots.values():  # a backward that left pins (an unused expert) ends here
            slot.grads_pending, slot.grads_early, slot.backward_uses = 0, 0, set()
        resident = list(self._on_device.values())
        for slot in resident + [s for s in self.slots.values() if s.tier != "device"]:
            self.fetch(slot, count_use=False)
            if grad_scale is not None:
                for p in slot.trained:
                    assert p.grad is not None
                    p.grad.mul_(grad_scale)
            for group in slot.optimizer.param_groups:
                group["lr"] = lr
            slot.optimizer.step()
            for p in slot.trained:
                assert p.grad is not None
                p.grad.zero_()
            for param, master in zip(slot.params, slot.masters, strict=False):
                param.data.copy_(master.data)  # bf16 rounds the updated master, as BF16_Optimizer's update_lp_params

    def zero_grads(self) -> None:
        """Zero every expert's gradients without a step (a step skipped for a non-finite gradient norm)."""
        for slot in self.slots.values():
            self.fetch(slot, count_use=False)
            for p in {id(q): q for q in slot.trained + slot.params}.values():  # bf16: the bf16 gradient too
                assert p.grad is not None
                p.grad.zero_()
            slot.unfolded = False

    def all_reduce_grads(self, group: dist.ProcessGroup | None = None, *, divide_by: int | None = None) -> None:
        """Sum every expert's gradients over `group` (the expert-data-parallel ranks, which hold the same experts) and
        divide by `divide_by` (default the group's size: the average). An engine at ep > 1 divides by dp, as
        DeepSpeed does for its expert gradients (every token of the dp group reached its expert through the
        all-to-all). DeepSpeed's engine reduces the gradients it finds on the parameters, and an evicted expert
        has none there. Experts go in (layer, index) order, whatever their tier, so every rank issues the same
        collectives; each is fetched and reduced on the device as one flat buffer."""
        size = dist.get_world_size(group) if dist.is_initialized() else 1
        divisor = size if divide_by is None else divide_by
        if size == 1 and divisor == 1:
            return
        for slot in self.slots.values():
            self.fetch(slot, count_use=False)
            grads = [p.grad for p in slot.trained if p.grad is not None]
            flat = torch.cat([g.reshape(-1) for g in grads])  # on the device, where the gradients are
            if size > 1:
                dist.all_reduce(flat, group=group)
            flat.div_(divisor)
            offset = 0
            for grad in grads:
                grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
                offset += grad.numel()

    def read_expert(self, key: ExpertKey) -> Tensors:
        """A CPU copy of an expert's tensors wherever it lives, moving nothing: weights by parameter name, `.grad`,
        `.exp_avg`, `.exp_avg_sq` and `.step` beside each. What a checkpoint saves (an evicted expert's parameters
        are empty placeholders, so the model's own state_dict does not hold them)."""
        slot = self.slots[key]
        if slot.tier == "device":
            tensors = {name: t.detach().to("cpu", copy=True) for name, t in self._gather(slot).items()}
        elif slot.tier == "host":
            assert slot.host is not None
            tensors = {name: t.clone() for name, t in slot.host.items()}
        else:
            assert self.disk is not None
            tensors = self.disk.peek(key)
        for name, p in zip(slot.names, slot.trained, strict=True):
            tensors[f"{name}.step"] = slot.optimizer.state[p]["step"].clone()
        return tensors

    def load_expert(self, key: ExpertKey, tensors: Tensors) -> None:
        """Put `tensors` (read_expert's form, e.g. from a checkpoint) into the expert, in whichever tier it is."""
        slot = self.slots[key]
        suffixes = ("", ".grad", ".exp_avg", ".exp_avg_sq") + ((".master", ".lp_grad") if slot.masters else ())
        names = [f"{name}{suffix}" for name in slot.names for suffix in suffixes]
        steps = [f"{name}.step" for name in slot.names]
        missing = [name for name in names + steps if name not in tensors]
        if missing:
            raise BadInput(f"expert store: expert {key} is missing {', '.join(missing)}")
        for name, p in zip(slot.names, slot.trained, strict=True):
            slot.optimizer.state[p]["step"].copy_(tensors[f"{name}.step"])
        if slot.tier == "device":
            for name, t in self._gather(slot).items():
                t.detach().copy_(tensors[name])
        elif slot.tier == "host":
            assert slot.host is not None
            for name, t in slot.host.items():
                t.copy_(tensors[name])
        else:
            assert self.disk is not None
            self.disk.write(key, {name: tensors[name].to("cpu") for name in names})

    def grad_norm_sq(self) -> float:
        """Sum of the squares of every expert gradient (fp64), read where each expert lives, moving nothing: the
        experts' share of the global gradient norm that clipping needs (add the dense parameters' share and reduce
        over the ranks as the engine does, then pass the clip coefficient to `step(grad_scale=...)`)."""
        total = 0.0
        for slot in self.slots.values():
            if slot.tier == "device":
                grads = [p.grad for p in slot.trained if p.grad is not None]
            elif slot.tier == "host":
                assert slot.host is not None
                grads = [slot.host[f"{name}.grad"] for name in slot.names]
            else:
                assert self.disk is not None
                grads = list(self.disk.peek(slot.key, [f"{name}.grad" for name in slot.names]).values())
            for grad in grads:  # one running sum in expert order: any run of the same model adds in this order
                total += float(grad.double().pow(2).sum())
        return total

    def parameters(self) -> list[nn.Parameter]:
        """The parameters the store owns: leave them out of every other optimizer (and of DeepSpeed's)."""
        return [p for slot in self.slots.values() for p in slot.params]

    # ---- counters ---------------------------------------------------------------------------------------------
    def _count(self, tier: str, **amounts: int) -> None:
        counters = self.counters_by_tier[tier]
        for name, amount in amounts.items():
            setattr(counters, name, getattr(counters, name) + amount)

    def counters(self) -> dict[str, dict[str, int]]:
        return {tier: asdict(c) for tier, c in self.counters_by_tier.items()}

    def placement(self) -> dict[str, int]:
        """How many experts each tier holds now."""
        return {tier: sum(s.tier == tier for s in self.slots.values()) for tier in TIERS}


def expert_tier_event(counters: dict[str, dict[str, int]], placement: dict[str, int] | None = None) -> dict:
    """The step event's `expert_tier` field (cumulative since the ranks started): hits on the device, fetches to it
    from host and disk, evictions out of device and host, the bytes moved onto and off the device, and the
    per-tier counters and placement for the dashboard."""
    device, host, disk = (counters[t] for t in TIERS)
    field_: dict = {
        "hits": device["hits"],
        "fetches": host["fetches"] + disk["fetches"],
        "evictions": device["evictions"] + host["evictions"],
        "bytes_in": device["bytes_in"],
        "bytes_out": device["bytes_out"],
        "by_tier": {tier: dict(counters[tier]) for tier in TIERS},
    }
    if placement is not None:
        field_["placement"] = dict(placement)
    return field_


def expert_step_fields(store: ExpertStore | None) -> dict:
    """What a step event adds for a run whose experts are in a store ({} without one)."""
    return {} if store is None else {"expert_tier": expert_tier_event(store.counters(), store.placement())}


def expert_store_for_run(
    layers: Sequence[Sequence[nn.Module]],
    *,
    device: torch.device | str,
    settings: TrainSettings,
    disk_dir: Path | None = None,
) -> ExpertStore | None:
    """The store a run's settings ask for (None when `expert_device_budget_mb` is 0: every expert stays resident),
    with the run's AdamW hyperparameters. The lr comes at each step (`ExpertStore.step(lr)`), from the schedule."""
    if settings.expert_device_budget_mb == 0:
        return None
    adamw = AdamWSettings(
        lr=settings.lr,
        betas=(settings.adam_beta1, settings.adam_beta2),
        eps=settings.adam_eps,
        weight_decay=settings.weight_decay,
    )
    budget = settings.expert_device_budget_mb * 2**20
    host = settings.expert_host_budget_mb * 2**20 or None  # 0: host memory unlimited
    return ExpertStore(
        layers, device=device, device_budget_bytes=budget, host_budget_bytes=host, disk_dir=disk_dir, adamw=adamw
    )
