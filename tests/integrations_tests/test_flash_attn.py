"""flashtune.flash_attn_interface: FlashAttention-2's functions over flashtune's ops. Each
function equals the op it wraps on transposed views (bitwise: the same kernels) and the fp32
reference; packed inputs get their gradients through views (no copies of the inputs); the LSE
comes in FlashAttention-2's layout; bad arguments raise errors naming FlashAttention-2's
argument that are flashtune's InputError and RuntimeError. Small odd shapes, under the
interpreter."""

from __future__ import annotations

import inspect

import pytest
import torch

import flashtune
from flashtune import flash_attn_interface as fa
from flashtune.core.errors import InputError, InputTypeError
from flashtune.integrations import flash_attn as fa_impl
from flashtune.kernel_templates.attn_fwd.reference import attn_fwd_reference
from tests.conftest import DEVICE
from tests.runtime_tests import test_lookup

env = test_lookup.env  # the fixture: isolated config sources

DT = torch.float16
B, NQ, NK, HQ, HKV, D = 2, 13, 21, 4, 2, 32


def rand(*shape, seed=0, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(*shape, generator=g).to(DEVICE, DT)
    return t.requires_grad_(requires_grad)


def bhsd(t):
    return t.transpose(1, 2)


def ref(q, k, v, **kw):
    """fp32 reference in FlashAttention-2's layout: ``(out, lse)``."""
    out, lse = attn_fwd_reference(bhsd(q), bhsd(k), bhsd(v), dtype=torch.float32, **kw)
    return bhsd(out), lse


def close(a, b, tol=2e-3):
    assert a.shape == b.shape
    torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=0)


def test_fa2_signatures():
    """Names, positional order and defaults of FlashAttention-2 at the pinned commit."""
    common = [("dropout_p", 0.0), ("softmax_scale", None), ("causal", False),
              ("window_size", (-1, -1)), ("softcap", 0.0), ("alibi_slopes", None),
              ("deterministic", False), ("return_attn_probs", False)]
    want = {
        "flash_attn_qkvpacked_func": ["qkv"],
        "flash_attn_kvpacked_func": ["q", "kv"],
        "flash_attn_func": ["q", "k", "v"],
        "flash_attn_varlen_qkvpacked_func": ["qkv", "cu_seqlens", "max_seqlen"],
        "flash_attn_varlen_kvpacked_func": ["q", "kv", "cu_seqlens_q", "cu_seqlens_k",
                                            "max_seqlen_q", "max_seqlen_k"],
        "flash_attn_varlen_func": ["q", "k", "v", "cu_seqlens_q", "cu_seqlens_k",
                                   "max_seqlen_q", "max_seqlen_k"],
    }
    for name, positional in want.items():
        params = inspect.signature(getattr(fa, name)).parameters
        extra = [("block_table", None)] if name == "flash_attn_varlen_func" else []
        assert [(p, params[p].default) for p in params] == (
            [(p, inspect.Parameter.empty) for p in positional] + common + extra), name
    kv = inspect.signature(fa.flash_attn_with_kvcache).parameters
    assert [(p, kv[p].default) for p in kv] == [
        ("q", inspect.Parameter.empty), ("k_cache", inspect.Parameter.empty),
        ("v_cache", inspect.Parameter.empty), ("k", None), ("v", None), ("rotary_cos", None),
        ("rotary_sin", None), ("cache_seqlens", None), ("cache_batch_idx", None),
        ("cache_leftpad", None), ("block_table", None), ("softmax_scale", None),
        ("causal", False), ("window_size", (-1, -1)), ("softcap", 0.0),
        ("rotary_interleaved", True), ("alibi_slopes", None), ("num_splits", 0),
        ("return_softmax_lse", False)]
    assert fa.FA2_COMMIT == "0251105a2fb19d2957484b7f023cd8c115286ced"


MODS = [
    ("plain", dict()),
    ("causal", dict(causal=True)),
    ("window", dict(causal=True, window_size=(5, 0))),
    ("softcap-alibi", dict(softcap=3.0, alibi="bh")),
]


