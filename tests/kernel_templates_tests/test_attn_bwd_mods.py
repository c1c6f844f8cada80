"""attn_bwd with FlashAttention-2's score modifications (local window, softcap, ALiBi) and
packed variable-length sequences (issue 29): dq, dk, dv against float64 autograd through
``attn_fwd_reference``, with test_attn_bwd.py's tolerance rule (``assert_grads_close``: a
few times the error of torch's own autograd in the inputs' precision).

The backward's inputs do not come from attn_fwd: out and LSE are the float64 reference's
(out cast to the input dtype, LSE to float32), so these tests hold whatever the forward
serves. Packed sequences are checked sequence by sequence against the reference on that
slice.
"""

from __future__ import annotations

import pytest
import torch

from flashtune.kernel_templates.attn_bwd import attn_bwd
from flashtune.kernel_templates.attn_bwd.launcher import kernel_args
from flashtune.kernel_templates.attn_fwd.reference import attn_fwd_reference, visible
from tests.helpers import assert_grads_close

# 16-row tiles everywhere: the windows below cut through several blocks of both walks
CFG = {"BLOCK_M1": 16, "BLOCK_N1": 16, "BLOCK_M2": 16, "BLOCK_N2": 16, "num_warps": 2,
       "num_stages": 1}
# test_attn_bwd.py's interpreter tiles (dK/dV key tiles and dQ query tiles of 32)
CFG_32 = {"BLOCK_M1": 16, "BLOCK_N1": 32, "BLOCK_M2": 32, "BLOCK_N2": 16, "num_warps": 2,
          "num_stages": 1}
DTYPES = [torch.float16, torch.bfloat16]
DTYPE_IDS = ["fp16", "bf16"]


def make(shape, dtype, device, seed=0, q_scale=1.0):
    """Random ``q, k, v, do`` of ``shape = (b, hq, hkv, nq, nk, d)``."""
    b, hq, hkv, nq, nk, d = shape
    g = torch.Generator().manual_seed(seed)

    def rand(h, n, s=1.0):
        return (torch.randn(b, h, n, d, generator=g) * s).to(dtype).to(device)
    return rand(hq, nq, q_scale), rand(hkv, nk), rand(hkv, nk), rand(hq, nq)


