"""Split-KV flash-decoding: short queries (Nq <= 16) against a long, ragged or paged KV cache.

Two kernels.

``attn_decode_split_kernel``, grid ``(NUM_SPLITS, B * Hkv, row_blocks)`` (more rows with
``NEW_ROWS``, see ``HAS_NEW``): one program owns
one KV head of one sequence and one chunk of that sequence's keys. Its tile rows are every
query head of the KV head's GQA group times every query: row ``r`` is query ``r % N_Q`` of
query head ``h_kv * GROUP + r // N_Q`` (``GROUP * N_Q`` rows padded to ``BLOCK_M >= 16``
for ``tl.dot``; ``row_blocks`` is 1 unless that exceeds ``BLOCK_M``), so each K/V tile is
read once for the whole group. The sequence's length ``L`` (``Seqlens[b]``, or ``N_K`` for a
dense K/V) is cut into ``NUM_SPLITS`` chunks of whole ``BLOCK_N`` blocks; a chunk past the
end is empty. Each program runs the online softmax over its chunk in two phases (blocks
every row sees in full, without masks; then the ragged end and the causal band), and
stores either a partial output (normalised by its own row sum, fp32) and partial LSE, or,
with ``NUM_SPLITS == 1``, the final output and LSE directly.

``attn_decode_combine_kernel``, grid ``(B * Hq * N_Q,)``: merges one row's partials:
``out = sum_s exp(lse_s - lse) o_s`` with ``lse = logsumexp_s lse_s``. Rows whose splits all
saw no key give ``out = 0`` and ``lse = -inf``, never NaN.

Causal masking is bottom-right aligned against each sequence's own length: query ``i`` sits
at key position ``pos_i = i + L - N_Q`` and sees keys ``j <= pos_i``.

Score modifications, FlashAttention-2's (as in attn_fwd's kernel; each behind a constexpr
flag, its pointer None and its scalars last, so a plain call compiles to the kernel without
them):

* ``HAS_WINDOW``: keys ``pos_i - WINDOW_LEFT <= j <= pos_i + WINDOW_RIGHT`` (-1: unbounded;
  causal is the right bound 0). The key range cut into splits starts at the block of the
  window's first key, ``max(L - N_Q - left, 0)`` (the last query sees up to the end), so a
  sliding window costs O(window), not O(L); each split walks a masked left band (the
  window's lower edge), the blocks every row sees unmasked, then a masked right band.
* ``HAS_SOFTCAP``: ``s = SOFTCAP * tanh(scale * q.k / SOFTCAP)``.
* ``HAS_ALIBI``: ``s -= slope[b, h] * |pos_i - j|`` (``Alibi`` fp32 ``(Hq,)`` with
  ``stride_ab`` 0, or ``(B, Hq)``), after the mask.

A split none of whose keys a row sees stores LSE ``-inf`` for it, which the combine weighs
0, as it does an empty split.

Paged caches (``PAGED``): K/V are ``(num_pages, Hkv, page_size, D)`` and key ``j`` of
sequence ``b`` lives at page ``BlockTable[b, j // page_size]``, slot ``j % page_size``. With
``PAGE_ALIGNED`` (``page_size % BLOCK_N == 0``: a tile never straddles pages) one page id is
read per tile; otherwise one per key row (any page size works, as in vLLM's Triton kernels).

FlashAttention-2's ``flash_attn_with_kvcache`` options, each behind a constexpr flag (its
pointers None when off, so a call without them compiles without them):

* ``HAS_NEW``: new keys/values ``KNew``/``VNew`` ``(B, Hkv, N_NEW, D)`` are appended at
  ``Seqlens[b]``: sequence ``b`` attends to ``L = Seqlens[b] + N_NEW`` keys. The splits cut
  only the cached keys ``[0, Seqlens[b])``, walked exactly as without new keys. The new keys
  are walked by one program per ``(b, h_kv)``: with ``NEW_ROWS`` (``NUM_SPLITS`` > 1) a
  program of its own, in grid rows after the ``B * Hkv`` of the splits (``NUM_SPLITS`` of
  them to a row, so they are launched last and the splits get the SMs first; split index
  ``NUM_SPLITS``, its partial the last one the combine merges); otherwise the last split,
  after its cached keys. That program reads them from ``KNew``/``VNew`` 16 rows at a time,
  rotates them once (in the cache's dtype), writes them into the cache (row block 0 only)
  and attends to the same values, so no program reads a slot another writes and the
  attended keys are the written ones bit for bit. (A rotary of the new keys inside the
  cache walk, as a ``(D, BLOCK_N)`` tile, took 255 registers, spills and 132 KB of shared
  memory on sm_90; a program of their own beside each head's splits put two splits on some
  SMs.)
* ``ROT_DIM`` > 0: rotary embedding of the first ``ROT_DIM`` dims of the new keys (key ``j``
  at position ``j``) and of q (query ``i`` at ``Seqlens[b] + i`` with ``ROT_Q_PER_POS``, at
  ``Seqlens[b]`` otherwise), GPT-J pairs ``(2t, 2t+1)`` with ``ROT_INTERLEAVED``, GPT-NeoX
  halves ``(t, t + ROT_DIM/2)`` otherwise; ``Cos``/``Sin`` ``(SEQLEN_RO, ROT_DIM / 2)``
  contiguous; computed in fp32 and rounded to the input dtype, as FlashAttention-2 does.
* ``HAS_BATCH_IDX``: sequence ``b`` uses cache row ``BatchIdx[b]`` (contiguous caches).
* ``HAS_LEFTPAD``: sequence ``b``'s keys start at ``LeftPad[b]``: keys before it are neither
  read nor attended (the walk starts at its block, as at a window's first key).

Bounds: whatever the values of ``Seqlens``, ``BlockTable``, ``BatchIdx`` and ``LeftPad``, no
program reads or writes outside its tensors. Lengths are clamped to ``[0, N_K]`` (``N_K`` the
capacity: the cache's max_seqlen, or max_pages x page_size), appended keys included (new keys
past the capacity are neither written nor attended); used page ids are clamped into ``[0,
NUM_PAGES)`` for reads, and a key is written only when its page id is in range; a cache row
``BatchIdx[b]`` outside ``[0, CACHE_BATCH)`` makes sequence ``b`` empty (zeros, nothing
written); ``LeftPad[b]`` is clamped to ``[0, L]``; cos/sin rows past ``SEQLEN_RO`` are not read
(no rotation there). Bad values give wrong rows, never an out-of-bounds access; the runtime
checks them on request (a device sync).
"""