@pytest.mark.parametrize("name,mods", MODS, ids=[m[0] for m in MODS])
def test_flash_attn_func_is_attention_on_views(env, name, mods):
    q, k, v = rand(B, NQ, HQ, D, seed=1), rand(B, NK, HKV, D, seed=2), rand(B, NK, HKV, D, seed=3)
    mods = dict(mods)
    kw = {"causal": mods.get("causal", False)}
    fkw = dict(kw)
    if "window_size" in mods:
        fkw["window_size"] = mods["window_size"]
        kw["window"] = mods["window_size"]
    if "softcap" in mods:
        fkw["softcap"] = kw["softcap"] = mods["softcap"]
    if "alibi" in mods:
        fkw["alibi_slopes"] = kw["alibi_slopes"] = torch.rand(B, HQ).to(DEVICE) * 0.3
    out, lse, third = fa.flash_attn_func(q, k, v, return_attn_probs=True, **fkw)
    assert third is None
    assert out.shape == (B, NQ, HQ, D) and lse.shape == (B, HQ, NQ) and lse.dtype == torch.float32
    # a view of flashtune's output, not a copy, and contiguous as FlashAttention-2's:
    # flashtune's kernels (and SDPA's cuDNN and FLASH) write the inputs' layout
    assert out.is_contiguous()
    want, want_lse = flashtune.attention(bhsd(q), bhsd(k), bhsd(v), return_lse=True, **kw)
    assert torch.equal(out, bhsd(want)) and torch.equal(lse, want_lse)
    r_out, r_lse = ref(q, k, v, **kw)
    close(out, r_out)
    seen = torch.isfinite(r_lse)
    close(lse[seen], r_lse[seen])
    # without the LSE asked for, the call is flashtune.attention's without it (on a GPU its
    # route may differ from the one that returns the LSE)
    assert torch.equal(fa.flash_attn_func(q, k, v, **fkw),
                       bhsd(flashtune.attention(bhsd(q), bhsd(k), bhsd(v), **kw)))


def test_window_size_as_tensor_and_negative_bounds(env):
    q, k, v = rand(1, NQ, 2, D, seed=4), rand(1, NK, 2, D, seed=5), rand(1, NK, 2, D, seed=6)
    # FlashAttention-2's tests pass torch.randint(...) of two ints
    a = fa.flash_attn_func(q, k, v, window_size=torch.tensor([6, 2]))
    assert torch.equal(a, fa.flash_attn_func(q, k, v, window_size=(6, 2)))
    # any negative bound is unbounded, as FlashAttention-2's kernels read it
    assert torch.equal(fa.flash_attn_func(q, k, v, window_size=(-5, -2)),
                       fa.flash_attn_func(q, k, v))


def _spy(monkeypatch, name):
    """Record the tensors flashtune's op ``name`` gets from the interface."""
    seen = []
    real = getattr(fa_impl, name)

    def spy(*args, **kwargs):
        seen.append((args, kwargs))
        return real(*args, **kwargs)

    monkeypatch.setattr(fa_impl, name, spy)
    return seen


def _same_storage(a, b):
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def test_qkvpacked_gradients_through_views(env, monkeypatch):
    seen = _spy(monkeypatch, "attention")
    qkv = rand(B, NQ, 3, HQ, D, seed=7, requires_grad=True)
    out = fa.flash_attn_qkvpacked_func(qkv, causal=True)
    args = seen[0][0]
    assert all(_same_storage(t, qkv) for t in args)  # views: no copy of q, k, v
    g = rand(*out.shape, seed=8)
    (dqkv,) = torch.autograd.grad(out, qkv, g)
    q, k, v = (qkv.detach()[:, :, i].clone().requires_grad_() for i in range(3))
    out2 = fa.flash_attn_func(q, k, v, causal=True)
    assert torch.equal(out, out2)
    assert dqkv.shape == qkv.shape
    for i, grad in enumerate(torch.autograd.grad(out2, (q, k, v), g)):
        assert torch.equal(dqkv[:, :, i], grad)


