"""Fused scale-mask-softmax with ALiBi vs the fp32 reference, and the reference vs transformers' BLOOM ALiBi."""

from __future__ import annotations

import pytest
import torch

from kernels import reference
from kernels.softmax import alibi_softmax


def _left_padded_mask(batch: int, k_len: int) -> torch.Tensor:
    mask = torch.ones(batch, k_len, dtype=torch.long)
    mask[0, : k_len - 3] = 0  # left padding: the first queries of row 0 see no real key at all
    mask[-1, -1] = 0  # a padded key at the end
    return mask


@pytest.mark.parametrize(
    ("shape", "dtype", "padded", "causal"),
    [
        ((3, 12, 7, 7), torch.float32, False, True),  # 12 heads (non-power-of-two slopes), batch 3, odd length
        ((2, 3, 5, 33), torch.bfloat16, True, True),  # 5 new queries after a 28-token prefix, left padding
        ((2, 3, 9, 9), torch.float32, True, False),  # bidirectional with padding
    ],
)
def test_alibi_softmax_matches_reference(shape, dtype, padded, causal, device, assert_matches) -> None:
    gen = torch.Generator().manual_seed(5)
    b, h, _, k_len = shape
    scores = (3 * torch.randn(shape, generator=gen)).to(device, dtype).requires_grad_()
    slopes = reference.alibi_slopes(h, device)
    mask = _left_padded_mask(b, k_len).to(device) if padded else None
    dprobs = torch.randn(shape, generator=gen).to(device, dtype)

    probs = alibi_softmax(scores, slopes, mask, 0.3, causal)
    probs.backward(dprobs)
    s32 = scores.detach().float().requires_grad_()
    p32 = reference.alibi_softmax(s32, slopes, mask, 0.3, causal)
    p32.backward(dprobs.float())

    assert probs.dtype == dtype
    assert_matches(probs, p32, dtype)
    assert_matches(scores.grad, s32.grad, dtype)
    if padded and causal:  # the first query of batch 0 sees only padding: an all-zero row, not NaN
        assert probs[0, :, 0].abs().sum() == 0


def test_strided_scores(device, assert_matches) -> None:
    # scores as a transposed view ([b, q, h, k] storage), as a baddbmm output reshaped by the caller might be
    gen = torch.Generator().manual_seed(6)
    base = torch.randn(2, 6, 4, 6, generator=gen).to(device)
    scores = base.transpose(1, 2).requires_grad_()
    slopes = reference.alibi_slopes(4, device)
    probs = alibi_softmax(scores, slopes, None, 0.5, True)
    probs.sum().backward()
    assert_matches(probs, reference.alibi_softmax(scores.detach(), slopes, None, 0.5, True), torch.float32)


def test_reference_alibi_is_transformers_bloom() -> None:
    """Our ALiBi (slopes, positions under padding, causal mask) equals transformers' BLOOM attention weights."""
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    torch.manual_seed(7)
    b, h, s = 2, 12, 6
    mask = _left_padded_mask(b, s)
    scores = torch.randn(b, h, s, s)
    scale = 0.25
    # BLOOM: alibi.baddbmm(q, k^T, beta=1, alpha=scale), then masked_fill(causal | padding, finfo.min), softmax
    alibi = build_alibi_tensor(mask, h, torch.float32).view(b, h, 1, s)
    causal = torch.ones(s, s, dtype=torch.bool).triu(1)
    hidden = causal.view(1, 1, s, s) | (mask == 0).view(b, 1, 1, s)
    logits = (scores * scale + alibi).masked_fill(hidden, torch.finfo(torch.float32).min)
    expected = torch.softmax(logits, dim=-1)
    ours = reference.alibi_softmax(scores, reference.alibi_slopes(h), mask, scale, causal=True)
    visible_rows = ~hidden.all(-1, keepdim=True)  # BLOOM spreads fully masked rows uniformly; ours are zero
    torch.testing.assert_close(ours * visible_rows, expected * visible_rows, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(
        reference.alibi_slopes(h), build_alibi_tensor(torch.ones(1, 2), h, torch.float32)[:, 0, 1]
    )
