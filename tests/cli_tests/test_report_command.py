"""``flashtune report`` through click's CliRunner, on databases built with the store API and
on one filled by a tiny tuning run under the Triton interpreter."""

from __future__ import annotations

import re
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from flashtune.cli.main import cli
from flashtune.core.device import DeviceFingerprint
from flashtune.core.problem import AttentionProblem
from flashtune.db import open_store
from flashtune.db.records import ImportedBest
from flashtune.kernel_templates import get_template
from flashtune.report.studies import collect_studies, param_importances
from tests.db_tests.support import A100, H100

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SPEC = get_template("attn_fwd")
P_BIG = AttentionProblem(2, 16, 4, 2048, 2048, 128, True, "bf16")
P_SMALL = AttentionProblem(1, 8, 8, 512, 512, 64, False, "fp16")
P_A100 = AttentionProblem(1, 8, 8, 1024, 1024, 64, True, "bf16")
P_IMPORTED = AttentionProblem(4, 32, 8, 4096, 4096, 128, True, "bf16")
GRID = [{"BLOCK_M": m, "BLOCK_N": n, "num_warps": w, "num_stages": s, "USE_TMA": 0,
         "REVERSE_M": 0}
        for m, n, w, s in [(64, 32, 4, 2), (64, 64, 4, 3), (128, 32, 8, 2), (128, 64, 8, 3),
                           (128, 128, 8, 2), (64, 128, 4, 4), (32, 64, 4, 3)]]


@pytest.fixture
def mpl() -> None:
    pytest.importorskip("matplotlib")


def invoke(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, list(args))
    assert result.exception is None or isinstance(result.exception, SystemExit), \
        result.exception
    assert "Traceback" not in result.output
    return result.exit_code, result.output


def _study(store: Any, device: DeviceFingerprint, problem: AttentionProblem,
           trials: list[tuple[dict[str, int], str, float | None]], *, tflops: bool = True,
           best: bool = True) -> None:
    """One run of ``trials`` ((config, state, ms) in order); the fastest offered as best."""
    d = store.ensure_device(device)
    t = store.ensure_template("attn_fwd", SPEC.source_hash)
    p = store.ensure_problem("attn_fwd", problem.key(), problem.bucket())
    run = store.create_run(d.id, t.id, p.id, study_name=f"study-{problem.bucket()}",
                           sampler="tpe")
    done = []
    for cfg, state, ms in trials:
        tf = 100.0 / ms if tflops and ms is not None else None
        rec = store.record_trial(run.id, cfg, state, median_ms=ms, tflops=tf,
                                 message=None if state == "COMPLETE" else f"{state} here")
        if ms is not None:
            done.append((ms, tf, cfg, rec.id))
    if best and done:
        ms, tf, cfg, trial_id = min(done, key=lambda x: x[0])
        store.offer_best(d.id, t.id, p.id, config=cfg, median_ms=ms, tflops=tf,
                         trial_id=trial_id, trials_count=len(trials))


@pytest.fixture
def db(tmp_path: Path) -> str:
    """H100: a study with 8 completed trials (the default first) and failures, one with 2;
    A100: one without TFLOP/s; and an imported best config with no trials."""
    url = f"sqlite:///{tmp_path / 'tuned.db'}"
    default = SPEC.default_config(P_BIG, H100)
    with open_store(url) as store:
        _study(store, H100, P_BIG, [(default, "COMPLETE", 1.0), (GRID[0], "COMPILE_ERROR", None),
                                    (GRID[1], "PRUNED_STATIC", None)]
               + [(cfg, "COMPLETE", 0.6 + 0.1 * i) for i, cfg in enumerate(GRID[2:])]
               + [(GRID[0] | {"num_stages": 5}, "OUT_OF_RESOURCES", None),
                  (GRID[1] | {"BLOCK_M": 16}, "COMPLETE", 2.5)])
        _study(store, H100, P_SMALL, [(GRID[0], "COMPLETE", 0.2), (GRID[1], "COMPLETE", 0.3)])
        _study(store, A100, P_A100, [(GRID[i], "COMPLETE", 0.5 + i) for i in range(3)],
               tflops=False)
        store.import_best([ImportedBest(*H100.hardware_key(), template_name="attn_fwd",
                                        source_hash=SPEC.source_hash,
                                        problem_key=P_IMPORTED.key(),
                                        bucket=P_IMPORTED.bucket(), config=GRID[3],
                                        median_ms=1.5, tflops=300.0, trials_count=40,
                                        tuned_at=datetime(2025, 1, 31, tzinfo=timezone.utc))])
    return url


def _check_folder(out: Path, output: str) -> tuple[str, set[str]]:
    """Every line names a written file; every PNG is one and the page references it."""
    written = [Path(line.split()[1]) for line in output.splitlines()]
    assert all(line.startswith("wrote ") for line in output.splitlines())
    assert written[-1] == out / "index.html"
    pngs = {p.name for p in out.glob("*.png")}
    assert {p.name for p in written[:-1]} == pngs
    for name in pngs:
        assert (out / name).read_bytes()[:8] == PNG_MAGIC, name
    page = (out / "index.html").read_text(encoding="utf-8")
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    assert set(re.findall(r'<img src="([^"]+)"', page)) == pngs
    return page, pngs


