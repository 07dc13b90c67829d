"""Training-size shapes on a real GPU, bf16, against the fp32 twins. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import backend_env, reference, registry

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    # norm-wise: robust for large tensors where a few elementwise bf16 roundings would dominate a max
    return ((actual.float() - expected.float()).norm() / expected.float().norm()).item()


def _check(ours, plain, inputs: list[torch.Tensor], limit: float = 1e-2) -> None:
    upcast = [t.detach().float().requires_grad_(t.requires_grad) if t.is_floating_point() else t for t in inputs]
    out, out32 = ours(*inputs), plain(*upcast)
    dy = torch.randn_like(out32)
    grads = torch.autograd.grad(out, [t for t in inputs if t.requires_grad], dy.to(out.dtype))
    grads32 = torch.autograd.grad(out32, [t for t in upcast if t.requires_grad], dy)
    for actual, expected in zip((out, *grads), (out32, *grads32), strict=True):
        assert _relative_error(actual, expected) < limit


@pytest.fixture(autouse=True)
def _triton(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(backend_env.BACKEND_ENV, "auto")


def _bf16(*shape: int, scale: float = 1.0) -> torch.Tensor:
    return (scale * torch.randn(*shape, device="cuda")).to(torch.bfloat16).requires_grad_()


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("seq", [1023, 2048])
def test_flash_attention_bf16(head_dim: int, seq: int) -> None:
    slopes = reference.alibi_slopes(12, "cuda")
    q, k, v = (_bf16(2, 12, seq, head_dim) for _ in range(3))
    _check(
        lambda q, k, v: registry.flash_alibi_attention(q, k, v, slopes),
        lambda q, k, v: reference.flash_alibi_attention(q, k, v, slopes),
        [q, k, v],
    )


def test_flash_attention_fp32_is_exact() -> None:
    slopes = reference.alibi_slopes(4, "cuda")
    q, k, v = (torch.randn(1, 4, 333, 64, device="cuda", requires_grad=True) for _ in range(3))
    _check(
        lambda q, k, v: registry.flash_alibi_attention(q, k, v, slopes),
        lambda q, k, v: reference.flash_alibi_attention(q, k, v, slopes),
        [q, k, v],
        limit=1e-5,
    )


def test_layer_norm_and_bias_gelu_bf16_bloom_width() -> None:
    x, w, b = _bf16(257, 14336), _bf16(14336, scale=0.1), _bf16(14336, scale=0.1)
    _check(registry.layer_norm, reference.layer_norm, [x, w, b])
    _check(registry.bias_gelu, reference.bias_gelu, [_bf16(257, 14336, scale=2.0), b])


def test_alibi_softmax_bf16_with_padding() -> None:
    slopes = reference.alibi_slopes(16, "cuda")
    mask = torch.ones(2, 2048, dtype=torch.long, device="cuda")
    mask[1, :100] = 0
    _check(
        lambda s: registry.alibi_softmax(s, slopes, mask, 0.125),
        lambda s: reference.alibi_softmax(s, slopes, mask, 0.125),
        [_bf16(2, 16, 2048, 2048, scale=3.0)],
    )


def test_vocab_cross_entropy_bf16_large_vocab() -> None:
    hidden, weight = _bf16(1000, 1024), _bf16(50257, 1024, scale=0.02)
    labels = torch.randint(0, 50257, (1000,), device="cuda")
    labels[::7] = -100
    _check(
        lambda h, w: registry.vocab_cross_entropy(h, w, labels, chunk_size=256),
        lambda h, w: F.cross_entropy(h @ w.t(), labels, ignore_index=-100),
        [hidden, weight],
    )
