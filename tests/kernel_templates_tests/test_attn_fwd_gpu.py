"""GPU-only checks: larger shapes, compiled kernels, and the tolerance rule against SDPA."""

from __future__ import annotations

import pytest
import torch

import flashtune
from flashtune.kernel_templates import get_template
from flashtune.kernel_templates.attn_fwd.reference import attn_fwd_reference

pytestmark = pytest.mark.gpu
SPEC = get_template("attn_fwd")


def _rand(*shape, dtype):
    return torch.randn(*shape, device="cuda", dtype=torch.float32).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("shape", [
    (2, 16, 16, 1000, 1000, 128, True),
    (2, 16, 16, 1023, 1023, 64, False),
    (1, 32, 8, 777, 777, 128, True),   # GQA 4:1
    (2, 8, 8, 2048, 2048, 96, False),
    (1, 8, 8, 513, 513, 256, True),
    (1, 32, 32, 4096, 4096, 96, True),  # Phi-3: two head-dim tiles where attn_fwd serves
    (4, 16, 16, 1000, 1000, 80, True),
], ids=lambda s: "b{}h{}:{}q{}k{}d{}{}".format(*s[:6], "c" if s[6] else ""))
def test_matches_sdpa_within_the_tolerance_rule(shape, dtype):
    """Error vs an fp32 reference at most 2x (+eps) the error of SDPA in the same dtype,
    through the public call as routed here, three calls on new tensors each (the first
    plans the shape's launch, the others replay the plan: a plan that kept its build
    call's tensors fails the second)."""
    b, hq, hkv, nq, nk, d, causal = shape
    kept = []
    for _ in range(3):
        q, k, v = _rand(b, hq, nq, d, dtype=dtype), _rand(b, hkv, nk, d, dtype=dtype), \
            _rand(b, hkv, nk, d, dtype=dtype)
        kept.append((q, k, v))  # alive: the next call's tensors sit elsewhere
        out = flashtune.attention(q, k, v, causal=causal)
        ref, _ = attn_fwd_reference(q, k, v, causal=causal, dtype=torch.float32)
        sdpa = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=causal, enable_gqa=hq != hkv)
        err = (out.float() - ref).abs().max().item()
        sdpa_err = (sdpa.float() - ref).abs().max().item()
        eps = torch.finfo(dtype).eps
        assert err <= 2 * sdpa_err + eps, f"flashtune {err:.3e} vs SDPA {sdpa_err:.3e}"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_a_spread_of_valid_configs_is_correct(dtype):
    from flashtune.core.device import cuda_device
    from flashtune.core.problem import AttentionProblem

    b, h, n, d = 1, 4, 333, 128
    q, k, v = (_rand(b, h, n, d, dtype=dtype) for _ in range(3))
    ref, _ = attn_fwd_reference(q, k, v, causal=True, dtype=torch.float32)
    problem = AttentionProblem(b, h, h, n, n, d, True, "fp16" if dtype == torch.float16 else "bf16")
    valid = SPEC.space.valid_configs(problem, cuda_device())
    # an even spread of 8 of the valid configs (compiling all of them takes minutes)
    configs = valid[:: max(1, len(valid) // 8)][:8]
    assert len(configs) >= 4
    for cfg in configs:
        out = SPEC.launcher(q, k, v, cfg, causal=True)
        rel = ((out.float() - ref).norm() / ref.norm()).item()
        assert rel < 1e-2, (cfg, rel)


KNOB_CONFIGS = [
    {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3, "USE_TMA": 1},
    {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3, "USE_TMA": 1,
     "REVERSE_M": 1},
    {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 2, "USE_TMA": 0,
     "REVERSE_M": 1},
    # D96 as two tiles, 64 + 32 (a second descriptor per tensor with TMA)
    {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3, "USE_TMA": 1,
     "SPLIT_D": 1},
    {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3, "USE_TMA": 0,
     "REVERSE_M": 1, "SPLIT_D": 1},
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("layout", ["bhnd", "bnhd", "misaligned"])
@pytest.mark.parametrize("cfg", KNOB_CONFIGS, ids=["tma", "tma-rev", "rev", "tma-split-d",
                                                  "rev-split-d"])
def test_hopper_knobs_match_the_reference(cfg, layout, dtype):
    """TMA (4-D descriptors, zero-filled edges) and reversed tiles on odd shapes, GQA, D=96,
    transposed views, and a misaligned view that must fall back to plain loads."""
    from flashtune.kernel_templates.attn_fwd.launcher import tma_ok

    b, hq, hkv, nq, nk, d = 2, 6, 2, 333, 517, 96
    if layout == "bnhd":
        q = _rand(b, nq, hq, d, dtype=dtype).transpose(1, 2)
        k, v = (_rand(b, nk, hkv, d, dtype=dtype).transpose(1, 2) for _ in range(2))
    else:
        q = _rand(b, hq, nq, d, dtype=dtype)
        k, v = (_rand(b, hkv, nk, d, dtype=dtype) for _ in range(2))
        if layout == "misaligned":  # base address 2 bytes past a 16-byte boundary
            k = _rand(b * hkv * nk * d + 1, dtype=dtype)[1:].view(b, hkv, nk, d)
            assert not tma_ok(k)
    for causal in (False, True):
        out, lse = SPEC.launcher(q, k, v, cfg, causal=causal, return_lse=True)
        ref, ref_lse = attn_fwd_reference(q, k, v, causal=causal, dtype=torch.float32)
        rel = ((out.float() - ref).norm() / ref.norm()).item()
        assert rel < 1e-2, (causal, rel)
        finite = torch.isfinite(ref_lse)
        assert torch.allclose(lse[finite], ref_lse[finite], atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("d", [96, 80])
def test_the_default_between_64_and_128_dims_matches_the_reference(d):
    """The default this GPU gets at a head dim two tiles serve (on Hopper: 128 x 64, TMA,
    two tiles), on odd lengths, GQA and causal with Nq != Nk."""
    from flashtune.core.device import cuda_device
    from flashtune.core.problem import AttentionProblem

    b, hq, hkv, nq, nk = 2, 6, 2, 333, 517
    cfg = SPEC.default_config(AttentionProblem(b, hq, hkv, nq, nk, d, True, "bf16"),
                              cuda_device())
    q = _rand(b, hq, nq, d, dtype=torch.bfloat16)
    k, v = (_rand(b, hkv, nk, d, dtype=torch.bfloat16) for _ in range(2))
    for causal in (False, True):
        out, lse = SPEC.launcher(q, k, v, cfg, causal=causal, return_lse=True)
        ref, ref_lse = attn_fwd_reference(q, k, v, causal=causal, dtype=torch.float32)
        rel = ((out.float() - ref).norm() / ref.norm()).item()
        assert rel < 1e-2, (cfg, causal, rel)
        finite = torch.isfinite(ref_lse)
        assert torch.allclose(lse[finite], ref_lse[finite], atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("d", [96, 80])
@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
def test_a_launch_plan_with_two_tiles_reads_each_calls_tensors(d, layout):
    """What ``flashtune.attention`` replays after a shape's first call (a launch plan), with
    two head-dim tiles by TMA: each call's output comes from that call's tensors. The
    second tile's descriptors were bound once, to the build call's tensors, and the
    columns past 64 came from a buffer freed after the build (a Phi-3 prefill at 8k routed
    to attn_fwd: logits 1.4 relative error)."""
    from flashtune.kernel_templates.attn_fwd.plan import AttnFwdPlan

    cfg = {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3, "USE_TMA": 1,
           "REVERSE_M": 1, "SPLIT_D": 1}
    b, hq, hkv, n = 1, 6, 2, 333
    kept = []  # every call's tensors stay alive: each call's sit at new addresses

    def make():
        if layout == "bnhd":
            t = (_rand(b, n, hq, d, dtype=torch.bfloat16).transpose(1, 2),
                 *(_rand(b, n, hkv, d, dtype=torch.bfloat16).transpose(1, 2)
                   for _ in range(2)))
        else:
            t = (_rand(b, hq, n, d, dtype=torch.bfloat16),
                 *(_rand(b, hkv, n, d, dtype=torch.bfloat16) for _ in range(2)))
        kept.append(t)
        return t

    plan = AttnFwdPlan(*make(), cfg, causal=True, scale=None, return_lse=True)
    stream = torch.cuda.current_stream().cuda_stream
    for _ in range(2):
        q, k, v = make()
        out, lse = plan(q, k, v, stream)
        ref, ref_lse = attn_fwd_reference(q, k, v, causal=True, dtype=torch.float32)
        rel = ((out.float() - ref).norm() / ref.norm()).item()
        assert rel < 1e-2, rel
        assert torch.allclose(lse, ref_lse, atol=1e-3, rtol=1e-4)


def test_phi3_prefill_at_8k_routes_to_the_reference():
    """The call that found it: Phi-3-mini's 32 heads of 96 at 8192 tokens, causal, in
    transformers' layout (slices of one fused q/k/v projection), three routed calls (the
    first builds the shape's launch plan, the rest replay it); on the H200 table the route
    is attn_fwd with two tiles."""
    h, n, d = 32, 8192, 96
    for _ in range(3):
        qkv = _rand(1, n, 3 * h * d, dtype=torch.bfloat16)
        q, k, v = (t.view(1, n, h, d).transpose(1, 2) for t in qkv.split(h * d, dim=-1))
        out = flashtune.attention(q, k, v, causal=True)
        ref, _ = attn_fwd_reference(q, k, v, causal=True, dtype=torch.float32)
        rel = ((out.float() - ref).norm() / ref.norm()).item()
        assert rel < 1e-2, (rel, flashtune.lookup_config(q, k, v, causal=True))


@pytest.mark.parametrize("impl,d,cfg", [
    ("attn_fwd", 96, {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3,
                      "USE_TMA": 1, "REVERSE_M": 1, "SPLIT_D": 1}),
    ("attn_fwd", 128, None),
    ("attn_fwd_gluon", 128, None),
], ids=["attn_fwd-split-d", "attn_fwd", "gluon"])
def test_the_plan_bench_checks_is_the_one_a_later_call_replays(impl, d, cfg):
    """``routing.replay_plan`` (what ``bench`` checks beside the launcher): built on one
    set of tensors, run on another, its output is the second set's."""
    from flashtune.core.device import cuda_device
    from flashtune.core.problem import AttentionProblem
    from flashtune.runtime.routing import replay_plan

    spec = get_template(impl)
    b, h, n = 2, 4, 300
    cfg = cfg or spec.default_config(AttentionProblem(b, h, h, n, n, d, True, "bf16"),
                                     cuda_device())
    first, later = ([_rand(b, h, n, d, dtype=torch.bfloat16) for _ in range(3)]
                    for _ in range(2))
    replay = replay_plan(spec, cfg, *first, causal=True)
    assert replay is not None
    ref, _ = attn_fwd_reference(*later, causal=True, dtype=torch.float32)
    out = replay(*later)
    rel = ((out.float() - ref).norm() / ref.norm()).item()
    assert rel < 1e-2, rel


@pytest.mark.parametrize("layout", ["bnhd", "fused", "bhnd"])
@pytest.mark.parametrize("d,split", [(96, 1), (128, 0), (64, 0)], ids=["d96-split", "d128",
                                                                      "d64"])
def test_a_plans_output_lies_in_qs_layout(layout, d, split):
    """What ``flashtune.attention`` replays writes the output in q's layout: transformers
    hands q as a ``(B, N, H, D)`` projection viewed per head (here also slices of one fused
    q/k/v projection) and transposes the output back, which is then a view, not a copy.
    The values are the launcher's (contiguous output), bit for bit."""
    from flashtune.kernel_templates.attn_fwd import attn_fwd
    from flashtune.runtime.routing import replay_plan

    b, h, n = 2, 4, 300
    cfg = {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3, "USE_TMA": 1,
           "REVERSE_M": 1, "SPLIT_D": split}

    def make():
        if layout == "fused":
            qkv = _rand(b, n, 3 * h * d, dtype=torch.bfloat16)
            return [t.view(b, n, h, d).transpose(1, 2) for t in qkv.split(h * d, dim=-1)]
        if layout == "bnhd":
            return [_rand(b, n, h, d, dtype=torch.bfloat16).transpose(1, 2) for _ in range(3)]
        return [_rand(b, h, n, d, dtype=torch.bfloat16) for _ in range(3)]

    first = make()
    replay = replay_plan(SPEC, cfg, *first, causal=True)
    assert replay is not None
    q, k, v = make()
    out = replay(q, k, v)
    assert out.shape == q.shape and out.stride() == torch.empty_like(q).stride()
    assert out.transpose(1, 2).is_contiguous() is (layout != "bhnd")
    assert torch.equal(out, attn_fwd(q, k, v, cfg, causal=True))
