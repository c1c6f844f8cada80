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
from flashtune.kernel_templates.attn_decode.reference import (
    attn_decode_kvcache_reference,
    attn_decode_reference,
    rotary_reference,
)
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
    """One program per KV head walks and writes the new keys; every split count and tile
    gives the reference's caches and the same output up to fp32 reordering."""
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
        {"const": dict(HAS_NEW=True, ROT_DIM=64, ROT_INTERLEAVED=False, ROT_Q_PER_POS=True,
                       NEW_ROWS=True),
         "none": off(*new, *rope, "BATCH_HEADS")},
        {"const": dict(HAS_NEW=True, ROT_DIM=64, ROT_INTERLEAVED=False, PAGED=True),
         "none": off(*new, *rope, "NUM_PAGES")},
        {"const": dict(HAS_NEW=True, ROT_DIM=128, ROT_INTERLEAVED=True, PAGED=True,
                       PAGE_ALIGNED=True, NUM_SPLITS=1),
         "none": off(*new, *rope, "NUM_PAGES")},
        {"const": dict(HAS_NEW=True, HAS_BATCH_IDX=True, HAS_LEFTPAD=True, HAS_WINDOW=True,
                       IS_CAUSAL=False, HAS_ALIBI=True),
         "none": off(*new, "BatchIdx", "CACHE_BATCH", "LeftPad", "Alibi")},
        {"const": dict(HAS_LEFTPAD=True, PAGED=True), "none": off("LeftPad", "NUM_PAGES")},
    ])


# -- the new keys' own program (split NUM_SPLITS; the one program with one split) --


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_many_new_keys_in_chunks_written_bit_exact_at_every_split_count(paged):
    """37 new keys (three chunks of 16, the last ragged) after lengths 0, 20 and 59 of a
    capacity of 96 (the last sequence ends exactly at it): at 1, 2 and 5 splits the caches
    equal the reference's rotation bit for bit, every other slot untouched, and the outputs
    agree; with 5 splits some splits hold no cached key at all."""
    base = append_case([0, 20, 59], 4, 2, 2, 37, 32, torch.float16, DEVICE, capacity=96,
                       page_size=16 if paged else None, rotary_dim=32, seed=21)
    before = {n: base[n].clone() for n in ("k_cache", "v_cache")}
    kw = {n: t for n, t in base.items() if n not in ("q", "k_cache", "v_cache",
                                                     "cache_seqlens")}
    _, _, k_ref, v_ref = attn_decode_kvcache_reference(
        base["q"], before["k_cache"], before["v_cache"], base["cache_seqlens"],
        rotary_interleaved=False, causal=True, **kw)
    outs, caches = [], []
    for config in (cfg(splits=1), cfg(splits=2), cfg(splits=5)):
        args = _fresh(base, before)
        out, lse = _launch(args, config, causal=True, return_lse=True,
                           rotary_interleaved=False)
        assert_kvcache_close(out, args, before, lse=lse, causal=True, rotary_interleaved=False)
        assert torch.equal(args["k_cache"], k_ref), "rotated keys not bit-exact"
        assert torch.equal(args["v_cache"], v_ref)
        outs.append(out.float())
        caches.append(args["k_cache"])
    for out, cache in zip(outs[1:], caches[1:]):
        assert (out - outs[0]).abs().max().item() < 4e-3
        assert torch.equal(cache, caches[0])


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_without_rows_of_their_own_the_last_split_walks_the_new_keys(paged, monkeypatch):
    """Where the new keys' rows would pass the grid's limit (here: any), the last split walks
    them after its cached keys: the same caches, bit for bit, and the same outputs."""
    from flashtune.kernel_templates.attn_decode import launcher

    base = append_case([0, 20, 59], 4, 2, 2, 37, 32, torch.float16, DEVICE, capacity=96,
                       page_size=16 if paged else None, rotary_dim=32, seed=24)
    before = {n: base[n].clone() for n in ("k_cache", "v_cache")}
    own = _fresh(base, before)
    out_own = _launch(own, cfg(splits=5), causal=True, rotary_interleaved=False)
    monkeypatch.setattr(launcher, "MAX_GRID_Y", 6)  # B * Hkv rows fit, no more
    assert launcher.partial_count(5, True, 6) == 5
    last = _fresh(base, before)
    out_last, lse = _launch(last, cfg(splits=5), causal=True, return_lse=True,
                            rotary_interleaved=False)
    assert_kvcache_close(out_last, last, before, lse=lse, causal=True,
                         rotary_interleaved=False)
    assert torch.equal(last["k_cache"], own["k_cache"])
    assert torch.equal(last["v_cache"], own["v_cache"])
    assert (out_last.float() - out_own.float()).abs().max().item() < 4e-3


@pytest.mark.parametrize("splits", [1, 3])
def test_a_window_that_starts_among_the_new_keys(splits):
    """A causal window of 3 keys behind 20 new ones: no cached key is seen (the splits walk
    nothing), the new keys' program attends to the last 4 and still writes all 20."""
    args = append_case([5, 30], 4, 2, 1, 20, 32, torch.float16, DEVICE, rotary_dim=16,
                       seed=22)
    before = {n: args[n].clone() for n in ("k_cache", "v_cache")}
    out, lse = _launch(args, cfg(splits=splits), causal=True, window=(3, 0), return_lse=True,
                       rotary_interleaved=False)
    assert_kvcache_close(out, args, before, lse=lse, causal=True, window=(3, 0),
                         rotary_interleaved=False)


