"""``flashtune tune --op``: the search across implementations from the command line, under
the interpreter (attn_fwd and torch's math SDPA are what a CPU machine can run)."""

from __future__ import annotations

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
    (["--op", "fwd", "--impl", "no_such"], "unknown template 'no_such'"),
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
