"""attention_with_kvcache with FlashAttention-2's cache options: new keys/values appended in
place (contiguous and paged), rotary embedding (GPT-J and GPT-NeoX, partial rotary dims,
causal and not), cache_batch_idx and cache_leftpad, each with GQA/MQA and with the score
modifications, against the reference built as FA2's test builds it (rotate, write, attend);
the caches after the call; every bound check naming its argument; and the unchecked path
(check_tables=False), where bad values must stay inside the tensors. Under the
interpreter: small shapes."""

from __future__ import annotations

import pytest
import torch

from flashtune.core.errors import InputError, InputTypeError
from flashtune.kernel_templates.attn_decode.reference import (
    attn_decode_kvcache_reference,
    attn_decode_reference,
)
from flashtune.runtime import kvcache
from flashtune.runtime.kvcache import attention_with_kvcache
from tests.conftest import DEVICE
from tests.decode_helpers import append_case, assert_kvcache_close

CFG = {"BLOCK_N": 16, "NUM_SPLITS": 3, "num_warps": 4, "num_stages": 1}
LENS = [0, 21, 40]  # an empty cache, odd, a multiple of BLOCK_N; capacity 64


def _call(args, **kw):
    return attention_with_kvcache(args["q"], args["k_cache"], args["v_cache"],
                                  args["cache_seqlens"],
                                  **{n: t for n, t in args.items()
                                     if n not in ("q", "k_cache", "v_cache", "cache_seqlens")},
                                  **kw)


def _before(args):
    return {"k_cache": args["k_cache"].clone(), "v_cache": args["v_cache"].clone()}


CASES = [
    # (id, heads, nq, n_new, case keywords, call keywords)
    ("append-contig-q1", (4, 2), 1, 1, {}, dict(causal=True)),
    ("append-paged-q3-mqa", (4, 1), 3, 3, dict(page_size=16), dict(causal=True)),
    ("append-paged-rows-q3", (4, 2), 3, 2, dict(page_size=8), dict(causal=False)),
    ("rope-neox-half-causal-q3", (4, 2), 3, 3, dict(rotary_dim=16),
     dict(causal=True, rotary_interleaved=False)),
    ("rope-gptj-full-noncausal-new2", (4, 2), 3, 2, dict(rotary_dim=32),
     dict(causal=False, rotary_interleaved=True)),
    ("rope-causal-new2-dead-row", (4, 2), 3, 2, dict(rotary_dim=16),
     dict(causal=True, rotary_interleaved=True)),
    ("rope-neox-paged-noncausal", (4, 2), 3, 3, dict(page_size=16, rotary_dim=16),
     dict(causal=False, rotary_interleaved=False)),
    ("rope-gptj-paged-rows-q1-mqa", (4, 1), 1, 1, dict(page_size=8, rotary_dim=16,
                                                       cos_dtype=torch.float32),
     dict(causal=True)),
    ("batch-idx-rope", (4, 2), 3, 3, dict(batch_cache=5, rotary_dim=16),
     dict(causal=True, rotary_interleaved=False)),
    ("batch-idx-no-append-mqa", (4, 1), 1, 0, dict(batch_cache=4), dict(causal=True)),
    ("leftpad-rope-gptj", (4, 2), 3, 3, dict(leftpad=[0, 5, 17], rotary_dim=16),
     dict(causal=True)),
    ("leftpad-no-append", (4, 2), 3, 0, dict(leftpad=[0, 21, 3]), dict(causal=False)),
    ("leftpad-batch-idx-noncausal", (4, 1), 1, 1, dict(leftpad=[0, 7, 40], batch_cache=3),
     dict(causal=False)),
    ("rope-window-softcap-alibi-paged", (4, 2), 3, 3, dict(page_size=16, rotary_dim=16),
     dict(causal=True, window=(20, 0), softcap=2.0, alibi_slopes="bh")),
    # a chunk of 20 new keys: the write loop takes 16 rows at a time
    ("chunk-20-paged-rope", (4, 2), 20, 20, dict(page_size=16, rotary_dim=16),
     dict(causal=True, rotary_interleaved=False)),
    ("leftpad-rope-window-noncausal", (4, 2), 3, 3, dict(leftpad=[0, 5, 17], rotary_dim=32),
     dict(causal=False, window=(20, 2), rotary_interleaved=False, alibi_slopes="h")),
]


