"""attn_bwd's ``SPLIT_D`` knob: a head dim that is not a power of two as two tiles (96 = 64 +
32, 80 = 64 + 16, 72 = 64 + 16 with 8 padded; :mod:`flashtune.kernel_templates.head_tiles`)
in both main kernels, against float64 autograd (test_attn_bwd's tolerance rule): plain loads
and TMA descriptors, every backward knob, transposed views, rows that see no key, score
modifications, an LSE gradient, packed sequences and dropout; its place in the space and
what it compiles to for sm_90."""

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
from flashtune.kernel_templates.attn_bwd import attn_bwd
from flashtune.kernel_templates.attn_bwd.space import shared_mem_bytes
from flashtune.kernel_templates.dropout import dropout_mask
from tests.helpers import assert_grads_close
from tests.kernel_templates_tests.test_attn_bwd import make as make_bhnd
from tests.kernel_templates_tests.test_attn_bwd_dropout import grad_refs
from tests.kernel_templates_tests.test_attn_bwd_mods import (
    check,
    check_packed,
    make,
    make_packed,
    reference,
    slopes,
)
from tests.kernel_templates_tests.test_attn_dropout import P, seed_tensor

SPEC = get_template("attn_bwd")
H100 = DeviceFingerprint("NVIDIA_H100_80GB_HBM3", "9.0", 132, 232448, 85 << 30)
CFG = {"BLOCK_M1": 16, "BLOCK_N1": 32, "BLOCK_M2": 32, "BLOCK_N2": 16, "num_warps": 2,
       "num_stages": 1, "SPLIT_D": 1}


def test_the_space_takes_it_only_where_it_cuts_padding():
    cfg = {"BLOCK_M1": 64, "BLOCK_N1": 128, "BLOCK_M2": 128, "BLOCK_N2": 64, "num_warps": 8,
           "num_stages": 3}
    assert SPEC.space.validate(cfg)["SPLIT_D"] == 0  # configs tuned before the knob
    d96 = AttentionProblem(2, 32, 32, 2048, 2048, 96, True, "bf16")
    assert SPEC.space.check(dict(cfg, SPLIT_D=1), d96, H100) is None
    for d in (128, 64, 112):  # one tile either way, or two that save nothing (64 + 64)
        p = AttentionProblem(2, 32, 32, 2048, 2048, d, True, "bf16")
        reason = SPEC.space.check(dict(cfg, SPLIT_D=1), p, H100)
        assert reason is not None and "SPLIT_D" in reason
    # the tiles the predicate counts lose their 32 padded columns: the dK/dV kernel's two
    # owned ones of 128 keys and three stages of two streamed ones of 64 queries, bf16
    saved = (2 * 128 + 3 * 2 * 64) * 32 * 2
    assert shared_mem_bytes(dict(cfg, SPLIT_D=1), 96) == shared_mem_bytes(cfg, 96) - saved


def test_a_search_proposes_the_knob_only_where_it_applies():
    """SearchSpace.narrow: SPLIT_D 0 alone at a power-of-two head dim, in the backward's
    space and under the training pair's ``bwd.`` prefix; both values at D96."""
    from flashtune.kernel_templates.registry import train_step

    p64 = AttentionProblem(2, 8, 8, 256, 256, 64, True, "bf16")
    p96 = AttentionProblem(2, 8, 8, 256, 256, 96, True, "bf16")
    assert SPEC.space.for_problem(p64).params["SPLIT_D"] == (0,)
    assert SPEC.space.for_problem(p96).params["SPLIT_D"] == (0, 1)
    pair = train_step(get_template("attn_fwd")).space
    assert pair.for_problem(p64).params["bwd.SPLIT_D"] == (0,)
    assert pair.for_problem(p96).params["bwd.SPLIT_D"] == (0, 1)


KNOBS = [
    ("plain", {}),
    ("split-loops-kv-splits", {"SPLIT_LOOPS": 1, "KV_SPLITS": 2}),
    ("one-launch", {"ONE_LAUNCH": 1, "REVERSE_DQ": 1}),
]


@pytest.mark.parametrize("tma", [0, 1], ids=["plain", "tma"])
@pytest.mark.parametrize("knobs", [k[1] for k in KNOBS], ids=[k[0] for k in KNOBS])
@pytest.mark.parametrize("d", [96, 80, 72])
def test_matches_float64(device, d, knobs, tma):
    """GQA 4:2, causal with Nq < Nk and not; 72 = 64 + 16 leaves 8 padded columns in the
    second tile (masked loads and stores there)."""
    dtype = torch.bfloat16 if tma else torch.float16
    q, k, v, do = make((1, 4, 2, 37, 53, d), dtype, device, seed=d + tma)
    cfg = {**CFG, "USE_TMA": tma, **knobs}
    for causal in (False, True):
        check(q, k, v, do, cfg, causal=causal)


