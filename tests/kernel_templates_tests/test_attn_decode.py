"""attn_decode numerics (dense, ragged and paged caches) against the float64 reference, and
its space, predicate and defaults. Small shapes: these run under the interpreter."""

from __future__ import annotations

import pytest
import torch

from flashtune.core.device import DeviceFingerprint
from flashtune.core.problem import AttentionProblem
from flashtune.kernel_templates import get_template
from flashtune.kernel_templates.attn_decode import (
    attn_decode,
    attn_decode_full,
    attn_decode_kvcache,
)
from flashtune.kernel_templates.attn_decode import full as full_mod
from flashtune.kernel_templates.attn_decode.space import block_m, default_splits
from tests.conftest import DEVICE
from tests.decode_helpers import assert_decode_close, make_cache

SPEC = get_template("attn_decode")
H100 = DeviceFingerprint("NVIDIA_H100_80GB_HBM3", "9.0", 132, 232448, 85 << 30)


def cfg(bn=16, splits=3, warps=4, stages=2):
    return {"BLOCK_N": bn, "NUM_SPLITS": splits, "num_warps": warps, "num_stages": stages}


def dense(b, hq, hkv, nq, nk, d, dtype=torch.float16, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda h, n: torch.randn(b, h, n, d, generator=g).to(dtype).to(DEVICE)  # noqa: E731
    return mk(hq, nq), mk(hkv, nk), mk(hkv, nk)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", [(2, 8, 1, 1, 133, 64), (1, 4, 2, 4, 77, 128),
                                   (1, 2, 2, 5, 3, 64)],  # Nq > Nk: dead causal rows
                         ids=lambda s: "b{}h{}:{}q{}k{}d{}".format(*s))
def test_dense_matches_reference(shape, causal):
    q, k, v = dense(*shape)
    out, lse = attn_decode(q, k, v, cfg(), causal=causal, return_lse=True)
    assert_decode_close(out, q, k, v, causal=causal, lse=lse)


# ragged lengths: 1, odd, exactly a multiple of BLOCK_N, the full capacity
LENS = [1, 77, 64, 133]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads,nq", [((8, 1), 1), ((4, 2), 4)], ids=["gqa8:1-q1", "gqa4:2-q4"])
def test_contiguous_cache_ragged_lengths(heads, nq, causal):
    q, k, v, lens, _ = make_cache(LENS, *heads, nq, 64, torch.float16, DEVICE, capacity=140)
    out, lse = attn_decode_kvcache(q, k, v, lens, cfg(splits=3), causal=causal,
                                   return_lse=True)
    assert_decode_close(out, q, k, v, cache_seqlens=lens, causal=causal, lse=lse)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("page_size,bn", [(16, 16), (32, 16), (8, 16), (24, 16)],
                         ids=["p16-tile", "p32-tile", "p8-rows", "p24-rows"])
def test_paged_cache_shuffled_pages(page_size, bn, causal):
    """Lengths 1, exactly one and two pages, odd; pages a random permutation. page_size a
    multiple of BLOCK_N reads one page id per tile, otherwise one per key row."""
    lens = [1, page_size, 2 * page_size, 45]
    nq = 4 if causal else 1
    q, k, v, lens_t, table = make_cache(lens, 4, 2, nq, 64, torch.float16, DEVICE,
                                        page_size=page_size, capacity=100, seed=page_size)
    out, lse = attn_decode_kvcache(q, k, v, lens_t, cfg(bn=bn, splits=3), block_table=table,
                                   causal=causal, return_lse=True)
    assert_decode_close(out, q, k, v, cache_seqlens=lens_t, block_table=table, causal=causal,
                        lse=lse)


def test_split_counts_agree():
    q, k, v, lens, table = make_cache([5, 130, 96], 8, 1, 4, 64, torch.float16, DEVICE,
                                      page_size=16, capacity=130, seed=3)
    outs = []
    for splits in (1, 3, 8):
        out, lse = attn_decode_kvcache(q, k, v, lens, cfg(splits=splits), block_table=table,
                                       causal=True, return_lse=True)
        assert_decode_close(out, q, k, v, cache_seqlens=lens, block_table=table, causal=True,
                            lse=lse)
        outs.append((out.float(), lse))
    for out, lse in outs[1:]:
        # splits only reorder fp32 sums: a few ulps of fp16 apart at most
        assert (out - outs[0][0]).abs().max().item() < 4e-3
        finite = torch.isfinite(lse)
        assert torch.equal(finite, torch.isfinite(outs[0][1]))
        assert (lse[finite] - outs[0][1][finite]).abs().max().item() < 1e-4