def test_report_writes_plots_and_page(mpl: None, db: str, tmp_path: Path) -> None:
    out = tmp_path / "report" / "here"  # created, parents too
    code, output = invoke("--db", db, "report", "-o", str(out))
    assert code == 0, output
    assert output.splitlines()[-1] == f"wrote {out / 'index.html'} (4 studies, 7 plots)"
    page, pngs = _check_folder(out, output)
    assert len([n for n in pngs if n.endswith("-history.png")]) == 4
    assert len([n for n in pngs if n.endswith("-importance.png")]) == 1  # only P_BIG's
    assert {"summary-tflops.png", "summary-ms.png"} <= pngs
    assert "parameter importances skipped: 2 completed trials; parameter importances need " \
           "at least 5" in page
    assert "imported best config: no trials in this database" in page
    assert P_BIG.describe() in page and A100.name in page
    assert "Optuna study: <code>study-" in page
    # tuned vs default: P_BIG's best is 0.6 ms against the default's 1.0 ms
    assert '<td class="num">1.67x</td>' in page


def test_report_filters(mpl: None, db: str, tmp_path: Path) -> None:
    out = tmp_path / "a100"
    code, output = invoke("--db", db, "report", "--device", A100.name, "-o", str(out))
    assert code == 0, output
    page, pngs = _check_folder(out, output)
    assert len(pngs) == 2 and "summary-ms.png" in pngs and "(filtered: device=" in page
    code, output = invoke("--db", db, "report", "--template", "attn_bwd", "-o",
                          str(tmp_path / "none"))
    assert (code, output) == (0, f"nothing to report: no trials or best configs in {db} "
                                 "matching template=attn_bwd\n")
    assert not (tmp_path / "none").exists()


def test_report_unknown_template_lists_the_known_ones(db: str, tmp_path: Path) -> None:
    code, output = invoke("--db", db, "report", "--template", "bogus", "-o",
                          str(tmp_path / "out"))
    assert code == 2
    [line] = [ln for ln in output.splitlines() if ln.startswith("Error:")]
    assert "'--template'" in line and "'bogus'" in line
    assert ("attn_bwd, attn_bwd_gluon, attn_decode, attn_fwd, attn_fwd_bwd_gluon, "
            "attn_fwd_gluon") in line
    assert not (tmp_path / "out").exists()


def test_report_empty_and_missing_database(mpl: None, tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'empty.db'}"
    open_store(url).close()
    code, output = invoke("--db", url, "report", "-o", str(tmp_path / "out"))
    assert (code, output) == (0, f"nothing to report: no trials or best configs in {url}\n")
    missing = tmp_path / "missing.db"
    code, output = invoke("--db", f"sqlite:///{missing}", "report", "-o", str(tmp_path / "o"))
    assert (code, output) == (0, f"nothing to report (database {missing} does not exist yet; "
                                 "run `flashtune tune` first)\n")
    assert not missing.exists() and not (tmp_path / "out").exists()


def test_report_without_matplotlib_says_how_to_install(db: str, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    code, output = invoke("--db", db, "report", "-o", str(tmp_path / "out"))
    assert code == 1 and output.count("\n") == 1
    assert output.startswith("Error: flashtune report needs matplotlib")
    assert "pip install matplotlib" in output and not (tmp_path / "out").exists()


def test_importances_need_trials_and_variation(db: str) -> None:
    with open_store(db, read_only=True) as store:
        studies = {s.problem.key_json: s for s in collect_studies(store)}
    big = next(s for s in studies.values() if s.problem.key == P_BIG.key())
    assert big.default_trial is not None and big.default_trial.number == 0
    assert len(big.complete) == 7 and len(big.failed) == 3
    result = param_importances(big)
    assert result.note is None and abs(sum(result.values.values()) - 1) < 1e-6
    assert "USE_TMA" in result.values  # the default has USE_TMA=1, the others 0
    note = param_importances(big, min_trials=8).note
    assert note == "7 completed trials; parameter importances need at least 8"


def test_importances_of_constant_parameters(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'flat.db'}"
    with open_store(url) as store:
        _study(store, H100, P_SMALL, [(GRID[0], "COMPLETE", 1.0 + i) for i in range(6)])
        [study] = collect_studies(store)
    note = param_importances(study).note
    assert note == "every parameter has one distinct value in the completed trials; nothing to rank"


def test_report_of_an_interpreter_tuning_run(mpl: None, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from flashtune.autotune import runners

    monkeypatch.setattr(runners, "INTERPRETER_REPS", 1)
    url = f"sqlite:///{tmp_path / 'tuned.db'}"
    code, output = invoke("--db", url, "tune", "--batch", "1", "--heads", "2", "--seqlen", "32",
                          "--head-dim", "16", "--dtype", "fp16", "--trials", "6", "--sampler",
                          "random", "--seed", "0", "--interpret", "--no-progress")
    assert code == 0, output
    out = tmp_path / "report"
    code, output = invoke("--db", url, "report", "-o", str(out))
    assert code == 0, output
    page, pngs = _check_folder(out, output)
    assert any(n.endswith("-history.png") for n in pngs) and "summary-tflops.png" in pngs
    assert "cpu-interpreter" in page and "B=1 Hq=2 Hkv=2 Nq=32 Nk=32 D=16 fp16" in page
