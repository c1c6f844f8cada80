"""Flash-attention forward: online softmax over K/V tiles; the Nq x Nk matrix never leaves SRAM.

Grid: ``(cdiv(Nq, BLOCK_M), B * Hq)``. Each program owns BLOCK_M query rows of one head and
walks the key axis in two phases:

1. blocks every row of the tile may see in full (no mask, no bounds check);
2. the boundary blocks: the causal diagonal band and the ragged end of the key axis.

Causal masking is bottom-right aligned: query ``i`` sees keys ``j <= i + Nk - Nq``. A row
that sees no key produces zeros and LSE = -inf. ``exp2`` is used with ``scale * log2(e)``
folded into one multiplier.

Hopper knobs (constexpr, chosen by the config):

* ``USE_TMA``: Q, K, V are read and O written through host-built 4-D tensor descriptors
  ``(B, H, N, D)`` (the bulk tensor-copy engine); out-of-range rows and the padded head-dim
  columns come back as zeros, so no load needs a mask.
* ``REVERSE_M``: programs take query tiles last-first, so under a causal mask the longest
  tiles start first and the short ones fill the tail of the wave.
"""

import triton
import triton.language as tl


@triton.jit
def _load_kv(k_base, v_base, desc_k, desc_v, off_b, off_hkv, start_n, offs_n, offs_d,
             stride_kn, stride_vn, N_K,
             HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
             MASKED: tl.constexpr, USE_TMA: tl.constexpr):
    """K^T ``(BLOCK_D, BLOCK_N)`` and V ``(BLOCK_N, BLOCK_D)`` of keys ``start_n + offs_n``;
    zeros past ``N_K`` (when MASKED) and past ``HEAD_DIM``."""
    if USE_TMA:
        k = desc_k.load([off_b, off_hkv, start_n, 0]).reshape(BLOCK_N, BLOCK_D)
        v = desc_v.load([off_b, off_hkv, start_n, 0]).reshape(BLOCK_N, BLOCK_D)
        kt = k.T
    else:
        cols = start_n + offs_n
        d_ok = offs_d < HEAD_DIM
        k_ptrs = k_base + cols[None, :].to(tl.int64) * stride_kn + offs_d[:, None]
        v_ptrs = v_base + cols[:, None].to(tl.int64) * stride_vn + offs_d[None, :]
        if MASKED:
            n_ok = cols < N_K
            kt = tl.load(k_ptrs, mask=n_ok[None, :] & d_ok[:, None], other=0.0)
            v = tl.load(v_ptrs, mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        elif BLOCK_D != HEAD_DIM:
            kt = tl.load(k_ptrs, mask=d_ok[:, None], other=0.0)
            v = tl.load(v_ptrs, mask=d_ok[None, :], other=0.0)
        else:
            kt = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
    return kt, v


@triton.jit
def _attn_fwd_inner(acc, l_i, m_i, q, k_base, v_base, desc_k, desc_v, off_b, off_hkv,
                    offs_m, offs_n, offs_d, stride_kn, stride_vn, lo, hi, N_K, CAUSAL_OFFSET,
                    qk_scale,
                    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                    MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, UPCAST_DOT: tl.constexpr,
                    USE_TMA: tl.constexpr, NEG_SCALE: tl.constexpr):
    for start_n in tl.range(lo, hi, BLOCK_N):
        kt, v = _load_kv(k_base, v_base, desc_k, desc_v, off_b, off_hkv, start_n, offs_n,
                         offs_d, stride_kn, stride_vn, N_K, HEAD_DIM, BLOCK_D, BLOCK_N,
                         MASKED, USE_TMA)
        if UPCAST_DOT:
            qk = tl.dot(q.to(tl.float32), kt.to(tl.float32))
        else:
            qk = tl.dot(q, kt)
        if MASKED:
            cols = start_n + offs_n
            keep = (cols < N_K)[None, :]
            if IS_CAUSAL:
                keep = keep & (cols[None, :] <= offs_m[:, None] + CAUSAL_OFFSET)
            qk = tl.where(keep, qk * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            # rows with no visible key so far keep m = -inf; subtract 0 to avoid inf - inf
            m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.math.exp2(qk - m_sub[:, None])
        else:
            # every row sees every key of an unmasked block, so m stays finite; the scale is
            # folded into one FMA per score: exp2(qk * scale - m), with the row maximum taken
            # before scaling (the minimum when the scale is negative).
            if NEG_SCALE:
                m_new = tl.maximum(m_i, tl.min(qk, 1) * qk_scale)
            else:
                m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            m_sub = m_new
            p = tl.math.exp2(qk * qk_scale - m_sub[:, None])
        alpha = tl.math.exp2(m_i - m_sub)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if UPCAST_DOT:
            acc += tl.dot(p, v.to(tl.float32))
        else:
            acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def attn_fwd_kernel(
    Q, K, V, Out, Lse,
    desc_q, desc_k, desc_v, desc_o,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_om,
    stride_lb, stride_lh,
    H_Q, GROUP, N_Q, N_K, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr, STORE_LSE: tl.constexpr, UPCAST_DOT: tl.constexpr,
    NEG_SCALE: tl.constexpr, USE_TMA: tl.constexpr, REVERSE_M: tl.constexpr,
):
    tl.static_assert(BLOCK_M >= 16 and BLOCK_N >= 16, "tl.dot needs tiles of at least 16")
    tl.static_assert(BLOCK_D >= HEAD_DIM, "BLOCK_D must cover HEAD_DIM")
    if REVERSE_M:
        start_m = tl.num_programs(0) - 1 - tl.program_id(0)
    else:
        start_m = tl.program_id(0)
    off_bh = tl.program_id(1)
    off_b = off_bh // H_Q
    off_h = off_bh % H_Q
    off_hkv = off_h // GROUP

    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < N_Q
    d_ok = offs_d < HEAD_DIM

    k_base = K + off_b.to(tl.int64) * stride_kb + off_hkv.to(tl.int64) * stride_kh
    v_base = V + off_b.to(tl.int64) * stride_vb + off_hkv.to(tl.int64) * stride_vh
    if USE_TMA:
        q = desc_q.load([off_b, off_h, start_m * BLOCK_M, 0]).reshape(BLOCK_M, BLOCK_D)
    else:
        q_base = Q + off_b.to(tl.int64) * stride_qb + off_h.to(tl.int64) * stride_qh
        q_ptrs = q_base + offs_m[:, None].to(tl.int64) * stride_qm + offs_d[None, :]
        q = tl.load(q_ptrs, mask=m_ok[:, None] & d_ok[None, :], other=0.0)

    qk_scale = sm_scale * 1.4426950408889634  # log2(e)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # Key ranges. Every row of this tile sees keys [0, full_hi) without masking.
    causal_offset = N_K - N_Q
    n_full = (N_K // BLOCK_N) * BLOCK_N
    if IS_CAUSAL:
        first_row_sees = start_m * BLOCK_M + causal_offset + 1  # keys [0, this) for row 0 of the tile
        full_hi = tl.minimum(n_full, tl.maximum(first_row_sees, 0) // BLOCK_N * BLOCK_N)
        band_hi = tl.minimum(N_K, tl.maximum(start_m * BLOCK_M + BLOCK_M + causal_offset, 0))
    else:
        full_hi = n_full
        band_hi = N_K
    band_hi = tl.maximum(band_hi, full_hi)

    acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q, k_base, v_base, desc_k, desc_v, off_b,
                                    off_hkv, offs_m, offs_n, offs_d, stride_kn, stride_vn,
                                    0, full_hi, N_K, causal_offset, qk_scale,
                                    HEAD_DIM, BLOCK_D, BLOCK_N,
                                    False, IS_CAUSAL, UPCAST_DOT, USE_TMA, NEG_SCALE)
    acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q, k_base, v_base, desc_k, desc_v, off_b,
                                    off_hkv, offs_m, offs_n, offs_d, stride_kn, stride_vn,
                                    full_hi, band_hi, N_K, causal_offset, qk_scale,
                                    HEAD_DIM, BLOCK_D, BLOCK_N,
                                    True, IS_CAUSAL, UPCAST_DOT, USE_TMA, NEG_SCALE)

    seen = l_i > 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    out = (acc / l_safe[:, None]).to(Out.dtype.element_ty)
    if USE_TMA:
        desc_o.store([off_b, off_h, start_m * BLOCK_M, 0], out.reshape(1, 1, BLOCK_M, BLOCK_D))
    else:
        o_ptrs = (Out + off_b.to(tl.int64) * stride_ob + off_h.to(tl.int64) * stride_oh
                  + offs_m[:, None].to(tl.int64) * stride_om + offs_d[None, :])
        tl.store(o_ptrs, out, mask=m_ok[:, None] & d_ok[None, :])
    if STORE_LSE:
        lse = tl.where(seen, (m_i + tl.math.log2(l_safe)) * 0.6931471805599453, float("-inf"))
        l_ptrs = Lse + off_b.to(tl.int64) * stride_lb + off_h.to(tl.int64) * stride_lh + offs_m
        tl.store(l_ptrs, lse, mask=m_ok)
