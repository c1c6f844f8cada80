"""attn_bwd launcher: takes an explicit config, allocates dQ/dK/dV and launches the kernels
(see kernel.py: preprocess, dK/dV and dQ, or preprocess and one fused launch). Inputs are
trusted (checked by the caller, :mod:`flashtune.runtime.checks`, as for attn_fwd).

FlashAttention-2's score modifications (a local ``window``, a ``softcap``, ALiBi slopes),
attention dropout (``dropout_p`` with the forward's seed: the mask is regenerated) and
packed variable-length sequences (``cu_seqlens_q``/``cu_seqlens_k``, as
``flash_attn_varlen_func``) are keyword arguments, off by default; each turns on a constexpr
flag of the kernels, so calls without them run the plain kernels. Packed sequences keep
``KV_SPLITS`` (the partial sums are laid out per K/V head over the packed keys) and never use
TMA.

``DROPOUT_BITS`` (a knob, with dropout; not with ``ONE_LAUNCH``): the dK/dV kernel writes the
keep mask it builds as bits into a scratch and the dQ kernel, launched after it on the same
stream, reads them instead of drawing Philox again. The scratch is one int32 array of
:func:`dropout_bits_shape` (``batch * heads_q`` rows of about ``seqlen_q * seqlen_k / 32``
words, padded to the tiles: 12 MiB for BERT-base's B32 H12 N512), allocated by
:func:`attn_bwd` with ``torch.empty`` for the call (never initialised: every word a visible
score needs is written by the dK/dV kernel before the dQ kernel reads it, the others only
meet scores whose probability is zero) and dropped when it returns, so nothing N x N
outlives the call. Same mask, same arithmetic: the same bits as without the knob.

:func:`kernel_args` is the one place that maps tensors and a config to the kernels'
arguments; the launcher and the precompiler (:mod:`flashtune.autotune.precompile`, which
passes shape-only stand-ins) both use it, so a precompiled kernel is the one the launch
looks up.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import triton

from flashtune.kernel_templates.attn_bwd.kernel import (
    attn_bwd_dkdv,
    attn_bwd_dq,
    attn_bwd_fused,
    attn_bwd_kv_reduce,
    attn_bwd_preprocess,
)
from flashtune.kernel_templates.attn_bwd.space import (
    DEFAULTS,
    dropout_bits_refusal,
    dropout_bits_words,
)
from flashtune.kernel_templates.attn_fwd.space import block_d
from flashtune.kernel_templates.dropout import dropout_threshold
from flashtune.kernel_templates.head_tiles import d_tiles
from flashtune.kernel_templates.tma import (
    desc,
    pad_head_dim,
    padded_head_dim,
    pads_head_dim,
    tma_ok,
    unpad_head_dim,
)

PREPROCESS_BLOCK_M = 64
REDUCE_BLOCK_N = 64

# (kernel, positional args, keyword args, grid) of one launch
Launch = tuple[Any, tuple[Any, ...], dict[str, Any], tuple[int, int]]


def _upcast_dot(q: Any) -> bool:
    # The Triton interpreter stores bf16 as raw uint16 and its tl.dot reads them as integers;
    # under the interpreter the dots run in fp32 instead (same rounding of inputs, fp32 math).
    return q.device.type == "cpu" and q.dtype == torch.bfloat16


def _s3(t: Any) -> tuple[int, int, int]:
    return t.stride(0), t.stride(1), t.stride(2)


def _bhn(t: Any, varlen: bool) -> tuple[int, int, int]:
    """The kernels' ``(batch, head, token)`` strides of ``t``: ``(B, H, N, ...)``, or packed
    ``(total, H, ...)`` with VARLEN (no batch stride: the kernels offset by the start)."""
    return (0, t.stride(1), t.stride(0)) if varlen else _s3(t)


def kv_splits(config: Mapping[str, int], group: int) -> int:
    """How many slices the dK/dV kernel cuts each GQA group's query heads into: the config's
    ``KV_SPLITS`` where it divides the group, else their largest common divisor (1 without
    GQA)."""
    return math.gcd(int(config.get("KV_SPLITS", DEFAULTS["KV_SPLITS"])), group)


def partial_shape(k: Any, splits: int) -> tuple[int, int, int]:
    """Shape of each fp32 partial dK/dV buffer for ``splits`` > 1:
    ``(batch * heads_kv * splits, seqlen_k, head_dim)``, for packed ``k``
    ``(total_k, heads_kv, head_dim)`` ``(heads_kv * splits, total_k, head_dim)``."""
    if len(k.shape) == 3:
        total_k, heads_kv, head_dim = k.shape
        return heads_kv * splits, total_k, head_dim
    batch, heads_kv, seqlen_k, head_dim = k.shape
    return batch * heads_kv * splits, seqlen_k, head_dim


def dropout_bits_shape(config: Mapping[str, int], batch: int, heads_q: int, seqlen_q: int,
                       seqlen_k: int) -> tuple[int, int]:
    """Shape of DROPOUT_BITS' int32 scratch: ``(batch * heads_q, words)``, ``words`` the
    bit array of one query head's ``seqlen_q x seqlen_k`` scores (the longest sequences of a
    packed batch) padded to the config's tiles (``space.dropout_bits_words``)."""
    return batch * heads_q, dropout_bits_words(config, seqlen_q, seqlen_k)[0]


