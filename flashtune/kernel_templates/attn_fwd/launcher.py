"""attn_fwd launcher: takes an explicit, already-validated config, allocates and launches.

Input checking lives in :mod:`flashtune.runtime.ops`; this layer trusts its arguments so the
tuner and the dispatcher pay for checks once.
"""

from __future__ import annotations

import math
from typing import Mapping

import torch
import triton

from flashtune.kernel_templates.attn_fwd.kernel import attn_fwd_kernel
from flashtune.kernel_templates.attn_fwd.space import block_d


def _upcast_dot(q: torch.Tensor) -> bool:
    # The Triton interpreter stores bf16 as raw uint16 and its tl.dot reads them as integers;
    # under the interpreter the dots run in fp32 instead (same rounding of inputs, fp32 math).
    return q.device.type == "cpu" and q.dtype == torch.bfloat16


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
        config: ``{"BLOCK_M", "BLOCK_N", "num_warps", "num_stages"}`` from the template's space.
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
    heads_kv, seqlen_k = k.shape[1], k.shape[2]
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if return_lse:
        lse = torch.empty((batch, heads_q, seqlen_q), device=q.device, dtype=torch.float32)
        lse_strides = (lse.stride(0), lse.stride(1))
    else:
        lse = out  # never written: STORE_LSE is False
        lse_strides = (0, 0)
    bm = config["BLOCK_M"]
    grid = (triton.cdiv(seqlen_q, bm), batch * heads_q)
    attn_fwd_kernel[grid](
        q, k, v, out, lse,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        lse_strides[0], lse_strides[1],
        heads_q, heads_q // heads_kv, seqlen_q, seqlen_k, float(scale),
        HEAD_DIM=head_dim, BLOCK_D=block_d(head_dim),
        BLOCK_M=bm, BLOCK_N=config["BLOCK_N"],
        IS_CAUSAL=bool(causal), STORE_LSE=bool(return_lse), UPCAST_DOT=_upcast_dot(q),
        num_warps=config["num_warps"], num_stages=config["num_stages"],
    )
    return (out, lse) if return_lse else out