import triton
import triton.language as tl

from flashtune.kernel_templates.score_mods import modified_scores


@triton.jit
def _rotary_dims(offs_d, ROT_DIM: tl.constexpr, ROT_INTERLEAVED: tl.constexpr):
    """Per dim ``d``: its rotary partner, the cos/sin column it uses, the sign of the
    partner's term and whether it rotates at all (``d < ROT_DIM``). A dim that does not
    rotate gets some partner and column in range, never read (the loads mask them). NeoX's
    partner and column are written as ``%`` of ``offs_d`` so that the compiler sees them
    contiguous and loads them in 16-byte vectors in q's own layout."""
    if ROT_INTERLEAVED:  # GPT-J: dims (2t, 2t + 1) turn by column t
        partner = offs_d ^ 1
        freq = offs_d // 2
        sign = tl.where(offs_d % 2 == 0, -1.0, 1.0)
    elif ROT_DIM > 0:  # GPT-NeoX: dims (t, t + ROT_DIM / 2) turn by column t
        partner = (offs_d + ROT_DIM // 2) % ROT_DIM
        freq = offs_d % (ROT_DIM // 2)
        sign = tl.where(offs_d % ROT_DIM < ROT_DIM // 2, -1.0, 1.0)
    else:  # no rotary: unused (and not compiled)
        partner = offs_d
        freq = offs_d
        sign = tl.where(offs_d < 0, -1.0, 1.0)
    return partner, freq, sign, offs_d < ROT_DIM


@triton.jit
def _load_rotated(ptrs, partner_ptrs, pos, ok, rot, freq, sign, Cos, Sin, seqlen_ro,
                  ROT_DIM: tl.constexpr):
    """Load ``ptrs`` where ``ok`` (0 elsewhere) and, with ``ROT_DIM`` > 0, rotate it at
    positions ``pos``: ``x cos + sign x_partner sin`` in fp32, rounded back to x's dtype (as
    FlashAttention-2). Cos/sin rows at or past ``seqlen_ro`` are not read (cos 1, sin 0).
    Every argument is already broadcast to the tile's orientation."""
    x = tl.load(ptrs, mask=ok, other=0.0)
    if ROT_DIM > 0:
        xp = tl.load(partner_ptrs, mask=ok & rot, other=0.0)
        cs_ok = ok & rot & (pos < seqlen_ro)
        cs_off = pos.to(tl.int64) * (ROT_DIM // 2) + freq
        c = tl.load(Cos + cs_off, mask=cs_ok, other=1.0).to(tl.float32)
        s = tl.load(Sin + cs_off, mask=cs_ok, other=0.0).to(tl.float32)
        x = (x.to(tl.float32) * c + sign * xp.to(tl.float32) * s).to(x.dtype)
    return x


@triton.jit
def _fold_block(acc, l_i, m_i, q, kt, v, cols, seqlen, causal_lim, qk_scale, win_l, win_r,
                cap_in, cap_out, slope, key_lo, acc1, q1, kt1, v1,
                MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, UPCAST_DOT: tl.constexpr,
                HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
                HAS_LEFTPAD: tl.constexpr, BLOCK_D1: tl.constexpr):
    """One block of keys ``cols`` (``kt`` ``(BLOCK_D, n)``, ``v`` ``(n, BLOCK_D)``) into the
    online softmax: the scores, their modifications and (``MASKED``) the mask (keys below
    ``seqlen``, from ``key_lo`` on, the causal band and the window). With ``BLOCK_D1`` > 0
    the head dim's second tile (``q1``, ``kt1``, ``v1``, ``acc1``) adds to the scores and
    takes its share of ``p @ v``; otherwise ``acc1`` passes through untouched."""
    if UPCAST_DOT:
        qk = tl.dot(q.to(tl.float32), kt.to(tl.float32))
        if BLOCK_D1 > 0:
            qk += tl.dot(q1.to(tl.float32), kt1.to(tl.float32))
    else:
        qk = tl.dot(q, kt)
        if BLOCK_D1 > 0:
            qk = tl.dot(q1, kt1, qk)
    if HAS_SOFTCAP or HAS_ALIBI:
        qk = modified_scores(qk, qk_scale, cap_in, cap_out, slope, causal_lim,
                             cols, HAS_SOFTCAP, HAS_ALIBI)
    else:
        qk = qk * qk_scale
    if MASKED:
        keep = (cols < seqlen)[None, :]
        if HAS_LEFTPAD:
            keep = keep & (cols >= key_lo)[None, :]
        if IS_CAUSAL:
            keep = keep & (cols[None, :] <= causal_lim[:, None])
        if HAS_WINDOW:  # causal_lim is each row's key position
            keep = keep & (cols[None, :] >= causal_lim[:, None] - win_l)
            if not IS_CAUSAL:
                keep = keep & (cols[None, :] <= causal_lim[:, None] + win_r)
        qk = tl.where(keep, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        # rows with no visible key so far keep m = -inf; subtract 0 to avoid inf - inf
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_sub = m_new
    p = tl.math.exp2(qk - m_sub[:, None])
    alpha = tl.math.exp2(m_i - m_sub)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    if UPCAST_DOT:
        acc += tl.dot(p, v.to(tl.float32))
        if BLOCK_D1 > 0:
            acc1 = acc1 * alpha[:, None] + tl.dot(p, v1.to(tl.float32))
    else:
        acc = tl.dot(p.to(v.dtype), v, acc)
        if BLOCK_D1 > 0:
            acc1 = tl.dot(p.to(v1.dtype), v1, acc1 * alpha[:, None])
    return acc, l_i, m_new, acc1


@triton.jit
def _decode_inner(acc, l_i, m_i, q, k_base, v_base, BlockTable, bt_row, offs_n, offs_d,
                  stride_kp, stride_kn, stride_vp, stride_vn, stride_btp,
                  lo, hi, seqlen, page_size, num_pages, causal_lim, qk_scale,
                  win_l, win_r, cap_in, cap_out, slope, key_lo, acc1, q1, offs_d1,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                  MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, PAGED: tl.constexpr,
                  PAGE_ALIGNED: tl.constexpr, UPCAST_DOT: tl.constexpr,
                  HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                  HAS_ALIBI: tl.constexpr, HAS_LEFTPAD: tl.constexpr,
                  BLOCK_D1: tl.constexpr):
    """The cache's keys ``[lo, hi)``, ``BLOCK_N`` at a time (``MASKED``: keys at or past
    ``seqlen`` neither read nor attended); with ``BLOCK_D1`` > 0 each tile is read as two,
    dims ``offs_d`` and ``offs_d1``."""
    d_ok = offs_d < HEAD_DIM
    for start_n in tl.range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        if PAGED:
            # a page id outside [0, num_pages) reads some page of the cache, never outside it
            if PAGE_ALIGNED:
                page = tl.load(BlockTable + bt_row + (start_n // page_size) * stride_btp)
                page = tl.minimum(tl.maximum(page, 0), num_pages - 1).to(tl.int64)
                slot = (start_n % page_size + offs_n).to(tl.int64)
                k_rows = page * stride_kp + slot * stride_kn
                v_rows = page * stride_vp + slot * stride_vn
            else:
                bt_ptrs = BlockTable + bt_row + (cols // page_size).to(tl.int64) * stride_btp
                if MASKED:
                    pages = tl.load(bt_ptrs, mask=cols < seqlen, other=0)
                else:
                    pages = tl.load(bt_ptrs)
                pages = tl.minimum(tl.maximum(pages, 0), num_pages - 1).to(tl.int64)
                slot = (cols % page_size).to(tl.int64)
                k_rows = pages * stride_kp + slot * stride_kn
                v_rows = pages * stride_vp + slot * stride_vn
        else:
            k_rows = cols.to(tl.int64) * stride_kn
            v_rows = cols.to(tl.int64) * stride_vn
        kt_ptrs = k_base + k_rows[None, :] + offs_d[:, None]
        v_ptrs = v_base + v_rows[:, None] + offs_d[None, :]
        if MASKED:
            n_ok = cols < seqlen
            kt = tl.load(kt_ptrs, mask=n_ok[None, :] & d_ok[:, None], other=0.0)
            v = tl.load(v_ptrs, mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        elif BLOCK_D > HEAD_DIM:
            kt = tl.load(kt_ptrs, mask=d_ok[:, None], other=0.0)
            v = tl.load(v_ptrs, mask=d_ok[None, :], other=0.0)
        else:
            kt = tl.load(kt_ptrs)
            v = tl.load(v_ptrs)
        kt1 = None
        v1 = None
        if BLOCK_D1 > 0:  # the second tile: dims [BLOCK_D, HEAD_DIM), padded to BLOCK_D1
            d1_ok = offs_d1 < HEAD_DIM
            kt1_ptrs = k_base + k_rows[None, :] + offs_d1[:, None]
            v1_ptrs = v_base + v_rows[:, None] + offs_d1[None, :]
            if MASKED:
                kt1 = tl.load(kt1_ptrs, mask=n_ok[None, :] & d1_ok[:, None], other=0.0)
                v1 = tl.load(v1_ptrs, mask=n_ok[:, None] & d1_ok[None, :], other=0.0)
            elif BLOCK_D + BLOCK_D1 > HEAD_DIM:
                kt1 = tl.load(kt1_ptrs, mask=d1_ok[:, None], other=0.0)
                v1 = tl.load(v1_ptrs, mask=d1_ok[None, :], other=0.0)
            else:
                kt1 = tl.load(kt1_ptrs)
                v1 = tl.load(v1_ptrs)
        acc, l_i, m_i, acc1 = _fold_block(acc, l_i, m_i, q, kt, v, cols, seqlen, causal_lim,
                                          qk_scale, win_l, win_r, cap_in, cap_out, slope,
                                          key_lo, acc1, q1, kt1, v1, MASKED, IS_CAUSAL,
                                          UPCAST_DOT, HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI,
                                          HAS_LEFTPAD, BLOCK_D1)
    return acc, l_i, m_i, acc1


@triton.jit
def _decode_new(acc, l_i, m_i, q, K, V, k_base, v_base, kn_base, vn_base, BlockTable,
                bt_row, offs_d, stride_kp, stride_kn, stride_vp, stride_vn, stride_btp,
                stride_knn, stride_vnn, cache_len, new_hi, write, page_size,
                num_pages, causal_lim, qk_scale, win_l, win_r, cap_in, cap_out, slope,
                key_lo, Cos, Sin, seqlen_ro, rot_partner, rot_freq, rot_sign, rot_on,
                acc1, q1, offs_d1,
                HEAD_DIM: tl.constexpr, BLOCK_NEW: tl.constexpr, IS_CAUSAL: tl.constexpr,
                PAGED: tl.constexpr, UPCAST_DOT: tl.constexpr, HAS_WINDOW: tl.constexpr,
                HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
                HAS_LEFTPAD: tl.constexpr, ROT_DIM: tl.constexpr,
                ROT_INTERLEAVED: tl.constexpr, BLOCK_D1: tl.constexpr):
    """The appended keys ``[cache_len, new_hi)`` (``new_hi <= seqlen``, the capacity-clamped
    length), ``BLOCK_NEW`` at a time, read from KNew/VNew in rows (coalesced) and rotated
    once: where ``write``, written into the cache (in the cache's dtype; a paged cache only
    through page ids in ``[0, num_pages)``), and attended to, masked. With ``BLOCK_D1`` > 0
    the dims ``offs_d1`` are a second tile (a rotary partner is read from memory, so a pair
    may straddle the tiles)."""
    d_ok = offs_d < HEAD_DIM
    offs_j = tl.arange(0, BLOCK_NEW)
    for start in tl.range(cache_len, new_hi, BLOCK_NEW):
        cols = start + offs_j  # the keys' positions in the sequence
        j_ok = cols < new_hi
        new_rows = (cols - cache_len).to(tl.int64)
        kn_rows = kn_base + (new_rows * stride_knn)[:, None]
        ok = j_ok[:, None] & d_ok[None, :]
        k_new = _load_rotated(kn_rows + offs_d[None, :], kn_rows + rot_partner[None, :],
                              cols[:, None], ok, rot_on[None, :], rot_freq[None, :],
                              rot_sign[None, :], Cos, Sin, seqlen_ro, ROT_DIM)
        v_new = tl.load(vn_base + (new_rows * stride_vnn)[:, None] + offs_d[None, :],
                        mask=ok, other=0.0)
        w_ok = j_ok & write
        if PAGED:
            page = tl.load(BlockTable + bt_row + (cols // page_size).to(tl.int64) * stride_btp,
                           mask=w_ok, other=-1)
            w_ok = w_ok & (page >= 0) & (page < num_pages)
            slot = (cols % page_size).to(tl.int64)
            k_dst = page.to(tl.int64) * stride_kp + slot * stride_kn
            v_dst = page.to(tl.int64) * stride_vp + slot * stride_vn
        else:
            k_dst = cols.to(tl.int64) * stride_kn
            v_dst = cols.to(tl.int64) * stride_vn
        st_ok = w_ok[:, None] & d_ok[None, :]
        tl.store(k_base + k_dst[:, None] + offs_d[None, :], k_new.to(K.dtype.element_ty),
                 mask=st_ok)
        tl.store(v_base + v_dst[:, None] + offs_d[None, :], v_new.to(V.dtype.element_ty),
                 mask=st_ok)
        kt_new1 = None
        v_new1 = None
        if BLOCK_D1 > 0:
            d1_ok = offs_d1 < HEAD_DIM
            partner1, freq1, sign1, rot_on1 = _rotary_dims(offs_d1, ROT_DIM, ROT_INTERLEAVED)
            ok1 = j_ok[:, None] & d1_ok[None, :]
            k_new1 = _load_rotated(kn_rows + offs_d1[None, :], kn_rows + partner1[None, :],
                                   cols[:, None], ok1, rot_on1[None, :], freq1[None, :],
                                   sign1[None, :], Cos, Sin, seqlen_ro, ROT_DIM)
            v_new1 = tl.load(vn_base + (new_rows * stride_vnn)[:, None] + offs_d1[None, :],
                             mask=ok1, other=0.0)
            st1_ok = w_ok[:, None] & d1_ok[None, :]
            tl.store(k_base + k_dst[:, None] + offs_d1[None, :],
                     k_new1.to(K.dtype.element_ty), mask=st1_ok)
            tl.store(v_base + v_dst[:, None] + offs_d1[None, :],
                     v_new1.to(V.dtype.element_ty), mask=st1_ok)
            kt_new1 = tl.trans(k_new1)
        acc, l_i, m_i, acc1 = _fold_block(acc, l_i, m_i, q, tl.trans(k_new), v_new, cols,
                                          new_hi, causal_lim, qk_scale, win_l, win_r, cap_in,
                                          cap_out, slope, key_lo, acc1, q1, kt_new1, v_new1,
                                          True, IS_CAUSAL, UPCAST_DOT, HAS_WINDOW,
                                          HAS_SOFTCAP, HAS_ALIBI, HAS_LEFTPAD, BLOCK_D1)
    return acc, l_i, m_i, acc1


@triton.jit
def attn_decode_split_kernel(
    Q, K, V, Out, Lse, Seqlens, BlockTable, OPart, LsePart, Alibi,
    KNew, VNew, Cos, Sin, BatchIdx, LeftPad,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_om,
    stride_btb, stride_btp,
    H_Q, H_KV, N_Q, N_K, page_size, sm_scale,
    # the modifications' scalars come last: a plain launch (Alibi None) keeps every earlier
    # parameter's place, and so its code
    stride_ab, WINDOW_LEFT, WINDOW_RIGHT, SOFTCAP,
    # the cache options' scalars (None when unused): NUM_PAGES with PAGED, the new K/V's
    # strides and N_NEW with HAS_NEW, SEQLEN_RO with ROT_DIM, CACHE_BATCH with HAS_BATCH_IDX,
    # BATCH_HEADS (B * Hkv) with NEW_ROWS
    NUM_PAGES, stride_knb, stride_knh, stride_knn, stride_vnb, stride_vnh, stride_vnn,
    N_NEW, SEQLEN_RO, CACHE_BATCH, BATCH_HEADS,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    IS_CAUSAL: tl.constexpr, HAS_SEQLENS: tl.constexpr, PAGED: tl.constexpr,
    PAGE_ALIGNED: tl.constexpr, STORE_LSE: tl.constexpr, UPCAST_DOT: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HAS_NEW: tl.constexpr, ROT_DIM: tl.constexpr, ROT_INTERLEAVED: tl.constexpr,
    ROT_Q_PER_POS: tl.constexpr, HAS_BATCH_IDX: tl.constexpr, HAS_LEFTPAD: tl.constexpr,
    NEW_ROWS: tl.constexpr = False, BLOCK_D1: tl.constexpr = 0,
):
    """K/V strides: ``stride_kb`` is the page stride when PAGED (K is ``(pages, Hkv,
    page_size, D)``), the batch stride otherwise. OPart ``(B, Hq, N_Q, P, HEAD_DIM)`` and
    LsePart ``(B, Hq, N_Q, P)`` are contiguous fp32, ``P = NUM_SPLITS`` (+ 1 with
    NEW_ROWS); Lse ``(B, Hq, N_Q)`` contiguous fp32. ``WINDOW_LEFT``/``WINDOW_RIGHT`` (-1:
    unbounded; the right one unread with IS_CAUSAL), ``SOFTCAP`` and ``Alibi`` are read only
    under their flags. ``N_K`` is the capacity every length is clamped to. KNew/VNew
    ``(B, Hkv, N_NEW, D)``; Cos/Sin ``(SEQLEN_RO, ROT_DIM // 2)`` contiguous; BatchIdx,
    LeftPad int32 ``(B,)``; NEW_ROWS needs HAS_NEW and NUM_SPLITS > 1. ``BLOCK_D1`` > 0
    reads the head dim as two tiles, dims ``[0, BLOCK_D)`` (all real) and ``[BLOCK_D,
    BLOCK_D + BLOCK_D1)`` (padded past HEAD_DIM): D96 as 64 + 32 moves no padded dim where
    one 128-wide tile issues D128's loads and dots; 0 (one tile) compiles as before."""
    tl.static_assert(not NEW_ROWS or (HAS_NEW and NUM_SPLITS > 1),
                     "NEW_ROWS: the new keys' own programs, with new keys and splits")
    tl.static_assert(BLOCK_M >= 16 and BLOCK_N >= 16, "tl.dot needs tiles of at least 16")
    tl.static_assert(BLOCK_D + BLOCK_D1 >= HEAD_DIM, "BLOCK_D (+ BLOCK_D1) must cover HEAD_DIM")
    tl.static_assert(BLOCK_D1 == 0 or (BLOCK_D < HEAD_DIM and BLOCK_D1 >= 16),
                     "a second tile of >= 16 dims past a first one of real dims")
    tl.static_assert(ROT_DIM == 0 or HAS_NEW, "rotary comes with new keys")
    tl.static_assert(ROT_DIM % 2 == 0 and ROT_DIM <= HEAD_DIM, "ROT_DIM even, <= HEAD_DIM")
    split = tl.program_id(0)
    off_bh = tl.program_id(1)
    if NEW_ROWS:
        # grid rows past the B * Hkv of the cache's splits: the new keys' programs, one per
        # KV head, NUM_SPLITS to a row (launched last, so the splits get the SMs first); the
        # last row's spare programs do nothing
        new_prog = off_bh >= BATCH_HEADS
        new_bh = (off_bh - BATCH_HEADS) * NUM_SPLITS + split
        live = (off_bh < BATCH_HEADS) | (new_bh < BATCH_HEADS)
        off_bh = tl.where(new_prog, tl.minimum(new_bh, BATCH_HEADS - 1), off_bh)
        split = tl.where(new_prog, NUM_SPLITS, split)
    off_b = off_bh // H_KV
    off_hkv = off_bh % H_KV

    offs_r = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    r_ok = offs_r < GROUP * N_Q
    offs_i = offs_r % N_Q  # the query within the sequence
    offs_h = off_hkv * GROUP + tl.minimum(offs_r // N_Q, GROUP - 1)  # its query head
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM

    # the sequence's keys: cached [0, cache_len), appended [cache_len, seqlen), every length
    # clamped to the capacity N_K whatever the tables hold
    if HAS_SEQLENS:
        cache_len = tl.minimum(tl.maximum(tl.load(Seqlens + off_b), 0), N_K)
    else:
        cache_len = N_K
    cache_b = off_b
    if HAS_BATCH_IDX:  # a cache row out of range: an empty sequence, nothing written
        cache_b = tl.load(BatchIdx + off_b)
        cache_b_ok = (cache_b >= 0) & (cache_b < CACHE_BATCH)
        cache_b = tl.where(cache_b_ok, cache_b, 0)
        cache_len = tl.where(cache_b_ok, cache_len, 0)
    n_new = 0
    if HAS_NEW:
        n_new = N_NEW
        if HAS_BATCH_IDX:
            n_new = tl.where(cache_b_ok, N_NEW, 0)
        seqlen = tl.minimum(cache_len + n_new, N_K)
    else:
        seqlen = cache_len
    key_lo = 0
    if HAS_LEFTPAD:  # keys before LeftPad[b] are not the sequence's
        key_lo = tl.minimum(tl.maximum(tl.load(LeftPad + off_b), 0), seqlen)
    if PAGED:
        k_base = K + off_hkv.to(tl.int64) * stride_kh
        v_base = V + off_hkv.to(tl.int64) * stride_vh
    else:
        k_base = K + cache_b.to(tl.int64) * stride_kb + off_hkv.to(tl.int64) * stride_kh
        v_base = V + cache_b.to(tl.int64) * stride_vb + off_hkv.to(tl.int64) * stride_vh
    bt_row = off_b.to(tl.int64) * stride_btb

    # the rotary's per-dim vectors (unused, so not compiled, without rotary)
    rot_partner, rot_freq, rot_sign, rot_on = _rotary_dims(offs_d, ROT_DIM, ROT_INTERLEAVED)
    kn_base = None
    vn_base = None
    walk_end = seqlen  # the keys walked from the cache end here
    if HAS_NEW:
        kn_base = KNew + off_b.to(tl.int64) * stride_knb + off_hkv.to(tl.int64) * stride_knh
        vn_base = VNew + off_b.to(tl.int64) * stride_vnb + off_hkv.to(tl.int64) * stride_vnh
        walk_end = cache_len  # the new keys come from KNew/VNew, in _decode_new

    q_rows = (Q + off_b.to(tl.int64) * stride_qb + offs_h[:, None].to(tl.int64) * stride_qh
              + offs_i[:, None].to(tl.int64) * stride_qm)
    q_ok = r_ok[:, None] & d_ok[None, :]
    if ROT_DIM > 0:
        # FlashAttention-2: query i at position cache_len + i (causal or local), else every
        # query at cache_len
        if ROT_Q_PER_POS:
            q_pos = cache_len + offs_i
        else:
            q_pos = cache_len + offs_i * 0
        q = _load_rotated(q_rows + offs_d[None, :], q_rows + rot_partner[None, :],
                          q_pos[:, None], q_ok, rot_on[None, :], rot_freq[None, :],
                          rot_sign[None, :], Cos, Sin, SEQLEN_RO, ROT_DIM)
    else:
        q = tl.load(q_rows + offs_d[None, :], mask=q_ok, other=0.0)
    # the head dim's second tile; without one, acc1 is a placeholder the loops carry and the
    # compiler drops
    offs_d1 = None
    q1 = None
    acc1 = tl.zeros([1], dtype=tl.float32)
    if BLOCK_D1 > 0:
        offs_d1 = BLOCK_D + tl.arange(0, BLOCK_D1)
        q1_ok = r_ok[:, None] & (offs_d1 < HEAD_DIM)[None, :]
        if ROT_DIM > 0:
            partner1, freq1, sign1, rot_on1 = _rotary_dims(offs_d1, ROT_DIM, ROT_INTERLEAVED)
            q1 = _load_rotated(q_rows + offs_d1[None, :], q_rows + partner1[None, :],
                               q_pos[:, None], q1_ok, rot_on1[None, :], freq1[None, :],
                               sign1[None, :], Cos, Sin, SEQLEN_RO, ROT_DIM)
        else:
            q1 = tl.load(q_rows + offs_d1[None, :], mask=q1_ok, other=0.0)
        acc1 = tl.zeros([BLOCK_M, BLOCK_D1], dtype=tl.float32)

    win_l = None
    win_r = None
    if not (HAS_WINDOW or HAS_LEFTPAD):
        # this split's cached keys: whole blocks, [lo, hi)
        blocks_per_split = tl.cdiv(tl.cdiv(walk_end, BLOCK_N), NUM_SPLITS)
        lo = split * blocks_per_split * BLOCK_N
        hi = tl.minimum(walk_end, lo + blocks_per_split * BLOCK_N)
        # keys every row sees: [0, full_end); blocks of [lo, mid) need no mask
        causal_lim = offs_i + seqlen - N_Q
        if IS_CAUSAL:
            full_end = tl.maximum(seqlen - N_Q + 1, 0)
        else:
            full_end = seqlen
        mid = lo + tl.maximum(tl.minimum(hi, full_end) - lo, 0) // BLOCK_N * BLOCK_N
        hi = tl.maximum(hi, mid)
    else:
        causal_lim = offs_i + seqlen - N_Q  # each row's key position
        if HAS_WINDOW:
            # -1 (unbounded) becomes a bound past every key: |pos - j| < seqlen + N_Q
            unbounded = seqlen + N_Q
            win_l = tl.where(WINDOW_LEFT < 0, unbounded, WINDOW_LEFT)
            if IS_CAUSAL:
                win_r = 0
            else:
                win_r = tl.where(WINDOW_RIGHT < 0, unbounded, WINDOW_RIGHT)
            # the keys any row sees start at first_key (the last row, at seqlen - 1, sees up
            # to the end); every row sees [full_key, full_end)
            first_key = tl.maximum(seqlen - N_Q - win_l, 0)
            full_key = tl.maximum(seqlen - 1 - win_l, 0)
            full_end = tl.minimum(tl.maximum(seqlen - N_Q + win_r + 1, 0), seqlen)
        else:
            first_key = 0
            full_key = 0
            if IS_CAUSAL:
                full_end = tl.maximum(seqlen - N_Q + 1, 0)
            else:
                full_end = seqlen
        if HAS_LEFTPAD:
            first_key = tl.maximum(first_key, key_lo)
            full_key = tl.maximum(full_key, key_lo)
        # the splits cut the cached blocks from first_key's on, so none walks keys before it
        first = first_key // BLOCK_N * BLOCK_N
        if HAS_NEW:  # the window may start among the new keys: no cached key to walk
            span = tl.maximum(walk_end - first, 0)
        else:
            span = seqlen - first
        blocks_per_split = tl.cdiv(tl.cdiv(span, BLOCK_N), NUM_SPLITS)
        lo = first + split * blocks_per_split * BLOCK_N
        hi = tl.maximum(tl.minimum(walk_end, lo + blocks_per_split * BLOCK_N), lo)
        # the whole blocks of [full_key, full_end), [full_lo, mid), need no mask; [lo,
        # full_lo) and [mid, hi) are walked masked (all of [lo, hi) when no block is seen in
        # full by every row)
        full_lo = (full_key + BLOCK_N - 1) // BLOCK_N * BLOCK_N
        full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
        if HAS_NEW:  # hi may be cache_len, inside a block
            full_end = tl.minimum(full_end, walk_end)
        mid = tl.maximum(tl.minimum(full_end // BLOCK_N * BLOCK_N, hi), full_lo)

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
        # a column: each row of the tile is a query head of the group, with its own slope
        slope = (tl.load(Alibi + off_b.to(tl.int64) * stride_ab + offs_h)
                 * 1.4426950408889634)[:, None]

    if HAS_WINDOW or HAS_LEFTPAD:  # the left band: the window's (or the keys') lower edge
        acc, l_i, m_i, acc1 = _decode_inner(
            acc, l_i, m_i, q, k_base, v_base, BlockTable, bt_row, offs_n, offs_d, stride_kb,
            stride_kn, stride_vb, stride_vn, stride_btp, lo, full_lo, walk_end, page_size,
            NUM_PAGES, causal_lim, qk_scale, win_l, win_r, cap_in, cap_out, slope, key_lo,
            acc1, q1, offs_d1, HEAD_DIM, BLOCK_D, BLOCK_N, True, IS_CAUSAL, PAGED,
            PAGE_ALIGNED, UPCAST_DOT, HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, HAS_LEFTPAD,
            BLOCK_D1)
        lo = full_lo
    acc, l_i, m_i, acc1 = _decode_inner(
        acc, l_i, m_i, q, k_base, v_base, BlockTable, bt_row, offs_n, offs_d, stride_kb,
        stride_kn, stride_vb, stride_vn, stride_btp, lo, mid, walk_end, page_size, NUM_PAGES,
        causal_lim, qk_scale, win_l, win_r, cap_in, cap_out, slope, key_lo, acc1, q1, offs_d1,
        HEAD_DIM, BLOCK_D, BLOCK_N, False, IS_CAUSAL, PAGED, PAGE_ALIGNED, UPCAST_DOT,
        HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, HAS_LEFTPAD, BLOCK_D1)
    acc, l_i, m_i, acc1 = _decode_inner(
        acc, l_i, m_i, q, k_base, v_base, BlockTable, bt_row, offs_n, offs_d, stride_kb,
        stride_kn, stride_vb, stride_vn, stride_btp, mid, hi, walk_end, page_size, NUM_PAGES,
        causal_lim, qk_scale, win_l, win_r, cap_in, cap_out, slope, key_lo, acc1, q1, offs_d1,
        HEAD_DIM, BLOCK_D, BLOCK_N, True, IS_CAUSAL, PAGED, PAGE_ALIGNED, UPCAST_DOT,
        HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, HAS_LEFTPAD, BLOCK_D1)
    if HAS_NEW:
        # the new keys: with NEW_ROWS their own program (split NUM_SPLITS, no cached keys)
        # walks them alone, so no split of the cache waits on them; otherwise the last split
        # walks them after its cached keys. Its row block 0 writes them into the cache.
        if NEW_ROWS:
            new_hi = tl.where((split == NUM_SPLITS) & live, seqlen, cache_len)
        else:
            new_hi = tl.where(split == NUM_SPLITS - 1, seqlen, cache_len)
        acc, l_i, m_i, acc1 = _decode_new(
            acc, l_i, m_i, q, K, V, k_base, v_base, kn_base, vn_base, BlockTable, bt_row,
            offs_d, stride_kb, stride_kn, stride_vb, stride_vn, stride_btp, stride_knn,
            stride_vnn, cache_len, new_hi, tl.program_id(2) == 0, page_size, NUM_PAGES,
            causal_lim, qk_scale, win_l, win_r, cap_in, cap_out, slope, key_lo, Cos, Sin,
            SEQLEN_RO, rot_partner, rot_freq, rot_sign, rot_on, acc1, q1, offs_d1, HEAD_DIM,
            16, IS_CAUSAL, PAGED, UPCAST_DOT, HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, HAS_LEFTPAD,
            ROT_DIM, ROT_INTERLEAVED, BLOCK_D1)

    seen = l_i > 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(seen, (m_i + tl.math.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    row_ids = (off_b * H_Q + offs_h).to(tl.int64) * N_Q + offs_i  # (b, hq, i) flattened
    if NUM_SPLITS == 1:
        o_ptrs = (Out + off_b.to(tl.int64) * stride_ob + offs_h[:, None].to(tl.int64) * stride_oh
                  + offs_i[:, None].to(tl.int64) * stride_om + offs_d[None, :])
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=r_ok[:, None] & d_ok[None, :])
        if BLOCK_D1 > 0:
            o1_ptrs = (Out + off_b.to(tl.int64) * stride_ob
                       + offs_h[:, None].to(tl.int64) * stride_oh
                       + offs_i[:, None].to(tl.int64) * stride_om
                       + offs_d1[None, :])  # type: ignore[index]
            tl.store(o1_ptrs, (acc1 / l_safe[:, None]).to(Out.dtype.element_ty),
                     mask=r_ok[:, None] & (offs_d1 < HEAD_DIM)[None, :])
        if STORE_LSE:
            tl.store(Lse + row_ids, lse, mask=r_ok)
    else:
        if NEW_ROWS:  # the new keys' program stores partial NUM_SPLITS
            part = row_ids * (NUM_SPLITS + 1) + split
            tl.store(OPart + part[:, None] * HEAD_DIM + offs_d[None, :], out,
                     mask=r_ok[:, None] & d_ok[None, :] & live)
            tl.store(LsePart + part, lse, mask=r_ok & live)
        else:
            part = row_ids * NUM_SPLITS + split
            tl.store(OPart + part[:, None] * HEAD_DIM + offs_d[None, :], out,
                     mask=r_ok[:, None] & d_ok[None, :])
            tl.store(LsePart + part, lse, mask=r_ok)
        if BLOCK_D1 > 0:
            part_ok = r_ok[:, None] & (offs_d1 < HEAD_DIM)[None, :]
            if NEW_ROWS:
                part_ok = part_ok & live
            tl.store(OPart + part[:, None] * HEAD_DIM + offs_d1[None, :],  # type: ignore[index]
                     acc1 / l_safe[:, None], mask=part_ok)


@triton.jit
def attn_decode_combine_kernel(
    OPart, LsePart, Out, Lse,
    stride_ob, stride_oh, stride_om,
    H_Q, N_Q,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr, STORE_LSE: tl.constexpr,
):
    """One program per (b, hq, i) row: merge its ``NUM_SPLITS`` partials by their LSEs."""
    row = tl.program_id(0).to(tl.int64)
    off_i = row % N_Q
    off_h = (row // N_Q) % H_Q
    off_b = row // (N_Q * H_Q)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < NUM_SPLITS
    d_ok = offs_d < HEAD_DIM

    lse_s = tl.load(LsePart + row * NUM_SPLITS + offs_s, mask=s_ok, other=float("-inf"))
    m = tl.max(lse_s, 0)
    m_sub = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse_s - m_sub)  # 0 for empty splits
    total = tl.sum(w, 0)
    o_s = tl.load(OPart + (row * NUM_SPLITS + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
                  mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    seen = total > 0.0
    t_safe = tl.where(seen, total, 1.0)
    out = tl.sum(o_s * (w / t_safe)[:, None], 0)
    o_ptrs = Out + off_b * stride_ob + off_h * stride_oh + off_i * stride_om + offs_d
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=d_ok)
    if STORE_LSE:
        tl.store(Lse + row, tl.where(seen, m_sub + tl.log(t_safe), float("-inf")))