def _window_args(causal: bool, window: tuple[int, int]) -> tuple[bool, int, int]:
    """``(HAS_WINDOW, WINDOW_LEFT, WINDOW_RIGHT)``: causal alone is IS_CAUSAL's (no window);
    with a left bound causal makes the right bound 0 (FlashAttention-2); a negative bound
    is unbounded (-1)."""
    left, right = (int(w) if w is not None and w >= 0 else -1 for w in window)
    if causal:
        right = 0
    if left < 0 and (causal or right < 0):
        return False, -1, -1
    return True, left, right


def _max_len(cu: Any) -> int:
    return int((cu[1:] - cu[:-1]).max().item())


def kernel_args(q: Any, k: Any, v: Any, out: Any, lse: Any, dout: Any, delta: Any,
                dq: Any, dk: Any, dv: Any, config: Mapping[str, int], *, causal: bool,
                scale: float, upcast_dot: bool, dlse: Any = None, part_k: Any = None,
                part_v: Any = None, window: tuple[int, int] = (-1, -1),
                softcap: float | None = None, alibi_slopes: Any = None,
                cu_seqlens_q: Any = None, cu_seqlens_k: Any = None,
                max_seqlen_q: int | None = None, max_seqlen_k: int | None = None,
                dropout_p: float = 0.0, seed: Any = None,
                bits: Any = None) -> dict[str, Launch]:
    """The launches in order: ``{"preprocess", "dkdv", ["kv_reduce",] "dq"}``, or with
    ``ONE_LAUNCH`` ``{"preprocess", "fused", ["kv_reduce"]}`` -> ``(kernel, args, kwargs,
    grid)``.

    ``lse`` and ``delta`` must be contiguous ``(batch, heads_q, seqlen_q)`` float32 (with
    ``cu_seqlens_q``: ``(heads_q, total_q)``); every other tensor needs a contiguous last dim
    (any other strides). ``dlse`` None: no LSE gradient (the preprocess kernel is compiled
    without it). ``part_k``/``part_v``: contiguous fp32 buffers of :func:`partial_shape`,
    needed when :func:`kv_splits` > 1. ``window``, ``softcap``, ``alibi_slopes`` and the
    varlen arguments as :func:`attn_bwd` takes them (``max_seqlen_q``/``max_seqlen_k``
    read from ``cu_seqlens_q``/``cu_seqlens_k`` when None); ``dropout_p`` with the
    forward's ``seed``; ``bits``: with ``DROPOUT_BITS`` (and dropout) the int32 scratch of
    :func:`dropout_bits_shape`, contiguous (ignored without dropout).
    """
    varlen = cu_seqlens_q is not None
    if varlen:
        # packed: the kernels' N_Q/N_K are the totals (the row strides of the LSE, delta and
        # the partial sums); the grids cover the longest sequence
        (n_q, heads_q, head_dim), (n_k, heads_kv) = q.shape, k.shape[:2]
        batch = cu_seqlens_q.shape[0] - 1
        seqlen_q = _max_len(cu_seqlens_q) if max_seqlen_q is None else int(max_seqlen_q)
        seqlen_k = _max_len(cu_seqlens_k) if max_seqlen_k is None else int(max_seqlen_k)
    else:
        batch, heads_q, seqlen_q, head_dim = q.shape
        heads_kv, seqlen_k = k.shape[1], k.shape[2]
        n_q, n_k = seqlen_q, seqlen_k
    bd = block_d(head_dim)
    # the main kernels' head-dim tiles: one of bd, or SPLIT_D's two (head_tiles.d_tiles)
    bd0, bd1 = d_tiles(head_dim, config.get("SPLIT_D", DEFAULTS["SPLIT_D"]))
    warps, stages = config["num_warps"], config["num_stages"]
    group = heads_q // heads_kv
    split = bool(config.get("SPLIT_LOOPS", DEFAULTS["SPLIT_LOOPS"]))
    # the tensor-copy engine where the config asks for it and every streamed tensor allows it
    # (the descriptors are per batch element: never with packed sequences)
    use_tma = bool(config.get("USE_TMA", 0)) and not varlen and tma_ok(q, k, v, dout)
    has_window, left, right = _window_args(causal, window)
    cap = float(softcap) if softcap is not None and softcap > 0 else 0.0
    has_softcap = cap > 0
    has_alibi = alibi_slopes is not None
    # the score modifications' and varlen's arguments, after the plain kernels' own (whose
    # parameter layout, and so code, stays as it was); any tensor for a pointer left off
    stride_ab = alibi_slopes.stride(0) if has_alibi and len(alibi_slopes.shape) == 2 else 0
    has_dropout = dropout_p > 0
    if has_dropout and seed is None:
        raise ValueError("dropout's backward needs the forward's seed tensor")
    mods = (alibi_slopes if has_alibi else lse, cu_seqlens_q if varlen else lse,
            cu_seqlens_k if varlen else lse, stride_ab, left, right, cap,
            seed if has_dropout else lse, dropout_threshold(dropout_p) if has_dropout else 0)
    flags = dict(HAS_WINDOW=has_window, HAS_SOFTCAP=has_softcap, HAS_ALIBI=has_alibi,
                 VARLEN=varlen, HAS_DROPOUT=has_dropout)
    # DROPOUT_BITS: the scratch and its layout as keyword arguments of the two main kernels
    # (None without the knob: specialised away, the kernels' parameters as they were)
    refusal = dropout_bits_refusal(config, has_dropout) if has_dropout else None
    if refusal is not None:
        raise ValueError(refusal)
    use_bits = has_dropout and bool(config.get("DROPOUT_BITS", DEFAULTS["DROPOUT_BITS"]))
    # the kernels' Bits, bits_stride_h, bits_nkb (after the dropout arguments, in their
    # order) and the DROPOUT_BITS flag
    bits_args: tuple[Any, ...] = (None, None, None)
    if use_bits:
        shape = dropout_bits_shape(config, batch, heads_q, seqlen_q, seqlen_k)
        if bits is None or tuple(bits.shape) != shape or bits.dtype != torch.int32:
            raise ValueError(f"DROPOUT_BITS needs an int32 scratch of shape {shape}")
        bits_args = (bits, shape[1], dropout_bits_words(config, seqlen_q, seqlen_k)[1])
    if dlse is None:
        dl_strides: tuple[int, int, int] = (0, 0, 0)
    elif varlen:  # (heads_q, total_q)
        dl_strides = (0, dlse.stride(0), dlse.stride(1))
    else:
        dl_strides = _s3(dlse)
    # delta = rowsum(dO * O) - dLSE does not see the modifications; packed tokens as one
    # batch element of total_q rows (delta (heads_q, total_q) like the LSE)
    pre_b, pre_n = (1, n_q) if varlen else (batch, seqlen_q)
    pre: Launch = (
        attn_bwd_preprocess,
        (out, dout, delta if dlse is None else dlse, delta, *_bhn(out, varlen),
         *_bhn(dout, varlen), *dl_strides, heads_q, pre_n),
        dict(HEAD_DIM=head_dim, BLOCK_D=bd, BLOCK_M=PREPROCESS_BLOCK_M,
             HAS_DLSE=dlse is not None),
        (triton.cdiv(pre_n, PREPROCESS_BLOCK_M), pre_b * heads_q))
    bm1, bn1 = config["BLOCK_M1"], config["BLOCK_N1"]
    bm2, bn2 = config["BLOCK_M2"], config["BLOCK_N2"]
    splits = kv_splits(config, group)
    if splits > 1 and (part_k is None or part_v is None):
        raise ValueError(f"KV_SPLITS {splits} needs part_k and part_v buffers")
    reverse_dq = bool(config.get("REVERSE_DQ", DEFAULTS["REVERSE_DQ"]))
    desc_qdo = (desc(q, bm1, bd0), desc(dout, bm1, bd0)) if use_tma else (None, None)
    desc_kv = (desc(k, bn2, bd0), desc(v, bn2, bd0)) if use_tma else (None, None)
    # the second tile's descriptors, the kernels' last runtime arguments (None without one)
    desc_qdo1: tuple[Any, ...] = (None, None)
    desc_kv1: tuple[Any, ...] = (None, None)
    if use_tma and bd1:
        desc_qdo1 = (desc(q, bm1, bd1), desc(dout, bm1, bd1))
        desc_kv1 = (desc(k, bn2, bd1), desc(v, bn2, bd1))
    parts_k, parts_v = (part_k, part_v) if splits > 1 else (dk, dv)
    s_q, s_k, s_v, s_do = (_bhn(t, varlen) for t in (q, k, v, dout))
    s_dq, s_dk, s_dv = (_bhn(t, varlen) for t in (dq, dk, dv))
    # packed dK/dV partial sums are reduced as one batch element of total_k rows
    reduce = (dk, dv, s_dk, s_dv, heads_kv, n_k, 1 if varlen else batch, head_dim, splits)
    launches: dict[str, Launch] = {"preprocess": pre}
    if config.get("ONE_LAUNCH", DEFAULTS["ONE_LAUNCH"]):
        n1_tiles, n2_tiles = triton.cdiv(seqlen_k, bn1), triton.cdiv(seqlen_q, bm2)
        n1_programs = n1_tiles * batch * heads_kv * splits
        launches["fused"] = (
            attn_bwd_fused,
            (q, k, v, dout, lse, delta, dq, dk, dv, parts_k, parts_v, *desc_qdo, *desc_kv,
             *s_q, *s_k, *s_v, *s_do, *s_dq, *s_dk, *s_dv,
             heads_q, heads_kv, group, n_q, n_k, float(scale), n1_tiles, n1_programs,
             n2_tiles, *mods, *desc_qdo1, *desc_kv1),
            dict(HEAD_DIM=head_dim, BLOCK_D=bd0, BLOCK_M1=bm1, BLOCK_N1=bn1, BLOCK_M2=bm2,
                 BLOCK_N2=bn2, IS_CAUSAL=bool(causal), UPCAST_DOT=upcast_dot,
                 SPLIT_LOOPS=split, KV_SPLITS=splits, USE_TMA=use_tma, REVERSE_DQ=reverse_dq,
                 **flags, BLOCK_D1=bd1, num_warps=warps, num_stages=stages),
            (n1_programs + n2_tiles * batch * heads_q, 1))
        if splits > 1:
            launches["kv_reduce"] = _kv_reduce(part_k, part_v, *reduce)
        return launches
    launches["dkdv"] = (
        attn_bwd_dkdv,
        (q, k, v, dout, lse, delta, dk, dv, parts_k, parts_v, *desc_qdo,
         *s_q, *s_k, *s_v, *s_do, *s_dk, *s_dv,
         heads_q, heads_kv, group, n_q, n_k, float(scale), *mods, *bits_args, *desc_qdo1),
        dict(HEAD_DIM=head_dim, BLOCK_D=bd0, BLOCK_M1=bm1, BLOCK_N1=bn1,
             IS_CAUSAL=bool(causal), UPCAST_DOT=upcast_dot, SPLIT_LOOPS=split,
             KV_SPLITS=splits, USE_TMA=use_tma, **flags, DROPOUT_BITS=use_bits,
             BLOCK_D1=bd1, num_warps=warps, num_stages=stages),
        (triton.cdiv(seqlen_k, bn1), batch * heads_kv * splits))
    if splits > 1:
        launches["kv_reduce"] = _kv_reduce(part_k, part_v, *reduce)
    launches["dq"] = (
        attn_bwd_dq,
        (q, k, v, dout, lse, delta, dq, *desc_kv,
         *s_q, *s_k, *s_v, *s_do, *s_dq,
         heads_q, group, n_q, n_k, float(scale), *mods, *bits_args, *desc_kv1),
        dict(HEAD_DIM=head_dim, BLOCK_D=bd0, BLOCK_M2=bm2, BLOCK_N2=bn2,
             IS_CAUSAL=bool(causal), UPCAST_DOT=upcast_dot, SPLIT_LOOPS=split,
             USE_TMA=use_tma, REVERSE_DQ=reverse_dq, **flags, DROPOUT_BITS=use_bits,
             BLOCK_D1=bd1, num_warps=warps, num_stages=stages),
        (triton.cdiv(seqlen_q, bm2), batch * heads_q))
    return launches


