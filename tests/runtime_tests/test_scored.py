"""flashtune.attention with window / softcap / ALiBi, and flashtune.attention_varlen: the
public API end to end (routing, numerics, gradients, bad input), under the interpreter."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import flashtune
from flashtune.core.errors import InputError, InputTypeError
from flashtune.core.problem import AttentionProblem
from flashtune.kernel_templates.attn_fwd.reference import attn_fwd_reference
from flashtune.runtime import scored
from tests.conftest import DEVICE

CFG = {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1}


def qkv(b=1, hq=4, hkv=2, nq=37, nk=45, d=32, dtype=torch.float16, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    mk = lambda h, n: torch.randn(b, h, n, d, generator=g).to(dtype).to(DEVICE)  # noqa: E731
    q, k, v = mk(hq, nq), mk(hkv, nk), mk(hkv, nk)
    if grad:
        for t in (q, k, v):
            t.requires_grad_(True)
    return q, k, v


def slopes(*shape):
    return (torch.rand(*shape, generator=torch.Generator().manual_seed(3)) * 0.5).to(DEVICE)


def check(out, ref, dtype, lse=None, ref_lse=None):
    tol = 2e-2 if dtype == torch.bfloat16 else 4e-3
    assert out.dtype == dtype and torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
    if lse is not None:
        inf = torch.isinf(ref_lse)
        assert torch.equal(torch.isinf(lse), inf)
        torch.testing.assert_close(lse.double()[~inf], ref_lse[~inf], atol=2e-3, rtol=2e-3)


MODS = [
    ("window", dict(window=(7, 3)), False),
    ("window causal", dict(window=(9, 5)), True),
    ("softcap", dict(softcap=2.0), False),
    ("alibi causal", dict(alibi_slopes=("h",)), True),
    ("all", dict(window=(12, 4), softcap=3.0, alibi_slopes=("bh",)), True),
]


def _kwargs(mods, b, hq):
    out = dict(mods)
    if "alibi_slopes" in out:
        out["alibi_slopes"] = slopes(hq) if out["alibi_slopes"] == ("h",) else slopes(b, hq)
    return out


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name,mods,causal", MODS, ids=[m[0] for m in MODS])
def test_forward_matches_reference(name, mods, causal, dtype):
    q, k, v = qkv(b=2, dtype=dtype)
    kw = _kwargs(mods, 2, 4)
    out, lse = flashtune.attention(q, k, v, causal=causal, return_lse=True, **kw)
    ref, ref_lse = attn_fwd_reference(q, k, v, causal=causal, **kw)
    check(out, ref, dtype, lse, ref_lse)
    # the same call again takes the memoised route: the same bits
    assert torch.equal(flashtune.attention(q, k, v, causal=causal, **kw), out)


def test_off_values_take_the_plain_path(monkeypatch):
    q, k, v = qkv()
    called = []
    monkeypatch.setattr(scored, "_run", lambda *a, **k: called.append(1))
    plain = flashtune.attention(q, k, v, causal=True)
    for kw in (dict(window=(-1, -1)), dict(window=(-1, 5)), dict(softcap=0.0),
               dict(softcap=None, window=None, alibi_slopes=None)):
        assert torch.equal(flashtune.attention(q, k, v, causal=True, **kw), plain), kw
    assert not called


@pytest.mark.parametrize("causal", [False, True])
def test_gradients_match_float64(causal):
    q, k, v = qkv(b=2, grad=True)
    kw = dict(window=(10, 6), softcap=4.0, alibi_slopes=slopes(4))
    out = flashtune.attention(q, k, v, causal=causal, **kw)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    ref, _ = attn_fwd_reference(q64, k64, v64, causal=causal, **kw)
    refs = torch.autograd.grad(ref, (q64, k64, v64), dout.double())
    check(out, ref.detach(), q.dtype)
    for name, got, want in zip("qkv", grads, refs):
        assert got.shape == want.shape, name
        torch.testing.assert_close(got.double(), want, atol=2e-2, rtol=2e-2, msg=name)


def test_routes_to_attn_fwd_and_keys_the_mods():
    q, k, v = qkv()
    problem = AttentionProblem.from_tensors(q, k, causal=True, window=(8, 3), softcap=2.0,
                                            alibi=True)
    assert problem.mods() == ("window", "softcap", "alibi")
    assert problem.window_right == -1  # causal is the right bound
    key = problem.key()
    assert key["window_left"] == 8 and key["softcap"] == 2.0 and key["alibi"] is True
    assert AttentionProblem.from_key(key) == problem
    plain = AttentionProblem.from_tensors(q, k, causal=True)
    assert "window_left" not in plain.key() and plain.bucket() != problem.bucket()
    assert plain.distance(problem) > plain.distance(
        AttentionProblem.from_tensors(q, k, causal=True))
    # no SDPA backend serves a modified score: they refuse, attn_fwd serves
    from flashtune.kernel_templates import get_template
    from flashtune.runtime.routing import _device_of
    dev = _device_of(q)
    assert "softcap" in get_template("sdpa_math").refuse(problem, dev)
    assert get_template("attn_fwd").refuse(problem, dev) is None
    with pytest.raises(InputError, match="sdpa_math.*cannot serve"):
        flashtune.attention(q, k, v, causal=True, softcap=2.0, impl="sdpa_math")


def test_window_flops_count_visible_pairs():
    p = AttentionProblem(1, 1, 1, 8, 8, 16, False, "fp16", 2, 0)
    pairs = int(((torch.arange(8)[:, None] - torch.arange(8)[None, :]).clamp(min=-1) <= 2)
                .logical_and(torch.arange(8)[:, None] >= torch.arange(8)[None, :]).sum())
    assert p.flops() == 4.0 * 16 * pairs


BAD = [
    (dict(window=(3,)), InputTypeError, "window must be a pair"),
    (dict(window=(-2, 3)), InputError, "window \\(-2, 3\\).*>= 0, or -1"),
    (dict(window=(1.5, 3)), InputTypeError, "window must be a pair of ints"),
    (dict(softcap=-1.0), InputError, "softcap must be a positive"),
    (dict(softcap=float("inf")), InputError, "softcap must be"),
    (dict(alibi_slopes=[0.1, 0.2]), InputTypeError, "alibi_slopes must be a torch.Tensor"),
    (dict(alibi_slopes=torch.ones(4, dtype=torch.float16)), InputTypeError,
     "alibi_slopes must be float32"),
    (dict(alibi_slopes=torch.ones(3)), InputError, "alibi_slopes must have shape \\(4,\\)"),
]


@pytest.mark.parametrize("kwargs,exc,msg", BAD, ids=[b[2][:24] for b in BAD])
def test_bad_mods_are_clear_errors(kwargs, exc, msg):
    q, k, v = qkv()
    kwargs = {n: (t.to(DEVICE) if isinstance(t, torch.Tensor) else t) for n, t in kwargs.items()}
    with pytest.raises(exc, match=msg):
        flashtune.attention(q, k, v, **kwargs)


# -- varlen ------------------------------------------------------------------------------


def packed(lens_q, lens_k, hq=4, hkv=2, d=32, dtype=torch.float16, grad=False):
    g = torch.Generator().manual_seed(1)
    tq, tk = sum(lens_q), sum(lens_k)
    q = torch.randn(tq, hq, d, generator=g).to(dtype).to(DEVICE)
    kv = torch.randn(tk, 2, hkv, d, generator=g).to(dtype).to(DEVICE)
    k, v = kv[:, 0], kv[:, 1]  # strided slices of one packed tensor
    if grad:
        q.requires_grad_(True)
        k = k.detach().requires_grad_(True)
        v = v.detach().requires_grad_(True)
    cu = lambda lens: torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()],  # noqa: E731
                                   dtype=torch.int32, device=DEVICE)
    return q, k, v, cu(lens_q), cu(lens_k)


def per_sequence(q, k, v, cq, ck, **kw):
    outs, lses = [], []
    for b in range(cq.numel() - 1):
        sq = slice(int(cq[b]), int(cq[b + 1]))
        sk = slice(int(ck[b]), int(ck[b + 1]))
        extra = dict(kw)
        if extra.get("alibi_slopes") is not None and extra["alibi_slopes"].dim() == 2:
            extra["alibi_slopes"] = extra["alibi_slopes"][b]
        o, lse = attn_fwd_reference(q[sq].transpose(0, 1)[None], k[sk].transpose(0, 1)[None],
                                    v[sk].transpose(0, 1)[None], **extra)
        outs.append(o[0].transpose(0, 1))
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, dim=1)


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_matches_each_sequence(causal):
    lens_q, lens_k = [19, 1, 33], [19, 7, 40]
    q, k, v, cq, ck = packed(lens_q, lens_k)
    kw = dict(window=(9, 4), softcap=3.0) if causal else {}
    out, lse = flashtune.attention_varlen(q, k, v, cq, ck, 33, 40, causal=causal,
                                          return_lse=True, **kw)
    assert out.shape == q.shape and lse.shape == (4, q.shape[0])
    ref, ref_lse = per_sequence(q, k, v, cq, ck, causal=causal, **kw)
    check(out, ref, q.dtype, lse, ref_lse)


def test_varlen_gradients():
    q, k, v, cq, ck = packed([21, 30], [21, 30], grad=True)
    out = flashtune.attention_varlen(q, k, v, cq, ck, 30, 30, causal=True)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    ref, _ = per_sequence(q64, k64, v64, cq, ck, causal=True)
    refs = torch.autograd.grad(ref, (q64, k64, v64), dout.double())
    for name, got, want in zip("qkv", grads, refs):
        torch.testing.assert_close(got.double(), want, atol=2e-2, rtol=2e-2, msg=name)


def _cu(*values):
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


VARLEN_BAD = [
    (lambda q, k, v, cq, ck: (q[None], k, v, cq, ck, 33, 40), InputError, "q must have 3"),
    (lambda q, k, v, cq, ck: (q, k, v, cq.long(), ck, 33, 40), InputTypeError,
     "cu_seqlens_q must be int32"),
    (lambda q, k, v, cq, ck: (q, k, v, _cu(0, 20, 19, 53), ck, 33, 40), InputError,
     "cu_seqlens_q must not decrease.*\\[2\\] = 19"),
    (lambda q, k, v, cq, ck: (q, k, v, _cu(1, 20, 21, 53), ck, 33, 40), InputError,
     "cu_seqlens_q\\[0\\] must be 0"),
    (lambda q, k, v, cq, ck: (q, k, v, cq, _cu(0, 19, 26, 60), 33, 40), InputError,
     "cu_seqlens_k\\[-1\\] = 60 must equal the number of tokens, 66"),
    (lambda q, k, v, cq, ck: (q, k, v, cq, _cu(0, 19, 66), 33, 40), InputError,
     "cu_seqlens_k has 3 entries and cu_seqlens_q 4"),
    (lambda q, k, v, cq, ck: (q, k, v, cq, ck, 20, 40), InputError,
     "max_seqlen_q = 20, but a sequence has 33"),
    (lambda q, k, v, cq, ck: (q, k, v, cq, ck, 0, 40), InputError, "max_seqlen_q must be"),
]


@pytest.mark.parametrize("mutate,exc,msg", VARLEN_BAD, ids=[b[2][:28] for b in VARLEN_BAD])
def test_varlen_bad_input(mutate, exc, msg):
    args = mutate(*packed([19, 1, 33], [19, 7, 40]))
    with pytest.raises(exc, match=msg):
        flashtune.attention_varlen(*args)


def test_varlen_refuses_other_implementations():
    q, k, v, cq, ck = packed([5, 9], [5, 9])
    with pytest.raises(InputError, match="sdpa_math.*cannot serve"):
        flashtune.attention_varlen(q, k, v, cq, ck, 9, 9, impl="sdpa_math")


def test_explicit_config_with_mods():
    q, k, v = qkv()
    out = flashtune.attention(q, k, v, window=(6, 6), config=CFG)
    ref, _ = attn_fwd_reference(q, k, v, window=(6, 6))
    check(out, ref, q.dtype)


def test_lookup_config_names_what_a_scored_call_runs():
    q, k, v = qkv()
    choice = flashtune.lookup_config(q, k, v, causal=True, window=(8, 0), softcap=3.0)
    assert choice.template == "attn_fwd" and {"BLOCK_M", "BLOCK_N"} <= set(choice.config)
    q2, k2, v2 = qkv(grad=True)
    pair = flashtune.lookup_config(q2, k2, v2, causal=True, window=(8, 0))
    assert pair.template == "attn_fwd" and any(n.startswith("bwd.") for n in pair.config)
    with pytest.raises(InputError, match="window"):
        flashtune.lookup_config(q, k, v, window=(-3, 0))


def test_torch_compile_traces_scored_calls_without_graph_breaks():
    q, k, v = qkv(b=2, grad=True)
    slopes_ = slopes(4)

    def block(q, k, v):
        out, lse = flashtune.attention(q * 1.0, k, v, causal=True, window=(9, 0),
                                       softcap=3.0, alibi_slopes=slopes_, return_lse=True)
        return out.float().sum(-1) + lse

    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    got, want = compiled(q, k, v), block(q, k, v)
    torch.testing.assert_close(got, want)
    g_got = torch.autograd.grad(got.sum(), (q, k, v))
    g_want = torch.autograd.grad(want.sum(), (q, k, v))
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b, atol=2e-3, rtol=2e-3)
    explained = torch._dynamo.explain(block)(q, k, v)
    assert explained.graph_break_count == 0


@pytest.mark.parametrize("mods", [{}, {"window": (9, 0)}])
def test_torch_compile_traces_calls_with_an_explicit_config(mods):
    """config= under torch.compile: the config travels to the custom op as text the
    compiler traces (it was json.dumps, a graph break), forward and backward; the output and
    gradients equal eager's with the same config."""
    from flashtune.kernel_templates.attn_fwd.space import DEFAULTS

    q, k, v = qkv(b=2, grad=True)
    config = {**DEFAULTS, "BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1}

    def block(q, k, v):
        return flashtune.attention(q * 1.0, k, v, causal=True, config=config, **mods)

    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    got, want = compiled(q, k, v), block(q, k, v)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    g_got = torch.autograd.grad(got.float().sum(), (q, k, v))
    g_want = torch.autograd.grad(want.float().sum(), (q, k, v))
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b, atol=2e-3, rtol=2e-3)


