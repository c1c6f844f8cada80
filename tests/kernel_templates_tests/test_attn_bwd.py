"""attn_bwd gradients against float64 autograd on odd shapes (interpreter or GPU), the tuner's
case for it, and the autograd wiring of flashtune.attention.

Under the interpreter every launch is slow, so the module shares what its tests would
otherwise recompute: the ``cases`` fixture keeps each case's inputs with its forward pass,
its reference gradients and the backward of each config it was run with. Checks of
determinism launch again (``Case.run``) rather than reading the memo.
"""

from __future__ import annotations

import pytest
import torch

import flashtune
from flashtune.core.device import current_device, interpreter_device
from flashtune.core.errors import ConfigError
from flashtune.core.problem import AttentionProblem
from flashtune.db.records import TrialState
from flashtune.kernel_templates import get_template
from flashtune.kernel_templates.attn_bwd import attn_bwd
from flashtune.kernel_templates.attn_bwd.space import DEFAULTS
from flashtune.kernel_templates.attn_fwd import attn_fwd
from flashtune.kernel_templates.attn_fwd.reference import attn_fwd_reference
from tests.conftest import DEVICE
from tests.helpers import assert_grads_close, grad_references

SPEC = get_template("attn_bwd")
# the forward only makes the backward's O and LSE: tiles as large as the shapes here, as
# few interpreted iterations as can be (16 x 16 tiles made it as slow as the backward)
FWD_CFG = {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 1}
CFG = {"BLOCK_M1": 16, "BLOCK_N1": 32, "BLOCK_M2": 32, "BLOCK_N2": 16, "num_warps": 2,
       "num_stages": 1}
DTYPES = [torch.float16, torch.bfloat16]


def make(b, hq, hkv, nq, nk, d, dtype, seed=0, layout="bhnd"):
    g = torch.Generator().manual_seed(seed)

    def rand(h, n):
        if layout == "bnhd":  # (B, N, H, D) storage viewed as (B, H, N, D)
            return torch.randn(b, n, h, d, generator=g).to(dtype).to(DEVICE).transpose(1, 2)
        return torch.randn(b, h, n, d, generator=g).to(dtype).to(DEVICE)
    return rand(hq, nq), rand(hkv, nk), rand(hkv, nk), rand(hq, nq)


def grads(q, k, v, do, cfg=CFG, *, causal, scale=None, **kw):
    out, lse = attn_fwd(q, k, v, FWD_CFG, causal=causal, scale=scale, return_lse=True)
    return attn_bwd(q, k, v, out, lse, do, cfg, causal=causal, scale=scale, **kw)


class Case:
    """One case's ``q, k, v, do`` with its forward pass (out, LSE) and reference gradients
    memoised per ``(causal, scale)``, and its gradients per config (the same inputs and
    config give the same bits). Nothing here may write into these tensors."""

    def __init__(self, q, k, v, do):
        self.q, self.k, self.v, self.do = q, k, v, do
        self._fwd, self._refs, self._grads = {}, {}, {}

    def fwd(self, *, causal, scale=None):
        if (causal, scale) not in self._fwd:
            self._fwd[causal, scale] = attn_fwd(self.q, self.k, self.v, FWD_CFG, causal=causal,
                                                scale=scale, return_lse=True)
        return self._fwd[causal, scale]

    def run(self, cfg=CFG, *, causal, scale=None, **kw):
        """A fresh backward launch (on the memoised forward)."""
        out, lse = self.fwd(causal=causal, scale=scale)
        return attn_bwd(self.q, self.k, self.v, out, lse, self.do, cfg, causal=causal,
                        scale=scale, **kw)

    def grads(self, cfg=CFG, *, causal, scale=None):
        """The backward of ``cfg``, launched once per case (knobs left out are their
        defaults, as the launcher reads them)."""
        key = (tuple(sorted({**DEFAULTS, **cfg}.items())), causal, scale)
        if key not in self._grads:
            self._grads[key] = self.run(cfg, causal=causal, scale=scale)
        return self._grads[key]

    def check(self, got, *, causal, scale=None):
        """``assert_grads_close`` against the memoised references."""
        if (causal, scale) not in self._refs:
            self._refs[causal, scale] = grad_references(self.q, self.k, self.v, self.do,
                                                        causal=causal, scale=scale)
        return assert_grads_close(got, self.q, self.k, self.v, self.do, causal=causal,
                                  scale=scale, refs=self._refs[causal, scale])


