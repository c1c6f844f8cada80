"""``flashtune bench`` through click's CliRunner, and the library function behind it, on tiny
shapes (interpreter on CPU; compiled with FLASHTUNE_TEST_DEVICE=cuda). Timings here prove
nothing; what is tested is that every implementation is checked before it is timed, that a
wrong or unsupported one is reported and not timed, the dispatcher's tuned config is the one
benchmarked, and the table, JSON and plot are written."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from flashtune.cli.main import cli
from flashtune.core.problem import AttentionProblem
from flashtune.kernel_templates import get_template

PLAN = """
[[shape]]
batch = 1
heads = 4
kv_heads = 2
seqlen = {n}
head_dim = 32
causal = true
dtype = "fp16"
"""


def _plan(tmp_path: Path, *seqlens: int) -> Path:
    path = tmp_path / "plan.toml"
    path.write_text("".join(PLAN.format(n=n) for n in seqlens))
    return path


def test_bench_checks_times_and_writes_table_json_and_plot(tmp_path):
    out = tmp_path / "run" / "bench.json"
    res = CliRunner().invoke(cli, ["--db", f"sqlite:///{tmp_path / 'ft.db'}", "bench",
                                   "--plan", str(_plan(tmp_path, 33, 64)),
                                   "--baselines", "sdpa_flash,sdpa_cudnn", "--rounds", "2",
                                   "--out", str(out)])
    assert res.exit_code == 0, res.output
    run = json.loads(out.read_text())
    assert [r["problem"]["seqlen_q"] for r in run["rows"]] == [33, 64]
    for row in run["rows"]:
        assert row["source"] == "default" and row["config"] == row["default_config"]
        for name in ("flashtune", "flashtune_default", "sdpa_flash"):
            assert row[name]["rel_err_vs_fp32"] < 5e-3 and row[name]["tflops"] > 0
            assert len(row[name]["round_medians_ms"]) == 2
    assert run["summary"]["all_checked"] and run["summary"]["flashtune_vs_sdpa_flash_geomean"]
    png = out.with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "B=1 Hq=4 Hkv=2 Nq=33 Nk=33 D=32 fp16 causal" in res.output
    assert "vs flash" in res.output and "flashtune (geomean): vs default" in res.output


def test_bench_of_the_backward_checks_all_three_gradients(tmp_path):
    out = tmp_path / "bwd.json"
    res = CliRunner().invoke(cli, ["--db", f"sqlite:///{tmp_path / 'ft.db'}", "bench",
                                   "--template", "attn_bwd", "--plan", str(_plan(tmp_path, 45)),
                                   "--baselines", "sdpa_flash", "--out", str(out)])
    assert res.exit_code == 0, res.output
    run = json.loads(out.read_text())
    [row] = run["rows"]
    p = AttentionProblem.from_key(row["problem"])
    assert run["benchmark"] == "attn_bwd" and row["flops"] == p.flops(backward=True)
    assert "BLOCK_M1" in row["config"]  # attn_bwd's own config, from its own dispatcher
    for name in ("flashtune", "flashtune_default", "sdpa_flash"):
        assert row[name]["rel_err_vs_fp32"] < 5e-3 and row[name]["tflops"] > 0


def test_a_wrong_gradient_is_reported_and_not_timed(monkeypatch):
    import flashtune.kernel_templates as templates
    from flashtune.runtime.bench import bench_attention

    real = templates.get_template
    spec = real("attn_bwd")

    def halve_dk(*args, **kw):
        dq, dk, dv = spec.launcher(*args, **kw)
        return dq, dk * 0.5, dv

    bad = dataclasses.replace(spec, launcher=halve_dk)
    monkeypatch.setattr(templates, "get_template",
                        lambda name: bad if name == "attn_bwd" else real(name))
    p = AttentionProblem(1, 2, 1, 40, 40, 32, False, "fp16")
    [row] = bench_attention([p], template="attn_bwd", baselines=[], db_url="sqlite://")["rows"]
    for name in ("flashtune", "flashtune_default"):
        assert "relative error" in row[name]["error"] and "tflops" not in row[name]


def test_a_wrong_implementation_is_reported_and_not_timed(monkeypatch):
    import flashtune.kernel_templates as templates
    from flashtune.runtime.bench import bench_attention

    spec = templates.get_template("attn_fwd")

    def doubled(q, k, v, config, **kw):
        return spec.launcher(q, k, v, config, **kw) * 2

    bad = dataclasses.replace(spec, launcher=doubled)
    monkeypatch.setattr(templates, "get_template", lambda name: bad)
    p = AttentionProblem(1, 2, 2, 40, 40, 32, False, "fp16")
    run = bench_attention([p], baselines=["sdpa_flash"], db_url="sqlite://")
    [row] = run["rows"]
    for name in ("flashtune", "flashtune_default"):
        assert "relative error" in row[name]["error"] and "tflops" not in row[name]
    assert row["sdpa_flash"]["tflops"] > 0  # the reference is right, SDPA is timed
    assert run["summary"]["all_checked"] is False


@pytest.mark.parametrize("plan", ["stale", "right", "unbuildable", "none"])
def test_what_a_later_call_replays_is_checked_too(monkeypatch, plan):
    """The routed choice's launch plan (what the runtime replays after a shape's first
    call; off the GPU there is none, so it is stood in for): built on copies of the inputs,
    run on the inputs (other values). One whose output is stale (a plan that kept its build call's
    tensors: attn_fwd's second head-dim tile did) fails flashtune's row where the launcher
    passed; a right one is recorded and flashtune timed; one that cannot be built, or
    none, leaves the launcher's row as it was."""
    from flashtune.runtime import routing
    from flashtune.runtime.bench import bench_attention

    spec = get_template("attn_fwd")
    built = []

    def replay_plan(impl, config, q, k, v, *, causal, **kw):
        if plan == "unbuildable":
            raise RuntimeError("Triton internals moved")
        if plan == "none":
            return None
        built.append((impl.name, q.data_ptr()))
        kept = (q, k, v)  # the build call's tensors

        def replay(q, k, v):
            return spec.launcher(*(kept if plan == "stale" else (q, k, v)), config,
                                 causal=causal)
        return replay

    monkeypatch.setattr(routing, "replay_plan", replay_plan)
    p = AttentionProblem(1, 2, 2, 40, 40, 32, True, "fp16")
    [row] = bench_attention([p], baselines=[], db_url="sqlite://")["rows"]
    assert row["flashtune_default"]["tflops"] > 0  # the plan is the routed choice's only
    planned = row["planned_rel_err_vs_fp32"]
    if plan == "stale":
        assert built and planned > 0.1
        assert "launch plan" in row["flashtune"]["error"] and "tflops" not in row["flashtune"]
    elif plan == "right":
        assert built == [("attn_fwd", built[0][1])] and planned < 5e-3
        assert row["flashtune"]["tflops"] > 0
    else:
        assert planned is None if plan == "none" else planned.startswith("not planned")
        assert row["flashtune"]["tflops"] > 0


def test_sdpa_is_not_compared_where_its_causal_mask_differs():
    from flashtune.runtime.bench import bench_attention

    p = AttentionProblem(1, 2, 2, 24, 40, 32, True, "fp16")  # Nq != Nk: bottom-right vs top-left
    [row] = bench_attention([p], baselines=["sdpa_flash"], db_url="sqlite://")["rows"]
    assert "top-left" in row["sdpa_flash"]["error"]
    assert row["flashtune"]["tflops"] > 0


def test_a_causal_step_of_one_query_is_compared_with_sdpa_unmasked():
    """Bottom-right, one query row sees every key: SDPA without its mask is the same."""
    from flashtune.runtime.bench import bench_attention

    p = AttentionProblem(1, 4, 2, 1, 40, 32, True, "fp16")
    [row] = bench_attention([p], baselines=["sdpa_flash"], db_url="sqlite://")["rows"]
    assert row["sdpa_flash"]["tflops"] > 0 and row["flashtune"]["tflops"] > 0


# on the CPU Flex runs eagerly (the interpreter's tensors), and torch says so
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_a_forwards_score_modifications_are_run_and_checked():
    """A window, a softcap and ALiBi reach every launch and the fp32 reference (a softcap of
    1 changes the output far beyond the check's tolerance, so a launch without it would
    fail the check), FlexAttention's too (its block mask and score_mod, checked the same
    way); SDPA is not timed with them; dropout, packed batches and the training step with
    modifications get a row that names the benchmark that times them."""
    from flashtune.runtime.bench import bench_attention

    window = AttentionProblem(1, 4, 2, 40, 56, 32, True, "fp16", 7)
    softcap = AttentionProblem(1, 2, 2, 40, 40, 32, False, "fp16", softcap=1.0)
    alibi = AttentionProblem(1, 4, 2, 1, 48, 32, True, "fp16", alibi=True)  # a decoding step
    dropout = AttentionProblem(1, 2, 2, 40, 40, 32, False, "fp16", dropout=0.1)
    run = bench_attention([window, softcap, alibi, dropout], baselines=["sdpa_flash", "flex"],
                          db_url="sqlite://")
    for row in run["rows"][:3]:
        for name in ("flashtune", "flashtune_default", "flex"):
            assert row[name]["tflops"] > 0 and row[name]["rel_err_vs_fp32"] < 1e-2, row
        assert "serves no" in row["sdpa_flash"]["error"]
    assert "bench_dropout.py" in run["rows"][3]["flashtune"]["error"]
    [trained] = bench_attention([softcap], baselines=[], db_url="sqlite://",
                                train=True)["rows"]
    assert "bench_mods.py" in trained["flashtune"]["error"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="tunes under the interpreter: its "
                    "entries are the interpreter device's, a GPU's bench reads its own")
def test_the_dispatchers_tuned_config_is_what_is_benchmarked(tmp_path):
    from flashtune.autotune.jobs import tune
    from flashtune.autotune.options import TuneOptions
    from flashtune.runtime.bench import bench_attention

    url = f"sqlite:///{tmp_path / 'ft.db'}"
    p = AttentionProblem(1, 4, 2, 64, 64, 32, True, "fp16")
    [tuned] = tune([p], TuneOptions(trials=2, sampler="random", seed=1, interpret=True),
                   db_url=url, progress=False)
    result = bench_attention([p], baselines=[], db_url=url)
    [row] = result["rows"]
    assert row["source"] == "exact" and row["config"] == tuned.best_config
    assert row["flashtune"]["tflops"] > 0
    # the stored winner's drift from what the tuner recorded for this very problem
    assert row["recorded_tflops"] == pytest.approx(tuned.best_tflops)
    assert row["drift"] == pytest.approx(row["flashtune"]["tflops"] / tuned.best_tflops)
    assert result["summary"]["drift_geomean"] == pytest.approx(row["drift"])
    from flashtune.cli.bench_commands import render_bench

    table = render_bench(result)
    assert "vs recorded" in table.splitlines()[0]
    assert f"{row['drift']:.2f}x" in table.splitlines()[1]
    assert "stored winners measured against their recorded TFLOP/s: geomean" in table
    # a neighbour's entry serves a shape it was not tuned for: no drift is claimed
    near = dataclasses.replace(p, seqlen_q=80, seqlen_k=80)
    [other] = bench_attention([near], baselines=[], db_url=url)["rows"]
    assert other["source"] != "exact" and other["recorded_tflops"] is None
    assert other["drift"] is None


def test_bad_input_names_the_option(tmp_path):
    runner = CliRunner()
    res = runner.invoke(cli, ["bench", "--baselines", "sdpa_flash,xformers"])
    assert res.exit_code == 2 and "'--baselines'" in res.output and "xformers" in res.output
    res = runner.invoke(cli, ["bench", "--head-dims", "64,x"])
    assert res.exit_code == 2 and "'--head-dims'" in res.output
    res = runner.invoke(cli, ["bench", "--seqlen", "64"])  # a partial shape
    assert res.exit_code == 2 and "--batch" in res.output
    res = runner.invoke(cli, ["bench", "--template", "attn_decode"])
    assert res.exit_code == 2 and "'--template'" in res.output
    from flashtune.runtime.bench import bench_attention

    with pytest.raises(ValueError, match="unknown baselines"):
        bench_attention([], baselines=["nope"])
    with pytest.raises(ValueError, match="cannot benchmark template 'attn_decode'"):
        bench_attention([], template="attn_decode")


def test_the_interpreter_refuses_the_standard_grid(tmp_path):
    res = CliRunner().invoke(cli, ["bench", "--interpret", "--out", str(tmp_path / "b.json")])
    assert res.exit_code == 2 and "give a small shape" in res.output
    assert not (tmp_path / "b.json").exists()


def test_without_a_shape_it_benchmarks_the_standard_grid(tmp_path, monkeypatch):
    import flashtune.cli.bench_commands as commands
    import flashtune.runtime.bench as bench_mod
    from flashtune.autotune.grids import standard_grid

    monkeypatch.setattr(commands, "_decide_interpret", lambda requested: False)  # "a GPU"

    seen = {}

    def fake(problems, **kw):  # stands in for bench_attention
        seen["problems"], seen["kw"] = list(problems), kw
        return {"rows": [], "summary": {}, "ceiling_tflops": None}

    monkeypatch.setattr(bench_mod, "bench_attention", fake)
    res = CliRunner().invoke(cli, ["bench", "--head-dims", "128", "--seqlens", "512,1024",
                                   "--no-plot", "--out", str(tmp_path / "b.json")])
    assert res.exit_code == 0, res.output
    assert seen["problems"] == standard_grid((128,), seqlens=(512, 1024))
    assert seen["kw"]["baselines"] == ["sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "flex"]
    assert seen["kw"]["template"] == "attn_fwd"
    assert not (tmp_path / "b.png").exists()


SMALL = ["--batch", "1", "--heads", "2", "--seqlen", "64", "--head-dim", "32", "--dtype",
         "fp16", "--baselines", "sdpa_flash"]


@pytest.fixture
def no_bench(monkeypatch):
    """bench_attention replaced by one that records it ran and returns an empty run."""
    import flashtune.runtime.bench as bench_mod

    calls = []

    def fake(problems, **kw):
        calls.append(list(problems))
        return {"rows": [], "summary": {}, "ceiling_tflops": None}

    monkeypatch.setattr(bench_mod, "bench_attention", fake)
    return calls


def _error_line(output):
    [line] = [ln for ln in output.splitlines() if ln.startswith("Error:")]
    return line


@pytest.mark.parametrize("option,make_path,needle", [
    ("--out", lambda tmp: "/proc/b.json", "cannot write in folder /proc"),
    ("--out", lambda tmp: str(tmp / "a-file" / "x.json"), "a-file is not a folder"),
    ("--plot", lambda tmp: "/proc/b.png", "cannot write in folder /proc"),
    ("--plot", lambda tmp: str(tmp / "a-file" / "b.png"), "a-file is not a folder"),
    ("--out", lambda tmp: str(tmp), "is a directory"),
])
def test_output_paths_are_checked_before_anything_runs(tmp_path, no_bench, option, make_path,
                                                       needle):
    (tmp_path / "a-file").write_text("")
    args = ["bench", *SMALL, "--out", str(tmp_path / "b.json"), option, make_path(tmp_path)]
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    line = _error_line(res.output)
    assert f"'{option}'" in line and needle in line
    assert not no_bench  # refused before the benchmark ran


def test_a_plot_that_cannot_be_written_still_prints_the_table(tmp_path, no_bench,
                                                              monkeypatch):
    from flashtune.report import plots

    def unwritable(result, path):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(plots, "plot_bench", unwritable)
    out = tmp_path / "b.json"
    res = CliRunner().invoke(cli, ["bench", *SMALL, "--out", str(out)])
    assert res.exit_code == 1 and "Traceback" not in res.output, res.output
    assert "vs flash" in res.output  # the table came first
    line = _error_line(res.output)
    assert f"wrote {out} but not the plot" in line and "Permission denied" in line
    assert json.loads(out.read_text())["rows"] == []


def test_a_json_that_cannot_be_written_is_one_line(tmp_path, no_bench, monkeypatch):
    def unwritable(self, *a, **kw):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_text", unwritable)
    res = CliRunner().invoke(cli, ["bench", *SMALL, "--no-plot", "--out",
                                   str(tmp_path / "b.json")])
    assert res.exit_code == 1 and "Traceback" not in res.output, res.output
    assert "No space left on device" in _error_line(res.output)


@pytest.mark.parametrize("args,option", [
    (["--batch", "1", "--heads", "2", "--seqlen", "64", "--head-dim", "257"], "'--head-dim'"),
    (["--head-dims", "64,257"], "'--head-dims'"),
])
def test_unsupported_head_dims_are_refused(tmp_path, no_bench, args, option):
    res = CliRunner().invoke(cli, ["bench", *args, "--out", str(tmp_path / "b.json")])
    assert res.exit_code == 2, res.output
    line = _error_line(res.output)
    assert option in line and "257" in line and "supported: 1 to 256" in line
    assert not no_bench


def test_the_interpreter_refuses_a_preset_as_it_refuses_the_grid(tmp_path, no_bench):
    res = CliRunner().invoke(cli, ["bench", "--preset", "llama3-8b", "--interpret", "--no-plot",
                                   "--out", str(tmp_path / "b.json")])
    assert res.exit_code == 2, res.output
    line = _error_line(res.output)
    assert "too big for the Triton interpreter" in line and "would take hours" in line
    assert not no_bench and not (tmp_path / "b.json").exists()


def test_the_training_step_bench_times_every_own_pair_the_gpu_can_run(tmp_path):
    """``bench --train``'s ``impl_<name>`` columns are the op's own pairs, the Gluon backward
    after either forward included, each with its own backward's config (for an H100:
    no GPU needed to list them)."""
    from flashtune.kernel_templates import get_template
    from flashtune.kernel_templates.sm90 import H100
    from flashtune.runtime.bench import _Served
    from flashtune.runtime.lookup import Dispatcher

    served = _Served(Dispatcher(get_template("attn_fwd")), f"sqlite:///{tmp_path / 'none.db'}")
    pairs = served.own_implementations(AttentionProblem(4, 16, 16, 1024, 1024, 128, True,
                                                        "bf16"), H100, train=True)
    # (with a GPU here, also the pairs with one of cuDNN's kernels, which need one to run)
    hybrids = {"impl_attn_fwd_gluon_bwd_cudnn", "impl_sdpa_cudnn_bwd_gluon"} \
        if torch.cuda.is_available() else set()
    assert set(pairs) == {"impl_attn_fwd", "impl_attn_fwd_bwd_gluon", "impl_attn_fwd_gluon",
                          "impl_attn_fwd_gluon_bwd_gluon"} | hybrids
    assert pairs["impl_attn_fwd_bwd_gluon"][0].launcher.bwd.name == "attn_bwd_gluon"
    spec, config = pairs["impl_attn_fwd_gluon_bwd_gluon"]
    assert spec.launcher.bwd.name == "attn_bwd_gluon"
    assert set(get_template("attn_bwd_gluon").space.params) == {
        k[len("bwd."):] for k in config if k.startswith("bwd.")}
    assert pairs["impl_attn_fwd_gluon"][0].launcher.bwd.name == "attn_bwd"
    # D96: the Gluon kernels refuse it, attn_fwd's pair serves it
    assert set(served.own_implementations(AttentionProblem(2, 8, 8, 256, 256, 96, False,
                                                           "bf16"), H100, train=True)) == {
        "impl_attn_fwd"}


def test_the_routed_column_is_what_the_runtime_runs_untuned_on_an_h100(tmp_path,
                                                                        monkeypatch):
    """With nothing tuned, ``bench``'s ``flashtune`` column on an sm_90 device is what the
    runtime runs: the training step on its default by compute capability
    (``routing._train_default``: SDPA's cuDNN backend), the forward on attn_fwd (cuDNN
    plans every new shape, so an inference call takes it only at a shape chosen for it).
    (A CPU build of torch has no cuDNN, so the extern's own refusal is stood in for: cuDNN
    serves head dims that are multiples of 8 here.)"""
    from flashtune.kernel_templates import get_template
    from flashtune.kernel_templates.registry import train_step
    from flashtune.kernel_templates.sm90 import H100
    from flashtune.runtime import routing
    from flashtune.runtime.bench import _Served
    from flashtune.runtime.lookup import Dispatcher

    real = routing._train_default
    asked = []

    def on_gpu(problem, device, return_lse):
        asked.append(problem.head_dim)
        if problem.head_dim % 8 or device.capability != (9, 0):
            return None
        return dataclasses.replace(real(problem, device, return_lse)
                                   or routing.ConfigChoice({}, "default",
                                                           template="sdpa_cudnn"))
    monkeypatch.setattr(routing, "_train_default", on_gpu)
    fwd = get_template("attn_fwd")
    served = _Served(Dispatcher(fwd), f"sqlite:///{tmp_path / 'none.db'}")
    p = AttentionProblem(4, 16, 16, 1024, 1024, 128, True, "bf16")
    assert served.choice(p, fwd, H100).template == "attn_fwd"
    assert served.choice(p, train_step(fwd), H100).template == "sdpa_cudnn"
    assert asked == [128]
    # a head dim cuDNN refuses keeps flashtune's own kernels
    odd = AttentionProblem(2, 8, 8, 256, 256, 59, True, "bf16")
    assert served.choice(odd, fwd, H100).template == "attn_fwd"
    assert served.choice(odd, train_step(fwd), H100).template == "attn_fwd"


def test_contenders_whose_rounds_spread_are_counted_and_named():
    """A contender whose round medians are more than 5% apart on a shape makes its ratios
    there uncertain by as much: the summary counts such shapes per contender and the table
    names the worst (the same cuDNN kernel spread 17% between rounds on an H100)."""
    from flashtune.cli.bench_commands import render_bench
    from flashtune.runtime.bench import round_spread, summarize

    def timed(*ms):
        return {"median_ms": sorted(ms)[len(ms) // 2], "tflops": 1.0 / ms[0],
                "round_medians_ms": list(ms)}

    rows = [{"label": "A", "source": "exact", "flops": 1.0, "flashtune": timed(1.0, 1.01, 1.0),
             "sdpa_cudnn": timed(2.82, 2.58, 2.42), "impl_attn_fwd_gluon": timed(1.0, 1.2)},
            {"label": "B", "source": "exact", "flops": 1.0, "flashtune": timed(1.0, 1.0, 1.0),
             "sdpa_cudnn": timed(1.0, 1.06, 1.0), "flex": timed(1.0)}]
    assert round_spread(rows[0]["sdpa_cudnn"]) == pytest.approx(2.82 / 2.42 - 1)
    assert round_spread(rows[1]["flex"]) is None  # one round: no spread to speak of
    summary = summarize(rows, None)
    assert summary["round_spread"] == {
        "impl_attn_fwd_gluon": {"shapes": 1, "max": pytest.approx(0.2), "at": "A"},
        "sdpa_cudnn": {"shapes": 2, "max": pytest.approx(2.82 / 2.42 - 1), "at": "A"}}
    table = render_bench({"rows": rows, "summary": summary})
    assert ("round medians more than 5% apart (a ratio there is that uncertain): "
            "attn_fwd_gluon on 1 shape(s), at most 20% (A); sdpa cudnn on 2 shape(s), at most "
            "17% (A)") in table
    steady = [dict(rows[1], sdpa_cudnn=timed(1.0, 1.04, 1.0))]
    assert "round_spread" not in summarize(steady, None)
    assert "apart" not in render_bench({"rows": steady, "summary": summarize(steady, None)})