def test_kvpacked_gqa_gradients_through_views(env, monkeypatch):
    seen = _spy(monkeypatch, "attention")
    q = rand(B, NQ, HQ, D, seed=9, requires_grad=True)
    kv = rand(B, NK, 2, HKV, D, seed=10, requires_grad=True)
    out, lse, _ = fa.flash_attn_kvpacked_func(q, kv, return_attn_probs=True)
    assert all(_same_storage(t, kv) for t in seen[0][0][1:])
    r_out, r_lse = ref(q.detach(), kv.detach()[:, :, 0], kv.detach()[:, :, 1])
    close(out, r_out)
    close(lse, r_lse)
    dq, dkv = torch.autograd.grad(out, (q, kv), rand(*out.shape, seed=11))
    assert dkv.shape == kv.shape and torch.isfinite(dkv).all() and dkv.abs().sum() > 0


def test_deterministic_runs_flashtunes_own_pair(env, monkeypatch):
    from flashtune.runtime import ops

    impls = []
    real = ops._train

    def spy(*args):
        impls.append(args[-1])
        return real(*args)

    monkeypatch.setattr(ops, "_train", spy)  # flashtune.attention(impl="attn_fwd")'s
    q = rand(1, NQ, 2, D, seed=12, requires_grad=True)
    k, v = rand(1, NK, 2, D, seed=13, requires_grad=True), rand(1, NK, 2, D, seed=14,
                                                                 requires_grad=True)
    g = rand(1, NQ, 2, D, seed=15)
    grads = [torch.autograd.grad(fa.flash_attn_func(q, k, v, causal=True, deterministic=True),
                                 (q, k, v), g) for _ in range(2)]
    assert impls == ["attn_fwd", "attn_fwd"]
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    plain = torch.autograd.grad(fa.flash_attn_func(q, k, v, causal=True), (q, k, v), g)
    assert all(torch.equal(a, b) for a, b in zip(grads[0], plain))  # the same kernels on CPU


def test_deterministic_packed_calls_force_attn_fwd_with_attn_bwd(monkeypatch):
    """The varlen functions pass ``deterministic=True`` on as ``impl="attn_fwd"`` when a
    gradient is wanted (attn_fwd with attn_bwd, no atomics; on sm_90 the routed pair runs
    the Gluon backward, whose dQ adds by atomics), and nothing forced otherwise."""
    seen = []
    monkeypatch.setattr(fa_impl, "attention_varlen",
                        lambda *a, **kw: seen.append(kw.get("impl")) or a[0])
    q, cu = _packed([5, 9], 2, seed=30)
    k = rand(14, 2, D, seed=31)
    qg = q.clone().requires_grad_(True)
    for query, det in ((qg, True), (qg, False), (q, True)):
        fa.flash_attn_varlen_func(query, k, k, cu, cu, 9, 9, causal=True, deterministic=det)
    fa.flash_attn_varlen_kvpacked_func(qg, torch.stack((k, k), 1), cu, cu, 9, 9,
                                       deterministic=True)
    fa.flash_attn_varlen_qkvpacked_func(torch.stack((qg, qg, qg), 1), cu, 9,
                                        deterministic=True)
    assert seen == ["attn_fwd", None, None, "attn_fwd", "attn_fwd"]


def _packed(lens, heads, seed):
    total = sum(lens)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32).to(DEVICE)
    return rand(total, heads, D, seed=seed), cu


def test_varlen_is_attention_varlen_with_fa2_lse_layout(env):
    lq, lk = [5, 13, 1], [9, 21, 4]
    q, cu_q = _packed(lq, HQ, 16)
    k, cu_k = _packed(lk, HKV, 17)
    v, _ = _packed(lk, HKV, 18)
    out, lse, third = fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lq), max(lk),
                                                causal=True, return_attn_probs=True)
    assert third is None and out.shape == q.shape and lse.shape == (HQ, sum(lq))
    want, want_lse = flashtune.attention_varlen(q, k, v, cu_q, cu_k, max(lq), max(lk),
                                                causal=True, return_lse=True)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    kv = torch.stack([k, v], dim=1)
    out2 = fa.flash_attn_varlen_kvpacked_func(q, kv, cu_q, cu_k, max(lq), max(lk), causal=True)
    assert torch.equal(out2, out)


