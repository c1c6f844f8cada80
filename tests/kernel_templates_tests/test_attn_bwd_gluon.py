"""attn_bwd_gluon, the Gluon warp-specialized backward: its spec, limits and training pair,
its space and the sm_90 compile table behind the predicate, the launch plan (grids, scratch,
descriptors) built from shapes, compiles for sm_90 (CPU), and (GPU, sm_90,
``FLASHTUNE_TEST_DEVICE=cuda``) its gradients against the float64 reference on odd shapes.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from flashtune.core.device import DeviceFingerprint, interpreter_device
from flashtune.core.errors import ConfigError, DeviceError, InputError
from flashtune.core.problem import AttentionProblem
from flashtune.kernel_templates import get_template, implementations
from flashtune.kernel_templates.attn_bwd.reference import attn_bwd_reference
from flashtune.kernel_templates.attn_bwd_gluon import CUDNN_PAIR_NAME, PAIR_NAME, space
from flashtune.kernel_templates.attn_bwd_gluon.launcher import (
    DEFAULT_CONFIG,
    PRE_BLOCK,
    SPLIT_D_CONFIG,
    attn_bwd_gluon,
    check_config,
    layout,
    plan,
    scratch_shapes,
)
from flashtune.kernel_templates.attn_bwd_gluon.prefilter import cases
from flashtune.kernel_templates.registry import source_hash
from flashtune.kernel_templates.shaped import Shaped
from flashtune.kernel_templates.training import TrainStep
from tests.helpers import (
    assert_compiles_and_captures,
    assert_grads_close,
    assert_trains_through_attention,
)

SPEC = get_template("attn_bwd_gluon")
FOLDER = space.TABLE.parent
H100 = DeviceFingerprint("NVIDIA_H100_80GB_HBM3", "9.0", 132, 232448, 85 * 2**30)
A100 = DeviceFingerprint("NVIDIA_A100_SXM4_80GB", "8.0", 108, 166912, 85 * 2**30)
ROOT = Path(__file__).resolve().parents[2]


def _problem(d: int = 128, causal: bool = False, dtype: str = "bf16", *, hq: int = 8,
             hkv: int = 8, nq: int = 1000, nk: int = 1000, **mods: object) -> AttentionProblem:
    return AttentionProblem(2, hq, hkv, nq, nk, d, causal, dtype, **mods)


def _config(**knobs: int) -> dict[str, int]:
    return {**DEFAULT_CONFIG, **knobs}


# the split-D kernel's one tile shape (D256)
SPLIT_D = {k: v for k, v in SPLIT_D_CONFIG.items() if k in DEFAULT_CONFIG}


# -- the spec, its limits, the training pair ---------------------------------------------------

def test_it_is_registered_as_a_gluon_backward() -> None:
    assert SPEC.op == "bwd" and SPEC.kind == "gluon" and SPEC.serves == ()
    assert SPEC.reference is attn_bwd_reference
    assert SPEC.source_hash == source_hash(FOLDER / "kernel.py", FOLDER / "launcher.py")
    assert SPEC not in implementations("fwd") and SPEC not in implementations("train")
    # importing it moves neither forward's hash (the shipped table is keyed to attn_fwd's)
    assert get_template("attn_fwd").source_hash == "96002eea06a4d9b3"
    assert get_template(PAIR_NAME).source_hash == get_template("attn_fwd_gluon").source_hash


def test_its_dq_is_declared_not_deterministic_and_the_old_pairs_still_are() -> None:
    assert SPEC.limits.deterministic is False
    trains = {s.name: s for s in implementations("train")}
    assert trains[PAIR_NAME].limits.deterministic is False  # the pair meets both kernels'
    assert trains["attn_fwd"].limits.deterministic and trains["attn_fwd_gluon"].limits.deterministic
    assert get_template("attn_bwd").limits.deterministic


def test_the_training_pair_is_attn_fwd_gluon_with_this_backward() -> None:
    fwd = get_template(PAIR_NAME)
    assert fwd.op == "fwd" and fwd.serves == ("train",) and fwd.backward == "attn_bwd_gluon"
    assert fwd.launcher is get_template("attn_fwd_gluon").launcher
    assert fwd not in implementations("fwd")  # a forward-only call never sees it
    pair = {s.name: s for s in implementations("train")}[PAIR_NAME]
    assert set(pair.space.params) == set(fwd.space.params) | {f"bwd.{n}" for n in space.PARAMS}
    assert pair.refuse(_problem(128, True, hq=8, hkv=2, nq=333, nk=517), H100,
                       return_lse=True) is None
    # the router's default pairs are unchanged: attn_fwd_gluon still pairs with attn_bwd
    assert get_template("attn_fwd_gluon").backward == "attn_bwd"


def test_cudnns_forward_pairs_with_this_backward_for_training() -> None:
    """``sdpa_cudnn_bwd_gluon``: SDPA cuDNN's forward (it returns the LSE this backward
    reads) with this backward, a training pair of flashtune's own kind that only a tuning
    run's choice routes to. What it serves is what both serve: not causal with Nq != Nk
    (cuDNN's mask is top-left), not packed batches, sm_90 only; its LSE has a gradient
    (this backward takes dLSE). Its hash moves with torch's and cuDNN's versions
    (``torch_bound``) and with this backward's."""
    fwd, cudnn = get_template(CUDNN_PAIR_NAME), get_template("sdpa_cudnn")
    assert fwd.op == "fwd" and fwd.serves == ("train",) and fwd.backward == SPEC.name
    assert fwd.launcher is cudnn.launcher and fwd.kind == "gluon" and fwd.torch_bound
    assert fwd.source_hash == cudnn.source_hash and not fwd.space.params
    assert fwd not in implementations("fwd")
    pair = {s.name: s for s in implementations("train")}[CUDNN_PAIR_NAME]
    assert isinstance(pair.launcher, TrainStep) and pair.launcher.bwd is SPEC
    assert set(pair.space.params) == {f"bwd.{n}" for n in space.PARAMS}
    assert pair.torch_bound and pair.source_hash not in (SPEC.source_hash, cudnn.source_hash)
    # its limits on an H100 (this process's torch may have no cuDNN: ``available``)
    limits = replace(pair.limits, available=None)
    assert limits.refuse(_problem(64, True, hq=8, hkv=2, nq=333, nk=333), H100,
                         return_lse=True) is None
    assert "causal" in limits.refuse(_problem(64, True, nq=333, nk=517), H100)
    assert limits.refuse(_problem(128, tokens_q=1500, tokens_k=1500), H100) is not None
    assert "head_dim 96" in limits.refuse(_problem(96), H100)
    assert "sm_90" in limits.refuse(_problem(), A100)
    assert pair.limits.deterministic is False
    if not torch.backends.cudnn.is_available():
        assert pair.refuse(_problem(), H100) is not None


def test_its_limits_refuse_what_it_cannot_serve() -> None:
    assert "needs a CUDA GPU" in SPEC.refuse(_problem(), interpreter_device())
    assert "sm_90" in SPEC.refuse(_problem(), A100)
    for d in (96, 32, 192):
        assert f"head_dim {d}" in SPEC.refuse(_problem(d), H100)
    assert "dropout" in SPEC.refuse(_problem(dropout=0.1), H100)
    # a causal sliding window and a softcap (the Gluon forward's), not a local window
    assert SPEC.refuse(_problem(128, True, window_left=255), H100) is None
    assert SPEC.refuse(_problem(64, True, window_left=255, softcap=30.0), H100) is None
    assert SPEC.refuse(_problem(softcap=30.0), H100) is None
    assert "window" in SPEC.refuse(_problem(128, False, window_left=255, window_right=255),
                                   H100)
    assert "window" in SPEC.refuse(_problem(128, False, window_left=255), H100)
    assert "ALiBi" in SPEC.refuse(_problem(alibi=True), H100)
    assert SPEC.refuse(_problem(tokens_q=1500, tokens_k=1500), H100) is None  # VARLEN
    for d in (64, 128, 256):
        for dtype in ("fp16", "bf16"):  # GQA, MQA, causal with Nq != Nk, ragged
            assert SPEC.refuse(_problem(d, True, dtype, hq=8, hkv=2, nq=333, nk=517), H100) \
                is None
            assert SPEC.refuse(_problem(d, False, dtype, hq=8, hkv=1, nq=197, nk=197), H100) \
                is None


def test_the_launcher_refuses_what_it_cannot_serve_by_name() -> None:
    q = torch.zeros(1, 2, 64, 128, dtype=torch.bfloat16)
    with pytest.raises(DeviceError, match="CUDA GPU"):
        attn_bwd_gluon(q, q, q, q, torch.zeros(1, 2, 64), q, DEFAULT_CONFIG)
    q96 = torch.zeros(1, 2, 64, 96, dtype=torch.bfloat16)
    with pytest.raises(InputError, match="head_dim must be one of"):
        attn_bwd_gluon(q96, q96, q96, q96, torch.zeros(1, 2, 64), q96, DEFAULT_CONFIG)
    with pytest.raises(ConfigError, match="missing"):
        attn_bwd_gluon(q, q, q, q, torch.zeros(1, 2, 64), q, {"BLOCK_M": 64})
    with pytest.raises(ConfigError, match="64 keys each"):
        check_config(_config(BLOCK_N=64, NUM_CONSUMERS=2))
    with pytest.raises(ConfigError, match="NUM_STAGES"):
        check_config(_config(NUM_STAGES=1))
    # D256: the consumers split the head dim, one tile shape (SPLIT_D_CONFIG's)
    q256 = torch.zeros(1, 2, 64, 256, dtype=torch.bfloat16)
    with pytest.raises(ConfigError, match="head_dim 256"):
        attn_bwd_gluon(q256, q256, q256, q256, torch.zeros(1, 2, 64), q256, DEFAULT_CONFIG)
    check_config(_config(**SPLIT_D), 256)
    check_config(_config(**SPLIT_D, LPT=1, TMA_STORE=1, EXPAND_GQA=1), 256)
    for bad in ({"BLOCK_M": 128}, {"NUM_STAGES": 3}, {"PERSISTENT": 1}, {"DQ_TMA": 1},
                {"BLOCK_N": 128, "NUM_CONSUMERS": 1}):
        with pytest.raises(ConfigError, match="head_dim 256"):
            check_config(_config(**{**SPLIT_D, **bad}), 256)
    with pytest.raises(ConfigError, match="64 keys each"):  # at D128 the keys are split
        check_config(_config(**SPLIT_D), 128)
    lse = torch.zeros(1, 2, 64)
    for bad in (dict(causal=False, window=(8, 0)), dict(causal=True, window=(8, 8)),
                dict(causal=True, window=(-2, 0)), dict(causal=False, window=(-1, 4)),
                dict(causal=False, window=(-1, 0)),  # a right bound: not "no window"
                dict(causal=True, window=8)):
        with pytest.raises(InputError, match="window"):
            attn_bwd_gluon(q, q, q, q, lse, q, DEFAULT_CONFIG, **bad)
    for cap in (-1.0, math.inf, math.nan, "x"):
        with pytest.raises(InputError, match="softcap"):
            attn_bwd_gluon(q, q, q, q, lse, q, DEFAULT_CONFIG, causal=True, softcap=cap)


# -- the space and its compile table -----------------------------------------------------------

def test_the_predicate_refuses_structure_head_dims_spills_and_shared_memory() -> None:
    p = _problem(128, True)
    assert "fewer than 64 keys" in space.check(_config(BLOCK_N=64, NUM_CONSUMERS=2), p, H100)
    assert "head_dim 96" in space.check(DEFAULT_CONFIG, _problem(96), H100)
    # D256: the split-D shape only (and what it compiles to within budget)
    assert "head_dim 256" in space.check(DEFAULT_CONFIG, _problem(256, True), H100)
    ok256 = [c for c in space.SPACE if space.check(c, _problem(256, True, hq=8, hkv=2), H100)
             is None]
    assert ok256 and all({k: c[k] for k in SPLIT_D} == SPLIT_D for c in ok256)
    table = space.load_table()
    refused = {k: c.reason() for k, c in table.items() if c.reason() is not None}
    # something is refused (the space is not all valid) and something is left at each dim
    assert refused
    for d in space.HEAD_DIMS:
        for causal in (False, True):
            ok = [c for c in space.SPACE
                  if space.check(c, _problem(d, causal), H100) is None]
            assert ok, (d, causal)
    spill = space.Compiled(100_000, 255, space.SPILL_LIMIT + 8)
    assert "spills" in spill.reason()
    big = space.Compiled(space.SMEM_LIMIT + 1, 168, 0)
    assert "shared memory" in big.reason()
    assert "does not compile" in space.Compiled(None, None, None, "CompilationError: x").reason()
    # a device that opts in to less shared memory refuses more configs
    small = DeviceFingerprint("GPU_SMALL_SMEM", "9.0", 132, 100_000, 85 * 2**30)
    assert any(space.check(c, p, H100) is None and space.check(c, p, small) is not None
               for c in space.SPACE)


def test_the_table_holds_every_point_of_the_space_and_the_current_source() -> None:
    doc = json.loads(space.TABLE.read_text())
    assert doc["source_hash"] == SPEC.source_hash, f"stale: {space.REGENERATE}"
    table = space.parse_table(doc)
    want = {space.entry_key(c["head_dim"], c["causal"], c["config"]) for c in cases()}
    assert set(table) == want
    # head dims x causal x configs x LPT x PERSISTENT x DQ_TMA x TMA_STORE, and D256's one
    # shape x causal x LPT x TMA_STORE
    assert len(want) == 2 * 2 * 12 * 2 * 2 * 2 * 2 + 2 * 2 * 2


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_the_default_config_is_valid_for_every_problem_it_serves(d: int, causal: bool) -> None:
    p = _problem(d, causal)
    config = SPEC.default_config(p, H100)
    assert space.check(config, p, H100) is None
    assert SPEC.space.validate(config) == config
    # D64 MHA at N 1000: persistent; D128: the grid launch; longest first under a causal
    # mask either way; dQ by TMA at D128 without a mask; dK and dV by TMA stores
    assert config["PERSISTENT"] == (d == 64) and config["LPT"] == causal
    assert config["DQ_TMA"] == (d == 128 and not causal)
    assert config["TMA_STORE"] == 1


@pytest.mark.parametrize("hq,hkv,d,causal,lpt", [
    (28, 4, 128, True, 1), (64, 8, 128, True, 1), (32, 32, 128, True, 1),
    (28, 4, 128, False, 0), (32, 8, 64, True, 1), (32, 4, 64, False, 0)])
def test_the_default_walks_longest_first_under_a_causal_mask(hq, hkv, d, causal, lpt):
    """Measured on the H100 (benchmarks/results/bwd_lpt_h100.json): 1.03-1.11x on causal
    GQA at D128, within 2% on MHA; on an H200 (lpt_sections_gqa_h200.json) 1.04-1.07x at
    D128 and 1.10-1.13x at D64; MHA D128 0.99-1.04x at N 512-8k once its sections were sized
    for 16 MiB (lpt_sections_b16_d128c_h200.json). The rest of the config is the GQA grid
    launch's either way, with the TMA stores of dK and dV (at D128 causal both fit since the
    epilogue's addresses stopped spilling: 104 B, was 268 over a budget of 256, the sm_90
    table). Packed batches walk longest first for GQA only (not measured for MHA)."""
    p = AttentionProblem(2, hq, hkv, 1000, 1000, d, causal, "bf16")
    config = SPEC.default_config(p, H100)
    assert config["LPT"] == lpt and space.check(config, p, H100) is None
    assert config["PERSISTENT"] == 0
    assert config["TMA_STORE"] == 1
    if d == 128:  # (MHA at D64 runs persistent at this length)
        mha = SPEC.default_config(AttentionProblem(2, hkv, hkv, 1000, 1000, d, causal, "bf16"),
                                  H100)
        assert config == mha
    packed = AttentionProblem(2, hq, hkv, 1000, 1000, d, causal, "bf16", tokens_q=1500,
                              tokens_k=1500)
    assert space.lpt_by_default(packed) == (causal and hq > hkv)


@pytest.mark.parametrize("hq,hkv,d,n,causal,expand", [
    (16, 2, 128, 2048, True, 1), (16, 4, 128, 4096, True, 1), (16, 4, 128, 2048, True, 0),
    (32, 4, 64, 8192, True, 1), (32, 4, 64, 2048, True, 0), (32, 8, 64, 8192, True, 0),
    (16, 2, 128, 8192, False, 0), (16, 16, 128, 8192, True, 0), (16, 1, 128, 1024, True, 1),
    (16, 8, 256, 4096, True, 0), (32, 16, 256, 8192, True, 0)])
def test_the_default_runs_gqa_per_query_head_where_the_group_outgrows_l2(hq, hkv, d, n, causal,
                                                                       expand):
    """EXPAND_GQA 1 by default for causal GQA whose groups in flight outgrow L2 (group x D
    at least 512) with walks that pay for the group sums (group x D x N at least 2M):
    measured on an H200 at 8:1 D128 from 2k, 4:1 D128 from 4k, 8:1 D64 at 8k (0.99x cuDNN's
    step, was 0.88x); not 4:1 D64, not without a mask (unmeasured), not MHA, not D256 (the
    split-D kernel ran 1.04-1.07x faster grouped at 2:1). The rest of the config is the GQA
    default's."""
    p = AttentionProblem(2, hq, hkv, n, n, d, causal, "bf16")
    config = SPEC.default_config(p, H100)
    assert config["EXPAND_GQA"] == expand and space.check(config, p, H100) is None
    assert space.expand_gqa_by_default(p) == bool(expand)
    if expand:
        assert {**config, "EXPAND_GQA": 0} == SPEC.default_config(
            AttentionProblem(2, hq, hkv, 1000, 1000, d, causal, "bf16"), H100)


@pytest.mark.parametrize("hq,hkv,n,causal,persistent", [
    (32, 32, 1000, False, 1), (32, 32, 2048, False, 1), (32, 32, 4096, False, 0),
    (32, 32, 1000, True, 1), (32, 32, 2048, True, 1), (32, 32, 4096, True, 0),
    (28, 4, 1000, True, 0), (32, 4, 1000, False, 0)])
def test_the_default_at_d64_is_persistent_for_short_mha_walks(hq, hkv, n, causal, persistent):
    """Measured on an H200 (benchmarks/results/train_breakdown_d64*_h200.json,
    defaults_d64_*_h200.json): the persistent main kernel 1.00-1.11x the grid launch on D64
    MHA at N 512-2k, 0.97-1.00x at 4k; causal (LPT 1) 1.03-1.12x up to 4k, and since the
    causal walks run the diagonal last 0.97x at 4k (bwd_diag_last_d64{,p}_h200.json);
    0.95-1.01x from 8k; the step 0.85-0.90x on GQA 4:1; a packed batch keeps the grid
    launch (PERSISTENT serves dense batches only)."""
    p = AttentionProblem(2, hq, hkv, n, n, 64, causal, "bf16")
    config = SPEC.default_config(p, H100)
    assert config["PERSISTENT"] == persistent and space.check(config, p, H100) is None
    if persistent:
        assert config["LPT"] == int(causal)
    packed = AttentionProblem.from_lengths([300, 700], None, heads_q=hq, heads_kv=hkv,
                                           head_dim=64, causal=causal, dtype="bf16")
    grid = SPEC.default_config(packed, H100)
    assert grid["PERSISTENT"] == 0 and space.check(grid, packed, H100) is None
    refused = space.check({**grid, "PERSISTENT": 1}, packed, H100)
    assert refused is not None and "PERSISTENT serves dense batches only" in refused


# -- the launch plan, from shapes --------------------------------------------------------------

def _plan(b: int, hq: int, hkv: int, nq: int, nk: int, d: int, config: dict[str, int],
          causal: bool = True, dlse: bool = False, **mods: object) -> dict:
    dt = torch.bfloat16
    q, k = Shaped(dt, (b, hq, nq, d)), Shaped(dt, (b, hkv, nk, d))
    scratch = {n: Shaped(torch.float32, s) for n, s in scratch_shapes(q.shape, config).items()}
    lse = Shaped(torch.float32, (b, hq, nq))
    return plan(q, k, k, Shaped(dt, q.shape), lse, Shaped(dt, q.shape), Shaped(dt, q.shape),
                Shaped(dt, k.shape), Shaped(dt, k.shape), scratch, config, causal=causal,
                scale=0.125, dlse=lse if dlse else None, **mods)


def test_a_window_and_a_softcap_plan_their_constexprs_and_the_tanhs_scale() -> None:
    """A causal window passes ``window_left`` and ``WINDOW``; a softcap ``SOFTCAP`` = cap x
    log2 e (a constexpr: one compile a cap) with ``qk_scale`` = scale / cap (the tanh's
    argument, as the Gluon forward's); ``sm_scale`` stays the scale (dK's and dQ's). A plain
    plan passes neither (the kernel as it was), and the grid is the same."""
    log2e = 1.4426950408889634
    plain = _plan(2, 8, 2, 333, 517, 128, DEFAULT_CONFIG)["main"]
    both = _plan(2, 8, 2, 333, 517, 128, DEFAULT_CONFIG, window_left=255, softcap=30.0)["main"]
    assert not {"WINDOW", "window_left", "SOFTCAP"} & set(plain[2])
    assert plain[1][-3] == pytest.approx(0.125 * log2e) and plain[1][-2] == 0.125
    assert both[2]["WINDOW"] is True and both[2]["window_left"] == 255
    assert both[2]["SOFTCAP"] == pytest.approx(30.0 * log2e)
    assert both[1][-3] == pytest.approx(0.125 / 30.0) and both[1][-2] == 0.125
    assert both[3] == plain[3]
    window_only = _plan(2, 8, 2, 333, 517, 64, DEFAULT_CONFIG, window_left=0)["main"]
    assert window_only[2]["window_left"] == 0 and "SOFTCAP" not in window_only[2]
    assert window_only[1][-3] == pytest.approx(0.125 * log2e)
    launches = SPEC.warmup_launches(_problem(128, True, window_left=100, softcap=50.0),
                                    DEFAULT_CONFIG)
    assert launches[1][2]["window_left"] == 100
    assert launches[1][2]["SOFTCAP"] == pytest.approx(50.0 * log2e)


def test_the_plan_sizes_the_grids_and_the_padded_scratch_from_the_shapes() -> None:
    config = _config(BLOCK_M=128, BLOCK_N=128, NUM_CONSUMERS=2)
    # GQA 4:1, ragged Nq 197 (padded to 256), Nk 1000 (8 key blocks, the last ragged)
    shapes = scratch_shapes((3, 8, 197, 64), config)
    assert shapes == {"lse2": (24, 256), "delta": (24, 256), "dq_acc": (24 * 256, 64)}
    launches = _plan(3, 8, 2, 197, 1000, 64, config)
    assert list(launches) == ["preprocess", "main", "convert"]
    assert launches["preprocess"][3] == (256 // PRE_BLOCK, 24)
    assert launches["main"][3] == (math.ceil(1000 / 128), 3 * 2)  # key blocks x batch x kv heads
    assert launches["convert"][3] == (math.ceil(197 / PRE_BLOCK), 24)
    kernel, args, kwargs, grid = launches["main"]
    q_desc, k_desc, v_desc, do_desc = args[:4]
    assert q_desc.block_shape == do_desc.block_shape == [128, 64]
    assert k_desc.block_shape == v_desc.block_shape == [128, 64]  # the CTA's keys, once
    assert q_desc.shape == [3 * 8 * 197, 64] and k_desc.shape == [3 * 2 * 1000, 64]
    assert kwargs["CAUSAL"] and not kwargs["Q_BSHD"] and not kwargs["KV_BSHD"]
    assert kwargs["maxnreg"] * 3 * 128 <= 65536
    assert kwargs["CONSUMER_REGS"] == 240 and kwargs["PRODUCER_REGS"] == 24
    seqlen_q, seqlen_k, pad = args[12:15]
    assert (seqlen_q, seqlen_k, pad) == (197, 1000, 256)
    assert args[-3] == pytest.approx(0.125 * 1.4426950408889634) and args[-2] == 0.125
    assert args[-1] == 0 and not kwargs["LPT"]  # no sections
    # MQA, one consumer over 64 keys, no dLSE vs with one
    one = _plan(1, 4, 1, 77, 133, 128, _config(BLOCK_N=64, NUM_CONSUMERS=1), causal=False)
    assert one["main"][3] == (3, 1) and one["main"][1][1].block_shape == [64, 128]
    assert not one["preprocess"][2]["HAS_DLSE"]
    assert _plan(1, 4, 1, 77, 133, 128, DEFAULT_CONFIG, dlse=True)["preprocess"][2]["HAS_DLSE"]


def test_expand_gqa_plans_a_cta_per_query_head_reading_its_groups_kv() -> None:
    """EXPAND_GQA 1 on GQA 4:1: the main launch as MHA over the query heads (a CTA per key
    block and query head, ``heads_kv`` = ``heads_q``, sections counting one query head),
    ``KV_GROUP`` 4 for the producer's K/V head, dK and dV one a query head (the caller sums
    each group); EXPAND_GQA 0 passes no KV_GROUP (the kernel as it was)."""
    b, hq, hkv, n, d = 2, 32, 8, 4096, 128
    dt = torch.bfloat16
    q, k, dkv = (Shaped(dt, (b, h, n, d)) for h in (hq, hkv, hq))
    config = _config(EXPAND_GQA=1, LPT=1)
    scratch = {name: Shaped(torch.float32, shape)
               for name, shape in scratch_shapes(q.shape, config).items()}
    launches = plan(q, k, k, Shaped(dt, q.shape), Shaped(torch.float32, q.shape[:3]),
                    Shaped(dt, q.shape), Shaped(dt, q.shape), dkv, dkv, scratch, config,
                    causal=True, scale=0.125)
    _, args, kwargs, grid = launches["main"]
    assert kwargs["KV_GROUP"] == 4 and grid == (32 * b * hq, 1)
    assert args[args.index(hq) + 1] == hq  # heads_q, then heads_kv: the query heads
    assert args[-1] == 2  # sections of 4 query heads (4 MB each of a one-head walk's 16)
    plain = _plan(b, hq, hkv, n, n, d, _config(LPT=1))["main"]
    assert "KV_GROUP" not in plain[2] and plain[3] == (32 * b * hkv, 1)
    with pytest.raises(AssertionError, match="per query head"):
        plan(q, k, k, Shaped(dt, q.shape), Shaped(torch.float32, q.shape[:3]),
             Shaped(dt, q.shape), Shaped(dt, q.shape), Shaped(dt, k.shape),
             Shaped(dt, k.shape), scratch, config, causal=True, scale=0.125)


def test_expand_gqa_serves_dense_gqa_problems_only() -> None:
    """The knob is refused where it would change nothing (MHA) or where the kernel walks
    packed groups (a packed batch), and accepted on dense GQA with its twin's table entry."""
    config = _config(EXPAND_GQA=1)
    mha, gqa = (AttentionProblem(2, 32, hkv, 1000, 1000, 128, True, "bf16") for hkv in (32, 8))
    packed = AttentionProblem.from_lengths([300, 700], None, heads_q=32, heads_kv=8,
                                           head_dim=128, causal=True, dtype="bf16")
    assert "EXPAND_GQA" in space.check(config, mha, H100)
    assert "EXPAND_GQA" in space.check(config, packed, H100)
    assert space.check(config, gqa, H100) is None
    assert space.entry_key(128, True, config) == space.entry_key(128, True, _config())


def test_the_longest_first_order_is_one_grid_dimension_in_sections_that_fit_l2() -> None:
    """LPT 1: ``key blocks x batch x kv heads`` CTAs on one grid axis, in sections of the
    most KV heads whose Q, dO and fp32 dQ accumulator fit the L2 budget (FA3's backward
    scheduler's count), a power of two dividing the batch's KV heads (the kernel takes its
    log2); a config without the knob runs LPT 0."""
    from flashtune.kernel_templates.attn_bwd_gluon.launcher import (
        L2_BUDGET,
        L2_BUDGET_ONE_HEAD,
        lpt_section,
    )

    # Q and dO (bf16) and the dQ accumulator (fp32) of a 4-head group, N 2048, D128
    per_head = 4 * 2048 * 128 * (2 + 2 + 4)
    assert L2_BUDGET // per_head == 5
    assert lpt_section(64, 4, 2048, 128) == 4  # 5 fit: the power of two below
    assert lpt_section(64, 4, 4096, 128) == 2  # 2.5 fit (Q and dO alone: 5)
    assert lpt_section(12, 1, 512, 64) == 4  # all fit: the most that divides 12
    assert lpt_section(7, 1, 512, 64) == 1  # an odd count: one head a section
    assert lpt_section(64, 8, 131072, 128) == 1  # not even one head fits
    # a walk of one query head (MHA, EXPAND_GQA) fills L2_BUDGET_ONE_HEAD: at N 2048 D128,
    # 2 MB a head, 8 of the 16 MiB where a group's walk would take 16 of its 40
    assert L2_BUDGET_ONE_HEAD == 16 << 20 < L2_BUDGET
    assert lpt_section(64, 1, 2048, 128) == 8
    assert lpt_section(64, 2, 1024, 128) == 16
    launches = _plan(2, 32, 8, 4096, 4096, 128, _config(LPT=1))
    kernel, args, kwargs, grid = launches["main"]
    assert kwargs["LPT"] and grid == (32 * 2 * 8, 1)
    assert args[-1] == 1  # sections of 2 of the 16 KV heads
    assert _plan(2, 32, 8, 4096, 4096, 128, DEFAULT_CONFIG)["main"][3] == (32, 16)
    with pytest.raises(ConfigError, match="LPT must be 0 or 1"):
        check_config(_config(LPT=2))
    assert space.SPACE.validate(DEFAULT_CONFIG) == {**DEFAULT_CONFIG, "LPT": 0, "PERSISTENT": 0,
                                                    "DQ_TMA": 0, "TMA_STORE": 0,
                                                    "EXPAND_GQA": 0}


def test_the_persistent_plan_runs_the_grid_tiles_on_one_cta_an_sm() -> None:
    """PERSISTENT 1: a 1-D grid of one CTA an SM (132 for a shape-only stand-in), fewer where
    there are fewer tiles, and the tile count the CTAs stride over; without it the grid
    kernel as it was (no tile count, no PERSISTENT); packed batches refuse it."""
    from flashtune.kernel_templates.attn_bwd_gluon.launcher import PLANNING_SMS, plan_packed
    from flashtune.kernel_templates.registry import hash_files

    for lpt in (0, 1):
        kernel, args, kwargs, grid = _plan(2, 32, 8, 4096, 4096, 128,
                                           _config(PERSISTENT=1, LPT=lpt))["main"]
        assert kwargs["PERSISTENT"] and kwargs["n_tiles"] == 32 * 2 * 8
        assert grid == (PLANNING_SMS, 1) and bool(kwargs["LPT"]) == bool(lpt)
    # the grid's helper is this launcher's own: no other template's files in its hash
    assert {p.parent.name for p in hash_files(FOLDER / "kernel.py", FOLDER / "launcher.py")} \
        == {"attn_bwd_gluon"}
    small = _plan(1, 1, 1, 1000, 1000, 128, _config(PERSISTENT=1))["main"]
    assert small[2]["n_tiles"] == 8 and small[3] == (8, 1)
    grid_kwargs = _plan(1, 1, 1, 1000, 1000, 128, DEFAULT_CONFIG)["main"][2]
    assert "PERSISTENT" not in grid_kwargs and "n_tiles" not in grid_kwargs
    with pytest.raises(ConfigError, match="PERSISTENT must be 0 or 1"):
        check_config(_config(PERSISTENT=2))
    # DQ_TMA: the accumulator's rows through a descriptor of one consumer's slice
    tma = _plan(2, 8, 2, 197, 300, 128, _config(DQ_TMA=1))["main"][2]
    assert tma["DQ_TMA"] and tma["dq_desc"].block_shape == [64, 64]
    assert tma["dq_desc"].shape == [2 * 8 * 256, 128]  # Nq padded to BLOCK_M (256)
    assert "dq_desc" not in grid_kwargs and "DQ_TMA" not in grid_kwargs
    dt = torch.bfloat16
    q, k = Shaped(dt, (300, 4, 64)), Shaped(dt, (300, 2, 64))
    with pytest.raises(ConfigError, match="PERSISTENT serves dense batches only"):
        plan_packed(q, k, k, q, Shaped(torch.float32, (4, 300)), q, q, k, k, {},
                    _config(PERSISTENT=1), causal=True, scale=0.125, cu_seqlens_q=None,
                    cu_seqlens_k=None, max_seqlen_q=200, max_seqlen_k=200)


def test_the_tma_store_plan_describes_dk_and_dv_as_k_is_seen() -> None:
    """TMA_STORE 1: dK's and dV's descriptors over K's 2-D view (contiguous: (B * Hkv * Nk,
    D); (B, N, H, D) storage: (B * Nk, Hkv * D); packed: (total, Hkv * D)), a consumer's
    rows a block; without it, no descriptors and the kernel as it was."""
    from flashtune.kernel_templates.attn_bwd_gluon.launcher import plan_packed

    for consumers, block in ((2, 128), (1, 64)):
        config = _config(TMA_STORE=1, NUM_CONSUMERS=consumers, BLOCK_N=block)
        kwargs = _plan(2, 8, 2, 197, 300, 128, config)["main"][2]
        assert kwargs["TMA_STORE"]
        for name in ("dk_desc", "dv_desc"):
            assert kwargs[name].block_shape == [64, 128]
            assert kwargs[name].shape == [2 * 2 * 300, 128]
    plain = _plan(2, 8, 2, 197, 300, 128, DEFAULT_CONFIG)["main"][2]
    assert not {"TMA_STORE", "dk_desc", "dv_desc"} & set(plain)
    x = torch.empty(2, 197, 4, 64, dtype=torch.bfloat16).transpose(1, 2)
    k = torch.empty(2, 300, 2, 64, dtype=torch.bfloat16).transpose(1, 2)
    scratch = {n: torch.empty(s) for n, s in scratch_shapes(tuple(x.shape), DEFAULT_CONFIG).items()}
    dk = torch.empty_like(k)
    kwargs = plan(x, k, k, x, torch.empty(2, 4, 197), x, x, dk, dk, scratch,
                  _config(TMA_STORE=1), causal=False, scale=0.125)["main"][2]
    assert kwargs["KV_BSHD"] and kwargs["dk_desc"].shape == [2 * 300, 2 * 64]
    total_q, total_k = 500, 700
    q = torch.empty(total_q, 4, 64, dtype=torch.bfloat16)
    kp = torch.empty(total_k, 2, 64, dtype=torch.bfloat16)
    cu_q = torch.tensor([0, 200, 500], dtype=torch.int32)
    cu_k = torch.tensor([0, 300, 700], dtype=torch.int32)
    scratch = {n: torch.empty(s) for n, s in scratch_shapes((2, 4, 300, 64),
                                                            DEFAULT_CONFIG).items()}
    kwargs = plan_packed(q, kp, kp, q, torch.empty(4, total_q), q, q, kp, kp, scratch,
                         _config(TMA_STORE=1), causal=True, scale=0.125, cu_seqlens_q=cu_q,
                         cu_seqlens_k=cu_k, max_seqlen_q=300, max_seqlen_k=400)["main"][2]
    assert kwargs["VARLEN"] and kwargs["dv_desc"].shape == [total_k, 2 * 64]
    with pytest.raises(ConfigError, match="TMA_STORE must be 0 or 1"):
        check_config(_config(TMA_STORE=2))


def test_the_d256_plan_splits_the_head_dim_between_the_consumers() -> None:
    """D256 (the consumers split the head dim): a CTA per 64 keys and KV head (longest
    first: one grid dimension), no dQ descriptor (the consumers add dQ themselves), and
    with TMA_STORE dK's and dV's blocks a consumer's half of every key's row."""
    config = _config(**SPLIT_D, TMA_STORE=1)
    _, _, kwargs, grid = _plan(2, 8, 2, 197, 300, 256, config)["main"]
    assert grid == (math.ceil(300 / 64), 2 * 2) and kwargs["HEAD_D"] == 256
    assert (kwargs["BLOCK_M"], kwargs["BLOCK_N"], kwargs["NUM_CONSUMERS"]) == (64, 64, 2)
    assert "DQ_TMA" not in kwargs and "PERSISTENT" not in kwargs
    for name in ("dk_desc", "dv_desc"):
        assert kwargs[name].block_shape == [64, 128]
        assert kwargs[name].shape == [2 * 2 * 300, 256]
    _, _, kwargs, grid = _plan(2, 8, 2, 197, 300, 256, _config(**SPLIT_D, LPT=1))["main"]
    assert grid == (math.ceil(300 / 64) * 2 * 2, 1) and kwargs["LPT"]


def test_the_persistent_grid_is_one_cta_an_sm_of_the_tensors_gpu(monkeypatch) -> None:
    """On a GPU the grid takes that GPU's SM count (an H100 PCIe's 114 here, asked by
    index: the tensor's device, or the current one for a bare ``cuda`` device)."""
    from types import SimpleNamespace

    from flashtune.kernel_templates.attn_bwd_gluon import launcher

    asked: list[int] = []
    monkeypatch.setattr(launcher, "sm_count", lambda index: asked.append(index) or 114)
    monkeypatch.setattr(launcher.torch.cuda, "current_device", lambda: 3)
    on_gpu = SimpleNamespace(device=torch.device("cuda", 1))
    assert launcher.persistent_ctas(on_gpu, 1000) == 114
    assert launcher.persistent_ctas(on_gpu, 7) == 7
    assert launcher.persistent_ctas(SimpleNamespace(device=torch.device("cuda")), 500) == 114
    assert asked == [1, 1, 3]
    assert launcher.persistent_ctas(Shaped(torch.bfloat16, (1, 1, 8, 64)), 500) \
        == launcher.PLANNING_SMS


def test_bshd_storage_is_read_through_its_own_descriptor_shape() -> None:
    x = torch.empty(2, 197, 4, 64, dtype=torch.bfloat16).transpose(1, 2)  # (B, H, N, D) view
    assert layout(x) == "bshd" and layout(x.contiguous()) == "bhsd"
    assert layout(torch.empty(2, 4, 197, 80)[..., :64]) is None  # rows not dense: copied
    k = torch.empty(2, 1, 300, 64, dtype=torch.bfloat16)
    scratch = {n: torch.empty(s) for n, s in scratch_shapes(tuple(x.shape), DEFAULT_CONFIG).items()}
    launches = plan(x, k, k, x, torch.empty(2, 4, 197), x, x, k, k, scratch, DEFAULT_CONFIG,
                    causal=False, scale=0.125)
    args, kwargs = launches["main"][1], launches["main"][2]
    assert kwargs["Q_BSHD"] and not kwargs["KV_BSHD"]
    assert args[0].shape == [2 * 197, 4 * 64] and args[3].shape == [2 * 197, 4 * 64]


def test_the_warmup_launches_are_the_three_planned() -> None:
    p = _problem(64, True, hq=8, hkv=2, nq=333, nk=517)
    launches = SPEC.warmup_launches(p, DEFAULT_CONFIG)
    names = [launch[0].fn.__name__ if hasattr(launch[0], "fn") else launch[0].__name__
             for launch in launches]
    assert names == ["gluon_attn_bwd_preprocess", "gluon_attn_bwd_kernel",
                     "gluon_attn_bwd_convert_dq"]
    assert launches[1][3] == (math.ceil(517 / 128), 2 * 2)


# -- sm_90 compiles (CPU) ----------------------------------------------------------------------

def _compile(cases: list[dict]) -> list[dict]:
    # in a process of its own: this one may run triton under the interpreter
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-m", "flashtune.kernel_templates.attn_bwd_gluon",
                           json.dumps(cases)], capture_output=True, check=False, text=True,
                          env=env, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def test_the_causal_mask_costs_one_compare_and_one_select_a_score() -> None:
    """The D128 causal default (64 x 128 tiles: a consumer's 64 keys by 64 queries, 32
    scores a thread), its sm_90a SASS: each consumer's main loop holds one masked section
    with 32 compares and 32 selects, the causal test alone (a key past the end is past
    every query row's diagonal); testing the keys' end too made it 32 more selects (116
    instructions, where it is 86-87 now), and the loops carried 6 and 14 spill reloads a
    step, where they carry at most 8 now."""
    (got,) = _compile([dict(BLOCK_M=64, BLOCK_N=128, NUM_STAGES=2, NUM_CONSUMERS=2,
                            TMA_STORE=1, head_dim=128, causal=True, loops=True)])
    assert len(got["loops"]) == 2, got["loops"]  # one a consumer
    for loop in got["loops"]:
        assert loop["opcodes"]["HGMMA"] == 32  # S, dP, dV, dK and dQ's wgmmas, unrolled
        (mask,) = loop["sections"]
        assert mask["opcodes"]["ISETP"] == 32 and mask["opcodes"]["FSEL"] == 32, mask
        assert loop["opcodes"].get("LDL", 0) <= 8, loop["opcodes"]


def test_the_d64_diagonal_loop_shifts_its_keys_not_its_query_rows() -> None:
    """The D64 causal default walks the diagonal's steps in a loop of their own (a
    consumer's 64 keys by 64 queries, 32 scores a thread, 2 keys and 16 query rows a
    thread). Its mask compares ``key - shift <= row``: the shift lands on the 2 keys, where
    ``key <= row + shift`` computed 16 query positions a step (19 IADD3, 16 SEL and 15 SHF
    among 557 / 572 instructions; 475 / 476 now). Each consumer's two loops: the unmasked
    one with no compare, the diagonal one with the mask's 32 compares and 32 selects."""
    (got,) = _compile([dict(head_dim=64, causal=True, loops=True)])
    assert got["config"] == dict(BLOCK_M=64, BLOCK_N=128, NUM_STAGES=2, NUM_CONSUMERS=2)
    plain, diagonal = got["loops"][0::2], got["loops"][1::2]
    assert len(got["loops"]) == 4, got["loops"]
    for loop in plain:
        assert "ISETP" not in loop["opcodes"] and "FSEL" not in loop["opcodes"], loop
    for loop in diagonal:
        ops = loop["opcodes"]
        assert ops["HGMMA"] == 24 and ops["ISETP"] == 32 and ops["FSEL"] == 32, ops
        assert not {"IADD3", "SEL", "SHF", "LDL"} & set(ops), ops
        assert loop["instructions"] <= 490, loop


def test_each_structural_variant_compiles_for_sm90_within_its_budget() -> None:
    """One consumer (D128, causal), two consumers (D64, (B, N, H, D) storage; D128 causal;
    longest first; dK and dV by TMA; both): no spill beyond the allowance, shared memory within 227 KiB, the register split, a wgmma
    left in flight, dQ by vector fp32 atomics; the contiguous ones as the table says."""
    cases = [
        dict(BLOCK_M=64, BLOCK_N=64, NUM_STAGES=2, NUM_CONSUMERS=1, head_dim=128, causal=True),
        dict(BLOCK_M=64, BLOCK_N=128, NUM_STAGES=2, NUM_CONSUMERS=2, head_dim=64, causal=False,
             layout="bshd"),
        dict(BLOCK_M=64, BLOCK_N=128, NUM_STAGES=2, NUM_CONSUMERS=2, head_dim=128, causal=True),
        dict(BLOCK_M=64, BLOCK_N=128, NUM_STAGES=2, NUM_CONSUMERS=2, LPT=1, head_dim=128,
             causal=True),
        dict(BLOCK_M=64, BLOCK_N=128, NUM_STAGES=2, NUM_CONSUMERS=2, TMA_STORE=1, head_dim=128,
             causal=True),
        # both: 268 B of spill while the epilogue from registers summed a row's and its
        # columns' offsets before adding them to the base (a 64-bit address an element)
        dict(BLOCK_M=64, BLOCK_N=128, NUM_STAGES=2, NUM_CONSUMERS=2, LPT=1, TMA_STORE=1,
             head_dim=128, causal=True),
    ]
    got = _compile([dict(c) for c in cases])
    assert len(got) == len(cases)
    table = space.load_table()
    for case, g in zip(cases, got, strict=True):
        assert sum(g["spill_store_bytes"]) <= space.SPILL_LIMIT, g
        assert g["shared"] <= space.SMEM_LIMIT, g
        assert g["warps"] == 4 + 4 * case["NUM_CONSUMERS"], g  # + the producer's warpgroup
        assert ["dec", "24"] in g["setmaxnreg"], g
        if case["NUM_CONSUMERS"] == 2:
            assert ["inc", "240"] in g["setmaxnreg"], g
        assert 1 in g["wgmma_wait_depths"], g  # dP^T in flight while P^T is computed
        assert "atom.global.gpu.relaxed.add.v4.f32" in g["atomics"], g
        # TMA_STORE: dK and dV by a TMA store each in each consumer's code
        assert g["tma_stores"] == (2 * case["NUM_CONSUMERS"] if case.get("TMA_STORE") else 0), g
        if g["layout"] == "bhsd":
            entry = table[space.entry_key(case["head_dim"], case["causal"], g["config"])]
            assert (entry.shared, entry.spill_bytes) == (g["shared"],
                                                         sum(g["spill_store_bytes"])), g


def test_the_d256_kernel_splits_the_head_dim_and_adds_dq_itself() -> None:
    """D256's split-D kernel for sm_90 (causal, longest first, dK and dV by TMA; a window
    and a softcap): two consumer warpgroups and the producer's warp (no dQ writer), shared
    memory within 227 KiB (the ring of two Q and dO tiles, K, V, two P^T and two dS^T
    tiles: 225 KiB), spills within the allowance, dQ added by the consumers with ``v2``
    fp32 atomics (the wgmma accumulator's two adjacent columns), a TMA store each of its
    halves of dK and dV, and a consumer loop's 12 wgmmas (S^T and dP^T over 4 K-steps of
    64 each, the dV and dK of its columns, dQ in two slices of 64 columns... as unrolled by
    the compiler: at least 10 HGMMA), its scores masked behind one branch."""
    base = dict(**SPLIT_D, LPT=1, TMA_STORE=1, head_dim=256, causal=True, loops=True)
    plain, mods = _compile([base, dict(base, window=True, softcap=50.0)])
    for g in (plain, mods):
        assert g["shared"] <= space.SMEM_LIMIT and sum(g["spill_store_bytes"]) \
            <= space.SPILL_LIMIT, g
        assert g["warps"] == 4 + 4 + 4, g  # consumer 0, consumer 1, the producer's group
        assert ["dec", "24"] in g["setmaxnreg"] and ["inc", "240"] in g["setmaxnreg"], g
        assert g["atomics"] == ["atom.global.gpu.relaxed.add.v2.f32"], g
        assert g["tma_stores"] == 4, g
        assert len(g["loops"]) == 2, g["loops"]  # one a consumer
        for loop in g["loops"]:
            assert loop["opcodes"]["HGMMA"] >= 10 and len(loop["sections"]) == 1, loop
    entry = space.load_table()[space.entry_key(256, True, plain["config"])]
    assert (entry.shared, entry.spill_bytes) == (plain["shared"],
                                                 sum(plain["spill_store_bytes"]))


def test_a_window_and_a_softcap_compile_for_sm90_within_their_costs() -> None:
    """The window's and the softcap's kernels for sm_90 (the table holds the plain ones):
    the D128 causal default with a window keeps its one masked section a consumer, 32
    compares and 32 selects (the window's edge one unsigned compare of the distance), and
    spills at most 160 B more than without it (104 -> 260 B in the loops' reloads: the
    tuner's timing judges it); at D64 neither modification spills more than 8 B more; a
    softcap's loop runs three MUFU ops a score where plain scores run one (the exp2, the
    forward's tanh, the log2 that reads it back from P)."""
    d128 = dict(BLOCK_M=64, BLOCK_N=128, NUM_STAGES=2, NUM_CONSUMERS=2, LPT=1, TMA_STORE=1,
                head_dim=128, causal=True, loops=True)
    d64 = dict(head_dim=64, causal=True, loops=True)
    plain128, window128, plain64, window64, cap64 = _compile(
        [d128, dict(d128, window=True), d64, dict(d64, window=True), dict(d64, softcap=30.0)])
    assert (window128["window"], cap64["softcap"]) == (True, 30.0)
    assert not plain128["window"] and plain128["softcap"] == 0.0

    def spill(g: dict) -> int:
        return sum(g["spill_store_bytes"])
    assert spill(window128) <= spill(plain128) + 160, (spill(plain128), spill(window128))
    assert window128["shared"] == plain128["shared"]
    assert len(window128["loops"]) == 2
    for loop in window128["loops"]:
        (mask,) = loop["sections"]
        assert mask["opcodes"]["ISETP"] == 32 and mask["opcodes"]["FSEL"] == 32, mask
    assert spill(window64) <= spill(plain64) + 8 and spill(cap64) <= spill(plain64) + 8
    # the window runs D64's causal walk in one loop (its edge is masked too): 2 loops, not 4
    assert len(plain64["loops"]) == 4 and len(window64["loops"]) == 2
    plain_mufu = plain64["loops"][0]["opcodes"]["MUFU"]
    assert [loop["opcodes"]["MUFU"] for loop in cap64["loops"][0::2]] == [3 * plain_mufu] * 2


# -- numerics on the GPU (sm_90) ---------------------------------------------------------------

GPU_CASES = [  # (batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim, causal)
    (2, 4, 4, 1000, 1000, 128, False),  # ragged: 1000 is no multiple of a tile
    (2, 4, 4, 1000, 1000, 64, True),
    (1, 8, 2, 77, 133, 64, True),  # GQA 4:1, causal Nq < Nk
    (2, 8, 2, 333, 517, 128, True),  # GQA 4:1, causal Nq < Nk
    (1, 4, 1, 384, 130, 128, True),  # MQA, causal Nq > Nk: rows that see no key
    (1, 6, 1, 197, 197, 64, False),  # MQA, ViT's 197
    (32, 12, 12, 197, 197, 64, False),  # B x H large (384), short N
    (1, 1, 1, 1000, 1000, 128, True),  # B x H = 1
    (1, 2, 2, 1, 1000, 64, False),  # one query
]


def _rand(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(*shape, device="cuda", dtype=dtype)


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool):
    from flashtune.core.device import cuda_device

    fwd = get_template("attn_fwd")
    p = AttentionProblem.from_tensors(q, k, causal=causal)
    return fwd.launcher(q, k, v, fwd.default_config(p, cuda_device()), causal=causal,
                        return_lse=True)


def _valid_configs(p: AttentionProblem) -> list[dict[str, int]]:
    from flashtune.core.device import cuda_device

    return [c for c in space.SPACE if space.check(c, p, cuda_device()) is None]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", GPU_CASES,
                         ids=lambda s: "b{}h{}:{}q{}k{}d{}{}".format(*s[:6], "c" if s[6] else ""))
