"""Flash-attention backward (FlashAttention-2 style): P is recomputed from Q, K and the saved
log-sum-exp; the Nq x Nk matrix is never stored.

Three kernels:

1. ``attn_bwd_preprocess``: ``delta = rowsum(dO * O)`` in fp32, ``(B, Hq, Nq)``.
2. ``attn_bwd_dkdv``: grid ``(cdiv(Nk, BLOCK_N1), B * Hkv)``. A program owns BLOCK_N1 keys
   of one K/V head and walks every query head of its GQA group and every query block that
   can see those keys, accumulating ``dV += P^T dO`` and ``dK += dS^T Q`` in registers: the
   group's dK/dV are summed inside one program, deterministic, no atomics.
3. ``attn_bwd_dq``: grid ``(cdiv(Nq, BLOCK_M2), B * Hq)``. A program owns BLOCK_M2 queries
   and walks the key blocks they can see: ``dQ += dS K``.

with ``P = exp(scale * Q K^T - LSE)`` and ``dS = P * (dO V^T - delta)``. Causal masking is
bottom-right aligned (query ``i`` sees key ``j <= i + Nk - Nq``); under it the loops start
or stop at the first or last block with a visible entry. Rows that see no key have
``LSE = -inf``; every one of their entries is masked, so they contribute zero.
"""

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def attn_bwd_preprocess(O, DO, Delta,
                        stride_ob, stride_oh, stride_om,
                        stride_dob, stride_doh, stride_dom,
                        H_Q, N_Q,
                        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
    off_bh = tl.program_id(1)
    off_b = off_bh // H_Q
    off_h = off_bh % H_Q
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_m < N_Q)[:, None] & (offs_d < HEAD_DIM)[None, :]
    o = tl.load(O + off_b.to(tl.int64) * stride_ob + off_h.to(tl.int64) * stride_oh
                + offs_m[:, None].to(tl.int64) * stride_om + offs_d[None, :],
                mask=mask, other=0.0).to(tl.float32)
    do = tl.load(DO + off_b.to(tl.int64) * stride_dob + off_h.to(tl.int64) * stride_doh
                 + offs_m[:, None].to(tl.int64) * stride_dom + offs_d[None, :],
                 mask=mask, other=0.0).to(tl.float32)
    delta = tl.sum(o * do, axis=1)
    tl.store(Delta + off_bh.to(tl.int64) * N_Q + offs_m, delta, mask=offs_m < N_Q)


@triton.jit
def _dot(a, b, UPCAST_DOT: tl.constexpr):
    # the interpreter reads bf16 as integers inside tl.dot: fp32 copies there
    if UPCAST_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    return tl.dot(a, b)


