"""BLOOM's MLP (dense_h_to_4h, bias+GeLU, dense_4h_to_h): the dense block's MLP and each expert of an MoE layer."""

from __future__ import annotations

import torch
from torch import nn

from appliance.model import ops
from appliance.model.config import BloomConfig
from appliance.model.linear import LinearFactory, project


class BloomMLP(nn.Module):
    def __init__(self, config: BloomConfig, linear_factory: LinearFactory) -> None:
        super().__init__()
        self.dense_h_to_4h = linear_factory(config.hidden_size, config.ffn_hidden_size, True, "mlp_in")
        self.dense_4h_to_h = linear_factory(config.ffn_hidden_size, config.hidden_size, True, "mlp_out")

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        hidden, bias = project(self.dense_h_to_4h, x)
        return project(self.dense_4h_to_h, ops.bias_gelu(hidden, bias))