def test_empty_sequences_and_dead_rows_are_zero_not_nan():
    """Length 0, and causal rows with i + L - Nq < 0, give zeros and LSE -inf."""
    q, k, v, lens, table = make_cache([0, 2, 40], 4, 2, 4, 64, torch.float16, DEVICE,
                                      page_size=16, capacity=48, seed=5)
    for splits in (1, 3):
        out, lse = attn_decode_kvcache(q, k, v, lens, cfg(splits=splits), block_table=table,
                                       causal=True, return_lse=True)
        assert torch.all(out[0] == 0) and torch.all(torch.isneginf(lse[0]))
        assert torch.all(out[1, :, :2] == 0) and torch.all(torch.isneginf(lse[1, :, :2]))
        assert torch.isfinite(lse[1, :, 2:]).all() and torch.isfinite(lse[2]).all()
        assert_decode_close(out, q, k, v, cache_seqlens=lens, block_table=table, causal=True,
                            lse=lse)


@pytest.mark.parametrize("d", [16, 96, 256])
def test_head_dims(d):
    q, k, v, lens, _ = make_cache([3, 50], 2, 1, 2, d, torch.float16, DEVICE, seed=d)
    out, lse = attn_decode_kvcache(q, k, v, lens, cfg(splits=2), causal=True, return_lse=True)
    assert_decode_close(out, q, k, v, cache_seqlens=lens, causal=True, lse=lse)


def test_bf16_and_transposed_cache_views():
    """bf16 (fp32 dots under the interpreter) and (B, N, H, D) storage viewed as (B, H, N, D)."""
    g = torch.Generator().manual_seed(9)
    q = torch.randn(2, 1, 4, 64, generator=g).to(torch.bfloat16).to(DEVICE).transpose(1, 2)
    k = torch.randn(2, 70, 2, 64, generator=g).to(torch.bfloat16).to(DEVICE).transpose(1, 2)
    v = torch.randn(2, 70, 2, 64, generator=g).to(torch.bfloat16).to(DEVICE).transpose(1, 2)
    lens = torch.tensor([70, 33], dtype=torch.int32, device=DEVICE)
    assert not k.is_contiguous() and k.stride(-1) == 1
    out, lse = attn_decode_kvcache(q, k, v, lens, cfg(splits=2), causal=False, return_lse=True)
    assert_decode_close(out, q, k, v, cache_seqlens=lens, causal=False, lse=lse)


def test_custom_scale_and_preallocated_output():
    q, k, v = dense(1, 4, 1, 2, 90, 64, seed=11)
    poison = torch.full_like(q, float("nan"))
    out = attn_decode(q, k, v, cfg(splits=4), scale=-0.3, out=poison)
    assert out is poison and not torch.isnan(poison).any()
    assert_decode_close(out, q, k, v, causal=False, scale=-0.3)
    assert not torch.allclose(out, attn_decode(q, k, v, cfg(splits=4)))


def test_the_tolerance_check_can_fail():
    """A kernel reading the wrong pages must not pass: hand the reference another table."""
    q, k, v, lens, table = make_cache([40, 33], 4, 2, 1, 64, torch.float16, DEVICE,
                                      page_size=16, capacity=48, seed=13)
    out = attn_decode_kvcache(q, k, v, lens, cfg(), block_table=table)
    swapped = table.flip(0).contiguous()
    with pytest.raises(AssertionError, match="kernel max error"):
        assert_decode_close(out, q, k, v, cache_seqlens=lens, block_table=swapped, causal=True)


# -- dense K/V through the cache variant (full.py) ----------------------------------------------


@pytest.mark.parametrize("mods", [{}, {"window": (40, -1), "softcap": 20.0}],
                         ids=["plain", "window_softcap"])
def test_the_templates_launcher_is_the_cache_variant_with_full_lengths(mods):
    """What the tuner times and the router runs for dense K/V: the same results as the dense
    variant (bit for bit: the same walk over the same keys) and the reference, through the
    kernel the KV-cache path runs."""
    q, k, v = dense(2, 8, 2, 3, 133, 64)
    got, lse = attn_decode_full(q, k, v, cfg(), causal=True, return_lse=True, **mods)
    want, want_lse = attn_decode(q, k, v, cfg(), causal=True, return_lse=True, **mods)
    assert torch.equal(got, want) and torch.equal(lse, want_lse)
    assert_decode_close(got, q, k, v, causal=True, lse=lse, **mods)


