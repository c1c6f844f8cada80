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
], ids=lambda s: "b{}h{}:{}q{}k{}d{}{}".format(*s[:6], "c" if s[6] else ""))
def test_matches_sdpa_within_the_tolerance_rule(shape, dtype):
    """Error vs an fp32 reference at most 2x (+eps) the error of SDPA in the same dtype."""
    b, hq, hkv, nq, nk, d, causal = shape
    q, k, v = _rand(b, hq, nq, d, dtype=dtype), _rand(b, hkv, nk, d, dtype=dtype), \
        _rand(b, hkv, nk, d, dtype=dtype)
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
    from flashtune.autotune.devices import cuda_device
    from flashtune.autotune.problems import AttentionProblem

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
