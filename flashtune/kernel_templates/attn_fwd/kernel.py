"""Flash-attention forward: online softmax over K/V tiles; the Nq x Nk matrix never leaves SRAM.

Grid: ``(cdiv(Nq, BLOCK_M), B * Hq)`` (with ``VARLEN``, ``Nq`` is the longest sequence's).
Each program owns BLOCK_M query rows of one head and walks the key axis in segments:

1. with a local window only, a masked left band: the blocks at the window's lower edge;
2. blocks every row of the tile may see in full (no mask, no bounds check);
3. a masked right band: the causal diagonal (or the window's upper edge) and the ragged end
   of the key axis.

Masks are bottom-right aligned (FlashAttention-2's convention): query ``i`` sits at key
position ``pos_i = i + Nk - Nq``; causal keeps keys ``j <= pos_i``. A row that sees no key
produces zeros and LSE = -inf. ``exp2`` is used with ``scale * log2(e)`` folded into one
multiplier.

Score modifications, FlashAttention-2's API (each behind a constexpr flag, so a plain call
compiles to the kernel without them):

* ``HAS_WINDOW``: a local window ``(WINDOW_LEFT, WINDOW_RIGHT)`` keeps keys
  ``pos_i - left <= j <= pos_i + right`` (-1: unbounded on that side; causal is right = 0 and
  may keep a left bound). Blocks outside the tile's window are never loaded, so a sliding
  window costs O(N * W); see :func:`_window_ranges` for the three segments. Causal alone
  stays ``IS_CAUSAL`` without ``HAS_WINDOW`` (segments 2 and 3).
* ``HAS_SOFTCAP``: ``s = softcap * tanh(scale * q.k / softcap)`` (Gemma-2, FA2's
  ``softcap``), computed in the log2 domain as ``tanh(q.k * scale / softcap) * softcap *
  log2(e)``.
* ``HAS_ALIBI``: ``s -= slope[b, h] * |pos_i - j|`` (ALiBi, Press et al.; FA2's
  ``alibi_slopes``, ``(Hq,)`` with ``stride_ab`` 0 or ``(B, Hq)``), after the mask.

``VARLEN`` (FA2's ``flash_attn_varlen_func``): Q/K/V are packed ``(total, H, D)``; program
``b`` reads its sequence's start and length from ``CuSeqQ``/``CuSeqK`` (the batch strides are
unused), ``N_Q``/``N_K`` are that sequence's, tiles past its end return at once, and the LSE
is ``(Hq, total_q)``.

Hopper knobs (constexpr, chosen by the config):

* ``USE_TMA``: Q, K, V are read and O written through host-built 4-D tensor descriptors
  ``(B, H, N, D)`` (the bulk tensor-copy engine); out-of-range rows and the padded head-dim
  columns come back as zeros, so no load needs a mask. Not with ``VARLEN``.
* ``REVERSE_M``: programs take query tiles last-first, so under a causal mask the longest
  tiles start first and the short ones fill the tail of the wave.

``BLOCK_D1`` > 0 (the ``SPLIT_D`` knob, :mod:`flashtune.kernel_templates.head_tiles`): the
head dim as two tiles, dims ``[0, BLOCK_D)`` (all real) and ``[BLOCK_D, BLOCK_D + BLOCK_D1)``
(zero past ``HEAD_DIM``): D96 as 64 + 32 multiplies no padded column where one 128-wide tile
spends a quarter of its dots on zeros. Q, K, V and O each get a second tile (with TMA, a
second descriptor of their own: ``desc_q1`` ..., boxes ``BLOCK_D1`` wide at column
``BLOCK_D``), the scores two dots, ``P @ V`` two accumulators. 0 compiles as before.
"""

import triton
import triton.language as tl

from flashtune.kernel_templates.score_mods import dropout_keep, modified_scores


@triton.jit
def _load_kv(k_base, v_base, desc_k, desc_v, off_b, off_hkv, start_n, offs_n, offs_d,
             stride_kn, stride_vn, N_K,
             HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
             MASKED: tl.constexpr, USE_TMA: tl.constexpr, COL0: tl.constexpr):
    """K^T ``(BLOCK_D, BLOCK_N)`` and V ``(BLOCK_N, BLOCK_D)`` of keys ``start_n + offs_n``,
    dims ``offs_d`` (``COL0 + arange(BLOCK_D)``: 0, or the head dim's second tile's first
    column); zeros past ``N_K`` (when MASKED) and past ``HEAD_DIM``."""
    if USE_TMA:
        k = desc_k.load([off_b, off_hkv, start_n, COL0]).reshape(BLOCK_N, BLOCK_D)
        v = desc_v.load([off_b, off_hkv, start_n, COL0]).reshape(BLOCK_N, BLOCK_D)
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
        elif COL0 + BLOCK_D > HEAD_DIM:
            kt = tl.load(k_ptrs, mask=d_ok[:, None], other=0.0)
            v = tl.load(v_ptrs, mask=d_ok[None, :], other=0.0)
        else:
            kt = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
    return kt, v