@pytest.fixture(scope="module")
def cases():
    """``cases(b, hq, hkv, nq, nk, d, dtype, seed=0, layout="bhnd")`` -> the module's one
    :class:`Case` of those inputs (``make``'s arguments)."""
    memo = {}

    def get(*shape_and_dtype, seed=0, layout="bhnd"):
        key = (*shape_and_dtype, seed, layout)
        if key not in memo:
            memo[key] = Case(*make(*shape_and_dtype, seed=seed, layout=layout))
        return memo[key]
    return get


SHAPES = [
    # (b, hq, hkv, nq, nk, d)
    (2, 2, 2, 77, 133, 64),  # Nq < Nk
    (1, 2, 2, 133, 77, 32),  # Nq > Nk: causal leaves the first 56 rows without keys
    (1, 2, 2, 1, 45, 32),    # one query row
    (1, 4, 2, 33, 33, 32),   # GQA 4:2: dK/dV summed over the group
    (1, 4, 1, 40, 29, 96),   # MQA, head_dim not a power of two
]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "b{}h{}:{}q{}k{}d{}".format(*s))
def test_gradients_match_float64(cases, shape, causal, dtype):
    case = cases(*shape, dtype)
    case.check(case.grads(causal=causal), causal=causal)


# tiles larger and smaller than the sequences, so every loop phase (causal band, unmasked
# blocks, ragged end; skipped blocks) is met with both orders of Nq and Nk
CONFIGS = [
    {"BLOCK_M1": 16, "BLOCK_N1": 16, "BLOCK_M2": 16, "BLOCK_N2": 16, "num_warps": 2,
     "num_stages": 1},
    {"BLOCK_M1": 32, "BLOCK_N1": 64, "BLOCK_M2": 64, "BLOCK_N2": 32, "num_warps": 4,
     "num_stages": 2},
    {"BLOCK_M1": 64, "BLOCK_N1": 16, "BLOCK_M2": 16, "BLOCK_N2": 64, "num_warps": 4,
     "num_stages": 3},
]


@pytest.mark.parametrize("split", [0, 1], ids=["one-loop", "split"])
@pytest.mark.parametrize("nq,nk", [(45, 70), (70, 45)], ids=["q<k", "q>k"])
@pytest.mark.parametrize("cfg", CONFIGS, ids=["16", "fa2", "transposed"])
def test_configs_cover_every_loop_phase(cases, cfg, nq, nk, split):
    case = cases(1, 4, 2, nq, nk, 32, torch.float16, seed=nq)
    cfg = {**cfg, "SPLIT_LOOPS": split}
    case.check(case.grads(cfg, causal=True), causal=True)


@pytest.mark.parametrize("split", [0, 1], ids=["one-loop", "split"])
@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
def test_tma_loads_match_float64(cases, layout, split):
    """USE_TMA: Q/dO (dK/dV kernel) and K/V (dQ kernel) through tensor descriptors, whose
    zero fill covers the ragged ends and the padded head dim (96 -> 128): GQA, causal with
    Nq != Nk both ways, strided (B, N, H, D) storage, KV_SPLITS too."""
    for nq, nk in ((45, 70), (70, 45)):
        case = cases(1, 4, 2, nq, nk, 96, torch.float16, seed=nq + split, layout=layout)
        for extra in ({}, {"KV_SPLITS": 2}):
            cfg = {**CONFIGS[1], "SPLIT_LOOPS": split, "USE_TMA": 1, **extra}
            for causal in (False, True):
                case.check(case.grads(cfg, causal=causal), causal=causal)


