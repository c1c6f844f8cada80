"""``flashtune db verify`` under the Triton interpreter (timings meaningless, pipeline real):
stale entries and other software are reported with their re-tune command, a sample is
checked and re-timed through the tuner's runner, a slower one is reported."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from flashtune.cli.db_commands import VERIFY_SOURCES
from flashtune.cli.main import cli
from flashtune.core.device import interpreter_device
from flashtune.core.problem import AttentionProblem
from flashtune.db import TrialState, open_store
from flashtune.kernel_templates import get_template
from flashtune.runtime import sources, verify

SPEC = get_template("attn_fwd")
CPU = interpreter_device()
FAST = AttentionProblem(1, 2, 2, 64, 64, 32, True, "fp16")      # recorded 1e-6 ms: slower
SLOW = AttentionProblem(1, 2, 2, 32, 32, 32, False, "fp16")     # recorded 1e6 ms: ok
GONE = AttentionProblem(2, 2, 2, 16, 16, 16, False, "fp16")     # an old source only: stale
TORCH = AttentionProblem(1, 2, 1, 16, 48, 16, False, "fp16")    # tuned under another torch


def _add(store: Any, problem: AttentionProblem, ms: float, source_hash: str = SPEC.source_hash,
         torch: str = CPU.torch_version) -> None:
    d = store.ensure_device(CPU)
    t = store.ensure_template("attn_fwd", source_hash)
    p = store.ensure_problem("attn_fwd", problem.key(), problem.bucket())
    r = store.create_run(d.id, t.id, p.id, study_name="s", sampler="RandomSampler", seed=0,
                         torch_version=torch, triton_version=CPU.triton_version)
    config = dict(SPEC.default_config(problem, CPU))
    trial = store.record_trial(r.id, config, TrialState.COMPLETE, median_ms=ms, tflops=1.0)
    assert store.offer_best(d.id, t.id, p.id, config=config, median_ms=ms, tflops=1.0,
                            trial_id=trial.id, trials_count=3)


@pytest.fixture
def db(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    url = f"sqlite:///{tmp_path / 'tuned.db'}"
    with open_store(url) as store:
        _add(store, FAST, 1e-6)
        _add(store, SLOW, 1e6)
        _add(store, GONE, 1.0, source_hash="0123456789abcdef")
        _add(store, SLOW, 2.0, source_hash="fedcba9876543210")  # replaced: history
        _add(store, TORCH, 1e6, torch="1.0.0")
    empty = tmp_path / "package"
    empty.mkdir()
    monkeypatch.setattr(sources, "source_dirs", lambda: [("package", empty)])
    return url


def run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, list(args))
    assert result.exception is None or isinstance(result.exception, SystemExit), \
        repr(result.exception)
    return result.exit_code, result.output


def test_sources_spelled_out_for_help_agree() -> None:
    assert VERIFY_SOURCES == verify.SOURCES


def test_without_a_gpu_it_says_so_and_stops(db: str) -> None:
    code, out = run("--db", db, "db", "verify")
    assert code == 2 and "no CUDA GPU found" in out and "--interpret" in out


def test_db_entries_reported_with_their_commands(db: str) -> None:
    code, out = run("--db", db, "db", "verify", "--interpret", "--source", "db", "--sample",
                    "0", "--rounds", "1", "--json")
    assert code == 1, out
    report = json.loads(out[out.index("{"):])
    by = {AttentionProblem.from_key(e["problem"]): e for e in report["entries"]}
    assert set(by) == {FAST, SLOW, GONE, TORCH}  # the replaced old source is left out
    assert by[FAST]["status"] == "slower" and by[FAST]["measured_ms"] > 0
    assert by[FAST]["drift"] < 1e-3 and "slower than recorded" in by[FAST]["message"]
    assert by[SLOW]["status"] == "ok" and not by[SLOW]["reported"]
    assert by[GONE]["status"] == "stale" and by[GONE]["measured_ms"] is None
    assert "0123456789abcdef" in by[GONE]["message"] and SPEC.source_hash in by[GONE]["message"]
    assert by[TORCH]["status"] == "ok" and by[TORCH]["reported"]
    assert by[TORCH]["software_changed"] == [f"torch 1.0.0 -> {CPU.torch_version}"]
    assert by[GONE]["command"] == ("flashtune tune --template attn_fwd --batch 2 --heads 2 "
                                   "--seqlen 16 --head-dim 16 --dtype fp16")
    assert by[TORCH]["command"].endswith("--kv-heads 1 --seqlen 16 --kv-seqlen 48 "
                                         "--head-dim 16 --dtype fp16")
    assert report["timed"] == 3 and report["reported"] == 3
    # the text lists what to re-tune, each with its command
    code, text = run("--db", db, "db", "verify", "--interpret", "--source", "db", "--sample",
                     "0", "--rounds", "1")
    assert code == 1 and "3 entries to re-tune:" in text
    assert by[GONE]["command"] in text and by[FAST]["command"] in text
    assert "timings mean nothing" in text


def test_a_sample_is_drawn_and_a_wide_tolerance_reports_no_slowdown(db: str) -> None:
    code, out = run("--db", db, "db", "verify", "--interpret", "--source", "db", "--sample",
                    "1", "--rounds", "1", "--tolerance", "9.9", "--json", "--seed", "3")
    report = json.loads(out[out.index("{"):])
    timed = [e for e in report["entries"] if e["measured_ms"] is not None]
    assert len(timed) == 1
    statuses = sorted(e["status"] for e in report["entries"])
    assert statuses.count("not sampled") == 2 and statuses.count("stale") == 1


def test_bad_arguments_name_the_option(db: str) -> None:
    for args, name in ((["--sample", "-1"], "--sample"), (["--tolerance", "-0.1"], "--tolerance"),
                       (["--source", "cloud"], "--source"), (["--rounds", "0"], "--rounds")):
        code, out = run("--db", db, "db", "verify", "--interpret", *args)
        assert code == 2 and f"'{name}'" in out, out


def test_shipped_tables_current_timed_stale_reported(db: str, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A current exported file of this device in $FLASHTUNE_CONFIG_DIR is re-timed; a stale
    one in the package folder is reported as a file, with the plan that re-tunes it."""
    folder, package = tmp_path / "dir", tmp_path / "pkg"
    code, out = run("--db", db, "export", "-o", str(folder))
    assert code == 0, out
    (path,) = folder.glob("*.json")
    package.mkdir()
    stale = json.loads(path.read_text())
    stale["template"]["source_hash"] = "0123456789abcdef"
    (package / path.name).write_text(json.dumps(stale))
    monkeypatch.setattr(sources, "source_dirs", lambda: [("dir", folder), ("package", package)])
    code, out = run("--db", db, "db", "verify", "--interpret", "--source", "shipped",
                    "--sample", "0", "--rounds", "1", "--json")
    assert code == 1
    report = json.loads(out[out.index("{"):])
    assert {e["origin"] for e in report["entries"]} == {f"dir {path}"}
    assert {AttentionProblem.from_key(e["problem"]) for e in report["entries"]} == \
        {FAST, SLOW, TORCH}
    (table,) = report["stale_tables"]
    assert table["path"] == str(package / path.name) and table["stale"] == 3
    assert "flashtune tune --template attn_fwd --plan shipped-fwd" in table["command"]
    assert f"flashtune export -o {package} --device {CPU.name} --template attn_fwd" \
        in table["command"]
    shutil.rmtree(package)
    package.mkdir()
    code, out = run("--db", db, "db", "verify", "--interpret", "--source", "shipped",
                    "--sample", "0", "--rounds", "1", "--tolerance", "9.9")
    assert code == 1 and "stale" not in out  # the other torch entry is still reported
    assert "torch 1.0.0" in out


