"""The custom ops ``torch.compile`` traces hand back what their fake implementations declare.

Inductor lays out what follows a custom op by its fake's strides and asserts them on the real
outputs. The fakes declare ``out`` and the gradients in the inputs' layout
(``torch.empty_like``), which is what flashtune's kernels write: with ``(B, N, H, D)`` storage
viewed as ``(B, H, N, D)`` (what transformers hands an attention function) the model's
transpose back is then a view, not a copy. An implementation that writes another layout
(contiguous, as the launchers did before, or an SDPA backend's) is copied into the declared
one. Here, on CPU, implementations writing either layout stand in behind the ops' routes.
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


def _contiguous(ref: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return t.contiguous()


@pytest.fixture(params=[_in_layout_of, _contiguous], ids=["inputs_layout", "contiguous"])
def gluon_like(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> list[str]:
    """The ops' paired route with its launchers writing the inputs' layout, or contiguous
    tensors; the list records which ran."""
    real = autograd._paired
    ran: list[str] = []
    write = request.param

    def paired(q: Any, k: Any, causal: bool, config_str: Any, impl: Any) -> Any:
        route = real(q, k, causal, config_str, impl)

        def fwd(q: Any, k: Any, v: Any, config: Any, **kw: Any) -> Any:
            out, lse = route.fwd.launcher(q, k, v, config, **kw)
            ran.append("fwd")
            return write(q, out), lse

        def bwd(q: Any, k: Any, v: Any, *args: Any, **kw: Any) -> Any:
            grads = route.bwd.launcher(q, k, v, *args, **kw)
            ran.append("bwd")
            return tuple(write(t, g) for t, g in zip((q, k, v), grads))

        return SimpleNamespace(fwd=SimpleNamespace(launcher=fwd), fwd_config=route.fwd_config,
                               bwd=SimpleNamespace(launcher=bwd), bwd_config=route.bwd_config)

    monkeypatch.setattr(autograd, "_paired", paired)
    return ran


def test_the_forward_and_backward_ops_return_the_inputs_layout_as_declared(gluon_like):
    q, k, v = (_bshd(1, 2, 24, 16, s) for s in range(3))
    assert not q.is_contiguous()
    out, lse = torch.ops.flashtune.attention_fwd_v2(q, k, v, True, None, False, None)
    assert gluon_like == ["fwd"]
    assert out.stride() == q.stride() and lse.is_contiguous()
    assert out.transpose(1, 2).is_contiguous()  # a model's transpose back: a view
    ref = flashtune.attention(q, k, v, causal=True)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    dout = torch.randn_like(out)
    grads = torch.ops.flashtune.attention_bwd_v2(q, k, v, out, lse, dout, None, True, None)
    assert gluon_like == ["fwd", "bwd"]
    assert [g.stride() for g in grads] == [t.stride() for t in (q, k, v)]
    # the eager training route's gradients (on a GPU it may run another pair: fp16 rounding)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    eager = torch.autograd.grad(flashtune.attention(*leaves, causal=True), leaves, dout)
    for got, want in zip(grads, eager):
        torch.testing.assert_close(got, want, rtol=0, atol=2e-3)


def test_opcheck_finds_the_real_outputs_as_the_fake_declares(gluon_like):
    """torch.library.opcheck's fake-tensor test compares the fake's strides with the real
    outputs' (it failed for the forward when the fake declared a contiguous output and the
    Gluon forward wrote q's layout)."""
    q, k, v = (_bshd(1, 2, 24, 16, s) for s in range(3))
    torch.library.opcheck(torch.ops.flashtune.attention_fwd_v2.default,
                          (q, k, v, True, None, False, None), test_utils="test_faketensor")
    out, lse = torch.ops.flashtune.attention_fwd_v2(q, k, v, True, None, False, None)
    torch.library.opcheck(torch.ops.flashtune.attention_bwd_v2.default,
                          (q, k, v, out, lse, torch.randn_like(out), None, True, None),
                          test_utils="test_faketensor")
    assert "fwd" in gluon_like and "bwd" in gluon_like


def test_a_slice_of_a_packed_qkv_gets_dense_outputs_in_its_order(gluon_like):
    """q, k, v sliced out of one packed ``(B, N, 3, H, D)`` tensor are not dense: the ops
    declare (and hand back) what ``torch.empty_like`` gives them, dense in their order."""
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(1, 24, 3, 2, 16, generator=g).to(torch.float16).to(DEVICE)
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    out, lse = torch.ops.flashtune.attention_fwd_v2(q, k, v, True, None, False, None)
    assert out.stride() == torch.empty_like(q).stride() == (768, 16, 32, 1)
    grads = torch.ops.flashtune.attention_bwd_v2(q, k, v, out, lse, torch.randn_like(out), None,
                                              True, None)
    assert [g.stride() for g in grads] == [torch.empty_like(t).stride() for t in (q, k, v)]
    torch.library.opcheck(torch.ops.flashtune.attention_fwd_v2.default,
                          (q, k, v, True, None, False, None), test_utils="test_faketensor")


@pytest.mark.parametrize("write", [_in_layout_of, _contiguous], ids=["inputs_layout", "contiguous"])
def test_the_windowed_forward_op_returns_the_inputs_layout_too(monkeypatch, write):
    """The op a compiled call with a window goes through (the Gluon forward serves a causal
    sliding window, in q's layout; attn_fwd too), whichever layout its kernel wrote."""
    from flashtune.runtime import scored

    real = scored._pair_route
    ran: list[str] = []

    def pair_route(*args: Any) -> Any:
        spec, fcfg, bwd, bcfg = real(*args)

        def fwd(q: Any, k: Any, v: Any, config: Any, **kw: Any) -> Any:
            out, lse = spec.launcher(q, k, v, config, **kw)
            ran.append("fwd")
            return write(q, out), lse

        return SimpleNamespace(launcher=fwd), fcfg, bwd, bcfg

    monkeypatch.setattr(scored, "_pair_route", pair_route)
    q, k, v = (_bshd(1, 2, 24, 16, s) for s in range(3))
    args = (q, k, v, True, None, 7, 0, 0.0, None, None, None)
    out, lse = torch.ops.flashtune.attention_scored_fwd_v2(*args)
    assert ran == ["fwd"] and out.stride() == q.stride() and lse.is_contiguous()
    torch.testing.assert_close(out, flashtune.attention(q, k, v, causal=True, window=(7, 0)),
                               rtol=0, atol=0)
    torch.library.opcheck(torch.ops.flashtune.attention_scored_fwd_v2.default, args,
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
