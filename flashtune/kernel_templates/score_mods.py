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