def test_gradients_match_the_reference_for_every_valid_config(case, dtype) -> None:
    b, hq, hkv, nq, nk, d, causal = case
    torch.manual_seed(0)
    q, k, v = _rand(b, hq, nq, d, dtype=dtype), _rand(b, hkv, nk, d, dtype=dtype), \
        _rand(b, hkv, nk, d, dtype=dtype)
    do = _rand(b, hq, nq, d, dtype=dtype)
    out, lse = _forward(q, k, v, causal)
    p = AttentionProblem.from_tensors(q, k, causal=causal)
    configs = _valid_configs(p)
    assert configs
    from tests.helpers import grad_references

    refs = grad_references(q, k, v, do, causal=causal)
    for config in configs:
        got = SPEC.launcher(q, k, v, out, lse, do, config, causal=causal)
        assert_grads_close(got, q, k, v, do, causal=causal, refs=refs)


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES[:8],
                         ids=lambda s: "b{}h{}:{}q{}k{}d{}{}".format(*s[:6], "c" if s[6] else ""))
def test_the_persistent_launch_matches_the_reference(case) -> None:
    """PERSISTENT 1: one CTA an SM (fewer where there are fewer tiles) walking the grid's
    tiles, each CTA several of them (B x H large) or one (B x H = 1), in both orders and
    with one or two consumers; ring slots and barrier phases run on across a CTA's tiles,
    so a wrong phase deadlocks or reads another tile's K, V, Q or dO."""
    _check_configs(case, torch.bfloat16, 3, [
        _config(PERSISTENT=1, **knobs)
        for knobs in ({}, {"LPT": 1}, {"BLOCK_N": 64, "NUM_CONSUMERS": 1},
                      {"NUM_STAGES": 3, "BLOCK_N": 64, "NUM_CONSUMERS": 1, "LPT": 1})])