def _options(kw, batch, heads_q):
    kw = dict(kw)
    if kw.get("alibi_slopes") is not None:
        g = torch.Generator().manual_seed(3)
        shape = (heads_q,) if kw["alibi_slopes"] == "h" else (batch, heads_q)
        kw["alibi_slopes"] = (torch.rand(*shape, generator=g) * 0.3).to(DEVICE)
    return kw


@pytest.mark.parametrize("name,heads,nq,n_new,case_kw,call_kw", CASES,
                         ids=[c[0] for c in CASES])
def test_matches_the_fa2_style_reference(name, heads, nq, n_new, case_kw, call_kw):
    args = append_case(LENS, *heads, nq, n_new, 32, torch.float16, DEVICE, seed=len(name),
                       **case_kw)
    kw = _options(call_kw, len(LENS), heads[0])
    before = _before(args)
    out, lse = _call(args, config=CFG, return_lse=True, **kw)
    assert_kvcache_close(out, args, before, lse=lse, **kw)


def test_default_config_and_one_split_agree_with_the_reference():
    """The dispatcher's config (the problem has no field for the options) and one split."""
    args = append_case([3, 50], 4, 2, 2, 2, 32, torch.float16, DEVICE, page_size=16,
                       rotary_dim=16, seed=7)
    before = _before(args)
    out = _call(args, causal=True)
    assert_kvcache_close(out, args, before, causal=True)
    args2 = {**args, "k_cache": before["k_cache"].clone(), "v_cache": before["v_cache"].clone()}
    one = _call(args2, causal=True, config={**CFG, "NUM_SPLITS": 1})
    assert (one.float() - out.float()).abs().max().item() < 4e-3
    assert torch.equal(args2["k_cache"], args["k_cache"])


def test_bf16_append_and_rotary():
    args = append_case(LENS, 4, 2, 3, 3, 32, torch.bfloat16, DEVICE, rotary_dim=16, seed=9)
    before = _before(args)
    out = _call(args, config=CFG, causal=True, rotary_interleaved=False)
    assert_kvcache_close(out, args, before, causal=True, rotary_interleaved=False)


def test_a_decoding_loop_appends_step_by_step():
    """Three steps of one token, each advancing cache_seqlens: the cache then equals the
    one a single call appending the three keys writes (rotated at the same positions)."""
    args = append_case([5, 30], 4, 2, 1, 3, 32, torch.float16, DEVICE, page_size=16,
                       rotary_dim=16, seed=11)
    one_shot = {**args, "k_cache": args["k_cache"].clone(), "v_cache": args["v_cache"].clone(),
                "q": args["q"].expand(-1, -1, 3, -1).contiguous()}
    _call(one_shot, config=CFG, causal=True)
    lens = args["cache_seqlens"].clone()
    for t in range(3):
        step = {**args, "cache_seqlens": lens, "k": args["k"][:, :, t:t + 1],
                "v": args["v"][:, :, t:t + 1]}
        before = _before(args)
        out = _call(step, config=CFG, causal=True)
        assert_kvcache_close(out, step, before, causal=True)
        lens = lens + 1
    assert torch.equal(args["k_cache"], one_shot["k_cache"])
    assert torch.equal(args["v_cache"], one_shot["v_cache"])


def test_rotary_changes_the_result():
    """The tolerance check sees a wrong rotary convention (interleaved vs not)."""
    args = append_case(LENS, 4, 2, 3, 3, 32, torch.float16, DEVICE, rotary_dim=32, seed=13)
    before = _before(args)
    out = _call(args, config=CFG, causal=True, rotary_interleaved=True)
    with pytest.raises(AssertionError):
        assert_kvcache_close(out, args, before, causal=True, rotary_interleaved=False)


