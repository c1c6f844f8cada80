"""Flash-attention backward (FlashAttention-2 style): P is recomputed from Q, K and the saved
log-sum-exp; the Nq x Nk matrix is never stored.

Three kernels:

1. ``attn_bwd_preprocess``: ``delta = rowsum(dO * O) - dLSE`` in fp32, ``(B, Hq, Nq)``
   (``dLSE``, the gradient of the LSE output, only when the caller has one).
2. ``attn_bwd_dkdv``: grid ``(cdiv(Nk, BLOCK_N1), B * Hkv * KV_SPLITS)``. A program owns
   BLOCK_N1 keys of one K/V head and walks the query heads of its GQA group (all of them,
   or its 1/KV_SPLITS slice) and, per head, the query blocks (BLOCK_M1) that can see those
   keys, accumulating ``dV += P^T dO`` and ``dK += dS^T Q`` in registers. KV_SPLITS 1: the
   group's dK/dV are summed inside one program and stored. KV_SPLITS > 1 (GQA/MQA shapes
   whose grid would leave SMs idle): each program stores its fp32 partial sums and
   ``attn_bwd_kv_reduce`` adds them up in slice order. Deterministic either way, no atomics.
3. ``attn_bwd_dq``: grid ``(cdiv(Nq, BLOCK_M2), B * Hq)``. A program owns BLOCK_M2 queries
   and walks the key blocks (BLOCK_N2) they can see: ``dQ += dS K``.

with ``P = exp(scale * Q K^T - LSE)`` and ``dS = P * (dO V^T - delta)``; ``exp2`` with
``log2(e)`` folded into the scale and the LSE.

``ONE_LAUNCH`` (a knob): kernels 2 and 3 as one launch, ``attn_bwd_fused``, whose 1-D grid
holds the dK/dV programs and then the dQ programs (one code path each, chosen by program id),
so dQ programs fill the SMs the dK/dV programs' last wave leaves idle. ``REVERSE_DQ`` (a
knob, causal): dQ programs take query tiles last-first, the longest first. Both only reorder
programs: the same bits.

``USE_TMA`` (a knob, compute capability >= 9.0): the tiles the two main kernels stream (Q and
dO in the dK/dV kernel, K and V in the dQ kernel) are read through host-built 4-D tensor
descriptors ``(B, H, N, D)``, out-of-range rows and padded head-dim columns coming back as
zeros, instead of per-element pointers and masks.

Causal masking is bottom-right aligned (query ``i`` sees key ``j <= i + Nk - Nq``); fully
masked blocks are skipped. ``SPLIT_LOOPS`` (a knob) splits each walk like the forward's:
blocks every entry of which is visible run in their own loop without any mask, and only the
diagonal band and the ragged end of the walked axis are masked. Off, one loop masks every
block: fewer registers (ptxas spills less in the dK/dV kernel, which holds two fp32
accumulator tiles), more ALU work per block. The ragged end of the *owned* axis needs no mask inside the loop: a row of
dK/dV (of dQ) depends only on its own key (query), and rows past the end are never stored;
the zeros loaded for them keep their columns out of the other operand's sums. Rows that see
no key have ``LSE = -inf``; they only ever meet masked entries, so they contribute zero.
"""

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def attn_bwd_preprocess(O, DO, DLse, Delta,
                        stride_ob, stride_oh, stride_om,
                        stride_dob, stride_doh, stride_dom,
                        stride_dlb, stride_dlh, stride_dlm,
                        H_Q, N_Q,
                        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                        HAS_DLSE: tl.constexpr):
    off_bh = tl.program_id(1)
    off_b = off_bh // H_Q
    off_h = off_bh % H_Q
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < N_Q
    mask = m_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    o = tl.load(O + off_b.to(tl.int64) * stride_ob + off_h.to(tl.int64) * stride_oh
                + offs_m[:, None].to(tl.int64) * stride_om + offs_d[None, :],
                mask=mask, other=0.0).to(tl.float32)
    do = tl.load(DO + off_b.to(tl.int64) * stride_dob + off_h.to(tl.int64) * stride_doh
                 + offs_m[:, None].to(tl.int64) * stride_dom + offs_d[None, :],
                 mask=mask, other=0.0).to(tl.float32)
    delta = tl.sum(o * do, axis=1)
    if HAS_DLSE:  # d lse_i / d s_ij = p_ij: enters as dS = P * (dP - (delta - dlse))
        delta -= tl.load(DLse + off_b.to(tl.int64) * stride_dlb
                         + off_h.to(tl.int64) * stride_dlh
                         + offs_m.to(tl.int64) * stride_dlm, mask=m_ok, other=0.0)
    tl.store(Delta + off_bh.to(tl.int64) * N_Q + offs_m, delta, mask=m_ok)