def _check_configs(case: tuple, dtype: torch.dtype, seed: int,
                   configs: list[dict[str, int]]) -> None:
    """Each config's gradients for ``case``'s random inputs against the float64 reference."""
    b, hq, hkv, nq, nk, d, causal = case
    torch.manual_seed(seed)
    q, k, v = _rand(b, hq, nq, d, dtype=dtype), _rand(b, hkv, nk, d, dtype=dtype), \
        _rand(b, hkv, nk, d, dtype=dtype)
    do = _rand(b, hq, nq, d, dtype=dtype)
    out, lse = _forward(q, k, v, causal)
    from tests.helpers import grad_references

    refs = grad_references(q, k, v, do, causal=causal)
    for config in configs:
        got = SPEC.launcher(q, k, v, out, lse, do, config, causal=causal)
        assert_grads_close(got, q, k, v, do, causal=causal, refs=refs)


DIAGONAL_LAST_CASES = [  # D64 causal: the walks run each query head's diagonal last
    (2, 4, 4, 1000, 1000, 64, True),  # ragged: the last key block runs past the end
    (1, 8, 2, 77, 133, 64, True),  # GQA 4:1, Nq < Nk: a CTA walks four heads' unmasked
    # blocks, then their four diagonals
    (1, 4, 1, 384, 130, 64, True),  # MQA, Nq > Nk: rows that see no key
    (2, 6, 3, 333, 517, 64, True),  # GQA 2:1, ragged, Nq < Nk
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", DIAGONAL_LAST_CASES,
                         ids=lambda s: "b{}h{}:{}q{}k{}d{}c".format(*s[:6]))
