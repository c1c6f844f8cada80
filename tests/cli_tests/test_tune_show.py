"""``flashtune tune`` and ``flashtune show`` through click's CliRunner.

``tune`` is tested against a stand-in ``flashtune.autotune.jobs`` module (same API) so the
tests are fast and need no GPU; one slow test runs the real pipeline in interpreter mode.
"""

from __future__ import annotations

import importlib
import json
import re
import sys
import types
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from flashtune.autotune.presets import preset
from flashtune.cli.main import cli
from flashtune.core.device import DeviceFingerprint
from flashtune.core.errors import StoreError
from flashtune.core.problem import AttentionProblem
from flashtune.db import SoftwareVersions, TrialState, open_store
from flashtune.db.records import ImportedBest
from flashtune.kernel_templates import known_names

SHAPE = ["--batch", "2", "--heads", "8", "--kv-heads", "2", "--seqlen", "256",
         "--head-dim", "64"]


@dataclass(frozen=True)
class FakeOptions:
    template: str = "attn_fwd"
    trials: int = 50
    timeout_s: float | None = None
    sampler: str = "tpe"
    seed: int | None = None
    patience: int | None = None
    interpret: bool = False
    workers: int | None = None
    trial_timeout_s: float = 120.0
    top_k_confirm: int = 3
    isolate: bool | None = None
    settle_ms: float = 0.0


@dataclass(frozen=True)
class FakeResult:
    problem: AttentionProblem
    device_name: str
    template: str
    best_config: dict | None
    best_ms: float | None
    best_tflops: float | None
    default_config: dict
    default_ms: float | None
    default_tflops: float | None
    speedup: float | None
    trials: int
    states: dict[str, int]
    wall_s: float
    became_best: bool
    study_name: str


@dataclass
class Calls:
    calls: list[dict[str, Any]] = field(default_factory=list)
    error: Exception | None = None


@pytest.fixture
def jobs(monkeypatch: pytest.MonkeyPatch) -> Calls:
    """A stand-in ``flashtune.autotune.jobs`` that records each ``tune`` call."""
    record = Calls()

    def tune(problems: list[AttentionProblem], options: FakeOptions, *,
             db_url: str | None = None, progress: bool = True,
             gpus: list[int] | None = None) -> list[FakeResult]:
        record.calls.append(dict(problems=list(problems), options=options, db_url=db_url,
                                 progress=progress, gpus=gpus))
        if record.error is not None:
            raise record.error
        cfg = {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}
        return [FakeResult(p, "cpu", options.template, cfg if i == 0 else None,
                           1.0 if i == 0 else None, 123.4 if i == 0 else None,
                           {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2},
                           1.5, 82.3, 1.5 if i == 0 else None, options.trials,
                           {"COMPLETE": options.trials}, 3.25, i == 0, f"s{i}")
                for i, p in enumerate(problems)]

    fake = types.ModuleType("flashtune.autotune.jobs")
    fake.TuneOptions = FakeOptions  # type: ignore[attr-defined]
    fake.TuneResult = FakeResult  # type: ignore[attr-defined]
    fake.tune = tune  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "flashtune.autotune.jobs", fake)
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # restored after the test
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    return record


def run(*args: str, env: dict[str, str] | None = None) -> Result:
    result = CliRunner().invoke(cli, list(args), env=env)
    assert result.exception is None or isinstance(result.exception, SystemExit), \
        repr(result.exception)
    assert "Traceback" not in result.output
    return result


def error_line(result: Result) -> str:
    lines = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(lines) == 1, result.output
    return lines[0]


# -- tune: parsing --------------------------------------------------------------------------


def test_tune_shape_and_search_options(jobs: Calls, tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 't.db'}"
    result = run("--db", url, "tune", *SHAPE, "--kv-seqlen", "512", "--causal", "--dtype",
                 "fp16", "--trials", "7", "--timeout", "30", "--patience", "3", "--sampler",
                 "random", "--seed", "5", "--workers", "2", "--no-progress")
    assert result.exit_code == 0, result.output
    (call,) = jobs.calls
    assert call["problems"] == [AttentionProblem(2, 8, 2, 256, 512, 64, True, "fp16")]
    assert call["options"] == FakeOptions(trials=7, timeout_s=30.0, sampler="random", seed=5,
                                          patience=3, interpret=False, workers=2)
    assert call["db_url"] == url and call["progress"] is False


