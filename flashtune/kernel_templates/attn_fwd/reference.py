"""Float64/float32 reference for attn_fwd: plain softmax attention in torch, no tiling."""

from __future__ import annotations

import math

import torch


def attn_fwd_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(out, lse)`` computed in ``dtype`` with the kernel's conventions.

    GQA by repeating K/V heads (fine for a reference), bottom-right causal alignment, rows
    that see no key give ``out = 0`` and ``lse = -inf``. Shapes as in ``attn_fwd``.
    """
    b, hq, nq, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    qf, kf, vf = (t.to(dtype) for t in (q, k, v))
    if hq != hkv:
        kf = kf.repeat_interleave(hq // hkv, dim=1)
        vf = vf.repeat_interleave(hq // hkv, dim=1)
    s = torch.matmul(qf, kf.transpose(-1, -2)) * scale
    if causal:
        i = torch.arange(nq, device=q.device)[:, None]
        j = torch.arange(nk, device=q.device)[None, :]
        s = s.masked_fill(j > i + (nk - nq), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)[..., None])
    out = torch.matmul(p, vf)
    return out, lse
