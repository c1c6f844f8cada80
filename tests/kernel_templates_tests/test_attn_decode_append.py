"""attn_decode's cache options at the launcher (FlashAttention-2's flash_attn_with_kvcache:
append, rotary, cache_batch_idx, cache_leftpad): split counts, row blocks, padded head dims
and page sizes that straddle tiles; the rotary reference itself; and the flags compiled for
sm_90 (the interpreter is lenient about types). Small shapes: these run under the
interpreter."""

from __future__ import annotations

import pytest
import torch

from flashtune.kernel_templates.attn_decode import attn_decode_kvcache
from flashtune.kernel_templates.attn_decode.launcher import rotary_q_per_position
from flashtune.kernel_templates.attn_decode.reference import rotary_reference
from tests.conftest import DEVICE
from tests.decode_helpers import (
    NO_CACHE_OPTIONS,
    append_case,
    assert_kvcache_close,
    compile_split_kernel_sm90,
)


def cfg(bn=16, splits=3, warps=4, stages=1):
    return {"BLOCK_N": bn, "NUM_SPLITS": splits, "num_warps": warps, "num_stages": stages}


def _launch(args, config, **kw):
    extra = {n: t for n, t in args.items()
             if n not in ("q", "k_cache", "v_cache", "cache_seqlens")}
    return attn_decode_kvcache(args["q"], args["k_cache"], args["v_cache"],
                               args["cache_seqlens"], config, **extra, **kw)


def _fresh(args, before):
    return {**args, "k_cache": before["k_cache"].clone(), "v_cache": before["v_cache"].clone()}


def test_split_counts_and_tiles_agree_and_write_once():
    """One program per KV head writes the new keys; every split count and tile gives the
    reference's caches and the same output up to fp32 reordering."""
    base = append_case([0, 13, 50], 4, 2, 3, 3, 32, torch.float16, DEVICE, page_size=16,
                       rotary_dim=16, seed=1)
    before = {n: base[n].clone() for n in ("k_cache", "v_cache")}
    outs = []
    for config in (cfg(splits=1), cfg(splits=2), cfg(splits=4), cfg(bn=32, splits=2)):
        args = _fresh(base, before)
        out, lse = _launch(args, config, causal=True, return_lse=True,
                           rotary_interleaved=False)
        assert_kvcache_close(out, args, before, lse=lse, causal=True, rotary_interleaved=False)
        outs.append(out.float())
    for out in outs[1:]:
        assert (out - outs[0]).abs().max().item() < 4e-3


def test_more_rows_than_one_program_holds():
    """GQA 32:1 with Nq 5 is 160 rows: two row blocks, of which one writes."""
    args = append_case([9, 30], 32, 1, 5, 5, 16, torch.float16, DEVICE, rotary_dim=16, seed=2)
    before = {n: args[n].clone() for n in ("k_cache", "v_cache")}
    out = _launch(args, cfg(splits=2), causal=True)
    assert_kvcache_close(out, args, before, causal=True)


@pytest.mark.parametrize("d,rotary_dim,interleaved", [(96, 64, True), (96, 96, False),
                                                      (16, 16, True)])
def test_padded_and_small_head_dims(d, rotary_dim, interleaved):
    """BLOCK_D 128 over head_dim 96: the partner dims' loads stay masked."""
    args = append_case([7, 33], 4, 2, 2, 2, d, torch.float16, DEVICE, capacity=48,
                       rotary_dim=rotary_dim, seed=d)
    before = {n: args[n].clone() for n in ("k_cache", "v_cache")}
    out = _launch(args, cfg(splits=2), causal=False, rotary_interleaved=interleaved)
    assert_kvcache_close(out, args, before, causal=False, rotary_interleaved=interleaved)


def test_page_smaller_than_the_tile_and_a_window():
    """Page 8 under BLOCK_N 16 (a page id per key row) with a causal window and leftpad-free
    paged append."""
    args = append_case([3, 29, 64 - 4], 4, 2, 4, 4, 32, torch.float16, DEVICE, page_size=8,
                       rotary_dim=32, seed=3)
    before = {n: args[n].clone() for n in ("k_cache", "v_cache")}
    out = _launch(args, cfg(splits=2), causal=True, window=(10, -1))
    assert_kvcache_close(out, args, before, causal=True, window=(10, -1))


def test_rotary_reference_is_fa2s_apply_rotary_emb():
    """Against FA2's ``apply_rotary_emb_torch`` written out: ``x * cos + rotate_half(x) *
    sin`` on the first rotary_dim dims, cos/sin repeated per pair or per half."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 3, 4, 16, generator=g)
    angle = torch.rand(10, 4, generator=g) * 6.0
    cos, sin = angle.cos(), angle.sin()
    pos = torch.tensor([[0, 1, 2, 3], [5, 5, 5, 5]])
    for interleaved in (False, True):
        c, s = cos[pos][:, None], sin[pos][:, None]
        if interleaved:
            c, s = c.repeat_interleave(2, -1), s.repeat_interleave(2, -1)
            x1, x2 = x[..., :8:2], x[..., 1:8:2]
            rot = torch.stack((-x2, x1), dim=-1).flatten(-2)
        else:
            c, s = torch.cat((c, c), -1), torch.cat((s, s), -1)
            rot = torch.cat((-x[..., 4:8], x[..., :4]), -1)
        want = torch.cat((x[..., :8] * c + rot * s, x[..., 8:]), -1)
        got = rotary_reference(x, cos, sin, pos, interleaved=interleaved)
        torch.testing.assert_close(got, want)


def test_rotary_q_positions_follow_fa2s_rule():
    assert rotary_q_per_position(True, (-1, -1), 64)
    assert rotary_q_per_position(False, (3, -1), 64)
    assert rotary_q_per_position(False, (-1, 0), 64)
    assert not rotary_q_per_position(False, (-1, -1), 64)
    assert not rotary_q_per_position(False, (64, 100), 64)  # FA2 drops bounds >= seqlen_k


def test_the_cache_options_compile_for_sm90():
    """Append + rotary (both styles, q per position or not), paged or not, cache_batch_idx,
    cache_leftpad with a window, leftpad alone: compiled for the H100 on the CPU."""
    def off(*on):
        return [n for n in NO_CACHE_OPTIONS + ["NUM_PAGES", "Alibi"] if n not in on]

    new = ["KNew", "VNew", "stride_knb", "stride_knh", "stride_knn", "stride_vnb",
           "stride_vnh", "stride_vnn", "N_NEW"]
    rope = ["Cos", "Sin", "SEQLEN_RO"]
    compile_split_kernel_sm90([
        {"const": dict(HAS_NEW=True, ROT_DIM=64, ROT_INTERLEAVED=False, ROT_Q_PER_POS=True),
         "none": off(*new, *rope)},
        {"const": dict(HAS_NEW=True, ROT_DIM=128, ROT_INTERLEAVED=True, PAGED=True,
                       PAGE_ALIGNED=True, NUM_SPLITS=1),
         "none": off(*new, *rope, "NUM_PAGES")},
        {"const": dict(HAS_NEW=True, HAS_BATCH_IDX=True, HAS_LEFTPAD=True, HAS_WINDOW=True,
                       IS_CAUSAL=False, HAS_ALIBI=True),
         "none": off(*new, "BatchIdx", "CACHE_BATCH", "LeftPad", "Alibi")},
        {"const": dict(HAS_LEFTPAD=True, PAGED=True), "none": off("LeftPad", "NUM_PAGES")},
    ])
