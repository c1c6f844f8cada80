"""flashtune.attention(dropout_p=) and flashtune.attention_varlen(dropout_p=) end to end under
the interpreter: the scored route serves them (attn_fwd, attn_bwd), numerics and gradients
against the float64 reference given the mask the call drew, the seed from torch's generator
(torch.manual_seed reproduces a call, the next call draws another mask), FlashAttention-2's
convention (applied whenever dropout_p > 0; 0 is the plain path), bad values named,
torch.compile without a graph break."""

from __future__ import annotations

import pytest
import torch

import flashtune
from flashtune.core.errors import InputError
from flashtune.core.problem import AttentionProblem
from flashtune.kernel_templates.attn_fwd.reference import attn_fwd_reference
from flashtune.kernel_templates.dropout import draw_seed, dropout_mask
from flashtune.runtime import scored
from tests.conftest import DEVICE
from tests.runtime_tests.test_scored import packed, qkv

P = 0.25


def call_mask(torch_seed, b, hq, nq, nk, p=P):
    """The mask a call made right after ``torch.manual_seed(torch_seed)`` drew."""
    torch.manual_seed(torch_seed)
    return dropout_mask(draw_seed(DEVICE), b, hq, nq, nk, p)


@pytest.mark.parametrize("causal", [False, True])
def test_forward_is_the_reference_with_the_calls_mask(causal):
    q, k, v = qkv(b=2, nq=23, nk=40)
    torch.manual_seed(3)
    out, lse = flashtune.attention(q, k, v, causal=causal, return_lse=True, dropout_p=P)
    mask = call_mask(3, 2, 4, 23, 40)
    ref, ref_lse = attn_fwd_reference(q, k, v, causal=causal, dropout_mask=mask, dropout_p=P)
    torch.testing.assert_close(out.double(), ref, atol=4e-3, rtol=4e-3)
    _, plain_lse = flashtune.attention(q, k, v, causal=causal, return_lse=True)
    # the LSE is of every score, kept or dropped (one of the kept ones would differ by
    # ~log(1 - p)); on a GPU the plain call may run another config (a tuned table's), whose
    # key order rounds the fp32 sum differently
    torch.testing.assert_close(lse, plain_lse, atol=1e-5, rtol=1e-5)


def test_manual_seed_reproduces_a_call_and_the_next_call_draws_another_mask():
    q, k, v = qkv(nq=16, nk=16, d=16)
    torch.manual_seed(7)
    a = flashtune.attention(q, k, v, dropout_p=P)
    b = flashtune.attention(q, k, v, dropout_p=P)
    torch.manual_seed(7)
    assert torch.equal(flashtune.attention(q, k, v, dropout_p=P), a)
    assert not torch.equal(a, b)


def test_gradients_match_autograd_through_the_masked_reference():
    q, k, v = qkv(b=2, nq=33, nk=40, grad=True)
    torch.manual_seed(4)
    out = flashtune.attention(q, k, v, causal=True, window=(12, -1), dropout_p=P)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    mask = call_mask(4, 2, 4, 33, 40)
    leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    ref, _ = attn_fwd_reference(*leaves, causal=True, window=(12, -1), dropout_mask=mask,
                                dropout_p=P)
    refs = torch.autograd.grad(ref, leaves, dout.double())
    torch.testing.assert_close(out.double(), ref.detach(), atol=4e-3, rtol=4e-3)
    for name, got, want in zip("qkv", grads, refs):
        torch.testing.assert_close(got.double(), want, atol=2e-2, rtol=2e-2, msg=name)


def test_varlen_forward_and_gradients():
    lens = [21, 30]
    q, k, v, cq, ck = packed(lens, lens, grad=True)
    torch.manual_seed(9)
    out = flashtune.attention_varlen(q, k, v, cq, ck, 30, 30, causal=True, dropout_p=P)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    mask = call_mask(9, 2, 4, 30, 30)
    leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    outs = []
    for b, n in enumerate(lens):
        s = slice(int(cq[b]), int(cq[b + 1]))
        o, _ = attn_fwd_reference(*(x[s].transpose(0, 1)[None] for x in leaves), causal=True,
                                  dropout_mask=mask[b:b + 1, :, :n, :n], dropout_p=P)
        outs.append(o[0].transpose(0, 1))
    ref = torch.cat(outs)
    refs = torch.autograd.grad(ref, leaves, dout.double())
    torch.testing.assert_close(out.double(), ref.detach(), atol=4e-3, rtol=4e-3)
    for name, got, want in zip("qkv", grads, refs):
        torch.testing.assert_close(got.double(), want, atol=2e-2, rtol=2e-2, msg=name)


