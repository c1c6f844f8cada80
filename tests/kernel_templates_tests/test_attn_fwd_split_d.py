"""attn_fwd's ``SPLIT_D`` knob: a head dim that is not a power of two as two tiles (96 = 64 +
32; :mod:`flashtune.kernel_templates.head_tiles`), against the float64 reference (plain
loads and TMA descriptors, both layouts, score modifications, packed sequences, dropout),
its place in the space, and what it compiles to for sm_90."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from flashtune.core.device import DeviceFingerprint, interpreter_device
from flashtune.core.problem import AttentionProblem
from flashtune.kernel_templates import get_template
from flashtune.kernel_templates.attn_fwd import attn_fwd
from flashtune.kernel_templates.attn_fwd.space import shared_mem_bytes
from flashtune.kernel_templates.dropout import draw_seed
from flashtune.kernel_templates.head_tiles import d_tiles
from tests.conftest import DEVICE
from tests.helpers import assert_close_to_reference
from tests.kernel_templates_tests.test_attn_fwd_mods import assert_matches, make_varlen, slopes

SPEC = get_template("attn_fwd")
H100 = DeviceFingerprint("NVIDIA_H100_80GB_HBM3", "9.0", 132, 232448, 85 << 30)
CFG = {"BLOCK_M": 32, "BLOCK_N": 16, "num_warps": 4, "num_stages": 2, "SPLIT_D": 1}


def make_qkv(b, hq, hkv, nq, nk, d, dtype, *, seed=0, layout="bhnd"):
    g = torch.Generator().manual_seed(seed)

    def rand(h, n):
        if layout == "bnhd":
            return torch.randn(b, n, h, d, generator=g).to(dtype).to(DEVICE).transpose(1, 2)
        return torch.randn(b, h, n, d, generator=g).to(dtype).to(DEVICE)
    return rand(hq, nq), rand(hkv, nk), rand(hkv, nk)


def test_the_tiles_are_the_decode_kernels():
    assert [d_tiles(d, 1) for d in (96, 80, 40, 192, 128, 16)] == \
        [(64, 32), (64, 16), (32, 16), (128, 64), (128, 0), (16, 0)]


def test_the_space_takes_it_only_where_it_cuts_padding():
    cfg = {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3}
    assert SPEC.space.validate(cfg)["SPLIT_D"] == 0  # configs tuned before the knob
    d96 = AttentionProblem(2, 32, 32, 2048, 2048, 96, True, "bf16")
    assert SPEC.space.check(dict(cfg, SPLIT_D=1), d96, H100) is None
    for d in (128, 64, 112):  # one tile either way, or two that save nothing (64 + 64)
        p = AttentionProblem(2, 32, 32, 2048, 2048, d, True, "bf16")
        reason = SPEC.space.check(dict(cfg, SPLIT_D=1), p, H100)
        assert reason is not None and "SPLIT_D" in reason
    assert shared_mem_bytes(dict(cfg, SPLIT_D=1), 96) * 4 == shared_mem_bytes(cfg, 96) * 3



def test_the_hopper_default_between_64_and_128_dims_is_two_tiles():
    two = {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3, "USE_TMA": 1,
           "SPLIT_D": 1}
    for d, split in ((96, 1), (80, 1), (72, 1), (112, 0), (128, 0), (64, 0), (40, 0)):
        p = AttentionProblem(2, 32, 8, 2048, 2048, d, True, "bf16")
        got = SPEC.default_config(p, H100)
        assert got["SPLIT_D"] == split, d
        if split:
            assert got == {**two, "REVERSE_M": 1}
        # the interpreter has no TMA: one tile, as before
        assert SPEC.default_config(p, interpreter_device())["SPLIT_D"] == 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("tma", [0, 1], ids=["plain", "tma"])
@pytest.mark.parametrize("d", [96, 80, 40])
def test_matches_reference(d, tma, dtype):
    q, k, v = make_qkv(1, 4, 2, 77, 133, d, dtype, seed=d)
    for causal in (False, True):
        out, lse = attn_fwd(q, k, v, dict(CFG, USE_TMA=tma), causal=causal, return_lse=True)
        assert_close_to_reference(out, q, k, v, causal=causal, lse=lse)


@pytest.mark.parametrize("tma", [0, 1], ids=["plain", "tma"])
def test_transposed_storage_and_rows_that_see_nothing(tma):
    q, k, v = make_qkv(2, 2, 1, 45, 30, 96, torch.float16, seed=3, layout="bnhd")
    out, lse = attn_fwd(q, k, v, dict(CFG, USE_TMA=tma, REVERSE_M=1), causal=True,
                        return_lse=True)
    assert torch.isneginf(lse[:, :, :15]).all() and (out[:, :, :15] == 0).all()
    assert_close_to_reference(out, q, k, v, causal=True, lse=lse)


def test_score_modifications():
    q, k, v = make_qkv(1, 4, 2, 37, 45, 96, torch.float16, seed=5)
    q = q * 2
    al = slopes(4)
    out, lse = attn_fwd(q, k, v, CFG, causal=True, window=(6, -1), softcap=3.0,
                        alibi_slopes=al, return_lse=True)
    assert_matches(out, lse, q, k, v, causal=True, window=(6, -1), softcap=3.0,
                   alibi_slopes=al)


def test_packed_sequences():
    q, k, v, cu_q, cu_k, max_q, max_k = make_varlen(4, 2, 80, torch.float16, packed=False,
                                                    seed=7)
    kw = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k,
              causal=True, return_lse=True)
    one, lse1 = attn_fwd(q, k, v, dict(CFG, SPLIT_D=0), **kw)
    two, lse2 = attn_fwd(q, k, v, CFG, **kw)
    assert (one.float() - two.float()).abs().max().item() < 4e-3
    seen = torch.isfinite(lse1)  # rows of a sequence with more queries than keys see none
    assert torch.equal(seen, torch.isfinite(lse2)) and not seen.all()
    assert (lse1[seen] - lse2[seen]).abs().max().item() < 1e-4


def test_dropout_keeps_the_same_mask():
    """The mask depends on rows and keys only: one tile or two drop the same scores."""
    q, k, v = make_qkv(1, 2, 2, 45, 45, 96, torch.float16, seed=9)
    torch.manual_seed(1234)
    seed = draw_seed(q.device)
    one = attn_fwd(q, k, v, dict(CFG, SPLIT_D=0), dropout_p=0.2, seed=seed)
    two = attn_fwd(q, k, v, CFG, dropout_p=0.2, seed=seed)
    assert (one.float() - two.float()).abs().max().item() < 4e-3


_CENSUS = r"""
import json
from flashtune.core.problem import AttentionProblem
from flashtune.kernel_templates.sm90 import compile_launches
p = AttentionProblem(4, 32, 32, 2048, 2048, 96, False, "bf16")
out = {}
for tma in (0, 1):
    for split in (0, 1):
        cfg = {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3, "USE_TMA": tma,
               "SPLIT_D": split}
        (launch,) = compile_launches("attn_fwd", p, cfg)
        out[f"{tma}{split}"] = {k: launch[k] for k in ("registers", "shared",
                                                        "spill_store_bytes")}