def test_varlen_qkvpacked_gradients_through_views(env, monkeypatch):
    seen = _spy(monkeypatch, "attention_varlen")
    lens = [7, 12]
    qkv_flat, cu = _packed(lens, 3 * 2, 19)
    qkv = qkv_flat.view(sum(lens), 3, 2, D).requires_grad_()
    out = fa.flash_attn_varlen_qkvpacked_func(qkv, cu, max(lens), causal=True)
    assert all(_same_storage(t, qkv) for t in seen[0][0][:3])
    (dqkv,) = torch.autograd.grad(out, qkv, rand(*out.shape, seed=20))
    assert dqkv.shape == qkv.shape and dqkv.abs().sum() > 0
    # per sequence, the dense function on that sequence alone
    for s, e in zip(cu.tolist(), cu.tolist()[1:]):
        one = fa.flash_attn_qkvpacked_func(qkv.detach()[None, s:e], causal=True)
        close(out[s:e], one[0])


def test_varlen_over_a_paged_cache(env):
    """block_table: packed queries over a paged cache equal the packed call on the
    sequences' keys gathered from their pages."""
    page, lq, lk = 8, [3, 7, 6], [19, 5, 30]  # sequence 1: two queries see no key
    nblocks = 4
    q, cu_q = _packed(lq, HQ, 21)
    kc, vc = rand(12, page, HKV, D, seed=22), rand(12, page, HKV, D, seed=23)
    table = torch.randperm(12, generator=torch.Generator().manual_seed(0))[:3 * nblocks]
    table = table.view(3, nblocks).to(torch.int32).to(DEVICE)
    cu_k = torch.tensor([0] + list(torch.tensor(lk).cumsum(0)), dtype=torch.int32).to(DEVICE)
    dense_k = torch.cat([kc[table[b].long()].flatten(0, 1)[:n] for b, n in enumerate(lk)])
    dense_v = torch.cat([vc[table[b].long()].flatten(0, 1)[:n] for b, n in enumerate(lk)])
    slopes = torch.rand(HQ).to(DEVICE) * 0.3
    for kw in (dict(causal=True), dict(window_size=(4, 2), alibi_slopes=slopes)):
        out, lse, _ = fa.flash_attn_varlen_func(q, kc, vc, cu_q, cu_k, max(lq), max(lk),
                                                block_table=table, return_attn_probs=True, **kw)
        want, want_lse, _ = fa.flash_attn_varlen_func(q, dense_k, dense_v, cu_q, cu_k, max(lq),
                                                      max(lk), return_attn_probs=True, **kw)
        close(out, want)
        close(lse, want_lse)
    short = table[:, :2].contiguous()  # 16 keys a sequence: 30 do not fit
    with pytest.raises(RuntimeError, match="block_table"):
        fa.flash_attn_varlen_func(q, kc, vc, cu_q, cu_k, max(lq), max(lk), block_table=short)


def test_with_kvcache_is_attention_with_kvcache_on_views(env):
    q = rand(B, 2, HQ, D, seed=24)
    kc, vc = rand(B, 40, HKV, D, seed=25), rand(B, 40, HKV, D, seed=26)
    lens = torch.tensor([17, 40], dtype=torch.int32).to(DEVICE)
    out, lse = fa.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, causal=True,
                                          window_size=(9, 0), softcap=4.0,
                                          return_softmax_lse=True)
    want, want_lse = flashtune.attention_with_kvcache(bhsd(q), bhsd(kc), bhsd(vc), lens,
                                                      causal=True, window=(9, 0), softcap=4.0,
                                                      return_lse=True)
    assert torch.equal(out, bhsd(want)) and torch.equal(lse, want_lse)
    assert lse.shape == (B, HQ, 2)
    # an int length, and None: the whole cache (FlashAttention-2's defaults: causal off)
    full = flashtune.attention_with_kvcache(bhsd(q), bhsd(kc), bhsd(vc),
                                            torch.full((B,), 40, dtype=torch.int32).to(DEVICE),
                                            causal=False)
    assert torch.equal(fa.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=40), bhsd(full))
    assert torch.equal(fa.flash_attn_with_kvcache(q, kc, vc), bhsd(full))


