"""``flashtune tune --op``: the search across implementations from the command line, under
the interpreter (attn_fwd and torch's math SDPA are what a CPU machine can run)."""

from __future__ import annotations

import re

import pytest
from click.testing import CliRunner

from flashtune.cli.main import cli
from flashtune.cli.tune_commands import OP_CHOICES
from flashtune.core.spec import USER_OPS
from flashtune.db import open_store

TINY = ["--batch", "1", "--heads", "2", "--seqlen", "48", "--head-dim", "32"]


def test_op_choices_are_the_user_ops():
    assert OP_CHOICES == USER_OPS


def _run(args, db):
    return CliRunner().invoke(cli, ["--db", f"sqlite:///{db}", *args], catch_exceptions=False)


def test_tune_op_searches_every_implementation_that_can_run_and_stores_the_winner(tmp_path):
    db = tmp_path / "t.db"
    res = _run(["tune", "--op", "fwd", *TINY, "--trials", "2", "--interpret", "--seed", "0",
                "--no-progress"], db)
    assert res.exit_code == 0, res.output
    out = res.output
    assert "implementation" in out and "over runner-up" in out
    for gpu_only in ("sdpa_cudnn", "attn_fwd_gluon"):
        assert f"{gpu_only} skipped: needs a CUDA GPU" in out
    with open_store(f"sqlite:///{db}") as store:
        (choice,) = store.list_choices(op="fwd")
    assert choice.implementation in ("attn_fwd", "sdpa_math")
    assert choice.implementation in out


@pytest.mark.parametrize("args, message", [
    (["--impl", "sdpa_math"], "--impl needs --op"),
    (["--op", "fwd", "--template", "attn_bwd"], "not both"),
    (["--op", "fwd", "--impl", "no_such"], "'no_such': not an implementation of op 'fwd'"),
    (["--op", "fwd", "--impl", "attn_fwd_gluon_bwd_gluon"], "Invalid value for '--impl'"),
    (["--op", "train", "--impl", "attn_bwd"], "not an implementation of op 'train'"),
    (["--op", "bwd"], "'bwd' is not one of"),
])
def test_tune_op_usage_errors(tmp_path, args, message):
    res = _run(["tune", *args, *TINY, "--interpret"], tmp_path / "u.db")
    assert res.exit_code == 2 and message in res.output, res.output


def test_a_forced_implementation_that_cannot_run_here_is_an_error_before_any_work(tmp_path):
    db = tmp_path / "f.db"
    res = _run(["tune", "--op", "fwd", "--impl", "sdpa_cudnn", *TINY, "--interpret"], db)
    assert res.exit_code == 1
    assert "--impl sdpa_cudnn cannot serve" in res.output and "needs a CUDA GPU" in res.output
    assert not db.exists()


PLAN = """op = "fwd"
[[shape]]
batch = 1
heads = 2
seqlen = 48
head_dim = 32

[[shape]]
batch = 1
heads = 2
seqlen = 40
head_dim = 16
causal = true
"""
QUICK = ["--trials", "1", "--interpret", "--seed", "0", "--no-progress"]


def _plan(tmp_path):
    path = tmp_path / "plan.toml"
    path.write_text(PLAN)
    return str(path)


def _choices(db):
    with open_store(f"sqlite:///{db}") as store:
        return store.list_choices(op="fwd")


def test_tune_op_on_two_gpu_slots_stores_every_shape_and_prints_one_table(tmp_path):
    db = tmp_path / "g.db"
    res = _run(["tune", "--op", "fwd", "--plan", _plan(tmp_path), "--gpus", "0,1", *QUICK], db)
    assert res.exit_code == 0, res.output
    assert "--gpus under the interpreter: 2 worker processes" in res.output
    assert "implementation" in res.output and "2 shapes: 2 tuned" in res.output
    table = res.output[res.output.index("implementation"):]
    assert "Nq=48" in table and "Nq=40" in table
    assert sorted(c.problem_key["seqlen_q"] for c in _choices(db)) == [40, 48]


@pytest.mark.parametrize("gpus, message", [
    ("a,b", "expected comma-separated GPU indices"),
    ("0,0", "must be distinct"),
    ("-1", "must be distinct and >= 0"),
])
def test_bad_gpus_with_op_are_refused_naming_the_option(tmp_path, gpus, message):
    res = _run(["tune", "--op", "fwd", *TINY, "--gpus", gpus, "--interpret"], tmp_path / "b.db")
    assert res.exit_code == 2 and "'--gpus'" in res.output and message in res.output, \
        res.output


@pytest.mark.parametrize("args, message", [
    (["--skip-tuned"], "--skip-tuned goes with --op"),
    (["--stop-after", "60"], "--stop-after goes with --op"),
    (["--op", "fwd", "--stop-after", "60"], "--stop-after needs --skip-tuned"),
    (["--op", "fwd", "--skip-tuned", "--stop-after", "0"], "Invalid value for '--stop-after'"),
])
def test_resume_options_usage_errors(tmp_path, args, message):
    res = _run(["tune", *args, *TINY, "--interpret"], tmp_path / "u.db")
    assert res.exit_code == 2 and message in res.output, res.output


def _restamp_attn_fwd(db):
    """The stored choice of the D32 shape, as if attn_fwd had been timed at another source."""
    with open_store(f"sqlite:///{db}") as store:
        (c,) = [c for c in store.list_choices(op="fwd") if c.problem_key["head_dim"] == 32]
        store.put_choice(c.device.id, "fwd", c.problem_key, implementation=c.implementation,
                         source_hash=c.source_hash, config=c.config, median_ms=c.median_ms,
                         tflops=c.tflops, runner_up=c.runner_up, runner_up_ms=c.runner_up_ms,
                         extern=c.extern, extern_ms=c.extern_ms,
                         candidates=[dict(x, source_hash="0" * 16)
                                     if x["implementation"] == "attn_fwd" else x
                                     for x in c.candidates])