def slopes(shape, device, seed=1):
    """ALiBi slopes in FlashAttention's range, fp32, ``shape`` (Hq,) or (B, Hq)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(shape, generator=g) * 0.5 + 0.05).to(device)


def reference(q, k, v, do, dlse=None, **mods):
    """``(out, lse, (exact, low))``: the float64 forward, and the gradients of
    ``sum(out * do) [+ sum(lse * dlse)]`` by autograd through ``attn_fwd_reference`` in
    float64 (exact) and in the inputs' precision (torch's own error, the tolerance's
    baseline)."""
    def run(dtype):
        qf, kf, vf = (t.detach().to(dtype).requires_grad_(True) for t in (q, k, v))
        out, lse = attn_fwd_reference(qf, kf, vf, dtype=dtype, **mods)
        loss = (out * do.to(dtype)).sum()
        if dlse is not None:  # rows that see no key: LSE -inf, no gradient
            loss = loss + (torch.where(torch.isinf(lse), 0.0, lse) * dlse.to(dtype)).sum()
        return out.detach(), lse.detach(), torch.autograd.grad(loss, (qf, kf, vf))
    out, lse, exact = run(torch.float64)
    low = run(q.dtype)[2]
    return out, lse, (exact, low)


def check(q, k, v, do, cfg, dlse=None, **mods):
    """attn_bwd of ``cfg`` on the float64 forward's out and LSE, against the references;
    returns the gradients."""
    out, lse, refs = reference(q, k, v, do, dlse, **mods)
    got = attn_bwd(q, k, v, out.to(q.dtype), lse.float(), do, cfg, dlse=dlse, **mods)
    assert_grads_close(got, q, k, v, do, causal=False, refs=refs)
    return got


# -- local windows ------------------------------------------------------------------------------

WINDOWS = [
    # (id, shape (b, hq, hkv, nq, nk, d), window, causal)
    ("left", (1, 4, 2, 37, 45, 32), (6, -1), False),
    ("right", (1, 4, 1, 45, 37, 32), (-1, 5), False),  # MQA, Nq > Nk
    ("both", (1, 4, 2, 37, 45, 32), (7, 3), False),
    ("causal-left", (1, 4, 2, 45, 37, 32), (9, -1), True),
    ("causal-drops-right", (1, 4, 1, 37, 45, 32), (5, 8), True),  # right bound 0 (FA2)
    # Nq > Nk, (1, 0): row i sees keys i - 9 and i - 8, the first 8 rows none
    ("narrow", (1, 4, 2, 45, 37, 32), (1, 0), False),
    ("d16", (1, 2, 2, 37, 45, 16), (4, 4), False),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", WINDOWS, ids=[w[0] for w in WINDOWS])
def test_windows_match_float64(device, case, dtype):
    """Both SPLIT_LOOPS: one masked loop over the blocks the window reaches, and the same
    blocks split into masked bands and unmasked middles."""
    _, shape, window, causal = case
    q, k, v, do = make(shape, dtype, device, seed=shape[3] + window[0])
    for split in (0, 1):
        got = check(q, k, v, do, {**CFG, "SPLIT_LOOPS": split}, window=window, causal=causal)
    if case[0] == "narrow":  # rows that see no key: zero dQ, not NaN
        assert torch.all(got[0][:, :, :8] == 0) and got[0][:, :, 8:].abs().sum() > 0


def test_window_wider_than_the_blocks_runs_unmasked_middles(device):
    """Nk 96, window (40, 8), 16-row tiles: the dQ tile of rows 32..47 (key positions
    48..63) sees keys [23, 56] with every row, so key block [32, 48) runs unmasked between
    the masked bands; the dK/dV tile of keys [32, 48) is seen in full by rows [23, 56], so
    query block [32, 48) does. Both loop layouts give the reference's gradients."""
    q, k, v, do = make((1, 2, 1, 80, 96, 32), torch.float16, device, seed=96)
    mods = dict(window=(40, 8), softcap=4.0)
    split = check(q, k, v, do, {**CFG, "SPLIT_LOOPS": 1}, **mods)
    one = check(q, k, v, do, {**CFG, "SPLIT_LOOPS": 0}, **mods)
    for x, y in zip(split, one):
        assert ((x.double() - y.double()).norm() / y.double().norm()).item() < 2e-3


def test_a_window_that_is_causal_gives_the_causal_bits(device):
    """``window=(-1, 0)`` is causal through the window path (HAS_WINDOW, left unbounded):
    the same blocks, the same masks, the same bits as IS_CAUSAL's path."""
    q, k, v, do = make((1, 4, 2, 45, 37, 32), torch.float16, device, seed=3)
    out, lse, _ = reference(q, k, v, do, causal=True)
    for split in (0, 1):
        cfg = {**CFG, "SPLIT_LOOPS": split}
        a = attn_bwd(q, k, v, out.half(), lse.float(), do, cfg, causal=True)
        b = attn_bwd(q, k, v, out.half(), lse.float(), do, cfg, window=(-1, 0))
        for x, y in zip(a, b):
            assert torch.equal(x, y)


# -- softcap and ALiBi --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_softcap_matches_float64(device, causal, dtype):
    """Scores twice as large as usual, capped at 2: tanh is far from linear, so a missing
    ``1 - t^2`` in dS would show."""
    shape = (1, 4, 1, 45, 37, 32) if causal else (1, 4, 2, 37, 45, 32)
    q, k, v, do = make(shape, dtype, device, seed=11, q_scale=2.0)
    check(q, k, v, do, {**CFG_32, "SPLIT_LOOPS": int(causal)}, softcap=2.0, causal=causal)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("per_batch", [False, True], ids=["slopes-h", "slopes-bh"])
def test_alibi_matches_float64(device, per_batch, dtype):
    """Slopes ``(Hq,)`` on GQA without a mask, and ``(B, Hq)`` (a row each batch element)
    causal with Nq > Nk."""
    if per_batch:
        q, k, v, do = make((2, 4, 2, 45, 37, 32), dtype, device, seed=12)
        check(q, k, v, do, {**CFG_32, "SPLIT_LOOPS": 1}, alibi_slopes=slopes((2, 4), device),
              causal=True)
    else:
        q, k, v, do = make((1, 4, 2, 37, 45, 32), dtype, device, seed=13)
        check(q, k, v, do, CFG_32, alibi_slopes=slopes(4, device))


