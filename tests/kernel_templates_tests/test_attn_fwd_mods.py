"""attn_fwd's score modifications (local window, softcap, ALiBi) and its packed (varlen)
layout against the float64 reference, FlashAttention-2's semantics (interpreter or GPU).

Tolerances are test_attn_fwd's flash-attention rule: the kernel's error vs float64 at most 2x
that of the same reference run in the inputs' precision, plus a few ulps.
"""

from __future__ import annotations

import pytest
import torch

from flashtune.kernel_templates.attn_fwd import attn_fwd
from flashtune.kernel_templates.attn_fwd.launcher import kernel_args
from flashtune.kernel_templates.attn_fwd.reference import attn_fwd_reference
from tests.conftest import DEVICE

CFG = {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1}
DTYPES = [torch.float16, torch.bfloat16]
DTYPE_IDS = ["fp16", "bf16"]


def make_qkv(b, hq, hkv, nq, nk, d, dtype, *, seed=0, spread=1.0):
    g = torch.Generator().manual_seed(seed)

    def rand(h, n, s=1.0):
        return (torch.randn(b, h, n, d, generator=g) * s).to(dtype).to(DEVICE)
    return rand(hq, nq, spread), rand(hkv, nk), rand(hkv, nk)


def slopes(*shape, seed=1):
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(*shape, generator=g) * 0.5 + 0.05).to(DEVICE)


def assert_matches(out, lse, q, k, v, factor=2.0, **mods):
    """test_attn_fwd's rule (tests.helpers.assert_close_to_reference) for modified scores;
    ``lse`` as the reference's, -inf where a row sees no key."""
    ref, ref_lse = attn_fwd_reference(q, k, v, dtype=torch.float64, **mods)
    low, _ = attn_fwd_reference(q, k, v, dtype=q.dtype, **mods)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert not torch.isnan(out).any(), "NaN in output"
    err = (out.double() - ref).abs().max().item()
    pt_err = (low.double() - ref).abs().max().item()
    eps = torch.finfo(q.dtype).eps
    assert err <= factor * pt_err + 4 * eps * max(1.0, ref.abs().max().item()), (
        f"kernel max error {err:.3e} > {factor} x torch low-precision error {pt_err:.3e}")
    rel = ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    assert rel < 2e-2, f"relative error {rel:.3e}"
    assert lse.dtype == torch.float32 and lse.shape == q.shape[:3]
    dead = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), dead), "LSE -inf pattern differs"
    assert (lse[dead] < 0).all()
    assert (out[dead] == 0).all(), "rows that see no key must be 0"
    if (~dead).any():
        lse_err = (lse.double()[~dead] - ref_lse[~dead]).abs().max().item()
        assert lse_err < 1e-3 * max(1.0, ref_lse[~dead].abs().max().item()), lse_err
    return ref


SHAPES = [
    # (b, hq, hkv, nq, nk, d)
    (1, 4, 2, 37, 45, 32),  # GQA 4:2
    (1, 4, 1, 45, 37, 32),  # MQA 4:1, Nq > Nk: early rows sit before the first key
    (2, 2, 1, 37, 45, 16),
]
SHAPE_IDS = ["gqa-q37k45d32", "mqa-q45k37d32", "b2-q37k45d16"]
WINDOWS = [
    # (window, causal)
    ((8, -1), False),   # left only
    ((-1, 5), False),   # right only
    ((6, 3), False),    # both
    ((1, 1), False),    # bounds equal to 1 (Triton specialises the integer 1)
    ((10, -1), True),   # causal with a left window
    ((4, 7), True),     # causal overrides the right bound: (4, 0)
]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("window,causal", WINDOWS, ids=lambda w: str(w))
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_window(shape, window, causal, dtype):
    q, k, v = make_qkv(*shape, dtype, seed=sum(window) + 7)
    out, lse = attn_fwd(q, k, v, CFG, causal=causal, window=window, return_lse=True)
    assert_matches(out, lse, q, k, v, causal=causal, window=window)