def test_tma_falls_back_to_plain_loads_on_unaligned_strides(cases):
    from flashtune.kernel_templates.attn_bwd.launcher import kernel_args
    case = cases(1, 2, 2, 20, 24, 32, torch.float16)
    q, k, v, do = case.q, case.k, case.v, case.do
    q_odd = torch.empty(1, 2, 20, 33, dtype=q.dtype, device=DEVICE)[..., :32]
    q_odd.copy_(q)  # row stride 33 elements: not a 16-byte multiple
    cfg = {**CONFIGS[1], "USE_TMA": 1}
    out, lse = case.fwd(causal=False)
    delta = torch.empty(1, 2, 20, device=DEVICE)
    for qq, expect in ((q, True), (q_odd, False)):
        launches = kernel_args(qq, k, v, out, lse, do, delta, torch.empty_like(q),
                               torch.empty_like(k), torch.empty_like(v), cfg, causal=False,
                               scale=0.2, upcast_dot=False)
        assert launches["dkdv"][2]["USE_TMA"] is expect and launches["dq"][2]["USE_TMA"] is expect
    got = attn_bwd(q_odd, k, v, out, lse, do, cfg)
    case.check(got, causal=False)


def test_every_diagonal_offset_is_masked_exactly(cases):
    """Nk - Nq around the multiples of the 16-row tiles, Nq = 2 mod 16: a block boundary
    off by one row in any loop split shows up in one of these."""
    for split in (0, 1):
        cfg = {"BLOCK_M1": 16, "BLOCK_N1": 16, "BLOCK_M2": 16, "BLOCK_N2": 16, "num_warps": 2,
               "num_stages": 1, "SPLIT_LOOPS": split}
        for off in (-17, -15, -2, -1, 0, 1, 2, 14, 15, 17):
            case = cases(1, 1, 1, 34, 34 + off, 16, torch.float16, seed=off + 20)
            case.check(case.grads(cfg, causal=True), causal=True)


@pytest.mark.parametrize("d", [16, 128, 256])
def test_small_and_large_head_dims(cases, d):
    case = cases(1, 2, 1, 29, 40, d, torch.float16, seed=d)
    case.check(case.grads(causal=True), causal=True)


def test_rows_that_see_no_key_get_zero_gradients_not_nan(cases):
    # Nq > Nk, causal: the first 56 of 133 rows see no key (LSE = -inf); the inputs of
    # test_gradients_match_float64's b1h2:2q133k77d32-causal-fp16
    dq, dk, dv = cases(1, 2, 2, 133, 77, 32, torch.float16).grads(causal=True)
    assert torch.all(dq[:, :, :56] == 0) and dq[:, :, 56:].abs().sum() > 0
    assert torch.isfinite(dk).all() and torch.isfinite(dv).all()
    # one key: only the last query sees it, with P = 1, so dS = dP - delta = 0 up to rounding
    case = cases(1, 2, 2, 20, 1, 32, torch.float16, seed=6)
    do = case.do
    dq, dk, dv = case.grads(causal=True)
    assert torch.all(dq[:, :, :19] == 0)
    assert dq.abs().max() < 1e-5 and dk.abs().max() < 1e-5
    assert torch.equal(dv, do[:, :, 19:])


def test_strided_inputs_outputs_and_custom_scale():
    q, k, v, do = make(2, 4, 2, 29, 41, 64, torch.float16, layout="bnhd")
    assert not q.is_contiguous() and q.stride(-1) == 1 and not do.is_contiguous()
    # preallocated outputs as transposed views too: written through their strides
    dq = torch.full((2, 29, 4, 64), float("nan"), dtype=q.dtype, device=DEVICE).transpose(1, 2)
    dk, dv = (torch.full((2, 41, 2, 64), float("nan"), dtype=q.dtype,
                         device=DEVICE).transpose(1, 2) for _ in range(2))
    got = grads(q, k, v, do, causal=True, scale=0.3, dq=dq, dk=dk, dv=dv)
    assert got[0] is dq and got[1] is dk and got[2] is dv
    assert_grads_close(got, q, k, v, do, causal=True, scale=0.3)
    default = grads(q, k, v, do, causal=True)
    assert not torch.allclose(default[0], dq)  # the scale really is used