# -- everything at once, with every knob -----------------------------------------------------------

ALL_MODS = dict(window=(10, -1), causal=True, softcap=3.0)
KNOBS = [{"SPLIT_LOOPS": 0}, {"SPLIT_LOOPS": 1}, {"KV_SPLITS": 2},
         {"ONE_LAUNCH": 1, "KV_SPLITS": 2, "SPLIT_LOOPS": 1, "REVERSE_DQ": 1}]


@pytest.mark.parametrize("knobs", KNOBS, ids=["one-loop", "split", "kv-splits2",
                                              "one-launch-kv-splits2-split"])
def test_all_modifications_with_every_knob(device, knobs):
    """Window (left 10) with causal, softcap and per-batch ALiBi on GQA 4:2 with Nq > Nk;
    KV_SPLITS 2 sums the group's two heads in two programs; ONE_LAUNCH and REVERSE_DQ
    reorder programs only (the bits of the separate launches)."""
    q, k, v, do = make((2, 4, 2, 45, 37, 32), torch.float16, device, seed=21)
    mods = dict(ALL_MODS, alibi_slopes=slopes((2, 4), device))
    cfg = {**CFG, **knobs}
    got = check(q, k, v, do, cfg, **mods)
    if knobs.get("ONE_LAUNCH"):
        out, lse, _ = reference(q, k, v, do, **mods)
        base = {n: x for n, x in cfg.items() if n not in ("ONE_LAUNCH", "REVERSE_DQ")}
        for x, y in zip(got, attn_bwd(q, k, v, out.half(), lse.float(), do, base, **mods)):
            assert torch.equal(x, y)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_lse_gradient_with_all_modifications(device, dtype):
    """dLSE enters through delta whatever modifies the scores; MQA 4:1, ALiBi per head."""
    q, k, v, do = make((1, 4, 1, 37, 45, 32), dtype, device, seed=31)
    dlse = torch.randn(1, 4, 37, generator=torch.Generator().manual_seed(2)).to(device)
    check(q, k, v, do, {**CFG_32, "SPLIT_LOOPS": 1}, dlse=dlse,
          alibi_slopes=slopes(4, device), **ALL_MODS)


# -- only the blocks the window reaches -----------------------------------------------------------


