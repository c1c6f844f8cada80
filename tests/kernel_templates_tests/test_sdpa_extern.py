"""torch SDPA's backends as extern implementations: their specs, declared limits, launcher
refusals, the math backend's numerics and the tuner's path through it (CPU)."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from flashtune.autotune.runners import LocalRunner
from flashtune.core.device import DeviceFingerprint, interpreter_device
from flashtune.core.errors import ConfigError, InputError
from flashtune.core.problem import MAX_HEAD_DIM, AttentionProblem
from flashtune.core.spec import Limits
from flashtune.db.records import TrialState
from flashtune.kernel_templates import get_template, implementations, known_names, sdpa_extern
from flashtune.kernel_templates.sdpa_extern import extern_hash, sdpa_math
from tests.conftest import DEVICE
from tests.helpers import assert_close_to_reference

NAMES = ("sdpa_cudnn", "sdpa_flash", "sdpa_efficient", "sdpa_math")
FUSED = ("sdpa_cudnn", "sdpa_flash", "sdpa_efficient")
H100 = DeviceFingerprint("NVIDIA_H100_80GB_HBM3", "9.0", 132, 232448, 85 << 30)
T4 = DeviceFingerprint("Tesla_T4", "7.5", 40, 65536, 16 << 30)
DTYPES = [torch.float16, torch.bfloat16]


def _problem(**kw: object) -> AttentionProblem:
    base = dict(batch=1, heads_q=2, heads_kv=2, seqlen_q=37, seqlen_k=37, head_dim=64,
                causal=False, dtype="fp16")
    base.update(kw)
    return AttentionProblem(**base)  # type: ignore[arg-type]


def make_qkv(b, hq, hkv, nq, nk, d, dtype, *, seed=0, layout="bhnd"):
    g = torch.Generator().manual_seed(seed)

    def rand(h, n):
        if layout == "bnhd":  # (B, N, H, D) storage seen as (B, H, N, D)
            return torch.randn(b, n, h, d, generator=g).to(dtype).to(DEVICE).transpose(1, 2)
        return torch.randn(b, h, n, d, generator=g).to(dtype).to(DEVICE)
    return rand(hq, nq), rand(hkv, nk), rand(hkv, nk)


# -- the specs ----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
def test_each_backend_is_an_extern_with_one_empty_config(name: str) -> None:
    spec = get_template(name)
    assert name in known_names()
    assert (spec.name, spec.op, spec.kind, spec.serves) == (name, "fwd", "extern",
                                                            ("fwd", "train", "decode"))
    assert spec.space.size == 1 and list(spec.space) == [{}]
    assert spec.space.valid_configs(_problem(), interpreter_device()) == [{}]
    assert spec.default_config(_problem(), interpreter_device()) == {}
    assert spec.tunable and spec.warmup_launches is None
    assert spec in implementations("fwd") and spec in implementations("decode")


def test_the_source_hash_follows_the_backend_torch_and_cudnn() -> None:
    h = extern_hash("flash", "2.9.0+cu128")
    assert re.fullmatch(r"[0-9a-f]{16}", h)
    assert extern_hash("flash", "2.9.0+cu128") == h
    assert extern_hash("flash", "2.9.1+cu128") != h
    assert extern_hash("efficient", "2.9.0+cu128") != h
    assert extern_hash("cudnn", "2.9.0+cu128", 91002) != extern_hash("cudnn", "2.9.0+cu128",
                                                                      91100)
    for name in NAMES:
        spec = get_template(name)
        backend = name.removeprefix("sdpa_")
        cudnn = sdpa_extern._cudnn_version() if backend == "cudnn" else None
        assert spec.source_hash == extern_hash(backend, str(torch.__version__), cudnn)
    assert len({get_template(n).source_hash for n in NAMES}) == 4


def test_an_unknown_backend_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown SDPA backend 'fast'"):
        sdpa_extern.extern_spec("fast")


# -- declared limits ----------------------------------------------------------------------------

def _no_process_check(name: str) -> Limits:
    return dataclasses.replace(get_template(name).limits, available=None)


@pytest.mark.parametrize("name", FUSED)
def test_the_fused_backends_need_a_gpu(name: str) -> None:
    reason = get_template(name).refuse(_problem(), interpreter_device())
    assert reason is not None and "needs a CUDA GPU" in reason


@pytest.mark.parametrize("name", FUSED)
def test_the_fused_backends_refuse_unaligned_causal_and_efficient_gqa(name: str) -> None:
    spec = get_template(name)
    gqa = spec.refuse(_problem(heads_q=4, heads_kv=2), H100)
    if name == "sdpa_efficient":
        assert gqa is not None and "GQA" in gqa
    else:  # cuDNN and flash take GQA as it is (checked on the GPU)
        assert gqa is None or "GQA" not in gqa
    unaligned = spec.refuse(_problem(seqlen_q=21, seqlen_k=37, causal=True), H100)
    assert unaligned is not None and "top-left" in unaligned
    limits = _no_process_check(name)
    assert limits.refuse(_problem(seqlen_q=1, seqlen_k=37, causal=True), H100) is None
    assert limits.refuse(_problem(seqlen_q=37, seqlen_k=37, causal=True), H100) is None
    assert limits.refuse(_problem(seqlen_q=21, seqlen_k=37), H100) is None
    assert limits.refuse(_problem(), H100, return_lse=True) is None
    # one query over one key: cuDNN's frontend refuses it ("s_q = s_kv = 1 is not
    # supported", FlashAttention-2's test_flash_attn_bwd_overflow on the H100)
    single = limits.refuse(_problem(seqlen_q=1, seqlen_k=1), H100)
    if name == "sdpa_cudnn":
        assert single is not None and "seqlen_q = seqlen_k = 1" in single
    else:
        assert single is None
    # torch's flash serves every head dim up to 256 (the launcher pads as torch does);
    # cuDNN and the efficient kernel multiples of 8 only: the others go to attn_fwd
    served = [d for d in range(1, MAX_HEAD_DIM + 1)
              if limits.refuse(_problem(head_dim=d), H100) is None]
    if name == "sdpa_flash":
        assert served == list(range(1, MAX_HEAD_DIM + 1))
    else:
        assert served == list(range(8, MAX_HEAD_DIM + 1, 8))
        assert "head_dim 59" in limits.refuse(_problem(head_dim=59), H100)


def test_the_math_backend_runs_anywhere_without_an_lse() -> None:
    spec = get_template("sdpa_math")
    cpu = interpreter_device()
    assert spec.refuse(_problem(), cpu) is None
    assert spec.refuse(_problem(seqlen_q=1, seqlen_k=37, causal=True), cpu) is None
    reason = spec.refuse(_problem(), cpu, return_lse=True)
    assert reason is not None and "LSE" in reason
    unaligned = spec.refuse(_problem(seqlen_q=21, seqlen_k=37, causal=True), cpu)
    assert unaligned is not None and "top-left" in unaligned
    if sdpa_extern._MATH_GQA:
        assert spec.refuse(_problem(heads_q=4, heads_kv=2), cpu) is None


def test_what_the_process_offers_is_asked_of_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    if torch.version.cuda is None:
        for name in FUSED:
            reason = get_template(name).limits.available(H100)  # type: ignore[misc]
            assert reason is not None and "without CUDA" in reason
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    flash = get_template("sdpa_flash").limits.available
    efficient = get_template("sdpa_efficient").limits.available
    cudnn = get_template("sdpa_cudnn").limits.available
    assert flash is not None and efficient is not None and cudnn is not None
    assert "sm_80" in (flash(T4) or "") and "sm_80" in (cudnn(T4) or "")
    monkeypatch.setattr(torch.backends.cuda, "is_flash_attention_available", lambda: True)
    monkeypatch.setattr(torch.backends.cuda, "flash_sdp_enabled", lambda: False)
    assert "flash_sdp_enabled" in (flash(H100) or "")
    monkeypatch.setattr(torch.backends.cuda, "flash_sdp_enabled", lambda: True)
    assert flash(H100) is None
    monkeypatch.setattr(torch.backends.cuda, "mem_efficient_sdp_enabled", lambda: False)
    assert "mem_efficient_sdp_enabled" in (efficient(T4) or "")
    monkeypatch.setattr(torch.backends.cuda, "mem_efficient_sdp_enabled", lambda: True)
    assert efficient(T4) is None
    monkeypatch.setattr(torch.backends.cuda, "cudnn_sdp_enabled", lambda: False)
    assert "cudnn_sdp_enabled" in (cudnn(H100) or "")
    monkeypatch.setattr(torch.backends.cuda, "cudnn_sdp_enabled", lambda: True)
    monkeypatch.setattr(sdpa_extern, "_cudnn_version", lambda: 8907)
    assert "cuDNN 9" in (cudnn(H100) or "")
    monkeypatch.setattr(sdpa_extern, "_cudnn_version", lambda: 91002)
    monkeypatch.setattr(sdpa_extern, "_CUDNN_CURRENT", False)
    assert "predates" in (cudnn(H100) or "")
    monkeypatch.setattr(sdpa_extern, "_CUDNN_CURRENT", True)
    assert cudnn(H100) is None


# -- the launchers' refusals --------------------------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
def test_a_config_other_than_empty_is_refused(name: str) -> None:
    q, k, v = make_qkv(1, 2, 2, 5, 7, 16, torch.float16)
    launcher = get_template(name).launcher
    for bad in ({"BLOCK_M": 64}, None):
        with pytest.raises(ConfigError, match="config must be {}"):
            launcher(q, k, v, bad)


@pytest.mark.parametrize("name", NAMES)
def test_unaligned_causal_is_refused_by_the_launcher(name: str) -> None:
    q, k, v = make_qkv(1, 2, 2, 5, 7, 16, torch.float16)
    with pytest.raises(InputError, match="causal_unaligned"):
        get_template(name).launcher(q, k, v, {}, causal=True)


@pytest.mark.parametrize("name", ["sdpa_efficient"])
def test_gqa_is_refused_by_the_efficient_launcher(name: str) -> None:
    q, k, v = make_qkv(1, 4, 2, 5, 7, 16, torch.float16)
    with pytest.raises(InputError, match="GQA"):
        get_template(name).launcher(q, k, v, {})


def test_the_math_launcher_cannot_return_the_lse() -> None:
    q, k, v = make_qkv(1, 2, 2, 5, 7, 16, torch.float16)
    with pytest.raises(InputError, match="LSE"):
        sdpa_math(q, k, v, {}, return_lse=True)


# -- the math backend's numerics ----------------------------------------------------------------

SHAPES = [
    # (b, hq, hkv, nq, nk, d, causal)
    (2, 3, 3, 77, 133, 64, False),
    (1, 2, 2, 77, 77, 32, True),     # causal, Nq == Nk: SDPA's is_causal
    (2, 2, 2, 1, 37, 128, True),     # causal decode: one row sees every key
    (1, 2, 2, 133, 77, 16, False),   # Nq > Nk
]


@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "b{}h{}:{}q{}k{}d{}{}".format(
    *s[:6], "c" if s[6] else ""))
def test_the_math_backend_matches_the_reference(shape, dtype, layout) -> None:
    b, hq, hkv, nq, nk, d, causal = shape
    q, k, v = make_qkv(b, hq, hkv, nq, nk, d, dtype, layout=layout)
    assert (layout == "bhnd") == k.is_contiguous()
    out = sdpa_math(q, k, v, {}, causal=causal)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert_close_to_reference(out, q, k, v, causal=causal)


def test_the_math_backend_takes_a_scale_and_gqa() -> None:
    q, k, v = make_qkv(1, 6, 2, 45, 70, 64, torch.float16, seed=3)
    if not sdpa_extern._MATH_GQA:
        with pytest.raises(InputError, match="GQA"):
            sdpa_math(q, k, v, {})
        return
    out = sdpa_math(q, k, v, {}, scale=0.3)
    assert_close_to_reference(out, q, k, v, causal=False, scale=0.3)


def test_the_math_backend_keeps_autograd() -> None:
    q, k, v = (t.requires_grad_() for t in make_qkv(1, 2, 2, 9, 13, 16, torch.float16))
    out = sdpa_math(q, k, v, {}, causal=False)
    assert out.requires_grad
    out.float().sum().backward()
    assert q.grad is not None and k.grad is not None and v.grad is not None


# -- the tuner's path ---------------------------------------------------------------------------

def test_the_tuner_evaluates_the_math_backend() -> None:
    spec = get_template("sdpa_math")
    for problem in (_problem(seqlen_q=21, seqlen_k=37, head_dim=16),
                    _problem(seqlen_q=1, seqlen_k=37, head_dim=16, causal=True, dtype="bf16")):
        result = LocalRunner(spec, problem, interpreter_device()).evaluate({})
        assert result.state is TrialState.COMPLETE, result.message
        assert result.median_ms is not None and result.median_ms > 0


def test_bound_inference_checks_once_and_binds_only_where_it_saves_work() -> None:
    """What the runtime memoises per call signature for an extern: the launcher's checks run
    when it is bound (unaligned causal, the efficient backend's GQA); math, and an LSE that
    needs reshaping, are left to the launcher (None)."""
    q, k = torch.empty(1, 4, 5, 64), torch.empty(1, 2, 9, 64)
    bind = sdpa_extern.bound_inference
    with pytest.raises(InputError, match="causal"):
        bind("sdpa_cudnn", q, k, causal=True, scale=None, return_lse=False)
    with pytest.raises(InputError, match="GQA"):
        bind("sdpa_efficient", q, k, causal=False, scale=None, return_lse=False)
    assert callable(bind("sdpa_cudnn", q, k, causal=False, scale=None, return_lse=False))
    assert callable(bind("sdpa_flash", q, k, causal=False, scale=None, return_lse=True))
    assert bind("sdpa_cudnn", q, k, causal=False, scale=None, return_lse=True) is None
    assert bind("sdpa_math", q, k, causal=False, scale=None, return_lse=False) is None
    assert bind("attn_fwd", q, k, causal=False, scale=None, return_lse=False) is None


def test_bound_inference_calls_torch_s_sdpa_only_where_torch_picks_that_backend(monkeypatch):
    """Where ``F.scaled_dot_product_attention`` would itself run the routed backend (asked
    once, at bind time), the bound call is that function (one tensor back to Python instead
    of the op's nine); elsewhere, and with an LSE, the op."""
    from torch.nn.attention import SDPBackend

    assert sdpa_extern._PICKS == {"sdpa_flash": int(SDPBackend.FLASH_ATTENTION),
                                  "sdpa_efficient": int(SDPBackend.EFFICIENT_ATTENTION),
                                  "sdpa_cudnn": int(SDPBackend.CUDNN_ATTENTION)}
    calls = []
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *a, **kw: calls.append(kw) or "sdpa")
    q, k = torch.empty(1, 4, 5, 64), torch.empty(1, 2, 5, 64)
    for picked, name, want in ((3, "sdpa_cudnn", "sdpa"), (1, "sdpa_flash", "sdpa"),
                               (1, "sdpa_cudnn", None)):
        monkeypatch.setattr(sdpa_extern, "_torch_picks", lambda *a, p=picked: p)
        fn = sdpa_extern.bound_inference(name, q, k, causal=True, scale=0.5, return_lse=False)
        if want is None:  # the op itself (not run on this CPU)
            assert "cudnn" in fn.__code__.co_freevars and "sdpa" not in fn.__code__.co_freevars
            continue
        assert sdpa_extern.any_layout(fn)  # torch's SDPA itself, the options bound
        assert fn(q, k, k) == "sdpa"
        assert calls.pop() == {"is_causal": True, "scale": 0.5, "enable_gqa": True}
    monkeypatch.setattr(sdpa_extern, "_torch_picks", lambda *a: 1)
    fn = sdpa_extern.bound_inference("sdpa_flash", q, k, causal=False, scale=None,
                                     return_lse=True)
    assert fn.__code__.co_freevars[0] == "flash"  # the LSE comes from the op
    assert not sdpa_extern.any_layout(fn)