def test_transposed_views_and_rows_that_see_nothing(device):
    """(B, N, H, D) storage viewed as (B, H, N, D); Nq > Nk causal: the first 8 rows see no
    key and get a zero dQ."""
    q, k, v, do = make_bhnd(2, 2, 1, 45, 37, 96, torch.float16, seed=5, layout="bnhd")
    got = check(q, k, v, do, {**CFG, "SPLIT_LOOPS": 1}, causal=True)
    assert torch.all(got[0][:, :, :8] == 0) and got[0][:, :, 8:].abs().sum() > 0


def test_score_modifications_and_the_lse_gradient(device):
    q, k, v, do = make((1, 4, 2, 40, 45, 96), torch.float16, device, seed=11)
    dlse = torch.randn(1, 4, 40, generator=torch.Generator().manual_seed(2)).to(device)
    check(q, k, v, do, {**CFG, "SPLIT_LOOPS": 1}, dlse=dlse, causal=True, window=(9, -1),
          softcap=3.0, alibi_slopes=slopes(4, device))


@pytest.mark.parametrize("knobs", [{"SPLIT_LOOPS": 1}, {"ONE_LAUNCH": 1, "KV_SPLITS": 2}],
                         ids=["split-loops", "one-launch-kv-splits"])
def test_packed_sequences(device, knobs):
    seqs = [(23, 37), (1, 12), (40, 17)]
    q, k, v, do, cu_q, cu_k = make_packed(seqs, 4, 2, 80, torch.float16, device, seed=4,
                                          pad=8)
    check_packed(q, k, v, do, cu_q, cu_k, {**CFG, **knobs}, causal=True, window=(8, -1))


def test_dropout_regenerates_the_same_mask(device):
    q, k, v, do = make((1, 4, 2, 23, 40, 96), torch.float16, device, seed=2)
    seed = seed_tensor(device)
    mask = dropout_mask(seed, 1, 4, 23, 40, P)
    out, lse, refs = grad_refs(q, k, v, do, mask, causal=True)
    got = attn_bwd(q, k, v, out.to(q.dtype), lse.float(), do, {**CFG, "KV_SPLITS": 2},
                   dropout_p=P, seed=seed, causal=True)
    assert_grads_close(got, q, k, v, do, causal=False, refs=refs)


def test_one_tile_and_two_agree(device):
    """The same gradients up to the fp32 summation order of the head dim's two halves."""
    q, k, v, do = make((1, 2, 2, 33, 33, 96), torch.float16, device, seed=8)
    out, lse, _ = reference(q, k, v, do, causal=True)
    one = attn_bwd(q, k, v, out.half(), lse.float(), do, dict(CFG, SPLIT_D=0), causal=True)
    two = attn_bwd(q, k, v, out.half(), lse.float(), do, CFG, causal=True)
    for x, y in zip(one, two):
        assert ((x.double() - y.double()).norm() / y.double().norm()).item() < 2e-3


_CENSUS = r"""
import json
from flashtune.core.problem import AttentionProblem
from flashtune.kernel_templates.sm90 import compile_launches
p = AttentionProblem(4, 32, 32, 2048, 2048, 96, True, "bf16")
out = {}
for split in (0, 1):
    cfg = {"BLOCK_M1": 64, "BLOCK_N1": 128, "BLOCK_M2": 128, "BLOCK_N2": 64, "num_warps": 8,
           "num_stages": 3, "USE_TMA": 1, "SPLIT_D": split}
    out[split] = {x["kernel"]: {k: x[k] for k in ("registers", "shared", "spill_store_bytes")}
                  for x in compile_launches("attn_bwd", p, cfg)}
print(json.dumps(out))
"""


def test_two_tiles_compile_for_sm90_in_less_shared_memory():
    """D96 at the head-dim default's tiles (D128's): with two tiles both main kernels hold
    less shared memory and no more registers, and neither spills."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _CENSUS], env=env, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    one, two = got["0"], got["1"]
    for kernel in ("attn_bwd_dkdv", "attn_bwd_dq"):
        assert two[kernel]["spill_store_bytes"] == 0, got
        assert two[kernel]["shared"] < one[kernel]["shared"], got
        assert two[kernel]["registers"] <= one[kernel]["registers"], got
