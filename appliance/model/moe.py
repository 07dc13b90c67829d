"""BLOOM-MoE's mixture-of-experts MLP, built on DeepSpeed's MoE layer (``deepspeed.moe.layer.MoE``).

An MoE block (config.is_moe_block) keeps BLOOM's attention and replaces its MLP by ``BloomMoE``: a top-k gate
(DeepSpeed's TopKGate, a [experts, hidden] linear without bias, softmax in fp32) sends each token to k of
``moe_num_experts`` experts, each one BLOOM's own MLP (dense_h_to_4h, tanh GeLU, dense_4h_to_h, biases added in
place). DeepSpeed computes GShard's load-balancing loss (mean over experts of token fraction x mean gate
probability, times experts^2) and the tokens each expert got; the block keeps both from its last forward
(``aux_loss``, ``expert_counts``) for the model's loss and for the step events.

Tensor parallelism: at tp > 1 the block passes its tensor-parallel linear factory, and every expert is sharded
over tp like the dense MLP (``ExpertMLP``; the token drop and gather around the all-to-all are DeepSpeed's, over our
tp group: parallel/experts/parallel.py).

Expert parallelism: with ep > 1 each rank of an ``ep`` group holds experts [ep_rank * E/ep, (ep_rank + 1) * E/ep)
and DeepSpeed exchanges tokens over the group with two all-to-alls per layer and pass. Which all-to-all is used is
chosen in one place, parallel/experts/exchange.py ``select_all_to_all`` (the hierarchical one where the ep group spans
nodes and the planner's cost model prefers it, else DeepSpeed's), and put in DeepSpeed's place by
``install_all_to_all`` here, the model's one seam for it.

Names. DeepSpeed names its parameters ``deepspeed_moe.gate.wg.weight`` and
``deepspeed_moe.experts.deepspeed_experts.<local index>.<linear>.<leaf>``; checkpoints, initial weights and exports
use the layout-free names ``mlp.gate.weight`` and ``mlp.experts.<global index>.<linear>.<leaf>``
(``canonical_moe_name``), so the same expert has the same name and the same initial values at every ep.
"""

from __future__ import annotations

import copy
import re
from typing import Any

import torch
import torch.distributed as dist
from deepspeed.moe import sharded_moe
from deepspeed.moe.layer import MoE
from torch import nn

from appliance.model.config import BloomConfig
from appliance.model.linear import LinearFactory
from appliance.model.mlp import BloomMLP

_GATE = re.compile(r"(^|\.)deepspeed_moe\.gate\.wg\.")
_EXPERT = re.compile(r"(^|\.)deepspeed_moe\.experts\.deepspeed_experts\.(\d+)\.")
_CANONICAL_GATE = re.compile(r"(^|\.)gate\.(?=weight$)")
_CANONICAL_EXPERT = re.compile(r"(^|\.)experts\.(\d+)\.")

# DeepSpeed's own autograd all-to-all, kept before anything replaces it.
DEEPSPEED_ALL_TO_ALL: type[torch.autograd.Function] = sharded_moe._AllToAll


def canonical_moe_name(name: str, expert_offset: int = 0) -> str:
    """DeepSpeed's parameter name -> the layout-free one; ``expert_offset`` is this rank's first global expert
    (ep_rank * experts / ep). Names of non-MoE parameters come back unchanged."""
    name = _GATE.sub(r"\1gate.", name)
    match = _EXPERT.search(name)
    if match:
        index = int(match.group(2)) + expert_offset
        name = f"{name[: match.start()]}{match.group(1)}experts.{index}.{name[match.end() :]}"
    return name


def deepspeed_moe_name(name: str, expert_offset: int = 0) -> str:
    """The inverse of ``canonical_moe_name`` (for ``load_state_dict``)."""
    name = _CANONICAL_GATE.sub(r"\1deepspeed_moe.gate.wg.", name)
    match = _CANONICAL_EXPERT.search(name)
    if match:
        local = int(match.group(2)) - expert_offset
        inner = f"deepspeed_moe.experts.deepspeed_experts.{local}."
        name = f"{name[: match.start()]}{match.group(1)}{inner}{name[match.end() :]}"
    return name


def install_all_to_all(exchange: Any) -> None:
    """Make DeepSpeed's MoE layers use ``exchange`` (an object with ``apply(group, x)``, DeepSpeed's own
    ``_AllToAll`` or ``experts.all_to_all.MoeAllToAll``): MOELayer.forward looks up the module-level ``_AllToAll``."""
    sharded_moe._AllToAll = exchange


def _plain_linear(in_features: int, out_features: int, bias: bool, role: str) -> nn.Module:
    # At tp = 1 experts are whole, and a plain nn.Linear adds its own bias.
    return nn.Linear(in_features, out_features, bias=bias)