def test_with_kvcache_paged_block_table_bound(env):
    """FlashAttention-2's regression test (#2709), on CPU: a length past what block_table
    addresses is an error naming it; exactly at capacity runs."""
    kc, vc = rand(4, 16, 1, D, seed=27), rand(4, 16, 1, D, seed=28)
    table = torch.zeros(1, 1, dtype=torch.int32).to(DEVICE)
    q = rand(1, 1, 1, D, seed=29)
    over = torch.full((1,), 17, dtype=torch.int32).to(DEVICE)
    with pytest.raises(RuntimeError, match="block_table") as err:
        fa.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=over, block_table=table)
    assert isinstance(err.value, InputError)
    k_new = rand(1, 1, 1, D, seed=30)
    with pytest.raises(RuntimeError, match=r"\+ seqlen_new = 17 exceeds .*block_table"):
        fa.flash_attn_with_kvcache(q, kc, vc, k_new, k_new, cache_seqlens=16,
                                   block_table=table)
    out = fa.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=16, block_table=table)
    want = flashtune.attention_with_kvcache(bhsd(q), bhsd(kc), bhsd(vc),
                                            torch.full((1,), 16, dtype=torch.int32,
                                                       device=DEVICE),
                                            block_table=table, causal=False)
    assert torch.equal(out, bhsd(want))


def test_with_kvcache_forwards_the_new_keywords(monkeypatch):
    """k/v (as (B, H, N, D) views), rotary and the cache indices reach
    attention_with_kvcache when it takes them; otherwise an error names them."""
    calls = []

    def with_k(q, k_cache, v_cache, cache_seqlens, *, block_table=None, causal=True,
               scale=None, window=None, softcap=None, alibi_slopes=None, return_lse=False,
               k=None, v=None, rotary_cos=None, rotary_sin=None, rotary_interleaved=False):
        calls.append(dict(q=q, k=k, v=v, rotary_cos=rotary_cos,
                          rotary_interleaved=rotary_interleaved))
        return torch.zeros_like(q)

    fa_impl._parameters.cache_clear()
    monkeypatch.setattr(fa_impl, "attention_with_kvcache", with_k)
    q, kc = rand(1, 1, 2, D, seed=31), rand(1, 32, 2, D, seed=32)
    knew = rand(1, 3, 2, D, seed=33)
    cos = torch.ones(32, 8).to(DEVICE, DT)
    out = fa.flash_attn_with_kvcache(q, kc, kc, knew, knew, rotary_cos=cos, rotary_sin=cos,
                                     cache_seqlens=4)
    assert out.shape == q.shape
    got = calls[0]
    assert got["k"].shape == (1, 2, 3, D) and _same_storage(got["k"], knew)
    assert got["rotary_cos"] is cos and got["rotary_interleaved"] is True
    lens = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="cache_leftpad") as err:
        fa.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=4, cache_leftpad=lens)
    assert isinstance(err.value, InputError)
    with pytest.raises(InputError, match="cache_batch_idx, cache_leftpad"):
        fa.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=4, cache_leftpad=lens,
                                   cache_batch_idx=lens)
    fa_impl._parameters.cache_clear()


