"""sdpa_cudnn_bwd, SDPA cuDNN's backward fed by another forward, and its training pair
``attn_fwd_gluon_bwd_cudnn`` (the Gluon forward with it): the specs and their limits, the
launcher's call of the aten op (CPU: the op replaced by a stand-in that checks what it is
given and returns float64 gradients), and (GPU, sm_90, ``FLASHTUNE_TEST_DEVICE=cuda``)
gradients against float64 autograd on odd shapes, torch.compile and CUDA graphs."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch

from flashtune.core.device import DeviceFingerprint, interpreter_device
from flashtune.core.errors import ConfigError, InputError
from flashtune.core.problem import AttentionProblem
from flashtune.core.spec import Limits
from flashtune.kernel_templates import get_template, implementations
from flashtune.kernel_templates.attn_bwd.reference import attn_bwd_reference
from flashtune.kernel_templates.attn_fwd.reference import attn_fwd_reference
from flashtune.kernel_templates.registry import source_hash
from flashtune.kernel_templates.sdpa_cudnn_bwd import PAIR_NAME, SPEC, launcher
from flashtune.kernel_templates.training import TrainStep
from tests.helpers import assert_compiles_and_captures, assert_trains_through_attention

H100 = DeviceFingerprint("NVIDIA_H100_80GB_HBM3", "9.0", 132, 232448, 85 * 2**30)
A100 = DeviceFingerprint("NVIDIA_A100_SXM4_80GB", "8.0", 108, 166912, 85 * 2**30)


def _problem(d: int = 128, causal: bool = False, *, hq: int = 8, hkv: int = 8, nq: int = 1000,
             nk: int = 1000, **mods: Any) -> AttentionProblem:
    return AttentionProblem(2, hq, hkv, nq, nk, d, causal, "bf16", **mods)


# -- the specs ---------------------------------------------------------------------------------

def test_it_is_an_extern_backward_bound_to_torch() -> None:
    assert SPEC.op == "bwd" and SPEC.kind == "extern" and SPEC.serves == ()
    assert SPEC.torch_bound and SPEC.reference is attn_bwd_reference
    assert SPEC.space.size == 1 and SPEC.default_config(_problem(), H100) == {}
    assert SPEC not in implementations("fwd") and SPEC not in implementations("train")
    # its hash moves with torch's cuDNN (SDPA cuDNN's hash) and with its launcher
    assert SPEC.source_hash not in (get_template("sdpa_cudnn").source_hash,
                                    source_hash(launcher.__file__))
    assert SPEC.limits.deterministic is False  # cuDNN sums dQ with atomics


def test_the_pair_is_the_gluon_forward_with_cudnns_backward() -> None:
    """What both halves serve: sm_90, head dims 64 and 128, GQA and MQA, causal only with
    Nq == Nk (cuDNN's mask is top-left), no single query over a single key, not packed;
    its LSE has a gradient (a call with one runs the Gluon backward)."""
    fwd, gluon = get_template(PAIR_NAME), get_template("attn_fwd_gluon")
    assert fwd.op == "fwd" and fwd.serves == ("train",) and fwd.backward == SPEC.name
    assert fwd.launcher is gluon.launcher and fwd.source_hash == gluon.source_hash
    assert fwd.torch_bound and not gluon.torch_bound and fwd not in implementations("fwd")
    pair = {s.name: s for s in implementations("train")}[PAIR_NAME]
    assert isinstance(pair.launcher, TrainStep) and pair.launcher.bwd is SPEC
    assert set(pair.space.params) == set(gluon.space.params)  # cuDNN adds no knob
    assert pair.torch_bound and pair.source_hash not in (SPEC.source_hash, gluon.source_hash)
    assert pair.limits.deterministic is False
    limits = replace(pair.limits, available=None)  # this torch may have no cuDNN
    for d in (64, 128):
        assert limits.refuse(_problem(d, True, hq=8, hkv=2, nq=333, nk=333), H100,
                             return_lse=True) is None
        assert limits.refuse(_problem(d, hq=4, hkv=1, nq=197, nk=3000), H100) is None
    assert "causal" in limits.refuse(_problem(64, True, nq=333, nk=517), H100)
    assert "head_dim 256" in limits.refuse(_problem(256), H100)
    assert "head_dim 96" in limits.refuse(_problem(96), H100)
    assert "sm_90" in limits.refuse(_problem(), A100)
    assert limits.refuse(_problem(nq=1, nk=1), H100) is not None
    assert limits.refuse(_problem(tokens_q=1500, tokens_k=1500), H100) is not None
    assert "needs a CUDA GPU" in pair.refuse(_problem(), interpreter_device())
    if not torch.backends.cudnn.is_available():
        assert pair.refuse(_problem(), H100) is not None


def test_cudnn_names_its_own_backward_for_the_compiled_path() -> None:
    """Under ``torch.compile`` a training call's backward is flashtune's custom op, which
    torch's autograd cannot differentiate: cuDNN's forward names this backward
    (``paired_backward``) so such a call runs cuDNN's kernels still. Alone it serves every
    head dim cuDNN's forward does (a call with the LSE's gradient runs attn_bwd where the
    Gluon backward does not serve), on sm_90, with cuDNN's mask and no dropout."""
    cudnn = get_template("sdpa_cudnn")
    assert cudnn.paired_backward == SPEC.name and cudnn.backward is None
    assert SPEC.limits.head_dims == cudnn.limits.head_dims
    limits = replace(SPEC.limits, available=None)
    for d in (64, 96, 128, 256):
        assert limits.refuse(_problem(d, True, hq=8, hkv=2, nq=333, nk=333), H100) is None
    assert "causal" in limits.refuse(_problem(96, True, nq=333, nk=517), H100)
    assert "sm_90" in limits.refuse(_problem(96), A100)
    assert limits.refuse(replace(_problem(96), dropout=0.1), H100) is not None
    assert not any(s.paired_backward for s in implementations("train")
                   if s.name != "sdpa_cudnn")


