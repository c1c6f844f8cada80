"""The Gluon FA3-style forward (``flashtune/kernel_templates/attn_fwd_gluon``) compiles for
Hopper on the CPU.

Its numerics can only be checked on a GPU (Gluon has no interpreter mode:
``benchmarks/explore_fwd_gluon.py`` does that first); what the CPU can check is that every
config of the sweep compiles for sm_90 into the structure the kernel is written for: 12
warps (2 consumer warpgroups + the producer's), the 24 / 240 register split, a wgmma left in
flight during the softmax (``wgmma.wait_group 1``), shared memory within the 227 KiB an H100
block may use, and no spills for the default config.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flashtune.kernel_templates.attn_fwd_gluon import protocol

ROOT = Path(__file__).resolve().parents[2]


def _compile(cases: list[dict]) -> list[dict]:
    # in a process of its own: this one runs triton under the interpreter
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-m", "flashtune.kernel_templates.attn_fwd_gluon",
                           json.dumps(cases)], capture_output=True, check=False, text=True,
                          env=env, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


@pytest.mark.slow
def test_the_default_config_compiles_into_fa3s_structure() -> None:
    cases = [{"head_dim": d, "causal": c} for d in (64, 128) for c in (False, True)]
    for case, got in zip(cases, _compile([dict(c) for c in cases]), strict=True):
        assert got["warps"] == 12, got
        assert ["dec", "24"] in got["setmaxnreg"] and ["inc", "240"] in got["setmaxnreg"], got
        assert 1 in got["wgmma_wait_depths"], got  # P V in flight while the softmax runs
        assert got["shared"] <= 227 * 1024, got
        assert got["spill_store_bytes"] == [0], got
        # Q (2 x 64 rows) + 2 stages of K and V tiles, bf16, plus the barriers
        d = case["head_dim"]
        assert 2 * (2 * 64 * d + 2 * 2 * 128 * d) <= got["shared"] \
            < 2 * (2 * 64 * d + 2 * 2 * 128 * d) + 2048, got


def test_inputs_in_bshd_storage_compile_as_bhsd_ones_do() -> None:
    """The (B, N, H, D) variant (``Q_BSHD``, ``KV_BSHD``: other descriptor coordinates and
    O offsets, no new arguments) uses the shared memory, registers and spills of the
    contiguous one the compile table was made from, persistent and not."""
    cases = [{"head_dim": 128, "causal": c, "PERSISTENT": p, "NUM_STAGES": 3, "layout": lay}
             for c, p in ((False, 1), (True, 0)) for lay in ("bhsd", "bshd")]
    got = _compile(cases)
    assert [g["layout"] for g in got] == ["bhsd", "bshd"] * 2
    for bhsd, bshd in (got[0:2], got[2:4]):
        for key in ("shared", "warps", "registers", "spill_store_bytes", "setmaxnreg"):
            assert bhsd[key] == bshd[key], (key, bhsd, bshd)


@pytest.mark.slow
def test_the_swept_configs_compile() -> None:
    cases = [{"BLOCK_N": 64, "NUM_STAGES": 3}, {"NUM_CONSUMERS": 1},
             {"ROWS": 128, "BLOCK_N": 64}, {"PINGPONG": 1, "causal": True},
             {"PINGPONG": 1, "head_dim": 64}, {"PERSISTENT": 1, "causal": True},
             {"PERSISTENT": 1, "PINGPONG": 1, "head_dim": 64},
             {"NUM_CONSUMERS": 3, "BLOCK_N": 64, "head_dim": 64, "PERSISTENT": 1},
             {"NUM_CONSUMERS": 3, "head_dim": 64, "NUM_STAGES": 3, "TMA_STORE": 1,
              "causal": True},
             {"NUM_CONSUMERS": 1, "BLOCK_N": 64, "CTAS_PER_SM": 2, "causal": True}]
    # warps: 4 per consumer + the producer's warpgroup (padded to 4 with three consumers)
    warps = {1: 8, 2: 12, 3: 16}
    for case, got in zip(cases, _compile([dict(c) for c in cases]), strict=True):
        assert got["warps"] == warps[case.get("NUM_CONSUMERS", 2)], got
        assert 1 in got["wgmma_wait_depths"], got
        if case.get("NUM_CONSUMERS") == 3:  # 24 / 160 registers, no spill at 64-key tiles
            # nor at D64's 128-key tiles (FA3's tile: P converted before the next S)
            assert ["inc", "160"] in got["setmaxnreg"], got
            assert got["spill_store_bytes"] == [0], got
        if case.get("CTAS_PER_SM") == 2:  # launched at 128 a thread, the consumer at 232
            assert got["registers"] == [128] and ["inc", "232"] in got["setmaxnreg"], got
            assert got["spill_store_bytes"] == [0], got
            assert got["shared"] <= (228 * 1024) // 2 - 1024, got  # two an SM
        assert got["shared"] <= 227 * 1024, got


def test_the_barrier_protocol_model_finds_no_deadlock(capsys) -> None:
    """``attn_fwd_gluon/protocol.py`` runs the kernel's mbarrier protocol (producer,
    consumers, causal consumers that see fewer blocks, ping-pong turns) in random
    interleavings; it fails on a deadlock or a barrier a phase ahead of its waiter (it does
    for a missing drain loop, a wrong ``kv_empty`` count or a wrong turn parity)."""
    protocol.main()  # raises AssertionError on the first bad interleaving
    assert "no deadlock" in capsys.readouterr().out


@pytest.mark.parametrize("mutation", protocol.MUTATIONS)
def test_the_protocol_model_catches_each_planted_bug(mutation: str) -> None:
    """The model can fail: a missing drain loop deadlocks, a producer that does not wait for
    ``q_empty`` overwrites a Q buffer being read, phases restarted per tile of a persistent
    CTA and a ``kv_empty`` counting one consumer let a barrier run a phase ahead, and a
    ``TMA_STORE`` consumer that releases its Q buffer once its last ``S`` is done (as
    without the TMA store) has the next tile's Q land on the O it is storing; with two sets
    of Q buffers, a parity taken from the tile count (not the set's own count) lets a wait
    pass on a phase that is not its own, and with ``SPLIT_KV`` a V buffer released with its
    K (before its ``P V`` is done) lets a barrier run a phase ahead."""
    with pytest.raises(AssertionError):
        protocol.check_all(mutation, seeds=5)


def test_the_explore_script_names_every_knob_so_no_two_configs_share_a_row():
    """``explore_fwd_gluon.py`` keeps results by a config's name: the LPT config once took
    its persistent twin's name, and one overwrote the other's timings in an H200 run."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "explore_fwd_gluon", ROOT / "benchmarks" / "explore_fwd_gluon.py")
    assert spec and spec.loader
    script = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(ROOT / "benchmarks"))  # it imports bench_fwd beside it
    try:
        spec.loader.exec_module(script)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    base = "ROWS=64,BLOCK_N=128,NUM_STAGES=3,NUM_CONSUMERS=2"
    configs = script.parse_configs(f"{base};{base},PERSISTENT=1;{base},PERSISTENT=1,LPT=1;"
                                   f"{base},PERSISTENT=1,Q_BUFFERS=2")
    assert [script.name_of(c) for c in configs] == [
        "gluon_64x2_128_s3", "gluon_64x2_128_s3_ps", "gluon_64x2_128_s3_ps_lpt1",
        "gluon_64x2_128_s3_ps_q_buffers2"]
    # a knob at its optional default (one Q buffer, no TMA store) names nothing
    assert script.name_of({**configs[1], "Q_BUFFERS": 1, "TMA_STORE": 0}) == \
        "gluon_64x2_128_s3_ps"
    with pytest.raises(SystemExit, match="named twice"):
        script.parse_configs(f"{base};{base},LPT=0")
