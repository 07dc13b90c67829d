"""Fused bias + GeLU(tanh) vs the fp32 reference, including saturated inputs."""

from __future__ import annotations

import pytest
import torch

from kernels import reference
from kernels.bias_gelu import FusedBiasGelu, bias_gelu


@pytest.mark.parametrize(
    ("shape", "dtype", "spread"),
    [
        ((1, 1, 1023), torch.float32, 3.0),  # one ragged row across many column tiles
        ((3, 7, 96), torch.bfloat16, 3.0),  # ragged tiles both ways (21 rows, 96 columns; 16 x 64 tiles)
        ((9, 40), torch.float32, 30.0),  # |x| up to ~100: tanh saturates, exp must not overflow into NaN
    ],
)
def test_bias_gelu_matches_reference(shape, dtype, spread, device, assert_matches) -> None:
    gen = torch.Generator().manual_seed(4)
    x = (spread * torch.randn(shape, generator=gen)).to(device, dtype).requires_grad_()
    bias = torch.randn(shape[-1], generator=gen).to(device, dtype).requires_grad_()
    dy = torch.randn(shape, generator=gen).to(device, dtype)
    y = bias_gelu(x, bias)
    y.backward(dy)
    x32, b32 = (t.detach().float().requires_grad_() for t in (x, bias))
    y32 = reference.bias_gelu(x32, b32)
    y32.backward(dy.float())
    assert y.dtype == dtype
    assert_matches(y, y32, dtype, scale=2 if spread > 10 else 1)
    assert_matches(x.grad, x32.grad, dtype)
    assert_matches(bias.grad, b32.grad, dtype, scale=5)


def test_bias_shape_checked(device) -> None:
    with pytest.raises(ValueError, match="bias shape"):
        bias_gelu(torch.zeros(2, 8, device=device), torch.zeros(7, device=device))


def test_module_applies_its_bias(device) -> None:
    module = FusedBiasGelu(16).to(device)
    with torch.no_grad():
        module.bias.fill_(0.5)
    x = torch.randn(3, 16, device=device)
    expected = torch.nn.functional.gelu(x + 0.5, approximate="tanh")
    torch.testing.assert_close(module(x), expected, atol=2e-6, rtol=2e-6)
