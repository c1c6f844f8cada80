"""The Gluon backward's kernels (``@gluon.jit`` only; the package doc describes the
structure, :mod:`.launcher` plans and launches them).

* ``gluon_attn_bwd_preprocess``: per query row ``delta = rowsum(dO * O) - dLSE`` and
  ``lse * log2(e)`` (``+inf`` where the row sees no key, and in the padding rows up to the
  query tile, so their probabilities are 0), both into ``(B * Hq, Nq_pad)`` float32 rows,
  and the fp32 dQ accumulator's rows zeroed;
* ``gluon_attn_bwd_kernel``: one CTA per (key block, batch x KV head) (in the order
  ``_tile`` gives: a head's key blocks side by side, or with ``LPT`` longest first in
  sections of heads), warp specialized
  as FA3's sm90 backward: ``_producer`` (1 warp) TMA-loads the CTA's K and V once and
  streams Q and dO tiles (and the rows' LSE and delta, by cp.async) of every query block
  (of every query head of the GQA group) that sees the key block through a ring of
  ``NUM_STAGES`` buffers; ``_consumer`` (``NUM_CONSUMERS`` warpgroups, each owning
  ``BLOCK_N // NUM_CONSUMERS`` keys) computes ``S^T = K Q^T``, ``P^T``, ``dP^T = V dO^T``,
  ``dS^T`` (to shared memory), accumulates ``dV += P^T dO`` and ``dK += dS^T Q`` in
  registers, and, once every consumer's ``dS^T`` rows are in, its ``HEAD_D //
  NUM_CONSUMERS`` columns of ``dS K`` over all the CTA's keys (one dQ partial a CTA and
  step) into shared memory; ``_dq_writer`` (2 warps) adds each step's partial to the fp32
  accumulator with vector atomics while the consumers go on;
* ``gluon_attn_bwd_convert_dq``: ``dQ = scale * accumulator`` cast to the input dtype.

At D256 (``_split_d``) the main kernel is ``_split_d_kernel``: the same producer, and two
``_consumer_d`` warpgroups that split the head dim, not the keys (dK and dV of a 64-key
block, 64 x 256 fp32 each, would take a warpgroup's every register): each computes ``S^T``
and ``dP^T`` of every key for half the step's query rows, writes its columns of the step's
``P^T`` and ``dS^T`` to shared memory, and once both halves are in accumulates its half of
dK's and dV's columns and adds its half of the step's ``dS K`` to the fp32 accumulator by
atomics itself (FA3's hdim 256 backward: no dQ writer, whose staging tile would not fit).

``_steps`` and ``_step_block`` are the one place the partitions read the CTA's walk from
(which query blocks, how many steps, in which order); keep them in step. Under a causal
mask at D64 (``DIAGONAL_LAST_MAX_D``) the walk runs the blocks no key of the CTA's block is
masked in first, from the last down, and the mask's diagonal last, so that the consumers
run the two in loops of their own (``_consumer_step``'s ``MASK``): the unmasked loop has no
mask and no branch on one (FA3's backward splits its loop the same way).

``PERSISTENT`` (dense batches): at most one CTA an SM, CTA ``i`` of ``P`` walking the grid
launch's tiles ``i, i + P, ...`` (``_tile_at`` numbers them as the grid's CTAs); each
partition runs its ``_*_tile`` body per tile with the CTA's steps so far (``step0``), so
ring slots and barrier phases run on across tiles, and a ``kv_empty`` barrier (the
consumers done with a tile's K and V) lets the producer load the next tile's K and V while
the consumers store dK and dV. Off, each partition runs its body once for the CTA's grid
tile: the code it was (the same sm_90a instructions).

``TMA_STORE`` (FA3's ``epilogue_bwd``): a consumer writes its dV into its own rows of V's
shared buffer and, once every consumer's last ``dS K`` has read K (the tile's last
``dq_full`` phase), its dK into its rows of K's, then stores both by TMA (``dk_desc``,
``dv_desc``); a block past the keys' end is stored from registers as without it. The
register stores it replaces were three quarters of a D128 grid CTA's fixed cost.

``WINDOW`` (with ``CAUSAL``; ``window_left`` keys before each query, FlashAttention-2's
``window_size = (left, 0)``): ``_steps`` ends a key block's walk at the last query block
that sees it, the consumers mask the window's edge behind the causal branch, and the D64
walk keeps one loop (``_diagonal_last``). ``SOFTCAP`` (the cap times log2 e): the consumers
recompute the forward's capped P and take dS through the tanh (``_consumer_step``). Both
constexprs are off by default: the kernel without them is the code it was.

``VARLEN`` (FlashAttention-2's ``flash_attn_varlen_func`` layout; off: the dense code, as it
was): Q, K, V, dO, O and the gradients are packed ``(total, H, D)``, ``b`` indexes the
sequences of ``cu_seqlens`` (``cu_q_ptr``, ``cu_k_ptr``) and every program reads its
sequence's start and lengths there (``_seq``); the grids and ``seqlen_q``/``seqlen_k``
cover the longest sequence. The TMA views are ``(total, H * D)``: a tile that runs past its
sequence reads the next one's rows (or zeros past ``total``), which contribute nothing:
the scratch rows stay padded per sequence (``(B * Hq, Nq_pad)``, ``Nq_pad`` the longest
query rounded up to ``BLOCK_M``), so a query row past its sequence has LSE ``+inf`` (P and
dS are 0) and its zero dQ partial lands in its own sequence's padding rows; a key past it
is masked by the sequence's length. A key block past its sequence's end walks no step and
its CTA loads and stores nothing.
"""

from __future__ import annotations

from triton._C.libtriton import ir as _ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

# a consumer step's masking (``_consumer_step``'s ``MASK``)
MASK_NONE: gl.constexpr = gl.constexpr(0)
MASK_BRANCH: gl.constexpr = gl.constexpr(1)
MASK_DIAGONAL: gl.constexpr = gl.constexpr(2)
# the largest head dim whose causal walks run the mask's diagonal last, in a loop of its own
# (``_step_block``); at D128 ptxas spills in the unmasked loop
DIAGONAL_LAST_MAX_D: gl.constexpr = gl.constexpr(64)
# the smallest head dim whose consumers split the head dim, not the keys (``_split_d``)
SPLIT_D_MIN_D: gl.constexpr = gl.constexpr(256)


@gluon.constexpr_function
def _diagonal_last(causal, window, head_dim):
    """Whether a walk runs the causal mask's diagonal last (``_step_block``): causal, at
    most :data:`DIAGONAL_LAST_MAX_D`, and no window (whose edge masks the walk's last
    blocks too: those walks run the mask behind a branch)."""
    return causal and head_dim <= DIAGONAL_LAST_MAX_D and not window


@gluon.jit
def gluon_attn_bwd_preprocess(o_ptr, do_ptr, lse_ptr, dlse_ptr, lse2_ptr, delta_ptr,
                              dq_acc_ptr, stride_ob, stride_oh, stride_on, stride_dob,
                              stride_doh, stride_don, stride_lb, stride_lh, stride_ln,
                              heads_q, seqlen_q, seqlen_q_pad, cu_q_ptr,
                              HEAD_D: gl.constexpr, BLOCK: gl.constexpr,
                              HAS_DLSE: gl.constexpr, VARLEN: gl.constexpr):
    """``seqlen_q``: the query length, the LSE's row length; with ``VARLEN`` ``total_q``
    (the LSE is ``(Hq, total_q)``, the batch strides 0: rows from the sequence's start).
    ``cu_q_ptr``: VARLEN's ``cu_seqlens_q`` (None without it), after the dense parameters
    so that those keep their places (and the dense code its bits), as in the other two."""
    layout: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [gl.num_warps(), 1], [1, 0])
    row_l: gl.constexpr = gl.SliceLayout(1, layout)
    col_l: gl.constexpr = gl.SliceLayout(0, layout)
    bh = gl.program_id(1)
    b = bh // heads_q
    h = bh % heads_q
    rows = gl.program_id(0) * BLOCK + gl.arange(0, BLOCK, layout=row_l)
    cols = gl.arange(0, HEAD_D, layout=col_l)
    if VARLEN:
        q_start, len_q = _seq(cu_q_ptr, b)
        valid = rows < len_q
        r64 = (q_start + rows).to(gl.int64)
    else:
        valid = rows < seqlen_q
        r64 = rows.to(gl.int64)
    o_offs = b.to(gl.int64) * stride_ob + h.to(gl.int64) * stride_oh \
        + gl.expand_dims(r64 * stride_on, 1) + gl.expand_dims(cols, 0)
    do_offs = b.to(gl.int64) * stride_dob + h.to(gl.int64) * stride_doh \
        + gl.expand_dims(r64 * stride_don, 1) + gl.expand_dims(cols, 0)
    m2 = gl.expand_dims(valid, 1)
    o = gl.load(o_ptr + o_offs, mask=m2, other=0.0).to(gl.float32)
    do = gl.load(do_ptr + do_offs, mask=m2, other=0.0).to(gl.float32)
    delta = gl.sum(o * do, axis=1)
    if VARLEN:
        lse = gl.load(lse_ptr + h.to(gl.int64) * seqlen_q + r64, mask=valid,
                      other=float("inf"))
    else:
        lse = gl.load(lse_ptr + bh.to(gl.int64) * seqlen_q + rows, mask=valid,
                      other=float("inf"))
    if HAS_DLSE:  # d lse_i / d s_ij = p_ij: dS = P (dP - (delta - dlse))
        dlse = gl.load(dlse_ptr + b.to(gl.int64) * stride_lb + h.to(gl.int64) * stride_lh
                       + r64 * stride_ln, mask=valid, other=0.0)
        delta = delta - dlse
    # a row that sees no key (lse -inf) or a padding row: +inf, so exp2(s - lse2) = 0
    lse2 = gl.where(lse == -float("inf"), float("inf"), lse * 1.4426950408889634)
    out_rows = bh.to(gl.int64) * seqlen_q_pad + rows
    in_pad = rows < seqlen_q_pad
    gl.store(lse2_ptr + out_rows, lse2, mask=in_pad)
    gl.store(delta_ptr + out_rows, gl.where(valid, delta, 0.0), mask=in_pad)
    acc_offs = gl.expand_dims(out_rows * HEAD_D, 1) + gl.expand_dims(cols, 0)
    gl.store(dq_acc_ptr + acc_offs, gl.zeros([BLOCK, HEAD_D], gl.float32, layout),
             mask=gl.expand_dims(in_pad, 1))