def test_causal_window_right_bound_is_zero():
    q, k, v = make_qkv(1, 2, 2, 37, 45, 32, torch.float16, seed=3)
    a = attn_fwd(q, k, v, CFG, causal=True, window=(4, 7))
    b = attn_fwd(q, k, v, CFG, causal=True, window=(4, 0))
    assert torch.equal(a, b)
    plain = attn_fwd(q, k, v, CFG, causal=True)
    assert torch.equal(attn_fwd(q, k, v, CFG, causal=True, window=(-1, -1)), plain)
    assert not torch.equal(a, plain)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("window,causal,dead", [((2, 0), False, 8), ((1, 2), False, 6),
                                                ((0, -1), True, 8)],
                         ids=["w2-0", "w1-2", "w0-causal"])
def test_narrow_window_rows_see_nothing(window, causal, dead, dtype):
    # Nq 45 > Nk 37: query i sits at key i - 8, so the first rows' windows end before key 0
    q, k, v = make_qkv(1, 4, 2, 45, 37, 32, dtype, seed=11)
    out, lse = attn_fwd(q, k, v, CFG, causal=causal, window=window, return_lse=True)
    assert_matches(out, lse, q, k, v, causal=causal, window=window)
    assert torch.all(out[:, :, :dead] == 0) and torch.all(torch.isneginf(lse[:, :, :dead]))
    assert torch.isfinite(lse[:, :, dead:]).all()


