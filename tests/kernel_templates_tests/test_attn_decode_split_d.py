"""attn_decode's ``SPLIT_D`` knob: a head dim that is not a power of two read as two tiles
(96 = 64 + 32), against the float64 reference under the interpreter (dense, ragged, paged,
score modifications, appended keys with rotary pairs that straddle the tiles), its place in
the space, and what it compiles to for sm_90 (fewer loads and dots than one padded tile)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from flashtune.core.device import DeviceFingerprint
from flashtune.core.problem import AttentionProblem
from flashtune.kernel_templates import get_template
from flashtune.kernel_templates.attn_decode import attn_decode, attn_decode_kvcache
from flashtune.kernel_templates.attn_decode.space import (
    block_d,
    d_tiles,
    default_config,
    shared_mem_bytes,
)
from flashtune.kernel_templates.head_tiles import saves_padding
from flashtune.kernel_templates.knob_scope import split_d_scope
from tests.conftest import DEVICE
from tests.decode_helpers import (
    NO_CACHE_OPTIONS,
    append_case,
    assert_decode_close,
    assert_kvcache_close,
    compile_split_kernel_sm90,
    make_cache,
)

SPEC = get_template("attn_decode")
H100 = DeviceFingerprint("NVIDIA_H100_80GB_HBM3", "9.0", 132, 232448, 85 << 30)
LENS = [1, 77, 64, 133]


def cfg(bn=16, splits=3, warps=4, stages=1, split_d=1):
    return {"BLOCK_N": bn, "NUM_SPLITS": splits, "num_warps": warps, "num_stages": stages,
            "SPLIT_D": split_d}


@pytest.mark.parametrize("d,tiles", [(96, (64, 32)), (80, (64, 16)), (72, (64, 16)),
                                     (192, (128, 64)), (160, (128, 32)), (40, (32, 16)),
                                     (128, (128, 0)), (64, (64, 0)), (16, (16, 0)),
                                     (24, (16, 16))])
def test_tiles(d, tiles):
    assert d_tiles(d, 1) == tiles
    assert d_tiles(d, 0) == (block_d(d), 0)


@pytest.mark.parametrize("d,saves", [(96, True), (80, True), (72, True), (40, True),
                                     (160, True), (192, True), (112, False), (24, False),
                                     (128, False), (64, False), (16, False), (8, False)])
def test_two_tiles_save_padding_where_they_cover_fewer_columns(d, saves):
    assert saves_padding(d) is saves
    assert saves == (sum(d_tiles(d, 1)) < block_d(d))


def test_every_template_allows_two_tiles_exactly_where_they_save_padding():
    # the three templates' predicates and the search's narrowing share one rule: with one
    # tile of ``whole`` columns, the split is whole / 2 plus the rest padded to a power of
    # two of at least 16, which is narrower only for whole / 2 < d <= 3 / 4 whole, whole >= 64
    specs = [get_template(name) for name in ("attn_fwd", "attn_bwd", "attn_decode")]
    for d in range(1, 257):
        whole = max(16, 1 << (d - 1).bit_length())
        assert saves_padding(d) is (whole >= 64 and whole // 2 < d <= 3 * whole // 4), d
        p = AttentionProblem(1, 8, 8, 1, 512, d, False, "bf16")
        assert (split_d_scope(p) == {}) is saves_padding(d), d
        for spec in specs:
            reason = spec.space.check(dict(spec.default_config(p, H100), SPLIT_D=1), p, H100)
            cuts = reason is not None and "SPLIT_D 1 cuts" in reason
            assert cuts is not saves_padding(d), (spec.name, d, reason)


def test_the_space_takes_it_only_where_it_cuts_padding():
    old = {"BLOCK_N": 64, "NUM_SPLITS": 4, "num_warps": 4, "num_stages": 2}
    assert SPEC.space.validate(old)["SPLIT_D"] == 0  # configs tuned before the knob
    d96 = AttentionProblem(1, 32, 32, 1, 4096, 96, True, "bf16")
    assert SPEC.space.check(dict(old, SPLIT_D=1), d96, H100) is None
    for d in (128, 64, 24):  # one tile either way: nothing to split
        p = AttentionProblem(1, 32, 8, 1, 4096, d, True, "bf16")
        reason = SPEC.space.check(dict(old, SPLIT_D=1), p, H100)
        assert reason is not None and "SPLIT_D" in reason and str(d) in reason
    # 96 dims in flight, not 128
    assert shared_mem_bytes(dict(old, SPLIT_D=1), 16, 96) * 4 == \
        shared_mem_bytes(old, 16, 96) * 3



@pytest.mark.parametrize("b,splits", [(1, 8), (2, 4), (4, 2), (8, 1), (64, 1)])
def test_the_default_below_128_dims_is_two_tiles_and_two_programs_an_sm(b, splits):
    """Phi-3's 32:32 D96: BLOCK_N 64, 3 stages, two tiles, splits for 2 x 132 programs."""
    p = AttentionProblem(b, 32, 32, 1, 4096, 96, True, "bf16")
    assert default_config(p, H100) == {"BLOCK_N": 64, "NUM_SPLITS": splits, "num_warps": 4,
                                       "num_stages": 3, "SPLIT_D": 1}


