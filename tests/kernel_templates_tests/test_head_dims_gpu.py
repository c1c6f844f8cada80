"""GPU-only checks of every head dim 1..256 (issue 31, item 1) on the head dims real models
and FlashAttention-2's tests use: 40, 80, 160 (Stable Diffusion 1.x), 80 (Phi-2), 224, and
the odd 59 and 111. attn_fwd and attn_bwd with their default configs (compiled, TMA where
the head dim allows it, plain masked loads where it does not) against the float64
reference under the flash-attention tolerance rule, strided views, explicit configs across
the knobs, flashtune.attention's autograd and routing, and ``sdpa_flash``'s padding.

    FLASHTUNE_TEST_DEVICE=cuda python -m pytest tests/kernel_templates_tests/test_head_dims_gpu.py
"""

from __future__ import annotations

import pytest
import torch

import flashtune
from flashtune.core.device import cuda_device
from flashtune.core.problem import AttentionProblem
from flashtune.kernel_templates import get_template, sdpa_extern
from flashtune.kernel_templates.tma import tma_ok
from tests.helpers import assert_close_to_reference, assert_grads_close

pytestmark = pytest.mark.gpu
FWD = get_template("attn_fwd")
BWD = get_template("attn_bwd")
DIMS = [40, 59, 80, 111, 160, 224]
DTYPES = [torch.float16, torch.bfloat16]


def _inputs(b, hq, hkv, nq, nk, d, dtype, *, seed=0, layout="bhnd"):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def rand(h, n):
        if layout == "bnhd":  # (B, N, H, D) storage viewed as (B, H, N, D)
            return torch.randn(b, n, h, d, device="cuda", generator=g).to(dtype).transpose(1, 2)
        return torch.randn(b, h, n, d, device="cuda", generator=g).to(dtype)
    return rand(hq, nq), rand(hkv, nk), rand(hkv, nk), rand(hq, nq)


def _hopper() -> bool:
    return torch.cuda.get_device_capability() >= (9, 0)


SHAPES = [
    # (b, hq, hkv, nq, nk, causal, layout)
    (2, 8, 8, 1000, 1000, True, "bhnd"),
    (1, 8, 2, 513, 777, True, "bnhd"),    # GQA 4:1, Nq < Nk, transposed views
    (2, 4, 4, 777, 640, False, "bhnd"),   # Nq > Nk, full
]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "b{}h{}:{}q{}k{}{}-{}".format(
    *s[:5], "c" if s[5] else "", s[6]))
@pytest.mark.parametrize("d", DIMS)
def test_default_configs_meet_the_tolerance_rule(d, shape, dtype):
    b, hq, hkv, nq, nk, causal, layout = shape
    q, k, v, do = _inputs(b, hq, hkv, nq, nk, d, dtype, seed=d, layout=layout)
    p = AttentionProblem.from_tensors(q, k, causal=causal)
    fcfg, bcfg = FWD.default_config(p, cuda_device()), BWD.default_config(p, cuda_device())
    if _hopper():  # TMA everywhere: a head dim that is not a multiple of 8 runs padded
        assert fcfg["USE_TMA"] == bcfg["USE_TMA"] == 1, (fcfg, bcfg)
    out, lse = FWD.launcher(q, k, v, fcfg, causal=causal, return_lse=True)
    assert_close_to_reference(out, q, k, v, causal=causal, lse=lse)
    grads = BWD.launcher(q, k, v, out, lse, do, bcfg, causal=causal)
    assert_grads_close(grads, q, k, v, do, causal=causal)


FWD_CONFIGS = [
    {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3, "USE_TMA": 1},
    {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2, "USE_TMA": 0,
     "REVERSE_M": 1},
]
BWD_CONFIGS = [
    {"BLOCK_M1": 32, "BLOCK_N1": 64, "BLOCK_M2": 64, "BLOCK_N2": 32, "num_warps": 4,
     "num_stages": 2, "USE_TMA": 1, "SPLIT_LOOPS": 1, "KV_SPLITS": 2},
    {"BLOCK_M1": 16, "BLOCK_N1": 64, "BLOCK_M2": 64, "BLOCK_N2": 16, "num_warps": 8,
     "num_stages": 1, "USE_TMA": 0, "ONE_LAUNCH": 1, "REVERSE_DQ": 1},
]