@triton.jit
def _dot(a, b, UPCAST_DOT: tl.constexpr):
    # the interpreter reads bf16 as integers inside tl.dot: fp32 copies there
    if UPCAST_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    return tl.dot(a, b)


@triton.jit
def _load_rows(base, offs, offs_d, stride, N, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
               MASKED: tl.constexpr):
    """Rows ``offs`` of a ``(N, HEAD_DIM)`` matrix at ``base``, ``(len(offs), BLOCK_D)``;
    zeros past ``N`` (when MASKED) and past ``HEAD_DIM``."""
    ptrs = base + offs[:, None].to(tl.int64) * stride + offs_d[None, :]
    if MASKED:
        return tl.load(ptrs, mask=(offs < N)[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0)
    elif BLOCK_D != HEAD_DIM:
        return tl.load(ptrs, mask=(offs_d < HEAD_DIM)[None, :], other=0.0)
    else:
        return tl.load(ptrs)


@triton.jit
def _load_tile(desc, base, off_b, off_h, start, offs, offs_d, stride, N,
               HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK: tl.constexpr,
               MASKED: tl.constexpr, USE_TMA: tl.constexpr):
    """Rows ``start + [0, BLOCK)`` (= ``offs``) of head ``(off_b, off_h)``, through the
    tensor descriptor (USE_TMA: zero-filled past N and HEAD_DIM by the copy engine) or as
    :func:`_load_rows`."""
    if USE_TMA:
        return desc.load([off_b, off_h, start, 0]).reshape(BLOCK, BLOCK_D)
    return _load_rows(base, offs, offs_d, stride, N, HEAD_DIM, BLOCK_D, MASKED)


@triton.jit
def _dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qm, stride_dom,
                offs_n, offs_m0, offs_d, lo, hi, N_Q, CAUSAL_OFFSET, qk_scale,
                desc_q, desc_do, off_b, off_h,
                HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M1: tl.constexpr,
                MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, UPCAST_DOT: tl.constexpr,
                USE_TMA: tl.constexpr):
    """Query blocks ``[lo, hi)`` of one head against the program's keys; MASKED blocks get
    the bounds and causal masks, the others every entry."""
    for start_m in range(lo, hi, BLOCK_M1):
        offs_m = start_m + offs_m0
        q = _load_tile(desc_q, q_base, off_b, off_h, start_m, offs_m, offs_d, stride_qm, N_Q,
                       HEAD_DIM, BLOCK_D, BLOCK_M1, MASKED, USE_TMA)
        do = _load_tile(desc_do, do_base, off_b, off_h, start_m, offs_m, offs_d, stride_dom,
                        N_Q, HEAD_DIM, BLOCK_D, BLOCK_M1, MASKED, USE_TMA)
        if MASKED:
            m_ok = offs_m < N_Q
            lse = tl.load(lse_base + offs_m, mask=m_ok, other=0.0)
            delta = tl.load(delta_base + offs_m, mask=m_ok, other=0.0)
        else:
            lse = tl.load(lse_base + offs_m)
            delta = tl.load(delta_base + offs_m)
        qkT = _dot(k, tl.trans(q), UPCAST_DOT)  # (BLOCK_N1, BLOCK_M1)
        pT = tl.math.exp2(qkT * qk_scale - (lse * LOG2E)[None, :])
        if MASKED:
            keep = (offs_m < N_Q)[None, :]
            if IS_CAUSAL:
                keep = keep & (offs_n[:, None] <= offs_m[None, :] + CAUSAL_OFFSET)
            pT = tl.where(keep, pT, 0.0)  # also drops the inf of rows with LSE = -inf
        dv += _dot(pT.to(do.dtype), do, UPCAST_DOT)
        dpT = _dot(v, tl.trans(do), UPCAST_DOT)
        dsT = pT * (dpT - delta[None, :])
        dk += _dot(dsT.to(q.dtype), q, UPCAST_DOT)
    return dk, dv


