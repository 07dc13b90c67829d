"""Flash attention with ALiBi vs the materialized fp32 reference: output and dq, dk, dv."""

from __future__ import annotations

import pytest
import torch

from kernels import reference
from kernels.flash_attention import flash_alibi_attention

CASES = [
    # (batch, heads, q_len, k_len, head_dim), dtype, causal. Interpreter tiles are 16 queries x 8 keys.
    ((3, 12, 7, 7, 16), torch.float32, True),  # batch 3, 12 heads, one ragged block
    ((1, 2, 33, 33, 16), torch.bfloat16, True),  # 3 query blocks, 5 key blocks, diagonal and tail masks
    ((1, 2, 9, 9, 64), torch.bfloat16, True),  # head dim 64
    ((1, 1, 9, 9, 128), torch.float32, True),  # head dim 128
    ((2, 3, 9, 20, 8), torch.float32, True),  # queries after an 11-token prefix (right-aligned causal)
    ((1, 2, 12, 5, 16), torch.float32, True),  # more queries than keys: the first 7 rows see nothing
    ((1, 2, 33, 17, 24), torch.float32, False),  # bidirectional, head dim not a power of two
]


@pytest.mark.parametrize(("dims", "dtype", "causal"), CASES)
def test_flash_matches_reference(dims, dtype, causal, device, assert_matches) -> None:
    b, h, q_len, k_len, d = dims
    gen = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(b, h, n, d, generator=gen).to(device, dtype).requires_grad_() for n in (q_len, k_len, k_len))
    slopes = reference.alibi_slopes(h, device)
    do = torch.randn(b, h, q_len, d, generator=gen).to(device, dtype)

    out = flash_alibi_attention(q, k, v, slopes, causal)
    out.backward(do)
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    out32 = reference.flash_alibi_attention(q32, k32, v32, slopes, causal)
    out32.backward(do.float())

    assert out.dtype == dtype and out.shape == q.shape
    # fp32: same math, different summation order; bf16: P and dS are rounded to bf16 before their dots
    assert_matches(out, out32, dtype, scale=5)
    assert_matches(q.grad, q32.grad, dtype, scale=5)
    assert_matches(k.grad, k32.grad, dtype, scale=5)
    assert_matches(v.grad, v32.grad, dtype, scale=5)


def test_strided_qkv_and_explicit_scale(device, assert_matches) -> None:
    # q, k, v sliced from one fused [b, s, 3, h, d] projection and transposed: no copies needed
    gen = torch.Generator().manual_seed(9)
    qkv = torch.randn(2, 11, 3, 4, 16, generator=gen).to(device).requires_grad_()
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    slopes = reference.alibi_slopes(4, device)
    out = flash_alibi_attention(q, k, v, slopes, causal=True, scale=0.3)
    out.sum().backward()
    qkv32 = qkv.detach().clone().requires_grad_()
    q32, k32, v32 = (qkv32[:, :, i].transpose(1, 2) for i in range(3))
    expected = reference.flash_alibi_attention(q32, k32, v32, slopes, causal=True, scale=0.3)
    expected.sum().backward()
    assert_matches(out, expected, torch.float32, scale=5)
    assert_matches(qkv.grad, qkv32.grad, torch.float32, scale=5)


def test_bad_shapes_are_named(device) -> None:
    q = torch.zeros(1, 2, 4, 8, device=device)
    with pytest.raises(ValueError, match="slopes shape"):
        flash_alibi_attention(q, q, q, torch.ones(3, device=device))
    with pytest.raises(ValueError, match="bad shapes"):
        flash_alibi_attention(q, q[..., :4], q, torch.ones(2, device=device))