# -- the launcher's call of the op (CPU, the op replaced) --------------------------------------

class _StandIn:
    """``aten._scaled_dot_product_cudnn_attention_backward`` on the CPU: checks the
    arguments a dense call without dropout must bring, then returns float64 gradients of
    attention with SDPA's top-left causal mask (the same as flashtune's at Nq == Nk)."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def __call__(self, dout, q, k, v, out, stats, seed, offset, bias, cu_q, cu_k, max_q, max_k,
                 dropout_p, is_causal, *, scale=None):
        b, h, nq, _ = q.shape
        assert stats.shape == (b, h, nq, 1) and stats.dtype == torch.float32
        assert stats.stride()[:3] == (h * nq, nq, 1)  # as cuDNN's forward writes its own
        assert (seed, offset, bias, cu_q, cu_k) == (None,) * 5  # no dropout, bias, packing
        assert (max_q, max_k, dropout_p) == (nq, k.shape[2], 0.0)
        self.calls.append({"is_causal": is_causal, "scale": scale, "out": out, "lse": stats})
        grads = attn_bwd_reference(q, k, v, dout, causal=is_causal, scale=scale)
        return tuple(g.to(q.dtype) for g in grads)


@pytest.fixture
def stand_in(monkeypatch: pytest.MonkeyPatch) -> _StandIn:
    op = _StandIn()
    monkeypatch.setattr(launcher, "_BWD", op)
    return op


def _inputs(hq: int = 4, hkv: int = 2, nq: int = 37, nk: int = 37, d: int = 64,
            causal: bool = True, dtype: torch.dtype = torch.float64
            ) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, hq, nq, d, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, hkv, nk, d, generator=g, dtype=torch.float64) for _ in range(2))
    dout = torch.randn(2, hq, nq, d, generator=g, dtype=torch.float64)
    out, lse = attn_fwd_reference(q, k, v, causal=causal, dtype=torch.float64)
    return (*(t.to(dtype) for t in (q, k, v, out)), lse.float(), dout.to(dtype))


@pytest.mark.parametrize("causal,scale,nq,nk", [(True, None, 37, 37), (False, 0.3, 37, 53),
                                                 (True, None, 1, 37)],
                         ids=["causal", "full", "causal-one-query"])
def test_the_op_gets_the_lse_as_cudnns_statistics_and_the_call_s_mask(
        stand_in: _StandIn, causal: bool, scale: float | None, nq: int, nk: int) -> None:
    """The mask is SDPA's ``is_causal`` for flashtune's: the same at Nq == Nk, none for a
    single query (which sees every key, bottom-right), as the pair's limits allow."""
    q, k, v, out, lse, dout = _inputs(nq=nq, nk=nk, causal=causal)
    got = launcher.sdpa_cudnn_bwd(q, k, v, out, lse, dout, {}, causal=causal, scale=scale)
    want = attn_bwd_reference(q, k, v, dout, causal=causal, scale=scale)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)
    call = stand_in.calls[-1]
    assert call["is_causal"] is (causal and nq == nk) and call["scale"] == scale
    assert call["out"] is out and torch.equal(call["lse"][..., 0], lse)


