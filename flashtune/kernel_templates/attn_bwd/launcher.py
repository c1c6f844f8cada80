"""attn_bwd launcher: takes an explicit config, allocates dQ/dK/dV and launches the three
kernels (see kernel.py). Inputs are trusted (checked by the caller, as for attn_fwd)."""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch
import triton

from flashtune.kernel_templates.attn_bwd.kernel import (
    attn_bwd_dkdv,
    attn_bwd_dq,
    attn_bwd_preprocess,
)
from flashtune.kernel_templates.attn_fwd.space import block_d

PREPROCESS_BLOCK_M = 64


def _upcast_dot(q: Any) -> bool:
    return q.device.type == "cpu" and q.dtype == torch.bfloat16


def _s3(t: Any) -> tuple[int, int, int]:
    return t.stride(0), t.stride(1), t.stride(2)


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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of flash-attention forward with an explicit config.

    Arguments:
        q: ``(batch, heads_q, seqlen_q, head_dim)``; k, v: ``(batch, heads_kv, seqlen_k,
            head_dim)``, the forward's inputs (fp16/bf16, last dim contiguous).
        out: the forward's output, like ``q``; lse: its float32 log-sum-exp
            ``(batch, heads_q, seqlen_q)`` (contiguous), natural log, ``-inf`` for rows
            that see no key.
        dout: the gradient of ``out`` (like ``q``, last dim contiguous).
        config: ``BLOCK_M1``, ``BLOCK_N1`` (dK/dV kernel: query and key tiles),
            ``BLOCK_M2``, ``BLOCK_N2`` (dQ kernel), ``num_warps``, ``num_stages``.
        causal, scale: as in the forward.
        dlse: optional gradient of ``lse`` (when the LSE output was used): since
            ``d lse_i / d s_ij = p_ij`` it enters as ``dS = P * (dP - (delta - dlse))``.
    Returns:
        ``(dq, dk, dv)`` in the input dtype, shaped like ``q``, ``k``, ``v``; dK/dV summed
        over the query heads of each GQA group, deterministically.
    """
    batch, heads_q, seqlen_q, head_dim = q.shape
    heads_kv, seqlen_k = k.shape[1], k.shape[2]
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    bd = block_d(head_dim)
    up = _upcast_dot(q)
    warps, stages = config["num_warps"], config["num_stages"]
    delta = torch.empty((batch, heads_q, seqlen_q), device=q.device, dtype=torch.float32)
    attn_bwd_preprocess[(triton.cdiv(seqlen_q, PREPROCESS_BLOCK_M), batch * heads_q)](
        out, dout, delta, *_s3(out), *_s3(dout), heads_q, seqlen_q,
        HEAD_DIM=head_dim, BLOCK_D=bd, BLOCK_M=PREPROCESS_BLOCK_M)
    if dlse is not None:
        delta -= dlse.to(torch.float32)
    lse = lse.contiguous()
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    dk = torch.empty_like(k, memory_format=torch.contiguous_format)
    dv = torch.empty_like(v, memory_format=torch.contiguous_format)
    group = heads_q // heads_kv
    bn1 = config["BLOCK_N1"]
    attn_bwd_dkdv[(triton.cdiv(seqlen_k, bn1), batch * heads_kv)](
        q, k, v, dout, lse, delta, dk, dv,
        *_s3(q), *_s3(k), *_s3(v), *_s3(dout), *_s3(dk), *_s3(dv),
        heads_q, heads_kv, group, seqlen_q, seqlen_k, float(scale),
        HEAD_DIM=head_dim, BLOCK_D=bd, BLOCK_M1=config["BLOCK_M1"], BLOCK_N1=bn1,
        IS_CAUSAL=bool(causal), UPCAST_DOT=up, num_warps=warps, num_stages=stages)
    bm2 = config["BLOCK_M2"]
    attn_bwd_dq[(triton.cdiv(seqlen_q, bm2), batch * heads_q)](
        q, k, v, dout, lse, delta, dq,
        *_s3(q), *_s3(k), *_s3(v), *_s3(dout), *_s3(dq),
        heads_q, group, seqlen_q, seqlen_k, float(scale),
        HEAD_DIM=head_dim, BLOCK_D=bd, BLOCK_M2=bm2, BLOCK_N2=config["BLOCK_N2"],
        IS_CAUSAL=bool(causal), UPCAST_DOT=up, num_warps=warps, num_stages=stages)
    return dq, dk, dv