print(json.dumps(out))
"""


def test_two_tiles_compile_for_sm90_in_less_shared_memory():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _CENSUS], env=env, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    for tma in "01":
        one, two = got[tma + "0"], got[tma + "1"]
        assert two["spill_store_bytes"] == 0
        assert two["shared"] < one["shared"] and two["registers"] <= one["registers"], got


def test_a_search_proposes_the_knob_only_where_it_applies():
    """SearchSpace.narrow (knob_scope.split_d_scope): at a power-of-two head dim the search
    walks SPLIT_D 0 alone, in the forward's space, the decode kernel's and a training
    pair's (whose backward has the knob too: both halves pinned); at D96 both values. The
    predicate is unchanged."""
    from flashtune.kernel_templates.registry import train_step

    p64 = AttentionProblem(2, 8, 8, 256, 256, 64, True, "bf16")
    p96 = AttentionProblem(2, 8, 8, 256, 256, 96, True, "bf16")
    pair = train_step(SPEC).space
    for space, knobs in ((SPEC.space, 1), (get_template("attn_decode").space, 1), (pair, 2)):
        assert space.for_problem(p64).params["SPLIT_D"] == (0,)
        assert space.for_problem(p96) is space and space.params["SPLIT_D"] == (0, 1)
        assert space.for_problem(p64).size * 2 ** knobs == space.size
        assert space.for_problem(p64).predicate is space.predicate
    assert pair.for_problem(p64).params["bwd.SPLIT_D"] == (0,)
