"""Launch plans of score-modified inference calls (:mod:`flashtune.runtime.scored`): a
window or a softcap routed to attn_fwd, and a causal sliding window routed to the Gluon
forward, replay a plan that matches the launcher bit for bit; calls that differ only in
their scale get plans of their own; ALiBi slopes, dropout and gradients keep the
launcher."""

from __future__ import annotations

import pytest
import torch

import flashtune
from flashtune.kernel_templates import get_template
from flashtune.kernel_templates.attn_fwd.reference import attn_fwd_reference
from flashtune.runtime import scored

pytestmark = pytest.mark.gpu
FWD, GLUON = get_template("attn_fwd"), get_template("attn_fwd_gluon")
FWD_CONFIG = {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3, "USE_TMA": 1,
              "REVERSE_M": 0}
GLUON_CONFIG = {"ROWS": 64, "BLOCK_N": 64, "NUM_STAGES": 2, "NUM_CONSUMERS": 2, "PINGPONG": 1,
                "PERSISTENT": 0, "SPLIT_KV": 1, "TMA_STORE": 1}


@pytest.fixture
def routed_to(monkeypatch):
    """Every score-modified call routes to the given kernel and config (the tables would
    choose by shape and GPU)."""
    def route(spec, config):
        monkeypatch.setattr(scored, "_choose", lambda *a, **kw: (spec, dict(config), None,
                                                                 None))
        scored.reset()
    yield route
    scored.reset()


def _qkv(b=2, hq=8, hkv=2, n=333, d=128, bshd=False):
    def make(h):
        if bshd:  # transformers' layout: (B, N, H, D) storage seen as (B, H, N, D)
            return torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        return torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16)
    return make(hq), make(hkv), make(hkv)


CASES = [  # (kernel, config, mods, head dim)
    (FWD, FWD_CONFIG, {"causal": True, "window": (100, 0)}, 128),
    (FWD, FWD_CONFIG, {"causal": False, "window": (64, 32)}, 64),
    (FWD, FWD_CONFIG, {"causal": True, "softcap": 30.0}, 256),
    (FWD, FWD_CONFIG, {"causal": True, "window": (50, 0), "softcap": 20.0}, 96),
    (FWD, FWD_CONFIG, {"causal": True, "window": (100, 0)}, 59),  # run padded
    (GLUON, GLUON_CONFIG, {"causal": True, "window": (100, 0)}, 128),
    (GLUON, GLUON_CONFIG, {"causal": True, "window": (200, 0)}, 256),
]


@pytest.mark.parametrize("bshd", [False, True])
@pytest.mark.parametrize("return_lse", [False, True])
@pytest.mark.parametrize("spec,config,mods,d", CASES,
                         ids=[f"{s.name}-{'-'.join(m)}-d{d}" for s, _, m, d in CASES])
def test_planned_score_modified_calls_match_the_launcher_bit_for_bit(routed_to, spec, config,
                                                                     mods, d, return_lse, bshd):
    routed_to(spec, config)
    q, k, v = _qkv(d=d, bshd=bshd)
    want = spec.launcher(q, k, v, config, return_lse=return_lse, **mods)
    for i in range(3):  # the first call builds the plan, the others replay it
        got = flashtune.attention(q, k, v, return_lse=return_lse, **mods)
        assert len(scored._PLANS) == 1 and None not in scored._PLANS.values()
        for a, b in zip(got if return_lse else (got,), want if return_lse else (want,)):
            assert torch.equal(a, b), i
    ref, _ = attn_fwd_reference(q, k, v, dtype=torch.float32, **mods)
    out = got[0] if return_lse else got
    assert ((out.float() - ref).norm() / ref.norm()).item() < 1e-2
    # new inputs of the same layout replay the same plan and read what they hold now
    q2, k2, v2 = _qkv(d=d, bshd=bshd)
    got = flashtune.attention(q2, k2, v2, return_lse=return_lse, **mods)
    assert len(scored._PLANS) == 1
    want = spec.launcher(q2, k2, v2, config, return_lse=return_lse, **mods)
    assert torch.equal(got[0] if return_lse else got, want[0] if return_lse else want)


def test_a_call_of_another_scale_gets_a_plan_of_its_own(routed_to):
    routed_to(FWD, FWD_CONFIG)
    q, k, v = _qkv(d=64)
    a = flashtune.attention(q, k, v, causal=True, window=(40, 0))
    b = flashtune.attention(q, k, v, causal=True, window=(40, 0), scale=0.5)
    assert len(scored._PLANS) == 2
    assert torch.equal(b, FWD.launcher(q, k, v, FWD_CONFIG, causal=True, window=(40, 0),
                                       scale=0.5))
    assert not torch.equal(a, b)


def test_alibi_dropout_and_gradients_keep_the_launcher(routed_to):
    routed_to(FWD, FWD_CONFIG)
    q, k, v = _qkv(d=64)
    slopes = torch.rand(8, device="cuda", dtype=torch.float32)
    flashtune.attention(q, k, v, causal=True, alibi_slopes=slopes)
    flashtune.attention(q, k, v, causal=True, window=(40, 0), dropout_p=0.1)
    assert scored._PLANS == {}


def test_a_window_the_gluon_plan_does_not_serve_keeps_the_launcher(routed_to):
    """A Gluon route with a window it cannot plan (none here: the router would not send
    one) keeps None under the key, and the launcher's own error is the caller's."""
    routed_to(GLUON, GLUON_CONFIG)
    q, k, v = _qkv(d=128)
    with pytest.raises(ValueError, match="causal sliding window"):
        flashtune.attention(q, k, v, causal=False, window=(40, 40))
    assert list(scored._PLANS.values()) == [None]
