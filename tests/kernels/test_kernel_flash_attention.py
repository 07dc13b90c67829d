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


# Chunks of a longer sequence, as context-parallel attention calls the kernel: global offsets of the first query and
# key, document ids, and the logsumexp for merging partial results.
CHUNK_CASES = [
    # (batch, heads, q_len, k_len, head_dim), q_offset, k_offset, documents, dtype
    ((1, 2, 12, 9, 16), 20, 3, False, torch.float32),  # every key before every query: no causal mask left
    ((1, 2, 9, 9, 16), 9, 9, False, torch.float32),  # the diagonal chunk, one ragged block
    ((2, 2, 10, 19, 8), 5, 0, True, torch.float32),  # keys past the queries, documents crossing block borders
    ((1, 2, 8, 8, 16), 0, 8, False, torch.float32),  # every key after every query: no row sees anything
    ((1, 2, 17, 17, 16), 0, 0, True, torch.bfloat16),  # a whole packed sequence (ops.flash_attention(doc_ids=))
]


def _documents(batch: int, length: int, offset: int) -> torch.Tensor:
    """Document ids of tokens offset..offset+length: documents of 7 tokens in sample 0, of 4 in sample 1."""
    positions = torch.arange(offset, offset + length)
    return torch.stack([positions // 7, positions // 4][:batch])


@pytest.mark.parametrize(("dims", "q_offset", "k_offset", "docs", "dtype"), CHUNK_CASES)
def test_flash_chunk_matches_reference(dims, q_offset, k_offset, docs, dtype, device, assert_matches) -> None:
    b, h, q_len, k_len, d = dims
    gen = torch.Generator().manual_seed(10)
    q, k, v = (torch.randn(b, h, n, d, generator=gen).to(device, dtype).requires_grad_() for n in (q_len, k_len, k_len))
    slopes = reference.alibi_slopes(h, device)
    do = torch.randn(b, h, q_len, d, generator=gen).to(device, dtype)
    extra = dict(q_offset=q_offset, k_offset=k_offset, return_lse=True)
    if docs:
        extra.update(q_doc=_documents(b, q_len, q_offset).to(device), k_doc=_documents(b, k_len, k_offset).to(device))

    out, lse = flash_alibi_attention(q, k, v, slopes, True, **extra)
    out.backward(do)
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    out32, lse32 = reference.flash_alibi_attention(q32, k32, v32, slopes, True, **extra)
    out32.backward(do.float())

    assert lse.dtype == torch.float32 and lse.shape == (b, h, q_len) and not lse.requires_grad
    empty = torch.isinf(lse32)  # rows that see no key: -inf from both, output and dq exactly 0
    assert torch.equal(torch.isinf(lse).cpu(), empty.cpu()) and (lse[empty] < 0).all()
    if q_offset < k_offset:
        assert empty.all() and (out == 0).all()
    assert_matches(lse.masked_fill(empty, 0.0), lse32.masked_fill(empty, 0.0), torch.float32, scale=5)
    assert_matches(out, out32, dtype, scale=5)
    assert_matches(q.grad, q32.grad, dtype, scale=5)
    assert_matches(k.grad, k32.grad, dtype, scale=5)
    assert_matches(v.grad, v32.grad, dtype, scale=5)


def test_chunk_backward_from_merged_lse(device, assert_matches) -> None:
    """The backward of one key chunk from the full rows' lse and delta: the twin's chunks add up to autograd's
    gradient of the whole attention (fp64), and the kernel's chunk gradients equal the twin's."""
    b, h, s, d, split = 2, 2, 14, 16, 6
    gen = torch.Generator().manual_seed(11)
    q, k, v, do = (torch.randn(b, h, s, d, generator=gen, dtype=torch.float64) for _ in range(4))
    slopes = reference.alibi_slopes(h)
    docs = _documents(b, s, 0)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = reference.flash_alibi_attention(*leaves, slopes, True, q_doc=docs, k_doc=docs, return_lse=True)
    out.backward(do)
    delta = (out.detach() * do).sum(-1)
    pieces = [(0, split), (split, s - split)]  # two key chunks at their global offsets
    grads = [reference.flash_alibi_attention_backward(
        do, q, k.narrow(2, start, n), v.narrow(2, start, n), lse, delta, slopes, d**-0.5,
        q_offset=0, k_offset=start, q_doc=docs, k_doc=docs.narrow(1, start, n),
    ) for start, n in pieces]  # fmt: skip
    torch.testing.assert_close(grads[0][0] + grads[1][0], leaves[0].grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(torch.cat([grads[0][1], grads[1][1]], 2), leaves[1].grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(torch.cat([grads[0][2], grads[1][2]], 2), leaves[2].grad, rtol=1e-12, atol=1e-12)

    from kernels.flash_attention import flash_alibi_attention_backward

    start, n = pieces[1]
    args32 = [t.float().to(device) for t in (do, q, k.narrow(2, start, n), v.narrow(2, start, n), lse, delta)]
    chunk = dict(q_offset=0, k_offset=start, q_doc=docs.to(device), k_doc=docs.narrow(1, start, n).to(device))
    got = flash_alibi_attention_backward(*args32, slopes.to(device), d**-0.5, **chunk)
    for actual, expected in zip(got, grads[1], strict=True):
        assert_matches(actual, expected.float(), torch.float32, scale=5)


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_packed_flash_attention_equals_the_masked_core(backend, device, monkeypatch, assert_matches) -> None:
    """ops.flash_attention(doc_ids=) on either backend is the model's materialized core with BLOOM's bias
    slope * k_pos and the causal mask cut at document borders (ALiBi positions need no reset per document)."""
    from appliance.model import ops
    from appliance.model.alibi import alibi_bias
    from kernels import op_backends

    monkeypatch.setenv("BLOOM_KERNELS", backend)
    b, h, s, d = 2, 3, 19, 16
    gen = torch.Generator().manual_seed(12)
    q, k, v = (torch.randn(b, h, s, d, generator=gen).to(device).requires_grad_() for _ in range(3))
    slopes = reference.alibi_slopes(h, device)
    docs = _documents(b, s, 0).to(device)
    op_backends.reset_call_counts()
    out = ops.flash_attention(q, k, v, slopes, d**-0.5, doc_ids=docs)
    assert op_backends.call_counts() == {("flash_alibi_attention", backend): 1}
    positions = torch.arange(s, device=device)
    mask = (positions[None, :] <= positions[:, None]) & (docs[:, None, :, None] == docs[:, None, None, :])
    want = ops.attention_core(q, k, v, alibi_bias(slopes, None, s), mask, d**-0.5)
    assert_matches(out, want, torch.float32)  # fp32 math both ways, in another summation order
    do = torch.randn(b, h, s, d, generator=gen).to(device)
    grads = torch.autograd.grad(out, (q, k, v), do)
    for got, expected in zip(grads, torch.autograd.grad(want, (q, k, v), do), strict=True):
        assert_matches(got, expected, torch.float32, scale=5)