@triton.jit
def _store_dkdv(DK, DV, dk, dv, off_b, off_hkv, offs_n, offs_d, mask,
                stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn):
    """dK and dV rows ``offs_n`` of K/V head ``(off_b, off_hkv)``, cast to their dtype."""
    tl.store(DK + off_b.to(tl.int64) * stride_dkb + off_hkv.to(tl.int64) * stride_dkh
             + offs_n[:, None].to(tl.int64) * stride_dkn + offs_d[None, :],
             dk.to(DK.dtype.element_ty), mask=mask)
    tl.store(DV + off_b.to(tl.int64) * stride_dvb + off_hkv.to(tl.int64) * stride_dvh
             + offs_n[:, None].to(tl.int64) * stride_dvn + offs_d[None, :],
             dv.to(DV.dtype.element_ty), mask=mask)


@triton.jit
def attn_bwd_dkdv(Q, K, V, DO, Lse, Delta, DK, DV, PartK, PartV, desc_q, desc_do,
                  stride_qb, stride_qh, stride_qm,
                  stride_kb, stride_kh, stride_kn,
                  stride_vb, stride_vh, stride_vn,
                  stride_dob, stride_doh, stride_dom,
                  stride_dkb, stride_dkh, stride_dkn,
                  stride_dvb, stride_dvh, stride_dvn,
                  H_Q, H_KV, GROUP, N_Q, N_K, sm_scale,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK_M1: tl.constexpr, BLOCK_N1: tl.constexpr,
                  IS_CAUSAL: tl.constexpr, UPCAST_DOT: tl.constexpr, SPLIT_LOOPS: tl.constexpr,
                  KV_SPLITS: tl.constexpr, USE_TMA: tl.constexpr):
    _dkdv_program(tl.program_id(0), tl.program_id(1),
                  Q, K, V, DO, Lse, Delta, DK, DV, PartK, PartV, desc_q, desc_do,
                  stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
                  stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_dom,
                  stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
                  H_Q, H_KV, GROUP, N_Q, N_K, sm_scale, HEAD_DIM, BLOCK_D, BLOCK_M1, BLOCK_N1,
                  IS_CAUSAL, UPCAST_DOT, SPLIT_LOOPS, KV_SPLITS, USE_TMA)