# -- bad arguments: errors naming them, before any launch (the cache untouched) -------------


def _bad_inputs():
    return append_case([5, 40], 4, 2, 1, 2, 32, torch.float16, DEVICE, capacity=48,
                       rotary_dim=16, seed=17)


def _paged_inputs():
    return append_case([5, 40], 4, 2, 1, 2, 32, torch.float16, DEVICE, capacity=48,
                       page_size=16, seed=19)


def _int32(*values):
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


BAD = [
    # (id, paged, mutate(args) -> None, exception, message)
    ("k-without-v", False, lambda a: a.pop("v"), InputError, "k and v go together"),
    ("k-fp32", False, lambda a: a.update(k=a["k"].float(), v=a["v"].float()), InputTypeError,
     "k must be float16 or bfloat16"),
    ("k-wrong-heads", False, lambda a: a.update(k=a["k"][:, :1], v=a["v"][:, :1]), InputError,
     "k must have shape .*\\(2, 2, any, 32\\)"),
    ("k-longer-than-cache", False,
     lambda a: a.update(k=a["k"][:, :, :1].expand(-1, -1, 49, -1),
                        v=a["v"][:, :, :1].expand(-1, -1, 49, -1)),
     InputError, "k has seqlen_new 49 keys, more than the cache holds \\(48\\)"),
    ("rotary-without-k", False, lambda a: (a.pop("k"), a.pop("v")), InputError,
     "rotary_cos/rotary_sin need the new keys"),
    ("cos-without-sin", False, lambda a: a.pop("rotary_sin"), InputError,
     "rotary_cos and rotary_sin go together"),
    ("rotary-dim-too-big", False,
     lambda a: a.update(rotary_cos=torch.ones(48, 17, dtype=torch.float16, device=DEVICE),
                        rotary_sin=torch.ones(48, 17, dtype=torch.float16, device=DEVICE)),
     InputError, "rotary_cos's rotary_dim \\(34 = 2 x 17\\) exceeds head_dim 32"),
    ("seqlen-ro-short", False,
     lambda a: a.update(rotary_cos=a["rotary_cos"][:47], rotary_sin=a["rotary_sin"][:47]),
     InputError, "rotary_cos/rotary_sin have 47 positions .* fewer than the cache holds"),
    ("cos-fp64", False, lambda a: a.update(rotary_cos=a["rotary_cos"].double()),
     InputTypeError, "rotary_cos must have q's dtype"),
    ("cos-strided", False,
     lambda a: a.update(rotary_cos=a["rotary_cos"].t().contiguous().t()), InputError,
     "rotary_cos must be contiguous"),
    ("cos-sin-shapes", False,
     lambda a: a.update(rotary_sin=torch.ones(48, 4, dtype=torch.float16, device=DEVICE)),
     InputError, "rotary_cos and rotary_sin must have one shape"),
    ("interleaved-not-bool", False, lambda a: a.update(rotary_interleaved=1), InputTypeError,
     "rotary_interleaved must be a bool"),
    ("batch-idx-int64", False, lambda a: a.update(cache_batch_idx=_int32(0, 1).long()),
     InputTypeError, "cache_batch_idx must have dtype torch.int32"),
    ("batch-idx-shape", False, lambda a: a.update(cache_batch_idx=_int32(0)), InputError,
     "cache_batch_idx must have shape \\(batch,\\) = \\(2,\\)"),
    ("batch-idx-strided", False,
     lambda a: a.update(cache_batch_idx=_int32(0, 0, 1, 1)[::2]), InputError,
     "cache_batch_idx must be contiguous"),
    ("leftpad-list", False, lambda a: a.update(cache_leftpad=[0, 0]), InputTypeError,
     "cache_leftpad must be an int32 torch.Tensor"),
    ("batch-idx-paged", True, lambda a: a.update(cache_batch_idx=_int32(0, 1)), InputError,
     "cache_batch_idx is not supported with block_table"),
    ("leftpad-paged", True, lambda a: a.update(cache_leftpad=_int32(0, 1)), InputError,
     "cache_leftpad is not supported with block_table"),
    ("check-tables-not-bool", False, lambda a: a.update(check_tables="yes"), InputTypeError,
     "check_tables must be True, False or None"),
    # values (checked on CPU by default; check_tables=True on CUDA)
    ("lens-plus-new-past-cache", False, lambda a: a.update(cache_seqlens=_int32(5, 47)),
     InputError, "cache_seqlens\\[1\\] \\+ seqlen_new = 47 \\+ 2 = 49 exceeds k_cache's "
                 "max_seqlen \\(48\\)"),
    ("lens-plus-new-past-table", True, lambda a: a.update(cache_seqlens=_int32(47, 5)),
     InputError, "cache_seqlens\\[0\\] \\+ seqlen_new = 47 \\+ 2 = 49 exceeds block_table's "
                 "capacity \\(3 pages x page_size 16\\)"),
    ("appended-page-id-bad", True,
     lambda a: a["block_table"].__setitem__((0, 1), 999) or a.update(
         cache_seqlens=_int32(15, 5)),
     InputError, "block_table\\[0, 1\\] = 999 is not a page of the cache.* length 17 uses its "
                 "first 2 entries"),
    ("batch-idx-out-of-range", False,
     lambda a: a.update(cache_batch_idx=_int32(1, 2)), InputError,
     "cache_batch_idx\\[1\\] = 2 is not a row of the cache: it must be in \\[0, 2\\)"),
    ("batch-idx-negative", False, lambda a: a.update(cache_batch_idx=_int32(-1, 0)),
     InputError, "cache_batch_idx\\[0\\] = -1 is not a row"),
    ("leftpad-past-length", False, lambda a: a.update(cache_leftpad=_int32(0, 41)),
     InputError, "cache_leftpad\\[1\\] = 41 must be in \\[0, cache_seqlens\\[1\\] = 40\\]"),
    ("leftpad-negative", False, lambda a: a.update(cache_leftpad=_int32(-2, 0)), InputError,
     "cache_leftpad\\[0\\] = -2 must be in"),
]


