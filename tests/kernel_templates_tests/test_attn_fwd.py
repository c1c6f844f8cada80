"""attn_fwd numerics against the float64 reference on odd shapes (interpreter or GPU)."""

from __future__ import annotations

import math

import pytest
import torch

from flashtune.kernel_templates import get_template
from flashtune.kernel_templates.attn_fwd import attn_fwd
from tests.conftest import DEVICE
from tests.helpers import assert_close_to_reference

SPEC = get_template("attn_fwd")
CFG = {"BLOCK_M": 32, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2}
DTYPES = [torch.float16, torch.bfloat16]


def make_qkv(b, hq, hkv, nq, nk, d, dtype, *, seed=0, layout="bhnd"):
    g = torch.Generator().manual_seed(seed)
    def rand(h, n):
        if layout == "bnhd":  # (B, N, H, D) storage viewed as (B, H, N, D)
            return torch.randn(b, n, h, d, generator=g).to(dtype).to(DEVICE).transpose(1, 2)
        return torch.randn(b, h, n, d, generator=g).to(dtype).to(DEVICE)
    return rand(hq, nq), rand(hkv, nk), rand(hkv, nk)


SHAPES = [
    # (b, hq, hkv, nq, nk, d)
    (2, 2, 2, 77, 133, 64),
    (1, 2, 2, 133, 77, 64),   # Nq > Nk: causal leaves the first rows without keys
    (2, 2, 2, 1, 133, 128),   # single query (decode-like)
    (1, 6, 2, 77, 77, 32),    # GQA 6:2
    (1, 4, 1, 133, 133, 96),  # MQA, head_dim not a power of two
]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "b{}h{}:{}q{}k{}d{}".format(*s))
def test_matches_reference(shape, causal, dtype):
    b, hq, hkv, nq, nk, d = shape
    q, k, v = make_qkv(b, hq, hkv, nq, nk, d, dtype)
    out, lse = attn_fwd(q, k, v, CFG, causal=causal, return_lse=True)
    assert_close_to_reference(out, q, k, v, causal=causal, lse=lse)


@pytest.mark.parametrize("d", [16, 192, 256])
def test_small_and_large_head_dims(d):
    q, k, v = make_qkv(1, 2, 1, 45, 70, d, torch.float16, seed=d)
    cfg = {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 2}
    out, lse = attn_fwd(q, k, v, cfg, causal=True, return_lse=True)
    assert_close_to_reference(out, q, k, v, causal=True, lse=lse)


@pytest.mark.parametrize("causal", [False, True])
def test_transposed_views_run_without_copy(causal):
    q, k, v = make_qkv(2, 4, 2, 77, 133, 64, torch.float16, layout="bnhd")
    assert not q.is_contiguous() and q.stride(-1) == 1
    out, lse = attn_fwd(q, k, v, CFG, causal=causal, return_lse=True)
    assert_close_to_reference(out, q, k, v, causal=causal, lse=lse)


def test_custom_scale():
    q, k, v = make_qkv(1, 2, 2, 77, 133, 64, torch.float16, seed=3)
    out, lse = attn_fwd(q, k, v, CFG, scale=0.3, return_lse=True)
    assert_close_to_reference(out, q, k, v, causal=False, scale=0.3, lse=lse)
    default = attn_fwd(q, k, v, CFG)
    assert not torch.allclose(out, default)  # the scale really is used


def test_fully_masked_rows_are_zero_not_nan():
    # Nq > Nk, causal: query i sees keys j <= i - (Nq - Nk); the first 56 rows see nothing.
    q, k, v = make_qkv(1, 2, 2, 133, 77, 64, torch.float16, seed=5)
    out, lse = attn_fwd(q, k, v, CFG, causal=True, return_lse=True)
    dead = 133 - 77
    assert torch.all(out[:, :, :dead] == 0)
    assert torch.all(torch.isneginf(lse[:, :, :dead]))
    assert torch.isfinite(lse[:, :, dead:]).all()
    assert (out[:, :, dead:] != 0).any()


def test_configs_from_the_space_agree():
    q, k, v = make_qkv(1, 2, 2, 77, 133, 64, torch.float16, seed=7)
    configs = [
        {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 2, "num_stages": 1},
        {"BLOCK_M": 32, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3},
        {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2},
        {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3},
    ]
    outs = []
    for cfg in configs:
        SPEC.space.validate(cfg)
        out = attn_fwd(q, k, v, cfg, causal=True)
        assert_close_to_reference(out, q, k, v, causal=True)
        outs.append(out.float())
    for other in outs[1:]:
        # different tilings only reorder fp32 sums: a few ulps of fp16 apart at most
        assert (other - outs[0]).abs().max().item() < 4e-3


@pytest.mark.parametrize("knobs", [{"USE_TMA": 1}, {"USE_TMA": 1, "REVERSE_M": 1},
                                   {"REVERSE_M": 1}], ids=["tma", "tma-rev", "rev"])
@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
def test_hopper_knobs_match_reference(knobs, layout):
    """TMA descriptors (zero-filled edges, padded D=96) and reversed tile order, interpreted."""
    q, k, v = make_qkv(1, 4, 2, 77, 133, 96, torch.float16, seed=17, layout=layout)
    cfg = {**CFG, **knobs}
    for causal in (False, True):
        out, lse = attn_fwd(q, k, v, cfg, causal=causal, return_lse=True)
        assert_close_to_reference(out, q, k, v, causal=causal, lse=lse)


def test_negative_scale():
    """The unmasked loop takes the row minimum when the scale is negative."""
    q, k, v = make_qkv(1, 2, 2, 70, 140, 64, torch.float16, seed=19)
    out, lse = attn_fwd(q, k, v, {**CFG, "BLOCK_N": 16}, scale=-0.2, return_lse=True)
    assert_close_to_reference(out, q, k, v, causal=False, scale=-0.2, lse=lse)


def test_output_is_fully_written():
    q, k, v = make_qkv(1, 2, 2, 77, 133, 96, torch.float16, seed=11)
    poison = torch.full_like(q, float("nan"))
    attn_fwd(q, k, v, CFG, out=poison)
    assert not torch.isnan(poison).any()


def test_lse_is_natural_log_of_row_sums():
    q, k, v = make_qkv(1, 1, 1, 33, 50, 32, torch.float16, seed=13)
    _, lse = attn_fwd(q, k, v, CFG, return_lse=True)
    s = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(32)
    assert torch.allclose(lse.double(), torch.logsumexp(s, -1), atol=1e-3)
