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

``BLOCK_D1`` > 0 (the ``SPLIT_D`` knob, :mod:`flashtune.kernel_templates.head_tiles`): the
head dim as two tiles, dims ``[0, BLOCK_D)`` (all real) and ``[BLOCK_D, BLOCK_D + BLOCK_D1)``
(zero past ``HEAD_DIM``), as the forward's: D96 as 64 + 32 multiplies no padded column where
one 128-wide tile spends a quarter of each of the five dots on zeros. Every tile of Q, K, V
and dO the two main kernels hold or stream gets a second one (with TMA, a second descriptor:
``desc_q1`` ..., boxes ``BLOCK_D1`` wide at column ``BLOCK_D``), the scores and ``dO V^T``
two dots each, dK, dV and dQ two accumulators; the preprocess and the reduce read one padded
tile (memory-bound). 0 compiles as before.

Causal masking is bottom-right aligned (query ``i`` sees key ``j <= i + Nk - Nq``); fully
masked blocks are skipped. ``SPLIT_LOOPS`` (a knob) splits each walk like the forward's:
blocks every entry of which is visible run in their own loop without any mask, and only the
diagonal band and the ragged end of the walked axis are masked. Off, one loop masks every
block: fewer registers (ptxas spills less in the dK/dV kernel, which holds two fp32
accumulator tiles), more ALU work per block. The ragged end of the *owned* axis needs no mask inside the loop: a row of
dK/dV (of dQ) depends only on its own key (query), and rows past the end are never stored;
the zeros loaded for them keep their columns out of the other operand's sums. Rows that see
no key have ``LSE = -inf``; they only ever meet masked entries, so they contribute zero.

Score modifications, dropout and packed sequences (FlashAttention-2's API, the forward's
semantics), each behind a constexpr flag: off, the kernels compile to the plain code above.
Their runtime arguments (``Alibi, CuSeqQ, CuSeqK, stride_ab, WINDOW_LEFT, WINDOW_RIGHT,
SOFTCAP, Seed, DROPOUT_T``) follow the plain kernels' own, which keep their places in the parameter buffer: moving them moved
ptxas's parameter loads and register allocation (one more register in a dQ config).

