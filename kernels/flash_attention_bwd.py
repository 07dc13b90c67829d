"""The flash attention backward kernels: the row term delta, then dK/dV per key block and dQ per query block
(FlashAttention-2 schedule with ALiBi; kernels/flash_attention.py launches them and describes the layout)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _flash_bwd_preprocess_kernel(Out, DO, Delta, q_len, head_dim, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    # delta_i = sum_d O[i, d] * dO[i, d] = sum_j P[i, j] * dP[i, j], the softmax-backward row term
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    bh = tl.program_id(1).to(tl.int64)
    mask = (offs_m < q_len)[:, None] & (offs_d < head_dim)[None, :]
    offs = bh * q_len * head_dim + offs_m[:, None] * head_dim + offs_d[None, :]
    o = tl.load(Out + offs, mask=mask, other=0.0).to(tl.float32)
    do = tl.load(DO + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Delta + bh * q_len + offs_m, tl.sum(o * do, axis=1), mask=offs_m < q_len)


@triton.jit
def _flash_bwd_dkdv_kernel(
    Q, K, V, Slopes, DO, LSE, Delta, DK, DV, QDoc, KDoc,
    stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
    n_heads, q_len, k_len, realign, head_dim, scale, scale2,
    CAUSAL: tl.constexpr, HAS_DOCS: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    # One program owns a key/value block and streams the query blocks that can see it, working with transposed
    # tiles (keys on rows) so dv += P^T dO and dk += dS^T Q need no transposes of P or dS.
    start_n = tl.program_id(0) * BLOCK_N
    bh = tl.program_id(1)
    b = (bh // n_heads).to(tl.int64)
    h = (bh % n_heads).to(tl.int64)
    slope2 = tl.load(Slopes + h).to(tl.float32) * 1.4426950408889634
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    kv_mask = (offs_n < k_len)[:, None] & (offs_d < head_dim)[None, :]
    k = tl.load(
        K + b * stride_kb + h * stride_kh + offs_n[:, None] * stride_ks + offs_d[None, :], mask=kv_mask, other=0.0
    )
    v = tl.load(
        V + b * stride_vb + h * stride_vh + offs_n[:, None] * stride_vs + offs_d[None, :], mask=kv_mask, other=0.0
    )
    if DOT_FP32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    k_doc = offs_n  # unused without documents
    if HAS_DOCS:
        k_doc = tl.load(KDoc + b * k_len + offs_n, mask=offs_n < k_len, other=-1)
    shift = k_len - q_len + realign  # query i sits at key index i + shift (see _flash_fwd_kernel)
    Q_base = Q + b * stride_qb + h * stride_qh
    row_base = bh.to(tl.int64) * q_len
    lo = 0
    if CAUSAL:  # query i sees key j when i + shift >= j: the first useful row is start_n - shift
        lo = (tl.maximum(start_n - shift, 0) // BLOCK_M) * BLOCK_M
    for start_m in range(lo, q_len, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q_mask = (offs_m < q_len)[None, :] & (offs_d < head_dim)[:, None]
        q_t = tl.load(Q_base + offs_m[None, :] * stride_qs + offs_d[:, None], mask=q_mask, other=0.0)  # [D, M]
        do_t = tl.load(DO + (row_base + offs_m[None, :]) * head_dim + offs_d[:, None], mask=q_mask, other=0.0)
        lse = tl.load(LSE + row_base + offs_m, mask=offs_m < q_len, other=float("inf"))
        delta = tl.load(Delta + row_base + offs_m, mask=offs_m < q_len, other=0.0)
        if DOT_FP32:
            q_t = q_t.to(tl.float32)
            do_t = do_t.to(tl.float32)
        s_t = tl.dot(k, q_t, input_precision=PRECISION) * scale2
        s_t += slope2 * (offs_n[:, None] - (offs_m + shift)[None, :]).to(tl.float32)
        visible = (offs_n < k_len)[:, None] & (offs_m < q_len)[None, :]
        if CAUSAL:
            visible = visible & (offs_n[:, None] <= (offs_m + shift)[None, :])
        if HAS_DOCS:
            q_doc = tl.load(QDoc + b * q_len + offs_m, mask=offs_m < q_len, other=-2)
            visible = visible & (k_doc[:, None] == q_doc[None, :])
        p_t = tl.where(visible, tl.exp2(s_t - lse[None, :]), 0.0)  # P^T, exact probabilities
        p_in = p_t.to(DO.dtype.element_ty)
        if DOT_FP32:
            p_in = p_in.to(tl.float32)
        dv += tl.dot(p_in, tl.trans(do_t), input_precision=PRECISION)
        dp_t = tl.dot(v, do_t, input_precision=PRECISION)  # dP^T = V dO^T
        ds_t = p_t * (dp_t - delta[None, :])  # gradient w.r.t. the natural-log logits
        ds_in = ds_t.to(Q.dtype.element_ty)
        if DOT_FP32:
            ds_in = ds_in.to(tl.float32)
        dk += tl.dot(ds_in, tl.trans(q_t), input_precision=PRECISION)
    out = bh.to(tl.int64) * k_len * head_dim + offs_n[:, None] * head_dim + offs_d[None, :]
    tl.store(DK + out, (dk * scale).to(DK.dtype.element_ty), mask=kv_mask)  # logits = scale * q.k + bias
    tl.store(DV + out, dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def _flash_bwd_dq_kernel(
    Q, K, V, Slopes, DO, LSE, Delta, DQ, QDoc, KDoc,
    stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
    n_heads, q_len, k_len, realign, head_dim, scale, scale2,
    CAUSAL: tl.constexpr, HAS_DOCS: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    # One program owns a query block and streams the key blocks it sees: dq = scale * sum_j dS[i, j] k_j.
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    b = (bh // n_heads).to(tl.int64)
    h = (bh % n_heads).to(tl.int64)
    slope2 = tl.load(Slopes + h).to(tl.float32) * 1.4426950408889634
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    shift = k_len - q_len + realign  # query i sits at key index i + shift (see _flash_fwd_kernel)
    q_pos = offs_m + shift
    q_mask = (offs_m < q_len)[:, None] & (offs_d < head_dim)[None, :]
    row_base = bh.to(tl.int64) * q_len
    q_doc = offs_m  # unused without documents
    if HAS_DOCS:
        q_doc = tl.load(QDoc + b * q_len + offs_m, mask=offs_m < q_len, other=-2)
    q = tl.load(
        Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qs + offs_d[None, :], mask=q_mask, other=0.0
    )
    do = tl.load(DO + (row_base + offs_m[:, None]) * head_dim + offs_d[None, :], mask=q_mask, other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    lse = tl.load(LSE + row_base + offs_m, mask=offs_m < q_len, other=float("inf"))
    delta = tl.load(Delta + row_base + offs_m, mask=offs_m < q_len, other=0.0)
    K_base = K + b * stride_kb + h * stride_kh
    V_base = V + b * stride_vb + h * stride_vh
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    hi = k_len
    if CAUSAL:
        hi = tl.maximum(tl.minimum(k_len, start_m + BLOCK_M + shift), 0)
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kv_mask = (offs_n < k_len)[:, None] & (offs_d < head_dim)[None, :]
        k = tl.load(K_base + offs_n[:, None] * stride_ks + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(V_base + offs_n[:, None] * stride_vs + offs_d[None, :], mask=kv_mask, other=0.0)
        if DOT_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale2
        s += slope2 * (offs_n[None, :] - q_pos[:, None]).to(tl.float32)
        visible = (offs_n < k_len)[None, :] & (offs_m < q_len)[:, None]
        if CAUSAL:
            visible = visible & (offs_n[None, :] <= q_pos[:, None])
        if HAS_DOCS:
            k_doc = tl.load(KDoc + b * k_len + offs_n, mask=offs_n < k_len, other=-1)
            visible = visible & (k_doc[None, :] == q_doc[:, None])
        p = tl.where(visible, tl.exp2(s - lse[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        ds_in = ds.to(K.dtype.element_ty)
        if DOT_FP32:
            ds_in = ds_in.to(tl.float32)
        dq += tl.dot(ds_in, k, input_precision=PRECISION)
    dq_ptrs = DQ + (row_base + offs_m[:, None]) * head_dim + offs_d[None, :]
    tl.store(dq_ptrs, (dq * scale).to(DQ.dtype.element_ty), mask=q_mask)