def test_torch_compile_traces_varlen_calls_without_graph_breaks():
    """attention_varlen under torch.compile: the custom ops (forward and backward), no graph
    break, the same output, LSE and gradients as eager."""
    q, k, v, cq, ck = packed([21, 5, 30], [21, 9, 30], grad=True)
    slopes_ = slopes(4)

    def block(q, k, v):
        out, lse = flashtune.attention_varlen(q * 1.0, k, v, cq, ck, 30, 30, causal=True,
                                              window=(7, 0), alibi_slopes=slopes_,
                                              return_lse=True)
        return out.float().sum(-1) + lse.t()

    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    got, want = compiled(q, k, v), block(q, k, v)
    torch.testing.assert_close(got, want)
    g_got = torch.autograd.grad(got.sum(), (q, k, v))
    g_want = torch.autograd.grad(want.sum(), (q, k, v))
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b, atol=2e-3, rtol=2e-3)
    explained = torch._dynamo.explain(block)(q, k, v)
    assert explained.graph_break_count == 0


@pytest.mark.parametrize("packed_batch", [False, True], ids=["scored", "varlen"])
@pytest.mark.parametrize("uses", ["out", "lse"])
def test_a_compiled_scored_step_hands_its_backward_only_the_gradients_the_loss_uses(
        monkeypatch, packed_batch, uses):
    """The score-modification and packed-batch custom ops, as ``flashtune::attention_fwd_v2``:
    an output the loss does not use reaches the backward as None, not zeros (eager's
    PairFn does the same), and the gradients equal eager's."""
    seen: list[torch.Tensor | None] = []
    launcher_of = scored._bwd_launcher

    def spy(bwd):
        launcher = launcher_of(bwd)

        def spied(*args, dlse=None, **kwargs):
            seen.append(dlse)
            return launcher(*args, dlse=dlse, **kwargs)

        return spied

    monkeypatch.setattr(scored, "_bwd_launcher", spy)
    if packed_batch:
        q, k, v, cq, ck = packed([21, 5, 30], [21, 9, 30])

        def call(q, k, v):
            out, lse = flashtune.attention_varlen(q, k, v, cq, ck, 30, 30, causal=True,
                                                  window=(7, 0), return_lse=True)
            return out, lse.t()
    else:
        q, k, v = qkv(b=2)

        def call(q, k, v):
            return flashtune.attention(q, k, v, causal=True, window=(9, 0), softcap=3.0,
                                       return_lse=True)

    def loss_fn(q, k, v):
        out, lse = call(q * 1.0, k, v)
        return (out.float() ** 2).sum() if uses == "out" else lse.sum()

    grads = []
    for fn in (loss_fn, torch.compile(loss_fn, backend="aot_eager", fullgraph=True)):
        leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
        fn(*leaves).backward()
        grads.append([t.grad for t in leaves])
    for eager, compiled in zip(*grads, strict=True):
        torch.testing.assert_close(compiled, eager, atol=2e-3, rtol=2e-3)
    assert seen[-1] is None if uses == "out" else seen[-1] is not None


