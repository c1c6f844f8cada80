"""The custom ops ``torch.compile`` traces hand back what their fake implementations declare.

Inductor lays out what follows a custom op by its fake's strides and asserts them on the real
outputs. The fakes declare contiguous tensors; the Gluon kernels write ``out`` and the
gradients in the inputs' layout, so with ``(B, N, H, D)`` storage viewed as ``(B, H, N, D)``
(what transformers hands an attention function) a compiled step met an AssertionError
("expected size ..., stride ...") on the Gluon routes. Here, on CPU, an implementation that
writes the inputs' layout as the Gluon kernels do stands in behind the ops' routes.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

import flashtune
from flashtune.runtime import autograd
from tests.conftest import DEVICE


def _bshd(b: int, h: int, n: int, d: int, seed: int) -> torch.Tensor:
    """``(B, H, N, D)`` over ``(B, N, H, D)`` storage, as transformers' projections give."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, n, h, d, generator=g).to(torch.float16).to(DEVICE).transpose(1, 2)


def _in_layout_of(ref: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``t`` copied into ``torch.empty_like(ref)``: ``ref``'s strides, as the Gluon
    kernels allocate their outputs."""
    return torch.empty_like(ref).copy_(t)


@pytest.fixture
def gluon_like(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The ops' paired route with its launchers writing the inputs' layout; the list
    records which ran."""
    real = autograd._paired
    ran: list[str] = []

    def paired(q: Any, k: Any, causal: bool, config_str: Any, impl: Any) -> Any:
        route = real(q, k, causal, config_str, impl)

        def fwd(q: Any, k: Any, v: Any, config: Any, **kw: Any) -> Any:
            out, lse = route.fwd.launcher(q, k, v, config, **kw)
            ran.append("fwd")
            return _in_layout_of(q, out), lse

        def bwd(q: Any, k: Any, v: Any, *args: Any, **kw: Any) -> Any:
            grads = route.bwd.launcher(q, k, v, *args, **kw)
            ran.append("bwd")
            return tuple(_in_layout_of(t, g) for t, g in zip((q, k, v), grads))

        return SimpleNamespace(fwd=SimpleNamespace(launcher=fwd), fwd_config=route.fwd_config,
                               bwd=SimpleNamespace(launcher=bwd), bwd_config=route.bwd_config)

    monkeypatch.setattr(autograd, "_paired", paired)
    return ran


def test_the_forward_and_backward_ops_return_contiguous_tensors_as_declared(gluon_like):
    q, k, v = (_bshd(1, 2, 24, 16, s) for s in range(3))
    assert not q.is_contiguous()
    out, lse = torch.ops.flashtune.attention_fwd(q, k, v, True, None, False, None)
    assert gluon_like == ["fwd"]
    assert out.is_contiguous() and lse.is_contiguous()
    ref = flashtune.attention(q, k, v, causal=True)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    dout = torch.randn_like(out)
    grads = torch.ops.flashtune.attention_bwd(q, k, v, out, lse, dout, None, True, None)
    assert gluon_like == ["fwd", "bwd"]
    assert all(g.is_contiguous() for g in grads)


def test_opcheck_finds_the_real_outputs_as_the_fake_declares(gluon_like):
    """torch.library.opcheck's fake-tensor test compares the fake's strides with the real
    outputs': it failed for the forward before the outputs were made contiguous."""
    q, k, v = (_bshd(1, 2, 24, 16, s) for s in range(3))
    torch.library.opcheck(torch.ops.flashtune.attention_fwd.default,
                          (q, k, v, True, None, False, None), test_utils="test_faketensor")
    out, lse = torch.ops.flashtune.attention_fwd(q, k, v, True, None, False, None)
    torch.library.opcheck(torch.ops.flashtune.attention_bwd.default,
                          (q, k, v, out, lse, torch.randn_like(out), None, True, None),
                          test_utils="test_faketensor")
    assert "fwd" in gluon_like and "bwd" in gluon_like


def test_the_windowed_forward_op_returns_contiguous_tensors_too(monkeypatch):
    """The op a compiled call with a window goes through: the Gluon forward serves a causal
    sliding window, in q's layout."""
    from flashtune.runtime import scored

    real = scored._pair_route
    ran: list[str] = []

    def pair_route(*args: Any) -> Any:
        spec, fcfg, bwd, bcfg = real(*args)

        def fwd(q: Any, k: Any, v: Any, config: Any, **kw: Any) -> Any:
            out, lse = spec.launcher(q, k, v, config, **kw)
            ran.append("fwd")
            return _in_layout_of(q, out), lse

        return SimpleNamespace(launcher=fwd), fcfg, bwd, bcfg

    monkeypatch.setattr(scored, "_pair_route", pair_route)
    q, k, v = (_bshd(1, 2, 24, 16, s) for s in range(3))
    args = (q, k, v, True, None, 7, 0, 0.0, None, None, None)
    out, lse = torch.ops.flashtune.attention_scored_fwd(*args)
    assert ran == ["fwd"] and out.is_contiguous() and lse.is_contiguous()
    torch.testing.assert_close(out, flashtune.attention(q, k, v, causal=True, window=(7, 0)),
                               rtol=0, atol=0)
    torch.library.opcheck(torch.ops.flashtune.attention_scored_fwd.default, args,
                          test_utils="test_faketensor")


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["attn_fwd_gluon_bwd_gluon", None])
def test_a_compiled_step_on_bshd_storage_runs_the_gluon_kernels(impl):
    """On the GPU, with the real Gluon kernels: a training step through
    ``torch.compile(fullgraph=True)`` on ``(B, N, H, D)`` storage gives eager's gradients
    (Inductor's stride asserts held), for the Gluon pair and for the router's own pair."""
    from tests.helpers import assert_compiles_and_captures

    torch.manual_seed(5)
    q, k, v = (torch.randn(2, 333, h, 128, device="cuda", dtype=torch.bfloat16)
               .transpose(1, 2) for h in (8, 2, 2))

    def loss_fn(q, k, v):
        out = flashtune.attention(q, k, v, causal=True, impl=impl)
        return (out.float() ** 2).mean()

    assert_compiles_and_captures(loss_fn, (q, k, v))
