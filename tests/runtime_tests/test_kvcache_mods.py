"""attention_with_kvcache with window / softcap / ALiBi (FlashAttention-2's
flash_attn_with_kvcache options), and flashtune.attention's short-query calls with them,
which take the decode route: numerics per sequence against the float64 reference, the
problem key, the plan key, and bad arguments. Under the interpreter."""

from __future__ import annotations

import pytest
import torch

import flashtune
from flashtune.core.errors import ConfigError, InputError, InputTypeError
from flashtune.kernel_templates.attn_decode import launcher as dec_launcher
from flashtune.kernel_templates.attn_fwd.reference import attn_fwd_reference
from flashtune.runtime import kvcache
from flashtune.runtime.kvcache import attention_with_kvcache
from tests.conftest import DEVICE
from tests.decode_helpers import assert_decode_close, make_cache
from tests.runtime_tests import test_lookup

env = test_lookup.env  # the fixture: isolated config sources

CFG = {"BLOCK_N": 16, "NUM_SPLITS": 2, "num_warps": 4, "num_stages": 1}
LENS = [1, 61, 48, 100]


def slopes(*shape):
    return (torch.rand(*shape, generator=torch.Generator().manual_seed(11)) * 0.3).to(DEVICE)


CASES = [
    # (id, heads, seqlen_q, causal, mods)
    ("gqa-q1-window", (4, 2), 1, True, dict(window=(9, 0))),
    ("mqa-q3-window-wide", (4, 1), 3, True, dict(window=(70, -1))),
    ("gqa-q3-softcap", (4, 2), 3, False, dict(softcap=1.5)),
    ("mqa-q1-alibi-h", (4, 1), 1, True, dict(alibi_slopes=("h",))),
    ("gqa-q3-all-bh", (4, 2), 3, True, dict(window=(20, 0), softcap=2.0,
                                            alibi_slopes=("bh",))),
]


def _mods(mods, batch, heads_q):
    out = dict(mods)
    if "alibi_slopes" in out:
        out["alibi_slopes"] = (slopes(heads_q) if out["alibi_slopes"] == ("h",)
                               else slopes(batch, heads_q))
    return out


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("name,heads,nq,causal,mods", CASES, ids=[c[0] for c in CASES])
def test_matches_reference_per_sequence(name, heads, nq, causal, mods, paged):
    q, k, v, lens, table = make_cache(LENS, *heads, nq, 32, torch.float16, DEVICE,
                                      page_size=16 if paged else None, capacity=100, seed=1)
    kw = _mods(mods, len(LENS), heads[0])
    out, lse = attention_with_kvcache(q, k, v, lens, block_table=table, causal=causal,
                                      return_lse=True, config=CFG, **kw)
    assert_decode_close(out, q, k, v, cache_seqlens=lens, block_table=table, causal=causal,
                        lse=lse, **kw)


def test_default_config_keys_the_problem_with_its_mods(monkeypatch):
    seen = []
    real = kvcache.DISPATCH.choose

    def spy(problem, device):
        seen.append(problem)
        return real(problem, device)

    monkeypatch.setattr(kvcache.DISPATCH, "choose", spy)
    q, k, v, lens, table = make_cache([5, 40], 4, 2, 1, 32, torch.float16, DEVICE,
                                      page_size=8, capacity=48, seed=2)
    sl = slopes(4)
    out = attention_with_kvcache(q, k, v, lens, block_table=table, window=(16, 3),
                                 softcap=3, alibi_slopes=sl)
    assert_decode_close(out, q, k, v, cache_seqlens=lens, block_table=table, causal=True,
                        window=(16, 3), softcap=3.0, alibi_slopes=sl)
    (p,) = seen
    # causal: the window's right bound is the causal one (-1 in the key)
    assert (p.seqlen_k, p.window_left, p.window_right, p.softcap, p.alibi) == \
        (48, 16, -1, 3.0, True)
    non_causal = attention_with_kvcache(q, k, v, lens, block_table=table, causal=False,
                                        window=(16, 3))
    # one query row sees every key of its sequence with the mask or without it, and none
    # past the last with any right bound: the problem is keyed causal either way
    assert (seen[-1].causal, seen[-1].window_left, seen[-1].window_right) == (True, 16, -1)
    assert_decode_close(non_causal, q, k, v, cache_seqlens=lens, block_table=table,
                        causal=False, window=(16, 3))


