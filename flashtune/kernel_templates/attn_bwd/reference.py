"""Float64/float32 reference gradients for attn_bwd: torch autograd through plain softmax
attention (no tiling), written so rows that see no key have zero output and zero gradient
instead of the NaN that autograd through ``logsumexp`` of an all ``-inf`` row gives."""

from __future__ import annotations

import math

import torch


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
               scale: float) -> torch.Tensor:
    hq, hkv = q.shape[1], k.shape[1]
    if hq != hkv:  # GQA by repeating K/V heads: their gradients sum over the group
        k = k.repeat_interleave(hq // hkv, dim=1)
        v = v.repeat_interleave(hq // hkv, dim=1)
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if causal:
        nq, nk = q.shape[2], k.shape[2]
        i = torch.arange(nq, device=q.device)[:, None]
        j = torch.arange(nk, device=q.device)[None, :]
        s = s.masked_fill(j > i + (nk - nq), float("-inf"))
    row_max = s.amax(dim=-1, keepdim=True).detach()
    row_max = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)
    e = torch.exp(s - row_max)
    denom = e.sum(dim=-1, keepdim=True)
    p = e / torch.where(denom == 0, torch.ones_like(denom), denom)
    return torch.matmul(p, v)


def attn_bwd_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor,
                       *, causal: bool = False, scale: float | None = None,
                       dtype: torch.dtype = torch.float64
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of ``sum(attention(q, k, v) * dout)`` in ``dtype``, with attn_fwd's
    conventions (bottom-right causal, GQA, rows that see no key give zeros)."""
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    qf, kf, vf = (t.detach().to(dtype).requires_grad_(True) for t in (q, k, v))
    out = _attention(qf, kf, vf, causal, scale)
    dq, dk, dv = torch.autograd.grad(out, (qf, kf, vf), dout.to(dtype))
    return dq, dk, dv