@gluon.jit
def gluon_attn_bwd_convert_dq(dq_acc_ptr, dq_ptr, stride_b, stride_h, stride_n, heads_q,
                              seqlen_q, seqlen_q_pad, scale, cu_q_ptr, HEAD_D: gl.constexpr,
                              BLOCK: gl.constexpr, VARLEN: gl.constexpr):
    layout: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [gl.num_warps(), 1], [1, 0])
    bh = gl.program_id(1)
    b = bh // heads_q
    h = bh % heads_q
    rows = gl.program_id(0) * BLOCK + gl.arange(0, BLOCK, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, layout))
    if VARLEN:
        q_start, len_q = _seq(cu_q_ptr, b)
        m2 = gl.expand_dims(rows < len_q, 1)
    else:
        m2 = gl.expand_dims(rows < seqlen_q, 1)
    acc_rows = bh.to(gl.int64) * seqlen_q_pad + rows
    acc = gl.load(dq_acc_ptr + gl.expand_dims(acc_rows * HEAD_D, 1) + gl.expand_dims(cols, 0),
                  mask=m2, other=0.0)
    if VARLEN:  # the packed rows from the sequence's start
        offs = h.to(gl.int64) * stride_h \
            + gl.expand_dims((q_start + rows).to(gl.int64) * stride_n, 1) \
            + gl.expand_dims(cols, 0)
    else:
        offs = b.to(gl.int64) * stride_b + h.to(gl.int64) * stride_h \
            + gl.expand_dims(rows.to(gl.int64) * stride_n, 1) + gl.expand_dims(cols, 0)
    gl.store(dq_ptr + offs, (acc * scale).to(dq_ptr.dtype.element_ty), mask=m2)


@builtin
def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    """``global[coord] += src`` (a shared-memory tile) by one TMA bulk reduce-add
    (``cp.reduce.async.bulk.tensor``, FA3's dQ writer), as ``tma.async_copy_shared_to_global``
    stores: Gluon 3.6's builder has the op, its Hopper module no wrapper. Wait with
    ``tma.store_wait`` before the tile is written again."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(_ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle,
                                              coord, src.handle)


@gluon.jit
def _tanh(x):
    """The hardware's ``tanh.approx.f32``, as the Gluon forward's softcap (its ``_tanh``,
    kept here so that the forward's files stay out of this kernel's source hash): the
    backward recomputes the forward's P with the same tanh."""
    return gl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x],
                                     dtype=gl.float32, is_pure=True, pack=1)


@gluon.jit
def _log2(x):
    """The hardware's ``lg2.approx.f32`` (one MUFU op; ``gl.log2`` is libdevice's, a
    polynomial of some 14 FMAs an element, which spilled the D128 consumers' main loop)."""
    return gl.inline_asm_elementwise("lg2.approx.f32 $0, $1;", "=f,f", [x],
                                     dtype=gl.float32, is_pure=True, pack=1)


@gluon.jit
def _seq(cu_ptr, b):
    """``(start, length)`` of packed sequence ``b`` (VARLEN)."""
    start = gl.load(cu_ptr + b)
    return start, gl.load(cu_ptr + b + 1) - start


@gluon.jit
def _steps(n_block, seqlen_q, seqlen_k, group, window_left, BLOCK_M: gl.constexpr,
           BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, VARLEN: gl.constexpr,
           WINDOW: gl.constexpr):
    """The CTA's walk: its first query block ``m_lo`` and per query head ``n_m`` blocks
    (``m_lo .. m_lo + n_m - 1``; causal: from the first block whose last row sees the key
    block's first key, bottom-right aligned; ``WINDOW``: up to the last block whose first
    row still sees the key block's last key, ``window_left`` keys back); ``group * n_m``
    steps in all. ``VARLEN``: the sequence's lengths, and no step for a key block past its
    end (the grid covers the longest sequence; dense, every key block holds a key, but
    under a window the keys before every query's window are seen by none: no step)."""
    m_lo = 0
    if CAUSAL:  # query i sees key j iff j <= i + seqlen_k - seqlen_q
        m_lo = gl.maximum(n_block * BLOCK_N - (seqlen_k - seqlen_q), 0) // BLOCK_M
    n_m = gl.maximum(gl.cdiv(seqlen_q, BLOCK_M) - m_lo, 0)
    if WINDOW:  # ... and j >= i + seqlen_k - seqlen_q - window_left: the rows up to
        # (block end - 1) + window_left - (seqlen_k - seqlen_q) see a key of the block (the
        # count of blocks through that row, clamped at 0 before the division truncates)
        last = n_block * BLOCK_N + BLOCK_N - 1 + window_left - (seqlen_k - seqlen_q)
        m_hi = gl.maximum(last + BLOCK_M, 0) // BLOCK_M
        n_m = gl.maximum(gl.minimum(gl.cdiv(seqlen_q, BLOCK_M), m_hi) - m_lo, 0)
    if VARLEN:
        n_m = gl.where(n_block * BLOCK_N < seqlen_k, n_m, 0)
    return m_lo, n_m, group * n_m