@pytest.mark.parametrize("name,paged,mutate,exc,msg", BAD, ids=[b[0] for b in BAD])
def test_bad_options_raise_errors_naming_them_before_any_write(name, paged, mutate, exc,
                                                               msg):
    args = _paged_inputs() if paged else _bad_inputs()
    mutate(args)
    before = _before(args)
    check = args.pop("check_tables", True)
    with pytest.raises(exc, match=msg):
        _call(args, config=CFG, check_tables=check)
    assert torch.equal(args["k_cache"], before["k_cache"])
    assert torch.equal(args["v_cache"], before["v_cache"])


def test_a_contiguous_cache_of_other_rows_needs_cache_batch_idx():
    args = append_case([5, 40], 4, 2, 1, 1, 32, torch.float16, DEVICE, batch_cache=3)
    args.pop("cache_batch_idx")
    with pytest.raises(InputError, match="batch mismatch.*cache_batch_idx"):
        _call(args)


# -- the unchecked path: bad values stay inside the tensors ---------------------------------


def _guarded(t, pad_rows=1, pad_slots=4):
    """``t`` (rows, H, slots, D) copied into the middle of a NaN-filled buffer with extra
    rows before and after and extra slots after each row: returns (view, buffer)."""
    rows, h, slots, d = t.shape
    buf = torch.full((rows + 2 * pad_rows, h, slots + pad_slots, d), float("nan"),
                     dtype=t.dtype, device=t.device)
    view = buf[pad_rows:pad_rows + rows, :, :slots]
    view.copy_(t)
    return view, buf


def _guards_intact(view, buf, pad_rows=1):
    rows, slots = view.shape[0], view.shape[2]
    assert torch.isnan(buf[:pad_rows]).all() and torch.isnan(buf[pad_rows + rows:]).all(), \
        "a write before or after the cache"
    assert torch.isnan(buf[:, :, slots:]).all(), "a write past a row's slots"