def test_skip_tuned_goes_on_with_a_plan_and_tunes_a_stale_choice_again(tmp_path):
    db, plan = tmp_path / "s.db", _plan(tmp_path)
    # an earlier command finished the first shape only
    assert _run(["tune", "--op", "fwd", *TINY, *QUICK], db).exit_code == 0
    res = _run(["tune", "--op", "fwd", "--plan", plan, "--skip-tuned", *QUICK], db)
    assert res.exit_code == 0, res.output
    assert "Nq=48 Nk=48 D=32 bf16: already tuned on this device: not tuned again" in res.output
    assert re.search(r"2 shapes: 1 tuned \(\d+ s, \d+ s a shape, the longest \d+ s\), "
                     r"1 already tuned \(skipped\)", res.output), res.output
    assert len(_choices(db)) == 2

    _restamp_attn_fwd(db)
    res = _run(["tune", "--op", "fwd", "--plan", plan, "--skip-tuned", *QUICK], db)
    assert res.exit_code == 0, res.output
    assert "D=32 bf16: the stored choice was stale (attn_fwd's source changed " \
           "(0000000000000000 -> " in res.output
    assert "D=16 bf16 causal: already tuned on this device" in res.output
    assert re.search(r"2 shapes: 1 tuned \(.*\), 1 already tuned \(skipped\)", res.output)


def test_a_table_tuned_elsewhere_resumes_from_its_exported_file(tmp_path):
    """An op file carries each choice's candidates (schema version 2), so a database that
    imports it can tell its choices are current: ``--skip-tuned`` goes on from the file
    where the first machine's database is gone, and tunes only what the file lacks."""
    first, plan = tmp_path / "first.db", _plan(tmp_path)
    assert _run(["tune", "--op", "fwd", *TINY, *QUICK], first).exit_code == 0
    out = tmp_path / "export"
    res = _run(["export", "-o", str(out), "--op", "fwd"], first)
    assert res.exit_code == 0, res.output
    (exported,) = out.glob("*op=fwd.json")
    assert '"candidates"' in exported.read_text()
    second = tmp_path / "second.db"
    res = _run(["import", str(exported)], second)
    assert res.exit_code == 0 and "1 added" in res.output, res.output
    (imported,) = _choices(second)
    assert len(imported.candidates) == len(_choices(first)[0].candidates) >= 2
    res = _run(["tune", "--op", "fwd", "--plan", plan, "--skip-tuned", *QUICK], second)
    assert res.exit_code == 0, res.output
    assert "Nq=48 Nk=48 D=32 bf16: already tuned on this device: not tuned again" in res.output
    assert re.search(r"2 shapes: 1 tuned \(.*\), 1 already tuned \(skipped\)", res.output)


def test_stop_after_starts_no_shape_past_its_time_once_one_is_tuned(tmp_path):
    db = tmp_path / "t.db"
    res = _run(["tune", "--op", "fwd", "--plan", _plan(tmp_path), "--skip-tuned",
                "--stop-after", "0.001", *QUICK], db)
    assert res.exit_code == 0, res.output
    # the first shape is tuned however short the time: every command makes progress
    assert re.search(r"2 shapes: 1 tuned \(.*\), 1 not done", res.output), res.output
    assert "--stop-after 0.001: 1 shape(s) not started; run the same command again" \
        in res.output
    assert len(_choices(db)) == 1


def test_a_lost_worker_is_reported_after_the_table_of_what_the_others_finished(tmp_path,
                                                                              monkeypatch):
    from flashtune.autotune import workers
    from flashtune.autotune.select import Leader, OpResult
    from flashtune.core.problem import AttentionProblem

    done = OpResult(AttentionProblem(1, 2, 2, 48, 48, 32, False, "bf16"), "fwd", "cpu",
                    (Leader("sdpa_math", "extern", {}, 2.0, 0.001),), (), ())

    def lose_one(problems, *args, **kwargs):
        raise workers.WorkerError("worker on GPU 1 died (exit code 3) while tuning "
                                  f"{problems[1].describe()}. Run the same command again "
                                  "(with --skip-tuned) to finish.", [done])

    monkeypatch.setattr(workers, "tune_op_on_gpus", lose_one)
    res = _run(["tune", "--op", "fwd", "--plan", _plan(tmp_path), "--gpus", "0,1", *QUICK],
               tmp_path / "l.db")
    assert res.exit_code == 1
    assert "sdpa_math" in res.output
    assert re.search(r"2 shapes: 1 tuned \(.*\), 1 not done", res.output), res.output
    assert "worker on GPU 1 died (exit code 3) while tuning B=1 Hq=2 Hkv=2 Nq=40" in res.output
    assert "--skip-tuned" in res.output


def test_the_gluon_training_pair_can_be_named_by_impl(tmp_path):
    """``--impl attn_fwd_gluon_bwd_gluon`` (registered by the Gluon backward's folder, not
    a folder of its own) names a train implementation; on a CPU it is skipped with the
    reason, as any GPU-only one."""
    res = _run(["tune", "--op", "train", "--impl", "attn_fwd_gluon_bwd_gluon", *TINY,
                "--interpret"], tmp_path / "g.db")
    assert "Invalid value" not in res.output, res.output
    assert "attn_fwd_gluon_bwd_gluon" in res.output and "needs a CUDA GPU" in res.output, \
        res.output