@pytest.mark.parametrize("split", [0, 1], ids=["one-loop", "split"])
def test_walks_visit_only_blocks_with_a_visible_entry(device, split, monkeypatch):
    """A sliding window costs O(N * W): the dQ program of a query tile walks exactly the key
    blocks one of its rows sees, the dK/dV program of a key tile exactly the query blocks
    one of whose rows sees it (counted through the kernels' ``_dot``, 3 a block in the dQ
    kernel and 4 in the dK/dV kernel; interpreter only)."""
    if device != "cpu":
        pytest.skip("counts the interpreter's calls")
    import flashtune.kernel_templates.attn_bwd.kernel as kernel_module

    dots = [0]
    real_dot = kernel_module._dot

    def counting_dot(*args, **kwargs):
        dots[0] += 1
        return real_dot(*args, **kwargs)
    monkeypatch.setattr(kernel_module, "_dot", counting_dot)
    nq, nk, d, bm, bn = 48, 80, 16, 16, 16
    q, k, v, do = make((1, 1, 1, nq, nk, d), torch.float16, device)
    lse = torch.zeros(1, 1, nq, device=device)
    cfg = {**CFG, "SPLIT_LOOPS": split}
    for window, causal in (((6, 2), False), ((10, -1), True), ((-1, -1), False)):
        launches = kernel_args(q, k, v, q, lse, do, torch.zeros_like(lse), torch.empty_like(q),
                               torch.empty_like(k), torch.empty_like(v), cfg, causal=causal,
                               scale=0.25, upcast_dot=False, window=window)
        seen = visible(nq, nk, causal=causal, window=window).reshape(nq // bm, bm, nk // bn, bn)
        blocks = int(seen.any(dim=3).any(dim=1).sum())
        for name, per_block in (("dq", 3), ("dkdv", 4)):
            kern, args, kwargs, grid = launches[name]
            dots[0] = 0
            kern[grid](*args, **kwargs)
            assert dots[0] == per_block * blocks, (window, causal, name, dots[0], blocks)
        if window == (6, 2):  # key positions 32..79 with 8 keys each: 8 of the 15 blocks
            assert blocks == 8


# -- packed variable-length sequences ------------------------------------------------------------

# (Nq_b, Nk_b) per sequence: Nq < Nk, one query against 12 keys, Nq > Nk
SEQS = [(23, 37), (1, 12), (40, 17)]


def make_packed(seqs, hq, hkv, d, dtype, device, seed=0, pad=0):
    """Packed ``q, k, v, do`` ``(total, H, D)`` and int32 ``cu_seqlens_q/k``; ``pad`` > 0
    stores each token's heads ``d + pad`` apart (strided views, last dim contiguous)."""
    g = torch.Generator().manual_seed(seed)
    tq, tk = sum(s[0] for s in seqs), sum(s[1] for s in seqs)

    def rand(n, h):
        return (torch.randn(n, h, d + pad, generator=g).to(dtype).to(device))[..., :d]
    cu = [torch.tensor([0] + [sum(s[i] for s in seqs[:b + 1]) for b in range(len(seqs))],
                       dtype=torch.int32, device=device) for i in (0, 1)]
    return rand(tq, hq), rand(tk, hkv), rand(tk, hkv), rand(tq, hq), cu[0], cu[1]


def packed_reference(q, k, v, do, cu_q, cu_k, dlse=None, alibi_slopes=None, **mods):
    """The reference sequence by sequence (``(1, H, N, D)`` slices), packed again: out,
    LSE ``(Hq, total_q)`` and ``(exact, low)`` gradients of the whole packed tensors."""
    outs, lses, grads = [], [], [[[], [], []], [[], [], []]]
    for b in range(len(cu_q) - 1):
        sq, sk = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        seq = [t[s].transpose(0, 1)[None] for t, s in ((q, sq), (k, sk), (v, sk), (do, sq))]
        sl = None
        if alibi_slopes is not None:
            sl = alibi_slopes if alibi_slopes.dim() == 1 else alibi_slopes[b]
        dl = None if dlse is None else dlse[:, sq][None]
        out, lse, refs = reference(*seq, dl, alibi_slopes=sl, **mods)
        outs.append(out[0].transpose(0, 1))
        lses.append(lse[0])
        for which in (0, 1):
            for i in range(3):
                grads[which][i].append(refs[which][i][0].transpose(0, 1))
    refs = tuple(tuple(torch.cat(g) for g in gs) for gs in grads)
    return torch.cat(outs), torch.cat(lses, dim=1), refs


def check_packed(q, k, v, do, cu_q, cu_k, cfg, dlse=None, **mods):
    out, lse, refs = packed_reference(q, k, v, do, cu_q, cu_k, dlse, **mods)
    mq, mk = (int((cu[1:] - cu[:-1]).max()) for cu in (cu_q, cu_k))
    got = attn_bwd(q, k, v, out.to(q.dtype), lse.float(), do, cfg, dlse=dlse,
                   cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=mq, max_seqlen_k=mk,
                   **mods)
    assert_grads_close(got, q, k, v, do, causal=False, refs=refs)
    # and sequence by sequence, against the largest gradient of the whole tensor
    exact = refs[0]
    for b in range(len(cu_q) - 1):
        sq, sk = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        for g, r, s in zip(got, exact, (sq, sk, sk)):
            err = (g[s].double() - r[s]).abs().max().item()
            assert err <= 2e-2 * max(1.0, r.abs().max().item()), (b, err)
    return got


PACKED_MODS = [
    ("plain", {}),
    ("causal", dict(causal=True)),
    ("window-softcap", dict(window=(6, 3), softcap=2.5)),
    ("all", dict(window=(8, -1), causal=True, softcap=3.0)),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", PACKED_MODS, ids=[m[0] for m in PACKED_MODS])
def test_varlen_matches_float64_per_sequence(device, case, dtype):
    """Three sequences (Nq < Nk, one query, Nq > Nk) of GQA 4:2 packed in strided views;
    each one aligned, windowed and ALiBi'd by its own lengths ((B, Hq) slopes in 'all')."""
    name, mods = case
    q, k, v, do, cu_q, cu_k = make_packed(SEQS, 4, 2, 32, dtype, device, seed=len(name), pad=8)
    if name == "all":
        mods = dict(mods, alibi_slopes=slopes((3, 4), device))
    check_packed(q, k, v, do, cu_q, cu_k, {**CFG, "SPLIT_LOOPS": int(name != "plain")}, **mods)


@pytest.mark.parametrize("knobs", [{"KV_SPLITS": 2, "SPLIT_LOOPS": 1},
                                   {"ONE_LAUNCH": 1, "KV_SPLITS": 2, "REVERSE_DQ": 1}],
                         ids=["kv-splits2", "one-launch"])
def test_varlen_with_kv_splits_one_launch_and_lse_gradient(device, knobs):
    """KV_SPLITS' partial sums laid out over the packed keys, the fused launch's dQ programs
    past their sequence returning at once, dLSE ``(Hq, total_q)`` (a strided view), a
    key sequence of length 1 and ALiBi per head."""
    seqs = [(17, 1), (30, 41), (9, 26)]
    q, k, v, do, cu_q, cu_k = make_packed(seqs, 4, 2, 32, torch.float16, device, seed=7)
    total_q = q.shape[0]
    dlse = torch.randn(total_q, 4, generator=torch.Generator().manual_seed(3)).to(device).t()
    check_packed(q, k, v, do, cu_q, cu_k, {**CFG, **knobs}, dlse=dlse, causal=True,
                 window=(12, -1), softcap=2.0, alibi_slopes=slopes(4, device))


def test_varlen_launch_arguments(device):
    """The packed launches: grids over the longest sequence and every batch element, no
    TMA whatever the config asks, the flags on; without the new keywords, every flag off
    (the plain kernels, which the precompiler warms); every parameter given once."""
    q, k, v, do, cu_q, cu_k = make_packed(SEQS, 4, 2, 32, torch.float16, device)
    lse = torch.zeros(4, q.shape[0], device=device)
    parts = torch.empty(2 * 2, k.shape[0], 32, device=device)
    cfg = {**CFG_32, "USE_TMA": 1, "KV_SPLITS": 2}
    launches = kernel_args(q, k, v, q, lse, do, lse, q, k, v, cfg, causal=True, scale=0.2,
                           upcast_dot=False, part_k=parts, part_v=parts, softcap=1.0,
                           cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=40,
                           max_seqlen_k=37)
    assert list(launches) == ["preprocess", "dkdv", "kv_reduce", "dq"]
    assert launches["preprocess"][3] == (1, 4)  # cdiv(64 tokens, 64), Hq (one batch element)
    assert launches["dkdv"][3] == (2, 3 * 2 * 2)  # cdiv(37, 32), B * Hkv * KV_SPLITS
    assert launches["kv_reduce"][3] == (2, 2)  # cdiv(66 keys, 64), Hkv
    assert launches["dq"][3] == (2, 3 * 4)  # cdiv(40, 32), B * Hq
    for name in ("dkdv", "dq"):
        kw = launches[name][2]
        assert kw["VARLEN"] and kw["HAS_SOFTCAP"] and not kw["USE_TMA"]
        assert not kw["HAS_WINDOW"] and not kw["HAS_ALIBI"] and kw["IS_CAUSAL"]
    q4, k4, v4, do4 = make((1, 4, 2, 20, 24, 32), torch.float16, device)
    lse4 = torch.zeros(1, 4, 20, device=device)
    plain = kernel_args(q4, k4, v4, q4, lse4, do4, lse4, q4, k4, v4, CFG_32, causal=True,
                        scale=0.2, upcast_dot=False)
    for is_plain, (kern, args, kwargs, _) in [(False, x) for x in launches.values()] + [
            (True, x) for x in plain.values()]:
        names = list(kern.arg_names)
        assert names[len(args):] == [n for n in kwargs if n not in ("num_warps", "num_stages")]
        if is_plain and "VARLEN" in kwargs:
            assert not any(kwargs[f] for f in ("HAS_WINDOW", "HAS_SOFTCAP", "HAS_ALIBI",
                                               "VARLEN"))
            assert args[names.index("WINDOW_LEFT")] == args[names.index("WINDOW_RIGHT")] == -1