@triton.jit
def _attn_fwd_inner(acc, l_i, m_i, q, k_base, v_base, desc_k, desc_v, off_b, off_hkv,
                    offs_m, offs_n, offs_d, stride_kn, stride_vn, lo, hi, N_K, CAUSAL_OFFSET,
                    qk_scale, win_l, win_r, cap_in, cap_out, slope, seed, off_bh, drop_t, drop_row,
                    acc1, q1, offs_d1, desc_k1, desc_v1,
                    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                    MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, UPCAST_DOT: tl.constexpr,
                    USE_TMA: tl.constexpr, NEG_SCALE: tl.constexpr,
                    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                    HAS_ALIBI: tl.constexpr, HAS_DROPOUT: tl.constexpr,
                    BLOCK_D1: tl.constexpr):
    for start_n in tl.range(lo, hi, BLOCK_N):
        kt, v = _load_kv(k_base, v_base, desc_k, desc_v, off_b, off_hkv, start_n, offs_n,
                         offs_d, stride_kn, stride_vn, N_K, HEAD_DIM, BLOCK_D, BLOCK_N,
                         MASKED, USE_TMA, 0)
        kt1 = None
        v1 = None
        if BLOCK_D1 > 0:  # the head dim's second tile
            kt1, v1 = _load_kv(k_base, v_base, desc_k1, desc_v1, off_b, off_hkv, start_n,
                               offs_n, offs_d1, stride_kn, stride_vn, N_K, HEAD_DIM, BLOCK_D1,
                               BLOCK_N, MASKED, USE_TMA, BLOCK_D)
        if UPCAST_DOT:
            qk = tl.dot(q.to(tl.float32), kt.to(tl.float32))
            if BLOCK_D1 > 0:
                qk += tl.dot(q1.to(tl.float32), kt1.to(tl.float32))  # type: ignore[union-attr]
        else:
            qk = tl.dot(q, kt)
            if BLOCK_D1 > 0:
                qk = tl.dot(q1, kt1, qk)
        if MASKED:
            cols = start_n + offs_n
            keep = (cols < N_K)[None, :]
            if IS_CAUSAL:
                keep = keep & (cols[None, :] <= offs_m[:, None] + CAUSAL_OFFSET)
            if HAS_WINDOW:
                pos = offs_m[:, None] + CAUSAL_OFFSET
                keep = keep & (cols[None, :] >= pos - win_l)
                if not IS_CAUSAL:
                    keep = keep & (cols[None, :] <= pos + win_r)
            if HAS_SOFTCAP or HAS_ALIBI:
                s = modified_scores(qk, qk_scale, cap_in, cap_out, slope,
                                     offs_m + CAUSAL_OFFSET, cols, HAS_SOFTCAP, HAS_ALIBI)
                qk = tl.where(keep, s, float("-inf"))
            else:
                qk = tl.where(keep, qk * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            # rows with no visible key so far keep m = -inf; subtract 0 to avoid inf - inf
            m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.math.exp2(qk - m_sub[:, None])
        elif HAS_SOFTCAP or HAS_ALIBI:
            # every row sees every key: m stays finite, but the scores are no longer a
            # multiple of the dot, so they are formed before the row maximum
            qk = modified_scores(qk, qk_scale, cap_in, cap_out, slope, offs_m + CAUSAL_OFFSET,
                                  start_n + offs_n, HAS_SOFTCAP, HAS_ALIBI)
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            m_sub = m_new
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
        l_i = l_i * alpha + tl.sum(p, 1)  # the normaliser sees every score, dropped or not
        acc = acc * alpha[:, None]
        if HAS_DROPOUT:
            # P.V sees the kept ones (scaled by 1 / keep at the end); a product, not a
            # select: a select would sink past the cast to 16 bits (unpacking the pairs)
            keep = dropout_keep(seed, off_bh, drop_row, start_n, drop_t, offs_m.shape[0], BLOCK_N)
            p = p * tl.where(keep, 1.0, 0.0)
        if UPCAST_DOT:
            acc += tl.dot(p, v.to(tl.float32))
            if BLOCK_D1 > 0:
                acc1 = acc1 * alpha[:, None] + tl.dot(
                    p, v1.to(tl.float32))  # type: ignore[union-attr]
        else:
            acc = tl.dot(p.to(v.dtype), v, acc)
            if BLOCK_D1 > 0:
                acc1 = tl.dot(p.to(v1.dtype), v1, acc1 * alpha[:, None])  # type: ignore[union-attr]
        m_i = m_new
    return acc, l_i, m_i, acc1


@triton.jit
def _window_ranges(start_m, N_K, causal_offset, win_l, win_r,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``(lo, full_lo, full_hi, hi)`` of a query tile under a window: keys ``[lo, full_lo)``
    (left band) and ``[full_hi, hi)`` (right band) are walked masked, ``[full_lo, full_hi)``
    unmasked; nothing outside ``[lo, hi)`` is loaded.

    Rows ``m0..m1`` (``m1 = m0 + BLOCK_M - 1``, unclamped) sit at keys ``pos(m) = m +
    causal_offset``. The tile sees keys ``[pos(m0) - left, pos(m1) + right]``: the walk
    starts at that block and stops at the last key (``hi`` need not be block-aligned). Every
    row sees ``[pos(m1) - left, pos(m0) + right]``: the whole blocks inside it, and below the
    ragged end of the key axis, run unmasked. When there are none (a window narrower than
    the tile) the left band is the whole walk. ``win_l``/``win_r`` are >= 0 (unbounded
    sides come in as a bound past every key)."""
    pos0 = start_m * BLOCK_M + causal_offset
    pos1 = pos0 + BLOCK_M - 1
    # floor/ceil to BLOCK_N of non-negative values only (// truncates toward zero)
    lo = tl.maximum(pos0 - win_l, 0) // BLOCK_N * BLOCK_N
    hi = tl.maximum(tl.minimum(N_K, pos1 + win_r + 1), lo)
    full_lo = (tl.maximum(pos1 - win_l, 0) + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    full_hi = tl.maximum(pos0 + win_r + 1, 0) // BLOCK_N * BLOCK_N
    full_hi = tl.maximum(tl.minimum(full_hi, (N_K // BLOCK_N) * BLOCK_N), full_lo)
    return lo, full_lo, full_hi, hi


@triton.jit
def attn_fwd_kernel(
    Q, K, V, Out, Lse,
    desc_q, desc_k, desc_v, desc_o,
    Alibi, CuSeqQ, CuSeqK,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_om,
    stride_lb, stride_lh,
    H_Q, GROUP, N_Q, N_K, sm_scale,
    # the modifications' scalars come last: a plain launch keeps every earlier parameter's
    # place, and so (the pointers above being None) today's PTX and SASS
    stride_ab, WINDOW_LEFT, WINDOW_RIGHT, SOFTCAP,
    Seed, DROPOUT_T,
    # the head dim's second tile's descriptors (None unless USE_TMA with BLOCK_D1 > 0)
    desc_q1, desc_k1, desc_v1, desc_o1,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr, STORE_LSE: tl.constexpr, UPCAST_DOT: tl.constexpr,
    NEG_SCALE: tl.constexpr, USE_TMA: tl.constexpr, REVERSE_M: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    VARLEN: tl.constexpr, HAS_DROPOUT: tl.constexpr, BLOCK_D1: tl.constexpr = 0,
):
    tl.static_assert(BLOCK_M >= 16 and BLOCK_N >= 16, "tl.dot needs tiles of at least 16")
    tl.static_assert(BLOCK_D + BLOCK_D1 >= HEAD_DIM, "BLOCK_D (+ BLOCK_D1) must cover HEAD_DIM")
    tl.static_assert(BLOCK_D1 == 0 or (BLOCK_D < HEAD_DIM and BLOCK_D1 >= 16),
                     "a second tile of >= 16 dims past a first one of real dims")
    tl.static_assert(not (USE_TMA and VARLEN), "VARLEN reads through pointers, not TMA")
    if REVERSE_M:
        start_m = tl.num_programs(0) - 1 - tl.program_id(0)
    else:
        start_m = tl.program_id(0)
    off_bh = tl.program_id(1)
    off_b = off_bh // H_Q
    off_h = off_bh % H_Q
    off_hkv = off_h // GROUP

    if VARLEN:
        # this sequence's rows of the packed tensors; the batch strides are unused
        q_start = tl.load(CuSeqQ + off_b)
        k_start = tl.load(CuSeqK + off_b)
        N_Q = tl.load(CuSeqQ + off_b + 1) - q_start
        N_K = tl.load(CuSeqK + off_b + 1) - k_start
        if start_m * BLOCK_M >= N_Q:
            return

    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < N_Q
    d_ok = offs_d < HEAD_DIM

    if VARLEN:
        k_base = K + k_start.to(tl.int64) * stride_kn + off_hkv.to(tl.int64) * stride_kh
        v_base = V + k_start.to(tl.int64) * stride_vn + off_hkv.to(tl.int64) * stride_vh
    else:
        k_base = K + off_b.to(tl.int64) * stride_kb + off_hkv.to(tl.int64) * stride_kh
        v_base = V + off_b.to(tl.int64) * stride_vb + off_hkv.to(tl.int64) * stride_vh
    if USE_TMA:
        q = desc_q.load([off_b, off_h, start_m * BLOCK_M, 0]).reshape(BLOCK_M, BLOCK_D)
    else:
        if VARLEN:
            q_base = Q + q_start.to(tl.int64) * stride_qm + off_h.to(tl.int64) * stride_qh
        else:
            q_base = Q + off_b.to(tl.int64) * stride_qb + off_h.to(tl.int64) * stride_qh
        q_ptrs = q_base + offs_m[:, None].to(tl.int64) * stride_qm + offs_d[None, :]
        q = tl.load(q_ptrs, mask=m_ok[:, None] & d_ok[None, :], other=0.0)
    # the head dim's second tile; without one, acc1 is a placeholder the loops carry and the
    # compiler drops
    offs_d1 = None
    q1 = None
    acc1 = tl.zeros([1], dtype=tl.float32)
    if BLOCK_D1 > 0:
        offs_d1 = BLOCK_D + tl.arange(0, BLOCK_D1)
        if USE_TMA:
            q1 = desc_q1.load([off_b, off_h, start_m * BLOCK_M, BLOCK_D]).reshape(BLOCK_M,
                                                                                  BLOCK_D1)
        else:
            q1_ptrs = q_base + offs_m[:, None].to(tl.int64) * stride_qm + offs_d1[None, :]
            q1 = tl.load(q1_ptrs, mask=m_ok[:, None] & (offs_d1 < HEAD_DIM)[None, :],
                         other=0.0)
        acc1 = tl.zeros([BLOCK_M, BLOCK_D1], dtype=tl.float32)

    qk_scale = sm_scale * 1.4426950408889634  # log2(e)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # the modifications' scalars; None (constexpr) when off, so a plain call compiles as before
    cap_in = None
    cap_out = None
    if HAS_SOFTCAP:
        cap_in = sm_scale / SOFTCAP
        cap_out = SOFTCAP * 1.4426950408889634
    slope = None
    if HAS_ALIBI:
        slope = tl.load(Alibi + off_b.to(tl.int64) * stride_ab + off_h) * 1.4426950408889634
    seed = None
    if HAS_DROPOUT:
        seed = tl.load(Seed)

    # Key ranges: masked [lo, full_lo), unmasked [full_lo, full_hi), masked [full_hi, hi).
    causal_offset = N_K - N_Q
    win_l = None
    win_r = None
    if not HAS_WINDOW:
        # Every row of this tile sees keys [0, full_hi) without masking; no left band.
        full_lo: tl.constexpr = 0
        n_full = (N_K // BLOCK_N) * BLOCK_N
        if IS_CAUSAL:
            first_row_sees = start_m * BLOCK_M + causal_offset + 1  # keys [0, this) for row 0 of the tile
            full_hi = tl.minimum(n_full, tl.maximum(first_row_sees, 0) // BLOCK_N * BLOCK_N)
            hi = tl.minimum(N_K, tl.maximum(start_m * BLOCK_M + BLOCK_M + causal_offset, 0))
        else:
            full_hi = n_full
            hi = N_K
        hi = tl.maximum(hi, full_hi)
    else:
        # -1 (unbounded) becomes a bound no tile reaches: |pos - j| < N_Q + N_K + BLOCK_M
        unbounded = N_Q + N_K + BLOCK_M
        win_l = tl.where(WINDOW_LEFT < 0, unbounded, WINDOW_LEFT)
        if IS_CAUSAL:
            win_r = 0
        else:
            win_r = tl.where(WINDOW_RIGHT < 0, unbounded, WINDOW_RIGHT)
        lo, full_lo, full_hi, hi = _window_ranges(start_m, N_K, causal_offset, win_l, win_r,
                                                  BLOCK_M, BLOCK_N)
        # the left band: the window's lower edge (all of the walk when no block is seen
        # in full by every row)
        acc, l_i, m_i, acc1 = _attn_fwd_inner(
            acc, l_i, m_i, q, k_base, v_base, desc_k, desc_v, off_b, off_hkv, offs_m, offs_n,
            offs_d, stride_kn, stride_vn, lo, full_lo, N_K, causal_offset, qk_scale, win_l,
            win_r, cap_in, cap_out, slope, seed, off_bh, DROPOUT_T, start_m * BLOCK_M,
            acc1, q1, offs_d1, desc_k1, desc_v1, HEAD_DIM, BLOCK_D, BLOCK_N,
            True, IS_CAUSAL, UPCAST_DOT, USE_TMA, NEG_SCALE,
            HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, BLOCK_D1)

    acc, l_i, m_i, acc1 = _attn_fwd_inner(
        acc, l_i, m_i, q, k_base, v_base, desc_k, desc_v, off_b, off_hkv, offs_m, offs_n,
        offs_d, stride_kn, stride_vn, full_lo, full_hi, N_K, causal_offset, qk_scale, win_l, win_r,
        cap_in, cap_out, slope, seed, off_bh, DROPOUT_T, start_m * BLOCK_M,
        acc1, q1, offs_d1, desc_k1, desc_v1, HEAD_DIM, BLOCK_D, BLOCK_N,
        False, IS_CAUSAL, UPCAST_DOT, USE_TMA, NEG_SCALE,
        HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, BLOCK_D1)
    acc, l_i, m_i, acc1 = _attn_fwd_inner(
        acc, l_i, m_i, q, k_base, v_base, desc_k, desc_v, off_b, off_hkv, offs_m, offs_n,
        offs_d, stride_kn, stride_vn, full_hi, hi, N_K, causal_offset, qk_scale, win_l, win_r,
        cap_in, cap_out, slope, seed, off_bh, DROPOUT_T, start_m * BLOCK_M,
        acc1, q1, offs_d1, desc_k1, desc_v1, HEAD_DIM, BLOCK_D, BLOCK_N,
        True, IS_CAUSAL, UPCAST_DOT, USE_TMA, NEG_SCALE,
        HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, BLOCK_D1)

    seen = l_i > 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    if HAS_DROPOUT:  # the kept scores scaled by 1 / keep, keep = DROPOUT_T / 256 exactly
        out = (acc / (l_safe * (DROPOUT_T * 0.00390625))[:, None]).to(Out.dtype.element_ty)
    else:
        out = (acc / l_safe[:, None]).to(Out.dtype.element_ty)
    out1 = None
    if BLOCK_D1 > 0:
        if HAS_DROPOUT:
            out1 = (acc1 / (l_safe * (DROPOUT_T * 0.00390625))[:, None]).to(
                Out.dtype.element_ty)
        else:
            out1 = (acc1 / l_safe[:, None]).to(Out.dtype.element_ty)
    if USE_TMA:
        desc_o.store([off_b, off_h, start_m * BLOCK_M, 0], out.reshape(1, 1, BLOCK_M, BLOCK_D))
        if BLOCK_D1 > 0:
            desc_o1.store([off_b, off_h, start_m * BLOCK_M, BLOCK_D],
                          out1.reshape(1, 1, BLOCK_M, BLOCK_D1))  # type: ignore[union-attr]
    else:
        if VARLEN:
            o_base = Out + q_start.to(tl.int64) * stride_om + off_h.to(tl.int64) * stride_oh
        else:
            o_base = Out + off_b.to(tl.int64) * stride_ob + off_h.to(tl.int64) * stride_oh
        o_ptrs = o_base + offs_m[:, None].to(tl.int64) * stride_om + offs_d[None, :]
        tl.store(o_ptrs, out, mask=m_ok[:, None] & d_ok[None, :])
        if BLOCK_D1 > 0:
            o1_ptrs = o_base + offs_m[:, None].to(tl.int64) * stride_om \
                + offs_d1[None, :]  # type: ignore[index]
            tl.store(o1_ptrs, out1, mask=m_ok[:, None] & (offs_d1 < HEAD_DIM)[None, :])
    if STORE_LSE:
        lse = tl.where(seen, (m_i + tl.math.log2(l_safe)) * 0.6931471805599453, float("-inf"))
        if VARLEN:  # (Hq, total_q)
            l_ptrs = Lse + off_h.to(tl.int64) * stride_lh + q_start + offs_m
        else:
            l_ptrs = (Lse + off_b.to(tl.int64) * stride_lb + off_h.to(tl.int64) * stride_lh
                      + offs_m)
        tl.store(l_ptrs, lse, mask=m_ok)