@triton.jit
def _dkdv_program(tile_n, part, Q, K, V, DO, Lse, Delta, DK, DV, PartK, PartV, desc_q, desc_do,
                  stride_qb, stride_qh, stride_qm,
                  stride_kb, stride_kh, stride_kn,
                  stride_vb, stride_vh, stride_vn,
                  stride_dob, stride_doh, stride_dom,
                  stride_dkb, stride_dkh, stride_dkn,
                  stride_dvb, stride_dvh, stride_dvn,
                  H_Q, H_KV, GROUP, N_Q, N_K, sm_scale,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK_M1: tl.constexpr, BLOCK_N1: tl.constexpr,
                  IS_CAUSAL: tl.constexpr, UPCAST_DOT: tl.constexpr, SPLIT_LOOPS: tl.constexpr,
                  KV_SPLITS: tl.constexpr, USE_TMA: tl.constexpr):
    """One dK/dV program: key tile ``tile_n`` of part ``part`` = ``(b, hkv) * KV_SPLITS +``
    the slice of the group's query heads."""
    tl.static_assert(BLOCK_M1 >= 16 and BLOCK_N1 >= 16, "tl.dot needs tiles of at least 16")
    tl.static_assert(BLOCK_D >= HEAD_DIM, "BLOCK_D must cover HEAD_DIM")
    start_n = tile_n * BLOCK_N1
    off_bh = part // KV_SPLITS
    off_s = part % KV_SPLITS
    off_b = off_bh // H_KV
    off_hkv = off_bh % H_KV
    offs_n = start_n + tl.arange(0, BLOCK_N1)
    offs_m0 = tl.arange(0, BLOCK_M1)
    offs_d = tl.arange(0, BLOCK_D)
    k = _load_rows(K + off_b.to(tl.int64) * stride_kb + off_hkv.to(tl.int64) * stride_kh,
                   offs_n, offs_d, stride_kn, N_K, HEAD_DIM, BLOCK_D, True)
    v = _load_rows(V + off_b.to(tl.int64) * stride_vb + off_hkv.to(tl.int64) * stride_vh,
                   offs_n, offs_d, stride_vn, N_K, HEAD_DIM, BLOCK_D, True)
    dk = tl.zeros([BLOCK_N1, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N1, BLOCK_D], dtype=tl.float32)
    qk_scale = sm_scale * LOG2E

    # Query ranges, the same for every head of the group: [m_lo, m_mid) the causal band
    # (masked), [m_mid, m_full) every entry visible, [m_full, N_Q) the ragged end (masked).
    causal_offset = N_K - N_Q
    m_full = N_Q // BLOCK_M1 * BLOCK_M1
    if IS_CAUSAL:
        # the first query that sees key start_n, and the first whose block sees every key
        # of the tile (the last one that exists)
        last_key = tl.minimum(start_n + BLOCK_N1, N_K) - 1
        m_lo = tl.maximum(start_n - causal_offset, 0) // BLOCK_M1 * BLOCK_M1
        m_mid = tl.cdiv(tl.maximum(last_key - causal_offset, 0), BLOCK_M1) * BLOCK_M1
        m_full = tl.maximum(m_full, m_lo)
        m_mid = tl.minimum(tl.maximum(m_mid, m_lo), m_full)
    else:
        m_lo = 0
        m_mid = 0

    heads_per_split = GROUP // KV_SPLITS
    for g in range(off_s * heads_per_split, (off_s + 1) * heads_per_split):
        off_h = off_hkv * GROUP + g
        q_base = Q + off_b.to(tl.int64) * stride_qb + off_h.to(tl.int64) * stride_qh
        do_base = DO + off_b.to(tl.int64) * stride_dob + off_h.to(tl.int64) * stride_doh
        row_base = (off_b * H_Q + off_h).to(tl.int64) * N_Q
        lse_base = Lse + row_base
        delta_base = Delta + row_base
        if SPLIT_LOOPS:
            if IS_CAUSAL:
                dk, dv = _dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base,
                                     stride_qm, stride_dom, offs_n, offs_m0, offs_d, m_lo,
                                     m_mid, N_Q, causal_offset, qk_scale,
                                     desc_q, desc_do, off_b, off_h,
                                     HEAD_DIM, BLOCK_D, BLOCK_M1, True, IS_CAUSAL, UPCAST_DOT,
                                     USE_TMA)
            dk, dv = _dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base,
                                 stride_qm, stride_dom, offs_n, offs_m0, offs_d, m_mid, m_full,
                                 N_Q, causal_offset, qk_scale, desc_q, desc_do, off_b, off_h,
                                 HEAD_DIM, BLOCK_D, BLOCK_M1, False, IS_CAUSAL, UPCAST_DOT,
                                 USE_TMA)
            dk, dv = _dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base,
                                 stride_qm, stride_dom, offs_n, offs_m0, offs_d, m_full, N_Q,
                                 N_Q, causal_offset, qk_scale, desc_q, desc_do, off_b, off_h,
                                 HEAD_DIM, BLOCK_D, BLOCK_M1, True, IS_CAUSAL, UPCAST_DOT,
                                 USE_TMA)
        else:  # one loop over every block with a visible entry, each one masked
            dk, dv = _dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base,
                                 stride_qm, stride_dom, offs_n, offs_m0, offs_d, m_lo, N_Q,
                                 N_Q, causal_offset, qk_scale, desc_q, desc_do, off_b, off_h,
                                 HEAD_DIM, BLOCK_D, BLOCK_M1, True, IS_CAUSAL, UPCAST_DOT,
                                 USE_TMA)
    dk *= sm_scale
    kv_mask = (offs_n < N_K)[:, None] & (offs_d < HEAD_DIM)[None, :]
    if KV_SPLITS > 1:  # fp32 partial sums, added up in order by attn_bwd_kv_reduce
        rows = part.to(tl.int64) * N_K + offs_n
        p_off = rows[:, None] * HEAD_DIM + offs_d[None, :]
        tl.store(PartK + p_off, dk, mask=kv_mask)
        tl.store(PartV + p_off, dv, mask=kv_mask)
    else:
        _store_dkdv(DK, DV, dk, dv, off_b, off_hkv, offs_n, offs_d, kv_mask,
                    stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn)