def test_varlen_max_seqlen_too_short_for_the_tokens_is_caught_without_reading_lengths():
    q, k, v, cq, ck = packed([19, 1, 33], [19, 7, 40])
    with pytest.raises(InputError, match="max_seqlen_q = 10, but 53 tokens in 3 sequences"):
        scored.varlen(q, k, v, cq, ck, 10, 40, read_lengths=False)


def _packed_route(monkeypatch, device, *, window=(-1, -1), impl=None, dropout=0.0):
    """``scored._choose`` of a packed GQA batch with gradients, as ``device`` would route it
    (only the device is faked: nothing launches)."""
    monkeypatch.setattr(scored, "_device_of", lambda q: device)
    q = torch.empty(2, 8, 128, dtype=torch.bfloat16)
    problem = AttentionProblem(3, 8, 2, 700, 700, 128, True, "bf16", window_left=window[0],
                               tokens_q=1500, tokens_k=1500, dropout=dropout)
    spec, fcfg, bwd, bcfg = scored._choose(problem, q, True, False, True, None, impl)
    return spec.name, bwd.name, fcfg, bcfg


def test_a_packed_training_step_takes_the_gluon_backward_on_hopper(monkeypatch):
    """A packed batch's gradients on sm_90 run attn_fwd's varlen forward with the Gluon
    backward's varlen kernel (PACKED_TRAIN_DEFAULT), each kernel with its own config, a
    causal sliding window too (the Gluon backward's WINDOW); not where the Gluon backward
    cannot serve the call (another GPU, dropout, deterministic algorithms) or attn_fwd is
    forced: attn_fwd with attn_bwd there."""
    from flashtune.kernel_templates import get_template
    from flashtune.kernel_templates.sm90 import H100

    gluon_bwd = set(get_template("attn_bwd_gluon").space.params)
    tl_bwd = set(get_template("attn_bwd").space.params)
    flashtune.reload_configs()
    name, bwd, fcfg, bcfg = _packed_route(monkeypatch, H100)
    assert (name, bwd) == ("attn_fwd_bwd_gluon", "attn_bwd_gluon")
    assert set(fcfg) <= set(get_template("attn_fwd").space.params) and set(bcfg) <= gluon_bwd
    assert bcfg["LPT"] == 1  # its default (longest first), not a config lent by a dense shape
    flashtune.reload_configs()
    assert _packed_route(monkeypatch, H100, window=(255, -1))[:2] == ("attn_fwd_bwd_gluon",
                                                                     "attn_bwd_gluon")
    a100 = H100.__class__(**{**H100.__dict__, "name": "NVIDIA A100", "compute_capability": "8.0"})
    for route in (lambda: _packed_route(monkeypatch, a100),
                  lambda: _packed_route(monkeypatch, H100, dropout=0.1),
                  lambda: _packed_route(monkeypatch, H100, impl="attn_fwd")):
        flashtune.reload_configs()
        name, bwd, _, bcfg = route()
        assert (name, bwd) == ("attn_fwd", "attn_bwd") and set(bcfg) <= tl_bwd
    flashtune.reload_configs()
    torch.use_deterministic_algorithms(True)
    try:
        assert _packed_route(monkeypatch, H100)[:2] == ("attn_fwd", "attn_bwd")
    finally:
        torch.use_deterministic_algorithms(False)
    flashtune.reload_configs()