def test_what_it_refuses_is_refused_before_the_op(stand_in: _StandIn) -> None:
    q, k, v, out, lse, dout = _inputs()
    with pytest.raises(ConfigError, match="config must be {}"):
        launcher.sdpa_cudnn_bwd(q, k, v, out, lse, dout, {"BLOCK_M": 64})
    q2, k2, v2, out2, lse2, dout2 = _inputs(nq=20, nk=37)
    with pytest.raises(InputError, match="seqlen_q 20 != seqlen_k 37"):
        launcher.sdpa_cudnn_bwd(q2, k2, v2, out2, lse2, dout2, {}, causal=True)
    with pytest.raises(InputError, match="lse must be float32"):
        launcher.sdpa_cudnn_bwd(q, k, v, out, lse.double(), dout, {}, causal=True)
    with pytest.raises(InputError, match=r"lse must be .*\(2, 4, 37\)"):
        launcher.sdpa_cudnn_bwd(q, k, v, out, lse[:, :2], dout, {}, causal=True)
    with pytest.raises(InputError, match="no gradient of the LSE"):
        launcher.sdpa_cudnn_bwd(q, k, v, out, lse, dout, {}, causal=True,
                                dlse=torch.zeros_like(lse))
    assert stand_in.calls == []


def test_a_call_with_the_lse_s_gradient_runs_the_fallback(stand_in: _StandIn,
                                                          monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    """cuDNN's backward has no input for dLSE: such a call runs the backward that takes it
    (the registered launcher's: attn_bwd_gluon with its default config for the problem)."""
    q, k, v, out, lse, dout = _inputs(dtype=torch.bfloat16)
    dlse = torch.randn_like(lse)
    seen: list[tuple[Any, ...]] = []

    def fallback(*args: Any, **kw: Any) -> tuple[torch.Tensor, ...]:
        seen.append((args, kw))
        return (q, k, v)

    got = launcher.sdpa_cudnn_bwd(q, k, v, out, lse, dout, {}, causal=True, scale=0.2,
                                  dlse=dlse, fallback=fallback)
    assert got == (q, k, v) and stand_in.calls == []
    assert seen[0][1] == {"causal": True, "scale": 0.2, "dlse": dlse}
    # the registered launcher's fallback: the Gluon backward with its default config where
    # it serves the problem, else attn_bwd with its default (here, under the interpreter)
    import flashtune.kernel_templates.sdpa_cudnn_bwd as package

    problem = AttentionProblem.from_tensors(q, k, causal=True)
    calls: list[dict[str, Any]] = []
    for name in ("attn_bwd_gluon", "attn_bwd"):
        monkeypatch.setattr(package, name, lambda *a, name=name, **kw: calls.append(
            {"launcher": name, "config": a[6], **kw}) or (q, k, v))
    package._lse_gradient_route.cache_clear()
    SPEC.launcher(q, k, v, out, lse, dout, {}, causal=True, dlse=dlse)
    tl = get_template("attn_bwd").default_config(problem, interpreter_device())
    assert calls == [{"launcher": "attn_bwd", "config": tl, "causal": True, "scale": None,
                      "dlse": dlse}]
    gluon = get_template("attn_bwd_gluon")
    monkeypatch.setattr(package, "GLUON_BWD", replace(gluon, limits=Limits()))  # it serves
    package._lse_gradient_route.cache_clear()
    SPEC.launcher(q, k, v, out, lse, dout, {}, causal=True, dlse=dlse)
    package._lse_gradient_route.cache_clear()
    want = gluon.default_config(problem, interpreter_device())
    assert calls[1:] == [{"launcher": "attn_bwd_gluon", "config": want, "causal": True,
                          "scale": None, "dlse": dlse}]
    SPEC.launcher(q, k, v, out, lse, dout, {}, causal=True)  # without dLSE: cuDNN's
    assert len(stand_in.calls) == 1 and len(calls) == 2


# -- on the GPU ----------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("d,hq,hkv,n,causal,bshd", [
    (64, 8, 8, 333, True, False), (128, 8, 2, 257, True, True), (64, 4, 1, 197, False, True),
    (128, 4, 4, 1000, False, False), (64, 8, 2, 1031, False, False)],
    ids=["d64-causal", "d128-gqa-causal-bshd", "d64-mqa-bshd", "d128", "d64-gqa-ragged"])
