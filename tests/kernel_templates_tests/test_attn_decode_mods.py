"""attn_decode with FlashAttention-2's score modifications (window, softcap, ALiBi) against
the float64 reference, per sequence of a ragged, contiguous or paged cache; the window's
key range (splits start at its first key); the combine of splits a row sees nothing of;
and that the flags compile for sm_90. Small shapes: these run under the interpreter."""

from __future__ import annotations

import pytest
import torch

from flashtune.core.device import DeviceFingerprint
from flashtune.core.problem import AttentionProblem
from flashtune.kernel_templates import get_template
from flashtune.kernel_templates.attn_decode import attn_decode, attn_decode_kvcache
from flashtune.kernel_templates.attn_decode.space import default_splits, keys_seen
from tests.conftest import DEVICE
from tests.decode_helpers import (
    NO_CACHE_OPTIONS,
    assert_decode_close,
    compile_split_kernel_sm90,
    make_cache,
)

SPEC = get_template("attn_decode")
H100 = DeviceFingerprint("NVIDIA_H100_80GB_HBM3", "9.0", 132, 232448, 85 << 30)
# lengths: 1 (queries before the cache's start), odd, a multiple of BLOCK_N, the capacity
LENS = [1, 77, 64, 133]


def cfg(bn=16, splits=3):
    return {"BLOCK_N": bn, "NUM_SPLITS": splits, "num_warps": 4, "num_stages": 1}


def slopes(*shape):
    g = torch.Generator().manual_seed(7)
    return (torch.rand(*shape, generator=g) * 0.3).to(DEVICE)


def run_and_check(q, k, v, lens, table, config, *, causal, **mods):
    out, lse = attn_decode_kvcache(q, k, v, lens, config, block_table=table, causal=causal,
                                   return_lse=True, **mods)
    assert_decode_close(out, q, k, v, cache_seqlens=lens, block_table=table, causal=causal,
                        lse=lse, **mods)
    return out, lse


# (id, window, causal): narrower than one BLOCK_N block, wider than several splits, one
# side unbounded, a window on a non-causal call (right bound < Nq - 1 cuts early rows)
WINDOWS = [
    ("narrow-causal", (4, 0), True),
    ("wide", (70, 5), False),
    ("left-only", (20, -1), False),
    ("right-only", (-1, 1), False),
    ("zero", (0, 0), False),
]


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("name,window,causal", WINDOWS, ids=[w[0] for w in WINDOWS])
def test_window_per_sequence(name, window, causal, paged):
    """GQA 4:2 with 3 queries (paged: page 24, one page id per key row) and MQA 4:1 with one
    query (contiguous)."""
    heads, nq = ((4, 2), 3) if paged else ((4, 1), 1)
    q, k, v, lens, table = make_cache(LENS, *heads, nq, 32, torch.float16, DEVICE,
                                      page_size=24 if paged else None, capacity=140, seed=1)
    run_and_check(q, k, v, lens, table, cfg(), causal=causal, window=window)


@pytest.mark.parametrize("nq", [1, 3])
def test_softcap_alone_and_with_window_and_alibi(nq):
    q, k, v, lens, table = make_cache(LENS, 4, 2, nq, 32, torch.float16, DEVICE,
                                      page_size=16, capacity=140, seed=2)
    q = q * 4  # large scores, so the cap bites
    run_and_check(q, k, v, lens, table, cfg(), causal=False, softcap=1.5)
    run_and_check(q, k, v, lens, table, cfg(), causal=True, softcap=2.0, window=(30, 0),
                  alibi_slopes=slopes(4, 4))