def test_off_values_run_the_plain_kernel():
    q, k, v, lens, table = make_cache([5, 40], 4, 2, 1, 32, torch.float16, DEVICE,
                                      page_size=16, capacity=48, seed=3)
    plain = attention_with_kvcache(q, k, v, lens, block_table=table)
    for kw in (dict(window=(-1, -1)), dict(window=(-1, 4)), dict(softcap=0.0),
               dict(window=None, softcap=None, alibi_slopes=None)):
        assert torch.equal(attention_with_kvcache(q, k, v, lens, block_table=table, **kw),
                           plain), kw


def test_explicit_config_counts_the_windows_keys():
    """Under a window the splits cut its keys only: more splits than its blocks idle."""
    q, k, v, lens, _ = make_cache([5, 40], 4, 2, 1, 32, torch.float16, DEVICE, seed=4)
    with pytest.raises(ConfigError, match="the 2 key blocks .* in the window's 5 keys"):
        attention_with_kvcache(q, k, v, lens, window=(4, 0), config={**CFG, "NUM_SPLITS": 3})
    out = attention_with_kvcache(q, k, v, lens, window=(4, 0), config=CFG)
    assert_decode_close(out, q, k, v, cache_seqlens=lens, causal=True, window=(4, 0))


def test_the_plan_key_holds_the_mods():
    """The CUDA hot path replays a plan without checks: its key tells the modifications
    and the slopes' metadata apart, and gives up (None: the checks run and name the
    argument) on values it cannot hold."""
    sl = slopes(4)
    base = kvcache._mods_key(None, None, None)
    keys = {base, kvcache._mods_key((8, 0), None, None), kvcache._mods_key(None, 2.0, None),
            kvcache._mods_key(None, None, sl), kvcache._mods_key(None, None, slopes(2, 4)),
            kvcache._mods_key(None, None, sl.half()), kvcache._mods_key(None, None, sl[:1])}
    assert len(keys) == 7
    for bad in (dict(window=[8, 0]), dict(window=(True, 0)), dict(softcap=True),
                dict(softcap="2"), dict(alibi_slopes=[0.1] * 4)):
        args = {"window": None, "softcap": None, "alibi_slopes": None, **bad}
        assert kvcache._mods_key(args["window"], args["softcap"], args["alibi_slopes"]) is None


def _inputs():
    return make_cache([5, 40], 4, 2, 1, 32, torch.float16, DEVICE, page_size=16,
                      capacity=48, seed=5)


BAD = [
    (dict(window=(3,)), InputTypeError, "window must be a pair"),
    (dict(window=[1.5, 0]), InputTypeError, "window must be a pair of ints"),
    (dict(window=(-2, 0)), InputError, "window \\(-2, 0\\).*>= 0, or -1"),
    (dict(softcap=-1.0), InputError, "softcap must be a positive"),
    (dict(softcap=float("nan")), InputError, "softcap must be"),
    (dict(softcap=True), InputError, "softcap must be"),
    (dict(alibi_slopes=[0.1] * 4), InputTypeError, "alibi_slopes must be a torch.Tensor"),
    (dict(alibi_slopes=torch.ones(4, dtype=torch.float16)), InputTypeError,
     "alibi_slopes must be float32"),
    (dict(alibi_slopes=torch.ones(2)), InputError,
     "alibi_slopes must have shape \\(4,\\) or \\(2, 4\\)"),
    (dict(alibi_slopes=torch.ones(3, 4)), InputError, "alibi_slopes must have shape"),
    (dict(alibi_slopes=torch.ones(4, device="meta")), InputError,
     "alibi_slopes is on meta"),
]


