"""Every head dim 1..256 (issue 31, item 1): attn_fwd and attn_bwd against the float64
reference at head dims that are not powers of two, aligned (40, 80, 160, 224) and odd
(1, 59, 111); the tensor-copy engine (USE_TMA) refused and skipped where a row is not a
16-byte multiple; default configs valid for every head dim; the sm_90 compile of the new
dims' default configs; the SDPA externs' head dims; attn_decode at odd head dims.

Interpreter-sized shapes (N <= 40, a few heads): one option set per head dim rather than
every combination (causal with Nq != Nk, GQA/MQA, strided layouts, both dtypes).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from flashtune.core.device import DeviceFingerprint, interpreter_device
from flashtune.core.problem import MAX_HEAD_DIM, AttentionProblem
from flashtune.kernel_templates import get_template, sdpa_extern
from flashtune.kernel_templates.attn_bwd import attn_bwd
from flashtune.kernel_templates.attn_bwd import space as bwd_space
from flashtune.kernel_templates.attn_fwd import attn_fwd
from flashtune.kernel_templates.attn_fwd import space as fwd_space
from flashtune.kernel_templates.attn_fwd.launcher import kernel_args
from flashtune.kernel_templates.attn_fwd.reference import attn_fwd_reference
from flashtune.kernel_templates.tma import padded_head_dim, tma_head_dim, tma_ok
from tests.conftest import DEVICE
from tests.helpers import assert_close_to_reference, assert_grads_close

FWD = get_template("attn_fwd")
BWD = get_template("attn_bwd")
H100 = DeviceFingerprint("NVIDIA_H100_80GB_HBM3", "9.0", 132, 232448, 85 << 30)
A100 = DeviceFingerprint("NVIDIA_A100_SXM4_80GB", "8.0", 108, 166912, 80 << 30)
ROOT = Path(__file__).resolve().parents[2]

# small tiles: few interpreted iterations per block; TMA asked for everywhere (the launchers
# drop it where the head dim or the strides do not allow it)
FWD_CFG = {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1, "USE_TMA": 1}
BWD_CFG = {"BLOCK_M1": 16, "BLOCK_N1": 16, "BLOCK_M2": 16, "BLOCK_N2": 16, "num_warps": 2,
           "num_stages": 1, "USE_TMA": 1}


def _rand(shape, dtype, g, layout):
    b, h, n, d = shape
    if layout == "bnhd":  # (B, N, H, D) storage viewed as (B, H, N, D)
        return torch.randn(b, n, h, d, generator=g).to(dtype).to(DEVICE).transpose(1, 2)
    if layout == "wide":  # the first d columns of rows 8 elements wider (strided rows)
        return torch.randn(b, h, n, d + 8, generator=g).to(dtype).to(DEVICE)[..., :d]
    return torch.randn(b, h, n, d, generator=g).to(dtype).to(DEVICE)


def make(b, hq, hkv, nq, nk, d, dtype, *, seed=0, layout="bhnd"):
    g = torch.Generator().manual_seed(seed)
    return (_rand((b, hq, nq, d), dtype, g, layout), _rand((b, hkv, nk, d), dtype, g, layout),
            _rand((b, hkv, nk, d), dtype, g, layout), _rand((b, hq, nq, d), dtype, g, "bhnd"))


# (head_dim, b, hq, hkv, nq, nk, causal, dtype, layout, backward config extras)
CASES = [
    (1, 1, 2, 2, 17, 29, True, torch.float16, "bhnd", {}),
    (8, 1, 4, 2, 23, 23, False, torch.bfloat16, "bhnd", {"KV_SPLITS": 2}),
    (40, 2, 2, 1, 19, 33, True, torch.float16, "bhnd", {"SPLIT_LOOPS": 1}),
    (59, 1, 4, 2, 33, 21, True, torch.float16, "bnhd", {}),
    (80, 1, 2, 2, 29, 40, False, torch.bfloat16, "bnhd", {"ONE_LAUNCH": 1}),
    (111, 1, 2, 1, 24, 37, True, torch.float16, "wide", {"SPLIT_LOOPS": 1}),
    (160, 1, 3, 1, 21, 21, True, torch.bfloat16, "bhnd", {}),
    (224, 1, 2, 2, 18, 31, False, torch.float16, "wide", {}),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"d{c[0]}")
def test_forward_and_gradients_match_float64(case):
    d, b, hq, hkv, nq, nk, causal, dtype, layout, extra = case
    q, k, v, do = make(b, hq, hkv, nq, nk, d, dtype, seed=d, layout=layout)
    out, lse = attn_fwd(q, k, v, FWD_CFG, causal=causal, return_lse=True)
    assert_close_to_reference(out, q, k, v, causal=causal, lse=lse)
    grads = attn_bwd(q, k, v, out, lse, do, {**BWD_CFG, **extra}, causal=causal)
    assert_grads_close(grads, q, k, v, do, causal=causal)


def test_unaligned_head_dims_read_without_tma_and_give_the_same_bits():
    """D59: a row of 118 bytes. ``tma_ok`` refuses it contiguous and also as the first 59
    columns of 64-wide rows (aligned strides, unaligned extent); the launcher then passes
    USE_TMA False, and a config that asks for TMA gives the bits of one that does not."""
    q, k, v, _ = make(1, 2, 2, 21, 30, 59, torch.float16, seed=1)
    wide = torch.zeros(1, 2, 21, 64, dtype=q.dtype, device=DEVICE)[..., :59]
    assert not tma_ok(q) and not tma_ok(wide)
    assert tma_ok(torch.zeros(1, 2, 21, 40, dtype=q.dtype, device=DEVICE))
    assert tma_ok(torch.zeros(1, 2, 21, 64, dtype=q.dtype, device=DEVICE)[..., :40])
    out = torch.empty_like(q)
    _, kwargs, _ = kernel_args(q, k, v, out, None, FWD_CFG, causal=True, scale=0.1,
                               use_tma=tma_ok(q, k, v, out), upcast_dot=False)
    assert kwargs["USE_TMA"] is False and kwargs["BLOCK_D"] == 64 and kwargs["HEAD_DIM"] == 59
    plain = {**FWD_CFG, "USE_TMA": 0}
    got = attn_fwd(q, k, v, FWD_CFG, causal=True)
    assert torch.equal(got, attn_fwd(q, k, v, plain, causal=True))
    assert_close_to_reference(got, q, k, v, causal=True)


@pytest.mark.parametrize("spec", [FWD, BWD], ids=["attn_fwd", "attn_bwd"])
def test_tma_serves_unaligned_head_dims_on_a_gpu_padded_and_is_refused_interpreted(spec):
    """On a GPU the launchers run a head dim that is not a multiple of 8 padded to the next
    one (tma.pads_head_dim), so TMA serves it and the defaults are the aligned ones; under
    the interpreter the kernels read it with masked loads, and the predicates refuse TMA."""
    interpreter = interpreter_device()
    for d in (1, 59, 111, 250):
        p = AttentionProblem(2, 4, 4, 512, 512, d, True, "bf16")
        cfg = spec.default_config(p, H100)
        assert cfg["USE_TMA"] == 1, (d, cfg)
        assert cfg == spec.default_config(replace(p, head_dim=padded_head_dim(d)), H100)
        reason = spec.space.check({**cfg, "USE_TMA": 1}, p, interpreter)
        assert reason is not None and "USE_TMA" in reason and f"head_dim {d}" in reason
    for d in (8, 40, 80, 160, 224):
        p = AttentionProblem(2, 4, 4, 512, 512, d, True, "bf16")
        assert spec.default_config(p, H100)["USE_TMA"] == 1, d
        assert spec.space.check({**spec.default_config(p, H100)}, p, interpreter) is None
    assert [d for d in range(1, 33) if tma_head_dim(d)] == [8, 16, 24, 32]
    assert [padded_head_dim(d) for d in (1, 8, 59, 111, 250, 256)] == [8, 8, 64, 112, 256, 256]


@pytest.fixture
def pad_on_cpu(monkeypatch):
    """The launchers' GPU rule (pad a head dim that is not a multiple of 8) for CPU tensors
    once the returned list holds ``"on"``; the padded head dims are appended to it."""
    from flashtune.kernel_templates import training
    from flashtune.kernel_templates.attn_bwd import launcher as bwd_launcher
    from flashtune.kernel_templates.attn_fwd import launcher as fwd_launcher

    widths = []

    def pads(t):
        if "on" in widths and t.shape[-1] % 8:
            widths.append(t.shape[-1])
            return True
        return False

    monkeypatch.setattr(fwd_launcher, "pads_head_dim", pads)
    monkeypatch.setattr(bwd_launcher, "pads_head_dim", pads)
    monkeypatch.setattr(training, "pads_head_dim", pads)
    return widths


@pytest.mark.parametrize("d", [1, 59])
def test_a_padded_head_dim_gives_the_masked_kernels_result(d, pad_on_cpu):
    """The padded launch (zero columns up to a multiple of 8, the true head dim's scale,
    the output and gradients cut back into the inputs' layout, preallocated outputs filled) equals
    the masked kernel on the unpadded tensors, forward, LSE and gradients, with dropout too
    (its mask does not depend on the head dim)."""
    from flashtune.kernel_templates.dropout import draw_seed

    q, k, v, do = make(1, 4, 2, 19, 27, d, torch.float16, seed=d, layout="bnhd")
    seed = draw_seed(q.device)
    cfg = {**FWD_CFG, "USE_TMA": 0}
    bcfg = {**BWD_CFG, "USE_TMA": 0}
    masked = attn_fwd(q, k, v, cfg, causal=True, return_lse=True, dropout_p=0.2, seed=seed)
    masked_grads = attn_bwd(q, k, v, masked[0], masked[1], do, bcfg, causal=True,
                            dropout_p=0.2, seed=seed)
    pad_on_cpu.append("on")
    out, lse = attn_fwd(q, k, v, cfg, causal=True, return_lse=True, dropout_p=0.2, seed=seed)
    assert pad_on_cpu == ["on", d]
    assert out.shape == q.shape and out.stride() == torch.empty_like(q).stride()  # q's layout
    torch.testing.assert_close(out, masked[0], atol=2e-3, rtol=0)
    torch.testing.assert_close(lse, masked[1], atol=1e-4, rtol=0)
    given = [torch.full_like(t, float("nan")) for t in (q, k, v)]
    grads = attn_bwd(q, k, v, out, lse, do, bcfg, causal=True, dq=given[0], dk=given[1],
                     dv=given[2], dropout_p=0.2, seed=seed)
    assert all(g is t for g, t in zip(grads, given)) and pad_on_cpu == ["on", d, d]
    for got, want in zip(grads, masked_grads):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=5e-3, rtol=0)


@pytest.mark.parametrize("d,layout", [(59, "bnhd"), (111, "wide")])
def test_the_training_step_pads_once_for_both_kernels(d, layout, pad_on_cpu, monkeypatch):
    """PairFn (what flashtune.attention runs with gradients) pads q, k, v once and saves the
    padded tensors; the backward pads the incoming gradient only (4 pads, not the launchers'
    3 + 5) and cuts the gradients back: the masked kernels' output and gradients, and every
    gradient against float64."""
    from flashtune.kernel_templates import training

    q, k, v, do = make(1, 4, 2, 21, 26, d, torch.float16, seed=d, layout=layout)
    cfg = {**FWD_CFG, "USE_TMA": 0}
    bcfg = {**BWD_CFG, "USE_TMA": 0}
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    out, _ = training.pair_fn(*leaves, True, None, attn_fwd, cfg, attn_bwd, bcfg)
    masked = torch.autograd.grad(out, leaves, do)
    pads = []
    real_pad = training.pad_head_dim

    def counting_pad(t, width):
        pads.append((tuple(t.shape), width))
        return real_pad(t, width)

    monkeypatch.setattr(training, "pad_head_dim", counting_pad)
    pad_on_cpu.append("on")
    out_p, lse_p = training.pair_fn(*leaves, True, None, attn_fwd, cfg, attn_bwd, bcfg)
    assert out_p.shape == q.shape and out_p.is_contiguous()
    grads = torch.autograd.grad(out_p, leaves, do)
    width = padded_head_dim(d)
    assert pads == [(tuple(t.shape), width) for t in (q, k, v, do)]
    assert pad_on_cpu == ["on", d]  # the launchers saw aligned tensors only
    torch.testing.assert_close(out_p, out, atol=2e-3, rtol=0)
    assert_close_to_reference(out_p, q, k, v, causal=True, lse=lse_p)
    for got, want in zip(grads, masked):
        assert got.shape == want.shape and got.is_contiguous()
        torch.testing.assert_close(got, want, atol=5e-3, rtol=0)
    assert_grads_close(grads, q, k, v, do, causal=True)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_pad_and_unpad_copy_exactly(dtype):
    """tma.pad_head_dim (one launch: the columns, then zeros, written once) and
    unpad_head_dim (into a new tensor or a strided one given) on odd shapes: (B, H, N, D)
    views with any strides, packed (total, H, D), head dims 1 to 250."""
    from flashtune.kernel_templates.tma import pad_head_dim, unpad_head_dim

    g = torch.Generator().manual_seed(7)
    cases = [
        (torch.randn(2, 37, 3, 59, generator=g).to(dtype).transpose(1, 2), 64),  # bnhd
        (torch.randn(1, 2, 5, 119, generator=g).to(dtype)[..., :111], 112),     # wide rows
        (torch.randn(13, 3, 1, generator=g).to(dtype), 8),                       # packed
        (torch.randn(1, 2, 70, 250, generator=g).to(dtype), 256),
    ]
    for t, width in cases:
        d = t.shape[-1]
        p = pad_head_dim(t, width)
        assert p.shape == (*t.shape[:-1], width) and p.is_contiguous()
        assert torch.equal(p[..., :d], t) and not p[..., d:].any()
        u = unpad_head_dim(p, d)
        assert u.is_contiguous() and torch.equal(u, t)
        given = torch.full((*t.shape[:-1], d + 3), float("nan"), dtype=dtype)[..., :d]
        assert unpad_head_dim(p, d, given) is given and torch.equal(given, t)


@pytest.mark.parametrize("spec", [FWD, BWD], ids=["attn_fwd", "attn_bwd"])
@pytest.mark.parametrize("device", [H100, A100], ids=["h100", "a100"])
def test_default_configs_are_valid_for_every_head_dim(spec, device):
    for d in range(1, MAX_HEAD_DIM + 1):
        for causal in (False, True):
            p = AttentionProblem(2, 8, 2, 1000, 1000, d, causal, "fp16")
            cfg = spec.default_config(p, device)
            assert spec.space.validate(cfg) == cfg, (d, cfg)
            assert spec.space.check(cfg, p, device) is None, (d, cfg)


def test_tiles_pad_the_head_dim_to_a_power_of_two_and_shared_memory_follows():
    assert [fwd_space.block_d(d) for d in (1, 8, 16, 17, 40, 59, 64, 80, 111, 160, 224, 256)] \
        == [16, 16, 16, 32, 64, 64, 64, 128, 128, 256, 256, 256]
    cfg = {"BLOCK_M": 128, "BLOCK_N": 64, "num_stages": 3}
    assert fwd_space.shared_mem_bytes(cfg, 80) == fwd_space.shared_mem_bytes(cfg, 128)
    bcfg = {"BLOCK_M1": 64, "BLOCK_N1": 128, "BLOCK_M2": 128, "BLOCK_N2": 64, "num_stages": 2}
    assert bwd_space.shared_mem_bytes(bcfg, 224) == bwd_space.shared_mem_bytes(bcfg, 256)
    # the pruning sees the padded tile: what D256 cannot hold, D160 cannot either
    big = {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3}
    p160 = AttentionProblem(1, 8, 8, 4096, 4096, 160, False, "bf16")
    assert "shared memory" in FWD.space.check(big, p160, H100)


def test_the_sdpa_externs_serve_the_head_dims_their_backends_take():
    p = {d: AttentionProblem(1, 2, 2, 64, 64, d, False, "bf16") for d in (40, 59, 111, 224)}
    for name in ("sdpa_cudnn", "sdpa_efficient"):
        limits = sdpa_extern._LIMITS[name.removeprefix("sdpa_")]
        assert limits.head_dims is not None
        assert [d for d in p if d in limits.head_dims] == [40, 224], name
    assert sdpa_extern._LIMITS["flash"].head_dims is None  # padded like torch pads
    # the Gluon forward still serves its own head dims only: the rest go to attn_fwd
    gluon = get_template("attn_fwd_gluon")
    for d in (40, 59, 80, 224):
        reason = gluon.limits.refuse(AttentionProblem(1, 2, 2, 64, 64, d, False, "bf16"),
                                     H100)
        assert reason is not None and f"head_dim {d}" in reason


def test_sdpa_flash_pads_a_head_dim_the_flash_op_refuses(monkeypatch):
    """torch's flash op takes multiples of 8 only; ``sdpa_flash`` pads q, k, v with zeros
    to the next one (as F.scaled_dot_product_attention does), keeps the real head dim's
    scale and returns the first head_dim columns."""
    seen = []

    def flash_op(q, k, v, dropout, is_causal, return_debug, *, scale=None):
        assert q.shape[-1] % 8 == 0 and k.shape[-1] == v.shape[-1] == q.shape[-1]
        seen.append((q.shape[-1], scale))
        out, lse = attn_fwd_reference(q, k, v, causal=is_causal, scale=scale,
                                      dtype=torch.float32)
        return out.to(q.dtype), lse

    monkeypatch.setattr(sdpa_extern, "_FLASH", flash_op)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 12, 59, generator=g).half() for _ in range(3))
    out, lse = sdpa_extern.sdpa_flash(q, k, v, {}, causal=True, return_lse=True)
    assert seen == [(64, pytest.approx(59 ** -0.5))]
    assert out.shape == q.shape and out.stride(-1) == 1
    assert_close_to_reference(out, q, k, v, causal=True, lse=lse)
    assert sdpa_extern.sdpa_flash(q[..., :56], k[..., :56], v[..., :56], {}).shape[-1] == 56
    assert seen[-1] == (56, None)  # a multiple of 8 goes through as it is


@pytest.mark.parametrize("d,splits", [(40, 1), (59, 3), (111, 2)])
def test_attn_decode_serves_odd_head_dims(d, splits):
    """Short-query calls route to attn_decode, which declares every head dim: its masked
    head-dim columns at a few head dims, split-KV included."""
    dec = get_template("attn_decode")
    q, k, v, _ = make(2, 4, 2, 3, 37, d, torch.float16, seed=d)
    cfg = {**dec.default_config(AttentionProblem.from_tensors(q, k, causal=True),
                                interpreter_device()), "NUM_SPLITS": splits}
    out, lse = dec.launcher(q, k, v, cfg, causal=True, return_lse=True)
    assert_close_to_reference(out, q, k, v, causal=True, lse=lse)


def _compile_sm90(cases: list[dict]) -> list[dict]:
    # in a process of its own: this one runs triton under the interpreter
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-m", "flashtune.kernel_templates.sm90",
                           json.dumps(cases)], capture_output=True, text=True, env=env,
                          timeout=900, cwd=ROOT, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def test_default_configs_of_new_head_dims_compile_for_hopper():
    """D80 (Phi-2, 32 heads, N2048 causal) and D224 (N4096 causal), forward and backward,
    their H100 default configs compiled for sm_90 on the CPU: within the 227 KiB of shared
    memory a block may use and the shared-memory model the predicates prune with, 255
    registers at most and no more than a few spilled bytes (the figures are in the
    messages)."""
    cases = [{"template": t, "head_dim": d, "batch": b, "heads": h, "seqlen": n,
              "causal": True}
             for d, b, h, n in ((80, 4, 32, 2048), (224, 2, 8, 4096))
             for t in ("attn_fwd", "attn_bwd")]
    got = _compile_sm90(cases)
    assert {(g["template"], g["head_dim"]) for g in got} == {
        (c["template"], c["head_dim"]) for c in cases}
    for g in got:
        figures = (f"{g['template']} D{g['head_dim']} {g['kernel']}: {g['registers']} "
                   f"registers, {g['spill_store_bytes']} B spilled, {g['shared']} B shared, "
                   f"config {g['config']}")
        assert g["shared"] <= H100.shared_mem_per_block, figures
        assert g["registers"] <= 255 and g["spill_store_bytes"] <= 128, figures
        assert g["config"]["USE_TMA"] == 1, figures
        if g["kernel"] == "attn_fwd_kernel":
            est = fwd_space.shared_mem_bytes(g["config"], g["head_dim"])
            assert est - 1024 < g["shared"] <= est, (figures, est)
        elif g["kernel"] != "attn_bwd_preprocess":
            # the model's documented tolerance (mma.sync tiles at one stage: up to 8 KiB)
            est = bwd_space.shared_mem_bytes(g["config"], g["head_dim"])
            assert abs(est - g["shared"]) <= 8192, (figures, est)
