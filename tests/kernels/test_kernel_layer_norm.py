"""Fused LayerNorm vs the fp32 reference: output and the gradients of x, weight and bias."""

from __future__ import annotations

import pytest
import torch

from kernels import reference
from kernels.layer_norm import FusedLayerNorm, layer_norm

CASES = [
    # (shape, dtype): one 1023-wide row (ragged block); 21 bf16 rows (two 16-row interpreter tiles); 50 rows so
    # each of the two backward programs walks two tiles
    ((1, 1, 1023), torch.float32),
    ((3, 7, 256), torch.bfloat16),
    ((50, 33), torch.float32),
]


@pytest.mark.parametrize(("shape", "dtype"), CASES)
def test_layer_norm_matches_reference(shape, dtype, device, assert_matches) -> None:
    gen = torch.Generator().manual_seed(1)
    n = shape[-1]
    x = (torch.randn(shape, generator=gen) * 2 + 0.5).to(device, dtype).requires_grad_()
    w = (1 + 0.1 * torch.randn(n, generator=gen)).to(device, dtype).requires_grad_()
    b = (0.1 * torch.randn(n, generator=gen)).to(device, dtype).requires_grad_()
    dy = torch.randn(shape, generator=gen).to(device, dtype)

    y = layer_norm(x, w, b, 1e-5)
    y.backward(dy)
    x32, w32, b32 = (t.detach().float().requires_grad_() for t in (x, w, b))
    y32 = reference.layer_norm(x32, w32, b32, 1e-5)
    y32.backward(dy.float())

    assert y.dtype == dtype and y.shape == x.shape
    assert_matches(y, y32, dtype)
    assert_matches(x.grad, x32.grad, dtype, scale=2)
    assert_matches(w.grad, w32.grad, dtype, scale=5)  # sums over all rows
    assert_matches(b.grad, b32.grad, dtype, scale=5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_wide_row_backward_schedule(dtype, device, assert_matches, monkeypatch: pytest.MonkeyPatch) -> None:
    # Rows past FUSED_BWD_MAX take the two-pass backward; lower the threshold so 1023-wide rows exercise it.
    import kernels.layer_norm as module

    monkeypatch.setattr(module, "FUSED_BWD_MAX", 512)
    gen = torch.Generator().manual_seed(10)
    x = torch.randn(3, 7, 1023, generator=gen).to(device, dtype).requires_grad_()
    w = (1 + 0.1 * torch.randn(1023, generator=gen)).to(device, dtype).requires_grad_()
    b = (0.1 * torch.randn(1023, generator=gen)).to(device, dtype).requires_grad_()
    dy = torch.randn(3, 7, 1023, generator=gen).to(device, dtype)
    layer_norm(x, w, b, 1e-5).backward(dy)
    x32, w32, b32 = (t.detach().float().requires_grad_() for t in (x, w, b))
    reference.layer_norm(x32, w32, b32, 1e-5).backward(dy.float())
    assert_matches(x.grad, x32.grad, dtype, scale=2)
    assert_matches(w.grad, w32.grad, dtype, scale=5)
    assert_matches(b.grad, b32.grad, dtype, scale=5)


def test_layer_norm_strided_input_and_fp32_params(device, assert_matches) -> None:
    # bf16 activations with fp32 parameters (mixed precision), input a transposed (non-contiguous) view
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(40, 3, generator=gen).to(device, torch.bfloat16).t().requires_grad_()  # [3, 40], stride (1, 3)
    w = torch.randn(40, generator=gen).to(device).requires_grad_()
    b = torch.randn(40, generator=gen).to(device).requires_grad_()
    y = layer_norm(x, w, b, 1e-5)
    y.sum().backward()
    x32, w32, b32 = (t.detach().float().requires_grad_() for t in (x, w, b))
    reference.layer_norm(x32, w32, b32, 1e-5).sum().backward()
    assert y.dtype == torch.bfloat16 and w.grad.dtype == torch.float32
    assert_matches(y, reference.layer_norm(x32, w32, b32, 1e-5), torch.bfloat16)
    assert_matches(w.grad, w32.grad, torch.bfloat16)


def test_module_matches_torch_layer_norm(device) -> None:
    torch.manual_seed(3)
    fused, plain = FusedLayerNorm(24).to(device), torch.nn.LayerNorm(24).to(device)
    with torch.no_grad():
        fused.weight.normal_()
        plain.weight.copy_(fused.weight)
    x = torch.randn(2, 5, 24, device=device)
    torch.testing.assert_close(fused(x), plain(x), atol=2e-6, rtol=2e-6)
