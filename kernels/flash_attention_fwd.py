"""The flash attention forward kernel (FlashAttention-2 schedule with ALiBi; the layout, the base-2 exponentials
and the query/key alignment are described in kernels/flash_attention.py, which launches it)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _fwd_blocks(
    acc, m_i, l_i, q, K_base, V_base, stride_kn, stride_vn, offs_d, q_pos, k_len, head_dim, scale2, slope2, lo, hi,
    KDoc_base, q_doc,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, HAS_DOCS: tl.constexpr, DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kv_mask = (offs_n < k_len)[:, None] & (offs_d < head_dim)[None, :]
        k = tl.load(K_base + offs_n[:, None] * stride_kn + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(V_base + offs_n[:, None] * stride_vn + offs_d[None, :], mask=kv_mask, other=0.0)
        if DOT_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        # base-2 logits: (q . k) * scale * log2(e) + slope * log2(e) * (j - i_abs)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale2
        s += slope2 * (offs_n[None, :] - q_pos[:, None]).to(tl.float32)
        if MASKED:  # only the diagonal and tail blocks pay for the mask (every block, with documents)
            visible = (offs_n < k_len)[None, :]
            if CAUSAL:
                visible = visible & (offs_n[None, :] <= q_pos[:, None])
            if HAS_DOCS:
                k_doc = tl.load(KDoc_base + offs_n, mask=offs_n < k_len, other=-1)
                visible = visible & (k_doc[None, :] == q_doc[:, None])
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet
        p = tl.exp2(s - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)  # rescales what was accumulated under the old max
        l_i = l_i * alpha + tl.sum(p, axis=1)
        p_in = p.to(V_base.dtype.element_ty)  # the P @ V product runs in the input dtype, as on tensor cores
        if DOT_FP32:
            p_in = p_in.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p_in, v, input_precision=PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _flash_fwd_kernel(
    Q, K, V, Slopes, Out, LSE, QDoc, KDoc,
    stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
    n_heads, q_len, k_len, realign, head_dim, scale2,
    CAUSAL: tl.constexpr, HAS_DOCS: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    b = (bh // n_heads).to(tl.int64)
    h = (bh % n_heads).to(tl.int64)
    slope2 = tl.load(Slopes + h).to(tl.float32) * 1.4426950408889634  # * log2(e)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    # Query i sits at key index i + shift: right-aligned (k_len - q_len) plus `realign` for chunks at other global
    # offsets. Passed as that sum's second term, not as shift itself: with a shift argument ptxas spilled 216
    # bytes per thread in the sm_90 fp32 dk/dv kernel at head dim 128 (bench.kernels_compile), with this none.
    shift = k_len - q_len + realign
    q_pos = offs_m + shift
    q_mask = (offs_m < q_len)[:, None] & (offs_d < head_dim)[None, :]
    q = tl.load(
        Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qs + offs_d[None, :], mask=q_mask, other=0.0
    )
    if DOT_FP32:
        q = q.to(tl.float32)
    q_doc = offs_m  # unused without documents
    if HAS_DOCS:
        q_doc = tl.load(QDoc + b * q_len + offs_m, mask=offs_m < q_len, other=-2)
    KDoc_base = KDoc + b * k_len
    K_base = K + b * stride_kb + h * stride_kh
    V_base = V + b * stride_vb + h * stride_vh
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # Key blocks below `full_end` are visible to every row of this block: no mask. The rest (the diagonal band
    # under the causal mask, the ragged tail of the keys) is masked; with documents every block is.
    if HAS_DOCS:
        full_end = 0
        hi = k_len
        if CAUSAL:
            hi = tl.maximum(tl.minimum(k_len, start_m + BLOCK_M + shift), 0)
    elif CAUSAL:
        full_end = tl.minimum((tl.maximum(start_m + shift + 1, 0) // BLOCK_N) * BLOCK_N, (k_len // BLOCK_N) * BLOCK_N)
        hi = tl.maximum(tl.minimum(k_len, start_m + BLOCK_M + shift), 0)
    else:
        full_end = (k_len // BLOCK_N) * BLOCK_N
        hi = k_len
    acc, m_i, l_i = _fwd_blocks(
        acc, m_i, l_i, q, K_base, V_base, stride_ks, stride_vs, offs_d, q_pos, k_len, head_dim, scale2, slope2,
        0, full_end, KDoc_base, q_doc, False, CAUSAL, HAS_DOCS, DOT_FP32, PRECISION, BLOCK_N,
    )  # fmt: skip
    acc, m_i, l_i = _fwd_blocks(
        acc, m_i, l_i, q, K_base, V_base, stride_ks, stride_vs, offs_d, q_pos, k_len, head_dim, scale2, slope2,
        full_end, hi, KDoc_base, q_doc, True, CAUSAL, HAS_DOCS, DOT_FP32, PRECISION, BLOCK_N,
    )  # fmt: skip
    seen = l_i > 0.0  # false only for a query that sees no key (causal mask before the first key, documents)
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    o_ptrs = Out + bh.to(tl.int64) * q_len * head_dim + offs_m[:, None] * head_dim + offs_d[None, :]
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=q_mask)
    # base-2 logsumexp; +inf for an empty row makes the backward's exp2(s - lse) exactly 0 there
    lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("inf"))
    tl.store(LSE + bh.to(tl.int64) * q_len + offs_m, lse, mask=offs_m < q_len)