def test_d64_causal_walks_mask_the_diagonal_last_in_every_tile_shape(case) -> None:
    """At D64 a causal walk runs every query head's unmasked blocks from the last down, then
    the heads' diagonal blocks in a loop of their own, with the mask
    (``kernel.DIAGONAL_LAST_MAX_D``), and the producer and the dQ writer walk alike
    (``kernel._step_block``): every tile shape the predicate accepts
    (query rows a step, keys a CTA, one or two consumers, two or three stages; the other
    knobs are the tests above) against the float64 reference, where a wrong count of masked
    steps lets a query see a later key or a ring slot pair with another step's Q."""
    b, hq, hkv, nq, nk, d, causal = case
    p = AttentionProblem(b, hq, hkv, nq, nk, d, causal, "bf16")
    configs = [c for c in _valid_configs(p)
               if all(c[k] == 0 for k in set(c) - {"BLOCK_M", "BLOCK_N", "NUM_STAGES",
                                                   "NUM_CONSUMERS"})]
    assert {(c["BLOCK_M"], c["NUM_CONSUMERS"]) for c in configs} >= {(64, 2), (64, 1)}
    _check_configs(case, torch.bfloat16, 9, configs)


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES,
                         ids=lambda s: "b{}h{}:{}q{}k{}d{}{}".format(*s[:6], "c" if s[6] else ""))
