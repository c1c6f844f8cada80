"""The launcher of ``sdpa_cudnn_bwd``: torch SDPA cuDNN's backward op
(``aten._scaled_dot_product_cudnn_attention_backward``) called with another forward's
output and LSE.

cuDNN's backward reads the forward's output only for ``delta = rowsum(dO * O)`` and its
softmax statistics only as the natural-log LSE of each query row, ``(batch, heads_q,
seqlen_q, 1)`` in float32: what flashtune's forwards return (their ``(batch, heads_q,
seqlen_q)`` LSE, seen with a unit last dim). So any forward that returns that LSE can pair
with it. It has no input for the LSE's own gradient; a call that brings one runs the
``fallback`` backward (one that takes it) instead.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from flashtune.core.errors import InputError
from flashtune.kernel_templates.sdpa_extern import sdpa_is_causal

__all__ = ["sdpa_cudnn_bwd"]

_BWD = torch.ops.aten._scaled_dot_product_cudnn_attention_backward.default


def sdpa_cudnn_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, dout: torch.Tensor, config: Mapping[str, int], *,
                   causal: bool = False, scale: float | None = None,
                   dlse: torch.Tensor | None = None,
                   fallback: Callable[..., Any] | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of attention by cuDNN's backward, from a forward's ``out`` and ``lse``.

    Arguments:
        q: ``(batch, heads_q, seqlen_q, head_dim)``, fp16 or bf16 on a CUDA device, last dim
            contiguous (any other strides).
        k, v: ``(batch, heads_kv, seqlen_k, head_dim)``; ``heads_q`` a multiple of
            ``heads_kv`` (cuDNN sums dK and dV over a GQA group).
        out: the forward's output, shaped like ``q`` (last dim contiguous).
        lse: the forward's float32 log-sum-exp ``(batch, heads_q, seqlen_q)``, natural log,
            contiguous (``attn_fwd_gluon`` with ``return_lse=True``).
        dout: the gradient of ``out``, shaped like it (last dim contiguous).
        config: ``{}`` (cuDNN has no knobs).
        causal: the causal mask, ``seqlen_q == seqlen_k`` or a single query (cuDNN aligns
            it top-left, flashtune bottom-right: the same mask there, and none for one query:
            :func:`~flashtune.kernel_templates.sdpa_extern.sdpa_is_causal`).
        scale: softmax scale, default ``1 / sqrt(head_dim)``.
        dlse: the LSE's gradient, or None. cuDNN's backward takes none, so a call with one
            runs ``fallback`` (the same arguments, ``config`` left to it).
        fallback: the backward of calls with ``dlse``: ``fallback(q, k, v, out, lse, dout,
            causal=, scale=, dlse=)``; None: such a call is an InputError.
    Returns:
        ``(dq, dk, dv)`` in the input dtype, laid out as ``q``, ``k``, ``v``. dQ is summed
        by cuDNN in fp32 with atomics (its last bits may differ between runs).
    Raises:
        ConfigError for a config other than ``{}``; InputError for causal with
        ``1 != seqlen_q != seqlen_k``, an LSE of another shape or dtype, or ``dlse`` without
        a ``fallback``.
    """
    is_causal = sdpa_is_causal("sdpa_cudnn_bwd", q, k, config, causal, gqa=True)
    if dlse is not None:
        if fallback is None:
            raise InputError("sdpa_cudnn_bwd takes no gradient of the LSE (dlse): cuDNN's "
                             "backward has no input for it")
        grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor] = fallback(
            q, k, v, out, lse, dout, causal=causal, scale=scale, dlse=dlse)
        return grads
    if lse.shape != q.shape[:3] or lse.dtype != torch.float32:
        raise InputError(f"lse must be float32 of shape {tuple(q.shape[:3])} (batch, heads_q, "
                         f"seqlen_q), got {lse.dtype} {tuple(lse.shape)}")
    # cuDNN's statistics are (batch, heads, seqlen_q, 1), as its forward returns them; no
    # dropout, so no seed or offset (undefined tensors), and no bias or packed lengths
    dq, dk, dv = _BWD(dout, q, k, v, out, lse.contiguous().unsqueeze(-1), None, None, None,
                      None, None, q.shape[2], k.shape[2], 0.0, is_causal, scale=scale)
    return dq, dk, dv