@pytest.mark.parametrize("kwargs,exc,msg", BAD, ids=[b[2][:26] for b in BAD])
def test_bad_mods_are_errors_naming_them(kwargs, exc, msg):
    q, k, v, lens, table = _inputs()
    kwargs = {n: (t.to(DEVICE) if isinstance(t, torch.Tensor) and t.device.type != "meta"
                  else t) for n, t in kwargs.items()}
    with pytest.raises(exc, match=msg):
        attention_with_kvcache(q, k, v, lens, block_table=table, **kwargs)


# -- flashtune.attention: short queries with modifications take the decode route ----------


def qkv(nq, nk, b=2, hq=4, hkv=2, d=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda h, n: torch.randn(b, h, n, d, generator=g).half().to(DEVICE)  # noqa: E731
    return mk(hq, nq), mk(hkv, nk), mk(hkv, nk)


ROUTED = [
    ("window-causal", True, dict(window=(20, 0))),
    ("window-softcap-alibi", False, dict(window=(30, 5), softcap=2.0, alibi_slopes=("bh",))),
]


@pytest.mark.skipif(DEVICE != "cpu", reason="the interpreter device's own tables")
@pytest.mark.parametrize("name,causal,mods", ROUTED, ids=[r[0] for r in ROUTED])
def test_attention_routes_short_queries_with_mods_to_attn_decode(env, monkeypatch, name,
                                                                 causal, mods):
    q, k, v = qkv(3, kvcache.DECODE_MIN_KEYS + 21, seed=1)
    kw = _mods(mods, 2, 4)
    assert flashtune.lookup_config(q, k, v, causal=causal, **kw).template == "attn_decode"
    launched = []
    real = dec_launcher._launch
    monkeypatch.setattr(dec_launcher, "_launch",
                        lambda *a, **o: launched.append(o) or real(*a, **o))
    out, lse = flashtune.attention(q, k, v, causal=causal, return_lse=True, **kw)
    (opts,) = launched  # attn_decode's dense launch, with the options
    assert opts["window"] == (kw["window"][0], 0 if causal else kw["window"][1])
    assert opts["softcap"] == kw.get("softcap")
    assert (opts["alibi_slopes"] is None) == ("alibi_slopes" not in kw)
    ref, ref_lse = attn_fwd_reference(q, k, v, causal=causal, **kw)
    torch.testing.assert_close(out.double(), ref, atol=4e-3, rtol=4e-3)
    inf = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), inf)
    torch.testing.assert_close(lse.double()[~inf], ref_lse[~inf], atol=2e-3, rtol=2e-3)
    assert torch.equal(flashtune.attention(q, k, v, causal=causal, **kw), out)  # memoised


@pytest.mark.skipif(DEVICE != "cpu", reason="the interpreter device's own tables")
def test_short_keys_long_queries_and_gradients_stay_on_attn_fwd(env):
    kw = dict(window=(8, 0), softcap=2.0)
    q, k, v = qkv(3, kvcache.DECODE_MIN_KEYS - 1)
    assert flashtune.lookup_config(q, k, v, causal=True, **kw).template == "attn_fwd"
    q, k, v = qkv(kvcache.DECODE_MAX_QUERIES + 1, 2 * kvcache.DECODE_MIN_KEYS)
    assert flashtune.lookup_config(q, k, v, causal=True, **kw).template == "attn_fwd"
    q, k, v = qkv(1, kvcache.DECODE_MIN_KEYS + 3)
    q.requires_grad_(True)
    assert flashtune.lookup_config(q, k, v, causal=True, **kw).template == "attn_fwd"
    out = flashtune.attention(q, k, v, causal=True, **kw)
    out.float().sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()
