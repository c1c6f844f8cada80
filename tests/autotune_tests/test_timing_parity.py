"""``benchmarks/timing_parity.py`` (issue 22, item 7): the plan of a round, the summary's
ratios and the table on synthetic rows, and the whole script's logic end to end on tiny
shapes under the Triton interpreter (CPU tensors, SDPA left out; timings mean nothing there:
what is tested is that every slot is checked against fp32, timed each round, and reported)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "timing_parity.py"


@pytest.fixture(scope="module")
def parity() -> ModuleType:
    """The script as a module, imported here rather than at collection time."""
    spec = importlib.util.spec_from_file_location("timing_parity", SCRIPT)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["timing_parity"] = module  # its dataclasses look their module up
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop("timing_parity", None)


def test_a_gpu_round_puts_cold_first_hot_last_and_bench_with_the_other_config(parity):
    slots = parity.plan_round("fwd", ["default", "other"], on_gpu=True,
                              tma_labels=["default", "other"])
    assert slots[:2] == [("default", "cold"), ("other", "cold")]
    assert slots[-2:] == [("default", "hot"), ("other", "hot")]
    assert len(slots) == len(set(slots))
    # one _bench_problem call times the other config and the default together
    assert ("other", "bench") in slots and ("default", "bench") not in slots
    # tma_off only for the default (one compile saved), and only when it uses TMA
    assert ("default", "tma_off") in slots and ("other", "tma_off") not in slots
    assert ("sdpa", "sdpa_flash") in slots and ("sdpa", "sdpa_cudnn") in slots
    for label in ("default", "other"):
        for name in ("tuner", "tuner_trial", "runtime", "runtime_served", "lse",
                     "layout_bnhd", "no_flush", "graph", "long"):
            assert (label, name) in slots
    # the backward has no LSE variant and one runtime path (autograd)
    bwd = parity.plan_round("bwd", ["default"], on_gpu=True, tma_labels=[])
    names = {v for _, v in bwd}
    assert "lse" not in names and "runtime_served" not in names and "tma_off" not in names
    assert ("default", "bench") in bwd and ("default", "runtime") in bwd


def test_off_the_gpu_a_round_has_no_gpu_timing_variants_and_no_sdpa(parity):
    slots = parity.plan_round("fwd", ["default", "other"], on_gpu=False,
                              tma_labels=["default"])
    names = {v for _, v in slots}
    gpu_only = {v.name for v in parity.VARIANTS if v.gpu_only}
    assert not names & gpu_only
    assert not any(label == "sdpa" for label, _ in slots)
    assert {"tuner", "tuner_trial", "bench", "runtime", "lse", "layout_bnhd"} <= names


def _rows():
    flops = 2e12
    return [
        {"shape": "s", "config": "default", "variant": "tuner", "flops": flops,
         "round_ms": [4.0, 4.4, 4.2]},
        {"shape": "s", "config": "default", "variant": "bench", "flops": flops,
         "round_ms": [4.2, 4.2]},
        {"shape": "s", "config": "other", "variant": "tuner", "flops": flops,
         "round_ms": [3.0, 3.2, 3.3]},
        {"shape": "s", "config": "other", "variant": "bench", "flops": flops,
         "round_ms": [4.0, 4.0, 4.0]},
        {"shape": "s", "config": "other", "variant": "hot", "flops": flops,
         "round_ms": [3.9]},
        {"shape": "s", "config": "other", "variant": "lse", "flops": flops,
         "round_ms": [], "error": "relative error 0.5 >= 0.02 vs fp32; not timed"},
        {"shape": "s", "config": "sdpa", "variant": "sdpa_cudnn", "flops": flops,
         "round_ms": [2.1]},
    ]


def test_the_summary_takes_medians_over_rounds_and_ratios_to_the_tuner(parity):
    summary = {(s["config"], s["variant"]): s for s in parity.summarize(_rows())}
    tuner = summary[("other", "tuner")]
    assert tuner["median_ms"] == pytest.approx(3.2) and tuner["min_ms"] == pytest.approx(3.0)
    assert tuner["tflops"] == pytest.approx(2e12 / 3.2e-3 / 1e12)
    assert tuner["vs_tuner"] == pytest.approx(1.0)
    assert tuner["spread"] == pytest.approx(0.3 / 3.2)
    assert tuner["vs_cudnn"] == pytest.approx(2.1 / 3.2)
    # bench's figure of the other config over the tuner's: the gap
    assert summary[("other", "bench")]["vs_tuner"] == pytest.approx(3.2 / 4.0)
    assert summary[("default", "bench")]["vs_tuner"] == pytest.approx(4.2 / 4.2)
    assert summary[("other", "hot")]["spread"] is None  # one round
    # SDPA rows compare with the default's tuner figure
    assert summary[("sdpa", "sdpa_cudnn")]["vs_tuner"] == pytest.approx(4.2 / 2.1)
    failed = summary[("other", "lse")]
    assert failed["median_ms"] is None and failed["vs_tuner"] is None
    assert "not timed" in failed["error"]


def test_the_table_shows_every_row_the_parity_lines_and_the_largest_effects(parity):
    text = parity.render_table(parity.summarize(_rows()), {"s": "B=1 Hq=16"})
    lines = text.splitlines()
    assert lines[0] == "== s: B=1 Hq=16"
    assert lines[1].split() == ["config", "variant", "ms", "TFLOP/s", "vs", "tuner", "spread",
                                "vs", "cuDNN", "host", "ms"]
    n = len(_rows())
    body = [ln.split() for ln in lines[2:2 + n]]
    assert [(b[0], b[1]) for b in body] == [(r["config"], r["variant"]) for r in _rows()]
    assert body[3][:5] == ["other", "bench", "4.0000", "500.0", "0.800"]
    assert body[5][-1] == "ERROR"  # the row that failed its check
    assert lines[2 + n].startswith("parity ")
    assert "parity s other: bench 0.800x of the tuner's" in text
    assert "parity s default: bench 1.000x of the tuner's" in text
    assert "s other: bench 0.800x, hot 0.821x" in text
    assert "error s other lse: relative error 0.5" in text


def _run_tiny(parity, shape, rounds, **kwargs):
    """``run_parity`` on one tiny shape under the interpreter, checked slot by slot: every
    slot of the round's plan (plus the default's figure from the other config's bench call)
    checked against fp32 and timed once per round."""
    from flashtune.core.case import TOLERANCE

    saved = []
    result = parity.run_parity([shape], rounds=rounds, cold_s=0.0, heat_s=0.0,
                               on_shape=lambda r: saved.append(len(r["shapes"])), **kwargs)
    assert saved == [1]
    assert not result["on_gpu"] and result["all_checked"]
    json.dumps(result)  # JSON-ready
    [done] = result["shapes"]
    assert set(done["configs"]) == {"default", "other"} and done["rounds"] == rounds
    assert all(done["configs"]["other"][k] == v for k, v in shape.others[0].items())
    rows = {(r["config"], r["variant"]): r for r in done["rows"]}
    expected = set(parity.plan_round(shape.op, ["default", "other"], on_gpu=False))
    expected.add(("default", "bench"))  # timed inside the other config's bench call
    assert set(rows) == expected
    for key, row in rows.items():
        assert row["error"] is None, (key, row["error"])
        assert len(row["round_ms"]) == rounds, key
        assert row["rel_err"] is not None and row["rel_err"] < TOLERANCE["fp16"], key
        assert row["flops"] == done["flops"] > 0
    assert all(s["vs_tuner"] and s["vs_tuner"] > 0 for s in result["summary"])
    return result


def test_the_forward_end_to_end_on_a_tiny_shape_under_the_interpreter(parity, monkeypatch):
    from flashtune.core.problem import AttentionProblem

    monkeypatch.setattr(parity, "CPU_REPS", 1)
    other = {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 2, "num_stages": 1, "REVERSE_M": 1}
    shape = parity.Shape("tiny_fwd", "fwd", AttentionProblem(1, 4, 2, 40, 40, 16, True, "fp16"),
                         (other,))
    # the lookup chain serving the other config: it is recognised, not timed twice
    served = {"config": other, "source": "exact", "origin": "test", "recorded_ms": 1.0,
              "recorded_tflops": 1.0, "tuned_problem": None}
    asked = []
    monkeypatch.setattr(parity, "served_choice",
                        lambda s, device, db_url: asked.append(db_url) or dict(served))
    result = _run_tiny(parity, shape, rounds=2, lookup=True, db_url="sqlite:///x.db")
    assert asked == ["sqlite:///x.db"]
    assert result["shapes"][0]["served"]["label"] == "other"
    text = parity.render_table(result["summary"])
    assert "parity tiny_fwd other: bench" in text and "runtime_served" in text


def test_the_backward_end_to_end_on_a_tiny_shape_under_the_interpreter(parity, monkeypatch):
    from flashtune.core.problem import AttentionProblem

    monkeypatch.setattr(parity, "CPU_REPS", 1)
    shape = parity.Shape("tiny_bwd", "bwd", AttentionProblem(1, 2, 1, 24, 24, 16, False, "fp16"),
                         ({"BLOCK_M1": 32, "BLOCK_N1": 32, "BLOCK_M2": 32, "BLOCK_N2": 32,
                           "num_warps": 2, "num_stages": 1},))
    result = _run_tiny(parity, shape, rounds=1)
    assert "parity tiny_bwd default: bench" in parity.render_table(result["summary"])


def test_the_command_line_defaults(parity):
    args = parity.parse_args([])
    assert args.out == "benchmarks/results/timing_parity_h100.json"
    assert args.shapes.split(",") == list(parity.SHAPE_NAMES) and args.rounds == 3
    args = parity.parse_args(["--out", "x.json", "--other", 'gemma2_fwd={"BLOCK_M": 64}'])
    assert args.other == ['gemma2_fwd={"BLOCK_M": 64}']