@gluon.jit
def _step_block(t, m_lo, n_m, n_diag, group, DIAGONAL_LAST: gl.constexpr):
    """Step ``t``'s query head in the GQA group and query block (the walk of :func:`_steps`:
    ``n_m`` blocks from ``m_lo`` per head), the same in the three partitions. A head's blocks
    up from ``m_lo``, head after head; with ``DIAGONAL_LAST`` every head's blocks that no key
    of the CTA's block is masked in, from the last down, then every head's ``n_diag`` blocks
    of the causal mask's diagonal (the first ones, :func:`_masked_steps`), so that the
    consumers run the steps the mask touches in a loop of their own, after the others."""
    if DIAGONAL_LAST:
        u = n_m - n_diag
        first = t < group * u
        r = t - group * u
        u1 = gl.maximum(u, 1)
        d1 = gl.maximum(n_diag, 1)
        return (gl.where(first, t // u1, r // d1),
                gl.where(first, m_lo + n_m - 1 - t % u1, m_lo + n_diag - 1 - r % d1))
    return t // n_m, m_lo + t % n_m


@gluon.jit
def _tile(seqlen_k, section_log2, BLOCK_N: gl.constexpr, LPT: gl.constexpr):
    """The CTA's key block and ``batch * heads_kv + kv_head`` (every partition reads its tile
    here). ``LPT`` 0: the 2-D grid ``(key block, batch x KV head)``, a head's key blocks
    side by side (they share its Q and dO in L2). ``LPT`` 1: a 1-D grid in sections of
    ``2 ** section_log2`` heads (as many as L2 holds the Q, dO and dQ rows of, dividing the
    batch's heads; the launcher's :func:`lpt_section`), key block outer, heads inner: under a causal
    mask the longest walks (the first key blocks, seen by every later query) start first
    and the shortest fill the tail (FA3's longest-processing-time order). Shifts and masks
    but one division: the partitions run on 24 registers."""
    n_block = gl.program_id(0)
    bhk = gl.program_id(1)
    if LPT:
        per = gl.cdiv(seqlen_k, BLOCK_N) << section_log2  # CTAs of a section
        sec = n_block // per
        r = n_block - sec * per
        bhk = (sec << section_log2) + (r & ((1 << section_log2) - 1))
        n_block = r >> section_log2
    return n_block, bhk


@gluon.jit
def _tile_at(tid, seqlen_k, section_log2, BLOCK_N: gl.constexpr, LPT: gl.constexpr):
    """``_tile`` for a persistent CTA's tile ``tid`` (``PERSISTENT``: CTA ``i`` of ``P``
    takes tiles ``i, i + P, ...``): the grid launch's order, numbered as its CTAs would
    be (``LPT`` 0: a head's key blocks side by side; ``LPT`` 1: the sections)."""
    n_kb = gl.cdiv(seqlen_k, BLOCK_N)
    if LPT:
        per = n_kb << section_log2
        sec = tid // per
        r = tid - sec * per
        return r >> section_log2, (sec << section_log2) + (r & ((1 << section_log2) - 1))
    bhk = tid // n_kb
    return tid - bhk * n_kb, bhk


@gluon.jit
def _q_coords(b, h, m, heads_q, seqlen_q, HEAD_D: gl.constexpr, BLOCK_M: gl.constexpr,
              Q_BSHD: gl.constexpr):
    """``[row, column]`` of query block ``m`` of head ``h`` of batch ``b`` in Q's (and
    dO's) 2-D TMA view: ``(B * H * N, D)``, or ``(B * N, H * D)`` with ``Q_BSHD``."""
    if Q_BSHD:
        return b * seqlen_q + m * BLOCK_M, h * HEAD_D
    return (b * heads_q + h) * seqlen_q + m * BLOCK_M, 0


@gluon.jit
def _kv_coords(b, hk, bhk, key, seqlen_k, k_start, HEAD_D: gl.constexpr,
               KV_BSHD: gl.constexpr, VARLEN: gl.constexpr):
    """``[row, column]`` of key ``key`` of KV head ``hk`` of batch ``b`` (``bhk`` = ``b *
    heads_kv + hk``) in K's 2-D TMA view (V's, dK's and dV's alike): ``(B * H * N, D)``,
    ``(B * N, H * D)`` with ``KV_BSHD``, or with ``VARLEN`` ``(total, H * D)`` from the
    sequence's first row ``k_start``."""
    if VARLEN:
        return k_start + key, hk * HEAD_D
    if KV_BSHD:
        return b * seqlen_k + key, hk * HEAD_D
    return bhk * seqlen_k + key, 0


@gluon.jit
def _producer(q_desc, k_desc, v_desc, do_desc, q_smem, do_smem, k_smem, v_smem, lse_smem,
              delta_smem, kv_bar, kv_empty, q_ready, do_ready, qdo_empty, lse2_ptr, delta_ptr,
              cu_q_ptr, cu_k_ptr, seqlen_q, seqlen_k, seqlen_q_pad, heads_q, heads_kv,
              section_log2, first, end, stride,
              HEAD_D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr, Q_BSHD: gl.constexpr,
              KV_BSHD: gl.constexpr, LPT: gl.constexpr, VARLEN: gl.constexpr,
              PERSISTENT: gl.constexpr, KV_GROUP: gl.constexpr, window_left,
              WINDOW: gl.constexpr):
    if PERSISTENT:  # steps and tiles of the CTA so far: ring slots and phases run on
        step0 = 0
        tile_i = 0
        for tid in range(first, end, stride):
            n_block, bhk = _tile_at(tid, seqlen_k, section_log2, BLOCK_N, LPT)
            step0 += _producer_tile(q_desc, k_desc, v_desc, do_desc, q_smem, do_smem, k_smem,
                                   v_smem, lse_smem, delta_smem, kv_bar, kv_empty, q_ready,
                                   do_ready, qdo_empty, lse2_ptr, delta_ptr, cu_q_ptr, cu_k_ptr,
                                   seqlen_q, seqlen_k, seqlen_q_pad, heads_q, heads_kv,
                                   n_block, bhk, step0, tile_i, HEAD_D, BLOCK_M, BLOCK_N,
                                   NUM_STAGES, CAUSAL, Q_BSHD, KV_BSHD, VARLEN, True,
                                   KV_GROUP, window_left, WINDOW)
            tile_i += 1
    else:
        n_block, bhk = _tile(seqlen_k, section_log2, BLOCK_N, LPT)
        _producer_tile(q_desc, k_desc, v_desc, do_desc, q_smem, do_smem, k_smem, v_smem,
                       lse_smem, delta_smem, kv_bar, kv_empty, q_ready, do_ready, qdo_empty,
                       lse2_ptr, delta_ptr, cu_q_ptr, cu_k_ptr, seqlen_q, seqlen_k,
                       seqlen_q_pad, heads_q, heads_kv, n_block, bhk, 0, 0, HEAD_D, BLOCK_M,
                       BLOCK_N, NUM_STAGES, CAUSAL, Q_BSHD, KV_BSHD, VARLEN, False, KV_GROUP,
                       window_left, WINDOW)


@gluon.jit
def _producer_tile(q_desc, k_desc, v_desc, do_desc, q_smem, do_smem, k_smem, v_smem, lse_smem,
                   delta_smem, kv_bar, kv_empty, q_ready, do_ready, qdo_empty, lse2_ptr,
                   delta_ptr, cu_q_ptr, cu_k_ptr, seqlen_q, seqlen_k, seqlen_q_pad, heads_q,
                   heads_kv, n_block, bhk, step0, tile_i,
                   HEAD_D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                   NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr, Q_BSHD: gl.constexpr,
                   KV_BSHD: gl.constexpr, VARLEN: gl.constexpr, PERSISTENT: gl.constexpr,
                   KV_GROUP: gl.constexpr, window_left, WINDOW: gl.constexpr):
    """One tile's loads: K and V once, then Q, dO and the rows' LSE and delta of every
    step through the ring (ring step ``step0 + t``: the CTA's earlier tiles took ``step0``);
    returns the tile's steps. ``KV_GROUP`` > 1: the launch runs a GQA problem per query
    head (``heads_kv`` counts the query heads, ``hk`` is one), whose K and V are its
    group's, head ``hk // KV_GROUP`` of K's own ``heads_kv // KV_GROUP``."""
    b = bhk // heads_kv
    hk = bhk % heads_kv
    group = heads_q // heads_kv
    # K and V of the CTA's keys, once
    k_start = 0
    if VARLEN:  # the (total, H * D) views from the sequences' starts
        q_start, seqlen_q = _seq(cu_q_ptr, b)
        k_start, seqlen_k = _seq(cu_k_ptr, b)
    kv_hk = hk  # K's and V's head (KV_GROUP > 1: the query head's group's)
    kv_bhk = bhk
    if KV_GROUP > 1:
        kv_hk = hk // KV_GROUP
        kv_bhk = b * (heads_kv // KV_GROUP) + kv_hk
    kv_row, kv_col = _kv_coords(b, kv_hk, kv_bhk, n_block * BLOCK_N, seqlen_k, k_start, HEAD_D,
                                KV_BSHD, VARLEN)
    rows_layout: gl.constexpr = gl.BlockedLayout([BLOCK_M // 32], [32], [1], [0])
    rows = gl.arange(0, BLOCK_M, layout=rows_layout)
    if VARLEN:  # no step, no K and V (the consumers wait for them on the same condition)
        m_lo, n_m, total = _steps(n_block, seqlen_q, seqlen_k, group, window_left, BLOCK_M,
                                  BLOCK_N, CAUSAL, VARLEN, WINDOW)
        live = total > 0
        mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes,
                        pred=live)
        tma.async_copy_global_to_shared(k_desc, [kv_row, kv_col], kv_bar, k_smem, pred=live)
        tma.async_copy_global_to_shared(v_desc, [kv_row, kv_col], kv_bar, v_smem, pred=live)
    else:
        if PERSISTENT:  # the consumers are done with the last tile's K and V (a fresh
            # mbarrier counts as phase 1 complete: the first tile passes)
            mbarrier.wait(kv_empty, (tile_i & 1) ^ 1)
        mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [kv_row, kv_col], kv_bar, k_smem)
        tma.async_copy_global_to_shared(v_desc, [kv_row, kv_col], kv_bar, v_smem)
        m_lo, n_m, total = _steps(n_block, seqlen_q, seqlen_k, group, window_left, BLOCK_M,
                                  BLOCK_N, CAUSAL, VARLEN, WINDOW)
    DIAGONAL_LAST: gl.constexpr = _diagonal_last(CAUSAL, WINDOW, HEAD_D)
    n_diag = 0
    if DIAGONAL_LAST:
        n_diag = _masked_steps(n_block * BLOCK_N, m_lo, n_m, seqlen_q, seqlen_k, BLOCK_M,
                               BLOCK_N)
    for t in range(total):
        j, m = _step_block(t, m_lo, n_m, n_diag, group, DIAGONAL_LAST)
        h = hk * group + j
        st = (step0 + t) % NUM_STAGES
        # a fresh mbarrier counts as phase 1 complete: the first NUM_STAGES waits pass
        mbarrier.wait(qdo_empty.index(st), (((step0 + t) // NUM_STAGES) & 1) ^ 1)
        # the rows' LSE and delta (padded rows: no mask) by cp.async, on q_ready: the
        # arrive counts itself in, so the phase also waits for them (FA3 loads them with Q)
        q_row0 = (b * heads_q + h).to(gl.int64) * seqlen_q_pad + m * BLOCK_M
        async_copy.async_copy_global_to_shared(lse_smem.index(st), lse2_ptr + q_row0 + rows)
        async_copy.async_copy_global_to_shared(delta_smem.index(st),
                                               delta_ptr + q_row0 + rows)
        async_copy.mbarrier_arrive(q_ready.index(st))
        if VARLEN:
            row = q_start + m * BLOCK_M
            col = h * HEAD_D
        else:
            row, col = _q_coords(b, h, m, heads_q, seqlen_q, HEAD_D, BLOCK_M, Q_BSHD)
        mbarrier.expect(q_ready.index(st), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [row, col], q_ready.index(st),
                                        q_smem.index(st))
        mbarrier.expect(do_ready.index(st), do_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(do_desc, [row, col], do_ready.index(st),
                                        do_smem.index(st))
    return total


@gluon.jit
def _dq_writer(dq_smem, dq_full, dq_empty, dq_acc_ptr, dq_desc, cu_q_ptr, cu_k_ptr, seqlen_q,
               seqlen_k, seqlen_q_pad, heads_q, heads_kv, section_log2, first, end, stride,
               HEAD_D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
               NUM_CONSUMERS: gl.constexpr, CAUSAL: gl.constexpr, LPT: gl.constexpr,
               VARLEN: gl.constexpr, PERSISTENT: gl.constexpr, DQ_TMA: gl.constexpr,
               window_left, WINDOW: gl.constexpr):
    """Two warps: each step's ``dS K`` (the consumers' column slices in ``dq_smem``) added
    to the fp32 accumulator's rows off the consumers' path: vector atomics, or with
    ``DQ_TMA`` TMA bulk reduce-adds (FA3's dQ writer warp)."""
    if PERSISTENT:
        step0 = 0
        for tid in range(first, end, stride):
            n_block, bhk = _tile_at(tid, seqlen_k, section_log2, BLOCK_N, LPT)
            step0 += _dq_writer_tile(dq_smem, dq_full, dq_empty, dq_acc_ptr, dq_desc, cu_q_ptr,
                                    cu_k_ptr, seqlen_q, seqlen_k, seqlen_q_pad, heads_q,
                                    heads_kv, n_block, bhk, step0, HEAD_D, BLOCK_M, BLOCK_N,
                                    NUM_CONSUMERS, CAUSAL, VARLEN, DQ_TMA, window_left,
                                    WINDOW)
    else:
        n_block, bhk = _tile(seqlen_k, section_log2, BLOCK_N, LPT)
        _dq_writer_tile(dq_smem, dq_full, dq_empty, dq_acc_ptr, dq_desc, cu_q_ptr, cu_k_ptr,
                        seqlen_q, seqlen_k, seqlen_q_pad, heads_q, heads_kv, n_block, bhk, 0,
                        HEAD_D, BLOCK_M, BLOCK_N, NUM_CONSUMERS, CAUSAL, VARLEN, DQ_TMA,
                        window_left, WINDOW)


@gluon.jit
def _dq_writer_tile(dq_smem, dq_full, dq_empty, dq_acc_ptr, dq_desc, cu_q_ptr, cu_k_ptr,
                    seqlen_q, seqlen_k, seqlen_q_pad, heads_q, heads_kv, n_block, bhk, step0,
                    HEAD_D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                    NUM_CONSUMERS: gl.constexpr, CAUSAL: gl.constexpr, VARLEN: gl.constexpr,
                    DQ_TMA: gl.constexpr, window_left, WINDOW: gl.constexpr):
    """One tile's dQ partials (the CTA's step ``step0 + t``); returns the tile's steps.
    ``DQ_TMA``: each consumer's slice by one TMA bulk reduce-add (``dq_desc``, the
    accumulator's rows), waited for before the buffer is handed back; else vector atomics."""
    DQ_COLS: gl.constexpr = HEAD_D // NUM_CONSUMERS
    LANES_C: gl.constexpr = DQ_COLS // 4
    CHUNK: gl.constexpr = 8  # rows a load: dq_smem's swizzle period
    layout: gl.constexpr = gl.BlockedLayout([1, 4], [32 // LANES_C, LANES_C],
                                            [gl.num_warps(), 1], [1, 0])
    offs = gl.expand_dims(gl.arange(0, CHUNK, layout=gl.SliceLayout(1, layout)) * HEAD_D, 1) \
        + gl.expand_dims(gl.arange(0, DQ_COLS, layout=gl.SliceLayout(0, layout)), 0)
    b = bhk // heads_kv
    hk = bhk % heads_kv
    group = heads_q // heads_kv
    if VARLEN:  # the padded scratch rows as dense; the walk by the sequence's lengths
        _, seqlen_q = _seq(cu_q_ptr, b)
        _, seqlen_k = _seq(cu_k_ptr, b)
    m_lo, n_m, total = _steps(n_block, seqlen_q, seqlen_k, group, window_left, BLOCK_M,
                              BLOCK_N, CAUSAL, VARLEN, WINDOW)
    DIAGONAL_LAST: gl.constexpr = _diagonal_last(CAUSAL, WINDOW, HEAD_D)
    n_diag = 0
    if DIAGONAL_LAST:
        n_diag = _masked_steps(n_block * BLOCK_N, m_lo, n_m, seqlen_q, seqlen_k, BLOCK_M,
                               BLOCK_N)
    for t in range(total):
        j, m = _step_block(t, m_lo, n_m, n_diag, group, DIAGONAL_LAST)
        h = hk * group + j
        if DQ_TMA:  # (the launcher keeps B * Hq * Nq_pad rows below 2**31)
            row = (b * heads_q + h) * seqlen_q_pad + m * BLOCK_M
            mbarrier.wait(dq_full, (step0 + t) & 1)
            for c in gl.static_range(NUM_CONSUMERS):
                _tma_reduce_add(dq_desc, [row, c * DQ_COLS], dq_smem.index(c))
            tma.store_wait(0)  # the reduce-adds have read the buffer
        else:
            base_ptr = dq_acc_ptr + ((b * heads_q + h).to(gl.int64) * seqlen_q_pad
                                     + m * BLOCK_M) * HEAD_D
            mbarrier.wait(dq_full, (step0 + t) & 1)
            for c in gl.static_range(NUM_CONSUMERS):
                for r in gl.static_range(BLOCK_M // CHUNK):
                    part = dq_smem.index(c).slice(r * CHUNK, CHUNK, dim=0).load(layout)
                    gl.atomic_add(base_ptr + (r * CHUNK * HEAD_D + c * DQ_COLS) + offs, part,
                                  sem="relaxed")
        mbarrier.arrive(dq_empty, count=1)
    return total


@gluon.jit
def _consumer(cid, q_smem, do_smem, k_smem, v_smem, ds_smem, dq_smem, lse_smem, delta_smem,
              kv_bar, kv_empty, q_ready, do_ready, qdo_empty, ds_ready, dq_full, dq_empty,
              dk_ptr, dv_ptr, cu_q_ptr, cu_k_ptr, stride_dkb, stride_dkh, stride_dkn, seqlen_q,
              seqlen_k, seqlen_q_pad, heads_q, heads_kv, qk_scale, sm_scale, section_log2,
              first, end, stride,
              HEAD_D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              NUM_STAGES: gl.constexpr, NUM_CONSUMERS: gl.constexpr, CAUSAL: gl.constexpr,
              LPT: gl.constexpr, VARLEN: gl.constexpr, PERSISTENT: gl.constexpr,
              DQ_TMA: gl.constexpr, dk_desc, dv_desc, KV_BSHD: gl.constexpr,
              TMA_STORE: gl.constexpr, window_left, WINDOW: gl.constexpr,
              SOFTCAP: gl.constexpr):
    if PERSISTENT:  # steps and tiles of the CTA so far: ring slots and phases run on
        step0 = 0
        tile_i = 0
        for tid in range(first, end, stride):
            n_block, bhk = _tile_at(tid, seqlen_k, section_log2, BLOCK_N, LPT)
            step0 += _consumer_tile(cid, q_smem, do_smem, k_smem, v_smem, ds_smem, dq_smem,
                                   lse_smem, delta_smem, kv_bar, kv_empty, q_ready, do_ready,
                                   qdo_empty, ds_ready, dq_full, dq_empty, dk_ptr, dv_ptr,
                                   cu_q_ptr, cu_k_ptr, stride_dkb, stride_dkh, stride_dkn,
                                   seqlen_q, seqlen_k, seqlen_q_pad, heads_q, heads_kv,
                                   qk_scale, sm_scale, n_block, bhk, step0, tile_i, HEAD_D,
                                   BLOCK_M, BLOCK_N, NUM_STAGES, NUM_CONSUMERS, CAUSAL, VARLEN,
                                   True, DQ_TMA, dk_desc, dv_desc, KV_BSHD, TMA_STORE,
                                   window_left, WINDOW, SOFTCAP)
            tile_i += 1
    else:
        n_block, bhk = _tile(seqlen_k, section_log2, BLOCK_N, LPT)
        _consumer_tile(cid, q_smem, do_smem, k_smem, v_smem, ds_smem, dq_smem, lse_smem,
                       delta_smem, kv_bar, kv_empty, q_ready, do_ready, qdo_empty, ds_ready,
                       dq_full, dq_empty, dk_ptr, dv_ptr, cu_q_ptr, cu_k_ptr, stride_dkb,
                       stride_dkh, stride_dkn, seqlen_q, seqlen_k, seqlen_q_pad, heads_q,
                       heads_kv, qk_scale, sm_scale, n_block, bhk, 0, 0, HEAD_D, BLOCK_M,
                       BLOCK_N, NUM_STAGES, NUM_CONSUMERS, CAUSAL, VARLEN, False, DQ_TMA,
                       dk_desc, dv_desc, KV_BSHD, TMA_STORE, window_left, WINDOW, SOFTCAP)


@gluon.jit
def _consumer_tile(cid, q_smem, do_smem, k_smem, v_smem, ds_smem, dq_smem, lse_smem,
                   delta_smem, kv_bar, kv_empty, q_ready, do_ready, qdo_empty, ds_ready,
                   dq_full, dq_empty, dk_ptr, dv_ptr, cu_q_ptr, cu_k_ptr, stride_dkb,
                   stride_dkh, stride_dkn, seqlen_q, seqlen_k, seqlen_q_pad, heads_q, heads_kv,
                   qk_scale, sm_scale, n_block, bhk, step0, tile_i,
                   HEAD_D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                   NUM_STAGES: gl.constexpr, NUM_CONSUMERS: gl.constexpr, CAUSAL: gl.constexpr,
                   VARLEN: gl.constexpr, PERSISTENT: gl.constexpr, DQ_TMA: gl.constexpr,
                   dk_desc, dv_desc, KV_BSHD: gl.constexpr, TMA_STORE: gl.constexpr,
                   window_left, WINDOW: gl.constexpr, SOFTCAP: gl.constexpr):
    """Consumer ``cid`` on one tile: keys ``[k0, k0 + ROWS_N)`` of the CTA's block, every
    step's ``S^T``, ``dP^T``, ``dS^T`` (its rows of the CTA's ``dS^T`` in shared memory),
    ``dV`` and ``dK`` of its keys, and columns ``[cid * DQ_COLS, ...)`` of ``dS K`` over all
    the CTA's keys (FA3's split: one dQ partial a CTA, not one a warpgroup); dK, dV stored
    at the end (``TMA_STORE``: a whole block of keys through this consumer's K and V rows in
    shared memory by two TMA stores, ``dk_desc``/``dv_desc`` over K's view; a block past
    the keys' end as without it). The CTA's step ``step0 + t`` picks the ring slot and the
    phases; returns the tile's steps."""
    ROWS_N: gl.constexpr = BLOCK_N // NUM_CONSUMERS
    DQ_COLS: gl.constexpr = HEAD_D // NUM_CONSUMERS
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_M, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, HEAD_D, 16])
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, DQ_COLS, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout,
                                                 k_width=2)
    key_l: gl.constexpr = gl.SliceLayout(1, s_layout)
    qry_l: gl.constexpr = gl.SliceLayout(0, s_layout)

    b = bhk // heads_kv
    hk = bhk % heads_kv
    group = heads_q // heads_kv
    if VARLEN:  # keys and queries counted from the sequence's starts, up to its lengths
        _, seqlen_q = _seq(cu_q_ptr, b)
        _, seqlen_k = _seq(cu_k_ptr, b)
    k0 = n_block * BLOCK_N + cid * ROWS_N
    keys = k0 + gl.arange(0, ROWS_N, layout=key_l)
    m_lo, n_m, total = _steps(n_block, seqlen_q, seqlen_k, group, window_left, BLOCK_M,
                              BLOCK_N, CAUSAL, VARLEN, WINDOW)

    dk = gl.zeros([ROWS_N, HEAD_D], gl.float32, acc_layout)
    dv = gl.zeros([ROWS_N, HEAD_D], gl.float32, acc_layout)
    k_c = k_smem.slice(cid * ROWS_N, ROWS_N, dim=0)
    v_c = v_smem.slice(cid * ROWS_N, ROWS_N, dim=0)
    k_cols = k_smem.slice(cid * DQ_COLS, DQ_COLS, dim=1)
    dq_c = dq_smem.index(cid)
    if VARLEN:  # the producer loads K and V only for a walk of some steps
        mbarrier.wait(kv_bar, 0, pred=total > 0)
    else:
        mbarrier.wait(kv_bar, tile_i & 1)
    DIAGONAL_LAST: gl.constexpr = _diagonal_last(CAUSAL, WINDOW, HEAD_D)
    if DIAGONAL_LAST:  # the steps no key of the block is masked in, then the diagonal's
        # (the CTA's count: a consumer whose keys some of those steps see whole masks them
        # all the same), in the order of _step_block
        n_diag = _masked_steps(n_block * BLOCK_N, m_lo, n_m, seqlen_q, seqlen_k, BLOCK_M,
                               BLOCK_N)
        for t in range(0, group * (n_m - n_diag)):  # (no mask: the block's index unused)
            dk, dv = _consumer_step(
                t, 0, step0, q_smem, do_smem, k_c, v_c, k_cols, ds_smem, dq_c, lse_smem,
                delta_smem, q_ready, do_ready, qdo_empty, ds_ready, dq_full, dq_empty, dk, dv,
                keys, k0, seqlen_q, seqlen_k, qk_scale, cid, BLOCK_M, ROWS_N, DQ_COLS,
                NUM_STAGES, CAUSAL, DQ_TMA, MASK_NONE, s_layout, dq_layout, a_layout, qry_l,
                window_left, WINDOW, SOFTCAP)
        for t in range(group * (n_m - n_diag), total):
            _, m = _step_block(t, m_lo, n_m, n_diag, group, True)
            dk, dv = _consumer_step(
                t, m, step0, q_smem, do_smem, k_c, v_c, k_cols, ds_smem, dq_c, lse_smem,
                delta_smem, q_ready, do_ready, qdo_empty, ds_ready, dq_full, dq_empty, dk, dv,
                keys, k0, seqlen_q, seqlen_k, qk_scale, cid, BLOCK_M, ROWS_N, DQ_COLS,
                NUM_STAGES, CAUSAL, DQ_TMA, MASK_DIAGONAL, s_layout, dq_layout, a_layout,
                qry_l, window_left, WINDOW, SOFTCAP)
    else:
        for t in range(total):
            dk, dv = _consumer_step(
                t, m_lo + t % n_m, step0, q_smem, do_smem, k_c, v_c, k_cols, ds_smem, dq_c,
                lse_smem, delta_smem, q_ready, do_ready, qdo_empty, ds_ready, dq_full, dq_empty,
                dk, dv, keys, k0, seqlen_q, seqlen_k, qk_scale, cid, BLOCK_M, ROWS_N, DQ_COLS,
                NUM_STAGES, CAUSAL, DQ_TMA, MASK_BRANCH, s_layout, dq_layout, a_layout, qry_l,
                window_left, WINDOW, SOFTCAP)
    if TMA_STORE:
        if k0 + ROWS_N <= seqlen_k:  # a whole block: no row of the view's next head (or
            # sequence) in it
            _store_through_smem(dk, dv, k_c, v_c, dq_full, dk_desc, dv_desc, b, hk, bhk, k0,
                                seqlen_k, cu_k_ptr, sm_scale, (step0 + total - 1) & 1, HEAD_D,
                                KV_BSHD, VARLEN)
        else:
            _store_rows(dk, dv, dk_ptr, dv_ptr, cu_k_ptr, b, hk, k0, seqlen_k, stride_dkb,
                        stride_dkh, stride_dkn, sm_scale, ROWS_N, HEAD_D, VARLEN)
        if PERSISTENT:  # K and V read by every MMA and by the stores: the next tile's may load
            mbarrier.arrive(kv_empty, count=1)
    else:
        if PERSISTENT:  # every MMA reading K and V is done: the producer may load the next
            # tile's
            mbarrier.arrive(kv_empty, count=1)
        _store_rows(dk, dv, dk_ptr, dv_ptr, cu_k_ptr, b, hk, k0, seqlen_k, stride_dkb,
                    stride_dkh, stride_dkn, sm_scale, ROWS_N, HEAD_D, VARLEN)
    return total


@gluon.jit
def _masked_steps(k0, m_lo, n_m, seqlen_q, seqlen_k, BLOCK_M: gl.constexpr,
                  ROWS_N: gl.constexpr):
    """Causal: how many of a query head's steps (query blocks ``m_lo ..``, ``n_m`` of them)
    the keys ``[k0, k0 + ROWS_N)`` are masked in: those whose first query row misses some
    of them (bottom-right aligned: row ``i`` sees key ``j`` iff ``j <= i + seqlen_k -
    seqlen_q``). Keys running past the end are masked in every step (no query row sees a key
    past it)."""
    m_end = gl.cdiv(gl.maximum(k0 + ROWS_N - 1 - (seqlen_k - seqlen_q), 0), BLOCK_M)
    return gl.minimum(gl.maximum(m_end - m_lo, 0), n_m)


@gluon.jit
def _consumer_step(t, m, step0, q_smem, do_smem, k_c, v_c, k_cols, ds_smem, dq_c, lse_smem,
                   delta_smem, q_ready, do_ready, qdo_empty, ds_ready, dq_full, dq_empty, dk, dv,
                   keys, k0, seqlen_q, seqlen_k, qk_scale, cid, BLOCK_M: gl.constexpr,
                   ROWS_N: gl.constexpr, DQ_COLS: gl.constexpr, NUM_STAGES: gl.constexpr,
                   CAUSAL: gl.constexpr, DQ_TMA: gl.constexpr, MASK: gl.constexpr,
                   s_layout: gl.constexpr, dq_layout: gl.constexpr, a_layout: gl.constexpr,
                   qry_l: gl.constexpr, window_left, WINDOW: gl.constexpr,
                   SOFTCAP: gl.constexpr):
    """Consumer ``cid``'s step ``t`` of its tile (query block ``m``; the CTA's step ``step0 +
    t`` picks the ring slot and the phases): ``S^T``, ``P^T``, ``dP^T``, ``dS^T``, ``dV``
    and ``dK`` of its keys, its columns of the step's ``dQ`` partial to the writer; returns
    ``dk, dv``. ``MASK``: :data:`MASK_NONE`, :data:`MASK_BRANCH` (the mask behind a branch
    on whether the step needs it: keys past the end, and under a causal mask the diagonal)
    or :data:`MASK_DIAGONAL` (the causal mask at every step). A causal mask masks the keys
    past the end with it and has no test of its own for them: one compare and one select a
    score where two of each were (on the H200 the D128 causal main kernel 1.3-2.2% faster,
    ``benchmarks/results/bwd_mask_v3_d128c_h200.json``). ``WINDOW`` (with a causal mask,
    behind the branch): the keys before a row's window, ``window_left`` keys back, masked
    too. ``SOFTCAP`` (the cap times log2 e; 0: none): the forward's scores ``SOFTCAP *
    tanh(s * qk_scale)`` recomputed (``qk_scale`` then ``scale / cap``) and ``dS`` taken
    through the tanh, ``1 - tanh^2`` (``sm_scale`` scales dK and dQ after, as without a
    cap)."""
    dtype: gl.constexpr = q_smem.dtype
    st = (step0 + t) % NUM_STAGES
    ph = ((step0 + t) // NUM_STAGES) & 1
    qrows = gl.arange(0, BLOCK_M, layout=qry_l)
    mbarrier.wait(q_ready.index(st), ph)
    # the query rows' LSE (log2 domain, +inf past the end) and delta, with Q
    lse2 = lse_smem.index(st).load(qry_l)
    delta = delta_smem.index(st).load(qry_l)
    q_t = q_smem.index(st)
    do_t = do_smem.index(st)
    # (the zero accumulators made at their use: hoisted, they hold registers throughout)
    s_zero = gl.zeros([ROWS_N, BLOCK_M], gl.float32, s_layout)
    s = warpgroup_mma(k_c, q_t.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    mbarrier.wait(do_ready.index(st), ph)
    dp = warpgroup_mma(v_c, do_t.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(num_outstanding=1, deps=(s, ))
    # P^T while dP^T is on the tensor cores
    if SOFTCAP > 0:  # (the forward's tanh, the hardware's approximation: the same P)
        p = gl.exp2(_tanh(s * qk_scale) * SOFTCAP - gl.expand_dims(lse2, 0))
    else:
        p = gl.exp2(s * qk_scale - gl.expand_dims(lse2, 0))
    if MASK == MASK_BRANCH:
        need_mask = k0 + ROWS_N > seqlen_k
        if CAUSAL:  # the block's first query row misses some of the keys
            need_mask = need_mask | (m * BLOCK_M + (seqlen_k - seqlen_q) < k0 + ROWS_N - 1)
        if WINDOW:  # the block's last query row's window starts after its first key
            need_mask = need_mask | (m * BLOCK_M + BLOCK_M - 1 + (seqlen_k - seqlen_q)
                                     - window_left > k0)
        if need_mask:
            if WINDOW:  # key j in [pos - window_left, pos]: pos - j in [0, window_left], one
                # unsigned compare (a key past the pos wraps round to a large distance; with
                # the shift on the keys instead, as the D64 diagonal's, or two compares,
                # ptxas spilled 20-100 B more at D128)
                qpos = m * BLOCK_M + qrows + (seqlen_k - seqlen_q)
                dist = gl.expand_dims(qpos, 0) - gl.expand_dims(keys, 1)
                ok = dist.to(gl.uint32, bitcast=True) <= window_left.to(gl.uint32, bitcast=True)
            elif CAUSAL:  # (which masks the keys past the end too: see MASK_DIAGONAL)
                qpos = m * BLOCK_M + qrows + (seqlen_k - seqlen_q)
                ok = gl.expand_dims(keys, 1) <= gl.expand_dims(qpos, 0)
            else:
                ok = gl.expand_dims(keys < seqlen_k, 1)
            p = gl.where(ok, p, 0.0)
    if MASK == MASK_DIAGONAL:  # query i sees key j iff j <= i + seqlen_k - seqlen_q: for
        # a query row (i < seqlen_q) no key past the end (j >= seqlen_k), so the keys' end
        # needs no test of its own; a padded row (i >= seqlen_q) has P = 0 by its LSE (+inf)
        shift = m * BLOCK_M + (seqlen_k - seqlen_q)
        ok = gl.expand_dims(keys - shift, 1) <= gl.expand_dims(qrows, 0)
        p = gl.where(ok, p, 0.0)
    # dV += P^T dO with P^T in registers, on the tensor cores while dS^T is computed
    p16 = gl.convert_layout(p.to(dtype), a_layout)
    dv = warpgroup_mma(p16, do_t, dv, is_async=True)
    dp = warpgroup_mma_wait(num_outstanding=1, deps=(dp, ))
    ds = p * (dp - gl.expand_dims(delta, 0))
    if SOFTCAP > 0:  # d(cap tanh(x / cap)) / dx = 1 - tanh^2, the tanh read back from P
        # (log2 P + lse2 = SOFTCAP tanh; kept from above, a score tile's registers spilled
        # 430 B at D128); where P is 0 (masked, or a row without keys: lse2 +inf) so is dS
        capped = gl.maximum((_log2(p) + gl.expand_dims(lse2, 0)) * (1.0 / SOFTCAP), -1.0)
        ds = gl.where(p > 0, ds * (1.0 - capped * capped), 0.0)
    # dK += dS^T Q with dS^T in registers too: issued before dS^T's store to shared
    # memory (for dS K), not after it
    ds16 = gl.convert_layout(ds.to(dtype), a_layout)
    dk = warpgroup_mma(ds16, q_t, dk, is_async=True)
    # dS^T: this consumer's rows of the step's buffer (two buffers: a consumer writes
    # buffer t % 2 again only after both passed step t + 1's ds_ready, so after the
    # other's dS K of step t has completed)
    ds_b = ds_smem.index((step0 + t) % 2)
    ds_own = ds_b.slice(cid * ROWS_N, ROWS_N, dim=0)
    ds_own.store(ds16)
    fence_async_shared()
    mbarrier.arrive(ds_ready.index((step0 + t) % 2), count=1)
    # dQ_part[:, cols] = dS K[:, cols] over all the CTA's keys, once every consumer's
    # dS^T rows are in
    mbarrier.wait(ds_ready.index((step0 + t) % 2), ((step0 + t) // 2) & 1)
    dq_zero = gl.zeros([BLOCK_M, DQ_COLS], gl.float32, dq_layout)
    dq = warpgroup_mma(ds_b.permute((1, 0)), k_cols, dq_zero, use_acc=False,
                       is_async=True)
    dv, dk, p16, ds16 = warpgroup_mma_wait(num_outstanding=1, deps=(dv, dk, p16, ds16))
    mbarrier.arrive(qdo_empty.index(st), count=1)  # Q and dO read
    dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq, ))
    # to the dQ writer: its buffer free once it read the previous step's
    mbarrier.wait(dq_empty, ((step0 + t) & 1) ^ 1)
    dq_c.store(dq)
    if DQ_TMA:  # the writer's reduce-adds read it through the async proxy
        fence_async_shared()
    mbarrier.arrive(dq_full, count=1)
    return dk, dv


@gluon.jit
def _store_through_smem(dk, dv, k_c, v_c, dq_full, dk_desc, dv_desc, b, hk, bhk, k0, seqlen_k,
                        cu_k_ptr, sm_scale, last_phase, HEAD_D: gl.constexpr,
                        KV_BSHD: gl.constexpr, VARLEN: gl.constexpr):
    """``TMA_STORE``'s epilogue (FA3's ``epilogue_bwd``): dV into the consumer's V rows (only
    its own ``dP`` wgmmas read them, all done), dK into its K rows once every consumer's
    ``dS K`` of the tile's last step is done (those read every K row: the ``dq_full`` phase
    ``last_phase``), then one TMA store each, waited for before the rows are reused."""
    dtype: gl.constexpr = k_c.dtype
    v_c.store(dv.to(dtype))
    mbarrier.wait(dq_full, last_phase)
    k_c.store((dk * sm_scale).to(dtype))
    fence_async_shared()
    k_start = 0
    if VARLEN:  # the sequence's first row, read here (no register held through the walk)
        k_start = gl.load(cu_k_ptr + b)
    row, col = _kv_coords(b, hk, bhk, k0, seqlen_k, k_start, HEAD_D, KV_BSHD, VARLEN)
    tma.async_copy_shared_to_global(dk_desc, [row, col], k_c)
    tma.async_copy_shared_to_global(dv_desc, [row, col], v_c)
    tma.store_wait(0)


@gluon.jit
def _store_rows(dk, dv, dk_ptr, dv_ptr, cu_k_ptr, b, hk, k0, seqlen_k, stride_dkb, stride_dkh,
                stride_dkn, sm_scale, ROWS_N: gl.constexpr, HEAD_D: gl.constexpr,
                VARLEN: gl.constexpr):
    """The epilogue from registers: dK = scale * dS^T Q, dV = P^T dO, keys past the end not
    stored; 32-bit offsets from the head's base (64-bit ones beside dK and dV spill), a
    row's added to the base before its columns' (so that ptxas addresses a row's columns
    as immediates from one pointer a row: summed first, it kept a 64-bit address an element
    and spilled them, 64-128 B a consumer)."""
    dtype: gl.constexpr = dk_ptr.dtype.element_ty
    acc_layout: gl.constexpr = dk.type.layout
    cols = gl.expand_dims(gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, acc_layout)), 0)
    rows = k0 + gl.arange(0, ROWS_N, layout=gl.SliceLayout(1, acc_layout))
    row_offs = gl.expand_dims(rows * stride_dkn, 1)
    if VARLEN:  # the packed rows from the sequence's start (read here: no register held
        # through the walk)
        base = gl.load(cu_k_ptr + b).to(gl.int64) * stride_dkn + hk.to(gl.int64) * stride_dkh
    else:
        base = b.to(gl.int64) * stride_dkb + hk.to(gl.int64) * stride_dkh
    ok = gl.expand_dims(rows < seqlen_k, 1)
    gl.store(dk_ptr + base + row_offs + cols, (dk * sm_scale).to(dtype), mask=ok)
    gl.store(dv_ptr + base + row_offs + cols, dv.to(dtype), mask=ok)


@gluon.constexpr_function
def _split_d(head_dim):
    """Whether the consumers split the head dim (``HEAD_D`` at least :data:`SPLIT_D_MIN_D`):
    dK and dV of a whole key block do not fit one warpgroup's registers there (FA3's hdim
    256 backward splits them the same way, ``mainloop_bwd_sm90_tma_gmma_ws.hpp``)."""
    return head_dim >= SPLIT_D_MIN_D


@gluon.jit
def _consumer_d(cid, q_smem, do_smem, k_smem, v_smem, p_smem, ds_smem, lse_smem, delta_smem,
                kv_bar, q_ready, do_ready, qdo_empty, ds_ready, dq_acc_ptr, dk_ptr, dv_ptr,
                cu_q_ptr, cu_k_ptr, stride_dkb, stride_dkh, stride_dkn, seqlen_q, seqlen_k,
                seqlen_q_pad, heads_q, heads_kv, qk_scale, sm_scale, section_log2,
                HEAD_D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr, LPT: gl.constexpr,
                VARLEN: gl.constexpr, dk_desc, dv_desc, KV_BSHD: gl.constexpr,
                TMA_STORE: gl.constexpr, window_left, WINDOW: gl.constexpr,
                SOFTCAP: gl.constexpr):
    """The split-D consumer ``cid`` (of two; :func:`_split_d`) on the CTA's tile: every
    key of the block, query rows ``[cid * BLOCK_M / 2, ...)`` of each step for ``S^T``,
    ``dP^T``, ``P^T`` and ``dS^T`` (its columns of the CTA's ``P^T`` and ``dS^T`` in shared
    memory), then, once both halves are in, columns ``[cid * HEAD_D / 2, ...)`` of ``dV +=
    P^T dO``, ``dK += dS^T Q`` and the step's ``dQ = dS K``, which it adds to the fp32
    accumulator itself (FA3 at hdim 256: no dQ writer, whose staging tile would not fit
    beside the ring), in two slices of 64 columns, the first's atomics under the dV and dK
    wgmmas. dK and dV stored at the end (``TMA_STORE``: its columns of the block through its
    columns of K and V in shared memory)."""
    HALF_M: gl.constexpr = BLOCK_M // 2
    COLS: gl.constexpr = HEAD_D // 2
    DQ_SLICE: gl.constexpr = 64
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HALF_M, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, COLS, 16])
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, DQ_SLICE, 16])
    key_l: gl.constexpr = gl.SliceLayout(1, s_layout)
    qry_l: gl.constexpr = gl.SliceLayout(0, s_layout)
    n_block, bhk = _tile(seqlen_k, section_log2, BLOCK_N, LPT)
    b = bhk // heads_kv
    hk = bhk % heads_kv
    group = heads_q // heads_kv
    if VARLEN:  # keys and queries counted from the sequence's starts, up to its lengths
        _, seqlen_q = _seq(cu_q_ptr, b)
        _, seqlen_k = _seq(cu_k_ptr, b)
    k0 = n_block * BLOCK_N
    keys = k0 + gl.arange(0, BLOCK_N, layout=key_l)
    m_lo, n_m, total = _steps(n_block, seqlen_q, seqlen_k, group, window_left, BLOCK_M,
                              BLOCK_N, CAUSAL, VARLEN, WINDOW)
    dk = gl.zeros([BLOCK_N, COLS], gl.float32, acc_layout)
    dv = gl.zeros([BLOCK_N, COLS], gl.float32, acc_layout)
    if VARLEN:  # the producer loads K and V only for a walk of some steps
        mbarrier.wait(kv_bar, 0, pred=total > 0)
    else:
        mbarrier.wait(kv_bar, 0)
    for t in range(total):
        j, m = _step_block(t, m_lo, n_m, 0, group, False)
        row0 = ((b * heads_q + hk * group + j).to(gl.int64) * seqlen_q_pad + m * BLOCK_M) \
            * HEAD_D
        dk, dv = _consumer_step_d(
            t, m, q_smem, do_smem, k_smem, v_smem, p_smem, ds_smem, lse_smem, delta_smem,
            q_ready, do_ready, qdo_empty, ds_ready, dq_acc_ptr + row0, dk, dv, keys,
            k0, seqlen_q, seqlen_k, qk_scale, cid, BLOCK_M, BLOCK_N, HALF_M, COLS, DQ_SLICE,
            NUM_STAGES, CAUSAL, s_layout, dq_layout, qry_l, window_left, WINDOW, SOFTCAP)
    k_c = k_smem.slice(cid * COLS, COLS, dim=1)
    v_c = v_smem.slice(cid * COLS, COLS, dim=1)
    if TMA_STORE and k0 + BLOCK_N <= seqlen_k:  # a whole block (see _consumer_tile); the
        # other consumer's last S^T and dP^T (all of K and V) are done (it had arrived on
        # the last step's ds_ready), and its dS K reads its own columns of K
        dtype: gl.constexpr = k_smem.dtype
        v_c.store(dv.to(dtype))
        k_c.store((dk * sm_scale).to(dtype))
        fence_async_shared()
        k_start = 0
        if VARLEN:
            k_start = gl.load(cu_k_ptr + b)
        row, col = _kv_coords(b, hk, bhk, k0, seqlen_k, k_start, HEAD_D, KV_BSHD, VARLEN)
        tma.async_copy_shared_to_global(dk_desc, [row, col + cid * COLS], k_c)
        tma.async_copy_shared_to_global(dv_desc, [row, col + cid * COLS], v_c)
        tma.store_wait(0)
    else:
        # (its columns: the pointers moved to them, COLS of them a row)
        _store_rows(dk, dv, dk_ptr + cid * COLS, dv_ptr + cid * COLS, cu_k_ptr, b, hk, k0,
                    seqlen_k, stride_dkb, stride_dkh, stride_dkn, sm_scale, BLOCK_N, COLS, VARLEN)


@gluon.jit
def _consumer_step_d(t, m, q_smem, do_smem, k_smem, v_smem, p_smem, ds_smem, lse_smem,
                     delta_smem, q_ready, do_ready, qdo_empty, ds_ready, dq_base, dk, dv,
                     keys, k0, seqlen_q, seqlen_k, qk_scale, cid, BLOCK_M: gl.constexpr,
                     BLOCK_N: gl.constexpr, HALF_M: gl.constexpr, COLS: gl.constexpr,
                     DQ_SLICE: gl.constexpr, NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                     s_layout: gl.constexpr, dq_layout: gl.constexpr, qry_l: gl.constexpr,
                     window_left, WINDOW: gl.constexpr, SOFTCAP: gl.constexpr):
    """Split-D consumer ``cid``'s step ``t`` (query block ``m``; :func:`_consumer_d`): its
    half of the query rows through ``S^T``, ``P^T``, ``dP^T``, ``dS^T`` (masks and softcap
    as :func:`_consumer_step`'s ``MASK_BRANCH``, on its rows), those into its columns of
    the step's ``P^T`` and ``dS^T`` buffers (two each: a consumer writes buffer ``t % 2``
    again only after both passed step ``t + 1``'s ``ds_ready``, so after the other's
    wgmmas of step ``t`` have completed), then its columns of ``dV``, ``dK`` and the step's
    dQ over the whole tile; returns ``dk, dv``."""
    dtype: gl.constexpr = q_smem.dtype
    st = t % NUM_STAGES
    ph = (t // NUM_STAGES) & 1
    q0: gl.constexpr = cid * HALF_M  # this consumer's first query row of the block
    qrows = q0 + gl.arange(0, HALF_M, layout=qry_l)
    mbarrier.wait(q_ready.index(st), ph)
    lse2 = lse_smem.index(st).slice(q0, HALF_M).load(qry_l)
    delta = delta_smem.index(st).slice(q0, HALF_M).load(qry_l)
    q_t = q_smem.index(st)
    do_t = do_smem.index(st)
    s_zero = gl.zeros([BLOCK_N, HALF_M], gl.float32, s_layout)
    s = warpgroup_mma(k_smem, q_t.slice(q0, HALF_M, dim=0).permute((1, 0)), s_zero,
                      use_acc=False, is_async=True)
    mbarrier.wait(do_ready.index(st), ph)
    dp = warpgroup_mma(v_smem, do_t.slice(q0, HALF_M, dim=0).permute((1, 0)), s_zero,
                       use_acc=False, is_async=True)
    s = warpgroup_mma_wait(num_outstanding=1, deps=(s, ))
    if SOFTCAP > 0:
        p = gl.exp2(_tanh(s * qk_scale) * SOFTCAP - gl.expand_dims(lse2, 0))
    else:
        p = gl.exp2(s * qk_scale - gl.expand_dims(lse2, 0))
    need_mask = k0 + BLOCK_N > seqlen_k
    if CAUSAL:  # this half's first query row misses some of the keys
        need_mask = need_mask | (m * BLOCK_M + q0 + (seqlen_k - seqlen_q) < k0 + BLOCK_N - 1)
    if WINDOW:  # this half's last query row's window starts after the block's first key
        need_mask = need_mask | (m * BLOCK_M + q0 + HALF_M - 1 + (seqlen_k - seqlen_q)
                                 - window_left > k0)
    if need_mask:
        if WINDOW:  # pos - key in [0, window_left]: one unsigned compare
            qpos = m * BLOCK_M + qrows + (seqlen_k - seqlen_q)
            dist = gl.expand_dims(qpos, 0) - gl.expand_dims(keys, 1)
            ok = dist.to(gl.uint32, bitcast=True) <= window_left.to(gl.uint32, bitcast=True)
        elif CAUSAL:  # (masks the keys past the end too: see _consumer_step)
            qpos = m * BLOCK_M + qrows + (seqlen_k - seqlen_q)
            ok = gl.expand_dims(keys, 1) <= gl.expand_dims(qpos, 0)
        else:
            ok = gl.expand_dims(keys < seqlen_k, 1)
        p = gl.where(ok, p, 0.0)
    buf = t % 2
    p_b = p_smem.index(buf)
    ds_b = ds_smem.index(buf)
    p_b.slice(q0, HALF_M, dim=1).store(p.to(dtype))
    dp = warpgroup_mma_wait(num_outstanding=0, deps=(dp, ))
    ds = p * (dp - gl.expand_dims(delta, 0))
    if SOFTCAP > 0:  # 1 - tanh^2, the tanh read back from P (see _consumer_step)
        capped = gl.maximum((_log2(p) + gl.expand_dims(lse2, 0)) * (1.0 / SOFTCAP), -1.0)
        ds = gl.where(p > 0, ds * (1.0 - capped * capped), 0.0)
    ds_b.slice(q0, HALF_M, dim=1).store(ds.to(dtype))
    fence_async_shared()
    mbarrier.arrive(ds_ready.index(buf), count=1)
    mbarrier.wait(ds_ready.index(buf), (t // 2) & 1)
    # both halves in: this consumer's columns of dQ over the whole tile, in two slices of
    # 64 (one slice's registers live at a time: with both, ptxas spilled 160-290 B), the
    # first's atomics under the dV and dK wgmmas
    dq_rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, dq_layout))
    dq_cols = gl.arange(0, DQ_SLICE, layout=gl.SliceLayout(0, dq_layout))
    dq_row_ptrs = gl.expand_dims(dq_base + (dq_rows * (2 * COLS) + cid * COLS), 1)
    dq_offs = gl.expand_dims(dq_cols, 0)
    dq_zero = gl.zeros([BLOCK_M, DQ_SLICE], gl.float32, dq_layout)
    dq = warpgroup_mma(ds_b.permute((1, 0)), k_smem.slice(cid * COLS, DQ_SLICE, dim=1),
                       dq_zero, use_acc=False, is_async=True)
    dv = warpgroup_mma(p_b, do_t.slice(cid * COLS, COLS, dim=1), dv, is_async=True)
    dk = warpgroup_mma(ds_b, q_t.slice(cid * COLS, COLS, dim=1), dk, is_async=True)
    dq = warpgroup_mma_wait(num_outstanding=2, deps=(dq, ))
    gl.atomic_add(dq_row_ptrs + dq_offs, dq, sem="relaxed")
    dv, dk = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dk))
    mbarrier.arrive(qdo_empty.index(st), count=1)  # Q and dO read
    dq = warpgroup_mma(ds_b.permute((1, 0)),
                       k_smem.slice(cid * COLS + DQ_SLICE, DQ_SLICE, dim=1), dq_zero,
                       use_acc=False, is_async=True)
    dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq, ))
    gl.atomic_add(dq_row_ptrs + (dq_offs + DQ_SLICE), dq, sem="relaxed")
    return dk, dv