def _segments(m0, nq, nk, left, right, bm, bn):
    """The spec's three key segments of the query tile at row ``m0`` (plain arithmetic, to
    show which tiles have an unmasked middle)."""
    pos0, pos1 = m0 + nk - nq, m0 + bm - 1 + nk - nq
    lo = max(0, pos0 - left) // bn * bn
    hi = max(min(nk, pos1 + right + 1), lo)
    full_lo = min(max(-(-max(pos1 - left, 0) // bn) * bn, lo), hi)
    full_hi = max(min(nk // bn * bn, max(pos0 + right + 1, 0) // bn * bn), full_lo)
    return lo, full_lo, full_hi, hi


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("mods", [{"window": (40, 8)}, {"window": (40, 0), "causal": True},
                                  {"window": (40, 8), "softcap": 4.0, "alibi": True}],
                         ids=["window", "causal", "softcap-alibi"])
def test_unmasked_middle_of_a_wide_window(mods, dtype):
    """Nk 96, a window wider than a BLOCK_N 16 tile: tiles walk a masked left band, full
    blocks without a mask, and a masked right band. Every row of tiles 1..5 sees a whole
    block in the middle, so skipping the middle, masking it wrongly, or running a band
    without its mask shows in the output against the reference."""
    nq = nk = 96
    left, right = mods["window"]
    causal = mods.get("causal", False)
    tiles = [_segments(m0, nq, nk, left, 0 if causal else right, 16, 16)
             for m0 in range(0, nq, 16)]
    assert all(t[2] - t[1] >= 16 for t in tiles[1:])  # an unmasked middle block
    assert all(t[0] < t[1] for t in tiles[2:]) and all(t[2] < t[3] for t in tiles)
    q, k, v = make_qkv(1, 2, 1, nq, nk, 32, dtype, seed=5, spread=2.0)
    extra = {}
    if mods.get("softcap"):
        extra["softcap"] = mods["softcap"]
    if mods.get("alibi"):
        extra["alibi_slopes"] = slopes(2) * 0.05  # gentle: keys 40 away still count
    out, lse = attn_fwd(q, k, v, CFG, causal=causal, window=(left, right), return_lse=True,
                        **extra)
    assert_matches(out, lse, q, k, v, causal=causal, window=(left, right), **extra)


def test_blocks_outside_the_window_are_never_read():
    """Nq 16 against Nk 96 with window (8, 0): the queries sit at keys 80..95 and see keys
    72..95, so a walk that starts at the window's first block never touches keys 0..63;
    NaN there must not reach the output (a sliding window costs O(N * W))."""
    q, k, v = make_qkv(1, 2, 2, 16, 96, 32, torch.float16, seed=9)
    kp, vp = k.clone(), v.clone()
    kp[:, :, :64] = float("nan")
    vp[:, :, :64] = float("nan")
    for causal, window in ((True, (8, -1)), (False, (8, 0)), (False, (8, 3))):
        out, lse = attn_fwd(q, kp, vp, CFG, causal=causal, window=window, return_lse=True)
        assert_matches(out, lse, q, k, v, causal=causal, window=window)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_softcap(causal, dtype):
    # scores of std ~3 so that a cap of 2.5 bends most of them
    q, k, v = make_qkv(1, 4, 2, 37, 45, 32, dtype, seed=13, spread=3.0)
    out, lse = attn_fwd(q, k, v, CFG, causal=causal, softcap=2.5, return_lse=True)
    assert_matches(out, lse, q, k, v, causal=causal, softcap=2.5)
    assert not torch.allclose(out, attn_fwd(q, k, v, CFG, causal=causal), atol=1e-2)
    assert torch.equal(attn_fwd(q, k, v, CFG, causal=causal, softcap=0.0),
                       attn_fwd(q, k, v, CFG, causal=causal))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("per_batch", [False, True], ids=["slopes-h", "slopes-bh"])
@pytest.mark.parametrize("shape", [(2, 4, 2, 37, 45, 32), (2, 4, 1, 45, 37, 16)],
                         ids=["gqa-q37k45d32", "mqa-q45k37d16"])
def test_alibi(shape, per_batch, causal, dtype):
    b, hq = shape[0], shape[1]
    q, k, v = make_qkv(*shape, dtype, seed=17)
    al = slopes(b, hq) if per_batch else slopes(hq)
    out, lse = attn_fwd(q, k, v, CFG, causal=causal, alibi_slopes=al, return_lse=True)
    assert_matches(out, lse, q, k, v, causal=causal, alibi_slopes=al)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("causal,window", [(True, (9, -1)), (False, (7, 4))],
                         ids=["causal-left", "both"])
@pytest.mark.parametrize("shape", [(2, 4, 1, 45, 37, 32), (1, 4, 2, 37, 45, 16)],
                         ids=["mqa-q45k37d32", "gqa-q37k45d16"])
def test_all_combined(shape, causal, window, dtype):
    b, hq = shape[0], shape[1]
    q, k, v = make_qkv(*shape, dtype, seed=19, spread=2.0)
    mods = dict(causal=causal, window=window, softcap=3.0, alibi_slopes=slopes(b, hq))
    out, lse = attn_fwd(q, k, v, CFG, return_lse=True, **mods)
    assert_matches(out, lse, q, k, v, **mods)


@pytest.mark.parametrize("knobs", [{"USE_TMA": 1}, {"REVERSE_M": 1}, {"BLOCK_M": 32,
                                   "BLOCK_N": 32, "num_stages": 2}],
                         ids=["tma", "reverse", "tiles32"])
def test_modifications_with_other_configs(knobs):
    q, k, v = make_qkv(1, 4, 2, 45, 37, 32, torch.float16, seed=23, spread=2.0)
    for causal, window in ((True, (6, -1)), (False, (5, 9))):
        mods = dict(causal=causal, window=window, softcap=3.0, alibi_slopes=slopes(4))
        out, lse = attn_fwd(q, k, v, {**CFG, **knobs}, return_lse=True, **mods)
        assert_matches(out, lse, q, k, v, **mods)


# --- varlen -------------------------------------------------------------------------------

# (Nq_b, Nk_b): equal lengths, a single query against 29 keys, more queries than keys
SEQLENS = [(20, 20), (1, 29), (33, 17)]


def make_varlen(hq, hkv, d, dtype, *, packed, seed=0, spread=1.0):
    """Packed q/k/v ``(total, H, D)`` and int32 cu_seqlens. ``packed``: q, k and v are views
    into one ``(total, Hq + 2 Hkv, D)`` tensor (FA2's qkvpacked GQA layout: a token stride of
    ``(Hq + 2 Hkv) D``, so q/k/v must share token counts)."""
    g = torch.Generator().manual_seed(seed)
    nq = [s[0] for s in SEQLENS]
    nk = nq if packed else [s[1] for s in SEQLENS]
    cu_q = torch.tensor([0, *torch.tensor(nq).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(nk).cumsum(0).tolist()], dtype=torch.int32)
    tq, tk = int(cu_q[-1]), int(cu_k[-1])
    if packed:
        qkv = torch.randn(tq, hq + 2 * hkv, d, generator=g).to(dtype).to(DEVICE)
        qkv[:, :hq] *= spread
        q, k, v = qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]
        assert not q.is_contiguous() and q.stride(0) == (hq + 2 * hkv) * d
    else:
        q = (torch.randn(tq, hq, d, generator=g) * spread).to(dtype).to(DEVICE)
        k = torch.randn(tk, hkv, d, generator=g).to(dtype).to(DEVICE)
        v = torch.randn(tk, hkv, d, generator=g).to(dtype).to(DEVICE)
    return q, k, v, cu_q.to(DEVICE), cu_k.to(DEVICE), max(nq), max(nk)


VARLEN_MODS = {
    "plain": {},
    "causal": {"causal": True},
    "window": {"window": (5, 2)},
    "all": {"causal": True, "window": (6, -1), "softcap": 3.0, "alibi": "bh"},
    "alibi-h": {"window": (-1, 4), "alibi": "h"},
}


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("mods", list(VARLEN_MODS.values()), ids=list(VARLEN_MODS))
@pytest.mark.parametrize("packed", [False, True], ids=["separate", "qkvpacked"])
def test_varlen_matches_each_sequence(packed, mods, dtype):
    hq, hkv, d = 4, 2, 32
    q, k, v, cu_q, cu_k, max_q, max_k = make_varlen(hq, hkv, d, dtype, packed=packed, seed=29,
                                                    spread=2.0)
    batch = len(SEQLENS)
    mods = dict(mods)
    al = mods.pop("alibi", None)
    if al is not None:
        mods["alibi_slopes"] = slopes(batch, hq) if al == "bh" else slopes(hq)
    out, lse = attn_fwd(q, k, v, CFG, return_lse=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                        max_seqlen_q=max_q, max_seqlen_k=max_k, **mods)
    assert out.shape == q.shape and out.is_contiguous()
    assert lse.shape == (hq, q.shape[0]) and lse.is_contiguous()
    for b in range(batch):
        qs, ks = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        seq = dict(mods)
        if al == "bh":
            seq["alibi_slopes"] = mods["alibi_slopes"][b]
        qb, kb, vb = (t[s].transpose(0, 1).unsqueeze(0) for t, s in ((q, qs), (k, ks), (v, ks)))
        assert_matches(out[qs].transpose(0, 1).unsqueeze(0), lse[:, qs].unsqueeze(0),
                       qb, kb, vb, **seq)


def test_varlen_writes_every_row_and_ignores_tma():
    q, k, v, cu_q, cu_k, max_q, max_k = make_varlen(4, 1, 16, torch.float16, packed=False,
                                                    seed=31)
    poison = torch.full_like(q, float("nan"))
    cfg = {**CFG, "USE_TMA": 1, "REVERSE_M": 1}
    out, lse = attn_fwd(q, k, v, cfg, causal=True, out=poison, return_lse=True,
                        cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)  # max_seqlen from cu_seqlens
    assert out is poison and not torch.isnan(out).any() and not torch.isnan(lse).any()
    args, kwargs, grid = kernel_args(q, k, v, out, lse, cfg, causal=True, scale=0.25,
                                     use_tma=True, upcast_dot=False, cu_seqlens_q=cu_q,
                                     cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k)
    assert grid == (-(-max_q // CFG["BLOCK_M"]), len(SEQLENS) * 4)
    assert kwargs["VARLEN"] and not kwargs["USE_TMA"]
    for b in range(len(SEQLENS)):
        qs, ks = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        ref, ref_lse = attn_fwd_reference(*(t[s].transpose(0, 1).unsqueeze(0) for t, s in
                                            ((q, qs), (k, ks), (v, ks))), causal=True)
        assert (out[qs].transpose(0, 1).double() - ref[0]).abs().max() < 5e-3
        assert torch.equal(torch.isinf(lse[:, qs]), torch.isinf(ref_lse[0]))


def test_plain_calls_pass_the_features_off():
    """Defaults leave every new flag off and every new pointer None (a constexpr): the
    compiled kernel is today's, and the launch plan's first nine arguments (the tensors it
    swaps per call) keep their places."""
    q, k, v = make_qkv(1, 2, 2, 37, 45, 32, torch.float16)
    for causal in (False, True):
        args, kwargs, grid = kernel_args(q, k, v, torch.empty_like(q), None, CFG,
                                         causal=causal, scale=0.2, use_tma=False,
                                         upcast_dot=False)
        assert all(a is t for a, t in zip(args[:3], (q, k, v)))
        assert args[9:12] == (None, None, None)
        assert not any(kwargs[f] for f in ("HAS_WINDOW", "HAS_SOFTCAP", "HAS_ALIBI", "VARLEN"))
        assert kwargs["IS_CAUSAL"] == causal and grid == (3, 2)