class ExpertMLP(BloomMLP):
    """One expert: BLOOM's MLP returning one tensor, its output bias added (DeepSpeed's Experts drops the second
    element of a returned tuple), under BloomMLP's parameter names. Built with the block's tensor-parallel linear
    factory at tp > 1, the expert is sharded like the dense MLP: dense_h_to_4h column-parallel, dense_4h_to_h
    row-parallel (its all-reduce makes the output whole on every tp rank before the replicated bias is added)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        out, bias = super().forward(x)
        return out if bias is None else out + bias

    def __deepcopy__(self, memo: dict[int, Any]) -> ExpertMLP:
        # DeepSpeed's Experts deep-copies the expert once per local expert; tensor-parallel linears hold their
        # process group, which is shared by the copies (a ProcessGroup cannot be copied).
        for module in self.modules():
            for value in vars(module).values():
                if isinstance(value, dist.ProcessGroup):
                    memo[id(value)] = value
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        for key, value in vars(self).items():
            new.__dict__[key] = copy.deepcopy(value, memo)
        return new


class BloomMoE(MoE):
    """The MoE MLP of a BLOOM block: forward(x [..., hidden]) -> (y [..., hidden], None), as BloomMLP's
    (output, bias still to add). ``ep_size`` ranks share the experts (1: all of them here); ``linear_factory``
    (tp > 1: the block's tensor-parallel factory) shards every expert over tp, None keeps them whole."""

    def __init__(
        self, config: BloomConfig, ep_size: int = 1, linear_factory: LinearFactory | None = None, tp_size: int = 1
    ) -> None:
        if not config.is_moe:
            raise ValueError("BloomMoE needs moe_num_experts > 0")
        if config.moe_num_experts % ep_size:
            raise ValueError(
                f"moe_num_experts({config.moe_num_experts}) % ep({ep_size}) = {config.moe_num_experts % ep_size}, "
                "must be 0 so every expert-parallel rank holds the same number of experts"
            )
        super().__init__(
            config.hidden_size,
            ExpertMLP(config, linear_factory or _plain_linear),
            num_experts=config.moe_num_experts,
            ep_size=ep_size,
            k=config.moe_top_k,
            capacity_factor=config.moe_capacity_factor,
            eval_capacity_factor=config.moe_eval_capacity_factor,
            min_capacity=config.moe_min_capacity,
            drop_tokens=config.moe_drop_tokens,
            use_rts=config.moe_random_routing,
            top2_2nd_expert_sampling=config.moe_random_routing,
        )
        self.min_capacity = config.moe_min_capacity
        self.tp_size = tp_size  # the tp group the experts are sharded over (linear_factory's)
        self.expert_offset = 0  # this rank's first global expert; the parallel layer sets it
        self.aux_loss: torch.Tensor | None = None  # the last forward's load-balancing loss (scalar, fp32)
        self.expert_counts: torch.Tensor | None = None  # the last forward's tokens per expert, [experts]
        # Tokens per expert summed over the training forwards since the trainer last read them (a recomputed
        # forward counts again, every micro-batch alike, so the fractions hold).
        self.step_counts: torch.Tensor | None = None
        self._register_state_dict_hook(_canonical_state_dict)
        self._register_load_state_dict_pre_hook(_deepspeed_state_dict, with_module=True)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        # DeepSpeed's top-1 gate refuses fewer tokens than min_capacity (a short prompt in greedy decoding): such a
        # call's floor is its token count. Every rank of an ep group passes as many tokens, so they still agree.
        gate = self.deepspeed_moe.gate
        tokens = x.numel() // x.shape[-1]
        gate.min_capacity = min(self.min_capacity, tokens)
        if self.tp_size > 1 and gate.drop_tokens:
            gate.min_capacity = self._capacity_over_tp(tokens, gate.min_capacity)
        out, aux_loss, counts = super().forward(x)
        self.aux_loss, self.expert_counts = aux_loss, counts
        if self.training:
            self.step_counts = counts if self.step_counts is None else self.step_counts + counts
        return out.to(x.dtype), None

    def _capacity_over_tp(self, tokens: int, floor: int) -> int:
        """At tp > 1 each tp rank sends 1/tp of an expert's slots, so the capacity must be a multiple of tp. With
        token dropping DeepSpeed's gate gives ceil(tokens / experts x capacity_factor x k) slots (fp32, as here), at
        least ``min_capacity``: raising that floor to the capacity rounded up to tp makes it the capacity (at most
        tp - 1 more slots). Not past the token count, which the top-k selection of slots cannot exceed."""
        gate = self.deepspeed_moe.gate
        factor = (gate.capacity_factor if gate.training else gate.eval_capacity_factor) * gate.k
        slots = int(torch.ceil(tokens / self.num_experts * torch.tensor(factor)))
        rounded = -(-max(slots, floor) // self.tp_size) * self.tp_size
        return rounded if rounded <= tokens else floor


def _canonical_state_dict(module: BloomMoE, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    for key in [k for k in state_dict if k.startswith(prefix)]:
        new = prefix + canonical_moe_name(key[len(prefix) :], module.expert_offset)
        if new != key:
            state_dict[new] = state_dict.pop(key)


def _deepspeed_state_dict(module: BloomMoE, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
    for key in [k for k in state_dict if k.startswith(prefix)]:
        new = prefix + deepspeed_moe_name(key[len(prefix) :], module.expert_offset)
        if new != key:
            state_dict[new] = state_dict.pop(key)


def moe_layers(model: nn.Module) -> list[BloomMoE]:
    """The model's MoE MLPs, in block order."""
    return [m for m in model.modules() if isinstance(m, BloomMoE)]


def aux_loss_sum(layers: list[BloomMoE], like: torch.Tensor) -> torch.Tensor:
    """The summed load-balancing loss of ``layers``' last forward (0 on ``like``'s device when there is none)."""
    total = torch.zeros((), dtype=torch.float32, device=like.device)
    for layer in layers:
        if layer.aux_loss is not None:
            total = total + layer.aux_loss.float()
    return total


def expert_load(counts: list[torch.Tensor]) -> list[list[float]]:
    """Per MoE layer, the fraction of routed tokens each expert got (the step events' ``expert_load``)."""
    out = []
    for c in counts:
        total = float(c.sum())
        out.append([float(x) / total if total else 0.0 for x in c.tolist()])
    return out
