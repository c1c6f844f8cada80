"""``benchmarks/bench_dropout.py`` (issue 31, item 2) without a GPU: its arguments, the plan
file against its cases, the tuning commands and the dry run."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from flashtune.autotune.plans import load_plan, parse_plan

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_dropout.py"


@pytest.fixture(scope="module")
def script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_dropout", SCRIPT)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_dropout"] = module  # its dataclass looks its module up
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop("bench_dropout", None)


def test_the_command_line(script):
    args = script.parse_args([])
    assert args.out == "benchmarks/results/dropout_h100.json" and args.dropout == 0.1
    assert args.cases.split(",") == ["bert", "d128c"] and args.modes == "fwd,train"
    for bad in (["--cases", "gpt"], ["--modes", "bwd"], ["--baselines", "flex"], ["--tune"],
                ["--dropout", "0"], ["--dropout", "1"]):
        with pytest.raises(SystemExit):
            script.parse_args(bad)


def test_the_plan_file_lists_the_cases(script):
    script.check_plan()
    plan = load_plan(script.PLAN)
    assert [(p.batch, p.heads_q, p.seqlen_q, p.head_dim, p.dropout) for p in plan] == [
        (32, 12, 512, 64, 0.1), (4, 16, 2048, 128, 0.1)]
    bert = [script.CASES["bert"]]
    assert parse_plan(script.plan_text(bert, 0.2)) == [bert[0].problem(0.2)]


def test_the_tuning_commands(script):
    args = script.parse_args(["--tune", "--tune-ops", "--db", "sqlite:///x.db"])
    cmds = [c[1:] for c in script.tune_commands(args, "p.toml")]
    assert [c[c.index("--template") + 1] for c in cmds[:2]] == ["attn_fwd", "attn_bwd"]
    assert [c[-1] for c in cmds[2:]] == ["fwd", "train"]
    assert all(c[:4] == ["-m", "flashtune", "--db", "sqlite:///x.db"] for c in cmds)


def test_the_dry_run(script):
    out = script.dry_run(script.parse_args(["--db", "sqlite:///x.db"]))
    assert [c["case"] for c in out["cases"]] == ["bert", "d128c"]
    assert out["cases"][0]["problem"]["dropout"] == 0.1
    assert out["cases"][0]["attn_fwd_default_h100"]["USE_TMA"] == 1
    assert out["flashtune_keep_probability"] == 230 / 256
    assert len(out["tune_commands"]) == 2


def test_the_ratios_and_the_target(script):
    res = {"flashtune": {"median_ms": 1.0}, "flashtune_nodrop": {"median_ms": 0.8},
           "sdpa_flash": {"median_ms": 1.5}, "sdpa_cudnn": {"median_ms": 1.2}}
    r = script.ratios(res, "train")
    assert r["flashtune_vs_best_sdpa"] == pytest.approx(1.2)
    assert r["target"] == {"against": "sdpa_cudnn", "ratio": pytest.approx(1.2),
                           "wanted": 1.1, "met": True}
    assert r["dropout_cost"] == pytest.approx(1.25)
    assert "target" not in script.ratios(res, "fwd")


def test_one_tiny_case_end_to_end_under_the_interpreter(script, monkeypatch):
    """A tiny case on CPU tensors (no SDPA backend there), the timer stubbed: flashtune's
    contenders are checked against fp32 with their masks (the fixed seed's and the routed
    call's, rebuilt from torch's seed), timed and reported, the kept fraction measured."""
    from flashtune.autotune.timing import Timing
    from flashtune.core.device import interpreter_device

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    case = script.Case("tiny", "tiny", 1, 2, 48, 16, True)
    args = script.parse_args(["--rounds", "2", "--dropout", "0.2"])
    timings = iter(range(1, 100))

    def bench(fn):
        fn()
        median = float(next(timings))
        return Timing(median_ms=median, p20_ms=median, p80_ms=median)

    row = script.run_case(case, args, interpreter_device(),
                          script.dispatchers_for(None), bench, torch_device="cpu")
    for mode in ("fwd", "train"):
        res = row[mode]
        assert set(res) == {"flashtune", "flashtune_nodrop", "flashtune_routed", "ratios"}
        assert all("error" not in res[n] for n in res if n != "ratios"), res
        assert max(res["flashtune"]["rel_err_vs_fp32"].values()) < 2e-2  # bf16
        assert max(res["flashtune_routed"]["rel_err_vs_fp32"].values()) < 2e-2
        assert len(res["flashtune"]["round_medians_ms"]) == 2 and "dropout_cost" in \
            res["ratios"]
    frac = row["kept_fraction"]["flashtune"]
    assert frac["expected"] == 205 / 256 and abs(frac["measured"] - frac["expected"]) < 0.02
    assert "| tiny | train |" in script.render_table([row], args)


def test_the_kernel_sweep_under_the_interpreter(script, monkeypatch):
    """``--sweep-bwd``: each backward override is checked against fp32 with the mask and
    timed, the first one also without dropout; a config that cannot run is reported, not
    timed; a bad list is refused."""
    from flashtune.autotune.timing import Timing
    from flashtune.core.device import interpreter_device

    for bad in ("{}", "[]", "[1]", "nope"):
        with pytest.raises(SystemExit):
            script.parse_args(["--sweep-bwd", bad])
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    case = script.Case("tiny", "tiny", 1, 2, 48, 16, False)
    args = script.parse_args(["--rounds", "2", "--dropout", "0.2", "--sweep-bwd",
                              '[{}, {"BLOCK_N1": 16, "BLOCK_M2": 16}, {"BLOCK_M1": 8}]'])

    def bench(fn):
        fn()
        return Timing(median_ms=1.0, p20_ms=1.0, p80_ms=1.0)

    row = script.sweep_case(case, args, interpreter_device(), script.dispatchers_for(None),
                            bench, torch_device="cpu")
    res = row["sweep"]
    timed = {n for n, r in res.items() if "tflops" in r}
    assert timed == {"fwd_drop", "fwd_nodrop", "bwd_default", "bwd_default_nodrop",
                     "bwd_BLOCK_N116_BLOCK_M216"}, res
    assert "error" in res["bwd_BLOCK_M18"]  # tl.dot needs tiles of 16
    for name in ("fwd_drop", "bwd_default", "bwd_BLOCK_N116_BLOCK_M216"):
        assert max(res[name]["rel_err_vs_fp32"].values()) < 2e-2, res[name]
    assert res["bwd_BLOCK_N116_BLOCK_M216"]["config"]["BLOCK_N1"] == 16
    assert "| tiny | bwd_default | " in script.render_sweep([row])


def test_the_backward_variant_under_the_interpreter(script, monkeypatch):
    """``--variant``: the training step also runs flashtune with the backward's config
    overridden (DROPOUT_BITS here), checked against fp32 with the mask, timed in the same
    rotation, with its ratio over the default; a bad object is refused."""
    from flashtune.autotune.timing import Timing
    from flashtune.core.device import interpreter_device

    for bad in ("[]", "{}", '{"DROPOUT_BITS": "yes"}', "nope"):
        with pytest.raises(SystemExit):
            script.parse_args(["--variant", bad])
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    case = script.Case("tiny", "tiny", 1, 2, 70, 16, True)
    variant = '{"DROPOUT_BITS": 1, "BLOCK_M1": 64, "BLOCK_N1": 32, "BLOCK_M2": 64, ' \
        '"BLOCK_N2": 32}'
    args = script.parse_args(["--rounds", "1", "--modes", "train", "--no-routed",
                              "--variant", variant])
    timings = iter([2.0, 1.0, 1.6])  # flashtune, flashtune_nodrop, flashtune_variant

    def bench(fn):
        fn()
        median = next(timings)
        return Timing(median_ms=median, p20_ms=median, p80_ms=median)

    row = script.run_case(case, args, interpreter_device(), script.dispatchers_for(None),
                          bench, torch_device="cpu")
    res = row["train"]
    assert set(res) == {"flashtune", "flashtune_nodrop", "flashtune_variant", "ratios"}, res
    assert max(res["flashtune_variant"]["rel_err_vs_fp32"].values()) < 2e-2, res
    assert res["flashtune_variant"]["rel_err_vs_fp32"] == res["flashtune"]["rel_err_vs_fp32"]
    assert row["attn_bwd"]["variant"]["DROPOUT_BITS"] == 1
    assert res["ratios"]["variant_over_default"] == pytest.approx(2.0 / 1.6)
    assert "flashtune_variant" in script.render_table([row], args)