def test_lse_gradient_enters_through_delta():
    q, k, v, do = make(1, 4, 2, 37, 50, 32, torch.float16, seed=7)
    dlse = torch.randn(4, 37, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    dlse = dlse.expand(1, 4, 37)  # like autograd's gradient of a sum: any strides
    got = grads(q, k, v, do, causal=True, dlse=dlse)
    ref = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    out, lse = attn_fwd_reference(*ref, causal=True)
    ((out * do.double()).sum() + (lse * dlse.double()).sum()).backward()
    for g, r in zip(got, ref):
        rel = ((g.double() - r.grad).norm() / r.grad.norm()).item()
        assert rel < 2e-3, rel


def test_configs_agree_and_runs_are_deterministic(cases):
    case = cases(1, 4, 2, 45, 45, 32, torch.float16, seed=3)
    a = case.run(CFG, causal=True)
    again = case.run(CFG, causal=True)
    other = case.grads({**CONFIGS[2], "SPLIT_LOOPS": 1}, causal=True)
    for x, y, z in zip(a, again, other):
        assert torch.equal(x, y)  # no atomics: bit for bit
        assert ((x.double() - z.double()).norm() / z.double().norm()).item() < 2e-3


@pytest.mark.parametrize("splits", [2, 4, 8], ids=lambda s: f"kv_splits{s}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_kv_splits_match_float64_and_stay_deterministic(cases, splits, causal):
    """dK/dV over slices of the GQA group (group 8 here; 4:1 for the causal Nq > Nk case),
    partial sums added in slice order: right against float64, bit-identical when run again,
    and close to the unsplit result."""
    for shape in [(1, 8, 1, 37, 53, 32), (2, 8, 2, 61, 29, 64)]:
        case = cases(*shape, torch.float16, seed=5)
        cfg = {**CFG, "KV_SPLITS": splits}
        got = case.grads(cfg, causal=causal)
        case.check(got, causal=causal)
        again = case.run(cfg, causal=causal)
        one = case.grads(CFG, causal=causal)
        for x, y, z in zip(got, again, one):
            assert torch.equal(x, y)
            assert ((x.double() - z.double()).norm() / z.double().norm()).item() < 2e-3
        assert torch.equal(got[0], one[0])  # dQ does not depend on the split


@pytest.mark.parametrize("knobs", [{"ONE_LAUNCH": 1}, {"REVERSE_DQ": 1},
                                   {"ONE_LAUNCH": 1, "REVERSE_DQ": 1, "KV_SPLITS": 2},
                                   {"ONE_LAUNCH": 1, "USE_TMA": 1, "SPLIT_LOOPS": 1}],
                         ids=["one-launch", "reverse-dq", "both-kv-splits", "one-launch-tma"])
def test_one_launch_and_reverse_dq_give_the_same_bits(cases, knobs):
    """ONE_LAUNCH (dK/dV and dQ programs in one grid) and REVERSE_DQ (dQ tiles last-first)
    only reorder programs: right against float64 on GQA/MQA causal shapes with Nq != Nk both
    ways and a padded head dim, and bit-identical to the separate launches."""
    from flashtune.kernel_templates.attn_bwd.launcher import kernel_args

    for shape in [(1, 4, 2, 45, 70, 32), (2, 4, 1, 70, 45, 96)]:
        case = cases(*shape, torch.float16, seed=shape[3])
        for causal in (False, True) if "REVERSE_DQ" not in knobs else (True,):
            base = {**CONFIGS[1], **{n: v for n, v in knobs.items()
                                     if n not in ("ONE_LAUNCH", "REVERSE_DQ")}}
            got = case.grads({**base, **knobs}, causal=causal)
            case.check(got, causal=causal)
            for x, y in zip(got, case.grads(base, causal=causal)):
                assert torch.equal(x, y)
    q, k, v, do = case.q, case.k, case.v, case.do
    out, lse = case.fwd(causal=True)
    # the launches' arguments only: dQ/dK/dV stand-ins of the launcher's layout
    launches = kernel_args(q, k, v, out, lse, do, lse, torch.empty_like(q), torch.empty_like(k),
                           torch.empty_like(v), {**CONFIGS[1], **knobs}, causal=True,
                           scale=0.1, upcast_dot=False, part_k=torch.empty(8, 45, 96),
                           part_v=torch.empty(8, 45, 96))
    if knobs.get("ONE_LAUNCH"):  # cdiv(45, 64) * 2 * 1 * splits dK/dV + cdiv(70, 64) * 2 * 4 dQ
        splits = knobs.get("KV_SPLITS", 1)
        assert list(launches) == ["preprocess", "fused"] + ["kv_reduce"] * (splits > 1)
        assert launches["fused"][3] == (2 * splits + 16, 1)
    else:
        assert list(launches) == ["preprocess", "dkdv", "dq"]
        assert launches["dq"][2]["REVERSE_DQ"] is True


def test_reverse_dq_is_refused_where_it_reorders_nothing():
    full = AttentionProblem(1, 2, 2, 128, 128, 64, False, "bf16")
    assert "causal" in SPEC.space.check({**CFG, "REVERSE_DQ": 1}, full, interpreter_device())
    causal = AttentionProblem(1, 2, 2, 128, 128, 64, True, "bf16")
    assert SPEC.space.check({**CFG, "REVERSE_DQ": 1}, causal, interpreter_device()) is None


def test_kv_splits_follow_the_group(cases):
    from flashtune.kernel_templates.attn_bwd.launcher import kv_splits

    assert [kv_splits({"KV_SPLITS": s}, 8) for s in (1, 2, 4, 8)] == [1, 2, 4, 8]
    assert [kv_splits({"KV_SPLITS": s}, 6) for s in (1, 2, 4, 8)] == [1, 2, 2, 2]
    assert kv_splits({"KV_SPLITS": 8}, 1) == 1 and kv_splits({}, 8) == 1
    # without GQA the knob changes nothing: the same bits
    case = cases(1, 2, 2, 30, 41, 32, torch.float16, seed=6)
    for x, y in zip(case.run({**CFG, "KV_SPLITS": 4}, causal=True),
                    case.run(CFG, causal=True)):
        assert torch.equal(x, y)


def test_bad_backward_configs_are_refused():
    with pytest.raises(ConfigError, match=r"unknown keys \['BLOCK_M'\]"):
        SPEC.space.validate({**CFG, "BLOCK_M": 16})
    with pytest.raises(ConfigError, match=r"missing keys \['BLOCK_N2'\]"):
        SPEC.space.validate({k: v for k, v in CFG.items() if k != "BLOCK_N2"})
    with pytest.raises(ConfigError, match="BLOCK_M1.*24.*allowed"):
        SPEC.space.validate({**CFG, "BLOCK_M1": 24})
    with pytest.raises(ConfigError, match="num_stages"):
        SPEC.space.validate({**CFG, "num_stages": 2.0})
    p = AttentionProblem(1, 2, 2, 128, 128, 256, True, "bf16")
    assert "spill" in SPEC.space.check({**CFG, "BLOCK_N1": 128, "num_warps": 2}, p,
                                       interpreter_device())


# -- the tuner -------------------------------------------------------------------------------


def test_the_tuner_checks_times_and_stores_backward_configs(tmp_path):
    from flashtune.autotune.jobs import tune
    from flashtune.autotune.options import TuneOptions
    from flashtune.db import open_store

    p = AttentionProblem(1, 4, 2, 24, 37, 32, True, "fp16")
    url = f"sqlite:///{tmp_path / 'bwd.db'}"
    # compiled kernels on the GPU with FLASHTUNE_TEST_DEVICE=cuda, the interpreter otherwise
    [res] = tune([p], TuneOptions(template="attn_bwd", trials=2, seed=0,
                                  interpret=DEVICE == "cpu"), db_url=url, progress=False)
    assert res.template == "attn_bwd" and res.best_config is not None
    assert SPEC.space.validate(res.best_config) == res.best_config
    assert res.states.get("COMPLETE", 0) >= 1
    with open_store(url) as store:
        [best] = store.list_best(template_name="attn_bwd")
    assert best.tflops > 0 and best.median_ms > 0


def test_runner_case_flags_wrong_gradients_and_counts_backward_flops():
    from flashtune.autotune.runners import LocalRunner

    p = AttentionProblem(1, 2, 1, 20, 30, 32, False, "fp16")
    dev = current_device(torch.device(DEVICE))
    runner = LocalRunner(SPEC, p, dev, seed=0)
    assert runner.flops == p.flops(backward=True) == 2.5 * p.flops()
    assert runner.evaluate(CFG).state is TrialState.COMPLETE

    def halve_dk(*args, **kwargs):
        dq, dk, dv = attn_bwd(*args, **kwargs)
        return dq, dk * 0.5, dv

    bad = LocalRunner(SPEC, p, dev, seed=0, launcher=halve_dk)
    res = bad.evaluate(CFG)
    assert res.state is TrialState.WRONG_RESULT and "relative error" in res.message


def test_precompile_warms_every_backward_kernel_with_the_launchers_arguments():
    from flashtune.kernel_templates.attn_bwd.warmup import attn_bwd_warmup_args

    p = AttentionProblem(2, 4, 2, 100, 70, 96, True, "bf16")
    launches = attn_bwd_warmup_args(p, SPEC.default_config(p, interpreter_device()))
    assert [kern.fn.__name__ for kern, *_ in launches] == [
        "attn_bwd_preprocess", "attn_bwd_dkdv", "attn_bwd_dq"]
    for kern, args, kwargs, _grid in launches:
        names = list(kern.arg_names)  # every parameter given exactly once
        assert names[len(args):] == [n for n in kwargs if n not in ("num_warps", "num_stages")]
        assert kwargs["BLOCK_D"] == 128 and kwargs["HEAD_DIM"] == 96
    assert launches[1][3] == (3, 4) and launches[2][3] == (4, 8)  # cdiv(70, 32), cdiv(100, 32)
    split = attn_bwd_warmup_args(p, {**SPEC.default_config(p, interpreter_device()),
                                     "KV_SPLITS": 2})
    assert [kern.fn.__name__ for kern, *_ in split] == [
        "attn_bwd_preprocess", "attn_bwd_dkdv", "attn_bwd_kv_reduce", "attn_bwd_dq"]
    assert split[1][3] == (3, 8) and split[1][2]["KV_SPLITS"] == 2
    for kern, args, kwargs, _grid in split:
        names = list(kern.arg_names)
        assert names[len(args):] == [n for n in kwargs if n not in ("num_warps", "num_stages")]
    # USE_TMA: the stand-ins are aligned, so descriptors of the launchers' box shapes
    tma = attn_bwd_warmup_args(p, {**SPEC.default_config(p, interpreter_device()),
                                   "USE_TMA": 1})
    dkdv, dq = tma[1], tma[2]
    assert dkdv[2]["USE_TMA"] and dq[2]["USE_TMA"]
    names = list(dkdv[0].arg_names)
    desc_q = dkdv[1][names.index("desc_q")]
    assert desc_q.block_shape == [1, 1, 16, 128]  # BLOCK_M1 of the interpreter default
    names = list(dq[0].arg_names)
    assert dq[1][names.index("desc_k")].block_shape == [1, 1, 16, 128]  # BLOCK_N2


# -- flashtune.attention with autograd ---------------------------------------------------------


def test_attention_backward_and_lse_gradient():
    q, k, v, do = make(1, 4, 2, 45, 61, 32, torch.float16, seed=4)
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    out, lse = flashtune.attention(q, k, v, causal=True, return_lse=True)
    assert out.grad_fn is not None
    (out.float() * do.float()).sum().backward(inputs=[q, k, v], retain_graph=True)
    assert_grads_close((q.grad, k.grad, v.grad), q.detach(), k.detach(), v.detach(), do,
                       causal=True)
    # the LSE is differentiable too: d lse_i / d s_ij = p_ij
    q.grad = k.grad = v.grad = None
    lse.sum().backward(inputs=[q, k, v])
    ref = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    attn_fwd_reference(*ref, causal=True)[1].sum().backward()
    rel = lambda a, b: ((a.double() - b).norm() / b.norm()).item()  # noqa: E731
    assert rel(q.grad, ref[0].grad) < 5e-3 and rel(k.grad, ref[1].grad) < 5e-3
    assert ref[2].grad is None and not v.grad.any()  # the LSE does not depend on V


def test_the_graph_keeps_no_n_by_n_tensor():
    q, k, v, _ = make(1, 2, 2, 64, 96, 32, torch.float16, seed=5)
    q.requires_grad_(True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t,
                                                  lambda t: t):
        flashtune.attention(q, k, v, causal=True)
    assert sorted(tuple(s) for s in saved) == sorted(
        [(1, 2, 64, 32), (1, 2, 96, 32), (1, 2, 96, 32), (1, 2, 64, 32), (1, 2, 64)])


def test_no_grad_inputs_take_the_inference_path():
    q, k, v, _ = make(1, 2, 2, 16, 16, 32, torch.float16)
    assert flashtune.attention(q, k, v).grad_fn is None