@gluon.jit
def _split_d_kernel(q_desc, k_desc, v_desc, do_desc, lse2_ptr, delta_ptr, dq_acc_ptr, dk_ptr,
                    dv_ptr, stride_dkb, stride_dkh, stride_dkn, seqlen_q, seqlen_k,
                    seqlen_q_pad, heads_q, heads_kv, qk_scale, sm_scale, section_log2,
                    cu_q_ptr, cu_k_ptr, HEAD_D: gl.constexpr, BLOCK_M: gl.constexpr,
                    BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
                    NUM_CONSUMERS: gl.constexpr, CAUSAL: gl.constexpr, Q_BSHD: gl.constexpr,
                    KV_BSHD: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                    CONSUMER_REGS: gl.constexpr, LPT: gl.constexpr, VARLEN: gl.constexpr,
                    PERSISTENT: gl.constexpr, DQ_TMA: gl.constexpr, dk_desc, dv_desc,
                    TMA_STORE: gl.constexpr, KV_GROUP: gl.constexpr, left,
                    WINDOW: gl.constexpr, SOFTCAP: gl.constexpr):
    """The main kernel where the consumers split the head dim (:func:`_split_d`): the
    producer's ring as in the key split, two buffers each of the step's ``P^T`` and
    ``dS^T`` (each consumer writes its half of the query columns, in a 64-byte swizzle:
    one such column half a swizzle atom), no dQ staging tile and no dQ writer
    (:func:`_consumer_d` adds dQ). Grid launch only, two consumers, ``BLOCK_M`` 64 (the
    ring of two Q and dO tiles, K, V and the four score tiles take 225 of the 227 KiB)."""
    gl.static_assert(NUM_CONSUMERS == 2 and BLOCK_M == 64 and BLOCK_N == 64)
    gl.static_assert(not PERSISTENT and not DQ_TMA)
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_M, HEAD_D], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_M, HEAD_D], do_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_D], v_desc.layout)
    ps_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=16,
                                                   rank=2)
    p_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_M], ps_layout)
    ds_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_M], ps_layout)
    rows_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    lse_smem = gl.allocate_shared_memory(gl.float32, [NUM_STAGES, BLOCK_M], rows_layout)
    delta_smem = gl.allocate_shared_memory(gl.float32, [NUM_STAGES, BLOCK_M], rows_layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    do_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    qdo_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1],
                                          mbarrier.MBarrierLayout())
    ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for s in gl.static_range(NUM_STAGES):
        mbarrier.init(q_ready.index(s), count=1)
        mbarrier.init(do_ready.index(s), count=1)
        mbarrier.init(qdo_empty.index(s), count=NUM_CONSUMERS)
    for s in gl.static_range(2):
        mbarrier.init(ds_ready.index(s), count=NUM_CONSUMERS)
    gl.warp_specialize([
        (_consumer_d, (0, q_smem, do_smem, k_smem, v_smem, p_smem, ds_smem, lse_smem,
                       delta_smem, kv_bar, q_ready, do_ready, qdo_empty, ds_ready, dq_acc_ptr,
                       dk_ptr, dv_ptr, cu_q_ptr, cu_k_ptr, stride_dkb, stride_dkh, stride_dkn,
                       seqlen_q, seqlen_k, seqlen_q_pad, heads_q, heads_kv, qk_scale,
                       sm_scale, section_log2, HEAD_D, BLOCK_M, BLOCK_N, NUM_STAGES, CAUSAL,
                       LPT, VARLEN, dk_desc, dv_desc, KV_BSHD, TMA_STORE, left, WINDOW,
                       SOFTCAP)),
        (_consumer_d, (1, q_smem, do_smem, k_smem, v_smem, p_smem, ds_smem, lse_smem,
                       delta_smem, kv_bar, q_ready, do_ready, qdo_empty, ds_ready, dq_acc_ptr,
                       dk_ptr, dv_ptr, cu_q_ptr, cu_k_ptr, stride_dkb, stride_dkh, stride_dkn,
                       seqlen_q, seqlen_k, seqlen_q_pad, heads_q, heads_kv, qk_scale,
                       sm_scale, section_log2, HEAD_D, BLOCK_M, BLOCK_N, NUM_STAGES, CAUSAL,
                       LPT, VARLEN, dk_desc, dv_desc, KV_BSHD, TMA_STORE, left, WINDOW,
                       SOFTCAP)),
        (_producer, (q_desc, k_desc, v_desc, do_desc, q_smem, do_smem, k_smem, v_smem,
                     lse_smem, delta_smem, kv_bar, kv_bar, q_ready, do_ready, qdo_empty,
                     lse2_ptr, delta_ptr, cu_q_ptr, cu_k_ptr, seqlen_q, seqlen_k, seqlen_q_pad,
                     heads_q, heads_kv, section_log2, 0, 1, 1, HEAD_D, BLOCK_M, BLOCK_N,
                     NUM_STAGES, CAUSAL, Q_BSHD, KV_BSHD, LPT, VARLEN, False, KV_GROUP, left,
                     WINDOW)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


@gluon.jit
def gluon_attn_bwd_kernel(q_desc, k_desc, v_desc, do_desc, lse2_ptr, delta_ptr, dq_acc_ptr,
                          dk_ptr, dv_ptr, stride_dkb, stride_dkh, stride_dkn, seqlen_q,
                          seqlen_k, seqlen_q_pad, heads_q, heads_kv, qk_scale, sm_scale,
                          section_log2, cu_q_ptr, cu_k_ptr,
                          HEAD_D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                          NUM_STAGES: gl.constexpr, NUM_CONSUMERS: gl.constexpr,
                          CAUSAL: gl.constexpr, Q_BSHD: gl.constexpr, KV_BSHD: gl.constexpr,
                          PRODUCER_REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                          LPT: gl.constexpr, VARLEN: gl.constexpr, n_tiles=None,
                          PERSISTENT: gl.constexpr = False, dq_desc=None,
                          DQ_TMA: gl.constexpr = False, dk_desc=None, dv_desc=None,
                          TMA_STORE: gl.constexpr = False, KV_GROUP: gl.constexpr = 1,
                          window_left=None, WINDOW: gl.constexpr = False,
                          SOFTCAP: gl.constexpr = 0.0):
    """``seqlen_q``, ``seqlen_k``: the lengths (``VARLEN``: the longest sequence's, the
    grid's); ``cu_q_ptr``, ``cu_k_ptr``: VARLEN's ``cu_seqlens`` (None without it), after
    the dense parameters. ``PERSISTENT`` (dense only): a 1-D grid of at most one CTA an SM,
    CTA ``i`` of ``P`` taking tiles ``i, i + P, ... < n_tiles`` in the grid launch's order,
    so that a tile's K and V load under the last tile's dK and dV stores and its first Q
    and dO stream in while the last steps run (None without it: the grid launch's kernel,
    as it was). ``DQ_TMA``: the dQ writer adds each step's partial with TMA bulk
    reduce-adds through ``dq_desc`` (the accumulator's ``(B * Hq * Nq_pad, D)`` rows, a
    block of ``BLOCK_M x D / NUM_CONSUMERS``), else with vector atomics (None).
    ``TMA_STORE``: each consumer stores a whole block of dK and dV through its K and V rows
    in shared memory by TMA (``dk_desc``, ``dv_desc``: dK's and dV's views as K's, a block
    of ``BLOCK_N / NUM_CONSUMERS`` rows), else from registers (None). ``KV_GROUP`` > 1
    (``EXPAND_GQA``): a GQA problem run as MHA, a CTA per query head: ``heads_kv`` is
    ``heads_q``, K and V are read at head ``h // KV_GROUP`` and dK, dV written per query
    head (the launcher sums each group's); 1: the kernel as it was. ``WINDOW`` (with
    ``CAUSAL``): a causal sliding window, query ``i`` seeing keys ``[pos - window_left,
    pos]`` (``pos = i + seqlen_k - seqlen_q``; None without it): a key block's walk ends
    at the last query block that sees it. ``SOFTCAP`` (the cap times log2 e; 0.0: none):
    the forward's capped scores, ``qk_scale`` then ``scale / cap`` (see
    ``_consumer_step``)."""
    gl.static_assert(KV_GROUP == 1 or not VARLEN)
    gl.static_assert(CAUSAL or not WINDOW)
    if WINDOW:
        left = window_left
    else:  # (a constant for the partitions, which take no None)
        left = 0
    gl.static_assert(NUM_CONSUMERS == 1 or NUM_CONSUMERS == 2)
    gl.static_assert(not (PERSISTENT and VARLEN))
    if PERSISTENT:
        first = gl.program_id(0)
        end = n_tiles
        stride = gl.num_programs(0)
    else:  # unused: every partition reads its one tile from the grid (_tile)
        first = 0
        end = 1
        stride = 1
    gl.static_assert(NUM_STAGES >= 2)
    dtype: gl.constexpr = q_desc.dtype
    SPLIT_D: gl.constexpr = _split_d(HEAD_D)
    if SPLIT_D:  # (see _consumer_d)
        _split_d_kernel(q_desc, k_desc, v_desc, do_desc, lse2_ptr, delta_ptr, dq_acc_ptr,
                        dk_ptr, dv_ptr, stride_dkb, stride_dkh, stride_dkn, seqlen_q,
                        seqlen_k, seqlen_q_pad, heads_q, heads_kv, qk_scale, sm_scale,
                        section_log2, cu_q_ptr, cu_k_ptr, HEAD_D, BLOCK_M, BLOCK_N, NUM_STAGES,
                        NUM_CONSUMERS, CAUSAL, Q_BSHD, KV_BSHD, PRODUCER_REGS, CONSUMER_REGS,
                        LPT, VARLEN, PERSISTENT, DQ_TMA, dk_desc, dv_desc, TMA_STORE, KV_GROUP,
                        left, WINDOW, SOFTCAP)
    else:
        gl.static_assert(BLOCK_N // NUM_CONSUMERS >= 64)  # a wgmma's M per warpgroup
        DQ_COLS: gl.constexpr = HEAD_D // NUM_CONSUMERS
        q_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_M, HEAD_D], q_desc.layout)
        do_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_M, HEAD_D], do_desc.layout)
        k_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_D], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_D], v_desc.layout)
        ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], dtype)
        ds_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_M], ds_layout)
        # 16-byte vectors XOR-swizzled over 8 rows: the accumulator layout's stores (8 rows of a
        # warp at once) and the writer's row loads both without bank conflicts
        if DQ_TMA:  # TMA's swizzle (the descriptor's): the writer's reduce-adds read it
            dq_smem = gl.allocate_shared_memory(gl.float32, [NUM_CONSUMERS, BLOCK_M, DQ_COLS],
                                                dq_desc.layout)
        else:
            dq_layout: gl.constexpr = gl.SwizzledSharedLayout(4, 1, 8, [1, 0])
            dq_smem = gl.allocate_shared_memory(gl.float32, [NUM_CONSUMERS, BLOCK_M, DQ_COLS],
                                                dq_layout)
        rows_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        lse_smem = gl.allocate_shared_memory(gl.float32, [NUM_STAGES, BLOCK_M], rows_layout)
        delta_smem = gl.allocate_shared_memory(gl.float32, [NUM_STAGES, BLOCK_M], rows_layout)
        kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        if PERSISTENT:  # the consumers are done with a tile's K and V
            kv_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
            mbarrier.init(kv_empty, count=NUM_CONSUMERS)
        else:  # never waited on
            kv_empty = kv_bar
        q_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        do_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        qdo_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1],
                                              mbarrier.MBarrierLayout())
        ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        dq_full = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        dq_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(kv_bar, count=1)
        for s in gl.static_range(NUM_STAGES):
            mbarrier.init(q_ready.index(s), count=1)
            mbarrier.init(do_ready.index(s), count=1)
            mbarrier.init(qdo_empty.index(s), count=NUM_CONSUMERS)
        for s in gl.static_range(2):
            mbarrier.init(ds_ready.index(s), count=NUM_CONSUMERS)
        mbarrier.init(dq_full, count=NUM_CONSUMERS)
        mbarrier.init(dq_empty, count=1)

        # (a partition's tuple cannot be named: the frontend reads a name as a tensor)
        if NUM_CONSUMERS == 1:
            gl.warp_specialize([
                (_consumer, (0, q_smem, do_smem, k_smem, v_smem, ds_smem, dq_smem, lse_smem,
                             delta_smem, kv_bar, kv_empty, q_ready, do_ready, qdo_empty, ds_ready,
                             dq_full, dq_empty, dk_ptr, dv_ptr, cu_q_ptr, cu_k_ptr, stride_dkb,
                             stride_dkh, stride_dkn, seqlen_q, seqlen_k, seqlen_q_pad, heads_q,
                             heads_kv, qk_scale, sm_scale, section_log2, first, end, stride, HEAD_D,
                             BLOCK_M, BLOCK_N, NUM_STAGES, NUM_CONSUMERS, CAUSAL, LPT, VARLEN,
                             PERSISTENT, DQ_TMA, dk_desc, dv_desc, KV_BSHD, TMA_STORE, left, WINDOW,
                             SOFTCAP)),
                (_producer, (q_desc, k_desc, v_desc, do_desc, q_smem, do_smem, k_smem, v_smem,
                             lse_smem, delta_smem, kv_bar, kv_empty, q_ready, do_ready, qdo_empty,
                             lse2_ptr, delta_ptr, cu_q_ptr, cu_k_ptr, seqlen_q, seqlen_k,
                             seqlen_q_pad, heads_q, heads_kv, section_log2, first, end, stride,
                             HEAD_D, BLOCK_M, BLOCK_N, NUM_STAGES, CAUSAL, Q_BSHD, KV_BSHD, LPT,
                             VARLEN, PERSISTENT, KV_GROUP, left, WINDOW)),
                (_dq_writer, (dq_smem, dq_full, dq_empty, dq_acc_ptr, dq_desc, cu_q_ptr, cu_k_ptr,
                              seqlen_q, seqlen_k, seqlen_q_pad, heads_q, heads_kv, section_log2,
                              first, end, stride, HEAD_D, BLOCK_M, BLOCK_N, NUM_CONSUMERS, CAUSAL,
                              LPT, VARLEN, PERSISTENT, DQ_TMA, left, WINDOW)),
            ], [1, 2], [PRODUCER_REGS, PRODUCER_REGS])
        else:
            gl.warp_specialize([
                (_consumer, (0, q_smem, do_smem, k_smem, v_smem, ds_smem, dq_smem, lse_smem,
                             delta_smem, kv_bar, kv_empty, q_ready, do_ready, qdo_empty, ds_ready,
                             dq_full, dq_empty, dk_ptr, dv_ptr, cu_q_ptr, cu_k_ptr, stride_dkb,
                             stride_dkh, stride_dkn, seqlen_q, seqlen_k, seqlen_q_pad, heads_q,
                             heads_kv, qk_scale, sm_scale, section_log2, first, end, stride, HEAD_D,
                             BLOCK_M, BLOCK_N, NUM_STAGES, NUM_CONSUMERS, CAUSAL, LPT, VARLEN,
                             PERSISTENT, DQ_TMA, dk_desc, dv_desc, KV_BSHD, TMA_STORE, left, WINDOW,
                             SOFTCAP)),
                (_consumer, (1, q_smem, do_smem, k_smem, v_smem, ds_smem, dq_smem, lse_smem,
                             delta_smem, kv_bar, kv_empty, q_ready, do_ready, qdo_empty, ds_ready,
                             dq_full, dq_empty, dk_ptr, dv_ptr, cu_q_ptr, cu_k_ptr, stride_dkb,
                             stride_dkh, stride_dkn, seqlen_q, seqlen_k, seqlen_q_pad, heads_q,
                             heads_kv, qk_scale, sm_scale, section_log2, first, end, stride, HEAD_D,
                             BLOCK_M, BLOCK_N, NUM_STAGES, NUM_CONSUMERS, CAUSAL, LPT, VARLEN,
                             PERSISTENT, DQ_TMA, dk_desc, dv_desc, KV_BSHD, TMA_STORE, left, WINDOW,
                             SOFTCAP)),
                (_producer, (q_desc, k_desc, v_desc, do_desc, q_smem, do_smem, k_smem, v_smem,
                             lse_smem, delta_smem, kv_bar, kv_empty, q_ready, do_ready, qdo_empty,
                             lse2_ptr, delta_ptr, cu_q_ptr, cu_k_ptr, seqlen_q, seqlen_k,
                             seqlen_q_pad, heads_q, heads_kv, section_log2, first, end, stride,
                             HEAD_D, BLOCK_M, BLOCK_N, NUM_STAGES, CAUSAL, Q_BSHD, KV_BSHD, LPT,
                             VARLEN, PERSISTENT, KV_GROUP, left, WINDOW)),
                (_dq_writer, (dq_smem, dq_full, dq_empty, dq_acc_ptr, dq_desc, cu_q_ptr, cu_k_ptr,
                              seqlen_q, seqlen_k, seqlen_q_pad, heads_q, heads_kv, section_log2,
                              first, end, stride, HEAD_D, BLOCK_M, BLOCK_N, NUM_CONSUMERS, CAUSAL,
                              LPT, VARLEN, PERSISTENT, DQ_TMA, left, WINDOW)),
            ], [4, 1, 2], [CONSUMER_REGS, PRODUCER_REGS, PRODUCER_REGS])