def test_full_lengths_are_made_once_per_shape_and_device():
    full_mod._FULL.clear()
    a = full_mod.full_lengths(3, 77, torch.device("cpu"))
    assert a.dtype == torch.int32 and a.tolist() == [77, 77, 77]
    assert full_mod.full_lengths(3, 77, torch.device("cpu")) is a
    assert full_mod.full_lengths(3, 78, torch.device("cpu")) is not a
    for n in range(full_mod.MEMO_LIMIT):  # a server meeting new lengths for months: bounded
        full_mod.full_lengths(1, n + 1000, torch.device("cpu"))
    assert len(full_mod._FULL) <= full_mod.MEMO_LIMIT


def test_the_precompiler_warms_the_kernels_the_launcher_runs(monkeypatch):
    """warmup_launches (the precompile pool's) builds, from shapes alone, the split and
    combine launches the template's launcher makes: the same constants, the cache variant
    (``HAS_SEQLENS``) included, so a precompiled candidate is a cache hit when timed."""
    from flashtune.kernel_templates.attn_decode import launcher as launcher_mod

    made = []
    real = launcher_mod.kernel_args

    def spy(*args, **kwargs):
        made.append(real(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(launcher_mod, "kernel_args", spy)
    p = AttentionProblem(2, 8, 2, 1, 133, 64, True, "fp16", window_left=40, softcap=20.0)
    q, k, v = dense(2, 8, 2, 1, 133, 64)
    SPEC.launcher(q, k, v, cfg(), causal=True, window=(40, -1), softcap=20.0)
    [launched] = made
    warm = SPEC.warmup_launches(p, cfg())
    assert [kern for kern, *_ in warm] == [kern for kern, *_ in launched]
    for (_, w_args, w_kw, w_grid), (_, l_args, l_kw, l_grid) in zip(warm, launched):
        assert w_kw == l_kw and w_grid == l_grid and len(w_args) == len(l_args)
    assert warm[0][2]["HAS_SEQLENS"] is True


# -- space, predicate, defaults ---------------------------------------------------------------


def prob(b=1, hq=32, hkv=8, nq=1, nk=131072, d=128):
    return AttentionProblem(b, hq, hkv, nq, nk, d, True, "bf16")


def test_registered_with_a_space_of_data():
    assert SPEC.name == "attn_decode" and SPEC.launcher is attn_decode_full
    assert set(SPEC.space.params) == {"BLOCK_N", "NUM_SPLITS", "num_warps", "num_stages",
                                      "SPLIT_D"}
    assert SPEC.space.defaults == {"SPLIT_D": 0}  # configs tuned before it run as they did
    assert 3 in SPEC.space.params["NUM_SPLITS"] and 1 in SPEC.space.params["NUM_SPLITS"]
    assert len(SPEC.source_hash) == 16


@pytest.mark.parametrize("b,nk,splits", [(1, 131072, 16), (4, 16384, 4), (16, 4096, 1),
                                         (64, 65536, 1), (1, 1024, 4), (1, 100, 1)])
def test_default_splits_give_an_h100_one_program_per_sm(b, nk, splits):
    p = prob(b=b, nk=nk)
    c = SPEC.default_config(p, H100)
    assert c == {"BLOCK_N": 128, "NUM_SPLITS": splits, "num_warps": 4, "num_stages": 2}
    assert SPEC.space.check(c, p, H100) is None
    assert default_splits(p, 132, 128) == splits
    wide = SPEC.default_config(prob(b=b, nk=nk, d=256), H100)
    assert wide["BLOCK_N"] == 64 and SPEC.space.check(wide, prob(b=b, nk=nk, d=256), H100) is None


def test_predicate_rejects_spilling_tiles_and_idle_splits():
    p = prob(nk=200)
    assert "idle" in SPEC.space.check(cfg(bn=64, splits=8, warps=4), p, H100)
    assert SPEC.space.check(cfg(bn=64, splits=4, warps=4), p, H100) is None
    assert "would spill" in SPEC.space.check(cfg(bn=128, splits=1, warps=1), prob(d=256), H100)
    # MQA with 16 queries: 128 rows a program (the cap), more rows take more programs
    big = AttentionProblem(1, 32, 1, 16, 4096, 256, True, "fp16")
    assert block_m(32, 16) == 128
    assert "accumulators" in SPEC.space.check(cfg(bn=16, splits=1, warps=2), big, H100)
    c = SPEC.default_config(big, H100)
    assert SPEC.space.check(c, big, H100) is None


def test_more_rows_than_one_program_holds():
    """GQA 32:1 with Nq 5 is 160 rows: two row blocks of 128."""
    q, k, v, lens, _ = make_cache([9, 30], 32, 1, 5, 16, torch.float16, DEVICE, seed=17)
    out, lse = attn_decode_kvcache(q, k, v, lens, cfg(splits=2), causal=True, return_lse=True)
    assert_decode_close(out, q, k, v, cache_seqlens=lens, causal=True, lse=lse)
