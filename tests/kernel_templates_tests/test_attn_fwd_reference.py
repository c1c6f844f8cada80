"""The float64 reference every forward is checked against, including the score
modifications of FlashAttention-2's API (window, softcap, ALiBi) that the kernels are to
serve: against a loop over every (query, key) pair written from FA2's definitions."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from flashtune.kernel_templates.attn_fwd.reference import attn_fwd_reference, visible


def _qkv(b=2, hq=4, hkv=2, nq=7, nk=11, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, hq, nq, d, generator=g, dtype=torch.float64),
            torch.randn(b, hkv, nk, d, generator=g, dtype=torch.float64),
            torch.randn(b, hkv, nk, d, generator=g, dtype=torch.float64))


def _by_loop(q, k, v, *, causal=False, window=(-1, -1), softcap=None, slopes=None):
    """One (b, h, i) at a time, from FA2's attention_ref: scaled scores, softcap, the local
    mask (bottom-right, -1 unbounded; causal sets the right bound to 0), ALiBi bias."""
    b, hq, nq, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    left, right = window
    if causal:
        right = 0
    out = torch.zeros_like(q)
    lse = torch.full((b, hq, nq), -math.inf, dtype=q.dtype)
    for bi in range(b):
        for h in range(hq):
            kh = h // (hq // hkv)
            for i in range(nq):
                pos = i + nk - nq
                scores, values = [], []
                for j in range(nk):
                    if (left >= 0 and j < pos - left) or (right >= 0 and j > pos + right):
                        continue
                    s = float(q[bi, h, i] @ k[bi, kh, j]) / math.sqrt(d)
                    if softcap is not None:
                        s = softcap * math.tanh(s / softcap)
                    if slopes is not None:
                        slope = slopes[h] if slopes.dim() == 1 else slopes[bi, h]
                        s -= float(slope) * abs(pos - j)
                    scores.append(s)
                    values.append(v[bi, kh, j])
                if scores:
                    m = max(scores)
                    w = [math.exp(s - m) for s in scores]
                    total = sum(w)
                    lse[bi, h, i] = m + math.log(total)
                    out[bi, h, i] = sum(wi / total * vj for wi, vj in zip(w, values))
    return out, lse


def _close(got, want):
    out, lse = got
    assert torch.allclose(out, want[0], atol=1e-10), (out - want[0]).abs().max()
    assert torch.equal(torch.isinf(lse), torch.isinf(want[1]))
    fin = ~torch.isinf(lse)
    assert torch.allclose(lse[fin], want[1][fin], atol=1e-10)


@pytest.mark.parametrize("nq,nk", [(7, 11), (11, 7), (9, 9), (1, 13)])
@pytest.mark.parametrize("causal,window", [
    (False, (-1, -1)), (True, (-1, -1)), (False, (3, 2)), (False, (0, 0)), (False, (2, -1)),
    (False, (-1, 1)), (True, (4, -1)), (True, (2, 5)),
])
def test_masks_match_fa2_s_definition(nq, nk, causal, window):
    q, k, v = _qkv(nq=nq, nk=nk)
    _close(attn_fwd_reference(q, k, v, causal=causal, window=window),
           _by_loop(q, k, v, causal=causal, window=window))


@pytest.mark.parametrize("slopes_shape", [(4,), (2, 4)])
def test_softcap_and_alibi_and_all_together(slopes_shape):
    q, k, v = _qkv(nq=6, nk=10, seed=1)
    q = q * 4  # large scores, so that the cap bites
    slopes = torch.rand(*slopes_shape, generator=torch.Generator().manual_seed(2),
                        dtype=torch.float64)
    _close(attn_fwd_reference(q, k, v, softcap=2.5), _by_loop(q, k, v, softcap=2.5))
    _close(attn_fwd_reference(q, k, v, alibi_slopes=slopes), _by_loop(q, k, v, slopes=slopes))
    _close(attn_fwd_reference(q, k, v, causal=True, window=(3, -1), softcap=2.5,
                              alibi_slopes=slopes),
           _by_loop(q, k, v, causal=True, window=(3, -1), softcap=2.5, slopes=slopes))


def test_without_options_it_is_torch_s_attention_and_rows_without_keys_are_zero():
    q, k, v = _qkv(hkv=4, nq=9, nk=9, seed=3)
    out, lse = attn_fwd_reference(q, k, v, causal=True)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True))
    # Nq > Nk, causal: the first Nq - Nk rows see no key
    q2, k2, v2 = _qkv(nq=9, nk=4, seed=4)
    out2, lse2 = attn_fwd_reference(q2, k2, v2, causal=True)
    assert (out2[:, :, :5] == 0).all() and torch.isinf(lse2[:, :, :5]).all()
    assert torch.isfinite(lse2[:, :, 5:]).all()


def test_visible_is_fa2_s_local_mask():
    """FA2's construct_local_mask for a window with both bounds set (the negation of what
    it masks), and causal as the right bound 0."""
    for nq, nk, (left, right) in [(5, 9, (2, 1)), (9, 5, (0, 3)), (6, 6, (1, 0))]:
        row = torch.arange(nq)[:, None]
        col = torch.arange(nk)[None, :]
        masked = (col > torch.minimum(row + nk - nq + right, torch.tensor(nk))) \
            | (col < row + nk - nq - left)
        assert torch.equal(visible(nq, nk, window=(left, right)), ~masked)
    assert torch.equal(visible(4, 6, causal=True), visible(4, 6, window=(-1, 0)))