def test_dropout_is_one_error_naming_it_until_the_op_takes_it():
    def plain(q, k, v, *, causal=False):
        return q

    def dropping(q, k, v, *, causal=False, dropout_p=0.0):
        return q

    fa_impl._parameters.cache_clear()
    assert fa_impl._dropout(plain, 0.0) == {}
    with pytest.raises(InputError, match="dropout_p") as err:
        fa_impl._dropout(plain, 0.1)
    assert isinstance(err.value, RuntimeError)
    assert fa_impl._dropout(dropping, 0.1) == {"dropout_p": 0.1}
    with pytest.raises(InputError, match=r"dropout_p must be a float in \[0, 1\)"):
        fa_impl._dropout(dropping, 1.0)
    if not fa_impl.accepts(flashtune.attention, "dropout_p"):
        q = rand(1, 3, 1, 16, seed=34)
        with pytest.raises(InputError, match="dropout_p=0.17"):
            fa.flash_attn_func(q, q, q, 0.17)
        with pytest.raises(InputError, match="dropout_p"):
            fa.flash_attn_qkvpacked_func(rand(1, 3, 3, 1, 16), 0.5)


def test_bad_arguments_name_fa2s_argument(env):
    q = rand(1, 5, 2, 16, seed=35)
    cases = [
        (lambda: fa.flash_attn_func(q[0], q, q), InputError, r"^q must have 4 dimensions "
         r"\(batch_size, seqlen_q, nheads, headdim\)"),
        (lambda: fa.flash_attn_func(q, q.float(), q), InputTypeError, "^k must be float16"),
        (lambda: fa.flash_attn_func(q, q[:, :, :1].expand(1, 5, 3, 16), q), InputError,
         "^k and v must have the same shape"),
        (lambda: fa.flash_attn_func(q, q, q, window_size=3), InputTypeError, "^window_size"),
        (lambda: fa.flash_attn_func(q, q, q, softmax_scale=float("nan")), InputError,
         "^softmax_scale"),
        (lambda: fa.flash_attn_func(q, q, q, softcap="x"), InputError, "^softcap"),
        (lambda: fa.flash_attn_qkvpacked_func(rand(1, 5, 2, 2, 16)), InputError,
         r"^qkv must be \(batch_size, seqlen, 3, nheads, headdim\)"),
        (lambda: fa.flash_attn_kvpacked_func(q, q), InputError, "^kv must have 5 dimensions"),
        (lambda: fa.flash_attn_with_kvcache(q, q, q, q), InputError,
         "^k and v must be given together"),
        (lambda: fa.flash_attn_with_kvcache(q, q, q, num_splits=-1), InputError,
         "^num_splits"),
        (lambda: fa.flash_attn_with_kvcache(q, q, q, q, q), InputError,
         "^cache_seqlens is required"),
        (lambda: fa.flash_attn_varlen_func(q[0], q[0], q[0], None, None, 5, 5), InputTypeError,
         "cu_seqlens_q"),
        (lambda: fa.flash_attn_varlen_func(q[0], q[0], q[0], torch.tensor([0, 5]),
                                           torch.tensor([0, 5], dtype=torch.int32), 0, 5),
         InputError, "^max_seqlen_q must be >= 1"),
    ]
    for call, kind, message in cases:
        with pytest.raises(kind, match=message) as err:
            call()
        assert isinstance(err.value, RuntimeError), message


def test_errors_from_inside_the_ops_become_fa2s_kind(env):
    """An error the op raises (here the cumulative lengths' values, checked by
    attention_varlen) is also a RuntimeError; the qkv-packed function names its own
    arguments."""
    qkv = rand(5, 3, 2, 16, seed=36)
    bad = torch.tensor([1, 5], dtype=torch.int32).to(DEVICE)
    with pytest.raises(RuntimeError, match=r"^cu_seqlens\[0\] must be 0") as err:
        fa.flash_attn_varlen_qkvpacked_func(qkv, bad, 5)
    assert isinstance(err.value, InputError)
    q, k, v = qkv.unbind(1)
    with pytest.raises(RuntimeError, match=r"^cu_seqlens_q\[0\] must be 0"):
        fa.flash_attn_varlen_func(q, k, v, bad, bad, 5, 5)


