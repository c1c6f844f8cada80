"""``benchmarks/gluon_tile_cost.py`` (issue 23): the line it fits through a contender's times
over the key lengths, and the split of that line into a tile's fixed cost and its cost per
key (the GPU part runs on the device only)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gluon_tile_cost.py"


@pytest.fixture(scope="module")
def script() -> ModuleType:
    sys.path.insert(0, str(SCRIPT.parent))
    spec = importlib.util.spec_from_file_location("gluon_tile_cost", SCRIPT)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(SCRIPT.parent))


def test_the_line_through_exact_points_is_found(script):
    assert script.fit_line([1, 2, 3], [5, 7, 9]) == pytest.approx((3.0, 2.0))
    # noisy points: the least-squares line, not the first and last
    b, m = script.fit_line([0, 1, 2, 3], [1.0, 2.9, 5.1, 7.0])
    assert m == pytest.approx(2.02) and b == pytest.approx(0.97)


@pytest.mark.parametrize("xs, ys", [([1], [1]), ([1, 2], [1]), ([2, 2], [1, 3])])
def test_a_line_needs_two_distinct_points(script, xs, ys):
    with pytest.raises(ValueError):
        script.fit_line(xs, ys)


def test_fixed_cost_and_cost_per_key_in_the_units_the_table_prints(script):
    # 20 us fixed, 10 us per 1k keys; 1e9 FLOPs a key -> 1e9 / 1e-8 s = 100 PFLOP/s
    nks = [128, 512, 2048]
    ms = [0.020 + 0.010 * n / 1000 for n in nks]
    got = script.split_cost(nks, ms, flops_per_key=1e9)
    assert got["fixed_us"] == pytest.approx(20.0)
    assert got["per_1k_keys_us"] == pytest.approx(10.0)
    assert got["slope_tflops"] == pytest.approx(1e5)
    assert got["fixed_keys"] == pytest.approx(2000.0)


def test_the_problems_keep_the_grids_tokens_and_hidden_size(script):
    p = script.problem(128, 512, 4096)
    assert (p.batch * p.seqlen_q, p.heads_q * p.head_dim, p.seqlen_k, p.causal) == \
        (16384, 2048, 4096, False)


def test_the_overlapped_twin_gives_up_a_stage_where_the_second_q_buffer_needs_it(script):
    """D128 (the H100 table's config for N512: 3 stages, ping-pong, persistent): two Q
    buffers do not fit beside 3 stages of 128-key tiles, so the twin runs 2; at D64 3 fit."""
    from flashtune.core.device import DeviceFingerprint
    from flashtune.kernel_templates import get_template

    gluon = get_template("attn_fwd_gluon")
    h100 = DeviceFingerprint("NVIDIA_H100_80GB_HBM3", "9.0", 132, 232448, 85 * 2**30)
    base = {"ROWS": 64, "BLOCK_N": 128, "NUM_STAGES": 3, "NUM_CONSUMERS": 2, "PINGPONG": 1,
            "PERSISTENT": 1, "LPT": 0, "TMA_STORE": 1, "Q_BUFFERS": 1, "SPLIT_KV": 0}
    twin = script.overlapped_twin(gluon, base, script.problem(128, 512, 512), h100)
    assert twin == {**base, "NUM_STAGES": 2, "Q_BUFFERS": 2, "SPLIT_KV": 1}
    twin64 = script.overlapped_twin(gluon, {**base, "PINGPONG": 0},
                                    script.problem(64, 512, 512), h100)
    assert twin64 is not None and twin64["NUM_STAGES"] == 3
    # D256: two Q buffers of 64 x 256 fit beside no stage count of 64-key tiles
    assert script.overlapped_twin(gluon, {**base, "BLOCK_N": 64, "NUM_STAGES": 2},
                                  script.problem(256, 512, 512), h100) is None


def test_a_causal_sweep_keeps_the_tokens_and_its_flops_grow_linearly_in_n(script):
    """``--causal``: square causal shapes at 16384 tokens, so the tiles are as many at every
    N and the time is a line in N; the FLOPs per unit of N are ``2 T H D`` (the causal
    count, the diagonal included), and the key sweep's ``4 B H Nq D`` per key."""
    for n in (512, 2048, 8192):
        p = script.point(128, 512, n, True)
        assert (p.seqlen_q, p.seqlen_k, p.causal, p.batch * n) == (n, n, True, 16384)
    assert script.point(128, 512, 2048, False) == script.problem(128, 512, 2048)
    assert script.flops_per_x(128, 512, [512, 8192], True) == pytest.approx(2 * 16384 * 16 * 128)
    assert script.flops_per_x(64, 512, [128, 4096], False) == pytest.approx(4 * 32 * 32 * 512 * 64)
