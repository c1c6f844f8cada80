"""attn_fwd launcher: takes an explicit, already-validated config, allocates and launches.

Input checking lives in :mod:`flashtune.runtime.checks`; this layer trusts its arguments so the
tuner and the dispatcher pay for checks once. :func:`kernel_args` is the one place that maps
tensors and a config to the kernel's arguments; the launcher and the precompiler
(:mod:`flashtune.autotune.precompile`, which passes shape-only stand-ins) both use it, so a
precompiled kernel is the one the launch looks up.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import triton

from flashtune.kernel_templates.attn_fwd.kernel import attn_fwd_kernel
from flashtune.kernel_templates.attn_fwd.space import block_d
from flashtune.kernel_templates.tma import desc, tma_ok


def _upcast_dot(q: Any) -> bool:
    # The Triton interpreter stores bf16 as raw uint16 and its tl.dot reads them as integers;
    # under the interpreter the dots run in fp32 instead (same rounding of inputs, fp32 math).
    return q.device.type == "cpu" and q.dtype == torch.bfloat16


def kernel_args(q: Any, k: Any, v: Any, out: Any, lse: Any, config: Mapping[str, int], *,
                causal: bool, scale: float, use_tma: bool, upcast_dot: bool
                ) -> tuple[tuple[Any, ...], dict[str, Any], tuple[int, int]]:
    """``(args, kwargs, grid)`` of ``attn_fwd_kernel`` for these tensors and ``config``.

    ``lse`` None: no LSE is stored. ``use_tma`` must already account for :func:`tma_ok`.
    """
    batch, heads_q, seqlen_q, head_dim = q.shape
    heads_kv, seqlen_k = k.shape[1], k.shape[2]
    bm, bn, bd = config["BLOCK_M"], config["BLOCK_N"], block_d(head_dim)
    if use_tma:
        descs: tuple[Any, ...] = (desc(q, bm, bd), desc(k, bn, bd), desc(v, bn, bd),
                                  desc(out, bm, bd))
    else:
        descs = (None, None, None, None)
    lse_strides = (lse.stride(0), lse.stride(1)) if lse is not None else (0, 0)
    args = (
        q, k, v, out, out if lse is None else lse, *descs,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        lse_strides[0], lse_strides[1],
        heads_q, heads_q // heads_kv, seqlen_q, seqlen_k, float(scale),
    )
    kwargs = dict(
        HEAD_DIM=head_dim, BLOCK_D=bd, BLOCK_M=bm, BLOCK_N=bn,
        IS_CAUSAL=bool(causal), STORE_LSE=lse is not None, UPCAST_DOT=upcast_dot,
        NEG_SCALE=scale < 0, USE_TMA=use_tma, REVERSE_M=bool(config.get("REVERSE_M", 0)),
        num_warps=config["num_warps"], num_stages=config["num_stages"],
    )
    return args, kwargs, (triton.cdiv(seqlen_q, bm), batch * heads_q)


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
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Flash-attention forward with an explicit config.

    Arguments:
        q: ``(batch, heads_q, seqlen_q, head_dim)``, fp16 or bf16, last dim contiguous.
        k, v: ``(batch, heads_kv, seqlen_k, head_dim)``, same dtype and device as ``q``;
            ``heads_q`` must be a multiple of ``heads_kv`` (GQA/MQA, never expanded).
        config: ``{"BLOCK_M", "BLOCK_N", "num_warps", "num_stages"}`` and optionally
            ``USE_TMA`` and ``REVERSE_M`` (0/1), from the template's space. ``USE_TMA`` falls
            back to plain loads when a tensor is not 16-byte aligned (see :func:`tma_ok`).
        causal: bottom-right aligned mask: query ``i`` sees key ``j`` iff
            ``j <= i + seqlen_k - seqlen_q``.
        scale: softmax scale, default ``1 / sqrt(head_dim)``.
        return_lse: also return the float32 log-sum-exp ``(batch, heads_q, seqlen_q)``
            (natural log; ``-inf`` for rows that see no key).
        out: optional preallocated output like ``q`` (last dim contiguous).
    Returns:
        ``out`` ``(batch, heads_q, seqlen_q, head_dim)`` in the input dtype, or ``(out, lse)``.
    """
    batch, heads_q, seqlen_q, head_dim = q.shape
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = None
    if return_lse:
        lse = torch.empty((batch, heads_q, seqlen_q), device=q.device, dtype=torch.float32)
    use_tma = bool(config.get("USE_TMA", 0)) and tma_ok(q, k, v, out)
    args, kwargs, grid = kernel_args(q, k, v, out, lse, config, causal=causal, scale=scale,
                                     use_tma=use_tma, upcast_dot=_upcast_dot(q))
    attn_fwd_kernel[grid](*args, **kwargs)
    return (out, lse) if lse is not None else out