@triton.jit
def attn_bwd_dkdv(Q, K, V, DO, Lse, Delta, DK, DV,
                  stride_qb, stride_qh, stride_qm,
                  stride_kb, stride_kh, stride_kn,
                  stride_vb, stride_vh, stride_vn,
                  stride_dob, stride_doh, stride_dom,
                  stride_dkb, stride_dkh, stride_dkn,
                  stride_dvb, stride_dvh, stride_dvn,
                  H_Q, H_KV, GROUP, N_Q, N_K, sm_scale,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK_M1: tl.constexpr, BLOCK_N1: tl.constexpr,
                  IS_CAUSAL: tl.constexpr, UPCAST_DOT: tl.constexpr):
    tl.static_assert(BLOCK_M1 >= 16 and BLOCK_N1 >= 16, "tl.dot needs tiles of at least 16")
    start_n = tl.program_id(0) * BLOCK_N1
    off_bh = tl.program_id(1)
    off_b = off_bh // H_KV
    off_hkv = off_bh % H_KV
    offs_n = start_n + tl.arange(0, BLOCK_N1)
    offs_m0 = tl.arange(0, BLOCK_M1)
    offs_d = tl.arange(0, BLOCK_D)
    n_ok = offs_n < N_K
    d_ok = offs_d < HEAD_DIM
    kv_mask = n_ok[:, None] & d_ok[None, :]
    k = tl.load(K + off_b.to(tl.int64) * stride_kb + off_hkv.to(tl.int64) * stride_kh
                + offs_n[:, None].to(tl.int64) * stride_kn + offs_d[None, :],
                mask=kv_mask, other=0.0)
    v = tl.load(V + off_b.to(tl.int64) * stride_vb + off_hkv.to(tl.int64) * stride_vh
                + offs_n[:, None].to(tl.int64) * stride_vn + offs_d[None, :],
                mask=kv_mask, other=0.0)
    dk = tl.zeros([BLOCK_N1, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N1, BLOCK_D], dtype=tl.float32)
    qk_scale = sm_scale * LOG2E
    causal_offset = N_K - N_Q
    if IS_CAUSAL:
        # query i sees key j iff i >= j - offset: rows before the tile's first key's first
        # viewer see none of the tile
        m_lo = tl.maximum(start_n - causal_offset, 0) // BLOCK_M1 * BLOCK_M1
    else:
        m_lo = 0
    for g in range(0, GROUP):
        off_h = off_hkv * GROUP + g
        q_base = Q + off_b.to(tl.int64) * stride_qb + off_h.to(tl.int64) * stride_qh
        do_base = DO + off_b.to(tl.int64) * stride_dob + off_h.to(tl.int64) * stride_doh
        row_base = (off_b * H_Q + off_h).to(tl.int64) * N_Q
        for start_m in range(m_lo, N_Q, BLOCK_M1):
            offs_m = start_m + offs_m0
            m_ok = offs_m < N_Q
            q_mask = m_ok[:, None] & d_ok[None, :]
            q = tl.load(q_base + offs_m[:, None].to(tl.int64) * stride_qm + offs_d[None, :],
                        mask=q_mask, other=0.0)
            do = tl.load(do_base + offs_m[:, None].to(tl.int64) * stride_dom + offs_d[None, :],
                         mask=q_mask, other=0.0)
            lse = tl.load(Lse + row_base + offs_m, mask=m_ok, other=0.0)
            delta = tl.load(Delta + row_base + offs_m, mask=m_ok, other=0.0)
            qkT = _dot(k, tl.trans(q), UPCAST_DOT)  # (BLOCK_N1, BLOCK_M1)
            keep = n_ok[:, None] & m_ok[None, :]
            if IS_CAUSAL:
                keep = keep & (offs_n[:, None] <= offs_m[None, :] + causal_offset)
            pT = tl.where(keep, tl.math.exp2(qkT * qk_scale - lse[None, :] * LOG2E), 0.0)
            dv += _dot(pT.to(do.dtype), do, UPCAST_DOT)
            dpT = _dot(v, tl.trans(do), UPCAST_DOT)
            dsT = pT * (dpT - delta[None, :])
            dk += _dot(dsT.to(q.dtype), q, UPCAST_DOT)
    dk *= sm_scale
    tl.store(DK + off_b.to(tl.int64) * stride_dkb + off_hkv.to(tl.int64) * stride_dkh
             + offs_n[:, None].to(tl.int64) * stride_dkn + offs_d[None, :],
             dk.to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + off_b.to(tl.int64) * stride_dvb + off_hkv.to(tl.int64) * stride_dvh
             + offs_n[:, None].to(tl.int64) * stride_dvn + offs_d[None, :],
             dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def attn_bwd_dq(Q, K, V, DO, Lse, Delta, DQ,
                stride_qb, stride_qh, stride_qm,
                stride_kb, stride_kh, stride_kn,
                stride_vb, stride_vh, stride_vn,
                stride_dob, stride_doh, stride_dom,
                stride_dqb, stride_dqh, stride_dqm,
                H_Q, GROUP, N_Q, N_K, sm_scale,
                HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                BLOCK_M2: tl.constexpr, BLOCK_N2: tl.constexpr,
                IS_CAUSAL: tl.constexpr, UPCAST_DOT: tl.constexpr):
    tl.static_assert(BLOCK_M2 >= 16 and BLOCK_N2 >= 16, "tl.dot needs tiles of at least 16")
    start_m = tl.program_id(0) * BLOCK_M2
    off_bh = tl.program_id(1)
    off_b = off_bh // H_Q
    off_h = off_bh % H_Q
    off_hkv = off_h // GROUP
    offs_m = start_m + tl.arange(0, BLOCK_M2)
    offs_n0 = tl.arange(0, BLOCK_N2)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < N_Q
    d_ok = offs_d < HEAD_DIM
    q_mask = m_ok[:, None] & d_ok[None, :]
    q = tl.load(Q + off_b.to(tl.int64) * stride_qb + off_h.to(tl.int64) * stride_qh
                + offs_m[:, None].to(tl.int64) * stride_qm + offs_d[None, :],
                mask=q_mask, other=0.0)
    do = tl.load(DO + off_b.to(tl.int64) * stride_dob + off_h.to(tl.int64) * stride_doh
                 + offs_m[:, None].to(tl.int64) * stride_dom + offs_d[None, :],
                 mask=q_mask, other=0.0)
    row_base = off_bh.to(tl.int64) * N_Q
    lse = tl.load(Lse + row_base + offs_m, mask=m_ok, other=0.0)
    delta = tl.load(Delta + row_base + offs_m, mask=m_ok, other=0.0)
    k_base = K + off_b.to(tl.int64) * stride_kb + off_hkv.to(tl.int64) * stride_kh
    v_base = V + off_b.to(tl.int64) * stride_vb + off_hkv.to(tl.int64) * stride_vh
    dq = tl.zeros([BLOCK_M2, BLOCK_D], dtype=tl.float32)
    qk_scale = sm_scale * LOG2E
    causal_offset = N_K - N_Q
    if IS_CAUSAL:  # keys past the tile's last row's last visible key are never seen
        n_hi = tl.minimum(N_K, tl.maximum(start_m + BLOCK_M2 + causal_offset, 0))
    else:
        n_hi = N_K
    for start_n in range(0, n_hi, BLOCK_N2):
        offs_n = start_n + offs_n0
        n_ok = offs_n < N_K
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_base + offs_n[:, None].to(tl.int64) * stride_kn + offs_d[None, :],
                    mask=kv_mask, other=0.0)
        v = tl.load(v_base + offs_n[:, None].to(tl.int64) * stride_vn + offs_d[None, :],
                    mask=kv_mask, other=0.0)
        qk = _dot(q, tl.trans(k), UPCAST_DOT)  # (BLOCK_M2, BLOCK_N2)
        keep = m_ok[:, None] & n_ok[None, :]
        if IS_CAUSAL:
            keep = keep & (offs_n[None, :] <= offs_m[:, None] + causal_offset)
        p = tl.where(keep, tl.math.exp2(qk * qk_scale - lse[:, None] * LOG2E), 0.0)
        dp = _dot(do, tl.trans(v), UPCAST_DOT)
        ds = p * (dp - delta[:, None])
        dq += _dot(ds.to(k.dtype), k, UPCAST_DOT)
    dq *= sm_scale
    tl.store(DQ + off_b.to(tl.int64) * stride_dqb + off_h.to(tl.int64) * stride_dqh
             + offs_m[:, None].to(tl.int64) * stride_dqm + offs_d[None, :],
             dq.to(DQ.dtype.element_ty), mask=q_mask)
