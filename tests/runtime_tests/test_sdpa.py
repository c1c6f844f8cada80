"""flashtune.scaled_dot_product_attention: torch's semantics (top-left causal, enable_gqa),
flashtune where it serves the call, torch with one debug line per reason where it does not."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

import flashtune
from flashtune.runtime import sdpa as sdpa_mod
from tests.conftest import DEVICE


def _t(b, h, n, d, dtype=torch.float16, seed=0):
    g = torch.Generator().manual_seed(seed + 97 * n + h)
    return torch.randn(b, h, n, d, generator=g).to(device=DEVICE, dtype=dtype)


def _torch_fp32(q, k, v, **kw):
    return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), **kw)


def _close(got, want, ref):
    """flash-attention's rule: at most 3x torch's own low-precision error (plus a floor)."""
    err = (got.float() - ref).abs().max().item()
    base = (want.float() - ref).abs().max().item()
    assert err <= 3 * base + 2e-3, (err, base)


@pytest.mark.parametrize("lq,lk", [(37, 37), (5, 70), (1, 33), (70, 129)])
@pytest.mark.parametrize("causal", [False, True])
def test_matches_torch_including_top_left_causal(lq, lk, causal):
    q, k, v = _t(2, 4, lq, 32), _t(2, 2, lk, 32), _t(2, 2, lk, 32, seed=1)
    kw = dict(is_causal=causal, enable_gqa=True)
    assert sdpa_mod.fallback_reason(q, k, v, **kw) is None  # flashtune serves all of these
    got = flashtune.scaled_dot_product_attention(q, k, v, **kw)
    ref = _torch_fp32(q, k, v, **kw)
    want = F.scaled_dot_product_attention(q.cpu(), k.cpu(), v.cpu(), **kw) if DEVICE == "cpu" \
        else F.scaled_dot_product_attention(q, k, v, **kw)
    assert got.shape == want.shape and got.dtype == q.dtype
    _close(got, want.to(got.device), ref)


def test_custom_scale():
    q, k, v = _t(1, 2, 20, 64), _t(1, 2, 30, 64), _t(1, 2, 30, 64, seed=2)
    got = flashtune.scaled_dot_product_attention(q, k, v, scale=0.3)
    ref = _torch_fp32(q, k, v, scale=0.3)
    _close(got, F.scaled_dot_product_attention(q, k, v, scale=0.3), ref)


def _fallback_cases():
    q, k, v = _t(1, 2, 9, 32), _t(1, 2, 9, 32), _t(1, 2, 9, 32, seed=3)
    mask = torch.ones(9, 9, dtype=torch.bool, device=DEVICE).tril()
    mask[2, 7] = True  # a causal mask but for one key: not a pattern flashtune serves
    return [
        ("attn_mask", (q, k, v), dict(attn_mask=mask)),
        ("more queries than keys", (_t(1, 2, 12, 32), k, v), dict(is_causal=True)),
        ("head_dim", (_t(1, 2, 9, 264), _t(1, 2, 9, 264), _t(1, 2, 9, 264)), {}),
        ("dtype", (q.float(), k.float(), v.float()), {}),
        ("Ev != E", (q, k, _t(1, 2, 9, 16)), {}),
    ]


@pytest.mark.parametrize("name,args,kw", _fallback_cases(), ids=[c[0] for c in _fallback_cases()])
def test_unsupported_calls_fall_back_to_torch_with_one_debug_line(name, args, kw, caplog):
    sdpa_mod._LOGGED.clear()
    with caplog.at_level(logging.DEBUG, logger="flashtune"):
        for _ in range(3):
            got = flashtune.scaled_dot_product_attention(*args, **kw)
    want = F.scaled_dot_product_attention(*args, **kw)
    assert torch.equal(got, want)  # torch ran it, with the same arguments
    lines = [r.getMessage() for r in caplog.records if "falling back" in r.getMessage()]
    assert len(lines) == 1, lines


def test_dropout_is_served_and_gqa_without_enable_gqa_raises_as_torch_does():
    q, k, v = _t(1, 4, 9, 32), _t(1, 2, 9, 32), _t(1, 2, 9, 32, seed=4)
    assert sdpa_mod.fallback_reason(q, q, q, dropout_p=0.1) is None  # flashtune drops
    assert "dropout_p" in sdpa_mod.fallback_reason(q, q, q, dropout_p=1.5)
    with pytest.raises(RuntimeError):
        F.scaled_dot_product_attention(q, k, v)
    with pytest.raises(RuntimeError):
        flashtune.scaled_dot_product_attention(q, k, v)


def test_gradients_flow_through_flashtune():
    q, k, v = (_t(1, 2, 21, 32, seed=s).requires_grad_(True) for s in (5, 6, 7))
    assert sdpa_mod.fallback_reason(q, k, v, is_causal=True) is None
    out = flashtune.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert out.grad_fn is not None
    out.float().sum().backward()
    ref = [t.detach().float().requires_grad_(True) for t in (q, k, v)]
    F.scaled_dot_product_attention(*ref, is_causal=True).sum().backward()
    for got, want in zip((q.grad, k.grad, v.grad), ref):
        assert ((got.float() - want.grad).norm() / want.grad.norm()).item() < 1e-2


def test_fallbacks_are_counted_by_reason_and_served_calls_are_not():
    q, k, v = _t(1, 2, 9, 32), _t(1, 2, 9, 32), _t(1, 2, 9, 32, seed=8)
    mask = torch.zeros(9, 9, device=DEVICE, dtype=q.dtype)  # additive: torch's
    sdpa_mod.reset_fallback_counts()
    for _ in range(3):
        flashtune.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    flashtune.scaled_dot_product_attention(q, k, v, scale=float("inf"))
    flashtune.scaled_dot_product_attention(q, k, v)  # served: not a fallback
    flashtune.scaled_dot_product_attention(q, k, v, dropout_p=0.5)  # served too
    counts = sdpa_mod.fallback_counts()
    assert counts == {sdpa_mod.fallback_reason(q, k, v, attn_mask=mask): 3,
                      sdpa_mod.fallback_reason(q, k, v, scale=float("inf")): 1}
    counts.clear()  # a copy: the caller's to change
    assert sum(sdpa_mod.fallback_counts().values()) == 4
    sdpa_mod.reset_fallback_counts()
    assert sdpa_mod.fallback_counts() == {}


def test_describe_route_names_the_fallback_or_flashtune_s_choice_without_running():
    q, k, v = _t(1, 2, 9, 32), _t(1, 2, 20, 32), _t(1, 2, 20, 32, seed=9)
    mask = torch.ones(9, 20, dtype=torch.bool, device=DEVICE).tril()  # top-left, Lq < Lk
    sdpa_mod.reset_fallback_counts()
    assert sdpa_mod.describe_route(q, k, v, attn_mask=mask) == \
        "torch SDPA: " + sdpa_mod.fallback_reason(q, k, v, attn_mask=mask)
    # top-left causal with Lq < Lk runs on the first Lq keys: the route is that call's
    want = flashtune.lookup_config(q, k[:, :, :9], v[:, :, :9], causal=True)
    assert sdpa_mod.describe_route(q, k, v, is_causal=True) == \
        f"{want.template} ({want.source})"
    assert sdpa_mod.fallback_counts() == {}  # nothing ran


def _served_cases():
    """(query, key, value, kwargs, served): CUDA calls flashtune serves (True) and ones
    ``_served`` leaves to the checks one by one (False)."""
    mk = lambda *s, dt=torch.bfloat16: torch.randn(*s, device="cuda").to(dt)  # noqa: E731
    q, k = mk(2, 8, 5, 64), mk(2, 2, 9, 64)
    kt = mk(2, 9, 2, 64).transpose(1, 2)
    return [
        (q, k, k, dict(enable_gqa=True), True),
        (q, k, k, dict(enable_gqa=True, is_causal=True), True),
        (q, kt, kt, dict(enable_gqa=True, scale=0.3), True),
        (mk(2, 8, 5, 24), mk(2, 2, 9, 24), mk(2, 2, 9, 24), dict(enable_gqa=True), True),
        (q, k, k, {}, False),  # GQA without the flag
        (q, k, k, dict(enable_gqa=True, scale=float("nan")), False),
        (q, k, k, dict(enable_gqa=True, scale=2), False),  # an int: the slow path decides
        (mk(2, 8, 12, 64), k, k, dict(enable_gqa=True, is_causal=True), False),  # Lq > Lk
        (q.float(), k.float(), k.float(), dict(enable_gqa=True), False),
        (q, k, k.half(), dict(enable_gqa=True), False),
        (q, k, mk(2, 2, 9, 32), dict(enable_gqa=True), False),
        (q, k, k, dict(enable_gqa=True, dropout_p=0.1), False),
        (q, k, k, dict(enable_gqa=True, attn_mask=torch.ones(5, 9, dtype=torch.bool,
                                                              device="cuda")), False),
        (q.transpose(2, 3).contiguous().transpose(2, 3), k, k, dict(enable_gqa=True), False),
        (mk(2, 8, 0, 64), k, k, dict(enable_gqa=True), False),
        (q.cpu(), k.cpu(), k.cpu(), dict(enable_gqa=True), False),
    ]


@pytest.mark.gpu
def test_the_fast_acceptance_never_serves_what_fallback_reason_refuses():
    """``_served`` (every model call's check, ahead of the others in fallback_reason)
    agrees with the checks one by one (``_reason``) where it says yes, and says yes to the
    calls a model makes."""
    for q, k, v, kw, served in _served_cases():
        args = dict(attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                    enable_gqa=False) | kw
        fast = sdpa_mod._served(q, k, v, **args)
        reason = sdpa_mod._reason(q, k, v, **args)
        assert sdpa_mod.fallback_reason(q, k, v, **args) == (None if fast else reason)
        assert not (fast and reason is not None), (reason, kw, q.shape, k.shape)
        assert fast == served, (kw, q.shape, k.shape, v.shape)


def test_the_fast_acceptance_leaves_cpu_calls_to_fallback_reason():
    q, k = _t(1, 2, 9, 32).cpu(), _t(1, 2, 9, 32).cpu()
    assert not sdpa_mod._served(q, k, k, None, 0.0, False, None, False)


def test_float32_inputs_under_autocast_run_on_flashtune_in_its_dtype(monkeypatch):
    """torch's SDPA is an autocast op of lower precision: under autocast float32 inputs (a
    rotary embedding in float32 makes them) run in autocast's dtype. The drop-in does the
    same on flashtune's kernels, output dtype and values as torch's; outside autocast
    float32 still goes to torch."""
    calls = []
    real = sdpa_mod.attention
    monkeypatch.setattr(sdpa_mod, "attention",
                        lambda *a, **kw: calls.append(a[0].dtype) or real(*a, **kw))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 9, 16, generator=g) for _ in range(3))
    half = torch.float16 if DEVICE == "cpu" else torch.bfloat16
    q, k, v = (t.to(DEVICE) for t in (q, k, v))
    with torch.autocast(DEVICE, dtype=half):
        got = flashtune.scaled_dot_product_attention(q, k, v, is_causal=True)
        want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        assert "torch SDPA" not in sdpa_mod.describe_route(q, k, v, is_causal=True)
    assert got.dtype == want.dtype == half and calls == [half]
    tol = 2e-3 if half == torch.float16 else 1.6e-2  # bfloat16: 8 bits of mantissa
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    flashtune.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert calls == [half]  # float32 outside autocast: torch's