def test_dq_by_tma_reduce_adds_matches_the_reference(case) -> None:
    """DQ_TMA 1: each step's dQ partial added by TMA bulk reduce-adds from shared memory
    (one a consumer's slice, two messages each), the buffer handed back only once they have
    read it; with two and one consumers, and under the persistent launch."""
    _check_configs(case, torch.float16, 4, [
        _config(DQ_TMA=1, **knobs)
        for knobs in ({}, {"BLOCK_N": 64, "NUM_CONSUMERS": 1}, {"PERSISTENT": 1, "LPT": 1})])


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES,
                         ids=lambda s: "b{}h{}:{}q{}k{}d{}{}".format(*s[:6], "c" if s[6] else ""))
def test_dk_and_dv_stored_by_tma_match_the_reference(case) -> None:
    """TMA_STORE 1: a whole block's dK and dV through the consumer's K and V rows in shared
    memory by TMA stores (dK only once every consumer's dS K has read those rows), a block
    past the keys' end from registers (the ragged and short cases); two and one consumers,
    dQ by TMA too, longest first, and under the persistent launch, where the next tile's K
    and V load only once the stores have read the rows."""
    _check_configs(case, torch.bfloat16, 5, [
        _config(TMA_STORE=1, **knobs)
        for knobs in ({}, {"BLOCK_N": 64, "NUM_CONSUMERS": 1}, {"DQ_TMA": 1}, {"LPT": 1},
                      {"PERSISTENT": 1, "LPT": 1}, {"PERSISTENT": 1, "NUM_STAGES": 3,
                                                    "BLOCK_N": 64, "NUM_CONSUMERS": 1})])


