"""``benchmarks/bench_headdims.py`` (issue 31, item 1) without a GPU: its arguments, the plan
file against its cases, the tuning commands, the dry run, and one case end to end on a
tiny shape under the Triton interpreter (CPU tensors, so no SDPA backend; the timer stubbed:
what is tested is that every contender is checked against fp32, timed and reported)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from flashtune.autotune.plans import load_plan, parse_plan
from flashtune.autotune.timing import Timing
from flashtune.core.device import interpreter_device

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_headdims.py"


@pytest.fixture(scope="module")
def script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_headdims", SCRIPT)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_headdims"] = module  # its dataclass looks its module up
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop("bench_headdims", None)


def test_the_command_line(script):
    args = script.parse_args([])
    assert args.out == "benchmarks/results/headdims_h100.json"
    assert args.cases.split(",") == ["sd40", "sd80", "phi2", "d224", "d59", "d111"]
    assert args.modes == "fwd,train" and args.baselines == "sdpa_flash,sdpa_cudnn"
    for bad in (["--cases", "d65"], ["--modes", "bwd"], ["--baselines", "flex"], ["--tune"]):
        with pytest.raises(SystemExit):
            script.parse_args(bad)
    # the aligned widths D59 and D111 run at, on request only (not in the plan)
    refs = script.selected(script.parse_args(["--cases", "d59,d64,d112"]))
    assert [(c.name, c.head_dim) for c in refs] == [("d59", 59), ("d64", 64), ("d112", 112)]
    assert refs[1].problem() == script.CASES["d59"].problem().__class__(
        4, 16, 16, 2048, 2048, 64, True, "bf16")
    sweep = script.parse_args(["--bwd-sweep", '[{"num_stages": 3}]'])
    assert sweep.bwd_sweep == '[{"num_stages": 3}]' and script.parse_args([]).bwd_sweep is None


def test_the_plan_file_lists_the_cases_and_a_subset_plan_parses(script):
    cases = list(script.CASES.values())
    script.check_plan(cases)
    assert [p.head_dim for p in load_plan(script.PLAN)] == [40, 80, 80, 224, 59, 111]
    subset = [script.CASES["d59"], script.CASES["phi2"]]
    assert parse_plan(script.plan_text(subset)) == [c.problem() for c in subset]


def test_the_tuning_commands(script):
    args = script.parse_args(["--tune", "--db", "sqlite:///x.db", "--trials", "3"])
    cmds = [c[1:] for c in script.tune_commands(args, "p.toml")]
    assert [c[c.index("--template") + 1] for c in cmds] == ["attn_fwd", "attn_bwd"]
    assert all(c[:4] == ["-m", "flashtune", "--db", "sqlite:///x.db"] and "--plan" in c
               and c[c.index("--trials") + 1] == "3" for c in cmds)
    args = script.parse_args(["--tune", "--tune-ops", "--db", "sqlite:///x.db"])
    assert [c[-1] for c in script.tune_commands(args, "p.toml")][2:] == ["fwd", "train"]
    root = SCRIPT.parents[1]
    assert script.db_folder("sqlite:///.route/h.db") == root / ".route"
    assert script.db_folder("sqlite:////tmp/a/h.db") == Path("/tmp/a")
    assert script.db_folder("postgresql://host/db") is None


def test_the_dry_run_needs_no_gpu(script):
    out = script.dry_run(script.parse_args(["--dry-run", "--db", "sqlite:///x.db"]))
    by_name = {r["case"]: r for r in out["cases"]}
    assert list(by_name) == list(script.CASES)
    for name, row in by_name.items():  # TMA everywhere (an unaligned head dim runs padded)
        assert row["attn_fwd_default_h100"]["USE_TMA"] == 1, name
        assert row["attn_bwd_default_h100"]["USE_TMA"] == 1, name
    # ANCHORS.md's counts: 4 B H N^2 D, halved causal; the training step 3.5x that
    assert by_name["sd40"]["fwd_tflop"] == pytest.approx(4 * 8 * 8 * 4096**2 * 40 / 1e12)
    assert by_name["d59"]["train_tflop"] == pytest.approx(
        3.5 * 4 * 4 * 16 * 2048**2 * 59 / 2 / 1e12)
    assert len(out["tune_commands"]) == 2 and out["contenders"][:2] == [
        "flashtune", "flashtune_routed"]


def test_a_case_end_to_end_under_the_interpreter(script):
    tiny = script.Case("tiny59", "B1 H4:2 N24 D59 causal", 1, 4, 24, 59, True, kv_heads=2)
    args = script.parse_args(["--rounds", "2", "--dtype", "fp16"])
    calls = []

    def stub_bench(fn):
        fn()
        calls.append(fn)
        return Timing(2.0, 1.9, 2.1)

    row = script.run_case(tiny, args, interpreter_device(), script.dispatchers_for(None),
                          stub_bench, torch_device="cpu")
    assert row["attn_fwd"]["config"]["USE_TMA"] == 0
    for mode in ("fwd", "train"):
        res = row[mode]
        for name in ("flashtune", "flashtune_routed"):
            assert res[name]["median_ms"] == 2.0 and len(res[name]["round_medians_ms"]) == 2
            assert max(res[name]["rel_err_vs_fp32"].values()) < 5e-3, (mode, name)
        assert set(res["flashtune"]["rel_err_vs_fp32"]) == (
            {"out"} if mode == "fwd" else {"dq", "dk", "dv"})
        assert res["flashtune_routed"]["route"]["template"]
        assert "target" not in res["ratios"]  # no SDPA backend on the CPU
    assert len(calls) == 2 * 2 * 2  # 2 contenders x 2 modes x 2 rounds
    table = script.render_table([row], args)
    assert "| B1 H4:2 N24 D59 causal | train |" in table


def test_the_backward_sweep_checks_then_times_each_config(script):
    """``--bwd-sweep``: attn_bwd alone with the default and each config given (over the
    default), every one checked against fp32 first; one the predicate refuses is reported,
    not run."""
    tiny = script.Case("tiny59", "B1 H2 N20 D59", 1, 2, 20, 59, False)
    args = script.parse_args(["--rounds", "1", "--dtype", "fp16", "--modes", "train",
                              "--no-routed", "--bwd-sweep",
                              '[{"BLOCK_M1": 32}, {"REVERSE_DQ": 1, "num_stages": 2}]'])
    timed = []

    def stub_bench(fn):
        fn()
        timed.append(fn)
        return Timing(3.0, 2.9, 3.1)

    row = script.run_case(tiny, args, interpreter_device(), script.dispatchers_for(None),
                          stub_bench, torch_device="cpu")
    sweep = row["bwd_sweep"]
    assert [e["default"] for e in sweep] == [True, False, False]
    assert sweep[0]["config"] == row["attn_bwd"]["config"]
    assert sweep[1]["config"] == {**row["attn_bwd"]["config"], "BLOCK_M1": 32}
    for e in sweep[:2]:
        assert e["median_ms"] == 3.0 and max(e["rel_err_vs_fp32"].values()) < 5e-3, e
    assert sweep[2]["error"].startswith("refused: REVERSE_DQ")  # not causal: a no-op
    assert len(timed) == 2 + 1  # two sweep configs, the training step once
