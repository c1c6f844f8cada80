"""GPU-only checks of attn_bwd: larger shapes, compiled kernels (fp16 and bf16, head dims up to
256), the tolerance rule, a spread of configs, determinism and the tuner end to end."""

from __future__ import annotations

import pytest
import torch

from flashtune.core.device import cuda_device
from flashtune.core.problem import AttentionProblem
from flashtune.kernel_templates import get_template
from tests.helpers import assert_grads_close

pytestmark = pytest.mark.gpu
SPEC = get_template("attn_bwd")
FWD = get_template("attn_fwd")
DTYPES = [torch.float16, torch.bfloat16]


def _inputs(b, hq, hkv, nq, nk, d, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def rand(h, n):
        return torch.randn(b, h, n, d, device="cuda", generator=g).to(dtype)
    return rand(hq, nq), rand(hkv, nk), rand(hkv, nk), rand(hq, nq)


def _forward(q, k, v, causal):
    p = AttentionProblem.from_tensors(q, k, causal=causal)
    return FWD.launcher(q, k, v, FWD.default_config(p, cuda_device()), causal=causal,
                        return_lse=True)


SHAPES = [
    (2, 16, 16, 1000, 1000, 128, True),
    (2, 16, 16, 1023, 1023, 64, False),
    (1, 32, 8, 777, 777, 128, True),    # GQA 4:1
    (2, 8, 8, 1024, 1024, 96, False),
    (1, 8, 8, 513, 700, 256, True),     # Nq < Nk
    (1, 8, 2, 900, 600, 64, True),      # Nq > Nk (300 rows see no key), GQA
    (1, 4, 1, 640, 640, 192, False),    # MQA
]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("shape", SHAPES,
                         ids=lambda s: "b{}h{}:{}q{}k{}d{}{}".format(*s[:6], "c" if s[6] else ""))
def test_default_config_meets_the_tolerance_rule(shape, dtype):
    b, hq, hkv, nq, nk, d, causal = shape
    q, k, v, do = _inputs(b, hq, hkv, nq, nk, d, dtype)
    out, lse = _forward(q, k, v, causal)
    p = AttentionProblem.from_tensors(q, k, causal=causal)
    got = SPEC.launcher(q, k, v, out, lse, do, SPEC.default_config(p, cuda_device()),
                        causal=causal)
    assert_grads_close(got, q, k, v, do, causal=causal)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_a_spread_of_valid_configs_is_correct(dtype):
    b, hq, hkv, nq, nk, d = 1, 4, 2, 333, 517, 128
    q, k, v, do = _inputs(b, hq, hkv, nq, nk, d, dtype, seed=1)
    out, lse = _forward(q, k, v, True)
    problem = AttentionProblem.from_tensors(q, k, causal=True)
    valid = SPEC.space.valid_configs(problem, cuda_device())
    # an even spread of 6 of the valid configs (compiling all of them takes minutes)
    configs = valid[:: max(1, len(valid) // 6)][:6]
    assert len(configs) >= 4
    for cfg in configs:
        got = SPEC.launcher(q, k, v, out, lse, do, cfg, causal=True)
        assert_grads_close(got, q, k, v, do, causal=True)


def test_transposed_views_and_bit_identical_reruns():
    b, hq, hkv, nq, nk, d = 2, 8, 2, 1000, 1000, 128
    g = torch.Generator(device="cuda").manual_seed(2)
    q, do = (torch.randn(b, nq, hq, d, device="cuda", generator=g).to(torch.bfloat16)
             .transpose(1, 2) for _ in range(2))
    k, v = (torch.randn(b, nk, hkv, d, device="cuda", generator=g).to(torch.bfloat16)
            .transpose(1, 2) for _ in range(2))
    out, lse = _forward(q, k, v, True)
    cfg = SPEC.default_config(AttentionProblem.from_tensors(q, k, causal=True), cuda_device())
    first = SPEC.launcher(q, k, v, out, lse, do, cfg, causal=True)
    again = SPEC.launcher(q, k, v, out, lse, do, cfg, causal=True)
    assert all(torch.equal(x, y) for x, y in zip(first, again))  # no atomics
    assert_grads_close(first, q, k, v, do, causal=True)


def test_the_tuner_runs_attn_bwd_on_the_gpu(tmp_path):
    from flashtune.autotune.jobs import tune
    from flashtune.autotune.options import TuneOptions

    p = AttentionProblem(2, 8, 8, 1024, 1024, 64, True, "bf16")
    [res] = tune([p], TuneOptions(template="attn_bwd", trials=4, seed=0, workers=4),
                 db_url=f"sqlite:///{tmp_path / 'bwd.db'}", progress=False)
    assert res.states.get("COMPLETE", 0) >= 2, res.states
    assert res.best_tflops is not None and res.best_tflops > 1.0


@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[1], SHAPES[2], SHAPES[5]],
                         ids=lambda s: "b{}h{}:{}q{}k{}d{}{}".format(*s[:6], "c" if s[6] else ""))
def test_one_launch_and_reverse_dq_give_the_default_bits(shape):
    """Compiled, the two ordering knobs on the default tiles: the same bits as the separate
    launches in program order (bf16)."""
    b, hq, hkv, nq, nk, d, causal = shape
    q, k, v, do = _inputs(b, hq, hkv, nq, nk, d, torch.bfloat16, seed=3)
    out, lse = _forward(q, k, v, causal)
    cfg = SPEC.default_config(AttentionProblem.from_tensors(q, k, causal=causal), cuda_device())
    want = SPEC.launcher(q, k, v, out, lse, do, cfg, causal=causal)
    assert_grads_close(want, q, k, v, do, causal=causal)
    for knobs in ({"ONE_LAUNCH": 1}, {"REVERSE_DQ": 1}, {"ONE_LAUNCH": 1, "REVERSE_DQ": 1},
                  {"ONE_LAUNCH": 1, "KV_SPLITS": 2}):
        if "REVERSE_DQ" in knobs and not causal:
            continue
        got = SPEC.launcher(q, k, v, out, lse, do, {**cfg, **knobs}, causal=causal)
        if knobs.get("KV_SPLITS", 1) > 1 and hq > hkv:  # dK/dV summed in another order
            assert_grads_close(got, q, k, v, do, causal=causal)
            assert torch.equal(got[0], want[0])
        else:
            assert all(torch.equal(x, y) for x, y in zip(got, want)), knobs


SPLIT_D_KNOBS = [
    {"ONE_LAUNCH": 1, "REVERSE_DQ": 1},
    {"ONE_LAUNCH": 0, "SPLIT_LOOPS": 1, "KV_SPLITS": 2},
    {"ONE_LAUNCH": 0, "USE_TMA": 0, "num_stages": 4},
]


@pytest.mark.parametrize("d", [96, 80])
@pytest.mark.parametrize("knobs", SPLIT_D_KNOBS, ids=["one-launch", "kv-splits", "plain"])
def test_two_head_dim_tiles_meet_the_tolerance_rule(knobs, d):
    """SPLIT_D at the Hopper default's tiles (TMA: a second descriptor per streamed tensor),
    GQA 3:1, odd lengths, causal with Nq < Nk and not, bf16."""
    q, k, v, do = _inputs(2, 6, 2, 333, 517, d, torch.bfloat16, seed=d)
    p = AttentionProblem.from_tensors(q, k, causal=True)
    cfg = {**SPEC.default_config(p, cuda_device()), "SPLIT_D": 1, **knobs}
    for causal in (False, True):
        out, lse = _forward(q, k, v, causal)
        got = SPEC.launcher(q, k, v, out, lse, do, cfg, causal=causal)
        assert_grads_close(got, q, k, v, do, causal=causal)
