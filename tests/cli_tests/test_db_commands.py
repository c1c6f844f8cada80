"""``flashtune db upgrade`` / ``flashtune db info`` through click's CliRunner."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from flashtune.cli.db_commands import db
from flashtune.db import HEAD_REVISION, open_store

ASSET = Path(__file__).resolve().parents[1] / "db_tests" / "assets" / "flashtune_0001.db"


@click.group()
@click.option("--db", "db_url", default=None)
@click.pass_context
def root(ctx: click.Context, db_url: str | None) -> None:
    """Stands in for flashtune.cli.main's group, which keeps --db in ctx.obj."""
    ctx.obj = {"db_url": db_url}


root.add_command(db)


def invoke(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(root, list(args))
    assert result.exception is None or isinstance(result.exception, SystemExit), \
        result.exception
    return result.exit_code, result.output


@pytest.fixture
def old_db(tmp_path: Path) -> str:
    path = tmp_path / "old.db"
    shutil.copyfile(ASSET, path)
    return f"sqlite:///{path}"


def test_upgrade_brings_the_0001_database_to_head(old_db: str) -> None:
    code, out = invoke("--db", old_db, "db", "info")
    assert code == 1
    assert out.startswith("Error: database ") and "flashtune db upgrade --db" in out
    assert out.count("\n") == 1  # one line, no traceback

    code, out = invoke("--db", old_db, "db", "upgrade")
    assert code == 0, out
    assert out == f"upgraded {old_db} from schema revision 0001 to {HEAD_REVISION}\n"
    code, out = invoke("--db", old_db, "db", "upgrade")
    assert (code, out) == (0, f"{old_db} is already at schema revision {HEAD_REVISION}\n")


def test_upgrade_creates_an_empty_database(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'new.db'}"
    code, out = invoke("--db", url, "db", "upgrade")
    assert (code, out) == (0, f"created the flashtune schema (revision {HEAD_REVISION}) in {url}\n")


def test_info_shows_counts_as_text_and_json(old_db: str) -> None:
    invoke("--db", old_db, "db", "upgrade")
    code, out = invoke("--db", old_db, "db", "info")
    assert code == 0, out
    assert f"revision   {HEAD_REVISION} (this flashtune: {HEAD_REVISION})" in out
    assert "ft_trials" in out and old_db in out
    code, out = invoke("--db", old_db, "db", "info", "--json")
    assert code == 0, out
    info = json.loads(out)
    assert info["counts"]["ft_trials"] == 5 and info["read_only"] is True
    assert info["revision"] == HEAD_REVISION


def test_info_uses_the_default_database(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    url = f"sqlite:///{tmp_path / 'env.db'}"
    monkeypatch.setenv("FLASHTUNE_DB", url)
    open_store(url).close()
    code, out = invoke("db", "info", "--json")
    assert code == 0 and json.loads(out)["url"] == url


def test_errors_are_one_line_with_the_password_hidden(tmp_path: Path) -> None:
    bad = tmp_path / "bad.db"
    bad.write_bytes(b"not a database" * 100)
    code, out = invoke("--db", f"sqlite:///{bad}", "db", "upgrade")
    assert code == 1 and out.count("\n") == 1 and "file is not a database" in out
    code, out = invoke("--db", "postgresql+psycopg://u:hunter2@127.0.0.1:1/x", "db", "info")
    assert code == 1 and out.count("\n") == 1
    assert "hunter2" not in out and "u:***@127.0.0.1:1/x" in out
