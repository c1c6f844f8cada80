"""flashtune.scaled_dot_product_attention with a boolean attn_mask: causal/window patterns
and key padding run on flashtune (same results as torch's SDPA given the mask), near misses
fall back to torch by reason, and a mask is read once per object (memoised)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import flashtune
from flashtune.kernel_templates.attn_fwd.reference import visible
from flashtune.runtime import sdpa as sdpa_mod
from flashtune.runtime import sdpa_masks
from tests.conftest import DEVICE


def _t(b, h, n, d, seed=0):
    g = torch.Generator().manual_seed(seed + 97 * n + h)
    return torch.randn(b, h, n, d, generator=g).to(device=DEVICE, dtype=torch.float16)


def _qkv(b, hq, hkv, lq, lk, d, seed=0):
    return _t(b, hq, lq, d, seed), _t(b, hkv, lk, d, seed + 1), _t(b, hkv, lk, d, seed + 2)


def _close(got, q, k, v, **kw):
    """flash-attention's rule (as test_sdpa.py): at most 3x torch's own low-precision
    error vs its fp32 result, plus a floor."""
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), **kw)
    want = F.scaled_dot_product_attention(q, k, v, **kw)
    assert got.shape == want.shape and got.dtype == q.dtype
    err = (got.float() - ref).abs().max().item()
    base = (want.float() - ref).abs().max().item()
    assert err <= 3 * base + 2e-3, (err, base)


def _padding(runs, lk, lq=1):
    """A (B, 1, lq, lk) key-padding mask keeping keys [s, e) of each batch element."""
    mask = torch.zeros(len(runs), 1, lq, lk, dtype=torch.bool)
    for b, (s, e) in enumerate(runs):
        mask[b, :, :, s:e] = True
    return mask.to(DEVICE)


@pytest.fixture(autouse=True)
def _fresh():
    sdpa_masks.reset_masks()
    sdpa_mod.reset_fallback_counts()
    yield
    sdpa_masks.reset_masks()


def _served_cases():
    lq, lk = 29, 41
    return [
        # (name, (B, Hq, Hkv, Lq, Lk, D), mask, what describe_route says it is)
        ("causal+window", (1, 2, 2, lq, lk, 32),
         visible(lq, lk, causal=True, window=(7, -1), device=DEVICE), "causal, window (7, 0)"),
        ("causal top-left square", (2, 2, 2, 33, 33, 16),
         torch.ones(33, 33, dtype=torch.bool, device=DEVICE).tril()[None, None], "causal"),
        ("window", (2, 2, 2, lq, lk, 16),
         visible(lq, lk, window=(5, 3), device=DEVICE).expand(2, 1, lq, lk).clone(),
         "window (5, 3)"),
        ("left-only window", (1, 2, 2, lq, lk, 32),
         visible(lq, lk, window=(6, -1), device=DEVICE)[None, None], "window (6, -1)"),
        ("every key", (1, 2, 2, lq, lk, 16), torch.ones(lq, lk, dtype=torch.bool,
                                                           device=DEVICE), "every key"),
        ("key padding right", (3, 2, 2, 17, 30, 32), _padding([(0, 30), (0, 11), (0, 1)], 30),
         "key padding, packed batch"),
        ("key padding left, rows", (2, 2, 2, 17, 30, 16),
         _padding([(9, 30), (0, 30)], 30, lq=17), "key padding, packed batch"),
        ("gqa window", (1, 4, 2, lq, lk, 32),
         visible(lq, lk, causal=True, window=(9, -1), device=DEVICE), "causal, window (9, 0)"),
        ("gqa key padding", (2, 4, 1, 13, 24, 16), _padding([(5, 24), (2, 19)], 24),
         "key padding, packed batch"),
    ]


@pytest.mark.parametrize("name,shape,mask,kind", _served_cases(),
                         ids=[c[0] for c in _served_cases()])
def test_recognised_masks_run_on_flashtune_and_match_torch(name, shape, mask, kind):
    b, hq, hkv, lq, lk, d = shape
    q, k, v = _qkv(b, hq, hkv, lq, lk, d)
    kw = dict(attn_mask=mask, enable_gqa=hq != hkv)
    assert sdpa_mod.fallback_reason(q, k, v, **kw) is None
    route = sdpa_mod.describe_route(q, k, v, **kw)
    assert not route.startswith("torch SDPA") and route.endswith(f"; attn_mask as {kind}"), route
    got = flashtune.scaled_dot_product_attention(q, k, v, **kw)
    assert sdpa_mod.fallback_counts() == {}  # served, not a fallback
    _close(got, q, k, v, **kw)


def test_key_padding_gradients_flow_through_the_packed_kernel():
    q, k, v = (t.requires_grad_(True) for t in _qkv(2, 2, 2, 16, 16, 16, seed=5))
    mask = _padding([(3, 16), (0, 9)], 16)
    out = flashtune.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert sdpa_mod.fallback_counts() == {}
    out.float().sum().backward()
    ref = [t.detach().float().requires_grad_(True) for t in (q, k, v)]
    F.scaled_dot_product_attention(*ref, attn_mask=mask).sum().backward()
    for got, want in zip((q.grad, k.grad, v.grad), ref):
        assert ((got.float() - want.grad).norm() / want.grad.norm()).item() < 1e-2


def _near_misses():
    lq, lk = 21, 27
    flipped = visible(lq, lk, causal=True, window=(6, -1), device=DEVICE).clone()
    flipped[10, 3] = True
    per_head = visible(lq, lk, window=(4, 4), device=DEVICE).expand(1, 2, lq, lk).clone()
    per_head[0, 1] = visible(lq, lk, window=(4, 3), device=DEVICE)
    holes = _padding([(0, lk), (2, 20)], lk)
    holes[1, ..., 9] = False
    return [
        ("one flipped element", flipped, sdpa_masks.OTHER),
        ("non-contiguous padding", holes, sdpa_masks.OTHER),
        ("all-False batch element", _padding([(0, lk), (0, 0)], lk), sdpa_masks.NO_KEY),
        ("float mask", torch.zeros(lq, lk, device=DEVICE, dtype=torch.float16),
         "a float (additive) attn_mask (flashtune serves boolean window and key-padding "
         "masks)"),
        ("per-head masks", per_head, sdpa_masks.PER_HEAD),
        ("top-left causal, Lq < Lk",
         torch.ones(lq, lk, dtype=torch.bool, device=DEVICE).tril(), sdpa_masks.OTHER),
        ("padding and causal rows", _padding([(0, lk), (3, lk)], lk, lq=lq)
         & visible(lq, lk, causal=True, device=DEVICE), sdpa_masks.OTHER),
    ]


@pytest.mark.parametrize("name,mask,reason", _near_misses(), ids=[c[0] for c in _near_misses()])
def test_near_miss_masks_fall_back_to_torch_by_reason(name, mask, reason):
    q, k, v = _qkv(2, 2, 2, 21, 27, 16, seed=3)
    assert sdpa_mod.fallback_reason(q, k, v, attn_mask=mask) == reason
    assert sdpa_mod.describe_route(q, k, v, attn_mask=mask) == f"torch SDPA: {reason}"
    got = flashtune.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)  # torch ran it
    assert sdpa_mod.fallback_counts() == {reason: 1}


def test_dropout_with_a_recognised_mask_is_served_and_is_causal_falls_back():
    q, k, v = _qkv(1, 2, 2, 9, 9, 16)
    mask = visible(9, 9, causal=True, device=DEVICE)
    assert sdpa_mod.fallback_reason(q, k, v, attn_mask=mask) is None
    assert sdpa_mod.fallback_reason(q, k, v, attn_mask=mask, dropout_p=0.1) is None
    torch.manual_seed(3)
    got = flashtune.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.1)
    torch.manual_seed(3)
    assert torch.equal(got, flashtune.attention(q, k, v, causal=True, dropout_p=0.1))
    assert "is_causal" in sdpa_mod.fallback_reason(q, k, v, attn_mask=mask, is_causal=True)


@pytest.fixture
def recognitions(monkeypatch):
    """The masks sdpa_masks.recognise was asked about (it reads the device)."""
    seen = []
    real = sdpa_masks.recognise

    def counting(mask, *sizes):
        seen.append(mask)
        return real(mask, *sizes)

    monkeypatch.setattr(sdpa_masks, "recognise", counting)
    return seen


def test_a_mask_is_recognised_once_per_object_and_version(recognitions):
    q, k, v = _qkv(1, 2, 2, 12, 12, 16, seed=7)
    mask = visible(12, 12, causal=True, window=(3, -1), device=DEVICE)
    for _ in range(3):  # the layers of a model, one mask tensor
        got = flashtune.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        assert sdpa_mod.fallback_reason(q, k, v, attn_mask=mask) is None
        sdpa_mod.describe_route(q, k, v, attn_mask=mask)
    assert len(recognitions) == 1
    _close(got, q, k, v, attn_mask=mask)
    # other call sizes, an equal mask in another tensor: read again
    assert sdpa_mod.fallback_reason(q[:, :1], k[:, :1], v[:, :1], attn_mask=mask) is None
    assert sdpa_mod.fallback_reason(q, k, v, attn_mask=mask.clone()) is None
    assert len(recognitions) == 3
    # an in-place write bumps the version: the verdict is made again, and changes
    mask[5, 0] = True
    assert sdpa_mod.fallback_reason(q, k, v, attn_mask=mask) == sdpa_masks.OTHER
    assert sdpa_mod.fallback_reason(q, k, v, attn_mask=mask) == sdpa_masks.OTHER
    assert len(recognitions) == 4
    got = flashtune.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert torch.equal(got, F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
    assert len(recognitions) == 4 and sdpa_mod.fallback_counts() == {sdpa_masks.OTHER: 1}


def test_the_memo_keeps_the_last_few_masks_and_holds_none_alive(recognitions):
    q, k, v = _qkv(1, 2, 2, 8, 8, 16)
    masks = [visible(8, 8, window=(w, w), device=DEVICE) for w in range(sdpa_masks.MEMO_SIZE)]
    for mask in masks + masks:
        assert sdpa_mod.fallback_reason(q, k, v, attn_mask=mask) is None
    assert len(recognitions) == sdpa_masks.MEMO_SIZE
    sdpa_mod.fallback_reason(q, k, v, attn_mask=visible(8, 8, device=DEVICE))  # one more
    sdpa_mod.fallback_reason(q, k, v, attn_mask=masks[0])  # the oldest was dropped
    assert len(recognitions) == sdpa_masks.MEMO_SIZE + 2
    recognitions.clear()
    del masks, mask
    assert all(ref() is None for ref, *_ in sdpa_masks._SEEN)  # weak references only


def test_inference_tensors_have_no_version_and_are_read_at_every_call(recognitions):
    q, k, v = _qkv(1, 2, 2, 8, 8, 16)
    with torch.inference_mode():
        mask = visible(8, 8, causal=True, device=DEVICE)
    for _ in range(2):
        assert sdpa_mod.fallback_reason(q, k, v, attn_mask=mask) is None
    assert len(recognitions) == 2