def test_lookup_names_the_packed_pair_a_training_step_runs(monkeypatch):
    """``lookup_varlen`` (what ``flashtune show``-like reports read) names the pair a packed
    call with gradients runs on sm_90: attn_fwd_bwd_gluon, its default source."""
    from flashtune.kernel_templates.sm90 import H100

    monkeypatch.setattr(scored, "_device_of", lambda q: H100)
    flashtune.reload_configs()
    q = torch.empty(1500, 8, 128, dtype=torch.bfloat16, requires_grad=True)
    k = torch.empty(1500, 2, 128, dtype=torch.bfloat16, requires_grad=True)
    problem = AttentionProblem(3, 8, 2, 700, 700, 128, True, "bf16", tokens_q=1500,
                               tokens_k=1500)
    choice = scored._lookup(problem, q, k, k, False)
    assert choice.template == "attn_fwd_bwd_gluon" and choice.source == "default"
    assert any(key.startswith("bwd.") for key in choice.config)
    flashtune.reload_configs()


def test_a_backward_launcher_gets_the_mods_it_serves_and_no_off_values():
    """A backward other than attn_bwd (the Gluon one) gets from the routes' launcher the
    score modifications its ``Limits`` serve (a causal window, a softcap) and not the off
    values (a causal call's window is ``(-1, 0)``); one it does not serve is refused,
    naming it (the route never sends it)."""
    from dataclasses import replace

    from flashtune.kernel_templates import get_template

    seen = []
    spec = get_template("attn_bwd_gluon")
    fake = replace(spec, name="fake_bwd", launcher=lambda *a, **kw: seen.append((a, kw)))
    run = scored._bwd_launcher(fake)
    assert scored._bwd_launcher(get_template("attn_bwd")) is get_template("attn_bwd").launcher
    run(1, 2, causal=True, window=(-1, 0), softcap=None, alibi_slopes=None, cu_seqlens_q=3)
    run(1, 2, causal=False, window=(-1, -1))
    run(1, 2, causal=True, window=(8, 0), softcap=30.0)
    assert seen == [((1, 2), {"causal": True, "cu_seqlens_q": 3}), ((1, 2), {"causal": False}),
                    ((1, 2), {"causal": True, "window": (8, 0), "softcap": 30.0})]
    for bad, match in ((dict(causal=False, window=(-1, 0)), "serves no window"),
                       (dict(causal=False, window=(8, -1)), "serves no window"),
                       (dict(causal=True, window=(8, 4)), "serves no window"),
                       (dict(causal=True, alibi_slopes=torch.ones(2)), "no ALiBi")):
        with pytest.raises(InputError, match=match):
            run(1, 2, **bad)
    plain = scored._bwd_launcher(replace(fake, name="fake_plain_bwd",
                                         limits=replace(spec.limits, score_mods=())))
    for bad, match in ((dict(causal=True, softcap=30.0), "no softcap"),
                       (dict(causal=True, window=(8, 0)), "serves no window")):
        with pytest.raises(InputError, match=match):
            plain(1, 2, **bad)
    assert len(seen) == 3