@triton.jit
def attn_bwd_kv_reduce(PartK, PartV, DK, DV,
                       stride_dkb, stride_dkh, stride_dkn,
                       stride_dvb, stride_dvh, stride_dvn,
                       H_KV, N_K,
                       HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                       KV_SPLITS: tl.constexpr):
    """dK and dV of ``KV_SPLITS`` > 1: the partial sums of each slice of the GQA group, added
    in slice order (deterministic), cast to the output dtype."""
    off_bh = tl.program_id(1)
    off_b = off_bh // H_KV
    off_hkv = off_bh % H_KV
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_n < N_K)[:, None] & (offs_d < HEAD_DIM)[None, :]
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    for s in tl.static_range(KV_SPLITS):
        rows = (off_bh.to(tl.int64) * KV_SPLITS + s) * N_K + offs_n
        p_off = rows[:, None] * HEAD_DIM + offs_d[None, :]
        dk += tl.load(PartK + p_off, mask=mask, other=0.0)
        dv += tl.load(PartV + p_off, mask=mask, other=0.0)
    _store_dkdv(DK, DV, dk, dv, off_b, off_hkv, offs_n, offs_d, mask,
                stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn)


@triton.jit
def _dq_inner(dq, q, do, lse2, delta, k_base, v_base, stride_kn, stride_vn,
              offs_m, offs_n0, offs_d, lo, hi, N_K, CAUSAL_OFFSET, qk_scale,
              desc_k, desc_v, off_b, off_hkv,
              HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N2: tl.constexpr,
              MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, UPCAST_DOT: tl.constexpr,
              USE_TMA: tl.constexpr):
    """Key blocks ``[lo, hi)`` against the program's queries (``lse2``: LSE in log2 units)."""
    for start_n in range(lo, hi, BLOCK_N2):
        offs_n = start_n + offs_n0
        k = _load_tile(desc_k, k_base, off_b, off_hkv, start_n, offs_n, offs_d, stride_kn, N_K,
                       HEAD_DIM, BLOCK_D, BLOCK_N2, MASKED, USE_TMA)
        v = _load_tile(desc_v, v_base, off_b, off_hkv, start_n, offs_n, offs_d, stride_vn, N_K,
                       HEAD_DIM, BLOCK_D, BLOCK_N2, MASKED, USE_TMA)
        qk = _dot(q, tl.trans(k), UPCAST_DOT)  # (BLOCK_M2, BLOCK_N2)
        p = tl.math.exp2(qk * qk_scale - lse2[:, None])
        if MASKED:
            keep = (offs_n < N_K)[None, :]
            if IS_CAUSAL:
                keep = keep & (offs_n[None, :] <= offs_m[:, None] + CAUSAL_OFFSET)
            p = tl.where(keep, p, 0.0)  # also drops the inf of rows with LSE = -inf
        dp = _dot(do, tl.trans(v), UPCAST_DOT)
        ds = p * (dp - delta[:, None])
        dq += _dot(ds.to(k.dtype), k, UPCAST_DOT)
    return dq


@triton.jit
def attn_bwd_dq(Q, K, V, DO, Lse, Delta, DQ, desc_k, desc_v,
                stride_qb, stride_qh, stride_qm,
                stride_kb, stride_kh, stride_kn,
                stride_vb, stride_vh, stride_vn,
                stride_dob, stride_doh, stride_dom,
                stride_dqb, stride_dqh, stride_dqm,
                H_Q, GROUP, N_Q, N_K, sm_scale,
                HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                BLOCK_M2: tl.constexpr, BLOCK_N2: tl.constexpr,
                IS_CAUSAL: tl.constexpr, UPCAST_DOT: tl.constexpr, SPLIT_LOOPS: tl.constexpr,
                USE_TMA: tl.constexpr, REVERSE_DQ: tl.constexpr):
    tile_m = tl.program_id(0)
    if REVERSE_DQ:
        tile_m = tl.num_programs(0) - 1 - tile_m
    _dq_program(tile_m, tl.program_id(1), Q, K, V, DO, Lse, Delta, DQ, desc_k, desc_v,
                stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
                stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_dom,
                stride_dqb, stride_dqh, stride_dqm, H_Q, GROUP, N_Q, N_K, sm_scale,
                HEAD_DIM, BLOCK_D, BLOCK_M2, BLOCK_N2, IS_CAUSAL, UPCAST_DOT, SPLIT_LOOPS,
                USE_TMA)