def test_the_default_elsewhere_is_as_before():
    for d, want in ((112, {"BLOCK_N": 64, "NUM_SPLITS": 8, "num_warps": 4, "num_stages": 3}),
                    (128, {"BLOCK_N": 128, "NUM_SPLITS": 4, "num_warps": 4, "num_stages": 2}),
                    (192, {"BLOCK_N": 64, "NUM_SPLITS": 4, "num_warps": 4, "num_stages": 2})):
        p = AttentionProblem(1, 32, 32, 1, 4096, d, True, "bf16")
        assert default_config(p, H100) == want, d  # 112 = 64 + 64 saves no padding


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [96, 80, 40])
def test_dense_matches_reference(d, causal):
    g = torch.Generator().manual_seed(d)
    q, k, v = (torch.randn(2, h, n, d, generator=g).half().to(DEVICE)
               for h, n in ((4, 3), (2, 77), (2, 77)))
    for splits in (1, 3):
        out, lse = attn_decode(q, k, v, cfg(splits=splits), causal=causal, return_lse=True)
        assert_decode_close(out, q, k, v, causal=causal, lse=lse)


@pytest.mark.parametrize("page_size", [None, 16, 24], ids=["contig", "p16-tile", "p24-rows"])
def test_ragged_and_paged_caches(page_size):
    q, k, v, lens, table = make_cache(LENS, 8, 2, 2, 96, torch.float16, DEVICE,
                                      page_size=page_size, capacity=140, seed=4)
    for splits in (1, 3):
        out, lse = attn_decode_kvcache(q, k, v, lens, cfg(splits=splits), block_table=table,
                                       causal=True, return_lse=True)
        assert_decode_close(out, q, k, v, cache_seqlens=lens, block_table=table, causal=True,
                            lse=lse)


def test_one_tile_and_two_agree_to_fp32_reordering():
    q, k, v, lens, _ = make_cache(LENS, 4, 4, 1, 96, torch.float16, DEVICE, capacity=140,
                                  seed=6)
    one = attn_decode_kvcache(q, k, v, lens, cfg(split_d=0), causal=True)
    two = attn_decode_kvcache(q, k, v, lens, cfg(split_d=1), causal=True)
    assert (one.float() - two.float()).abs().max().item() < 4e-3


def test_score_modifications_and_bf16():
    q, k, v, lens, table = make_cache(LENS, 4, 2, 3, 96, torch.bfloat16, DEVICE,
                                      page_size=16, capacity=140, seed=8)
    q = q * 4  # large scores, so the cap bites
    slopes = torch.linspace(0.05, 0.4, 4, dtype=torch.float32, device=DEVICE)
    out, lse = attn_decode_kvcache(q, k, v, lens, cfg(), block_table=table, causal=True,
                                   return_lse=True, softcap=2.0, window=(30, 0),
                                   alibi_slopes=slopes)
    assert_decode_close(out, q, k, v, cache_seqlens=lens, block_table=table, causal=True,
                        lse=lse, softcap=2.0, window=(30, 0), alibi_slopes=slopes)