def _kv_reduce(part_k: Any, part_v: Any, dk: Any, dv: Any, s_dk: tuple[int, int, int],
               s_dv: tuple[int, int, int], heads_kv: int, seqlen_k: int, batch: int,
               head_dim: int, splits: int) -> Launch:
    """The launch that adds up the ``splits`` fp32 partial dK/dV sums in order (``s_dk``,
    ``s_dv``: dK's and dV's ``(batch, head, token)`` strides)."""
    return (attn_bwd_kv_reduce,
            (part_k, part_v, dk, dv, *s_dk, *s_dv, heads_kv, seqlen_k),
            dict(HEAD_DIM=head_dim, BLOCK_D=block_d(head_dim), BLOCK_N=REDUCE_BLOCK_N,
                 KV_SPLITS=splits, num_warps=4),
            (triton.cdiv(seqlen_k, REDUCE_BLOCK_N), batch * heads_kv))


def attn_bwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dout: torch.Tensor,
    config: Mapping[str, int],
    *,
    causal: bool = False,
    scale: float | None = None,
    dlse: torch.Tensor | None = None,
    dq: torch.Tensor | None = None,
    dk: torch.Tensor | None = None,
    dv: torch.Tensor | None = None,
    window: tuple[int, int] = (-1, -1),
    softcap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    dropout_p: float = 0.0,
    seed: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of flash-attention forward with an explicit config.

    Arguments:
        q: ``(batch, heads_q, seqlen_q, head_dim)``, fp16 or bf16, last dim contiguous
            (packed ``(total_q, heads_q, head_dim)`` with ``cu_seqlens_q``).
        k, v: ``(batch, heads_kv, seqlen_k, head_dim)`` (packed ``(total_k, heads_kv,
            head_dim)``), same dtype and device as ``q``; ``heads_q`` must be a multiple of
            ``heads_kv`` (GQA/MQA, never expanded).
        out: the forward's output, like ``q`` (last dim contiguous).
        lse: the forward's float32 log-sum-exp ``(batch, heads_q, seqlen_q)`` (packed:
            ``(heads_q, total_q)``), natural log of the modified scores, ``-inf`` for rows
            that see no key (``attn_fwd(..., return_lse=True)``).
        dout: the gradient of ``out``, like ``q`` (last dim contiguous).
        config: ``{"BLOCK_M1", "BLOCK_N1", "BLOCK_M2", "BLOCK_N2", "num_warps",
            "num_stages"}`` from the template's space: the dK/dV kernel's query step and key
            tile, the dQ kernel's query tile and key step; optionally ``SPLIT_LOOPS`` (0/1:
            unmasked blocks in loops of their own, see kernel.py) and ``KV_SPLITS`` (1, 2,
            4, 8: dK/dV programs per key tile, each over a slice of the GQA group, summed
            in order afterwards; :func:`kv_splits`), ``USE_TMA`` (0/1: Q/dO and K/V
            tiles through tensor descriptors; plain loads where a tensor is not 16-byte
            aligned, see ``attn_fwd.launcher.tma_ok``, and for packed sequences),
            ``ONE_LAUNCH`` (0/1: the dK/dV and dQ programs in one launch) and ``REVERSE_DQ``
            (0/1: dQ query tiles last-first); the last two only reorder programs (the same
            bits); ``DROPOUT_BITS`` (0/1, with dropout: the dQ kernel reads the dK/dV
            kernel's mask from a scratch of ~``seqlen_q * seqlen_k / 8`` bytes per query
            head held during the call; not with ONE_LAUNCH, query tiles of 64k, key tiles
            of 32k; ignored without dropout).
        causal: bottom-right aligned mask: query ``i`` sees key ``j`` iff
            ``j <= i + seqlen_k - seqlen_q`` (FlashAttention-2's ``window_size``
            ``(left, 0)``).
        scale: softmax scale, default ``1 / sqrt(head_dim)``.
        dlse: optional gradient of ``lse``, shaped like it, any strides (when the LSE output
            was used): since ``d lse_i / d s_ij = p_ij`` it enters as
            ``dS = P * (dP - (delta - dlse))``.
        dq, dk, dv: optional preallocated outputs shaped like ``q``, ``k``, ``v`` in their
            dtype (last dim contiguous); written in full.
        window: ``(left, right)`` local attention (FlashAttention-2's ``window_size``):
            query ``i`` sees keys ``j`` with ``i + seqlen_k - seqlen_q - left <= j <=
            i + seqlen_k - seqlen_q + right``, -1 unbounded on that side; with ``causal``
            the right bound is 0.
        softcap: scores ``softcap * tanh(scale * q.k / softcap)`` (None or 0: off).
        alibi_slopes: float32 ``(heads_q,)`` or ``(batch, heads_q)``, contiguous: scores
            minus ``slope * |i + seqlen_k - seqlen_q - j|``; no gradient to the slopes.
        cu_seqlens_q, cu_seqlens_k: int32 ``(batch + 1,)`` on ``q``'s device, cumulative
            sequence lengths of packed ``q`` and ``k``/``v`` (``flash_attn_varlen_func``);
            sequence ``b`` is tokens ``[cu[b], cu[b + 1])``, and the alignment, window and
            ALiBi use its own lengths.
        max_seqlen_q, max_seqlen_k: the longest sequences (the launch grids); read from the
            ``cu_seqlens`` (a device sync) when None.
        dropout_p, seed: the forward's attention dropout and its seed tensor (required with
            ``dropout_p > 0``): both kernels regenerate its keep mask ``Z`` (never stored)
            and, with ``r`` the inverse keep probability, compute ``dV = (P Z r)^T dO`` and
            ``dS = P (dP Z r - delta)``; ``out`` is the dropped output, so ``delta =
            rowsum(dO * O)`` needs no change.
    Returns:
        ``(dq, dk, dv)`` in the input dtype, shaped and laid out like ``q``, ``k``, ``v``
        (``torch.empty_like``: their strides where dense, else contiguous); dK/dV summed
        over the query heads of each GQA group in a fixed order (deterministic: the same
        inputs and config give the same bits).
    """
    head_dim = q.shape[-1]
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    if pads_head_dim(q):  # rows that cannot be 16-byte aligned: run padded (tma.py)
        width = padded_head_dim(head_dim)
        qw, kw, vw, ow, dow = (pad_head_dim(t, width) for t in (q, k, v, out, dout))
        wide = attn_bwd(qw, kw, vw, ow, lse, dow, config, causal=causal, scale=scale,
                        dlse=dlse, window=window, softcap=softcap, alibi_slopes=alibi_slopes,
                        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                        dropout_p=dropout_p, seed=seed)
        grads = []
        for given, like, got in zip((dq, dk, dv), (q, k, v), wide):
            if given is None:
                given = torch.empty_like(like)
            grads.append(unpad_head_dim(got, head_dim, given))
        return grads[0], grads[1], grads[2]
    if cu_seqlens_q is not None:  # packed: delta (heads_q, total_q) like the LSE
        delta_shape: tuple[int, ...] = (q.shape[1], q.shape[0])
    else:
        delta_shape = tuple(q.shape[:3])
    delta = torch.empty(delta_shape, device=q.device, dtype=torch.float32)
    lse = lse.contiguous()
    if dlse is not None and dlse.dtype != torch.float32:
        dlse = dlse.to(torch.float32)
    if dq is None:
        dq = torch.empty_like(q)
    if dk is None:
        dk = torch.empty_like(k)
    if dv is None:
        dv = torch.empty_like(v)
    part_k = part_v = None
    splits = kv_splits(config, q.shape[1] // k.shape[1])  # heads: axis 1 either way
    if splits > 1:
        shape = partial_shape(k, splits)
        part_k = torch.empty(shape, device=q.device, dtype=torch.float32)
        part_v = torch.empty(shape, device=q.device, dtype=torch.float32)
    bits = None
    if dropout_p > 0 and config.get("DROPOUT_BITS", DEFAULTS["DROPOUT_BITS"]):
        # the keep mask as bits for this call only (see the module doc): written by the
        # dK/dV launch, read by the dQ launch after it, freed on return
        if cu_seqlens_q is not None:
            batch = cu_seqlens_q.shape[0] - 1
            if max_seqlen_q is None:
                max_seqlen_q = _max_len(cu_seqlens_q)
            if max_seqlen_k is None:
                max_seqlen_k = _max_len(cu_seqlens_k)
            lens = (int(max_seqlen_q), int(max_seqlen_k))
        else:
            batch, lens = q.shape[0], (q.shape[2], k.shape[2])
        bits = torch.empty(dropout_bits_shape(config, batch, q.shape[1], *lens),
                           device=q.device, dtype=torch.int32)
    launches = kernel_args(q, k, v, out, lse, dout, delta, dq, dk, dv, config, causal=causal,
                           scale=scale, upcast_dot=_upcast_dot(q), dlse=dlse, part_k=part_k,
                           part_v=part_v, window=window, softcap=softcap,
                           alibi_slopes=alibi_slopes, cu_seqlens_q=cu_seqlens_q,
                           cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                           max_seqlen_k=max_seqlen_k, dropout_p=dropout_p, seed=seed,
                           bits=bits)
    for kernel, args, kwargs, grid in launches.values():
        kernel[grid](*args, **kwargs)
    return dq, dk, dv