def test_tune_settle_ms(jobs: Calls) -> None:
    from flashtune.autotune.options import MAX_SETTLE_MS
    from flashtune.cli.tune_commands import MAX_SETTLE_MS as CLI_MAX

    assert CLI_MAX == MAX_SETTLE_MS  # written out in the CLI, which imports no library code
    result = run("tune", *SHAPE, "--settle-ms", "250")
    assert result.exit_code == 0, result.output
    assert jobs.calls[0]["options"] == FakeOptions(settle_ms=250.0)
    for bad in ("-1", "nan", "20000"):
        result = run("tune", *SHAPE, "--settle-ms", bad)
        assert result.exit_code == 2 and "--settle-ms" in result.output, result.output
    assert len(jobs.calls) == 1


def test_tune_gpus(jobs: Calls, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    result = run("tune", *SHAPE, "--gpus", "0,2,3")
    assert result.exit_code == 0, result.output
    assert jobs.calls[0]["gpus"] == [0, 2, 3]
    for bad, needle in (("0,x", "comma-separated GPU indices"), ("1,1", "distinct"),
                        ("-1", "distinct and >= 0"), ("0,4", r"GPU\(s\) \[4\] do not exist")):
        result = run("tune", *SHAPE, "--gpus", bad)
        assert result.exit_code == 2 and re.search(needle, result.output), result.output
    assert len(jobs.calls) == 1


def test_tune_gpus_worker_died_shows_the_rest(jobs: Calls,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from flashtune.autotune.workers import WorkerError

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    done = FakeResult(AttentionProblem(2, 8, 2, 256, 256, 64, False, "bf16"), "gpu",
                      "attn_fwd", {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4,
                                   "num_stages": 3}, 1.0, 99.0, {}, None, None, None, 5,
                      {"COMPLETE": 5}, 1.0, True, "s")
    jobs.error = WorkerError("worker on GPU 1 died (exit code -11) while tuning X. Run the "
                             "same command again to resume.", [done])
    result = run("tune", *SHAPE, "--gpus", "0,1")
    assert result.exit_code == 1
    assert "99.0" in result.output  # the finished problem's row
    assert "died (exit code -11)" in error_line(result)


def test_tune_defaults(jobs: Calls) -> None:
    result = run("tune", "--batch", "1", "--heads", "4", "--seqlen", "128", "--head-dim", "32")
    assert result.exit_code == 0, result.output
    (call,) = jobs.calls
    assert call["problems"] == [AttentionProblem(1, 4, 4, 128, 128, 32, False, "bf16")]
    assert call["options"] == FakeOptions()
    assert call["db_url"] is None and call["progress"] is True


def test_tune_db_from_envvar(jobs: Calls) -> None:
    result = run("tune", *SHAPE, env={"FLASHTUNE_DB": "sqlite:///x.db"})
    assert result.exit_code == 0
    assert jobs.calls[0]["db_url"] == "sqlite:///x.db"


def test_tune_template_option(jobs: Calls) -> None:
    assert run("tune", "--template", "attn_bwd", *SHAPE).exit_code == 0
    assert jobs.calls[0]["options"].template == "attn_bwd"


def test_tune_help_lists_the_templates() -> None:
    result = run("tune", "--help")
    assert f"[{'|'.join(known_names())}]" in result.output
    assert "[attn_bwd|attn_bwd_gluon|attn_decode|attn_fwd|attn_fwd_bwd_gluon|attn_fwd_gluon|" \
        in result.output
    assert "|sdpa_cudnn|sdpa_cudnn_bwd|sdpa_cudnn_bwd_gluon|sdpa_efficient|sdpa_flash|" \
        in result.output


def test_tune_seed_range_ends_at_2_to_the_32_minus_1(jobs: Calls) -> None:
    assert run("tune", *SHAPE, "--seed", "0").exit_code == 0
    assert run("tune", *SHAPE, "--seed", "4294967295").exit_code == 0
    assert [c["options"].seed for c in jobs.calls] == [0, 4294967295]


def test_tune_cmaes_without_the_package_names_the_option(jobs: Calls,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from flashtune.cli import options

    monkeypatch.setattr(options, "cmaes_installed", lambda: False)
    result = run("tune", *SHAPE, "--sampler", "cmaes")
    assert result.exit_code == 2
    line = error_line(result)
    assert "'--sampler'" in line and "pip install cmaes" in line
    assert not jobs.calls
    monkeypatch.setattr(options, "cmaes_installed", lambda: True)
    assert run("tune", *SHAPE, "--sampler", "cmaes").exit_code == 0


def test_tune_plan_with_an_unsupported_head_dim_names_the_plan(jobs: Calls,
                                                               tmp_path: Path) -> None:
    plan = tmp_path / "plan.toml"
    plan.write_text("[[shape]]\nbatch = 1\nheads = 4\nseqlen = 64\nhead_dim = 257\n")
    result = run("tune", "--plan", str(plan))
    assert result.exit_code == 2
    line = error_line(result)
    assert "'--plan'" in line and "257" in line and "supported: 1 to 256" in line
    assert not jobs.calls


def test_bad_seed_writes_nothing_with_the_real_pipeline(tmp_path: Path) -> None:
    """The real jobs module: refused while parsing, so no run is left RUNNING (the database
    is not even created)."""
    path = tmp_path / "t.db"
    for bad in ("-1", "4294967296", "99999999999999999999"):
        result = run("--db", f"sqlite:///{path}", "tune", "--batch", "1", "--heads", "2",
                     "--seqlen", "64", "--head-dim", "32", "--dtype", "fp16", "--trials", "2",
                     "--seed", bad, "--interpret", "--no-progress")
        assert result.exit_code == 2 and "'--seed'" in error_line(result)
    assert not path.exists()


def test_tune_preset(jobs: Calls) -> None:
    result = run("tune", "--preset", "llama3-8b", "--dtype", "fp16")
    assert result.exit_code == 0, result.output
    assert jobs.calls[0]["problems"] == preset("llama3-8b", dtype="fp16")


def test_tune_unknown_preset_lists_known(jobs: Calls) -> None:
    result = run("tune", "--preset", "gpt5")
    assert result.exit_code == 2
    line = error_line(result)
    assert "gpt5" in line and "llama3-8b" in line and "standard" in line
    assert not jobs.calls


def test_tune_plan(jobs: Calls, tmp_path: Path) -> None:
    plan = tmp_path / "plan.toml"
    plan.write_text("[[shape]]\nbatch = 1\nheads = 4\nseqlen = 64\nhead_dim = 16\n"
                    "[[shape]]\nbatch = 2\nheads = 8\nkv_heads = 2\nseqlen = 32\n"
                    "kv_seqlen = 64\nhead_dim = 32\ncausal = true\ndtype = 'fp16'\n")
    result = run("tune", "--plan", str(plan))
    assert result.exit_code == 0, result.output
    assert jobs.calls[0]["problems"] == [AttentionProblem(1, 4, 4, 64, 64, 16, False, "bf16"),
                                         AttentionProblem(2, 8, 2, 32, 64, 32, True, "fp16")]


@pytest.mark.parametrize("text,needle", [
    ("[[shape]]\nbatch = 1\nheads = 4\nseqlen = 64\n", "shape[1]: missing required field 'head_dim'"),
    ("[[shape]]\nbatch = 1\nheads = 4\nseqlen = 'x'\nhead_dim = 16\n", "shape[1].seqlen: expected an integer"),
    ("[[shape]]\nbatch = 1\nheads = 4\nseqlen = 64\nhead_dim = 16\nfoo = 1\n", "unknown field(s) foo"),
    ("[[shape\n", "not valid TOML"),
])
def test_tune_plan_errors(jobs: Calls, tmp_path: Path, text: str, needle: str) -> None:
    plan = tmp_path / "plan.toml"
    plan.write_text(text)
    result = run("tune", "--plan", str(plan))
    assert result.exit_code == 2
    assert needle in error_line(result)
    assert not jobs.calls


def test_tune_plan_missing_file(jobs: Calls, tmp_path: Path) -> None:
    result = run("tune", "--plan", str(tmp_path / "nope.toml"))
    assert result.exit_code == 2 and "cannot read plan" in error_line(result)


@pytest.mark.parametrize("args", [
    [],
    [*SHAPE, "--preset", "llama3-8b"],
    [*SHAPE, "--plan", "p.toml"],
    ["--plan", "p.toml", "--preset", "llama3-8b"],
    ["--causal", "--preset", "llama3-8b"],
])
def test_tune_sources_are_exclusive(jobs: Calls, args: list[str]) -> None:
    result = run("tune", *args)
    assert result.exit_code == 2
    assert "exactly one of" in error_line(result)
    assert not jobs.calls


def test_tune_dtype_with_plan_is_refused(jobs: Calls, tmp_path: Path) -> None:
    result = run("tune", "--plan", str(tmp_path / "p.toml"), "--dtype", "fp16")
    assert result.exit_code == 2 and "--dtype" in error_line(result)


@pytest.mark.parametrize("args,needle", [
    (["--batch", "1", "--heads", "4", "--seqlen", "64"], "--head-dim"),
    ([*SHAPE, "--trials", "-1"], "--trials"),
    ([*SHAPE, "--trials", "0"], "--trials"),
    ([*SHAPE[:-1], "sixty"], "--head-dim"),
    ([*SHAPE, "--dtype", "fp32"], "--dtype"),
    ([*SHAPE, "--sampler", "bayes"], "--sampler"),
    ([*SHAPE, "--timeout", "0"], "--timeout"),
    ([*SHAPE, "--timeout", "soon"], "--timeout"),
    ([*SHAPE, "--patience", "0"], "--patience"),
    ([*SHAPE, "--workers", "0"], "--workers"),
    ([*SHAPE, "--seed", "1.5"], "--seed"),
    # values the parser used to accept and the search then crashed on, with a traceback and
    # a RUNNING run left in the database
    ([*SHAPE, "--seed", "-1"], "--seed"),
    ([*SHAPE, "--seed", "4294967296"], "--seed"),
    ([*SHAPE, "--seed", "99999999999999999999"], "--seed"),
    ([*SHAPE, "--timeout", "nan"], "--timeout"),
    ([*SHAPE, "--timeout", "inf"], "--timeout"),
    (["--template", "nope", *SHAPE], "--template"),
    ([*SHAPE[:-1], "257"], "--head-dim"),
    (["--batch", "0", "--heads", "4", "--seqlen", "64", "--head-dim", "16"], "--batch"),
    (["--batch", "1", "--heads", "6", "--kv-heads", "4", "--seqlen", "64", "--head-dim", "16"],
     "multiple of heads_kv"),
])
def test_tune_bad_values(jobs: Calls, args: list[str], needle: str) -> None:
    result = run("tune", *args)
    assert result.exit_code == 2
    assert needle in error_line(result)
    assert not jobs.calls


def test_tune_library_error_is_one_line(jobs: Calls) -> None:
    jobs.error = StoreError("cannot open sqlite:///x.db:\n  disk full")
    result = run("tune", *SHAPE)
    assert result.exit_code == 1
    assert error_line(result) == "Error: cannot open sqlite:///x.db: disk full"


def test_tune_table(jobs: Calls) -> None:
    result = run("tune", "--preset", "gemma2-9b")
    assert result.exit_code == 0, result.output
    lines = result.output.strip().splitlines()
    assert lines[0].split()[:3] == ["shape", "best", "BM,BN,w,s"]
    assert "stored best" in lines[0]
    first = lines[1]
    assert "B=32 Hq=16 Hkv=8 Nq=512 Nk=512 D=256 bf16 causal" in first
    for cell in ("128,64,4,3", "123.4", "82.3", "1.50x", "50", "3.2", "yes"):
        assert cell in first
    assert lines[2].rstrip().endswith("no") and " - " in lines[2]
    assert len(lines) == 1 + len(preset("gemma2-9b"))


# -- tune: interpreter mode -----------------------------------------------------------------


def test_interpret_flag_sets_env_before_jobs(jobs: Calls,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET")
    seen: list[str | None] = []
    fake = sys.modules["flashtune.autotune.jobs"]
    real_tune = fake.tune  # type: ignore[attr-defined]

    def tune(*a: Any, **k: Any) -> Any:
        import os

        seen.append(os.environ.get("TRITON_INTERPRET"))
        return real_tune(*a, **k)

    monkeypatch.setattr(fake, "tune", tune)
    result = run("tune", *SHAPE, "--interpret")
    assert result.exit_code == 0
    assert seen == ["1"] and jobs.calls[0]["options"].interpret is True
    assert "Triton interpreter" in result.output


def test_no_gpu_means_interpret(jobs: Calls, monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    import torch

    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    result = run("tune", *SHAPE)
    assert result.exit_code == 0
    assert jobs.calls[0]["options"].interpret is True
    assert os.environ.get("TRITON_INTERPRET") == "1"
    notice = [line for line in result.output.splitlines() if "Triton interpreter" in line]
    assert len(notice) == 1 and notice[0].startswith("no CUDA GPU found")


@pytest.mark.parametrize("args", [
    ["--preset", "llama3-8b"],
    ["--batch", "32", "--heads", "32", "--seqlen", "512", "--head-dim", "128"],
])
def test_shapes_too_big_for_the_interpreter_are_refused(jobs: Calls,
                                                        monkeypatch: pytest.MonkeyPatch,
                                                        args: list[str]) -> None:
    """As ``bench`` refuses its standard grid: hours of CPU for nothing."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    result = run("tune", *args)
    assert result.exit_code == 2
    line = error_line(result)
    assert "too big for the Triton interpreter" in line and "would take hours" in line
    assert "B=32 Hq=32" in line or "B=1 Hq=32 Hkv=8 Nq=16384" in line
    assert "CUDA GPU" in line and "--batch 1 --heads 2 --seqlen 64 --head-dim 32" in line
    assert not jobs.calls
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU: tuned
    assert run("tune", *args).exit_code == 0 and len(jobs.calls) == 1


def test_gpu_means_compiled(jobs: Calls, monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    monkeypatch.delenv("TRITON_INTERPRET")
    result = run("tune", *SHAPE)
    assert result.exit_code == 0
    assert jobs.calls[0]["options"].interpret is False
    assert "TRITON_INTERPRET" not in os.environ
    assert "interpreter" not in result.output


# -- show -----------------------------------------------------------------------------------

CPU = DeviceFingerprint(name="cpu-interpreter", compute_capability="cpu", sm_count=1,
                        shared_mem_per_block=1 << 20, total_memory=1 << 30)
H100 = DeviceFingerprint(name="NVIDIA_H100_80GB_HBM3", compute_capability="9.0", sm_count=132,
                         shared_mem_per_block=232448, total_memory=85520809984)
CFG = {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3}


def _add_best(store: Any, device: DeviceFingerprint, template: str,
              problem: AttentionProblem, ms: float, tflops: float | None,
              **versions: str) -> None:
    d = store.ensure_device(device)
    t = store.ensure_template(template, "0123456789abcdef")
    p = store.ensure_problem(template, problem.key(), problem.bucket())
    r = store.create_run(d.id, t.id, p.id, study_name="s", sampler="RandomSampler", seed=0,
                         **versions)
    trial = store.record_trial(r.id, CFG, TrialState.COMPLETE, median_ms=ms, tflops=tflops)
    assert store.offer_best(d.id, t.id, p.id, config=CFG, median_ms=ms, tflops=tflops,
                            trial_id=trial.id, trials_count=12)


@pytest.fixture
def populated(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path / 'tuned.db'}"
    with open_store(url) as store:
        _add_best(store, H100, "attn_fwd", AttentionProblem(4, 32, 8, 4096, 4096, 128, True,
                                                            "bf16"), 1.25, 440.5)
        _add_best(store, CPU, "attn_fwd", AttentionProblem(1, 2, 2, 64, 64, 16, False,
                                                           "fp16"), 80.0, None)
        _add_best(store, H100, "attn_bwd", AttentionProblem(1, 8, 8, 1024, 1024, 64, False,
                                                            "fp16"), 0.5, 100.0)
    return url


def test_show_table(populated: str) -> None:
    result = run("--db", populated, "show")
    assert result.exit_code == 0, result.output
    table, stale = result.output.split("stale, not served (3):\n")
    lines = table.strip().splitlines()
    assert lines[0].split() == ["device", "template", "shape", "config", "median", "ms",
                                "TFLOP/s", "trials", "tuned_at"]
    assert len(lines) == 4
    # the fixture's source hash is no template's: each entry is listed with its command
    assert len(stale.splitlines()) == 3 and "source 0123456789abcdef" in stale
    assert ("re-tune on that GPU: flashtune tune --template attn_fwd --batch 4 --heads 32 "
            "--kv-heads 8 --seqlen 4096 --head-dim 128 --causal --dtype bf16") in stale
    text = result.output
    assert "B=4 Hq=32 Hkv=8 Nq=4096 Nk=4096 D=128 bf16 causal" in text
    assert "128,64,8,3" in text and "1.2500" in text and "440.5" in text and "12" in text


def test_show_filters(populated: str) -> None:
    result = run("--db", populated, "show", "--device", "NVIDIA_H100_80GB_HBM3",
                 "--template", "attn_fwd")
    assert result.exit_code == 0
    assert len(result.output.split("stale, not served")[0].strip().splitlines()) == 2
    result = run("--db", populated, "show", "--device", "nope")
    assert result.exit_code == 0 and "no tuned configs" in result.output
    assert "device=nope" in result.output


def test_show_unknown_template_lists_the_known_ones(populated: str) -> None:
    result = run("--db", populated, "show", "--template", "bogus")
    assert result.exit_code == 2
    line = error_line(result)
    assert "'--template'" in line and "'bogus'" in line
    assert ("attn_bwd, attn_bwd_gluon, attn_decode, attn_fwd, attn_fwd_bwd_gluon, "
            "attn_fwd_gluon") in line


def test_show_json_round_trip(populated: str) -> None:
    result = run("--db", populated, "show", "--json")
    assert result.exit_code == 0
    rows = json.loads(result.output)
    with open_store(populated, read_only=True) as store:
        stored = store.list_best()
    assert len(rows) == len(stored) == 3
    for row, best in zip(rows, stored):
        assert row["device"] == best.device.name and row["template"] == best.template.name
        assert AttentionProblem.from_key(row["problem"]) == AttentionProblem.from_key(
            best.problem.key)
        assert row["config"] == best.config and row["median_ms"] == best.median_ms
        assert row["tflops"] == best.tflops and row["trials"] == best.trials_count
        assert row["tuned_at"] == best.tuned_at.isoformat()
    only = json.loads(run("--db", populated, "show", "--json", "--template", "attn_bwd").output)
    assert [r["template"] for r in only] == ["attn_bwd"]


def test_show_software(tmp_path: Path) -> None:
    """``--software`` adds what each config was tuned under (its run's versions, or the
    imported file's; '-' where unknown); ``--json`` always has it."""
    url = f"sqlite:///{tmp_path / 'tuned.db'}"
    problem = AttentionProblem(4, 32, 8, 4096, 4096, 128, True, "bf16")
    small = AttentionProblem(1, 2, 2, 64, 64, 16, False, "fp16")
    with open_store(url) as store:
        _add_best(store, H100, "attn_fwd", problem, 1.25, 440.5, flashtune_version="0.3.0",
                  torch_version="2.6.0+cu126", triton_version="3.2.0", cuda_version="12.6",
                  driver_version="560.35.03")
        store.import_best([ImportedBest(
            *H100.hardware_key(), template_name="attn_fwd", source_hash="0123456789abcdef",
            problem_key=small.key(), bucket=small.bucket(), config=CFG, median_ms=80.0,
            tflops=None, trials_count=3, tuned_at=datetime(2025, 1, 31, tzinfo=timezone.utc),
            software=SoftwareVersions(torch="2.5.1"))])
    plain = run("--db", url, "show")
    assert plain.exit_code == 0 and "triton" not in plain.output
    result = run("--db", url, "show", "--software")
    assert result.exit_code == 0, result.output
    header, *rows = result.output.split("stale, not served")[0].strip().splitlines()
    assert header.split()[-6:] == ["tuned_at", "flashtune", "torch", "triton", "cuda",
                                   "driver"]
    by_shape = {("D=128" in row): row.split() for row in rows}
    assert by_shape[True][-5:] == ["0.3.0", "2.6.0+cu126", "3.2.0", "12.6", "560.35.03"]
    assert by_shape[False][-5:] == ["-", "2.5.1", "-", "-", "-"]
    data = json.loads(run("--db", url, "show", "--json").output)
    assert {r["bucket"]: r["software"] for r in data} == {
        problem.bucket(): {"cuda": "12.6", "driver": "560.35.03", "flashtune": "0.3.0",
                           "torch": "2.6.0+cu126", "triton": "3.2.0"},
        small.bucket(): {"cuda": "", "driver": "", "flashtune": "", "torch": "2.5.1",
                         "triton": ""}}
    assert json.loads(run("--db", url, "show", "--json", "--software").output) == data


def test_show_missing_database(tmp_path: Path) -> None:
    path = tmp_path / "none.db"
    result = run("--db", f"sqlite:///{path}", "show")
    assert result.exit_code == 0
    assert result.output.strip().splitlines() == [
        f"no tuned configs (database {path} does not exist yet; run `flashtune tune` first)"]
    assert json.loads(run("--db", f"sqlite:///{path}", "show", "--json").output) == []
    assert not path.exists()


def test_show_store_error_is_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "junk.db"
    bad.write_bytes(b"this is not a database" * 100)
    result = run("--db", f"sqlite:///{bad}", "show")
    assert result.exit_code == 1
    error_line(result)


# -- the real pipeline ----------------------------------------------------------------------


def _real_jobs_available() -> bool:
    try:
        importlib.import_module("flashtune.autotune.jobs")
    except Exception:  # noqa: BLE001 - not written yet, or broken: skip
        return False
    return True


@pytest.mark.slow
def test_tune_end_to_end_interpreter(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if not _real_jobs_available():
        pytest.skip("flashtune.autotune.jobs cannot be imported")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    url = f"sqlite:///{tmp_path / 'e2e.db'}"
    result = run("--db", url, "tune", "--batch", "1", "--heads", "2", "--seqlen", "32",
                 "--head-dim", "16", "--dtype", "fp16", "--trials", "2", "--sampler", "random",
                 "--seed", "0", "--interpret", "--no-progress")
    assert result.exit_code == 0, result.output
    assert "B=1 Hq=2 Hkv=2 Nq=32 Nk=32 D=16 fp16" in result.output
    rows = json.loads(run("--db", url, "show", "--json").output)
    assert any(r["problem"]["seqlen_q"] == 32 for r in rows), result.output
    with open_store(url, read_only=True) as store:  # the best config keeps its run's software
        [tuned] = store.list_runs()
        assert {r["software"]["torch"] for r in rows} == {tuned.torch_version} != {""}
        assert {r["software"]["triton"] for r in rows} == {tuned.triton_version}


@pytest.mark.slow
def test_sigterm_interrupts_the_run_and_the_same_command_resumes(tmp_path: Path) -> None:
    """``kill <pid>`` (what ``timeout`` and batch schedulers send) during a real interpreter
    job: exit 143 with one line, the run INTERRUPTED, no trial left RUNNING; the same
    command then resumes the study without repeating a measured config."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from flashtune.db import RunStatus, TrialState, canonical_json, open_store

    if not _real_jobs_available():
        pytest.skip("flashtune.autotune.jobs cannot be imported")
    url = f"sqlite:///{tmp_path / 'term.db'}"
    cmd = [sys.executable, "-m", "flashtune", "--db", url, "tune", "--batch", "1", "--heads",
           "2", "--seqlen", "64", "--head-dim", "32", "--dtype", "fp16", "--trials", "40",
           "--sampler", "random", "--seed", "0", "--interpret", "--no-progress",
           "--no-isolate"]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.monotonic() + 240
    try:
        while time.monotonic() < deadline:  # wait until a trial is being measured
            time.sleep(0.5)
            if (tmp_path / "term.db").exists():
                try:
                    with open_store(url, read_only=True) as store:
                        if any(t.state is TrialState.RUNNING for t in store.list_trials()):
                            break
                except Exception:  # noqa: BLE001 - the schema is still being created
                    continue
        else:
            pytest.fail("the job never started a trial")
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert "terminated (SIGTERM)" in err and "Traceback" not in err, err[-2000:]
    with open_store(url, read_only=True) as store:
        [run] = store.list_runs()
        assert run.status is RunStatus.INTERRUPTED
        trials = store.list_trials()
        assert trials and not any(t.state is TrialState.RUNNING for t in trials)
        before = {canonical_json(t.config) for t in trials if t.state is TrialState.COMPLETE}
    resumed = subprocess.run([*cmd[:cmd.index("--trials") + 1], "2",
                              *cmd[cmd.index("--trials") + 2:]],
                             env=env, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    with open_store(url, read_only=True) as store:
        runs = store.list_runs()
        assert [r.status for r in runs] == [RunStatus.INTERRUPTED, RunStatus.COMPLETE]
        complete = [canonical_json(t.config) for t in store.list_trials()
                    if t.state is TrialState.COMPLETE]
    assert len(complete) == len(set(complete)), "a config was measured twice"
    assert before <= set(complete)


_SIGTERM_INSIDE_EXEC = '''
import os, signal, sys
import flashtune.autotune.jobs as jobs
from flashtune.cli.main import cli

def tune(*args, **kwargs):
    # the signal lands while Python runs code given to exec() as a string (what triton,
    # dataclasses, namedtuple do): the handler's exception passes out of that exec
    exec("os.kill(os.getpid(), signal.SIGTERM)\\nfor _ in range(10000):\\n    pass",
         {"os": os, "signal": signal})
    raise AssertionError("SIGTERM did not interrupt")

jobs.tune = tune
cli(prog_name="flashtune", args=sys.argv[1:])
'''


def test_sigterm_inside_an_exec_still_exits_143(tmp_path: Path) -> None:
    """CPython 3.11 (fixed in 3.14, gh-128130) remembers a plain ``KeyboardInterrupt`` that
    left an ``exec(str)`` and, under ``python -m``, ends the process with SIGINT even after
    the exception was caught and ``sys.exit(143)`` ran. CI saw a SIGTERM'd tune exit -2 that
    way; the handler's exception must not be exactly ``KeyboardInterrupt``."""
    import os
    import signal
    import subprocess
    import sys

    (tmp_path / "sigterm_in_exec.py").write_text(_SIGTERM_INSIDE_EXEC)
    url = f"sqlite:///{tmp_path / 'x.db'}"
    proc = subprocess.run([sys.executable, "-m", "sigterm_in_exec", "--db", url, "tune",
                           "--batch", "1", "--heads", "1", "--seqlen", "32", "--head-dim", "16",
                           "--interpret", "--no-progress"],
                          cwd=tmp_path, env={**os.environ, "TRITON_INTERPRET": "1",
                                             "PYTHONPATH": os.pathsep.join(sys.path)},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr[-2000:]
    assert "terminated (SIGTERM)" in proc.stderr and "Traceback" not in proc.stderr