@pytest.mark.parametrize("rotary_dim,interleaved,splits", [(96, False, 2), (64, True, 1),
                                                           (80, False, 3)])
def test_appended_keys_with_rotary_across_the_tiles(rotary_dim, interleaved, splits):
    """GPT-NeoX pairs (t, t + 48) of a 96-dim rotary join the 64-dim tile to the 32-dim one;
    the new keys are written into the cache as the reference rotates them."""
    args = append_case([7, 33, 0], 4, 2, 2, 3, 96, torch.float16, DEVICE, capacity=48,
                       page_size=16 if splits == 3 else None, rotary_dim=rotary_dim,
                       seed=rotary_dim)
    before = {n: args[n].clone() for n in ("k_cache", "v_cache")}
    extra = {n: t for n, t in args.items()
             if n not in ("q", "k_cache", "v_cache", "cache_seqlens")}
    out, lse = attn_decode_kvcache(args["q"], args["k_cache"], args["v_cache"],
                                   args["cache_seqlens"], cfg(splits=splits), **extra,
                                   causal=True, return_lse=True,
                                   rotary_interleaved=interleaved)
    assert_kvcache_close(out, args, before, lse=lse, causal=True,
                         rotary_interleaved=interleaved)


def test_two_tiles_with_the_options_compile_for_sm90():
    """The interpreter is lenient about types: append + rotary across the tiles + the new
    keys' own programs + every score modification, and a paged cache with left pads."""
    def off(*on):
        return [n for n in NO_CACHE_OPTIONS + ["NUM_PAGES", "Alibi"] if n not in on]

    new = ["KNew", "VNew", "stride_knb", "stride_knh", "stride_knn", "stride_vnb",
           "stride_vnh", "stride_vnn", "N_NEW"]
    compile_split_kernel_sm90([
        {"const": dict(HEAD_DIM=96, BLOCK_D=64, BLOCK_D1=32, HAS_NEW=True, ROT_DIM=96,
                       ROT_Q_PER_POS=True, NEW_ROWS=True, HAS_WINDOW=True, HAS_SOFTCAP=True,
                       HAS_ALIBI=True),
         "none": off(*new, "Cos", "Sin", "SEQLEN_RO", "BATCH_HEADS", "Alibi")},
        {"const": dict(HEAD_DIM=80, BLOCK_D=64, BLOCK_D1=16, PAGED=True, NUM_SPLITS=1,
                       HAS_LEFTPAD=True),
         "none": off("LeftPad", "NUM_PAGES")},
    ])


_CENSUS = r"""
import json, sys
from flashtune.core.problem import AttentionProblem
from flashtune.kernel_templates.sm90 import compile_launches
p = AttentionProblem(4, 32, 32, 1, 4096, 96, True, "bf16")
base = {"BLOCK_N": 128, "NUM_SPLITS": 1, "num_warps": 4, "num_stages": 2}
out = {}
for split in (0, 1):
    (launch,) = compile_launches("attn_decode", p, dict(base, SPLIT_D=split), loops=True)
    out[split] = {"registers": launch["registers"], "shared": launch["shared"],
                  "loops": [lp["opcodes"] for lp in launch["loops"]]}
print(json.dumps(out))
"""


def test_two_tiles_issue_three_quarters_of_the_loads_and_dots_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _CENSUS], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    one, two = got["0"], got["1"]
    assert one["loops"] and len(one["loops"]) == len(two["loops"])
    for a, b in zip(one["loops"], two["loops"]):
        for op in ("LDGSTS", "HMMA"):
            assert b[op] * 4 == a[op] * 3, (op, a, b)
    assert two["shared"] < one["shared"] and two["registers"] <= one["registers"]