@pytest.mark.gpu
def test_dk_and_dv_stored_by_tma_in_bshd_storage() -> None:
    """TMA_STORE 1 with (B, N, H, D) storage: dK and dV through K's (B * N, H * D) view, at
    the KV head's columns; GQA 4:1, a ragged length."""
    torch.manual_seed(6)
    b, hq, hkv, n, d = 2, 8, 2, 333, 128
    q, do = (torch.randn(b, n, hq, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
             for _ in range(2))
    k, v = (torch.randn(b, n, hkv, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
            for _ in range(2))
    out, lse = _forward(q, k, v, False)
    for knobs in ({}, {"PERSISTENT": 1}):
        got = SPEC.launcher(q, k, v, out, lse, do, _config(TMA_STORE=1, **knobs))
        assert_grads_close(got, q, k, v, do, causal=False)
        assert got[1].stride() == k.stride() and got[2].stride() == v.stride()


@pytest.mark.gpu
@pytest.mark.parametrize("case", [c for c in GPU_CASES if c[1] > c[2]],
                         ids=lambda s: "b{}h{}:{}q{}k{}d{}{}".format(*s[:6], "c" if s[6] else ""))
def test_expand_gqa_matches_the_reference(case) -> None:
    """EXPAND_GQA 1 (a CTA per query head, dK and dV summed over the group after) on the GQA
    and MQA cases: with the grid and longest-first orders, the TMA stores and dQ by TMA, and
    under the persistent launch; and in (B, N, H, D) storage, where the per-query-head dK
    and dV take K's layout."""
    _check_configs(case, torch.bfloat16, 7, [
        _config(EXPAND_GQA=1, **knobs)
        for knobs in ({}, {"LPT": 1, "TMA_STORE": 1}, {"DQ_TMA": 1, "TMA_STORE": 1},
                      {"PERSISTENT": 1, "LPT": 1, "TMA_STORE": 1})])
    b, hq, hkv, nq, nk, d, causal = case
    torch.manual_seed(8)
    q, do = (torch.randn(b, nq, hq, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
             for _ in range(2))
    k, v = (torch.randn(b, nk, hkv, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
            for _ in range(2))
    out, lse = _forward(q, k, v, causal)
    got = SPEC.launcher(q, k, v, out, lse, do, _config(EXPAND_GQA=1, TMA_STORE=1),
                        causal=causal)
    assert_grads_close(got, q, k, v, do, causal=causal)
    assert got[1].stride() == k.stride() and got[2].stride() == v.stride()


@pytest.mark.gpu
@pytest.mark.parametrize("budget", [1, 800_000], ids=["one-head-sections", "two-head-sections"])
def test_the_longest_first_order_covers_every_tile_once(monkeypatch, budget) -> None:
    """LPT 1 with sections smaller than the batch's heads (an L2 budget made small): one
    head a section, and sections of 2 of the 6 KV heads, one of them across the two
    batches; every CTA's tile is its own, or dK and dV of some keys would be wrong or
    unwritten."""
    from flashtune.kernel_templates.attn_bwd_gluon import launcher

    monkeypatch.setattr(launcher, "L2_BUDGET", budget)
    assert launcher.lpt_section(6, 2, 333, 64) == (1 if budget == 1 else 2)
    torch.manual_seed(2)
    dt = torch.bfloat16
    q, k, v = _rand(2, 6, 333, 64, dtype=dt), _rand(2, 3, 517, 64, dtype=dt), \
        _rand(2, 3, 517, 64, dtype=dt)
    do = _rand(2, 6, 333, 64, dtype=dt)
    out, lse = _forward(q, k, v, True)
    p = AttentionProblem.from_tensors(q, k, causal=True)
    configs = [c for c in _valid_configs(p) if c["LPT"] == 1]
    assert configs
    from tests.helpers import grad_references

    refs = grad_references(q, k, v, do, causal=True)
    for config in configs:
        got = SPEC.launcher(q, k, v, out, lse, do, config, causal=True)
        assert_grads_close(got, q, k, v, do, causal=True, refs=refs)


@pytest.mark.gpu
def test_bshd_inputs_a_dlse_and_the_training_pair() -> None:
    """(B, N, H, D) storage read in place, the LSE's gradient, and the pair through autograd
    (attn_fwd_gluon's forward, this backward) against attn_fwd + attn_bwd's gradients."""
    torch.manual_seed(1)
    b, hq, hkv, n, d = 2, 8, 2, 333, 128
    q = torch.randn(b, n, hq, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    k = torch.randn(b, n, hkv, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    v = torch.randn(b, n, hkv, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    do = torch.randn(b, n, hq, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    out, lse = _forward(q, k, v, True)
    got = SPEC.launcher(q, k, v, out, lse, do, DEFAULT_CONFIG, causal=True)
    assert_grads_close(got, q, k, v, do, causal=True)
    assert got[0].stride() == q.stride() and got[1].stride() == k.stride()
    dlse = torch.randn_like(lse)
    ref = get_template("attn_bwd")
    from flashtune.core.device import cuda_device

    p = AttentionProblem.from_tensors(q, k, causal=True)
    want = ref.launcher(q, k, v, out, lse, do, ref.default_config(p, cuda_device()),
                        causal=True, dlse=dlse)
    have = SPEC.launcher(q, k, v, out, lse, do, DEFAULT_CONFIG, causal=True, dlse=dlse)
    for w, h in zip(want, have):
        assert ((w.float() - h.float()).norm() / w.float().norm()).item() < 1e-2
    pair = {s.name: s for s in implementations("train")}[PAIR_NAME]
    qs, ks, vs = (t.detach().contiguous().requires_grad_() for t in (q, k, v))
    config = pair.default_config(p, cuda_device())
    _, dq, dk, dv = pair.launcher(qs, ks, vs, do, config, causal=True)
    assert_grads_close((dq, dk, dv), qs, ks, vs, do, causal=True)


@pytest.mark.gpu
@pytest.mark.parametrize("d,hq,hkv,n,causal,bshd", [
    (64, 8, 8, 333, True, False), (128, 8, 2, 257, True, True), (64, 4, 1, 197, False, True),
    (128, 4, 4, 1000, False, False)], ids=["d64-causal", "d128-gqa-causal-bshd",
                                          "d64-mqa-bshd", "d128"])
def test_cudnns_forward_with_this_backward_trains_through_attention(d, hq, hkv, n, causal,
                                                                    bshd) -> None:
    """The pair ``sdpa_cudnn_bwd_gluon`` as a user runs it (``flashtune.attention(...,
    impl=)`` with gradients): out, dQ, dK and dV against float64 autograd on ragged, GQA
    and MQA shapes, in (B, H, N, D) and (B, N, H, D) storage, then with a loss on the LSE
    too, against attn_fwd + attn_bwd's gradients of the same loss."""
    assert_trains_through_attention(CUDNN_PAIR_NAME, d, hq, hkv, n, causal, bshd, seed=2)


@pytest.mark.gpu
def test_cudnns_forward_with_this_backward_compiles_and_captures() -> None:
    """The contract of every route, for ``sdpa_cudnn_bwd_gluon``: a training step through
    ``torch.compile(fullgraph=True)`` gives eager's gradients, and a forward + backward
    captured in a CUDA graph replays to them."""
    import flashtune

    torch.manual_seed(3)
    q, k, v = (torch.randn(2, h, 300, 64, device="cuda", dtype=torch.bfloat16)
               for h in (8, 2, 2))

    def loss_fn(q, k, v):
        out, lse = flashtune.attention(q, k, v, causal=True, return_lse=True,
                                       impl=CUDNN_PAIR_NAME)
        return (out.float() ** 2).mean() + lse.mean()

    assert_compiles_and_captures(loss_fn, (q, k, v))


# -- D256: the consumers split the head dim (GPU) ---------------------------------------------

D256_CASES = [  # (batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim, causal)
    (2, 4, 4, 1000, 1000, 256, False),  # ragged: the last key block runs past the end
    (2, 4, 4, 1000, 1000, 256, True),
    (1, 8, 2, 77, 133, 256, True),  # GQA 4:1, causal Nq < Nk
    (1, 4, 1, 384, 130, 256, True),  # MQA, causal Nq > Nk: rows that see no key
    (1, 6, 3, 197, 197, 256, False),  # GQA 2:1, ViT's 197
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", D256_CASES,
                         ids=lambda s: "b{}h{}:{}q{}k{}d{}{}".format(*s[:6], "c" if s[6] else ""))
def test_d256_gradients_match_the_reference_for_every_valid_config(case, dtype) -> None:
    """The split-D kernel (each consumer half the query rows of a step's scores, half the
    head dim of dK, dV and dQ, dQ by its own atomics) in every config the predicate accepts
    (longest first, dK and dV by TMA, a GQA group per query head) against float64."""
    from flashtune.core.device import cuda_device

    b, hq, hkv, nq, nk, d, causal = case
    p = AttentionProblem(b, hq, hkv, nq, nk, d, causal, "bf16")
    configs = [c for c in space.SPACE if space.check(c, p, cuda_device()) is None]
    assert len(configs) >= 4 and SPEC.default_config(p, cuda_device()) in configs
    _check_configs(case, dtype, 5, configs)


D256_MOD_CASES = [  # as MOD_CASES
    (2, 8, 4, 1000, 1000, 256, True, 255, 50.0),  # Gemma 2: GQA 2:1, a window and a cap
    (1, 4, 4, 777, 1300, 256, True, 100, 0.0),  # Nq < Nk: keys before every window
    (2, 4, 2, 1000, 1000, 256, False, -1, 30.0),  # a softcap, no mask
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", D256_MOD_CASES,
                         ids=["d256-gqa-w255-cap50", "d256-nq<nk-w100", "d256-full-cap30"])
def test_d256_windows_and_softcaps_match_the_reference(case) -> None:
    """:func:`test_a_window_and_a_softcap_match_the_reference` at D256, every valid config
    (longest first, dK and dV by TMA, a GQA group per query head)."""
    from flashtune.core.device import cuda_device

    _check_window_and_softcap(case, 13, lambda p: [
        c for c in space.SPACE if space.check(c, p, cuda_device()) is None], min_configs=4)

@pytest.mark.gpu
def test_the_d256_pair_trains_through_attention_in_bshd_storage() -> None:
    """The Gluon pair at D256 as a user runs it (``flashtune.attention(..., impl=)`` with
    gradients, (B, N, H, D) storage, GQA, causal), then with a loss on the LSE too."""
    assert_trains_through_attention(PAIR_NAME, 256, 8, 4, 333, True, True, seed=6)


# -- a causal sliding window and a softcap (GPU) -------------------------------------------------

MOD_CASES = [  # (batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim, causal, left, softcap)
    (2, 8, 2, 1000, 1000, 128, True, 255, 0.0),  # GQA, a window of 2 tiles, ragged end
    (1, 4, 4, 777, 1300, 64, True, 100, 0.0),  # Nq < Nk, a window inside one key block
    (1, 2, 2, 128, 1024, 64, True, 64, 0.0),  # keys before every window: walks of no step
    (1, 4, 1, 384, 130, 128, True, 50, 0.0),  # MQA, Nq > Nk: rows that see no key
    (2, 4, 4, 1000, 1000, 128, True, 1, 0.0),  # window 1: each query, itself and the key
    # before (window 0 makes dS = 0: P = 1 on the diagonal, dP = delta)
    (2, 4, 4, 1000, 1000, 64, True, -1, 30.0),  # a softcap, causal
    (2, 8, 2, 1000, 1000, 128, False, -1, 30.0),  # a softcap, no mask, GQA
    (2, 8, 2, 1000, 1000, 128, True, 255, 50.0),  # both
]
MOD_IDS = ["d128-gqa-w255", "d64-nq<nk-w100", "d64-unseen-keys-w64", "d128-mqa-nq>nk-w50",
           "d128-w1", "d64-cap30", "d128-gqa-full-cap30", "d128-gqa-w255-cap50"]


def _mod_references(q, k, v, do, causal, window, softcap):
    """``(exact, low)``: float64 autograd through the reference with the modifications, and
    the same in the inputs' precision (torch's own error: :func:`assert_grads_close`'s
    baseline)."""
    from flashtune.kernel_templates.attn_fwd.reference import attn_fwd_reference

    refs = []
    for dt in (torch.float64, q.dtype):
        leaves = [t.detach().to(dt).requires_grad_() for t in (q, k, v)]
        out, _ = attn_fwd_reference(*leaves, causal=causal, window=window,
                                    softcap=softcap or None, dtype=dt)
        refs.append(tuple(torch.autograd.grad(out, leaves, do.to(dt))))
    return refs[0], refs[1]


@pytest.mark.gpu
@pytest.mark.parametrize("case", MOD_CASES, ids=MOD_IDS)
def test_a_window_and_a_softcap_match_the_reference(case) -> None:
    """The Gluon forward's window and softcap, backward: gradients of its output (its LSE
    saved) against float64 autograd through the reference, for the default config and the
    knobs that change the walk or the epilogue (one consumer, longest first, persistent, dQ
    and dK/dV by TMA, a GQA group per query head). A window ends each key block's walk
    where its last query sees it (keys no query sees get dK = dV = 0); a softcap's dS goes
    through the hardware tanh the forward used: its error is the tanh's (2^-11 of the
    cap), checked as the forward's is, within 2% of the float64 norm."""
    from flashtune.core.device import cuda_device

    def configs(p: AttentionProblem) -> list[dict[str, int]]:
        knobs = [{}, {"BLOCK_N": 64, "NUM_CONSUMERS": 1}, {"LPT": 1, "TMA_STORE": 1},
                 {"PERSISTENT": 1, "LPT": 1}, {"DQ_TMA": 1}]
        if p.heads_q > p.heads_kv:
            knobs.append({"EXPAND_GQA": 1, "TMA_STORE": 1})
        return [c for c in [SPEC.default_config(p, cuda_device())]
                + [_config(**kn) for kn in knobs] if space.check(c, p, cuda_device()) is None]
    # (persistent at D128 spills past the table's allowance: 5 of 6 or 7)
    _check_window_and_softcap(case, 11, configs, min_configs=5)


def _check_window_and_softcap(case: tuple, seed: int, configs_for, min_configs: int) -> None:
    """Gradients of the Gluon forward's output with ``case``'s window and softcap (its LSE
    saved) for each config ``configs_for(problem)`` gives (at least ``min_configs``) against
    float64 autograd through the reference (with a softcap within 2% of its norm); keys
    before every query's window get dK = dV = 0."""
    from flashtune.core.device import cuda_device

    b, hq, hkv, nq, nk, d, causal, left, cap = case
    window = (left, 0) if left >= 0 else (-1, -1)
    torch.manual_seed(seed)
    dt = torch.bfloat16
    q, k, v = _rand(b, hq, nq, d, dtype=dt), _rand(b, hkv, nk, d, dtype=dt), \
        _rand(b, hkv, nk, d, dtype=dt)
    if cap:
        q = q * 4  # scores that reach the cap
    do = _rand(b, hq, nq, d, dtype=dt)
    fwd = get_template("attn_fwd_gluon")
    p = AttentionProblem.from_tensors(q, k, causal=causal, window=window, softcap=cap)
    mods = {"window": window, "softcap": cap or None}
    out, lse = fwd.launcher(q, k, v, fwd.default_config(p, cuda_device()), causal=causal,
                            return_lse=True, **mods)
    refs = _mod_references(q, k, v, do, causal, window, cap)
    configs = configs_for(p)
    assert len(configs) >= min_configs
    for config in configs:
        got = SPEC.launcher(q, k, v, out, lse, do, config, causal=causal, **mods)
        if cap:
            for name, g, ref in zip(("dq", "dk", "dv"), got, refs[0]):
                assert torch.isfinite(g).all(), (config, name)
                rel = ((g.double() - ref).norm() / ref.norm()).item()
                assert rel < 2e-2, (config, name, rel)
        else:
            assert_grads_close(got, q, k, v, do, causal=causal, refs=refs)
        if left >= 0 and nk - nq > left:  # keys before every query's window
            unseen = nk - nq - left
            assert not got[1][:, :, :unseen].any() and not got[2][:, :, :unseen].any()

@pytest.mark.gpu
def test_the_gluon_pair_trains_a_window_and_a_softcap_through_attention() -> None:
    """The training pair as ``flashtune.attention`` runs it for a windowed, capped call
    whose tuned choice it is (its launcher a ``TrainStep``, the options passed to both
    kernels) and under the route's own launcher (``scored._bwd_launcher``): gradients
    against float32 autograd through the reference."""
    from flashtune.core.device import cuda_device
    from flashtune.kernel_templates.attn_fwd.reference import attn_fwd_reference
    from flashtune.runtime import scored

    torch.manual_seed(12)
    b, hq, hkv, n, d = 1, 8, 2, 1000, 128
    q = _rand(b, hq, n, d, dtype=torch.bfloat16) * 4
    k, v = _rand(b, hkv, n, d, dtype=torch.bfloat16), _rand(b, hkv, n, d, dtype=torch.bfloat16)
    do = _rand(b, hq, n, d, dtype=torch.bfloat16)
    kw = dict(causal=True, window=(255, 0), softcap=50.0)
    p = AttentionProblem.from_tensors(q, k, **kw)
    pair = {s.name: s for s in implementations("train")}[PAIR_NAME]
    assert pair.refuse(p, cuda_device(), return_lse=True) is None
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    _, dq, dk, dv = pair.launcher(*leaves, do, pair.default_config(p, cuda_device()), **kw)
    ref_leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
    ref, _ = attn_fwd_reference(*ref_leaves, dtype=torch.float32, **kw)
    want = torch.autograd.grad(ref, ref_leaves, do.float())
    out, lse = get_template("attn_fwd_gluon").launcher(
        q, k, v, get_template("attn_fwd_gluon").default_config(p, cuda_device()),
        return_lse=True, **kw)
    routed = scored._bwd_launcher(SPEC)(q, k, v, out, lse, do, DEFAULT_CONFIG, **kw)
    for got in ((dq, dk, dv), routed):
        for g, w in zip(got, want):
            rel = ((g.float() - w).norm() / w.norm()).item()
            assert rel < 2e-2, rel

