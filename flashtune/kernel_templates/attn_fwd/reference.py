"""Float64/float32 reference for attn_fwd: plain softmax attention in torch, no tiling.

Beside plain and causal attention it computes the score modifications of FlashAttention-2's
API (its test suite's ``attention_ref``), which flashtune's kernels are to serve (issue 29):
a logit ``softcap`` (``softcap * tanh(s / softcap)`` of the scaled scores), a local
``window`` ``(left, right)`` (-1: unbounded on that side), bottom-right aligned as causal
is, and ALiBi slopes (a bias ``-slope * |i + Nk - Nq - j|``), in that order. Attention
dropout takes the kernels' keep mask (``kernel_templates.dropout.dropout_mask``): the
probabilities of the dropped scores are zeroed and the kept ones divided by the keep
probability after the softmax, whose normaliser (the LSE) is over every score.
"""

from __future__ import annotations

import math

import torch

__all__ = ["attn_fwd_reference", "visible"]


def visible(nq: int, nk: int, *, causal: bool = False, window: tuple[int, int] = (-1, -1),
            device: torch.device | str | None = None) -> torch.Tensor:
    """Which keys each query sees: a bool ``(nq, nk)``, bottom-right aligned (query ``i``
    sits at key position ``i + nk - nq``). ``causal`` is ``window``'s right bound 0;
    ``window = (left, right)`` keeps keys ``j`` with ``pos - left <= j <= pos + right``, -1
    leaving that side unbounded (FlashAttention-2's ``window_size``)."""
    left, right = window
    if causal:
        right = 0
    pos = torch.arange(nq, device=device)[:, None] + (nk - nq)
    j = torch.arange(nk, device=device)[None, :]
    ok = torch.ones(nq, nk, dtype=torch.bool, device=device)
    if left >= 0:
        ok &= j >= pos - left
    if right >= 0:
        ok &= j <= pos + right
    return ok


def attn_fwd_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    dtype: torch.dtype = torch.float64,
    window: tuple[int, int] = (-1, -1),
    softcap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    dropout_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(out, lse)`` computed in ``dtype`` with the kernel's conventions.

    GQA by repeating K/V heads (fine for a reference), bottom-right causal alignment, rows
    that see no key give ``out = 0`` and ``lse = -inf``. Shapes as in ``attn_fwd``.
    ``window``, ``softcap`` and ``alibi_slopes`` (``(Hq,)`` or ``(B, Hq)``) as the module
    doc says; the LSE is of the modified scores. (FlashAttention-2's causal ALiBi adds
    ``slope * j`` instead, which differs by a constant per row: the same output, another
    LSE.) ``dropout_mask``: bool ``(B, Hq, Nq, Nk)``, True where a score is kept, applied
    with ``dropout_p`` (the kept probabilities divided by ``keep_probability(dropout_p)``,
    the kernels' quantised keep probability); the LSE does not see it.
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
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if causal or window != (-1, -1):
        s = s.masked_fill(~visible(nq, nk, causal=causal, window=window, device=q.device),
                          float("-inf"))
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(device=q.device, dtype=dtype)
        slopes = slopes.reshape(1 if slopes.dim() == 1 else b, hq, 1, 1)
        pos = torch.arange(nq, device=q.device)[:, None] + (nk - nq)
        dist = (pos - torch.arange(nk, device=q.device)[None, :]).abs().to(dtype)
        s = s - slopes * dist
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)[..., None])
    if dropout_mask is not None:
        from flashtune.kernel_templates.dropout import keep_probability

        p = p.masked_fill(~dropout_mask, 0.0) / keep_probability(dropout_p)
    out = torch.matmul(p, vf)
    return out, lse
