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
def dropout_keep(seed, head, start_row, start_col, threshold, BLOCK_R: tl.constexpr,
                 BLOCK_C: tl.constexpr, TRANS: tl.constexpr = False):
    """The dropout keep mask of queries ``start_row + [0, BLOCK_R)`` against keys
    ``start_col + [0, BLOCK_C)`` of head ``head`` = ``b * H_Q + h`` (positions within the
    sequence, packed or not; blocks powers of two >= 16, starts multiples of them):
    ``(BLOCK_R, BLOCK_C)``, or with ``TRANS`` its transpose ``(BLOCK_C, BLOCK_R)`` (keys by
    queries: the dK/dV kernel's tile), built in that orientation.

    The mapping, the same in every kernel and for every tile: score ``(i, j)`` of ``head``
    is kept iff byte ``2 * i3 + j3`` (``(w >> 8 * byte) & 0xFF``) of word ``2 * j4 + j0``
    of ``philox_4x32_7(key = seed, counter = (head, 8 * (i // 16) + i % 8, 0, 4 * (j // 32)
    + (j // 2) % 4))`` is below ``threshold``, where ``x0``, ``x3``, ``x4`` are bits 0, 3
    and 4 of ``x`` (Triton's ``tl.philox``: the 64-bit seed's low word is key 0, its high
    word key 1; 7 rounds, as FlashAttention-2). The rounds multiply counter words 0 and 2:
    the first round's are constants of the program (head, 0), so it costs one XOR a word
    that moves along the walk. One call serves 16 scores: rows ``r, r + 8`` against keys
    ``c + {0, 1, 8, 9, 16, 17, 24, 25}``, which one thread holds in a Hopper/Ampere MMA
    accumulator (rows ``g, g + 8``, pairs of columns every 8), so the forward and dQ
    kernels build their mask in registers (FlashAttention-2's 16 scores a call). Bits 3 of
    a row and of a column are registers of a thread in either orientation, so each word's
    4 bytes are one thread's in the dK/dV kernel's transposed tile too: it moves words
    between threads (one per 4 scores), not the mask.
    ``threshold`` in ``[1, 256]``: the keep probability is ``threshold / 256`` exactly
    (:func:`flashtune.kernel_templates.dropout.dropout_threshold`)."""
    tl.static_assert(BLOCK_R >= 16 and BLOCK_C >= 16, "dropout tiles are at least 16 x 16")
    # byte <= threshold - 1, tested on the byte shifted to the top (see _byte_draws); a
    # threshold of 1 comes in as a constant (Triton specialises integers equal to 1)
    t24 = ((threshold - 1 + tl.full([], 0, tl.int32)).to(tl.uint32) << 24) | 0xFFFFFF
    # the calls' counters: rows without bit 3, columns without bits 0, 3 and 4
    ic = start_row // 2 + tl.arange(0, BLOCK_R // 2)
    C32: tl.constexpr = 32 if BLOCK_C < 32 else BLOCK_C
    jc = start_col // 32 * 4 + tl.arange(0, C32 // 8)
    zero = tl.zeros([BLOCK_R // 2, C32 // 8], dtype=tl.int32)
    w0, w1, w2, w3 = tl.philox(seed, head + zero, ic[:, None] + zero, zero,
                               jc[None, :] + zero, 7)
    if BLOCK_C >= 32:
        # (ic, jc, j0, j4): word 2 j4 + j0; then (.., i3, j3): byte 2 i3 + j3
        draw = _byte_draws(tl.join(tl.join(w0, w1), tl.join(w2, w3)))
        # (r16, i2..i0, c32, j2 j1, j0, j4, i3, j3): i = 16 r16 + 8 i3 + i2..i0,
        # j = 32 c32 + 16 j4 + 8 j3 + 2 (j2 j1) + j0
        draw = draw.reshape(BLOCK_R // 16, 8, BLOCK_C // 32, 4, 2, 2, 2, 2)
        if TRANS:
            draw = tl.permute(draw, (2, 5, 7, 3, 4, 0, 6, 1)).reshape(BLOCK_C, BLOCK_R)
        else:
            draw = tl.permute(draw, (0, 6, 1, 2, 5, 7, 3, 4)).reshape(BLOCK_R, BLOCK_C)
    else:
        # 16 keys: the half j4 of the calls' 32
        j4 = (start_col // 16) % 2
        draw = _byte_draws(tl.join(tl.where(j4 == 1, w2, w0), tl.where(j4 == 1, w3, w1)))
        # (r16, i2..i0, j2 j1, j0, i3, j3)
        draw = draw.reshape(BLOCK_R // 16, 8, 4, 2, 2, 2)
        if TRANS:
            draw = tl.permute(draw, (5, 2, 3, 0, 4, 1)).reshape(BLOCK_C, BLOCK_R)
        else:
            draw = tl.permute(draw, (0, 4, 1, 5, 2, 3)).reshape(BLOCK_R, BLOCK_C)
    return draw <= t24
