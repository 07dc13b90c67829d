"""The tiered expert store's records (experts/store.py): an expert's slot (its parameters, AdamW, fp32 masters, tier
and pins), the AdamW settings every expert steps with, and the per-tier move counters.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from appliance.parallel.experts.store_tiers import Tensors

TIERS = ("device", "host", "disk")
STATE_KEYS = ("exp_avg", "exp_avg_sq")  # AdamW's per-element state, moved with the expert

ExpertKey = tuple[int, int]  # (MoE layer in forward order, expert index in the layer)


@dataclass
class TierCounters:
    hits: int = 0
    fetches: int = 0
    evictions: int = 0
    bytes_in: int = 0
    bytes_out: int = 0


@dataclass(frozen=True)
class AdamWSettings:
    """torch.optim.AdamW's defaults; a run passes its own (expert_store_for_run)."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 1e-2
    # Megatron's split, as the engine's dense optimizer has it (engine.param_groups): no decay on biases (1-D)
    decay_vectors: bool = True
    # torch's fused kernel instead of the per-tensor loop: also elementwise, so the same bits per expert as one fused
    # AdamW over every parameter (what the engine's dense optimizer runs on CPU, engine.adamw_kernel). It reads the
    # step count on the parameters' device, so only where that is the host (CPU); foreach=False elsewhere.
    fused: bool = False


@dataclass(eq=False)
class ExpertSlot:
    key: ExpertKey
    module: nn.Module
    names: list[str]
    params: list[nn.Parameter]
    optimizer: torch.optim.AdamW
    nbytes: int
    # bf16 experts: an fp32 master per parameter, which AdamW steps and whose .grad accumulates the micro-batches'
    # gradients in fp32 (DeepSpeed's BF16_Optimizer's arithmetic); empty for fp32 experts, their own masters.
    masters: list[nn.Parameter] = field(default_factory=list)
    unfolded: bool = False  # bf16: a micro-batch's gradient is in the bf16 .grad, not yet added to the master's
    tier: str = "device"
    host: Tensors | None = None
    forward_pinned: bool = False
    grads_pending: int = 0  # parameters whose gradient this backward has still to accumulate
    grads_early: int = 0  # gradients accumulated in this backward before its first use of the weights
    backward_uses: set[int] = field(default_factory=set)

    @property
    def pinned(self) -> bool:
        return self.forward_pinned or self.grads_pending > 0

    @property
    def trained(self) -> list[nn.Parameter]:
        """What AdamW steps and where the gradients accumulate: the fp32 masters, or the fp32 parameters."""
        return self.masters or self.params