def test_which_plan_a_score_modified_call_gets(monkeypatch):
    """``_new_plan``'s choice (the plans themselves replay CUDA launches: their GPU tests
    are in test_scored_plans_gpu.py): attn_fwd's plan with the window and the softcap bound;
    an implementation's own plan (the Gluon forward's) with both too; a plan that refuses
    the call is kept as None, so the launcher runs it from then on."""
    from flashtune.kernel_templates import get_template

    built = []

    class Planned:
        device_index = 0

        def __init__(self, *args, **kwargs):
            built.append(kwargs)

    monkeypatch.setattr(scored, "AttnFwdPlan", Planned)
    monkeypatch.setattr(scored, "_PLANS", {})
    q = torch.zeros(1, 2, 8, 16)
    options = {"window": (3, 0), "softcap": 20.0, "alibi_slopes": None}
    fwd = get_template("attn_fwd")
    plan = scored._new_plan(q, q, q, fwd, {}, True, None, False, options, ("a",))
    assert isinstance(plan, Planned) and scored._PLANS == {("a",): plan}
    assert built[-1] == {"causal": True, "scale": None, "return_lse": False,
                         "window": (3, 0), "softcap": 20.0}

    gluon = dataclasses.replace(get_template("attn_fwd_gluon"), plan=Planned)
    plan = scored._new_plan(q, q, q, gluon, {}, True, 0.5, True, options, ("b",))
    assert isinstance(plan, Planned)
    assert built[-1] == {"causal": True, "scale": 0.5, "return_lse": True, "window": (3, 0),
                         "softcap": 20.0}
    plan = scored._new_plan(q, q, q, gluon, {}, True, 0.5, True, {**options, "softcap": 0.0},
                            ("c",))
    assert isinstance(plan, Planned)
    assert built[-1] == {"causal": True, "scale": 0.5, "return_lse": True, "window": (3, 0),
                         "softcap": 0.0}

    def refuses(*args, **kwargs):
        raise ValueError("the launcher copies these inputs: no plan")

    gluon = dataclasses.replace(gluon, plan=refuses)
    assert scored._new_plan(q, q, q, gluon, {}, True, None, False,
                            {**options, "softcap": 0.0}, ("d",)) is None
    assert ("d",) in scored._PLANS and scored._PLANS[("d",)] is None


@pytest.mark.skipif(DEVICE != "cpu", reason="the interpreter's calls")
def test_calls_on_the_interpreter_plan_nothing():
    scored.reset()
    q, k, v = qkv()
    flashtune.attention(q, k, v, causal=True, window=(5, 0), softcap=10.0)
    assert scored._PLANS == {}