@pytest.mark.parametrize("bad", [1.0, 1.5, -0.1, float("nan"), True, "0.1"])
def test_bad_dropout_p_is_an_error_naming_it(bad):
    q, k, v = qkv(nq=16, nk=16, d=16)
    with pytest.raises(InputError, match="dropout_p"):
        flashtune.attention(q, k, v, dropout_p=bad)
    q, k, v, cq, ck = packed([16], [16])
    with pytest.raises(InputError, match="dropout_p"):
        flashtune.attention_varlen(q, k, v, cq, ck, 16, 16, dropout_p=bad)


def test_zero_takes_the_plain_path(monkeypatch):
    q, k, v = qkv(nq=16, nk=16, d=16)
    plain = flashtune.attention(q, k, v, causal=True)
    called = []
    monkeypatch.setattr(scored, "_run", lambda *a, **kw: called.append(1))
    for p in (0.0, 0, None):
        assert torch.equal(flashtune.attention(q, k, v, causal=True, dropout_p=p), plain)
    assert not called


def test_route_keys_dropout_and_refuses_what_cannot_drop():
    """The problem keys the rate; attn_fwd and attn_bwd serve it, the Gluon forward,
    attn_decode and the SDPA backends refuse it; a short query with dropout runs attn_fwd
    (not the decode route); lookup_config names the choice."""
    from flashtune.kernel_templates import get_template
    from flashtune.runtime.routing import _device_of

    q, k, v = qkv(nq=1, nk=40)
    problem = AttentionProblem.from_tensors(q, k, causal=False, dropout=0.1)
    assert problem.key()["dropout"] == 0.1 and "dropout" not in \
        AttentionProblem.from_tensors(q, k, causal=False).key()
    dev = _device_of(q)
    for name in ("attn_fwd", "attn_bwd"):
        assert get_template(name).refuse(problem, dev) is None
    for name in ("attn_decode", "sdpa_math"):
        assert "dropout" in get_template(name).refuse(problem, dev), name
    for name in ("attn_fwd_gluon", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient"):
        assert not get_template(name).limits.dropout, name
    choice = flashtune.lookup_config(q, k, v, dropout_p=0.1)
    assert choice.template == "attn_fwd"
    with pytest.raises(InputError, match="cannot serve"):
        flashtune.attention(q, k, v, dropout_p=0.1, impl="sdpa_math")
    out = flashtune.attention(q, k, v, dropout_p=0.1)  # one query: attn_fwd, not decode
    assert out.shape == q.shape and torch.isfinite(out).all()


def test_torch_compile_traces_dropout_calls_without_graph_breaks():
    """The seed is a random op of the traced graph: with the same torch seed the compiled
    call drops what the eager one drops (forward and gradients), and no graph break."""
    q, k, v = qkv(b=2, nq=23, nk=40, grad=True)

    def block(q, k, v):
        out = flashtune.attention(q * 1.0, k, v, causal=True, dropout_p=P)
        return out.float().sum(-1)

    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    torch.manual_seed(1)
    got = compiled(q, k, v)
    torch.manual_seed(1)
    want = block(q, k, v)
    torch.testing.assert_close(got, want)
    g_got = torch.autograd.grad(got.sum(), (q, k, v))
    g_want = torch.autograd.grad(want.sum(), (q, k, v))
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b, atol=2e-3, rtol=2e-3)
    explained = torch._dynamo.explain(block)(q, k, v)
    assert explained.graph_break_count == 0


def test_torch_compile_varlen_with_dropout():
    q, k, v, cq, ck = packed([21, 9], [21, 30], grad=True)

    def block(q, k, v):
        return flashtune.attention_varlen(q * 1.0, k, v, cq, ck, 21, 30, dropout_p=P).float()

    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    torch.manual_seed(2)
    got = compiled(q, k, v)
    torch.manual_seed(2)
    want = block(q, k, v)
    torch.testing.assert_close(got, want)
    g_got = torch.autograd.grad(got.sum(), (q, k, v))
    g_want = torch.autograd.grad(want.sum(), (q, k, v))
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b, atol=2e-3, rtol=2e-3)