def test_show_and_db_info_list_stale_entries_and_tables(db: str, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    folder, package = tmp_path / "dir", tmp_path / "pkg"
    assert run("--db", db, "export", "-o", str(folder))[0] == 0
    (path,) = folder.glob("*.json")
    package.mkdir()
    stale = json.loads(path.read_text())
    stale["template"]["source_hash"] = "0123456789abcdef"
    (package / path.name).write_text(json.dumps(stale))
    monkeypatch.setattr(sources, "source_dirs", lambda: [("package", package)])
    code, out = run("--db", db, "show")
    assert code == 0
    listed = out.split("stale, not served (2):\n")[1].splitlines()
    assert listed[0].startswith(f"  {CPU.name} attn_fwd {GONE.describe()}: tuned for attn_fwd "
                                "source 0123456789abcdef")
    assert listed[0].endswith("flashtune tune --template attn_fwd --batch 2 --heads 2 "
                              "--seqlen 16 --head-dim 16 --dtype fp16")
    assert listed[1].startswith(f"  package {path.name} is stale: all 3 attn_fwd configs")
    rows = json.loads(run("--db", db, "show", "--json")[1])
    assert sorted(r["stale"] is None for r in rows) == [False, True, True, True, True]
    code, out = run("--db", db, "db", "info", "--json")
    info = json.loads(out)
    assert code == 0 and info["stale_entries"] == 1
    assert [t["path"] for t in info["stale_tables"]] == [str(package / path.name)]
    text = run("--db", db, "db", "info")[1]
    assert "stale      1 stored entries" in text and f"stale      package {path.name}" in text
