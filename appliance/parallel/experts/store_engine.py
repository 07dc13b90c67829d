"""The tiered expert store (experts/store.py) in the training engine: a BLOOM-MoE run whose experts do not fit in the
device budget (``expert_device_budget_mb``) trains with them moving between device, host memory and, past the host
budget (``expert_host_budget_mb``), local disk.

Wired and tested against the all-resident engine (tests/distributed/test_moe_parallel.py): fp32 at ZeRO 0 and 1,
bf16 (DeepSpeed's BF16_Optimizer, which bf16 runs at ZeRO 0 and 1 alike), at any pp. ``check_store_layout`` refuses
fp16 and ZeRO 2 with the keys to change. What changes in DeepSpeed's step, and why:
- the store owns the experts' AdamW (one per expert, its state moving with the expert), so the expert parameters
  stay out of DeepSpeed's optimizer groups (``dense_for_optimizer``). In bf16 and under ZeRO, DeepSpeed's optimizer
  would demand expert groups as soon as it saw an MoE layer, so the engine is built with them hidden
  (``experts_hidden_from_deepspeed``);
- DeepSpeed reduces the gradients it finds on the module's parameters (fp32 ZeRO 0) or in its optimizer's buffers
  (bf16, ZeRO); an evicted expert's are placeholders, so the store reduces all of its experts itself (sum over edp,
  divided by dp, DeepSpeed's own arithmetic for expert gradients) and DeepSpeed's reduction skips them
  (``_get_gradients_for_reduction`` filtered at fp32 ZeRO 0; nothing to skip elsewhere);
- the global norm adds the store's squares (summed over ep, counted on tp rank 0, summed over tp x pp like every
  other parameter's): grads.global_grad_norm at fp32 ZeRO 0, the bf16 optimizer's ``get_grads_for_norm`` (one tensor
  more), ZeRO's ``scaled_global_norm``. The clip coefficient is applied by the store's step, run right after
  DeepSpeed's optimizer step (skipped, gradients zeroed, on a non-finite norm);
- bf16: the store keeps an fp32 master and fp32 gradient per expert parameter, adds each micro-batch's bf16 gradient
  into it where DeepSpeed folds its own (``update_hp_grads``, after all of a micro-batch's backward passes) and
  rounds the stepped master back into the bf16 weight, as the bf16 optimizer does for the rest;
- DeepSpeed's ``zero_grad`` drops every module gradient; the store's gradients are allocated once and zeroed by
  its own step, so they are left alone;
- on a pipeline stage without MoE blocks there is no store, and that stage's step is DeepSpeed's own;
- checkpoints read and write the experts through the store (``read_expert`` / ``load_expert``): an evicted
  expert's parameter is an empty placeholder. Weights and Adam state (bf16: and the fp32 master) keep the
  layout-free names and the format of every other parameter (checkpoint/weight_shards.py,
  checkpoint/optimizer_state.py), so a checkpoint loads with the store on or off.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from appliance.errors import BadInput
from appliance.model.moe import BloomMoE
from appliance.parallel.experts.parallel import is_expert_parameter
from appliance.parallel.experts.store import ExpertStore
from appliance.parallel.experts.store_hooks import attach_expert_store
from appliance.parallel.experts.store_slots import STATE_KEYS, AdamWSettings, ExpertKey
from appliance.parallel.step.grads import clip_by_global_norm, clip_coefficient
from appliance.parallel.tensor.mappings import collective_device, group_size
from appliance.parallel.topology import ParallelTopology
from appliance.planner.layout_rules import store_problems


def check_store_layout(
    *,
    is_moe: bool,
    dtype: str,
    zero_stage: int,
    pp: int,
    cp: int = 1,
    tp: int = 1,
    device_budget_bytes: int = 1,
    host_budget_bytes: int = 0,
) -> None:
    """BadInput naming every key when the tiered store cannot run with these settings (the rules and their words are
    the planner's, planner/layout_rules.py, which Layout.validate states too). The store runs at any ``pp``."""
    problems = store_problems(
        is_moe=is_moe,
        dtype=dtype,
        zero_stage=zero_stage,
        cp=cp,
        tp=tp,
        device_budget_bytes=device_budget_bytes,
        host_budget_bytes=host_budget_bytes,
    )
    if problems:
        raise BadInput("; ".join(problems))


@contextmanager
def experts_hidden_from_deepspeed() -> Iterator[None]:
    """deepspeed.initialize in bf16 with the store owning the experts: DeepSpeed's engine finds MoE layers by
    isinstance against the MoE class its engine module imported, and with any its BF16_Optimizer asserts an expert
    param group and reduces and counts those groups itself. (The fp32 ZeRO-0 path keeps them seen: its reduction
    sorts expert gradients by group, which install_store_step filters.) The store's experts are in no group
    and reduced, counted and stepped by the store, so while the engine is built that name points at a class no
    layer is: DeepSpeed builds the dense engine it steps, the MoE layers running inside it as ordinary modules
    (the gate's weight is dense; the all-to-all runs over the ep group registered before, experts/parallel.py)."""
    from deepspeed.runtime import engine as deepspeed_engine

    class NoLayerIsThis:
        pass

    original = deepspeed_engine.MoE
    deepspeed_engine.MoE = NoLayerIsThis
    try:
        yield
    finally:
        deepspeed_engine.MoE = original


def dense_for_optimizer(named: Sequence[tuple[str, nn.Parameter]]) -> list[tuple[str, nn.Parameter]]:
    """The parameters DeepSpeed's optimizer gets when the store owns the experts."""
    return [(n, p) for n, p in named if not is_expert_parameter(p)]


class EngineExpertStore:
    """The store of one rank's experts, with each expert parameter's layout-free (Hugging Face) name."""

    def __init__(self, store: ExpertStore, names: dict[ExpertKey, list[tuple[str, str]]]) -> None:
        self.store = store
        self.names = names  # (layer, expert) -> [(name in the expert module, layout-free name)]
        self.owned = {id(p) for p in store.parameters()}

    def holds(self, param: torch.Tensor) -> bool:
        return id(param) in self.owned

    # ---- checkpoints ----------------------------------------------------------------------------------------
    def weights(self) -> dict[str, torch.Tensor]:
        """Every expert's weights, CPU fp32, by layout-free name (what the model shard holds for them)."""
        out = {}
        for key, names in self.names.items():
            tensors = self.store.read_expert(key)
            out.update({full: tensors[local].float().contiguous() for local, full in names})
        return out

    def load_weights(self, read: Callable[[str], torch.Tensor]) -> None:
        """Set every expert's weights to ``read(layout-free name)``, wherever the expert is."""
        for key, names in self.names.items():
            tensors = self.store.read_expert(key)
            for local, full in names:
                value = read(full)
                if value.shape != tensors[local].shape:
                    raise ValueError(f"{full}: checkpoint {tuple(value.shape)}, expert {tuple(tensors[local].shape)}")
                tensors[local] = value.to(tensors[local].dtype)
                if f"{local}.master" in tensors:  # bf16: the file's fp32 numbers, as safe_set_full_fp32_param does
                    tensors[f"{local}.master"] = value.float()
            self.store.load_expert(key, tensors)

    def optimizer_state(self) -> dict[str, torch.Tensor]:
        """Adam's moments and step per expert parameter, in checkpoint/optimizer_state.py's keys (``<name>.exp_avg``
        ...)."""
        out: dict[str, torch.Tensor] = {}
        for key, names in self.names.items():
            tensors = self.store.read_expert(key)
            step = int(tensors[f"{names[0][0]}.step"])
            if step == 0:
                continue  # before the first step: no state, as for DeepSpeed's optimizer
            for local, full in names:
                out.update({f"{full}.{kind}": tensors[f"{local}.{kind}"].float() for kind in STATE_KEYS})
                out[f"{full}.step"] = torch.tensor(int(tensors[f"{local}.step"]), dtype=torch.int64)
                if f"{local}.master" in tensors:  # bf16 experts: checkpoint/optimizer_state.py's <name>.master
                    out[f"{full}.master"] = tensors[f"{local}.master"].float()
        return out

    def load_optimizer_state(self, keys: set[str], read: Callable[[str, str], torch.Tensor]) -> bool:
        """Load what ``optimizer_state`` saved; False when the checkpoint holds none for the experts."""
        loaded = False
        for key, names in self.names.items():
            if f"{names[0][1]}.step" not in keys:
                continue
            tensors = self.store.read_expert(key)
            for local, full in names:
                for kind in STATE_KEYS:
                    if f"{full}.{kind}" not in keys:
                        raise KeyError(f"optimizer state has no {full}.{kind}")
                    # the moment's own dtype: fp32 also beside a bf16 weight
                    tensors[f"{local}.{kind}"] = read(f"{full}.{kind}", full).to(tensors[f"{local}.{kind}"].dtype)
                tensors[f"{local}.step"] = torch.tensor(float(read(f"{full}.step", full)))
                if f"{local}.master" in tensors and f"{full}.master" in keys:
                    tensors[f"{local}.master"] = read(f"{full}.master", full).float()
            self.store.load_expert(key, tensors)
            loaded = True
        return loaded


def build_engine_store(
    module: nn.Module,
    named: Sequence[tuple[str, nn.Parameter]],
    *,
    device: torch.device,
    budget_bytes: int,
    disk_dir: Path | None,
    host_budget_bytes: int = 0,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
) -> EngineExpertStore | None:
    """The store of this rank's experts (after deepspeed.initialize: its broadcast needs the weights whole), hooked
    into every MoE layer's experts container in forward order; None on a pipeline stage without MoE blocks."""
    containers = [layer.deepspeed_moe.experts for layer in module.modules() if isinstance(layer, BloomMoE)]
    if not containers:
        return None
    full_name = {id(p): name for name, p in named}
    names = {
        (li, ei): [(local, full_name[id(p)]) for local, p in expert.named_parameters()]
        for li, container in enumerate(containers)
        for ei, expert in enumerate(container.deepspeed_experts)
    }
    # The dense optimizer's split (engine.param_groups): no weight decay on biases.
    # On CPU the engine's AdamW is torch's fused kernel (engine.adamw_kernel); the store runs the same one there, so
    # a tiered run repeats the resident one bit for bit. On an accelerator the store keeps the step count on the host,
    # where the fused kernel cannot read it: the per-tensor loop, equal within fp32 rounding.
    adamw = AdamWSettings(
        lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, decay_vectors=False, fused=device.type == "cpu"
    )
    store = ExpertStore(
        [list(c.deepspeed_experts) for c in containers],
        device=device,
        device_budget_bytes=budget_bytes,
        host_budget_bytes=host_budget_bytes or None,  # 0: unlimited host memory
        disk_dir=disk_dir,
        adamw=adamw,
    )
    attach_expert_store(store, containers)
    return EngineExpertStore(store, names)


def install_store_step(engine: Any, experts: EngineExpertStore, topology: ParallelTopology) -> None:
    """Put the store into DeepSpeed's step (module docstring): the fp32 ZeRO-0 one, or the bf16 optimizer's. Call
    after grads.install_global_norm_clipping, whose clipping this one replaces."""
    if engine.bfloat16_enabled():
        _install_bf16_store_step(engine, experts, topology)
        return
    if engine.zero_optimization():
        _install_zero_store_step(engine, experts, topology)
        return
    store, optimizer = experts.store, engine.optimizer
    edp_group = topology.group("edp")
    find_grads = engine._get_gradients_for_reduction
    apply_update = optimizer.step

    def gradients_for_reduction() -> tuple[list[torch.Tensor], dict[str, list[torch.Tensor]]]:
        # DeepSpeed hands over grad.data (a new tensor on the same memory): compare addresses
        owned = {p.grad.data_ptr() for p in store.parameters() if p.grad is not None and p.numel()}
        dense, by_group = find_grads()
        return [g for g in dense if g.data_ptr() not in owned], {
            name: [g for g in grads if g.data_ptr() not in owned] for name, grads in by_group.items()
        }

    def zero_grad() -> None:
        for param in engine.module.parameters():
            if not experts.holds(param):
                param.grad = None

    state: dict[str, float | None] = {"coefficient": None}

    def clip_fp32_gradients() -> None:
        # The experts' gradients summed over edp and divided by dp, as DeepSpeed does for the experts it reduces.
        store.all_reduce_grads(edp_group, divide_by=topology.dp)
        dense = [p for p in engine.module.parameters() if not experts.holds(p)]
        norm = clip_by_global_norm(dense, engine.gradient_clipping(), topology, store.grad_norm_sq())
        engine._global_grad_norm = norm
        state["coefficient"] = clip_coefficient(norm, engine.gradient_clipping())
        optimizer.overflow = not math.isfinite(float(norm))

    def step(*args: Any, **kwargs: Any) -> Any:
        if optimizer.overflow:
            store.zero_grads()
            return None
        result = apply_update(*args, **kwargs)
        store.step(float(optimizer.param_groups[0]["lr"]), grad_scale=state["coefficient"])
        return result

    engine._get_gradients_for_reduction = gradients_for_reduction
    engine.zero_grad = zero_grad
    engine.clip_fp32_gradients = clip_fp32_gradients
    optimizer.step = step


def _store_squares(store: ExpertStore, topology: ParallelTopology) -> torch.Tensor:
    """This rank's share of the store's squares in the global norm (fp64): summed over the ep group (each ep rank
    holds other experts) and counted on tp rank 0 (experts are replicated over tp); a sum over the model-parallel
    group (tp x pp) completes it, as grads.global_grad_norm does."""
    squares = torch.tensor(store.grad_norm_sq(), dtype=torch.float64, device=collective_device(topology.group("ep")))
    if topology.ep > 1:
        dist.all_reduce(squares, group=topology.group("ep"))
    if topology.tp_rank(dist.get_rank()) != 0:
        squares.zero_()
    return squares


def _store_norm_share(store: ExpertStore, topology: ParallelTopology, device: torch.device) -> torch.Tensor:
    """_store_squares as a one-element tensor whose square it is: one more tensor in the bf16 optimizer's norm,
    whose sum over the model-parallel group completes it."""
    return _store_squares(store, topology).sqrt().to(device=device, dtype=torch.float32).reshape(1)


def _install_bf16_store_step(engine: Any, experts: EngineExpertStore, topology: ParallelTopology) -> None:
    """DeepSpeed's BF16_Optimizer (bf16 at ZeRO 0 and 1, step/deepspeed_config.py) steps the dense parameters: fp32
    gradient buffers filled after each micro-batch, reduced over dp in fp32, the global norm of them, clipping, AdamW
    on fp32 master partitions, bf16 weights copied from the masters. The store does the same for its experts (its
    bf16 experts have fp32 masters and fp32 gradients, experts/store.py), around that step:
    - before it, the experts' fp32 gradients are reduced (sum over edp, times 1 / dp, as DeepSpeed's expert
      reduction); DeepSpeed reduces only its optimizer's buffers, which hold no expert;
    - its norm adds the store's squares through ``get_grads_for_norm`` (the list it sums, one tensor more);
    - after it, the store steps with the same clip coefficient, or zeroes its gradients where the norm was not
      finite (the bf16 optimizer then skipped its update)."""
    store, optimizer = experts.store, engine.optimizer
    dense_grads_for_norm = optimizer.get_grads_for_norm
    fold_dense = optimizer.update_hp_grads

    def update_hp_grads(*args: Any, **kwargs: Any) -> Any:
        # where DeepSpeed adds a micro-batch's bf16 gradients into its fp32 buffers (after the whole backward of
        # it, the pipeline's second pass for the MoE loss included): the store's experts too
        result = fold_dense(*args, **kwargs)
        store.fold_grads()
        return result

    def grads_for_norm(for_clipping: bool = False) -> Any:
        if for_clipping:  # the tensors clipping scales: DeepSpeed's own; the store scales its in its step
            return dense_grads_for_norm(for_clipping=True)
        dense, by_expert_group = dense_grads_for_norm()
        return [*dense, _store_norm_share(store, topology, engine.device)], by_expert_group

    optimizer.get_grads_for_norm = grads_for_norm
    optimizer.update_hp_grads = update_hp_grads
    optimizer.step = _store_steps_after(optimizer, store, topology)


def _install_zero_store_step(engine: Any, experts: EngineExpertStore, topology: ParallelTopology) -> None:
    """fp32 at ZeRO 1: DeepSpeed's ZeRO optimizer reduces its partitions over dp, takes the global norm of them
    (``scaled_global_norm``, already summed over the model-parallel group), clips and steps them. The store's
    experts are in none of its groups: they are reduced before that step, their squares (summed over ep and the
    model-parallel group here) join its norm, and the store steps after it with the same clip coefficient."""
    store, optimizer = experts.store, engine.optimizer
    dense_norm = optimizer.scaled_global_norm

    def scaled_global_norm(*args: Any, **kwargs: Any) -> torch.Tensor:
        norm = dense_norm(*args, **kwargs)
        squares = _store_squares(store, topology)
        if group_size(topology.mp_group) > 1:
            dist.all_reduce(squares, group=topology.mp_group)
        total = (norm.double().to(squares.device) ** 2 + squares).sqrt()
        return total.to(device=norm.device, dtype=norm.dtype)

    optimizer.scaled_global_norm = scaled_global_norm
    optimizer.step = _store_steps_after(optimizer, store, topology)


def _store_steps_after(optimizer: Any, store: ExpertStore, topology: ParallelTopology) -> Callable[..., Any]:
    """``optimizer.step`` (DeepSpeed's bf16 or ZeRO optimizer) followed by the store's: the store's gradients are
    reduced first (sum over edp / dp), and after DeepSpeed's update the store steps with DeepSpeed's own clip
    coefficient, clip / (norm + 1e-6) where below 1 (its clip_grad is inf without clipping), or drops its gradients
    where DeepSpeed skipped the step on a non-finite norm."""
    apply_update, edp_group = optimizer.step, topology.group("edp")

    def step(*args: Any, **kwargs: Any) -> Any:
        store.all_reduce_grads(edp_group, divide_by=topology.dp)
        result = apply_update(*args, **kwargs)
        if optimizer.overflow:
            store.zero_grads()
            return result
        coefficient = clip_coefficient(float(optimizer._global_grad_norm), float(optimizer.clip_grad))
        store.step(float(optimizer.param_groups[0]["lr"]), grad_scale=coefficient)
        return result

    return step
