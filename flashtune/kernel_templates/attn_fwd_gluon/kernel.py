"""The Gluon forward's kernel: ``gluon_attn_fwd_kernel`` and its partitions (``@gluon.jit``
only; the package doc describes the structure, :mod:`.launcher` launches it).

* ``_producer`` (1 warp): per tile, each consumer's Q tile (once its buffer is free:
  ``q_empty``), then K and V tiles into a ring of ``NUM_STAGES`` buffers behind the
  ``k_ready`` / ``v_ready`` / ``kv_empty`` mbarriers (``_producer_tile``; ``SPLIT_KV``:
  ``kv_empty`` frees a K buffer once its ``S`` is done, ``v_empty`` a V buffer once its
  ``P V`` is);
* ``_consumer`` (a warpgroup each, one to three): ``S_j = Q K_j^T`` and
  ``O += P_{j-1} V_{j-1}`` as async wgmma, the softmax of ``S_j`` (``_softmax_block``) while
  the second is in flight, the epilogue (``_consumer_tile``; ``TMA_STORE``: O through the
  consumer's Q buffer and one TMA store, ``o_desc``); ``_my_turn`` / ``_their_turn`` are the
  ping-pong barriers (``PINGPONG``).

A CTA serves one tile (query block ``m_block`` of ``bh``, batch x head) when the grid has a
CTA per tile, or with ``PERSISTENT`` the tiles ``first, first + stride, ... < end`` (a CTA per
SM looping over the tiles, FA3's persistent kernel: the producer loads the next tile's Q and
first K/V blocks while the consumers finish the last ``P V`` and the epilogue of this one;
``_coords`` maps a tile index to its ``(bh, m_block)``, ``_tile`` a tile to its rows and key
blocks; ``Q_BUFFERS`` 2: the tiles alternate between two sets of Q buffers, ``_q_slot``).
``LPT`` (persistent, causal) orders the tiles longest first across the heads of a section
(FA3's longest-processing-time order; see ``_coords``). Barrier phases run on over
the tiles: ring slot and phase come from a count of key blocks over the CTA's tiles
(``kv_base + j - lo``), the ping-pong turn from a count of steps, ``q_bar`` / ``q_empty``
from the tile count (per set of Q buffers).

``WINDOW`` (with ``CAUSAL``): a sliding window of ``window_left`` keys before each query
(FlashAttention-2's ``window_size = (window_left, 0)``). A tile's key blocks start at the
block of its first row's first visible key (``_tile``'s ``lo``): the blocks before are
neither loaded nor computed, so the work is O(N x window); the blocks that cut a row's
window are masked in ``_softmax_block``. Every tile still holds ``hi - lo`` blocks for both
partitions, so the barrier protocol is the one the model checks.

``SOFTCAP`` (a constexpr, the cap times log2 e; 0: none): ``_softmax_block`` caps the raw
scores first, ``tanh(qk * qk_scale) * SOFTCAP`` (``qk_scale`` is then ``scale / cap``), and
masks the capped ones. Every kernel's frontend IR names it (a partition's mangled name
carries its constexprs), but a kernel without it compiles to the instructions it had before
the knob (170 of 170 shipped-config compiles, ``sass_hash``, flashtune/configs/README.md).

:mod:`.protocol` models the barrier protocol of ``_producer`` and ``_consumer``: keep the two
in step.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)


@gluon.jit
def _coords(t, n_mblocks, end, section, CAUSAL: gl.constexpr, LPT: gl.constexpr):
    """Tile ``t`` of a persistent CTA: ``(bh, m_block)``.

    By default in the order a grid launch runs them: query blocks of one head are
    consecutive tiles (CTAs running side by side share K and V in L2), causal ones longest
    first. A CTA striding over that order by a multiple of ``n_mblocks`` takes causal tiles
    of one length only (132 SMs, 4 query blocks at N 512: one CTA walks 62 key blocks,
    another 16). With ``LPT``: sections of ``section`` consecutive heads (batch x heads_q,
    the last one shorter; the launcher sizes them so their K and V fit in L2), each
    section's tiles longest first across its heads (``m_block`` outer, descending), so a
    striding CTA takes every length in turn."""
    if LPT:
        per = section * n_mblocks
        s = t // per
        r = t - s * per
        heads = gl.minimum(section, end // n_mblocks - s * section)
        bh = s * section + r % heads
        m_block = n_mblocks - 1 - r // heads
    else:
        bh = t // n_mblocks
        m_block = t % n_mblocks
        if CAUSAL:
            m_block = n_mblocks - 1 - m_block
    return bh, m_block


@gluon.jit
def _tile(bh, m_block, heads_q, group, seqlen_q, seqlen_k, window_left, ROWS: gl.constexpr,
          BLOCK_N: gl.constexpr, NUM_CONSUMERS: gl.constexpr, CAUSAL: gl.constexpr,
          WINDOW: gl.constexpr):
    """The key blocks ``[lo, hi)`` of query block ``m_block`` of ``bh`` (batch x heads_q):
    from the first the tile's first row sees (``WINDOW``: its position minus
    ``window_left``; else 0) to the last its last row sees (causal)."""
    n_total = gl.cdiv(seqlen_k, BLOCK_N)
    if CAUSAL:  # the keys the tile's last row sees
        n_total = gl.minimum(n_total, gl.cdiv((m_block + 1) * (NUM_CONSUMERS * ROWS)
                                              + (seqlen_k - seqlen_q), BLOCK_N))
    lo = 0
    if WINDOW:  # the keys the tile's first row sees start window_left before it
        lo = gl.maximum(m_block * (NUM_CONSUMERS * ROWS) + (seqlen_k - seqlen_q)
                        - window_left, 0) // BLOCK_N
    return lo, gl.maximum(n_total, lo + 1)


@gluon.jit
def _tile_coords(bh, m_block, heads_q, group, seqlen_q, seqlen_k, HEAD_D: gl.constexpr,
                 ROWS: gl.constexpr, NUM_CONSUMERS: gl.constexpr, Q_BSHD: gl.constexpr,
                 KV_BSHD: gl.constexpr):
    """``[row, column]`` of the tile's first query row and of its KV head's first key in the
    descriptors' 2-D views: ``(B * H * N, D)`` for ``(B, H, N, D)`` storage, ``(B * N,
    H * D)`` for ``(B, N, H, D)`` storage (``Q_BSHD``, ``KV_BSHD``: a head is then ``D``
    columns, not ``N`` rows, further)."""
    b = bh // heads_q
    h = bh % heads_q
    hk = h // group
    m0 = m_block * (NUM_CONSUMERS * ROWS)
    if Q_BSHD:
        q_row = b * seqlen_q + m0
        q_col = h * HEAD_D
    else:
        q_row = bh * seqlen_q + m0
        q_col = 0
    if KV_BSHD:
        kv_row = b * seqlen_k
        kv_col = hk * HEAD_D
    else:
        kv_row = (b * (heads_q // group) + hk) * seqlen_k
        kv_col = 0
    return q_row, q_col, kv_row, kv_col


@gluon.jit
def _q_slot(tile_i, NUM_CONSUMERS: gl.constexpr, Q_BUFFERS: gl.constexpr):
    """Tile ``tile_i``'s Q buffers (the first of its ``NUM_CONSUMERS``) and the parity of
    their barriers' phase: with ``Q_BUFFERS`` 2 a persistent CTA's tiles alternate between
    two sets, so the next tile's Q loads while this one's epilogue still holds its set."""
    if Q_BUFFERS == 1:
        first = 0
        parity = tile_i & 1
    else:
        first = (tile_i % Q_BUFFERS) * NUM_CONSUMERS
        parity = (tile_i // Q_BUFFERS) & 1
    return first, parity


@gluon.jit
def _producer_tile(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, q_empty, k_ready,
                   v_ready, kv_empty, v_empty, bh, m_block, kv_base, tile_i, heads_q, group, seqlen_q,
                   seqlen_k, window_left, ROWS: gl.constexpr,
                   BLOCK_N: gl.constexpr,
                   NUM_STAGES: gl.constexpr, NUM_CONSUMERS: gl.constexpr, CAUSAL: gl.constexpr,
                   WINDOW: gl.constexpr, PERSISTENT: gl.constexpr, Q_BSHD: gl.constexpr,
                   KV_BSHD: gl.constexpr, Q_BUFFERS: gl.constexpr, SPLIT_KV: gl.constexpr):
    """The loads of the tile (``bh``, ``m_block``), after ``kv_base`` key blocks and ``tile_i`` tiles of this CTA;
    returns how many key blocks the tile has."""
    lo, n_total = _tile(bh, m_block, heads_q, group, seqlen_q, seqlen_k, window_left, ROWS,
                        BLOCK_N, NUM_CONSUMERS, CAUSAL, WINDOW)
    HEAD_D: gl.constexpr = q_desc.block_type.shape[1]
    q_row, q_col, kv_row, kv_col = _tile_coords(bh, m_block, heads_q, group, seqlen_q,
                                                seqlen_k, HEAD_D, ROWS, NUM_CONSUMERS, Q_BSHD,
                                                KV_BSHD)
    qs, q_parity = _q_slot(tile_i, NUM_CONSUMERS, Q_BUFFERS)
    for c in gl.static_range(NUM_CONSUMERS):
        if PERSISTENT:  # consumer c is done with the buffer's last tile (a fresh barrier passes)
            mbarrier.wait(q_empty.index(qs + c), q_parity ^ 1)
        mbarrier.expect(q_bar.index(qs + c), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [q_row + c * ROWS, q_col], q_bar.index(qs + c),
                                        q_smem.index(qs + c))
    for j in range(lo, n_total):
        g = kv_base + j - lo
        st = g % NUM_STAGES
        ph = (g // NUM_STAGES) & 1
        # a fresh mbarrier counts as phase 1 complete: the first NUM_STAGES waits pass
        mbarrier.wait(kv_empty.index(st), ph ^ 1)
        mbarrier.expect(k_ready.index(st), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [kv_row + j * BLOCK_N, kv_col],
                                        k_ready.index(st), k_smem.index(st))
        if SPLIT_KV:  # kv_empty freed K's buffer (its S is done); V's frees with its P V
            mbarrier.wait(v_empty.index(st), ph ^ 1)
        mbarrier.expect(v_ready.index(st), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [kv_row + j * BLOCK_N, kv_col],
                                        v_ready.index(st), v_smem.index(st))
    return n_total - lo


@gluon.jit
def _producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, q_empty, k_ready,
              v_ready, kv_empty, v_empty, first, end, stride, n_mblocks, heads_q, group, seqlen_q,
              seqlen_k, window_left, section, ROWS: gl.constexpr, BLOCK_N: gl.constexpr,
              NUM_STAGES: gl.constexpr, NUM_CONSUMERS: gl.constexpr, CAUSAL: gl.constexpr,
              WINDOW: gl.constexpr, PERSISTENT: gl.constexpr, Q_BSHD: gl.constexpr,
              KV_BSHD: gl.constexpr, LPT: gl.constexpr, Q_BUFFERS: gl.constexpr,
              SPLIT_KV: gl.constexpr):
    if PERSISTENT:
        kv_base = 0
        tile_i = 0
        for t in range(first, end, stride):
            bh, m_block = _coords(t, n_mblocks, end, section, CAUSAL, LPT)
            kv_base += _producer_tile(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar,
                                      q_empty, k_ready, v_ready, kv_empty, v_empty, bh, m_block,
                                      kv_base, tile_i, heads_q, group, seqlen_q, seqlen_k,
                                      window_left, ROWS, BLOCK_N,
                                      NUM_STAGES, NUM_CONSUMERS, CAUSAL, WINDOW, True, Q_BSHD,
                                      KV_BSHD, Q_BUFFERS, SPLIT_KV)
            tile_i += 1
    else:  # a grid launch: (first, end) are the CTA's (m_block, bh)
        _producer_tile(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, q_empty, k_ready,
                       v_ready, kv_empty, v_empty, end, first, 0, 0, heads_q, group, seqlen_q,
                       seqlen_k, window_left, ROWS, BLOCK_N,
                       NUM_STAGES, NUM_CONSUMERS, CAUSAL, WINDOW, False, Q_BSHD, KV_BSHD,
                       Q_BUFFERS, SPLIT_KV)


@gluon.jit
def _tanh(x):
    """The hardware's ``tanh.approx.f32``, as FA2's and FA3's softcap (CUTLASS's
    ``fast_tanh``): one MUFU op a score, where the exp2 form takes two beside the softmax's
    own exp2."""
    return gl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x],
                                     dtype=gl.float32, is_pure=True, pack=1)


@gluon.jit
def _softmax_block(qk, j, m_i, l_i, q_start, seqlen_q, seqlen_k, qk_scale, window_left,
                   s_layout: gl.constexpr, ROWS: gl.constexpr, BLOCK_N: gl.constexpr,
                   CAUSAL: gl.constexpr, WINDOW: gl.constexpr, SOFTCAP: gl.constexpr = 0.0):
    """One block's online-softmax step on the raw scores ``qk`` (fp32, ``s_layout``):
    returns ``(p, alpha, m_i, l_i)`` with ``p`` unnormalised in the log2 domain.
    ``SOFTCAP`` (the cap times log2 e; 0: none): the scores become ``tanh(qk * qk_scale) *
    SOFTCAP``, ``qk_scale`` then being ``scale / cap``, already in the log2 domain."""
    if SOFTCAP > 0:
        qk = _tanh(qk * qk_scale) * SOFTCAP
        qk_scale = 1.0
    start_n = j * BLOCK_N
    need_mask = start_n + BLOCK_N > seqlen_k
    if CAUSAL:
        need_mask = need_mask | (start_n + BLOCK_N - 1 > q_start + (seqlen_k - seqlen_q))
    if WINDOW:  # the last row's window starts inside (or after) the block
        need_mask = need_mask | (start_n < q_start + ROWS - 1 + (seqlen_k - seqlen_q)
                                 - window_left)
    if need_mask:
        cols = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        ok = gl.expand_dims(cols < seqlen_k, 0)
        if CAUSAL:
            rows = q_start + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))
            ok = ok & (gl.expand_dims(cols, 0)
                       <= gl.expand_dims(rows + (seqlen_k - seqlen_q), 1))
        if WINDOW:
            rows_w = q_start + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))
            ok = ok & (gl.expand_dims(cols, 0)
                       >= gl.expand_dims(rows_w + (seqlen_k - seqlen_q) - window_left, 1))
        qk = gl.where(ok, qk, -float("inf"))
    m_new = gl.maximum(m_i, gl.max(qk, axis=1) * qk_scale)
    # rows that have seen no key yet keep m = -inf: subtract 0 there instead (no NaN)
    m_safe = gl.where(m_new == -float("inf"), 0.0, m_new)
    p = gl.exp2(qk * qk_scale - gl.expand_dims(m_safe, 1))
    alpha = gl.exp2(m_i - m_safe)
    l_i = l_i * alpha + gl.sum(p, axis=1)
    return p, alpha, m_new, l_i


@gluon.jit
def _my_turn(turn, cid, step, PINGPONG: gl.constexpr):
    """FA3's ping-pong: two consumers take turns to issue their wgmmas, so one's softmax
    runs while the other's matrix products use the tensor cores. Consumer 0 goes first
    (a fresh barrier counts as phase 1 complete); each issue ends with ``_their_turn``.
    Every consumer takes ``n_total + 1`` steps (prologue, one per later block, the last
    ``P V``; a consumer that sees fewer causal blocks steps through the rest), so the two
    stay in lockstep and neither runs a phase ahead."""
    if PINGPONG:
        mbarrier.wait(turn.index(cid), (step & 1) ^ (1 - cid))


@gluon.jit
def _their_turn(turn, cid, PINGPONG: gl.constexpr):
    if PINGPONG:
        mbarrier.arrive(turn.index(1 - cid), count=1)


@gluon.jit
def _consumer_tile(cid, q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, v_ready, kv_empty,
                   v_empty, turn, o_ptr, o_desc, lse_ptr, bh, m_block, kv_base, tile_i, heads_q, group,
                   seqlen_q, seqlen_k, qk_scale, window_left,
                   HEAD_D: gl.constexpr, ROWS: gl.constexpr, BLOCK_N: gl.constexpr,
                   NUM_STAGES: gl.constexpr, NUM_CONSUMERS: gl.constexpr,
                   CAUSAL: gl.constexpr, WINDOW: gl.constexpr, PINGPONG: gl.constexpr,
                   PERSISTENT: gl.constexpr, Q_BSHD: gl.constexpr, TMA_STORE: gl.constexpr,
                   Q_BUFFERS: gl.constexpr, SPLIT_KV: gl.constexpr,
                   SOFTCAP: gl.constexpr = 0.0):
    """Consumer ``cid``'s part of the tile (``bh``, ``m_block``), after ``kv_base`` key blocks and ``tile_i``
    tiles of this CTA; returns the tile's key blocks. ``TMA_STORE``: a whole tile's O goes
    out through Q's shared buffer by one TMA store (``o_desc``, q's 2-D view over O)."""
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    # FA3's order: P_j becomes the P V operand once P_{j-1} V_{j-1} is done, so the fp32 P
    # (64 registers at 128 keys) never lives beside the next S. Three consumers at D64
    # need it (160 registers: FA3's 192 x 128 tile spilled 0.8-1.6 KB without it, none
    # with it); elsewhere the conversion stays after the next S is issued, off the
    # softmax's path (early: 0.94-1.06x at two consumers, results/sustained_early_h200.json)
    EARLY_P: gl.constexpr = (NUM_CONSUMERS == 3) & (BLOCK_N == 128) & (HEAD_D == 64)

    steps = kv_base + tile_i  # ping-pong steps of the earlier tiles (their blocks + 1 each)
    lo, n_total = _tile(bh, m_block, heads_q, group, seqlen_q, seqlen_k, window_left, ROWS,
                        BLOCK_N, NUM_CONSUMERS, CAUSAL, WINDOW)
    q_start = m_block * (NUM_CONSUMERS * ROWS) + cid * ROWS
    n_mine = n_total
    if CAUSAL:  # the keys this consumer's last row sees
        n_mine = gl.minimum(n_total,
                            gl.cdiv(q_start + ROWS + (seqlen_k - seqlen_q), BLOCK_N))
    # rows that see no key still run block lo, fully masked; the tile's blocks are
    # [lo, n_total), the g-th of the CTA's ring is block lo + g - kv_base
    n_mine = gl.maximum(n_mine, lo + 1)

    m_i = gl.full([ROWS], -float("inf"), gl.float32, row_s)
    l_i = gl.full([ROWS], 0.0, gl.float32, row_s)
    acc = gl.zeros([ROWS, HEAD_D], gl.float32, o_layout)
    s_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)  # per tile: no live range
    # across the epilogue (hoisted, its registers spilled in the persistent loop)

    qs, q_parity = _q_slot(tile_i, NUM_CONSUMERS, Q_BUFFERS)
    mbarrier.wait(q_bar.index(qs + cid), q_parity)
    q = q_smem.index(qs + cid)

    # block 0: S_0, its softmax
    st0 = kv_base % NUM_STAGES
    _my_turn(turn, cid, steps, PINGPONG)
    mbarrier.wait(k_ready.index(st0), (kv_base // NUM_STAGES) & 1)
    qk = warpgroup_mma(q, k_smem.index(st0).permute((1, 0)), s_zero, use_acc=False,
                       is_async=True)
    _their_turn(turn, cid, PINGPONG)
    qk = warpgroup_mma_wait(num_outstanding=0, deps=(qk, ))
    if SPLIT_KV:  # S_0 is done: K_0's buffer is free
        mbarrier.arrive(kv_empty.index(st0), count=1)
    p, alpha, m_i, l_i = _softmax_block(qk, lo, m_i, l_i, q_start, seqlen_q, seqlen_k,
                                        qk_scale, window_left, s_layout, ROWS, BLOCK_N, CAUSAL,
                                        WINDOW, SOFTCAP)
    if EARLY_P:
        p16 = gl.convert_layout(p.to(dtype), p_layout)
    for j in range(lo + 1, n_mine):
        g = kv_base + j - lo
        st = g % NUM_STAGES
        ph = (g // NUM_STAGES) & 1
        prev = (g - 1) % NUM_STAGES
        prev_ph = ((g - 1) // NUM_STAGES) & 1
        # issue S_j = Q K_j^T, then O += P_{j-1} V_{j-1}; wait only for the first
        _my_turn(turn, cid, steps + j - lo, PINGPONG)
        mbarrier.wait(k_ready.index(st), ph)
        qk = warpgroup_mma(q, k_smem.index(st).permute((1, 0)), s_zero, use_acc=False,
                           is_async=True)
        mbarrier.wait(v_ready.index(prev), prev_ph)
        if not EARLY_P:
            p16 = gl.convert_layout(p.to(dtype), p_layout)
        acc = warpgroup_mma(p16, v_smem.index(prev), acc, is_async=True)
        _their_turn(turn, cid, PINGPONG)
        qk = warpgroup_mma_wait(num_outstanding=1, deps=(qk, ))
        if SPLIT_KV:  # S_j is done: K_j's buffer is free (V_{j-1}'s once its P V is)
            mbarrier.arrive(kv_empty.index(st), count=1)
        # the softmax of S_j runs while P_{j-1} V_{j-1} is on the tensor cores
        p, alpha, m_i, l_i = _softmax_block(qk, j, m_i, l_i, q_start, seqlen_q, seqlen_k,
                                            qk_scale, window_left, s_layout, ROWS, BLOCK_N,
                                            CAUSAL, WINDOW, SOFTCAP)
        acc, p16 = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p16))
        if SPLIT_KV:
            mbarrier.arrive(v_empty.index(prev), count=1)
        else:
            mbarrier.arrive(kv_empty.index(prev), count=1)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
        if EARLY_P:
            p16 = gl.convert_layout(p.to(dtype), p_layout)
    if PERSISTENT and not TMA_STORE:  # every S of the tile is done: the producer may load
        mbarrier.arrive(q_empty.index(qs + cid), count=1)  # the next tile's Q
    # the last block's P V
    g_last = kv_base + n_mine - 1 - lo
    last = g_last % NUM_STAGES
    _my_turn(turn, cid, steps + n_mine - lo, PINGPONG)
    mbarrier.wait(v_ready.index(last), (g_last // NUM_STAGES) & 1)
    if not EARLY_P:
        p16 = gl.convert_layout(p.to(dtype), p_layout)
    acc = warpgroup_mma(p16, v_smem.index(last), acc, is_async=True)
    _their_turn(turn, cid, PINGPONG)
    acc, p16 = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p16))
    if SPLIT_KV:
        mbarrier.arrive(v_empty.index(last), count=1)
    else:
        mbarrier.arrive(kv_empty.index(last), count=1)
    # blocks the producer loads for the other consumers: keep the barrier phases in step
    for j in range(n_mine, n_total):
        g = kv_base + j - lo
        st = g % NUM_STAGES
        ph = (g // NUM_STAGES) & 1
        _my_turn(turn, cid, steps + j - lo + 1, PINGPONG)  # the other's steps alternate still
        _their_turn(turn, cid, PINGPONG)
        mbarrier.wait(k_ready.index(st), ph)
        mbarrier.wait(v_ready.index(st), ph)
        mbarrier.arrive(kv_empty.index(st), count=1)
        if SPLIT_KV:
            mbarrier.arrive(v_empty.index(st), count=1)

    # epilogue: O / l, lse = (m + log2 l) ln 2; rows that saw no key: O = 0, lse = -inf
    l_o = gl.convert_layout(l_i, row_o)
    out = acc / gl.expand_dims(gl.where(l_o == 0.0, 1.0, l_o), 1)
    rows_o = q_start + gl.arange(0, ROWS, layout=row_o)
    cols_o = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, o_layout))
    if Q_BSHD:  # O as Q: (B, N, H, D) storage seen as (B, H, N, D)
        o_rows = ((bh // heads_q) * seqlen_q + rows_o).to(gl.int64) * heads_q + bh % heads_q
    else:
        o_rows = (bh * seqlen_q + rows_o).to(gl.int64)
    offs = gl.expand_dims(o_rows * HEAD_D, 1) + gl.expand_dims(cols_o, 0)
    if TMA_STORE:
        if q_start + ROWS <= seqlen_q:  # a whole tile: no row of the view's next head
            q.store(out.to(dtype))  # every S of the tile is done: Q's buffer is free
            fence_async_shared()
            if Q_BSHD:
                o_row = (bh // heads_q) * seqlen_q + q_start
                o_col = (bh % heads_q) * HEAD_D
            else:
                o_row = bh * seqlen_q + q_start
                o_col = 0
            tma.async_copy_shared_to_global(o_desc, [o_row, o_col], q)
            tma.store_wait(0)  # the buffer is read: a later tile's Q may land in it
        else:
            gl.store(o_ptr + offs, out.to(dtype), mask=gl.expand_dims(rows_o < seqlen_q, 1))
        if PERSISTENT:
            mbarrier.arrive(q_empty.index(qs + cid), count=1)
    else:
        gl.store(o_ptr + offs, out.to(dtype), mask=gl.expand_dims(rows_o < seqlen_q, 1))
    lse = gl.where(l_i == 0.0, -float("inf"), (m_i + gl.log2(l_i)) * 0.6931471805599453)
    rows_s = q_start + gl.arange(0, ROWS, layout=row_s)
    gl.store(lse_ptr + bh.to(gl.int64) * seqlen_q + rows_s, lse, mask=rows_s < seqlen_q)

    return n_total - lo


@gluon.jit
def _consumer(cid, q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, v_ready, kv_empty, v_empty,
              turn,
              o_ptr, o_desc, lse_ptr, first, end, stride, n_mblocks, heads_q, group, seqlen_q,
              seqlen_k, qk_scale, window_left, section,
              HEAD_D: gl.constexpr, ROWS: gl.constexpr, BLOCK_N: gl.constexpr,
              NUM_STAGES: gl.constexpr, NUM_CONSUMERS: gl.constexpr, CAUSAL: gl.constexpr,
              WINDOW: gl.constexpr, PINGPONG: gl.constexpr, PERSISTENT: gl.constexpr,
              Q_BSHD: gl.constexpr, LPT: gl.constexpr, TMA_STORE: gl.constexpr,
              Q_BUFFERS: gl.constexpr, SPLIT_KV: gl.constexpr, SOFTCAP: gl.constexpr = 0.0):
    if PERSISTENT:  # key blocks and tiles of the CTA so far: ring slots and phases run on
        kv_base = 0
        tile_i = 0
        for t in range(first, end, stride):
            bh, m_block = _coords(t, n_mblocks, end, section, CAUSAL, LPT)
            kv_base += _consumer_tile(cid, q_smem, k_smem, v_smem, q_bar, q_empty, k_ready,
                                      v_ready, kv_empty, v_empty, turn, o_ptr, o_desc, lse_ptr, bh,
                                      m_block, kv_base, tile_i, heads_q, group, seqlen_q,
                                      seqlen_k, qk_scale, window_left, HEAD_D, ROWS, BLOCK_N,
                                      NUM_STAGES, NUM_CONSUMERS, CAUSAL, WINDOW, PINGPONG, True,
                                      Q_BSHD, TMA_STORE, Q_BUFFERS, SPLIT_KV, SOFTCAP)
            tile_i += 1
    else:  # a grid launch: (first, end) are the CTA's (m_block, bh)
        _consumer_tile(cid, q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, v_ready, kv_empty,
                       v_empty, turn, o_ptr, o_desc, lse_ptr, end, first, 0, 0, heads_q, group,
                       seqlen_q, seqlen_k, qk_scale, window_left, HEAD_D, ROWS, BLOCK_N,
                       NUM_STAGES, NUM_CONSUMERS, CAUSAL, WINDOW, PINGPONG, False, Q_BSHD,
                       TMA_STORE, Q_BUFFERS, SPLIT_KV, SOFTCAP)


@gluon.jit
def gluon_attn_fwd_kernel(q_desc, k_desc, v_desc, o_ptr, lse_ptr, seqlen_q, seqlen_k, heads_q,
                          group, batch_heads, qk_scale, window_left, section,
                          HEAD_D: gl.constexpr, ROWS: gl.constexpr, BLOCK_N: gl.constexpr,
                          NUM_STAGES: gl.constexpr, NUM_CONSUMERS: gl.constexpr,
                          CAUSAL: gl.constexpr, PINGPONG: gl.constexpr,
                          PERSISTENT: gl.constexpr, Q_BSHD: gl.constexpr,
                          KV_BSHD: gl.constexpr,
                          PRODUCER_REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                          WINDOW: gl.constexpr = False, LPT: gl.constexpr = False,
                          o_desc=None, TMA_STORE: gl.constexpr = False,
                          Q_BUFFERS: gl.constexpr = 1, SPLIT_KV: gl.constexpr = False,
                          SOFTCAP: gl.constexpr = 0.0):
    n_mblocks = gl.cdiv(seqlen_q, NUM_CONSUMERS * ROWS)
    if PERSISTENT:  # a CTA per SM (or fewer), each taking every stride-th tile
        first = gl.program_id(0)
        end = n_mblocks * batch_heads
        stride = gl.num_programs(0)
    else:  # a CTA per tile: (query block, batch x head), passed as (first, end) below
        first = gl.program_id(0)
        if CAUSAL:  # the longest rows (most key blocks) first, so the short ones fill the tail
            first = gl.num_programs(0) - 1 - first
        end = gl.program_id(1)
        stride = 1

    dtype: gl.constexpr = q_desc.dtype
    gl.static_assert(Q_BUFFERS == 1 or Q_BUFFERS == 2)
    if not PERSISTENT:  # one tile per CTA: nothing to alternate
        gl.static_assert(Q_BUFFERS == 1)
    q_smem = gl.allocate_shared_memory(dtype, [Q_BUFFERS * NUM_CONSUMERS, ROWS, HEAD_D],
                                       q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, HEAD_D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, HEAD_D], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [Q_BUFFERS * NUM_CONSUMERS, 1],
                                      mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [Q_BUFFERS * NUM_CONSUMERS, 1],
                                        mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = kv_empty  # SPLIT_KV: a V buffer's own barrier; kv_empty then guards K's only
    if SPLIT_KV:
        v_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1],
                                            mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(turn.index(0), count=1)
    mbarrier.init(turn.index(1), count=1)
    for c in gl.static_range(Q_BUFFERS * NUM_CONSUMERS):
        mbarrier.init(q_bar.index(c), count=1)
        mbarrier.init(q_empty.index(c), count=1)
    for s in gl.static_range(NUM_STAGES):
        mbarrier.init(k_ready.index(s), count=1)
        mbarrier.init(v_ready.index(s), count=1)
        mbarrier.init(kv_empty.index(s), count=NUM_CONSUMERS)
        if SPLIT_KV:
            mbarrier.init(v_empty.index(s), count=NUM_CONSUMERS)

    gl.static_assert(NUM_CONSUMERS >= 1 and NUM_CONSUMERS <= 3)
    gl.static_assert(not PINGPONG or NUM_CONSUMERS == 2)
    # (a partition's tuple cannot be named: the frontend reads a name as a tensor)
    if NUM_CONSUMERS == 1:
        gl.warp_specialize([
            (_consumer, (0, q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, v_ready, kv_empty,
                         v_empty, turn, o_ptr, o_desc, lse_ptr, first, end, stride, n_mblocks, heads_q,
                         group, seqlen_q, seqlen_k, qk_scale, window_left, section, HEAD_D,
                         ROWS, BLOCK_N, NUM_STAGES, NUM_CONSUMERS, CAUSAL, WINDOW, PINGPONG,
                         PERSISTENT, Q_BSHD, LPT, TMA_STORE, Q_BUFFERS, SPLIT_KV, SOFTCAP)),
            (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, q_empty,
                         k_ready, v_ready, kv_empty, v_empty, first, end, stride, n_mblocks, heads_q,
                         group, seqlen_q, seqlen_k, window_left, section, ROWS,
                         BLOCK_N, NUM_STAGES, NUM_CONSUMERS, CAUSAL, WINDOW, PERSISTENT, Q_BSHD,
                         KV_BSHD, LPT, Q_BUFFERS, SPLIT_KV)),
        ], [1], [PRODUCER_REGS])
    elif NUM_CONSUMERS == 2:
        gl.warp_specialize([
            (_consumer, (0, q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, v_ready, kv_empty,
                         v_empty, turn, o_ptr, o_desc, lse_ptr, first, end, stride, n_mblocks, heads_q,
                         group, seqlen_q, seqlen_k, qk_scale, window_left, section, HEAD_D,
                         ROWS, BLOCK_N, NUM_STAGES, NUM_CONSUMERS, CAUSAL, WINDOW, PINGPONG,
                         PERSISTENT, Q_BSHD, LPT, TMA_STORE, Q_BUFFERS, SPLIT_KV, SOFTCAP)),
            (_consumer, (1, q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, v_ready, kv_empty,
                         v_empty, turn, o_ptr, o_desc, lse_ptr, first, end, stride, n_mblocks, heads_q,
                         group, seqlen_q, seqlen_k, qk_scale, window_left, section, HEAD_D,
                         ROWS, BLOCK_N, NUM_STAGES, NUM_CONSUMERS, CAUSAL, WINDOW, PINGPONG,
                         PERSISTENT, Q_BSHD, LPT, TMA_STORE, Q_BUFFERS, SPLIT_KV, SOFTCAP)),
            (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, q_empty,
                         k_ready, v_ready, kv_empty, v_empty, first, end, stride, n_mblocks, heads_q,
                         group, seqlen_q, seqlen_k, window_left, section, ROWS,
                         BLOCK_N, NUM_STAGES, NUM_CONSUMERS, CAUSAL, WINDOW, PERSISTENT, Q_BSHD,
                         KV_BSHD, LPT, Q_BUFFERS, SPLIT_KV)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    else:  # FA3's 192-row tile at head dim 64: three consumer warpgroups
        gl.warp_specialize([
            (_consumer, (0, q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, v_ready, kv_empty,
                         v_empty, turn, o_ptr, o_desc, lse_ptr, first, end, stride, n_mblocks, heads_q,
                         group, seqlen_q, seqlen_k, qk_scale, window_left, section, HEAD_D,
                         ROWS, BLOCK_N, NUM_STAGES, NUM_CONSUMERS, CAUSAL, WINDOW, PINGPONG,
                         PERSISTENT, Q_BSHD, LPT, TMA_STORE, Q_BUFFERS, SPLIT_KV, SOFTCAP)),
            (_consumer, (1, q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, v_ready, kv_empty,
                         v_empty, turn, o_ptr, o_desc, lse_ptr, first, end, stride, n_mblocks, heads_q,
                         group, seqlen_q, seqlen_k, qk_scale, window_left, section, HEAD_D,
                         ROWS, BLOCK_N, NUM_STAGES, NUM_CONSUMERS, CAUSAL, WINDOW, PINGPONG,
                         PERSISTENT, Q_BSHD, LPT, TMA_STORE, Q_BUFFERS, SPLIT_KV, SOFTCAP)),
            (_consumer, (2, q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, v_ready, kv_empty,
                         v_empty, turn, o_ptr, o_desc, lse_ptr, first, end, stride, n_mblocks, heads_q,
                         group, seqlen_q, seqlen_k, qk_scale, window_left, section, HEAD_D,
                         ROWS, BLOCK_N, NUM_STAGES, NUM_CONSUMERS, CAUSAL, WINDOW, PINGPONG,
                         PERSISTENT, Q_BSHD, LPT, TMA_STORE, Q_BUFFERS, SPLIT_KV, SOFTCAP)),
            (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, q_empty,
                         k_ready, v_ready, kv_empty, v_empty, first, end, stride, n_mblocks, heads_q,
                         group, seqlen_q, seqlen_k, window_left, section, ROWS,
                         BLOCK_N, NUM_STAGES, NUM_CONSUMERS, CAUSAL, WINDOW, PERSISTENT, Q_BSHD,
                         KV_BSHD, LPT, Q_BUFFERS, SPLIT_KV)),
        ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS])