@triton.jit
def _dq_program(tile_m, off_bh, Q, K, V, DO, Lse, Delta, DQ, desc_k, desc_v,
                stride_qb, stride_qh, stride_qm,
                stride_kb, stride_kh, stride_kn,
                stride_vb, stride_vh, stride_vn,
                stride_dob, stride_doh, stride_dom,
                stride_dqb, stride_dqh, stride_dqm,
                H_Q, GROUP, N_Q, N_K, sm_scale,
                HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                BLOCK_M2: tl.constexpr, BLOCK_N2: tl.constexpr,
                IS_CAUSAL: tl.constexpr, UPCAST_DOT: tl.constexpr, SPLIT_LOOPS: tl.constexpr,
                USE_TMA: tl.constexpr):
    """One dQ program: query tile ``tile_m`` of query head ``off_bh`` = ``b * H_Q + h``."""
    tl.static_assert(BLOCK_M2 >= 16 and BLOCK_N2 >= 16, "tl.dot needs tiles of at least 16")
    tl.static_assert(BLOCK_D >= HEAD_DIM, "BLOCK_D must cover HEAD_DIM")
    start_m = tile_m * BLOCK_M2
    off_b = off_bh // H_Q
    off_h = off_bh % H_Q
    off_hkv = off_h // GROUP
    offs_m = start_m + tl.arange(0, BLOCK_M2)
    offs_n0 = tl.arange(0, BLOCK_N2)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < N_Q
    q = _load_rows(Q + off_b.to(tl.int64) * stride_qb + off_h.to(tl.int64) * stride_qh,
                   offs_m, offs_d, stride_qm, N_Q, HEAD_DIM, BLOCK_D, True)
    do = _load_rows(DO + off_b.to(tl.int64) * stride_dob + off_h.to(tl.int64) * stride_doh,
                    offs_m, offs_d, stride_dom, N_Q, HEAD_DIM, BLOCK_D, True)
    row_base = off_bh.to(tl.int64) * N_Q
    lse2 = tl.load(Lse + row_base + offs_m, mask=m_ok, other=0.0) * LOG2E
    delta = tl.load(Delta + row_base + offs_m, mask=m_ok, other=0.0)
    k_base = K + off_b.to(tl.int64) * stride_kb + off_hkv.to(tl.int64) * stride_kh
    v_base = V + off_b.to(tl.int64) * stride_vb + off_hkv.to(tl.int64) * stride_vh
    dq = tl.zeros([BLOCK_M2, BLOCK_D], dtype=tl.float32)
    qk_scale = sm_scale * LOG2E

    # Key ranges: [0, n_full) seen in full by every row of the tile, [n_full, n_hi) the
    # causal band and the ragged end (masked); keys past n_hi are seen by no row.
    causal_offset = N_K - N_Q
    n_full = N_K // BLOCK_N2 * BLOCK_N2
    if IS_CAUSAL:
        first_row_sees = tl.maximum(start_m + causal_offset + 1, 0)  # keys [0, this)
        n_full = tl.minimum(n_full, first_row_sees // BLOCK_N2 * BLOCK_N2)
        n_hi = tl.minimum(N_K, tl.maximum(start_m + BLOCK_M2 + causal_offset, 0))
        n_hi = tl.maximum(n_hi, n_full)
    else:
        n_hi = N_K
    if SPLIT_LOOPS:
        dq = _dq_inner(dq, q, do, lse2, delta, k_base, v_base, stride_kn, stride_vn, offs_m,
                       offs_n0, offs_d, 0, n_full, N_K, causal_offset, qk_scale,
                       desc_k, desc_v, off_b, off_hkv,
                       HEAD_DIM, BLOCK_D, BLOCK_N2, False, IS_CAUSAL, UPCAST_DOT, USE_TMA)
        dq = _dq_inner(dq, q, do, lse2, delta, k_base, v_base, stride_kn, stride_vn, offs_m,
                       offs_n0, offs_d, n_full, n_hi, N_K, causal_offset, qk_scale,
                       desc_k, desc_v, off_b, off_hkv,
                       HEAD_DIM, BLOCK_D, BLOCK_N2, True, IS_CAUSAL, UPCAST_DOT, USE_TMA)
    else:  # one loop over every block with a visible entry, each one masked
        dq = _dq_inner(dq, q, do, lse2, delta, k_base, v_base, stride_kn, stride_vn, offs_m,
                       offs_n0, offs_d, 0, n_hi, N_K, causal_offset, qk_scale,
                       desc_k, desc_v, off_b, off_hkv,
                       HEAD_DIM, BLOCK_D, BLOCK_N2, True, IS_CAUSAL, UPCAST_DOT, USE_TMA)
    dq *= sm_scale
    tl.store(DQ + off_b.to(tl.int64) * stride_dqb + off_h.to(tl.int64) * stride_dqh
             + offs_m[:, None].to(tl.int64) * stride_dqm + offs_d[None, :],
             dq.to(DQ.dtype.element_ty), mask=m_ok[:, None] & (offs_d < HEAD_DIM)[None, :])


@triton.jit
def attn_bwd_fused(Q, K, V, DO, Lse, Delta, DQ, DK, DV, PartK, PartV,
                   desc_q, desc_do, desc_k, desc_v,
                   stride_qb, stride_qh, stride_qm,
                   stride_kb, stride_kh, stride_kn,
                   stride_vb, stride_vh, stride_vn,
                   stride_dob, stride_doh, stride_dom,
                   stride_dqb, stride_dqh, stride_dqm,
                   stride_dkb, stride_dkh, stride_dkn,
                   stride_dvb, stride_dvh, stride_dvn,
                   H_Q, H_KV, GROUP, N_Q, N_K, sm_scale, N1_TILES, N1_PROGRAMS, N2_TILES,
                   HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_M1: tl.constexpr, BLOCK_N1: tl.constexpr,
                   BLOCK_M2: tl.constexpr, BLOCK_N2: tl.constexpr,
                   IS_CAUSAL: tl.constexpr, UPCAST_DOT: tl.constexpr, SPLIT_LOOPS: tl.constexpr,
                   KV_SPLITS: tl.constexpr, USE_TMA: tl.constexpr, REVERSE_DQ: tl.constexpr):
    """``ONE_LAUNCH``: the dK/dV and the dQ programs in one 1-D grid, the ``N1_PROGRAMS``
    dK/dV ones (``N1_TILES`` key tiles a part) first, then the dQ ones (``N2_TILES`` query
    tiles a head), so that the dQ programs fill the SMs the dK/dV kernel's last wave leaves
    idle instead of waiting for it to end."""
    pid = tl.program_id(0)
    if pid < N1_PROGRAMS:
        _dkdv_program(pid % N1_TILES, pid // N1_TILES,
                      Q, K, V, DO, Lse, Delta, DK, DV, PartK, PartV, desc_q, desc_do,
                      stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
                      stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_dom,
                      stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
                      H_Q, H_KV, GROUP, N_Q, N_K, sm_scale, HEAD_DIM, BLOCK_D, BLOCK_M1,
                      BLOCK_N1, IS_CAUSAL, UPCAST_DOT, SPLIT_LOOPS, KV_SPLITS, USE_TMA)
    else:
        pid -= N1_PROGRAMS
        tile_m = pid % N2_TILES
        if REVERSE_DQ:
            tile_m = N2_TILES - 1 - tile_m
        _dq_program(tile_m, pid // N2_TILES, Q, K, V, DO, Lse, Delta, DQ, desc_k, desc_v,
                    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
                    stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_dom,
                    stride_dqb, stride_dqh, stride_dqm, H_Q, GROUP, N_Q, N_K, sm_scale,
                    HEAD_DIM, BLOCK_D, BLOCK_M2, BLOCK_N2, IS_CAUSAL, UPCAST_DOT, SPLIT_LOOPS,
                    USE_TMA)
