"""attn_fwd launcher: takes an explicit, already-validated config, allocates and launches.

Input checking lives in :mod:`flashtune.runtime.checks`; this layer trusts its arguments so the
tuner and the dispatcher pay for checks once. :func:`kernel_args` is the one place that maps
tensors and a config to the kernel's arguments; the launcher and the precompiler
(:mod:`flashtune.autotune.precompile`, which passes shape-only stand-ins) both use it, so a
precompiled kernel is the one the launch looks up.

The score modifications and the packed (varlen) layout follow FlashAttention-2's
``flash_attn_func`` / ``flash_attn_varlen_func``: ``window``, ``softcap``, ``alibi_slopes``,
``cu_seqlens_q/k`` and ``max_seqlen_q/k`` mean what they mean there. A feature left at its
default passes ``None`` for its pointer and False for its flag, so a plain call compiles to
the kernel it compiled to before they existed.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import triton

from flashtune.kernel_templates.attn_fwd.kernel import attn_fwd_kernel
from flashtune.kernel_templates.dropout import draw_seed, dropout_threshold
from flashtune.kernel_templates.head_tiles import d_tiles
from flashtune.kernel_templates.tma import (
    desc,
    pad_head_dim,
    padded_head_dim,
    pads_head_dim,
    tma_ok,
    unpad_head_dim,
)


def _upcast_dot(q: Any) -> bool:
    # The Triton interpreter stores bf16 as raw uint16 and its tl.dot reads them as integers;
    # under the interpreter the dots run in fp32 instead (same rounding of inputs, fp32 math).
    return q.device.type == "cpu" and q.dtype == torch.bfloat16


def kernel_args(q: Any, k: Any, v: Any, out: Any, lse: Any, config: Mapping[str, int], *,
                causal: bool, scale: float, use_tma: bool, upcast_dot: bool,
                window: tuple[int, int] = (-1, -1), softcap: float | None = None,
                alibi_slopes: Any = None, cu_seqlens_q: Any = None, cu_seqlens_k: Any = None,
                max_seqlen_q: int | None = None, max_seqlen_k: int | None = None,
                dropout_p: float = 0.0, seed: Any = None,
                ) -> tuple[tuple[Any, ...], dict[str, Any], tuple[int, int]]:
    """``(args, kwargs, grid)`` of ``attn_fwd_kernel`` for these tensors and ``config``.

    ``lse`` None: no LSE is stored. ``use_tma`` must already account for :func:`tma_ok`
    (and is ignored with varlen). Varlen when ``cu_seqlens_q`` is given: q/k/v/out are
    ``(total, heads, head_dim)``, ``lse`` is ``(heads_q, total_q)`` and ``max_seqlen_q``
    (the grid) is required (``max_seqlen_k`` is not: each program reads its sequence's
    lengths); the modifications and dropout as in :func:`attn_fwd`.
    """
    varlen = cu_seqlens_q is not None
    heads_q, head_dim = q.shape[-2 if varlen else 1], q.shape[-1]
    bm, bn = config["BLOCK_M"], config["BLOCK_N"]
    bd0, bd1 = d_tiles(head_dim, config.get("SPLIT_D", 0))
    if varlen:
        # (total, H, D): token stride, head stride; the batch strides are unused (0)
        if max_seqlen_q is None:
            raise ValueError("varlen kernel_args need max_seqlen_q: the grid covers the "
                             "longest sequence's query tiles")
        use_tma = False
        batch, heads_kv = cu_seqlens_q.shape[0] - 1, k.shape[1]
        grid_q = int(max_seqlen_q)
        seqlens: tuple[int, int] = (0, 0)  # per program, read from cu_seqlens
        strides: tuple[int, ...] = tuple(
            s for t in (q, k, v, out) for s in (0, t.stride(1), t.stride(0)))
        lse_strides = (0, lse.stride(0)) if lse is not None else (0, 0)
    else:
        batch, heads_kv = q.shape[0], k.shape[1]
        grid_q = q.shape[2]
        seqlens = (q.shape[2], k.shape[2])
        strides = tuple(s for t in (q, k, v, out) for s in (t.stride(0), t.stride(1),
                                                            t.stride(2)))
        lse_strides = (lse.stride(0), lse.stride(1)) if lse is not None else (0, 0)
    descs1: tuple[Any, ...] = (None, None, None, None)
    if use_tma:
        descs: tuple[Any, ...] = (desc(q, bm, bd0), desc(k, bn, bd0), desc(v, bn, bd0),
                                  desc(out, bm, bd0))
        if bd1:
            descs1 = (desc(q, bm, bd1), desc(k, bn, bd1), desc(v, bn, bd1), desc(out, bm, bd1))
    else:
        descs = (None, None, None, None)
    left, right = (int(w) for w in window)
    if causal:
        right = 0  # FA2: causal is a window's right bound 0; a left bound stays
    has_window = left >= 0 or (right >= 0 and not causal)
    cap = float(softcap) if softcap else 0.0
    has_softcap = cap > 0
    has_alibi = alibi_slopes is not None
    stride_ab = alibi_slopes.stride(0) if has_alibi and len(alibi_slopes.shape) == 2 else 0
    has_dropout = dropout_p > 0
    if has_dropout and seed is None:
        raise ValueError("dropout needs the call's seed tensor (kernel_templates.dropout."
                         "draw_seed)")
    args = (
        q, k, v, out, out if lse is None else lse, *descs,
        alibi_slopes, cu_seqlens_q, cu_seqlens_k,
        *strides,
        lse_strides[0], lse_strides[1],
        heads_q, heads_q // heads_kv, seqlens[0], seqlens[1], float(scale),
        stride_ab, left, right, cap if has_softcap else 0.0,
        seed if has_dropout else None, dropout_threshold(dropout_p) if has_dropout else 0,
        *descs1,
    )
    kwargs = dict(
        HEAD_DIM=head_dim, BLOCK_D=bd0, BLOCK_M=bm, BLOCK_N=bn,
        IS_CAUSAL=bool(causal), STORE_LSE=lse is not None, UPCAST_DOT=upcast_dot,
        NEG_SCALE=scale < 0, USE_TMA=use_tma, REVERSE_M=bool(config.get("REVERSE_M", 0)),
        HAS_WINDOW=has_window, HAS_SOFTCAP=has_softcap, HAS_ALIBI=has_alibi, VARLEN=varlen,
        HAS_DROPOUT=has_dropout, BLOCK_D1=bd1, num_warps=config["num_warps"],
        num_stages=config["num_stages"],
    )
    return args, kwargs, (triton.cdiv(grid_q, bm), batch * heads_q)


def attn_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    config: Mapping[str, int],
    *,
    causal: bool = False,
    scale: float | None = None,
    return_lse: bool = False,
    out: torch.Tensor | None = None,
    window: tuple[int, int] = (-1, -1),
    softcap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    dropout_p: float = 0.0,
    seed: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Flash-attention forward with an explicit config.

    Arguments:
        q: ``(batch, heads_q, seqlen_q, head_dim)``, fp16 or bf16, last dim contiguous; with
            ``cu_seqlens_q``, packed ``(total_q, heads_q, head_dim)`` (any token and head
            strides).
        k, v: ``(batch, heads_kv, seqlen_k, head_dim)`` (packed: ``(total_k, heads_kv,
            head_dim)``), same dtype and device as ``q``; ``heads_q`` must be a multiple of
            ``heads_kv`` (GQA/MQA, never expanded).
        config: ``{"BLOCK_M", "BLOCK_N", "num_warps", "num_stages"}`` and optionally
            ``USE_TMA``, ``REVERSE_M`` and ``SPLIT_D`` (0/1: a head dim that is not a power
            of two as two tiles), from the template's space. ``USE_TMA`` falls
            back to plain loads when a tensor is not 16-byte aligned (see :func:`tma_ok`),
            and is off with varlen.
        causal: bottom-right aligned mask: query ``i`` sees key ``j`` iff
            ``j <= i + seqlen_k - seqlen_q`` (per sequence with varlen). With a ``window``,
            causal is its right bound 0.
        scale: softmax scale, default ``1 / sqrt(head_dim)``.
        return_lse: also return the float32 log-sum-exp ``(batch, heads_q, seqlen_q)``
            (varlen: ``(heads_q, total_q)``) of the modified scores (natural log; ``-inf``
            for rows that see no key).
        out: optional preallocated output like ``q`` (last dim contiguous).
        window: ``(left, right)``: query ``i`` sees keys ``i + seqlen_k - seqlen_q - left
            <= j <= i + seqlen_k - seqlen_q + right``; -1 leaves a side unbounded.
        softcap: scores become ``softcap * tanh(scale * q.k / softcap)``; None or 0: off.
        alibi_slopes: float32 ``(heads_q,)`` or ``(batch, heads_q)``, contiguous: scores
            minus ``slope * |i + seqlen_k - seqlen_q - j|``.
        cu_seqlens_q, cu_seqlens_k: int32 ``(batch + 1,)`` on ``q``'s device, cumulative
            sequence starts (``[0, ..., total]``): the packed layout.
        max_seqlen_q, max_seqlen_k: the longest sequence (the grid); read from
            ``cu_seqlens`` when None (a device sync).
        dropout_p: attention dropout in ``[0, 1)`` (FlashAttention-2's ``dropout_p``):
            each score is kept with probability ``keep`` (``dropout_p`` quantised to 1/256,
            :func:`~flashtune.kernel_templates.dropout.keep_probability`) and the kept ones
            scaled by ``1 / keep``; the softmax normaliser, and so the LSE, is over every
            score. The mask is :func:`~flashtune.kernel_templates.dropout.dropout_mask`'s.
        seed: with ``dropout_p > 0``, the int64 ``(1,)`` seed tensor on ``q``'s device
            (:func:`~flashtune.kernel_templates.dropout.draw_seed`; the backward takes the
            same one); None draws one.
    Returns:
        ``out`` like ``q`` in the input dtype, or ``(out, lse)``: in ``q``'s layout
        (``torch.empty_like(q)``: ``q``'s strides where ``q`` is dense, as a ``(B, N, H, D)``
        tensor viewed per head is, so a model's transpose back is a view; contiguous
        otherwise, as for a slice of a packed ``qkv``).
    """
    head_dim = q.shape[-1]
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    if pads_head_dim(q):  # rows that cannot be 16-byte aligned: run padded (tma.py)
        width = padded_head_dim(head_dim)
        got = attn_fwd(pad_head_dim(q, width), pad_head_dim(k, width), pad_head_dim(v, width),
                       config, causal=causal, scale=scale, return_lse=return_lse,
                       window=window, softcap=softcap, alibi_slopes=alibi_slopes,
                       cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                       max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                       dropout_p=dropout_p, seed=seed)
        wide, wide_lse = got if isinstance(got, tuple) else (got, None)
        if out is None:
            out = torch.empty_like(q)
        unpad_head_dim(wide, head_dim, out)
        return (out, wide_lse) if wide_lse is not None else out
    if out is None:
        out = torch.empty_like(q)
    varlen = cu_seqlens_q is not None
    lse = None
    if return_lse:
        lse_shape = (q.shape[1], q.shape[0]) if varlen else q.shape[:3]
        lse = torch.empty(lse_shape, device=q.device, dtype=torch.float32)
    if cu_seqlens_q is not None and max_seqlen_q is None:
        max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max().item())
    if dropout_p > 0 and seed is None:
        seed = draw_seed(q.device)
    use_tma = not varlen and bool(config.get("USE_TMA", 0)) and tma_ok(q, k, v, out)
    args, kwargs, grid = kernel_args(q, k, v, out, lse, config, causal=causal, scale=scale,
                                     use_tma=use_tma, upcast_dot=_upcast_dot(q),
                                     window=window, softcap=softcap, alibi_slopes=alibi_slopes,
                                     cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                                     max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                                     dropout_p=dropout_p, seed=seed)
    attn_fwd_kernel[grid](*args, **kwargs)
    return (out, lse) if lse is not None else out