def _guard_case(page_size=None, nq=2, **kw):
    args = append_case([5, 40], 4, 2, nq, 2, 32, torch.float16, DEVICE, capacity=48,
                       page_size=page_size, rotary_dim=16, seed=23, **kw)
    bufs = {}
    for name in ("k_cache", "v_cache"):
        args[name], bufs[name] = _guarded(args[name])
    for name in ("rotary_cos", "rotary_sin"):  # rows past seqlen_ro are NaN
        t = args[name]
        buf = torch.full((t.shape[0] + 8, t.shape[1]), float("nan"), dtype=t.dtype,
                         device=t.device)
        buf[:t.shape[0]] = t
        args[name] = buf[:t.shape[0]]
    return args, bufs


UNCHECKED = [
    # (id, paged, mutate)
    ("lens-past-capacity", False, lambda a: a.update(cache_seqlens=_int32(47, 1000))),
    ("lens-negative", False, lambda a: a.update(cache_seqlens=_int32(-7, 40))),
    ("lens-past-capacity-no-append", False,
     lambda a: [a.pop(n) for n in ("k", "v", "rotary_cos", "rotary_sin")]
     and a.update(cache_seqlens=_int32(49, 10 ** 6))),
    ("paged-lens-past-table-no-append", True,
     lambda a: [a.pop(n) for n in ("k", "v", "rotary_cos", "rotary_sin")]
     and a.update(cache_seqlens=_int32(49, -4))),
    ("paged-lens-past-table", True, lambda a: a.update(cache_seqlens=_int32(2 ** 30, 47))),
    ("page-ids-out-of-range", True,
     lambda a: a["block_table"].copy_(torch.tensor([[-1, -5, 10 ** 6], [8, 9, 2 ** 31 - 1]],
                                                   dtype=torch.int32))),
    ("batch-idx-out-of-range", False,
     lambda a: a.update(cache_batch_idx=_int32(2, -3))),
    ("leftpad-past-length-and-negative", False,
     lambda a: a.update(cache_leftpad=_int32(400, -9))),
]


@pytest.mark.parametrize("name,paged,mutate", UNCHECKED, ids=[u[0] for u in UNCHECKED])
def test_unchecked_bad_values_never_leave_the_tensors(name, paged, mutate):
    """check_tables=False: no error, finite rows, no write outside the caches (their
    neighbours are NaN, so a read there would show in the output too)."""
    args, bufs = _guard_case(page_size=16 if paged else None)
    mutate(args)
    out, lse = _call(args, config=CFG, causal=True, check_tables=False, return_lse=True)
    assert torch.isfinite(out).all(), "a read outside the cache (NaN) reached the output"
    assert not torch.isnan(lse).any()
    for name in ("k_cache", "v_cache"):
        _guards_intact(args[name], bufs[name])


def test_unchecked_lengths_past_the_capacity_are_clamped():
    """Lengths past the capacity read as the capacity: the reference with clamped lengths
    and the new keys that do not fit dropped."""
    args, bufs = _guard_case(nq=1)
    args["cache_seqlens"] = _int32(47, 1000)
    before = _before(args)
    out = _call(args, config=CFG, causal=True, check_tables=False)
    # sequence 0: 47 keys + the first new one (the second does not fit); sequence 1: the
    # whole cache, nothing written
    for b, (length, fits) in enumerate([(47, 1), (48, 0)]):
        one = {n: t[b:b + 1] for n, t in args.items()
               if n in ("q", "k_cache", "v_cache", "k", "v")}
        ref, _, k_ref, v_ref = attn_decode_kvcache_reference(
            one["q"], before["k_cache"][b:b + 1], before["v_cache"][b:b + 1],
            _int32(length), k=one["k"][:, :, :fits] if fits else None,
            v=one["v"][:, :, :fits] if fits else None,
            rotary_cos=args["rotary_cos"] if fits else None,
            rotary_sin=args["rotary_sin"] if fits else None, causal=True,
            dtype=torch.float64)
        if not fits:  # q still rotated at position 48 (past seqlen_ro: no rotation)
            ref, _ = attn_decode_reference(one["q"], before["k_cache"][b:b + 1],
                                                   before["v_cache"][b:b + 1],
                                                   cache_seqlens=_int32(48), causal=True)
        torch.testing.assert_close(out[b:b + 1].double(), ref, atol=4e-3, rtol=4e-3)
        assert torch.equal(args["k_cache"][b:b + 1], k_ref.to(args["k_cache"].dtype))
        assert torch.equal(args["v_cache"][b:b + 1], v_ref)
    for name in ("k_cache", "v_cache"):
        _guards_intact(args[name], bufs[name])


