"""FlashAttention-2's score modifications inside a kernel (``@triton.jit`` only): the logit
softcap and ALiBi, in the log2 domain the kernels' online softmax works in. The forward,
backward and decode kernels share them; the window is each kernel's own (it decides which
blocks a walk visits)."""

import triton
import triton.language as tl


@triton.jit
def tanh(x):
    """``tanh(x) = 1 - 2 / (e^(2x) + 1)``, exact at both saturations (``e^(2x)`` = inf gives
    1, 0 gives -1): triton 3.6's interpreter has no portable tanh."""
    return 1.0 - 2.0 / (tl.math.exp2(x * 2.8853900817779268) + 1.0)  # 2 * log2(e)


@triton.jit
def modified_scores(qk, qk_scale, cap_in, cap_out, slope, pos, cols,
                    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr):
    """Log2-domain scores of raw dots ``qk`` (rows at key positions ``pos``, columns the keys
    ``cols``): ``qk * scale * log2(e)``, or with a softcap ``tanh(qk * cap_in) * cap_out``
    (``cap_in = scale / softcap``, ``cap_out = softcap * log2(e)``), minus ``slope * |pos -
    j|`` (``slope`` already times log2(e): a scalar, or a column ``(rows, 1)``)."""
    if HAS_SOFTCAP:
        s = tanh(qk * cap_in) * cap_out
    else:
        s = qk * qk_scale
    if HAS_ALIBI:
        # distances in fp32 (exact below 2^24): one FADD with a free |.| and one FFMA
        dist = tl.abs(pos.to(tl.float32)[:, None] - cols.to(tl.float32)[None, :])
        s -= slope * dist
    return s


@triton.jit
def _byte_draws(words):
    """The bytes of ``words`` as draws, byte ``2 * a + d`` at ``[.., a, d]`` (two new
    dims), each shifted to the top of its word (``w << 8 * (3 - b)``: the bytes below it
    stay, under the threshold's low ones in :func:`dropout_keep`'s test). Joined as
    integers, so that the one comparison happens in the caller's layout."""
    return tl.join(tl.join(words << 24, words << 8), tl.join(words << 16, words))


@triton.jit
def dropout_keep(seed, head, rows, start_col, threshold, BLOCK_C: tl.constexpr):
    """The dropout keep mask ``(len(rows), BLOCK_C)`` of queries ``rows`` against keys
    ``start_col + [0, BLOCK_C)`` of head ``head`` = ``b * H_Q + h`` (positions within the
    sequence, packed or not; ``BLOCK_C`` a power of two >= 16, ``start_col`` a multiple of
    it).

    The mapping, the same in every kernel and for every tile: score ``(i, j)`` of ``head``
    is kept iff byte ``k % 4`` (``(w >> 8 * (k % 4)) & 0xFF``) of word ``k // 4`` of
    ``philox_4x32_7(key = seed, counter = (4 * (j // 64) + (j // 2) % 4, i, head, 0))`` is
    below ``threshold``, where ``k = 2 * ((j // 8) % 8) + j % 2`` (Triton's ``tl.philox``:
    the 64-bit seed's low word is key 0, its high word key 1; 7 rounds, as
    FlashAttention-2). One call serves 16 keys of a row: those of a 64-key block with the
    same ``(j // 2) % 4``, which are the keys one thread holds in a Hopper/Ampere MMA
    accumulator (pairs of columns every 8), so the forward and dQ kernels build their mask
    in registers (FlashAttention-2's 16 scores a call), without a layout conversion; the
    dK/dV kernel's transposed tile gets it through one.
    ``threshold`` in ``[1, 256]``: the keep probability is ``threshold / 256`` exactly
    (:func:`flashtune.kernel_templates.dropout.dropout_threshold`)."""
    tl.static_assert(BLOCK_C >= 16, "dropout tiles hold at least 16 keys")
    # byte <= threshold - 1, tested on the byte shifted to the top (see _byte_draws); a
    # threshold of 1 comes in as a constant (Triton specialises integers equal to 1)
    t24 = ((threshold - 1 + tl.full([], 0, tl.int32)).to(tl.uint32) << 24) | 0xFFFFFF
    R: tl.constexpr = rows.shape[0]
    if BLOCK_C >= 64:
        # (rows, 64-key blocks, t = (j >> 1) & 3): one call each
        NB: tl.constexpr = BLOCK_C // 64
        groups = (start_col // 64 + tl.arange(0, NB))[:, None] * 4 + tl.arange(0, 4)[None, :]
        zero = tl.zeros([R, NB, 4], dtype=tl.int32)
        w0, w1, w2, w3 = tl.philox(seed, groups[None, :, :] + zero, rows[:, None, None] + zero,
                                   head + zero, zero, 7)
        # [.., j5, j4]: word 2 j5 + j4; then [.., j3, j0]: byte 2 j3 + j0
        draw = _byte_draws(tl.join(tl.join(w0, w2), tl.join(w1, w3)))
        # (rows, block, t, j5, j4, j3, j0) -> key 64 block + 32 j5 + 16 j4 + 8 j3 + 2 t + j0
        draw = tl.permute(draw, (0, 1, 3, 4, 5, 2, 6))
    else:
        # one 64-key block, its half (BLOCK_C 32: j5 fixed) or quarter (16: j5, j4 fixed)
        groups = (start_col // 64) * 4 + tl.arange(0, 4)
        zero = tl.zeros([R, 4], dtype=tl.int32)
        w0, w1, w2, w3 = tl.philox(seed, groups[None, :] + zero, rows[:, None] + zero,
                                   head + zero, zero, 7)
        j5 = (start_col // 32) % 2
        if BLOCK_C == 32:
            # [.., j4]: word 2 j5 + j4; (rows, t, j4, j3, j0) -> 16 j4 + 8 j3 + 2 t + j0
            draw = _byte_draws(tl.join(tl.where(j5 == 1, w2, w0), tl.where(j5 == 1, w3, w1)))
            draw = tl.permute(draw, (0, 2, 3, 1, 4))
        else:
            tl.static_assert(BLOCK_C == 16, "dropout tiles are powers of two")
            # word 2 j5 + j4; (rows, t, j3, j0) -> 8 j3 + 2 t + j0
            word = tl.where((start_col // 16) % 2 == 1, tl.where(j5 == 1, w3, w1),
                            tl.where(j5 == 1, w2, w0))
            draw = tl.permute(_byte_draws(word), (0, 2, 1, 3))
    return draw.reshape(R, BLOCK_C) <= t24
