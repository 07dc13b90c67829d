"""The linear layers a BLOOM model is built from: a factory by role, so tensor-parallel linears can take the place of
nn.Linear without changing the model, and the Megatron convention for a deferred bias (`skip_bias_add`)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

# (in_features, out_features, bias, role) -> module with .weight [out, in] and .bias [out] (or None).
LinearFactory = Callable[[int, int, bool, str], nn.Module]
LINEAR_ROLES = ("qkv", "attn_out", "mlp_in", "mlp_out")


class SkipBiasLinear(nn.Linear):
    """nn.Linear that leaves its bias to the caller, which folds it into the following fused op."""

    skip_bias_add = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


def default_linear_factory(in_features: int, out_features: int, bias: bool, role: str) -> nn.Module:
    """Single-device linears. The three whose bias Megatron fuses into the next op defer their bias."""
    if role not in LINEAR_ROLES:
        raise ValueError(f"unknown linear role {role!r}; expected one of {LINEAR_ROLES}")
    if role == "qkv":
        return nn.Linear(in_features, out_features, bias=bias)
    return SkipBiasLinear(in_features, out_features, bias=bias)


def project(linear: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run a factory linear; return its output and the bias still to be added (None when already added)."""
    out = linear(x)
    bias = getattr(linear, "bias", None)
    if getattr(linear, "skip_bias_add", False) and isinstance(bias, torch.Tensor):
        return out, bias
    return out, None