def test_the_pair_trains_through_attention(d, hq, hkv, n, causal, bshd) -> None:
    """``attn_fwd_gluon_bwd_cudnn`` as a user runs it (``flashtune.attention(..., impl=)``
    with gradients): out, dQ, dK and dV against float64 autograd on ragged, GQA and MQA
    shapes in (B, H, N, D) and (B, N, H, D) storage; then a loss on the LSE too (the Gluon
    backward then), against attn_fwd + attn_bwd's gradients of the same loss."""
    assert_trains_through_attention(PAIR_NAME, d, hq, hkv, n, causal, bshd, seed=4)


@pytest.mark.gpu
@pytest.mark.parametrize("d,hkv", [(96, 8), (128, 2)], ids=["d96", "d128-gqa"])
def test_a_compiled_call_near_cudnn_s_training_choice_runs_cudnn_through_the_ops(d, hkv):
    """A training call on sm_90 near the shipped tables' cuDNN choices (or with none: the
    documented default) runs cuDNN's step; under ``torch.compile`` (``paired``) that is
    cuDNN's forward with this backward through flashtune's custom ops, and the compiled step
    gives eager's gradients."""
    import flashtune
    from flashtune.core.device import cuda_device
    from flashtune.runtime import routing

    q, k, v = (torch.randn(2, 700, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
               for h in (8, hkv, hkv))
    if SPEC.refuse(AttentionProblem.from_tensors(q, k, causal=True), cuda_device()):
        pytest.skip("cuDNN's backward does not serve this GPU")
    route = routing._train_route(q, k, True, True, paired=True)
    assert (route.fwd.name, route.bwd) == ("sdpa_cudnn", SPEC)
    assert route.fwd_config == {} and route.bwd_config == {}

    def loss_fn(q, k, v):
        out = flashtune.attention(q, k, v, causal=True)
        return (out.float() ** 2).mean()

    assert_compiles_and_captures(loss_fn, (q, k, v))


@pytest.mark.gpu
def test_the_pair_compiles_and_captures() -> None:
    """The contract of every route: a training step through ``torch.compile(fullgraph=
    True)`` gives eager's gradients, and a forward + backward captured in a CUDA graph
    (on other values) replays to them from the inputs copied in after."""
    import flashtune

    torch.manual_seed(5)
    q, k, v = (torch.randn(2, h, 300, 128, device="cuda", dtype=torch.bfloat16)
               for h in (8, 2, 2))

    def loss_fn(q, k, v):
        out = flashtune.attention(q, k, v, causal=True, impl=PAIR_NAME)
        return (out.float() ** 2).mean()

    assert_compiles_and_captures(loss_fn, (q, k, v))