def test_the_attended_keys_are_the_written_ones():
    """The fused call's output equals the attention alone over the cache it left, with q
    rotated as the reference rotates it (what was attended is what was written)."""
    args = append_case([9, 33, 47], 8, 2, 1, 1, 64, torch.float16, DEVICE, capacity=48,
                       page_size=16, rotary_dim=64, seed=23)
    out = _launch(args, cfg(bn=16, splits=4), causal=True, rotary_interleaved=False)
    lens = args["cache_seqlens"]
    q_rot = rotary_reference(args["q"], args["rotary_cos"], args["rotary_sin"],
                             lens.long()[:, None], interleaved=False)
    alone = attn_decode_kvcache(q_rot, args["k_cache"], args["v_cache"], lens + 1,
                                cfg(bn=16, splits=4), block_table=args["block_table"],
                                causal=True)
    assert (out.float() - alone.float()).abs().max().item() < 2e-3
    ref = attn_decode_reference(q_rot, args["k_cache"], args["v_cache"], cache_seqlens=lens + 1,
                                block_table=args["block_table"], dtype=torch.float32)[0]
    assert (out.float() - ref).abs().max().item() < 4e-3


# compile the bench's fused call and its attention alone for sm_90 (a subprocess, without the
# interpreter): what ptxas made of each
_PTXAS_SCRIPT = r"""
import json, math, sys
import torch
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.compiler import compile as triton_compile
from triton.runtime.jit import create_function_from_signature
from flashtune.kernel_templates.shaped import Shaped
from flashtune.kernel_templates.attn_decode.launcher import kernel_args, partial_count, partial_shapes
from flashtune.kernel_templates.attn_fwd_gluon.launcher import ptxas_stats
target = GPUTarget("cuda", 90, 32)
backend = make_backend(target)
b, nk, ps, splits, paged, fused = json.loads(sys.argv[1])
dt, hq, hkv, d = torch.bfloat16, 32, 8, 128
cfg = {"BLOCK_N": 128, "NUM_SPLITS": splits, "num_warps": 4, "num_stages": 2}
q = Shaped(dt, (b, hq, 1, d))
k = Shaped(dt, (b * nk // ps, hkv, ps, d)) if paged else Shaped(dt, (b, hkv, nk, d))
bt = Shaped(torch.int32, (b, nk // ps)) if paged else None
opts = {}
if fused:
    kn, cs = Shaped(dt, (b, hkv, 1, d)), Shaped(dt, (nk, d // 2))
    opts = dict(k_new=kn, v_new=kn, rotary_cos=cs, rotary_sin=cs, rotary_interleaved=False)
o_part = l_part = None
if splits > 1:
    o, l = partial_shapes(q, partial_count(splits, fused, b * hkv))
    o_part, l_part = Shaped(torch.float32, o), Shaped(torch.float32, l)
kern, args, kw, grid = kernel_args(q, k, k, Shaped(dt, q.shape), None, Shaped(torch.int32, (b,)),
                                   bt, o_part, l_part, cfg, seqlen_k=nk, causal=True,
                                   scale=1 / math.sqrt(d), upcast_dot=False, **opts)[0]
kw = {**kw, "debug": False}
bound, spec, options = create_function_from_signature(kern.signature, kern.params, backend)(*args, **kw)
options, sig, constexprs, attrs = kern._pack_args(backend, kw, bound, spec, options)
c = triton_compile(ASTSource(kern, sig, constexprs, attrs), target=target, options=options.__dict__)
st = ptxas_stats(c.asm["ptx"])
print(json.dumps({"shared": c.metadata.shared, "registers": max(st["registers"]),
                  "spills": max(st["spill_store_bytes"], default=0), "grid": list(grid)}))
"""


def _ptxas(b, nk, splits, paged, fused):
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _PTXAS_SCRIPT,
                           json.dumps([b, nk, 64, splits, paged, fused])],
                          capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("splits,paged", [(16, False), (1, True)],
                         ids=["16-splits-contiguous", "one-split-paged"])
def test_the_fused_step_compiles_like_the_attention_alone_for_sm90(splits, paged):
    """The bench's decode step (GQA 32:8, D128, BLOCK_N 128, 2 stages, 4 warps): with the
    append and the rotary, the split kernel takes the attention's shared memory (one K/V
    pipeline; the rotated new-key tile inside the walk took 132 KB, one program per SM) and
    spills nothing (it spilled 850-920 bytes at 255 registers); with splits, one program
    more per KV head walks the new keys, in grid rows after the splits'."""
    alone = _ptxas(4, 4096, splits, paged, False)
    fused = _ptxas(4, 4096, splits, paged, True)
    assert fused["spills"] == 0 and alone["spills"] == 0, (alone, fused)
    assert fused["shared"] == alone["shared"], (alone, fused)
    assert alone["grid"] == [splits, 32, 1]
    assert fused["grid"] == [splits, 32 + (-(-32 // splits) if splits > 1 else 0), 1]
