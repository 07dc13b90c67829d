"""A small MoE stack for the expert store's tests and bench: residual blocks whose experts are DeepSpeed's
`Experts` container of BLOOM MLPs (h -> 4h, GeLU, 4h -> h), the container the BLOOM-MoE model uses.

Routing is fixed, not learned, so two runs route the same tokens to the same experts whatever their weights do:
token t of a micro-batch goes to expert t % E (E experts, T tokens, T / E tokens each: every expert is used in
every step). A learned sigmoid gate per token scales the experts' output, so the non-expert weights train too.
"""

from __future__ import annotations

import torch
from deepspeed.moe.experts import Experts
from torch import nn


class BloomMlp(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.dense_h_to_4h = nn.Linear(hidden, 4 * hidden)
        self.dense_4h_to_h = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense_4h_to_h(nn.functional.gelu(self.dense_h_to_4h(x), approximate="tanh"))


class FixedRouteMoeBlock(nn.Module):
    def __init__(self, hidden: int, num_experts: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.norm = nn.LayerNorm(hidden)
        self.gate = nn.Linear(hidden, 1)
        self.experts = Experts(BloomMlp(hidden), num_local_experts=num_experts)
        for expert in self.experts.deepspeed_experts:  # Experts deep-copies one expert: give each its own draw
            for module in expert.modules():
                if isinstance(module, nn.Linear):
                    module.reset_parameters()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        hidden = tokens.shape[-1]
        experts, per_expert = self.num_experts, tokens.shape[0] // self.num_experts
        h = self.norm(tokens)
        # [T, H] -> [T/E, E, H] -> [E, T/E, H]: row e holds tokens e, e + E, ...; Experts cuts dim 1 into E chunks
        dispatched = h.reshape(per_expert, experts, hidden).transpose(0, 1).reshape(1, experts * per_expert, hidden)
        out = self.experts(dispatched).reshape(experts, per_expert, hidden).transpose(0, 1).reshape(-1, hidden)
        return x + (out * torch.sigmoid(self.gate(h))).reshape(x.shape)


class MoeStack(nn.Module):
    def __init__(self, hidden: int, num_experts: int, layers: int, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.moe_blocks = [FixedRouteMoeBlock(hidden, num_experts) for _ in range(layers)]  # typed view
        self.blocks = nn.ModuleList(self.moe_blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x

    def expert_containers(self) -> list[nn.Module]:
        return [block.experts for block in self.moe_blocks]

    def expert_layers(self) -> list[list[nn.Module]]:
        return [list(block.experts.deepspeed_experts) for block in self.moe_blocks]


def dense_parameters(model: MoeStack) -> list[nn.Parameter]:
    """The parameters outside the experts (norms, gates)."""
    experts = {id(p) for c in model.expert_containers() for p in c.parameters()}
    return [p for p in model.parameters() if id(p) not in experts]