@pytest.mark.parametrize("d", DIMS)
def test_explicit_configs_across_the_knobs(d):
    """USE_TMA asked for at every head dim (the launchers drop it where a row is not a
    16-byte multiple), split loops, GQA splits, one launch; wherever the device holds it."""
    q, k, v, do = _inputs(1, 8, 2, 333, 517, d, torch.bfloat16, seed=d + 1)
    p = AttentionProblem.from_tensors(q, k, causal=True)
    for fcfg in FWD_CONFIGS:
        if FWD.space.check({**fcfg, "USE_TMA": 0}, p, cuda_device()) is not None:
            continue  # more shared memory than the device has at this BLOCK_D
        got, got_lse = FWD.launcher(q, k, v, fcfg, causal=True, return_lse=True)
        assert_close_to_reference(got, q, k, v, causal=True, lse=got_lse)
    out, lse = FWD.launcher(q, k, v, FWD.default_config(p, cuda_device()), causal=True,
                            return_lse=True)
    for bcfg in BWD_CONFIGS:
        if BWD.space.check({**bcfg, "USE_TMA": 0}, p, cuda_device()) is not None:
            continue
        grads = BWD.launcher(q, k, v, out, lse, do, bcfg, causal=True)
        assert_grads_close(grads, q, k, v, do, causal=True)


def test_an_unaligned_head_dim_in_aligned_rows_reads_without_tma():
    """D59 as the first 59 columns of 64-wide rows: strides aligned, the row's extent not;
    the launcher reads it with plain loads (the same bits as asking for none)."""
    base = torch.randn(2, 4, 300, 64, device="cuda", dtype=torch.float16)
    q = base[..., :59]
    k, v = (torch.randn_like(base)[..., :59] for _ in range(2))
    assert not tma_ok(q) and q.stride(-1) == 1
    cfg = FWD_CONFIGS[0]
    out, lse = FWD.launcher(q, k, v, cfg, causal=True, return_lse=True)
    assert torch.equal(out, FWD.launcher(q, k, v, {**cfg, "USE_TMA": 0}, causal=True))
    assert_close_to_reference(out, q, k, v, causal=True, lse=lse)


@pytest.mark.parametrize("d", [59, 80, 111, 224])
def test_flashtune_attention_trains_at_these_head_dims(d):
    """The public op with gradients (whatever the router picks: attn_fwd + attn_bwd where
    cuDNN cannot serve the head dim, cuDNN by default on sm_90 where it can)."""
    q, k, v, do = _inputs(2, 8, 4, 700, 700, d, torch.bfloat16, seed=d + 2, layout="bnhd")
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    out = flashtune.attention(*leaves, causal=True)
    assert_close_to_reference(out.detach(), q, k, v, causal=True)
    out.backward(do)
    assert_grads_close(tuple(t.grad for t in leaves), q, k, v, do, causal=True)
    choice = flashtune.lookup_config(q, k, v, causal=True)
    if d % 8:  # neither cuDNN nor the Gluon forward takes it
        assert choice.template in ("attn_fwd", "sdpa_flash"), choice


@pytest.mark.parametrize("d", [59, 111])
def test_sdpa_flash_pads_odd_head_dims_as_torch_does(d):
    if sdpa_extern._flash_available(cuda_device()) is not None:
        pytest.skip("torch's flash backend is not available here")
    q, k, v, do = _inputs(2, 4, 4, 513, 513, d, torch.float16, seed=d + 3)
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    out, lse = sdpa_extern.sdpa_flash(*leaves, {}, causal=True, return_lse=True)
    assert out.shape == q.shape
    assert_close_to_reference(out.detach(), q, k, v, causal=True, lse=lse)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert (out.detach().float() - want.float()).abs().max().item() < 2e-3
    out.backward(do)
    assert_grads_close(tuple(t.grad for t in leaves), q, k, v, do, causal=True)


@pytest.mark.parametrize("d", [59, 111])
def test_a_routed_call_at_a_padded_head_dim_replays_a_padded_plan(d):
    """flashtune.attention without gradients at a head dim run padded: from the first call
    of a shape on, its AttnFwdPlan pads q, k, v (transposed views here), runs the kernel
    and cuts the output back, through direct launches: the launcher's bits, output and
    LSE, contiguous and like q."""
    from flashtune.kernel_templates.attn_fwd.plan import AttnFwdPlan
    from flashtune.runtime import routing

    q, k, v, _ = _inputs(2, 8, 4, 700, 700, d, torch.bfloat16, seed=d + 4, layout="bnhd")
    choice = flashtune.lookup_config(q, k, v, causal=True)
    if choice.template != "attn_fwd":
        pytest.skip(f"routed to {choice.template}")
    want, want_lse = FWD.launcher(q, k, v, choice.config, causal=True, return_lse=True)
    assert_close_to_reference(want, q, k, v, causal=True, lse=want_lse)
    for _ in range(2):
        got = flashtune.attention(q, k, v, causal=True)
        assert got.shape == q.shape and got.is_contiguous() and torch.equal(got, want)
        got, lse = flashtune.attention(q, k, v, causal=True, return_lse=True)
        assert torch.equal(got, want) and torch.equal(lse, want_lse)
    if routing._DIRECT:
        padded = [p for p in routing._PLANS.values()
                  if isinstance(p, AttnFwdPlan) and p._pads is not None]
        assert len(padded) >= 2, routing._PLANS
