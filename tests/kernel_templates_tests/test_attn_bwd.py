"""attn_bwd gradients against float64 autograd on odd shapes (interpreter or GPU), and the
autograd wiring of flashtune.attention."""

from __future__ import annotations

import pytest
import torch

import flashtune
from flashtune.autotune.devices import interpreter_device
from flashtune.autotune.problems import AttentionProblem
from flashtune.errors import ConfigError
from flashtune.kernel_templates import get_template
from flashtune.kernel_templates.attn_bwd import attn_bwd, attn_bwd_reference
from flashtune.kernel_templates.attn_fwd import attn_fwd
from tests.conftest import DEVICE

SPEC = get_template("attn_bwd")
FWD_CFG = {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 2, "num_stages": 1}
CFG = {"BLOCK_M1": 16, "BLOCK_N1": 32, "BLOCK_M2": 32, "BLOCK_N2": 16, "num_warps": 2,
       "num_stages": 1}
DTYPES = [torch.float16, torch.bfloat16]


def make(b, hq, hkv, nq, nk, d, dtype, seed=0, layout="bhnd"):
    g = torch.Generator().manual_seed(seed)

    def rand(h, n):
        if layout == "bnhd":
            return torch.randn(b, n, h, d, generator=g).to(dtype).to(DEVICE).transpose(1, 2)
        return torch.randn(b, h, n, d, generator=g).to(dtype).to(DEVICE)
    return rand(hq, nq), rand(hkv, nk), rand(hkv, nk), rand(hq, nq)


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def assert_grads_close(got, q, k, v, do, causal):
    """flash-attention's rule: at most 3x the error of torch's own computation in the input
    dtype (autograd through plain attention), with a small floor."""
    exact = attn_bwd_reference(q, k, v, do, causal=causal, dtype=torch.float64)
    low = attn_bwd_reference(q.float(), k.float(), v.float(), do.float(), causal=causal,
                             dtype=torch.float32)
    for name, g, ref, base in zip(("dq", "dk", "dv"), got, exact, low):
        assert g.shape == ref.shape and g.dtype == q.dtype, name
        assert torch.isfinite(g).all(), name
        torch_err = rel(base.to(q.dtype), ref)  # torch's error rounded to the input dtype
        assert rel(g, ref) <= 3 * torch_err + 2e-3, (name, rel(g, ref), torch_err)


SHAPES = [
    # (b, hq, hkv, nq, nk, d)
    (2, 2, 2, 37, 53, 32),
    (1, 2, 2, 53, 37, 64),   # Nq > Nk: causal leaves the first rows without keys
    (1, 2, 2, 1, 45, 32),    # one query row
    (1, 6, 2, 33, 33, 32),   # GQA 6:2: dK/dV summed over the group
    (1, 4, 1, 40, 29, 96),   # MQA, head_dim not a power of two
]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "b{}h{}:{}q{}k{}d{}".format(*s))
def test_gradients_match_float64(shape, causal, dtype):
    q, k, v, do = make(*shape, dtype)
    out, lse = attn_fwd(q, k, v, FWD_CFG, causal=causal, return_lse=True)
    assert_grads_close(attn_bwd(q, k, v, out, lse, do, CFG, causal=causal), q, k, v, do, causal)


def test_strided_inputs_and_custom_scale():
    q, k, v, do = make(2, 4, 2, 29, 41, 64, torch.float16, layout="bnhd")
    assert not q.is_contiguous() and q.stride(-1) == 1
    out, lse = attn_fwd(q, k, v, FWD_CFG, causal=True, scale=0.3, return_lse=True)
    got = attn_bwd(q, k, v, out, lse, do, CFG, causal=True, scale=0.3)
    exact = attn_bwd_reference(q, k, v, do, causal=True, scale=0.3)
    for g, ref in zip(got, exact):
        assert rel(g, ref) < 5e-3


def test_configs_agree_and_runs_are_deterministic():
    q, k, v, do = make(1, 4, 2, 45, 45, 32, torch.float16, seed=3)
    out, lse = attn_fwd(q, k, v, FWD_CFG, causal=True, return_lse=True)
    a = attn_bwd(q, k, v, out, lse, do, CFG, causal=True)
    again = attn_bwd(q, k, v, out, lse, do, CFG, causal=True)
    other = attn_bwd(q, k, v, out, lse, do, {**CFG, "BLOCK_M1": 32, "BLOCK_N1": 16,
                                              "BLOCK_M2": 16, "BLOCK_N2": 32}, causal=True)
    for x, y, z in zip(a, again, other):
        assert torch.equal(x, y)  # no atomics: bit for bit
        assert rel(x, z) < 5e-3


# -- flashtune.attention with autograd ---------------------------------------------------------


def test_attention_backward_and_lse_gradient():
    q, k, v, do = make(1, 4, 2, 45, 61, 32, torch.float16, seed=4)
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    out, lse = flashtune.attention(q, k, v, causal=True, return_lse=True)
    assert out.grad_fn is not None
    (out.float() * do.float()).sum().backward(inputs=[q, k, v], retain_graph=True)
    assert_grads_close((q.grad, k.grad, v.grad), q, k, v, do, True)
    # the LSE is differentiable too: d lse_i / d s_ij = p_ij
    q.grad = k.grad = v.grad = None
    lse.sum().backward(inputs=[q, k, v])
    from flashtune.kernel_templates.attn_fwd.reference import attn_fwd_reference

    ref = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    attn_fwd_reference(*ref, causal=True)[1].sum().backward()
    assert rel(q.grad, ref[0].grad) < 5e-3 and rel(k.grad, ref[1].grad) < 5e-3
    assert ref[2].grad is None and not v.grad.any()  # the LSE does not depend on V


def test_the_graph_keeps_no_n_by_n_tensor():
    q, k, v, _ = make(1, 2, 2, 64, 96, 32, torch.float16, seed=5)
    q.requires_grad_(True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t,
                                                  lambda t: t):
        flashtune.attention(q, k, v, causal=True)
    assert saved and all(64 * 96 not in (s[-2] * s[-1] if len(s) > 1 else 0,) for s in saved)
    assert sorted(tuple(s) for s in saved) == sorted(
        [(1, 2, 64, 32), (1, 2, 96, 32), (1, 2, 96, 32), (1, 2, 64, 32), (1, 2, 64)])


def test_no_grad_inputs_take_the_inference_path():
    q, k, v, _ = make(1, 2, 2, 16, 16, 32, torch.float16)
    assert flashtune.attention(q, k, v).grad_fn is None


def test_bad_backward_configs_are_refused():
    with pytest.raises(ConfigError, match="unknown keys"):
        SPEC.space.validate({**CFG, "BLOCK_X": 16})
    with pytest.raises(ConfigError):
        SPEC.space.validate({**CFG, "BLOCK_M1": 24})
    p = AttentionProblem(1, 2, 2, 128, 128, 256, True, "bf16")
    assert "spill" in SPEC.space.check({**CFG, "BLOCK_N1": 128, "num_warps": 2}, p,
                                       interpreter_device())
    assert SPEC.space.check(SPEC.default_config(p, interpreter_device()), p,
                            interpreter_device()) is None


def test_attn_bwd_is_not_offered_to_the_tuner_yet(tmp_path):
    from flashtune.autotune.jobs import TuneOptions, tune

    p = AttentionProblem(1, 2, 2, 16, 16, 32, True, "fp16")
    with pytest.raises(ConfigError, match="cannot be tuned yet"):
        tune([p], TuneOptions(template="attn_bwd", trials=1, interpret=True),
             db_url=f"sqlite:///{tmp_path / 'x.db'}", progress=False)