def _rotate(x, cos, sin, positions):
    """GPT-NeoX rotary of x ``(B, N, H, D)`` (its first ``2 * cos.shape[1]`` dims) at
    ``positions`` ``(B, N)``, in fp32."""
    half = cos.shape[1]
    c, s = cos[positions][:, :, None].float(), sin[positions][:, :, None].float()
    x1, x2, rest = x[..., :half].float(), x[..., half:2 * half].float(), x[..., 2 * half:]
    return torch.cat([x1 * c - x2 * s, x1 * s + x2 * c, rest.float()], -1).to(x.dtype)


@pytest.mark.skipif(not fa_impl.accepts(flashtune.attention_with_kvcache, "k"),
                    reason="attention_with_kvcache has no in-place append yet")
def test_with_kvcache_append_and_rotary_as_fa2(env):
    """k/v appended in place at cache_seqlens and rotary at each sequence's positions, in
    FlashAttention-2's layout: the cache and the output against a torch reference."""
    nq, new, cap, half = 2, 2, 24, 8
    q = rand(B, nq, HQ, D, seed=40)
    kc, vc = rand(B, cap, HKV, D, seed=41), rand(B, cap, HKV, D, seed=42)
    knew, vnew = rand(B, new, HKV, D, seed=43), rand(B, new, HKV, D, seed=44)
    angle = torch.rand(cap, half, generator=torch.Generator().manual_seed(45)) * 6.28
    cos, sin = torch.cos(angle).to(DEVICE, DT), torch.sin(angle).to(DEVICE, DT)
    lens = torch.tensor([5, 17], dtype=torch.int32).to(DEVICE)
    k_ref, v_ref = kc.clone(), vc.clone()
    pos = lens.long()[:, None] + torch.arange(new, device=DEVICE)[None, :]
    k_rot, q_rot = _rotate(knew, cos, sin, pos), _rotate(q, cos, sin, pos[:, :nq])
    for b in range(B):
        k_ref[b, pos[b]] = k_rot[b]
        v_ref[b, pos[b]] = vnew[b]
    out = fa.flash_attn_with_kvcache(q, kc, vc, knew, vnew, rotary_cos=cos, rotary_sin=sin,
                                     cache_seqlens=lens, causal=True,
                                     rotary_interleaved=False)
    close(kc, k_ref, tol=1e-2)
    assert torch.equal(vc, v_ref)
    for b in range(B):
        n = int(lens[b]) + new
        want, _ = ref(q_rot[b:b + 1], k_ref[b:b + 1, :n], v_ref[b:b + 1, :n], causal=True)
        close(out[b:b + 1], want, tol=1e-2)


def test_with_kvcache_appends_under_torch_compile():
    """A decode step through FA2's flash_attn_with_kvcache, compiled fullgraph: the same
    output as eager and the same new keys/values written into both caches."""
    g = torch.Generator().manual_seed(5)
    b, hq, hkv, d, cap = 2, 4, 2, 32, 64

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(DEVICE, torch.float16)

    q, k_new, v_new = randn(b, 1, hq, d), randn(b, 1, hkv, d), randn(b, 1, hkv, d)
    k_cache, v_cache = randn(b, cap, hkv, d), randn(b, cap, hkv, d)
    lens = torch.tensor([5, 30], dtype=torch.int32, device=DEVICE)

    def step(q, k_cache, v_cache, k_new, v_new, lens):
        return fa.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new,
                                          cache_seqlens=lens, causal=True)

    k_eager, v_eager = k_cache.clone(), v_cache.clone()
    want = step(q, k_eager, v_eager, k_new, v_new, lens)
    got = torch.compile(step, backend="aot_eager", fullgraph=True)(q, k_cache, v_cache,
                                                                    k_new, v_new, lens)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert torch.equal(k_cache, k_eager) and torch.equal(v_cache, v_eager)
    assert torch.equal(k_cache[1, 30], k_new[1, 0])  # written where the sequence ends