* ``HAS_WINDOW``: a local window ``(WINDOW_LEFT, WINDOW_RIGHT)``, bottom-right aligned like
  the causal mask: query ``i``, at key position ``pos = i + Nk - Nq``, sees keys
  ``pos - left <= j <= pos + right``, -1 leaving a side unbounded. With ``IS_CAUSAL`` the
  right bound is 0 (causal alone keeps the IS_CAUSAL path). Both walks visit only the blocks
  the window reaches, O(N * W) work for W keys a row (FlashAttention-2's local attention):
  the dK/dV program for keys ``[n0, n1]`` the query tiles with ``pos`` in
  ``[n0 - right, n1 + left]``, the dQ program for rows ``[m0, m1]`` the key tiles in
  ``[pos(m0) - left, pos(m1) + right]``; with SPLIT_LOOPS the blocks in the middle, every
  entry of which is visible, run unmasked and only the bands on both sides are masked.
* ``HAS_SOFTCAP``: ``s = SOFTCAP * tanh(scale * q.k / SOFTCAP)`` (Gemma 2's logit cap), in
  log2 units ``t * (SOFTCAP * log2(e))``; dS with respect to the raw scaled score is the
  dS of the capped one times ``1 - t^2``. tanh through ``exp2``
  (:func:`~flashtune.kernel_templates.score_mods.tanh`: the interpreter has no tanh).
* ``HAS_ALIBI``: ``s -= slope[b, h] * |pos - j|`` (``Alibi`` fp32, row stride ``stride_ab``,
  0 for one slope per head); a constant of the scores, no gradient flows to the slopes.
* ``HAS_DROPOUT``: attention dropout (FlashAttention-2's ``dropout_p``, the forward's):
  both walks regenerate the forward's keep mask ``Z`` from the seed at ``Seed``
  (:func:`~flashtune.kernel_templates.score_mods.dropout_keep`, a function of the head and
  the (query, key) position only, so the transposed tiles of the dK/dV kernel and the dQ
  kernel's own tiles see the same one) and, with ``r = 256 / DROPOUT_T`` the inverse keep
  probability, compute ``dV += (P Z r)^T dO`` and ``dS = P (dP Z r - delta)``; ``delta =
  rowsum(dO O)`` of the dropped output, unchanged.
* ``VARLEN``: packed sequences (``flash_attn_varlen_func``'s layout): Q/dO/dQ
  ``(total_q, Hq, D)``, K/V/dK/dV ``(total_k, Hkv, D)``, sequence ``b`` the tokens
  ``[CuSeqQ[b], CuSeqQ[b + 1])`` (``CuSeqK`` for keys). Program ``b`` reads its starts and
  lengths there and offsets its base pointers by ``start * token stride`` (the batch stride
  is unused); ``N_Q``/``N_K`` are then the totals, the row strides of the LSE and delta
  ``(Hq, total_q)`` and of KV_SPLITS' partial sums ``(Hkv * KV_SPLITS, total_k, D)``;
  programs whose tile starts past their sequence return at once. The preprocess and the
  reduce kernels need no flag: the launcher runs them over the packed tokens as one batch
  element. No TMA (the descriptors are per batch element).
"""

import triton
import triton.language as tl

from flashtune.kernel_templates.score_mods import dropout_keep, tanh

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
def _seq(CuSeq, off_b):
    """``(start, length)`` of packed sequence ``off_b`` (VARLEN)."""
    start = tl.load(CuSeq + off_b)
    return start, tl.load(CuSeq + off_b + 1) - start


@triton.jit
def _head(X, off_b, off_h, start, stride_b, stride_h, stride_n, VARLEN: tl.constexpr):
    """Base pointer of head ``off_h`` of batch element ``off_b`` (``(B, H, N, D)`` strides),
    with VARLEN of the packed ``(total, H, D)`` tokens from ``start`` on."""
    if VARLEN:
        return X + start.to(tl.int64) * stride_n + off_h.to(tl.int64) * stride_h
    return X + off_b.to(tl.int64) * stride_b + off_h.to(tl.int64) * stride_h


@triton.jit
def _window(WINDOW_LEFT, WINDOW_RIGHT, n_q, n_k, IS_CAUSAL: tl.constexpr):
    """The window's ``(left, right)`` bounds, an unbounded side (-1) as ``n_q + n_k`` (past
    every key), ``right`` 0 when causal."""
    left = tl.where(WINDOW_LEFT < 0, n_q + n_k, WINDOW_LEFT)
    if IS_CAUSAL:
        right = 0
    else:
        right = tl.where(WINDOW_RIGHT < 0, n_q + n_k, WINDOW_RIGHT)
    return left, right


@triton.jit
def _load_rows(base, offs, offs_d, stride, N, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
               MASKED: tl.constexpr):
    """Rows ``offs`` of a ``(N, HEAD_DIM)`` matrix at ``base``, ``(len(offs), BLOCK_D)``;
    zeros past ``N`` (when MASKED) and past ``HEAD_DIM`` (a tile narrower than HEAD_DIM,
    SPLIT_D's first, takes its first BLOCK_D dims)."""
    ptrs = base + offs[:, None].to(tl.int64) * stride + offs_d[None, :]
    if MASKED:
        return tl.load(ptrs, mask=(offs < N)[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0)
    elif BLOCK_D > HEAD_DIM:
        return tl.load(ptrs, mask=(offs_d < HEAD_DIM)[None, :], other=0.0)
    else:
        return tl.load(ptrs)


@triton.jit
def _load_tile(desc, base, off_b, off_h, start, offs, offs_d, stride, N,
               HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK: tl.constexpr,
               MASKED: tl.constexpr, USE_TMA: tl.constexpr, COL0: tl.constexpr):
    """Rows ``start + [0, BLOCK)`` (= ``offs``) of head ``(off_b, off_h)``, dims ``COL0 +
    offs_d`` (``offs_d = arange(BLOCK_D)``; COL0 > 0: SPLIT_D's second tile), through the
    tensor descriptor (USE_TMA: zero-filled past N and HEAD_DIM by the copy engine) or as
    :func:`_load_rows`."""
    if USE_TMA:
        return desc.load([off_b, off_h, start, COL0]).reshape(BLOCK, BLOCK_D)
    if COL0 > 0:  # the matrix of the HEAD_DIM - COL0 dims from column COL0 on
        return _load_rows(base + COL0, offs, offs_d, stride, N, HEAD_DIM - COL0, BLOCK_D,
                          MASKED)
    return _load_rows(base, offs, offs_d, stride, N, HEAD_DIM, BLOCK_D, MASKED)


# DROPOUT_BITS: the keep mask as bits, written by the dK/dV kernel and read by the dQ kernel.
# Per query head (``b * H_Q + h``) an int32 array of ``NQB * NKB * 64`` words (NQB blocks
# of 64 queries, NKB of 32 keys, both padded to the kernels' tiles), block ``(qb, kb)`` at
# word ``(qb * NKB + kb) * 64``. Query ``i = 64 qb + 32 i5 + 16 i4 + 8 i3 + 2 i21 + i0``
# against key ``j = 32 kb + 16 j4 + 8 j3 + j210`` (bits and fields of the offsets within
# the block) is bit ``16 i5 + 8 i4 + 4 i0 + 2 i3 + j3`` of the block's word ``32 j4 + 8 i21
# + j210``. The fields are chosen for the sm_90 MMA layouts of 64 x 64 tiles at 4 warps:
# a word is the 32 scores one thread holds of the dK/dV kernel's transposed tile (keys by
# queries: warp = (kb, j4), lane = (j210, i21)), so it packs its own word and a warp stores
# 128 contiguous bytes; a thread of the dQ kernel's tile reads 4 bits of each of 8 words.


@triton.jit
def _or_shift(x, SHIFT: tl.constexpr):
    """The two halves of ``x``'s last dim (of size 2) as one word: ``lo | hi << SHIFT``
    (disjoint bits)."""
    lo, hi = tl.split(x)
    return lo | (hi << SHIFT)


@triton.jit
def _bits_offsets(bits_nkb, start_q, start_k, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr):
    """Word offsets ``(qb, i21, kb, j4, j210)`` of queries ``start_q + [0, BLOCK_Q)`` against
    keys ``start_k + [0, BLOCK_K)`` (starts multiples of 64 and 32)."""
    qb = start_q // 64 + tl.arange(0, BLOCK_Q // 64)
    kb = start_k // 32 + tl.arange(0, BLOCK_K // 32)
    block = (qb[:, None] * bits_nkb + kb[None, :]) * 64
    off = block[:, None, :, None, None] \
        + tl.arange(0, 4)[None, :, None, None, None] * 8 \
        + tl.arange(0, 2)[None, None, None, :, None] * 32 \
        + tl.arange(0, 8)[None, None, None, None, :]
    return off


@triton.jit
def _store_bits(bits_base, bits_nkb, keepT, start_n, start_m, BLOCK_N: tl.constexpr,
                BLOCK_M: tl.constexpr):
    """Store the dK/dV kernel's keep tile ``keepT`` (keys ``start_n + [0, BLOCK_N)`` by
    queries ``start_m + [0, BLOCK_M)``) as whole words of the bit array at ``bits_base``."""
    tl.static_assert(BLOCK_M % 64 == 0 and BLOCK_N % 32 == 0,
                     "DROPOUT_BITS: query steps of 64k and key tiles of 32k")
    # (kb, j4, j3, j210, qb, i5, i4, i3, i21, i0) -> (kb, j4, j210, qb, i21, | i5, i4, i0,
    # i3, j3), the word's bits last, then folded from the lowest one up
    x = keepT.to(tl.int32).reshape(BLOCK_N // 32, 2, 2, 8, BLOCK_M // 64, 2, 2, 2, 4, 2)
    x = tl.permute(x, (4, 8, 0, 1, 3, 5, 6, 9, 7, 2))
    x = _or_shift(_or_shift(_or_shift(_or_shift(_or_shift(x, 1), 2), 4), 8), 16)
    tl.store(bits_base + _bits_offsets(bits_nkb, start_m, start_n, BLOCK_M, BLOCK_N), x)


@triton.jit
def _load_bits(bits_base, bits_nkb, start_m, start_n, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr):
    """The keep tile of queries ``start_m + [0, BLOCK_M)`` against keys ``start_n + [0,
    BLOCK_N)`` (``(BLOCK_M, BLOCK_N)`` bool) from the bit array at ``bits_base``."""
    tl.static_assert(BLOCK_M % 64 == 0 and BLOCK_N % 32 == 0,
                     "DROPOUT_BITS: query tiles of 64k and key steps of 32k")
    w = tl.load(bits_base + _bits_offsets(bits_nkb, start_m, start_n, BLOCK_M, BLOCK_N))
    # one bit per (i5, i4, i0, i3, j3)
    i5 = tl.arange(0, 2)[:, None, None, None, None]
    i4 = tl.arange(0, 2)[None, :, None, None, None]
    i0 = tl.arange(0, 2)[None, None, :, None, None]
    i3 = tl.arange(0, 2)[None, None, None, :, None]
    j3 = tl.arange(0, 2)[None, None, None, None, :]
    bit = 1 << (16 * i5 + 8 * i4 + 4 * i0 + 2 * i3 + j3)
    keep = (w[:, :, :, :, :, None, None, None, None, None]
            & bit[None, None, None, None, None, :, :, :, :, :]) != 0
    # (qb, i21, kb, j4, j210, i5, i4, i0, i3, j3) -> (qb, i5, i4, i3, i21, i0, kb, j4, j3,
    # j210)
    keep = tl.permute(keep, (0, 5, 6, 8, 1, 7, 2, 3, 9, 4))
    return keep.reshape(BLOCK_M, BLOCK_N)


@triton.jit
def _dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qm, stride_dom,
                offs_n, offs_m0, offs_d, lo, hi, N_Q, CAUSAL_OFFSET, qk_scale,
                desc_q, desc_do, off_b, off_h, win_left, win_right, cap_scale, cap2, slope2,
                seed, drop_head, drop_start, drop_t, drop_r, bits_base, bits_nkb,
                dk1, dv1, k1, v1, desc_q1, desc_do1,
                HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M1: tl.constexpr,
                MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, UPCAST_DOT: tl.constexpr,
                USE_TMA: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                HAS_ALIBI: tl.constexpr, HAS_DROPOUT: tl.constexpr,
                DROPOUT_BITS: tl.constexpr, BLOCK_D1: tl.constexpr):
    """Query blocks ``[lo, hi)`` of one head against the program's keys; MASKED blocks get
    the bounds and causal (window) masks, the others every entry. ``cap_scale``/``cap2``:
    ``scale / SOFTCAP`` and ``SOFTCAP * log2(e)``; ``slope2``: the ALiBi slope times
    ``log2(e)``. BLOCK_D1 > 0: ``k1``, ``v1``, ``dk1``, ``dv1`` the head dim's second
    tiles (placeholders otherwise), Q's and dO's read here."""
    for start_m in range(lo, hi, BLOCK_M1):
        offs_m = start_m + offs_m0
        q = _load_tile(desc_q, q_base, off_b, off_h, start_m, offs_m, offs_d, stride_qm, N_Q,
                       HEAD_DIM, BLOCK_D, BLOCK_M1, MASKED, USE_TMA, 0)
        do = _load_tile(desc_do, do_base, off_b, off_h, start_m, offs_m, offs_d, stride_dom,
                        N_Q, HEAD_DIM, BLOCK_D, BLOCK_M1, MASKED, USE_TMA, 0)
        q1 = None
        do1 = None
        if BLOCK_D1 > 0:
            offs_e = tl.arange(0, BLOCK_D1)
            q1 = _load_tile(desc_q1, q_base, off_b, off_h, start_m, offs_m, offs_e, stride_qm,
                            N_Q, HEAD_DIM, BLOCK_D1, BLOCK_M1, MASKED, USE_TMA, BLOCK_D)
            do1 = _load_tile(desc_do1, do_base, off_b, off_h, start_m, offs_m, offs_e,
                             stride_dom, N_Q, HEAD_DIM, BLOCK_D1, BLOCK_M1, MASKED, USE_TMA,
                             BLOCK_D)
        if MASKED:
            m_ok = offs_m < N_Q
            lse = tl.load(lse_base + offs_m, mask=m_ok, other=0.0)
            delta = tl.load(delta_base + offs_m, mask=m_ok, other=0.0)
        else:
            lse = tl.load(lse_base + offs_m)
            delta = tl.load(delta_base + offs_m)
        qkT = _dot(k, tl.trans(q), UPCAST_DOT)  # (BLOCK_N1, BLOCK_M1)
        if BLOCK_D1 > 0:
            qkT += _dot(k1, tl.trans(q1), UPCAST_DOT)
        if HAS_SOFTCAP or HAS_ALIBI:
            if HAS_SOFTCAP:
                tT = tanh(qkT * cap_scale)
                sT = tT * cap2
            else:
                sT = qkT * qk_scale
            if HAS_ALIBI:
                dist = tl.abs(offs_m[None, :] + CAUSAL_OFFSET - offs_n[:, None])
                sT -= slope2 * dist.to(tl.float32)
            pT = tl.math.exp2(sT - (lse * LOG2E)[None, :])
        else:
            pT = tl.math.exp2(qkT * qk_scale - (lse * LOG2E)[None, :])
        if MASKED:
            keep = (offs_m < N_Q)[None, :]
            if HAS_WINDOW:
                pos = offs_m[None, :] + CAUSAL_OFFSET
                keep = keep & (offs_n[:, None] >= pos - win_left) \
                    & (offs_n[:, None] <= pos + win_right)
            elif IS_CAUSAL:
                keep = keep & (offs_n[:, None] <= offs_m[None, :] + CAUSAL_OFFSET)
            pT = tl.where(keep, pT, 0.0)  # also drops the inf of rows with LSE = -inf
        if HAS_DROPOUT:
            # Z r: the forward's mask (regenerated, built keys by queries: words move
            # between threads, not the mask), 1 / keep where kept; dV = (P Z r)^T dO,
            # dS = P (dP Z r - delta)
            keepT = dropout_keep(seed, drop_head, start_m, drop_start, drop_t, BLOCK_M1,
                                 k.shape[0], True)
            if DROPOUT_BITS:  # the mask as bits, for the dQ kernel (run after this one)
                _store_bits(bits_base, bits_nkb, keepT, drop_start, start_m, k.shape[0],
                            BLOCK_M1)
            zT = tl.where(keepT, drop_r, 0.0)
            dv += _dot((pT * zT).to(do.dtype), do, UPCAST_DOT)
            dpT = _dot(v, tl.trans(do), UPCAST_DOT)
            if BLOCK_D1 > 0:
                dv1 += _dot((pT * zT).to(do.dtype), do1, UPCAST_DOT)
                dpT += _dot(v1, tl.trans(do1), UPCAST_DOT)
            dsT = pT * (dpT * zT - delta[None, :])
        else:
            dv += _dot(pT.to(do.dtype), do, UPCAST_DOT)
            dpT = _dot(v, tl.trans(do), UPCAST_DOT)
            if BLOCK_D1 > 0:
                dv1 += _dot(pT.to(do.dtype), do1, UPCAST_DOT)
                dpT += _dot(v1, tl.trans(do1), UPCAST_DOT)
            dsT = pT * (dpT - delta[None, :])
        if HAS_SOFTCAP:  # d(capped score) / d(scaled score)
            dsT = dsT * (1.0 - tT * tT)
        dk += _dot(dsT.to(q.dtype), q, UPCAST_DOT)
        if BLOCK_D1 > 0:
            dk1 += _dot(dsT.to(q.dtype), q1, UPCAST_DOT)
    return dk, dv, dk1, dv1


@triton.jit
def _store_dkdv(DK, DV, dk, dv, off_b, off_hkv, start, offs_n, offs_d, mask,
                stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
                VARLEN: tl.constexpr):
    """dK and dV rows ``offs_n`` of K/V head ``(off_b, off_hkv)`` (VARLEN: of the packed
    sequence from token ``start`` on), cast to their dtype."""
    tl.store(_head(DK, off_b, off_hkv, start, stride_dkb, stride_dkh, stride_dkn, VARLEN)
             + offs_n[:, None].to(tl.int64) * stride_dkn + offs_d[None, :],
             dk.to(DK.dtype.element_ty), mask=mask)
    tl.store(_head(DV, off_b, off_hkv, start, stride_dvb, stride_dvh, stride_dvn, VARLEN)
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
                  Alibi, CuSeqQ, CuSeqK, stride_ab, WINDOW_LEFT, WINDOW_RIGHT, SOFTCAP,
                  Seed, DROPOUT_T, Bits, bits_stride_h, bits_nkb,
                  # the head dim's second tile's descriptors (None unless USE_TMA with
                  # BLOCK_D1 > 0), after every other runtime argument
                  desc_q1, desc_do1,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK_M1: tl.constexpr, BLOCK_N1: tl.constexpr,
                  IS_CAUSAL: tl.constexpr, UPCAST_DOT: tl.constexpr, SPLIT_LOOPS: tl.constexpr,
                  KV_SPLITS: tl.constexpr, USE_TMA: tl.constexpr,
                  HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
                  VARLEN: tl.constexpr, HAS_DROPOUT: tl.constexpr,
                  DROPOUT_BITS: tl.constexpr, BLOCK_D1: tl.constexpr = 0):
    _dkdv_program(tl.program_id(0), tl.program_id(1),
                  Q, K, V, DO, Lse, Delta, DK, DV, PartK, PartV, desc_q, desc_do,
                  stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
                  stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_dom,
                  stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
                  H_Q, H_KV, GROUP, N_Q, N_K, sm_scale, Alibi, CuSeqQ, CuSeqK, stride_ab,
                  WINDOW_LEFT, WINDOW_RIGHT, SOFTCAP,
                  Seed, DROPOUT_T, Bits, bits_stride_h, bits_nkb, desc_q1, desc_do1,
                  HEAD_DIM, BLOCK_D, BLOCK_M1,
                  BLOCK_N1, IS_CAUSAL, UPCAST_DOT, SPLIT_LOOPS, KV_SPLITS, USE_TMA, HAS_WINDOW,
                  HAS_SOFTCAP, HAS_ALIBI, VARLEN, HAS_DROPOUT, DROPOUT_BITS, BLOCK_D1)


@triton.jit
def _dkdv_program(tile_n, part, Q, K, V, DO, Lse, Delta, DK, DV, PartK, PartV, desc_q, desc_do,
                  stride_qb, stride_qh, stride_qm,
                  stride_kb, stride_kh, stride_kn,
                  stride_vb, stride_vh, stride_vn,
                  stride_dob, stride_doh, stride_dom,
                  stride_dkb, stride_dkh, stride_dkn,
                  stride_dvb, stride_dvh, stride_dvn,
                  H_Q, H_KV, GROUP, N_Q, N_K, sm_scale,
                  Alibi, CuSeqQ, CuSeqK, stride_ab, WINDOW_LEFT, WINDOW_RIGHT, SOFTCAP,
                  Seed, DROPOUT_T, Bits, bits_stride_h, bits_nkb, desc_q1, desc_do1,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK_M1: tl.constexpr, BLOCK_N1: tl.constexpr,
                  IS_CAUSAL: tl.constexpr, UPCAST_DOT: tl.constexpr, SPLIT_LOOPS: tl.constexpr,
                  KV_SPLITS: tl.constexpr, USE_TMA: tl.constexpr,
                  HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
                  VARLEN: tl.constexpr, HAS_DROPOUT: tl.constexpr,
                  DROPOUT_BITS: tl.constexpr, BLOCK_D1: tl.constexpr):
    """One dK/dV program: key tile ``tile_n`` of part ``part`` = ``(b, hkv) * KV_SPLITS +``
    the slice of the group's query heads."""
    tl.static_assert(BLOCK_M1 >= 16 and BLOCK_N1 >= 16, "tl.dot needs tiles of at least 16")
    tl.static_assert(BLOCK_D + BLOCK_D1 >= HEAD_DIM, "BLOCK_D (+ BLOCK_D1) must cover HEAD_DIM")
    tl.static_assert(BLOCK_D1 == 0 or (BLOCK_D < HEAD_DIM and BLOCK_D1 >= 16),
                     "a second tile of >= 16 dims past a first one of real dims")
    tl.static_assert(not (USE_TMA and VARLEN), "VARLEN reads no tensor descriptors")
    start_n = tile_n * BLOCK_N1
    off_bh = part // KV_SPLITS
    off_s = part % KV_SPLITS
    off_b = off_bh // H_KV
    off_hkv = off_bh % H_KV
    # this sequence's queries and keys: N_Q/N_K themselves unless VARLEN
    q_start = 0
    k_start = 0
    seq_q = N_Q
    seq_k = N_K
    if VARLEN:
        q_start, seq_q = _seq(CuSeqQ, off_b)
        k_start, seq_k = _seq(CuSeqK, off_b)
        if start_n >= seq_k:
            return
    offs_n = start_n + tl.arange(0, BLOCK_N1)
    offs_m0 = tl.arange(0, BLOCK_M1)
    offs_d = tl.arange(0, BLOCK_D)
    k = _load_rows(_head(K, off_b, off_hkv, k_start, stride_kb, stride_kh, stride_kn, VARLEN),
                   offs_n, offs_d, stride_kn, seq_k, HEAD_DIM, BLOCK_D, True)
    v = _load_rows(_head(V, off_b, off_hkv, k_start, stride_vb, stride_vh, stride_vn, VARLEN),
                   offs_n, offs_d, stride_vn, seq_k, HEAD_DIM, BLOCK_D, True)
    dk = tl.zeros([BLOCK_N1, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N1, BLOCK_D], dtype=tl.float32)
    # the head dim's second tile (dims BLOCK_D + offs_e); without one, dk1 and dv1 are
    # placeholders the loops carry and the compiler drops
    offs_e = None
    k1 = None
    v1 = None
    dk1 = tl.zeros([1], dtype=tl.float32)
    dv1 = tl.zeros([1], dtype=tl.float32)
    if BLOCK_D1 > 0:
        offs_e = tl.arange(0, BLOCK_D1)
        k1 = _load_rows(_head(K, off_b, off_hkv, k_start, stride_kb, stride_kh, stride_kn,
                              VARLEN) + BLOCK_D,
                        offs_n, offs_e, stride_kn, seq_k, HEAD_DIM - BLOCK_D, BLOCK_D1, True)
        v1 = _load_rows(_head(V, off_b, off_hkv, k_start, stride_vb, stride_vh, stride_vn,
                              VARLEN) + BLOCK_D,
                        offs_n, offs_e, stride_vn, seq_k, HEAD_DIM - BLOCK_D, BLOCK_D1, True)
        dk1 = tl.zeros([BLOCK_N1, BLOCK_D1], dtype=tl.float32)
        dv1 = tl.zeros([BLOCK_N1, BLOCK_D1], dtype=tl.float32)
    qk_scale = sm_scale * LOG2E
    if HAS_SOFTCAP:
        cap_scale = sm_scale / SOFTCAP
        cap2 = SOFTCAP * LOG2E
    else:
        cap_scale = qk_scale
        cap2 = qk_scale
    seed = None
    drop_r = None
    if HAS_DROPOUT:  # the forward's seed; 1 / keep, keep = DROPOUT_T / 256
        seed = tl.load(Seed)
        drop_r = 256.0 / DROPOUT_T

    # Query ranges, the same for every head of the group: [m_lo, m_mid) the causal band or
    # the window's right edge (masked), [m_mid, m_full) every entry visible, [m_full, m_hi)
    # the window's left edge and the ragged end (masked).
    causal_offset = seq_k - seq_q
    m_full = seq_q // BLOCK_M1 * BLOCK_M1
    m_hi = seq_q
    win_left = 0
    win_right = 0
    if HAS_WINDOW:
        # query i, at pos = i + causal_offset, sees some of the tile's keys [start_n,
        # last_key] (the last one that exists) iff pos - left <= last_key and
        # pos + right >= start_n, all of them iff pos - left <= start_n and
        # pos + right >= last_key
        win_left, win_right = _window(WINDOW_LEFT, WINDOW_RIGHT, seq_q, seq_k, IS_CAUSAL)
        last_key = tl.minimum(start_n + BLOCK_N1, seq_k) - 1
        m_lo = tl.maximum(start_n - win_right - causal_offset, 0) // BLOCK_M1 * BLOCK_M1
        m_hi = tl.maximum(tl.minimum(last_key + win_left - causal_offset + 1, seq_q), m_lo)
        m_mid = tl.cdiv(tl.maximum(last_key - win_right - causal_offset, 0), BLOCK_M1) * BLOCK_M1
        m_mid = tl.minimum(tl.maximum(m_mid, m_lo), m_hi)
        m_full = tl.maximum(tl.minimum(start_n + win_left - causal_offset + 1, seq_q), 0)
        m_full = tl.minimum(tl.maximum(m_full // BLOCK_M1 * BLOCK_M1, m_mid), m_hi)
    elif IS_CAUSAL:
        # the first query that sees key start_n, and the first whose block sees every key
        # of the tile (the last one that exists)
        last_key = tl.minimum(start_n + BLOCK_N1, seq_k) - 1
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
        q_base = _head(Q, off_b, off_h, q_start, stride_qb, stride_qh, stride_qm, VARLEN)
        do_base = _head(DO, off_b, off_h, q_start, stride_dob, stride_doh, stride_dom, VARLEN)
        if VARLEN:  # LSE and delta (Hq, total_q)
            row_base = off_h.to(tl.int64) * N_Q + q_start
        else:
            row_base = (off_b * H_Q + off_h).to(tl.int64) * N_Q
        lse_base = Lse + row_base
        delta_base = Delta + row_base
        if HAS_ALIBI:
            slope2 = tl.load(Alibi + off_b * stride_ab + off_h) * LOG2E
        else:
            slope2 = qk_scale
        drop_head = off_b * H_Q + off_h  # dropout's head index, as in the forward
        bits_base = None
        if DROPOUT_BITS:  # this head's bit array
            bits_base = Bits + drop_head.to(tl.int64) * bits_stride_h
        if SPLIT_LOOPS:
            if IS_CAUSAL or HAS_WINDOW:
                dk, dv, dk1, dv1 = _dkdv_inner(
                    dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qm, stride_dom,
                    offs_n, offs_m0, offs_d, m_lo, m_mid, seq_q, causal_offset, qk_scale, desc_q,
                    desc_do, off_b, off_h, win_left, win_right, cap_scale, cap2, slope2, seed,
                    drop_head, start_n, DROPOUT_T, drop_r, bits_base, bits_nkb, dk1, dv1, k1, v1,
                    desc_q1, desc_do1, HEAD_DIM, BLOCK_D, BLOCK_M1, True, IS_CAUSAL, UPCAST_DOT,
                    USE_TMA, HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, DROPOUT_BITS,
                    BLOCK_D1)
            dk, dv, dk1, dv1 = _dkdv_inner(
                dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qm, stride_dom,
                offs_n, offs_m0, offs_d, m_mid, m_full, seq_q, causal_offset, qk_scale, desc_q,
                desc_do, off_b, off_h, win_left, win_right, cap_scale, cap2, slope2, seed,
                drop_head, start_n, DROPOUT_T, drop_r, bits_base, bits_nkb, dk1, dv1, k1, v1,
                desc_q1, desc_do1, HEAD_DIM, BLOCK_D, BLOCK_M1, False, IS_CAUSAL, UPCAST_DOT,
                USE_TMA, HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, DROPOUT_BITS,
                BLOCK_D1)
            dk, dv, dk1, dv1 = _dkdv_inner(
                dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qm, stride_dom,
                offs_n, offs_m0, offs_d, m_full, m_hi, seq_q, causal_offset, qk_scale, desc_q,
                desc_do, off_b, off_h, win_left, win_right, cap_scale, cap2, slope2, seed,
                drop_head, start_n, DROPOUT_T, drop_r, bits_base, bits_nkb, dk1, dv1, k1, v1,
                desc_q1, desc_do1, HEAD_DIM, BLOCK_D, BLOCK_M1, True, IS_CAUSAL, UPCAST_DOT,
                USE_TMA, HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, DROPOUT_BITS,
                BLOCK_D1)
        else:  # one loop over every block with a visible entry, each one masked
            dk, dv, dk1, dv1 = _dkdv_inner(
                dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qm, stride_dom,
                offs_n, offs_m0, offs_d, m_lo, m_hi, seq_q, causal_offset, qk_scale, desc_q,
                desc_do, off_b, off_h, win_left, win_right, cap_scale, cap2, slope2, seed,
                drop_head, start_n, DROPOUT_T, drop_r, bits_base, bits_nkb, dk1, dv1, k1, v1,
                desc_q1, desc_do1, HEAD_DIM, BLOCK_D, BLOCK_M1, True, IS_CAUSAL, UPCAST_DOT,
                USE_TMA, HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, DROPOUT_BITS,
                BLOCK_D1)
    dk *= sm_scale
    kv_mask = (offs_n < seq_k)[:, None] & (offs_d < HEAD_DIM)[None, :]
    kv_mask1 = None
    if BLOCK_D1 > 0:
        dk1 *= sm_scale
        kv_mask1 = (offs_n < seq_k)[:, None] & (offs_e < HEAD_DIM - BLOCK_D)[None, :]
    if KV_SPLITS > 1:  # fp32 partial sums, added up in order by attn_bwd_kv_reduce
        if VARLEN:  # (Hkv * KV_SPLITS, total_k, D)
            rows = (off_hkv * KV_SPLITS + off_s).to(tl.int64) * N_K + k_start + offs_n
        else:
            rows = part.to(tl.int64) * N_K + offs_n
        p_off = rows[:, None] * HEAD_DIM + offs_d[None, :]
        tl.store(PartK + p_off, dk, mask=kv_mask)
        tl.store(PartV + p_off, dv, mask=kv_mask)
        if BLOCK_D1 > 0:
            # offs_e is None without a second tile (this branch is then compiled out)
            p_off1 = rows[:, None] * HEAD_DIM + BLOCK_D + offs_e[None, :]  # type: ignore[index]
            tl.store(PartK + p_off1, dk1, mask=kv_mask1)
            tl.store(PartV + p_off1, dv1, mask=kv_mask1)
    else:
        _store_dkdv(DK, DV, dk, dv, off_b, off_hkv, k_start, offs_n, offs_d, kv_mask,
                    stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
                    VARLEN)
        if BLOCK_D1 > 0:
            _store_dkdv(DK + BLOCK_D, DV + BLOCK_D, dk1, dv1, off_b, off_hkv, k_start, offs_n,
                        offs_e, kv_mask1, stride_dkb, stride_dkh, stride_dkn, stride_dvb,
                        stride_dvh, stride_dvn, VARLEN)


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
    _store_dkdv(DK, DV, dk, dv, off_b, off_hkv, 0, offs_n, offs_d, mask,
                stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn, False)


@triton.jit
def _dq_inner(dq, q, do, lse2, delta, k_base, v_base, stride_kn, stride_vn,
              offs_m, offs_n0, offs_d, lo, hi, N_K, CAUSAL_OFFSET, qk_scale,
              desc_k, desc_v, off_b, off_hkv, win_left, win_right, cap_scale, cap2, slope2,
              seed, drop_head, drop_row, drop_t, drop_r, bits_base, bits_nkb,
              dq1, q1, do1, desc_k1, desc_v1,
              HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N2: tl.constexpr,
              MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, UPCAST_DOT: tl.constexpr,
              USE_TMA: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
              HAS_ALIBI: tl.constexpr, HAS_DROPOUT: tl.constexpr,
              DROPOUT_BITS: tl.constexpr, BLOCK_D1: tl.constexpr):
    """Key blocks ``[lo, hi)`` against the program's queries (``lse2``: LSE in log2 units;
    the modifications' scalars as in :func:`_dkdv_inner`). BLOCK_D1 > 0: ``q1``, ``do1``,
    ``dq1`` the head dim's second tiles (placeholders otherwise), K's and V's read here."""
    for start_n in range(lo, hi, BLOCK_N2):
        offs_n = start_n + offs_n0
        k = _load_tile(desc_k, k_base, off_b, off_hkv, start_n, offs_n, offs_d, stride_kn, N_K,
                       HEAD_DIM, BLOCK_D, BLOCK_N2, MASKED, USE_TMA, 0)
        v = _load_tile(desc_v, v_base, off_b, off_hkv, start_n, offs_n, offs_d, stride_vn, N_K,
                       HEAD_DIM, BLOCK_D, BLOCK_N2, MASKED, USE_TMA, 0)
        k1 = None
        v1 = None
        if BLOCK_D1 > 0:
            offs_e = tl.arange(0, BLOCK_D1)
            k1 = _load_tile(desc_k1, k_base, off_b, off_hkv, start_n, offs_n, offs_e,
                            stride_kn, N_K, HEAD_DIM, BLOCK_D1, BLOCK_N2, MASKED, USE_TMA,
                            BLOCK_D)
            v1 = _load_tile(desc_v1, v_base, off_b, off_hkv, start_n, offs_n, offs_e,
                            stride_vn, N_K, HEAD_DIM, BLOCK_D1, BLOCK_N2, MASKED, USE_TMA,
                            BLOCK_D)
        qk = _dot(q, tl.trans(k), UPCAST_DOT)  # (BLOCK_M2, BLOCK_N2)
        if BLOCK_D1 > 0:
            qk += _dot(q1, tl.trans(k1), UPCAST_DOT)
        if HAS_SOFTCAP or HAS_ALIBI:
            if HAS_SOFTCAP:
                t = tanh(qk * cap_scale)
                s = t * cap2
            else:
                s = qk * qk_scale
            if HAS_ALIBI:
                dist = tl.abs(offs_m[:, None] + CAUSAL_OFFSET - offs_n[None, :])
                s -= slope2 * dist.to(tl.float32)
            p = tl.math.exp2(s - lse2[:, None])
        else:
            p = tl.math.exp2(qk * qk_scale - lse2[:, None])
        if MASKED:
            keep = (offs_n < N_K)[None, :]
            if HAS_WINDOW:
                pos = offs_m[:, None] + CAUSAL_OFFSET
                keep = keep & (offs_n[None, :] >= pos - win_left) \
                    & (offs_n[None, :] <= pos + win_right)
            elif IS_CAUSAL:
                keep = keep & (offs_n[None, :] <= offs_m[:, None] + CAUSAL_OFFSET)
            p = tl.where(keep, p, 0.0)  # also drops the inf of rows with LSE = -inf
        dp = _dot(do, tl.trans(v), UPCAST_DOT)
        if BLOCK_D1 > 0:
            dp += _dot(do1, tl.trans(v1), UPCAST_DOT)
        if HAS_DROPOUT:  # dP Z r (Z regenerated), as in _dkdv_inner
            if DROPOUT_BITS:  # the dK/dV kernel's bits of the same mask
                z = tl.where(_load_bits(bits_base, bits_nkb, drop_row, start_n,
                                        offs_m.shape[0], BLOCK_N2), drop_r, 0.0)
            else:
                z = tl.where(dropout_keep(seed, drop_head, drop_row, start_n, drop_t,
                                          offs_m.shape[0], BLOCK_N2), drop_r, 0.0)
            ds = p * (dp * z - delta[:, None])
        else:
            ds = p * (dp - delta[:, None])
        if HAS_SOFTCAP:  # d(capped score) / d(scaled score)
            ds = ds * (1.0 - t * t)
        dq += _dot(ds.to(k.dtype), k, UPCAST_DOT)
        if BLOCK_D1 > 0:
            dq1 += _dot(ds.to(k.dtype), k1, UPCAST_DOT)
    return dq, dq1


@triton.jit
def attn_bwd_dq(Q, K, V, DO, Lse, Delta, DQ, desc_k, desc_v,
                stride_qb, stride_qh, stride_qm,
                stride_kb, stride_kh, stride_kn,
                stride_vb, stride_vh, stride_vn,
                stride_dob, stride_doh, stride_dom,
                stride_dqb, stride_dqh, stride_dqm,
                H_Q, GROUP, N_Q, N_K, sm_scale,
                Alibi, CuSeqQ, CuSeqK, stride_ab, WINDOW_LEFT, WINDOW_RIGHT, SOFTCAP,
                Seed, DROPOUT_T, Bits, bits_stride_h, bits_nkb,
                # the head dim's second tile's descriptors (None unless USE_TMA with
                # BLOCK_D1 > 0), after every other runtime argument
                desc_k1, desc_v1,
                HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                BLOCK_M2: tl.constexpr, BLOCK_N2: tl.constexpr,
                IS_CAUSAL: tl.constexpr, UPCAST_DOT: tl.constexpr, SPLIT_LOOPS: tl.constexpr,
                USE_TMA: tl.constexpr, REVERSE_DQ: tl.constexpr,
                HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
                VARLEN: tl.constexpr, HAS_DROPOUT: tl.constexpr,
                DROPOUT_BITS: tl.constexpr, BLOCK_D1: tl.constexpr = 0):
    tile_m = tl.program_id(0)
    if REVERSE_DQ:
        tile_m = tl.num_programs(0) - 1 - tile_m
    _dq_program(tile_m, tl.program_id(1), Q, K, V, DO, Lse, Delta, DQ, desc_k, desc_v,
                stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
                stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_dom,
                stride_dqb, stride_dqh, stride_dqm, H_Q, GROUP, N_Q, N_K, sm_scale,
                Alibi, CuSeqQ, CuSeqK, stride_ab, WINDOW_LEFT, WINDOW_RIGHT, SOFTCAP,
                Seed, DROPOUT_T, Bits, bits_stride_h, bits_nkb, desc_k1, desc_v1,
                HEAD_DIM, BLOCK_D, BLOCK_M2, BLOCK_N2, IS_CAUSAL, UPCAST_DOT, SPLIT_LOOPS,
                USE_TMA, HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, VARLEN, HAS_DROPOUT, DROPOUT_BITS,
                BLOCK_D1)


@triton.jit
def _dq_program(tile_m, off_bh, Q, K, V, DO, Lse, Delta, DQ, desc_k, desc_v,
                stride_qb, stride_qh, stride_qm,
                stride_kb, stride_kh, stride_kn,
                stride_vb, stride_vh, stride_vn,
                stride_dob, stride_doh, stride_dom,
                stride_dqb, stride_dqh, stride_dqm,
                H_Q, GROUP, N_Q, N_K, sm_scale,
                Alibi, CuSeqQ, CuSeqK, stride_ab, WINDOW_LEFT, WINDOW_RIGHT, SOFTCAP,
                Seed, DROPOUT_T, Bits, bits_stride_h, bits_nkb, desc_k1, desc_v1,
                HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                BLOCK_M2: tl.constexpr, BLOCK_N2: tl.constexpr,
                IS_CAUSAL: tl.constexpr, UPCAST_DOT: tl.constexpr, SPLIT_LOOPS: tl.constexpr,
                USE_TMA: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                HAS_ALIBI: tl.constexpr, VARLEN: tl.constexpr, HAS_DROPOUT: tl.constexpr,
                DROPOUT_BITS: tl.constexpr, BLOCK_D1: tl.constexpr):
    """One dQ program: query tile ``tile_m`` of query head ``off_bh`` = ``b * H_Q + h``."""
    tl.static_assert(BLOCK_M2 >= 16 and BLOCK_N2 >= 16, "tl.dot needs tiles of at least 16")
    tl.static_assert(BLOCK_D + BLOCK_D1 >= HEAD_DIM, "BLOCK_D (+ BLOCK_D1) must cover HEAD_DIM")
    tl.static_assert(BLOCK_D1 == 0 or (BLOCK_D < HEAD_DIM and BLOCK_D1 >= 16),
                     "a second tile of >= 16 dims past a first one of real dims")
    tl.static_assert(not (USE_TMA and VARLEN), "VARLEN reads no tensor descriptors")
    start_m = tile_m * BLOCK_M2
    off_b = off_bh // H_Q
    off_h = off_bh % H_Q
    off_hkv = off_h // GROUP
    q_start = 0
    k_start = 0
    seq_q = N_Q
    seq_k = N_K
    if VARLEN:  # this sequence's queries and keys
        q_start, seq_q = _seq(CuSeqQ, off_b)
        k_start, seq_k = _seq(CuSeqK, off_b)
        if start_m >= seq_q:
            return
    offs_m = start_m + tl.arange(0, BLOCK_M2)
    offs_n0 = tl.arange(0, BLOCK_N2)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < seq_q
    q = _load_rows(_head(Q, off_b, off_h, q_start, stride_qb, stride_qh, stride_qm, VARLEN),
                   offs_m, offs_d, stride_qm, seq_q, HEAD_DIM, BLOCK_D, True)
    do = _load_rows(_head(DO, off_b, off_h, q_start, stride_dob, stride_doh, stride_dom, VARLEN),
                    offs_m, offs_d, stride_dom, seq_q, HEAD_DIM, BLOCK_D, True)
    if VARLEN:  # LSE and delta (Hq, total_q)
        row_base = off_h.to(tl.int64) * N_Q + q_start
    else:
        row_base = off_bh.to(tl.int64) * N_Q
    lse2 = tl.load(Lse + row_base + offs_m, mask=m_ok, other=0.0) * LOG2E
    delta = tl.load(Delta + row_base + offs_m, mask=m_ok, other=0.0)
    k_base = _head(K, off_b, off_hkv, k_start, stride_kb, stride_kh, stride_kn, VARLEN)
    v_base = _head(V, off_b, off_hkv, k_start, stride_vb, stride_vh, stride_vn, VARLEN)
    dq = tl.zeros([BLOCK_M2, BLOCK_D], dtype=tl.float32)
    # the head dim's second tile (dims BLOCK_D + offs_e); without one, dq1 is a placeholder
    # the loops carry and the compiler drops
    offs_e = None
    q1 = None
    do1 = None
    dq1 = tl.zeros([1], dtype=tl.float32)
    if BLOCK_D1 > 0:
        offs_e = tl.arange(0, BLOCK_D1)
        q1 = _load_rows(_head(Q, off_b, off_h, q_start, stride_qb, stride_qh, stride_qm,
                              VARLEN) + BLOCK_D,
                        offs_m, offs_e, stride_qm, seq_q, HEAD_DIM - BLOCK_D, BLOCK_D1, True)
        do1 = _load_rows(_head(DO, off_b, off_h, q_start, stride_dob, stride_doh, stride_dom,
                               VARLEN) + BLOCK_D,
                         offs_m, offs_e, stride_dom, seq_q, HEAD_DIM - BLOCK_D, BLOCK_D1, True)
        dq1 = tl.zeros([BLOCK_M2, BLOCK_D1], dtype=tl.float32)
    qk_scale = sm_scale * LOG2E
    if HAS_SOFTCAP:
        cap_scale = sm_scale / SOFTCAP
        cap2 = SOFTCAP * LOG2E
    else:
        cap_scale = qk_scale
        cap2 = qk_scale
    if HAS_ALIBI:
        slope2 = tl.load(Alibi + off_b * stride_ab + off_h) * LOG2E
    else:
        slope2 = qk_scale
    seed = None
    drop_r = None
    if HAS_DROPOUT:  # the forward's seed; 1 / keep, keep = DROPOUT_T / 256
        seed = tl.load(Seed)
        drop_r = 256.0 / DROPOUT_T
    bits_base = None
    if DROPOUT_BITS:  # this head's bit array, written by the dK/dV kernel
        bits_base = Bits + off_bh.to(tl.int64) * bits_stride_h

    # Key ranges: [n_lo, n_mid) the left band (masked, windows only), [n_mid, n_full) seen
    # in full by every row of the tile, [n_full, n_hi) the causal (right) band and the
    # ragged end (masked); keys outside [n_lo, n_hi) are seen by no row.
    causal_offset = seq_k - seq_q
    n_lo = 0
    n_mid = 0
    n_full = seq_k // BLOCK_N2 * BLOCK_N2
    win_left = 0
    win_right = 0
    if HAS_WINDOW:
        # row m, at pos(m) = m + causal_offset, sees keys [pos - left, pos + right]; the
        # tile's rows m0..m1 (unclamped) together [pos(m0) - left, pos(m1) + right], every
        # one of them [pos(m1) - left, pos(m0) + right]
        win_left, win_right = _window(WINDOW_LEFT, WINDOW_RIGHT, seq_q, seq_k, IS_CAUSAL)
        pos_first = start_m + causal_offset
        pos_last = pos_first + BLOCK_M2 - 1
        n_lo = tl.maximum(pos_first - win_left, 0) // BLOCK_N2 * BLOCK_N2
        n_hi = tl.maximum(tl.minimum(pos_last + win_right + 1, seq_k), n_lo)
        n_mid = tl.cdiv(tl.maximum(pos_last - win_left, 0), BLOCK_N2) * BLOCK_N2
        n_mid = tl.minimum(tl.maximum(n_mid, n_lo), n_hi)
        n_full = tl.maximum(tl.minimum(pos_first + win_right + 1, seq_k), 0)
        n_full = tl.minimum(tl.maximum(n_full // BLOCK_N2 * BLOCK_N2, n_mid), n_hi)
    elif IS_CAUSAL:
        first_row_sees = tl.maximum(start_m + causal_offset + 1, 0)  # keys [0, this)
        n_full = tl.minimum(n_full, first_row_sees // BLOCK_N2 * BLOCK_N2)
        n_hi = tl.minimum(seq_k, tl.maximum(start_m + BLOCK_M2 + causal_offset, 0))
        n_hi = tl.maximum(n_hi, n_full)
    else:
        n_hi = seq_k
    if SPLIT_LOOPS:
        if HAS_WINDOW:
            dq, dq1 = _dq_inner(dq, q, do, lse2, delta, k_base, v_base, stride_kn, stride_vn,
                           offs_m, offs_n0, offs_d, n_lo, n_mid, seq_k, causal_offset,
                           qk_scale, desc_k, desc_v, off_b, off_hkv, win_left, win_right,
                           cap_scale, cap2, slope2, seed, off_bh, start_m, DROPOUT_T, drop_r,
                           bits_base, bits_nkb, dq1, q1, do1, desc_k1, desc_v1,
                           HEAD_DIM, BLOCK_D, BLOCK_N2, True, IS_CAUSAL, UPCAST_DOT, USE_TMA,
                           HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, DROPOUT_BITS,
                           BLOCK_D1)
        dq, dq1 = _dq_inner(dq, q, do, lse2, delta, k_base, v_base, stride_kn, stride_vn, offs_m,
                       offs_n0, offs_d, n_mid, n_full, seq_k, causal_offset, qk_scale,
                       desc_k, desc_v, off_b, off_hkv, win_left, win_right,
                       cap_scale, cap2, slope2, seed, off_bh, start_m, DROPOUT_T, drop_r,
                       bits_base, bits_nkb, dq1, q1, do1, desc_k1, desc_v1,
                       HEAD_DIM, BLOCK_D, BLOCK_N2, False, IS_CAUSAL, UPCAST_DOT, USE_TMA,
                       HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, DROPOUT_BITS,
                       BLOCK_D1)
        dq, dq1 = _dq_inner(dq, q, do, lse2, delta, k_base, v_base, stride_kn, stride_vn, offs_m,
                       offs_n0, offs_d, n_full, n_hi, seq_k, causal_offset, qk_scale,
                       desc_k, desc_v, off_b, off_hkv, win_left, win_right,
                       cap_scale, cap2, slope2, seed, off_bh, start_m, DROPOUT_T, drop_r,
                       bits_base, bits_nkb, dq1, q1, do1, desc_k1, desc_v1,
                       HEAD_DIM, BLOCK_D, BLOCK_N2, True, IS_CAUSAL, UPCAST_DOT, USE_TMA,
                       HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, DROPOUT_BITS,
                       BLOCK_D1)
    else:  # one loop over every block with a visible entry, each one masked
        dq, dq1 = _dq_inner(dq, q, do, lse2, delta, k_base, v_base, stride_kn, stride_vn, offs_m,
                       offs_n0, offs_d, n_lo, n_hi, seq_k, causal_offset, qk_scale,
                       desc_k, desc_v, off_b, off_hkv, win_left, win_right,
                       cap_scale, cap2, slope2, seed, off_bh, start_m, DROPOUT_T, drop_r,
                       bits_base, bits_nkb, dq1, q1, do1, desc_k1, desc_v1,
                       HEAD_DIM, BLOCK_D, BLOCK_N2, True, IS_CAUSAL, UPCAST_DOT, USE_TMA,
                       HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, DROPOUT_BITS,
                       BLOCK_D1)
    dq *= sm_scale
    tl.store(_head(DQ, off_b, off_h, q_start, stride_dqb, stride_dqh, stride_dqm, VARLEN)
             + offs_m[:, None].to(tl.int64) * stride_dqm + offs_d[None, :],
             dq.to(DQ.dtype.element_ty), mask=m_ok[:, None] & (offs_d < HEAD_DIM)[None, :])
    if BLOCK_D1 > 0:
        dq1 *= sm_scale
        tl.store(_head(DQ, off_b, off_h, q_start, stride_dqb, stride_dqh, stride_dqm, VARLEN)
                 + BLOCK_D + offs_m[:, None].to(tl.int64) * stride_dqm
                 + offs_e[None, :],  # type: ignore[index]
                 dq1.to(DQ.dtype.element_ty),
                 mask=m_ok[:, None] & (offs_e < HEAD_DIM - BLOCK_D)[None, :])


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
                   Alibi, CuSeqQ, CuSeqK, stride_ab, WINDOW_LEFT, WINDOW_RIGHT, SOFTCAP,
                   Seed, DROPOUT_T,
                   # the head dim's second tile's descriptors (None unless USE_TMA with
                   # BLOCK_D1 > 0), after every other runtime argument
                   desc_q1, desc_do1, desc_k1, desc_v1,
                   HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_M1: tl.constexpr, BLOCK_N1: tl.constexpr,
                   BLOCK_M2: tl.constexpr, BLOCK_N2: tl.constexpr,
                   IS_CAUSAL: tl.constexpr, UPCAST_DOT: tl.constexpr, SPLIT_LOOPS: tl.constexpr,
                   KV_SPLITS: tl.constexpr, USE_TMA: tl.constexpr, REVERSE_DQ: tl.constexpr,
                   HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
                   VARLEN: tl.constexpr, HAS_DROPOUT: tl.constexpr, BLOCK_D1: tl.constexpr = 0):
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
                      H_Q, H_KV, GROUP, N_Q, N_K, sm_scale, Alibi, CuSeqQ, CuSeqK, stride_ab,
                      WINDOW_LEFT, WINDOW_RIGHT, SOFTCAP,
                      Seed, DROPOUT_T, None, None, None, desc_q1, desc_do1, HEAD_DIM, BLOCK_D,
                      BLOCK_M1, BLOCK_N1, IS_CAUSAL, UPCAST_DOT, SPLIT_LOOPS, KV_SPLITS, USE_TMA,
                      HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, VARLEN, HAS_DROPOUT, False, BLOCK_D1)
    else:
        pid -= N1_PROGRAMS
        tile_m = pid % N2_TILES
        if REVERSE_DQ:
            tile_m = N2_TILES - 1 - tile_m
        _dq_program(tile_m, pid // N2_TILES, Q, K, V, DO, Lse, Delta, DQ, desc_k, desc_v,
                    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
                    stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_dom,
                    stride_dqb, stride_dqh, stride_dqm, H_Q, GROUP, N_Q, N_K, sm_scale,
                    Alibi, CuSeqQ, CuSeqK, stride_ab, WINDOW_LEFT, WINDOW_RIGHT, SOFTCAP,
                    Seed, DROPOUT_T, None, None, None, desc_k1, desc_v1,
                    HEAD_DIM, BLOCK_D, BLOCK_M2, BLOCK_N2, IS_CAUSAL, UPCAST_DOT, SPLIT_LOOPS,
                    USE_TMA, HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, VARLEN, HAS_DROPOUT, False,
                    BLOCK_D1)