# -- the CUDA hot path's key ----------------------------------------------------------------


def test_the_options_key_tells_the_options_apart():
    args = _bad_inputs()
    k, v, cos, sin = args["k"], args["v"], args["rotary_cos"], args["rotary_sin"]
    idx = _int32(0, 1)
    keys = {kvcache._options_key(None, None, None, None, True, None, None),
            kvcache._options_key(k, v, None, None, True, None, None),
            kvcache._options_key(k[:, :, :1], v[:, :, :1], None, None, True, None, None),
            kvcache._options_key(k, v, cos, sin, True, None, None),
            kvcache._options_key(k, v, cos, sin, False, None, None),
            kvcache._options_key(k, v, cos.float(), sin.float(), True, None, None),
            kvcache._options_key(None, None, None, None, True, idx, None),
            kvcache._options_key(None, None, None, None, True, None, idx)}
    assert len(keys) == 8
    # rotary_interleaved does not matter without rotary
    assert kvcache._options_key(k, v, None, None, False, None, None) == \
        kvcache._options_key(k, v, None, None, True, None, None)
    for bad in (dict(k=[1.0]), dict(rotary_interleaved=1), dict(cache_leftpad=[0, 1])):
        a = dict(k=None, v=None, rotary_cos=None, rotary_sin=None, rotary_interleaved=True,
                 cache_batch_idx=None, cache_leftpad=None)
        a.update(bad)
        assert kvcache._options_key(*a.values()) is None


@pytest.mark.parametrize("page_size", [None, 16])
def test_under_torch_compile_the_call_is_one_op_that_writes_the_caches(page_size):
    """fullgraph: attention_with_kvcache with append + rotary is the custom op
    flashtune::attention_with_kvcache; out, LSE and the written caches equal eager's, and a
    read of the cache after the call in the same graph sees the new keys."""
    args = append_case(LENS, 4, 2, 1, 1, 32, torch.float16, DEVICE, page_size=page_size,
                       rotary_dim=16, seed=13)
    eager = {**args, **_before(args)}
    want, want_lse = _call(eager, config=CFG, causal=True, return_lse=True)
    rest = {n: t for n, t in args.items() if n not in ("q", "k_cache", "v_cache",
                                                        "cache_seqlens")}

    def step(q, k_cache, v_cache, seqlens):
        out, lse = attention_with_kvcache(q, k_cache, v_cache, seqlens, config=CFG,
                                          causal=True, return_lse=True, **rest)
        return out, lse, k_cache.sum()

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    out, lse, total = compiled(args["q"], args["k_cache"], args["v_cache"],
                               args["cache_seqlens"])
    torch.testing.assert_close(out, want, atol=0, rtol=0)
    torch.testing.assert_close(lse, want_lse, atol=0, rtol=0)
    assert torch.equal(args["k_cache"], eager["k_cache"])
    assert torch.equal(args["v_cache"], eager["v_cache"])
    assert total == eager["k_cache"].sum()  # read after the write
    assert not torch.equal(args["k_cache"], _before(append_case(
        LENS, 4, 2, 1, 1, 32, torch.float16, DEVICE, page_size=page_size, rotary_dim=16,
        seed=13))["k_cache"])  # the call did write