@pytest.mark.parametrize("shape", ["h", "bh"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_alibi_slopes_per_head_and_per_sequence(shape, causal):
    q, k, v, lens, _ = make_cache(LENS, 8, 1, 3, 32, torch.float16, DEVICE, capacity=140,
                                  seed=3)
    sl = slopes(8) if shape == "h" else slopes(4, 8)
    run_and_check(q, k, v, lens, None, cfg(), causal=causal, alibi_slopes=sl)


def test_keys_before_the_window_are_never_read():
    """The splits start at the block of the window's first key: values before it are NaN
    and the output stays finite (a split walking them would turn ``0 * NaN`` into NaN)."""
    lens = [133, 100, 37]
    q, k, v, lens_t, table = make_cache(lens, 4, 2, 2, 32, torch.float16, DEVICE,
                                        page_size=16, capacity=140, seed=4)
    left, nq, bn = 20, 2, 16
    k_bad, v_bad = k.clone(), v.clone()
    for b, n in enumerate(lens):
        first = max(n - nq - left, 0) // bn * bn
        for j in range(first):
            page, slot = int(table[b, j // 16]), j % 16
            k_bad[page, :, slot] = float("nan")
            v_bad[page, :, slot] = float("nan")
    for splits in (1, 3):
        out, lse = attn_decode_kvcache(q, k_bad, v_bad, lens_t, cfg(bn=bn, splits=splits),
                                       block_table=table, causal=True, return_lse=True,
                                       window=(left, 0))
        assert_decode_close(out, q, k, v, cache_seqlens=lens_t, block_table=table,
                            causal=True, lse=lse, window=(left, 0))


def test_splits_a_row_sees_nothing_of_combine_as_empty():
    """Window (0, 0), 3 queries: each row sees one key. With L = 34 the first row's key
    (31) ends block 1 and the others' (32, 33) start block 2, so with one block a split
    every row misses one of the two non-empty splits (LSE -inf there), and the third split
    is empty. Length 1: the first two rows see no key at all (zeros, LSE -inf)."""
    q, k, v, lens, _ = make_cache([34, 1], 2, 1, 3, 32, torch.float16, DEVICE, seed=5)
    outs = []
    for splits in (1, 2, 3):
        out, lse = run_and_check(q, k, v, lens, None, cfg(splits=splits), causal=False,
                                 window=(0, 0))
        assert torch.all(out[1, :, :2] == 0) and torch.all(torch.isneginf(lse[1, :, :2]))
        assert torch.isfinite(lse[0]).all() and torch.isfinite(lse[1, :, 2]).all()
        outs.append((out.float(), lse))
    for out, lse in outs[1:]:
        assert (out - outs[0][0]).abs().max().item() < 4e-3
        finite = torch.isfinite(lse)
        assert (lse[finite] - outs[0][1][finite]).abs().max().item() < 1e-4


def test_split_counts_agree_under_a_window():
    q, k, v, lens, table = make_cache([5, 130, 96], 4, 1, 3, 32, torch.float16, DEVICE,
                                      page_size=32, capacity=130, seed=6)
    outs = [run_and_check(q, k, v, lens, table, cfg(splits=s), causal=True, window=(50, 0),
                          softcap=3.0)[0].float() for s in (1, 4)]
    assert (outs[1] - outs[0]).abs().max().item() < 4e-3


def test_dense_kv_and_bf16():
    """attn_decode (dense K/V, the route flashtune.attention takes) with every modification,
    and bf16 under the interpreter (fp32 dots)."""
    g = torch.Generator().manual_seed(8)
    q = torch.randn(2, 4, 3, 32, generator=g).to(torch.bfloat16).to(DEVICE)
    k = torch.randn(2, 2, 90, 32, generator=g).to(torch.bfloat16).to(DEVICE)
    v = torch.randn(2, 2, 90, 32, generator=g).to(torch.bfloat16).to(DEVICE)
    mods = dict(window=(25, 1), softcap=2.5, alibi_slopes=slopes(2, 4))
    out, lse = attn_decode(q, k, v, cfg(splits=2), return_lse=True, **mods)
    assert_decode_close(out, q, k, v, causal=False, lse=lse, **mods)
    plain = attn_decode(q, k, v, cfg(splits=2))
    assert not torch.allclose(out, plain)


def test_window_sizes_the_default_splits_and_the_idle_check():
    """Under a window the splits cut only its keys: the default split count and the idle
    check count those, not the cache's capacity."""
    p = AttentionProblem(1, 32, 8, 1, 131072, 128, True, "bf16")
    w = AttentionProblem(1, 32, 8, 1, 131072, 128, True, "bf16", 255)
    assert keys_seen(p) == 131072 and keys_seen(w) == 256
    assert default_splits(p, 132, 128) == 16 and default_splits(w, 132, 128) == 1
    assert SPEC.default_config(w, H100)["NUM_SPLITS"] == 1
    assert "the window's 256 keys" in SPEC.space.check(cfg(bn=128, splits=4), w, H100)
    assert SPEC.space.check(cfg(bn=128, splits=4), p, H100) is None
    assert SPEC.limits.refuse(AttentionProblem(1, 4, 1, 3, 100, 32, False, "fp16", 5, 5,
                                               2.0, True), H100) is None


def test_the_flags_compile_for_sm90():
    """The interpreter is lenient about types; compile the modified kernel for the H100 on
    the CPU (a subprocess: this process has the kernels wrapped by the interpreter)."""
    off = NO_CACHE_OPTIONS + ["NUM_PAGES"]
    compile_split_kernel_sm90([
        {"const": dict(IS_CAUSAL=True, HAS_WINDOW=True, HAS_SOFTCAP=True, HAS_ALIBI=True),
         "none": off},
        {"const": dict(IS_CAUSAL=False, HAS_WINDOW=True), "none": off + ["Alibi"]},
    ])
