"""``flashtune db upgrade`` / ``flashtune db info`` through click's CliRunner."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import shutil
import sqlite3
import sqlite3.dbapi2
from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner

from flashtune.cli.db_commands import db
from flashtune.cli.main import cli
from flashtune.core.errors import StoreError
from flashtune.db import HEAD_REVISION, open_store, upgrade

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


def run_cli(*args: str, env: dict[str, str | None] | None = None) -> tuple[int, str]:
    """The real root command (``--db`` is its option, before the subcommand)."""
    result = CliRunner().invoke(cli, list(args), env=env)
    assert result.exception is None or isinstance(result.exception, SystemExit), \
        repr(result.exception)
    assert "Traceback" not in result.output
    return result.exit_code, result.output


def one_error_line(out: str) -> str:
    lines = [line for line in out.splitlines() if line.startswith("Error:")]
    assert len(lines) == 1, out
    return lines[0]


def digest(path: Path) -> tuple[str, list[str]]:
    return hashlib.sha256(path.read_bytes()).hexdigest(), sorted(os.listdir(path.parent))


# -- an older schema: db info shows it, every hint's command works ---------------------------


def test_info_shows_an_older_schema_and_how_to_upgrade_it(old_db: str) -> None:
    path = Path(old_db.removeprefix("sqlite:///"))
    before = digest(path)
    code, out = run_cli("--db", old_db, "db", "info")
    assert code == 0, out
    assert f"revision   0001 (this flashtune: {HEAD_REVISION})" in out
    assert f"upgrade it with `flashtune --db {old_db} db upgrade`" in out
    assert re.search(r"ft_trials +5", out)
    code, out = run_cli("--db", old_db, "db", "info", "--json")
    assert code == 0, out
    info = json.loads(out)
    assert (info["revision"], info["head"]) == ("0001", HEAD_REVISION)
    assert info["upgrade"] == f"flashtune --db {old_db} db upgrade"
    assert info["counts"]["ft_trials"] == 5 and info["read_only"] is True
    assert digest(path) == before  # nothing written, no -wal or -journal left


def _hinted_command(text: str) -> list[str]:
    match = re.search(r"`(flashtune [^`]+ db upgrade)`", text)
    assert match, text
    return shlex.split(match.group(1))


@pytest.mark.parametrize("name", ["old.db", "old db (copy).db"])
def test_the_upgrade_hint_is_a_command_that_works(tmp_path: Path, name: str) -> None:
    """Every message that says how to upgrade names a command line that runs: ``--db`` is
    the root command's option, and a path with spaces is quoted."""
    path = tmp_path / name
    shutil.copyfile(ASSET, path)
    url = f"sqlite:///{path}"
    code, out = run_cli("--db", url, "show")  # refused: the store needs the head schema
    assert code == 1
    argv = _hinted_command(one_error_line(out))
    assert argv[:3] == ["flashtune", "--db", url] and argv[3:] == ["db", "upgrade"]
    code, out = run_cli("--db", url, "db", "info")
    assert _hinted_command(out) == argv
    code, out = run_cli(*argv[1:])
    assert (code, out) == (0, f"upgraded {url} from schema revision 0001 to {HEAD_REVISION}\n")
    assert run_cli("--db", url, "show")[0] == 0


# -- sqlite files that cannot be used: say why ------------------------------------------------


def test_a_missing_database_file_is_named(tmp_path: Path) -> None:
    path = tmp_path / "missing.db"
    code, out = run_cli("--db", f"sqlite:///{path}", "db", "info")
    assert code == 1
    line = one_error_line(out)
    assert f"database {path} does not exist" in line and "unable to open" not in line
    assert not path.exists()
    with pytest.raises(StoreError, match=f"file {path} does not exist"):
        open_store(f"sqlite:///{path}", read_only=True, create=False)


def test_a_directory_is_not_a_database(tmp_path: Path) -> None:
    folder = tmp_path / "dir.db"
    folder.mkdir()
    for args in (["db", "info"], ["db", "upgrade"], ["show"]):
        code, out = run_cli("--db", f"sqlite:///{folder}", *args)
        assert code == 1, (args, out)
        line = one_error_line(out)
        assert f"{folder} is a directory, not a database file" in line, line


def test_a_missing_parent_folder_is_named(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'nodir' / 'a.db'}"
    code, out = run_cli("--db", url, "db", "upgrade")
    assert code == 1
    assert f"folder {tmp_path / 'nodir'} does not exist" in one_error_line(out)
    with pytest.raises(StoreError, match="folder .*nodir does not exist"):
        open_store(url)  # what tune and import open
    (tmp_path / "file").write_text("")
    with pytest.raises(StoreError, match=f"{tmp_path / 'file'} is not a folder"):
        open_store(f"sqlite:///{tmp_path / 'file' / 'a.db'}")
    assert not (tmp_path / "nodir").exists()


# -- a read-only database: one line saying so -------------------------------------------------


def open_sqlite_read_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """From now on every SQLite file opens as the driver opens a file it may not write (the
    tests run as root, whom file modes do not stop): reads work, and the first write, the
    switch to WAL, fails with "attempt to write a readonly database"."""
    real = sqlite3.dbapi2.connect

    def connect(database: Any, *args: Any, **kwargs: Any) -> Any:
        if not kwargs.get("uri") and str(database) not in ("", ":memory:"):
            database, kwargs["uri"] = f"file:{Path(database).resolve()}?mode=ro", True
        return real(database, *args, **kwargs)

    monkeypatch.setattr(sqlite3.dbapi2, "connect", connect)


def test_writing_to_a_read_only_database_is_one_line(tmp_path: Path, old_db: str,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    url = f"sqlite:///{tmp_path / 'head.db'}"
    upgrade(url)  # at head, journal mode not yet WAL (the store switches on first open)
    open_sqlite_read_only(monkeypatch)
    with pytest.raises(StoreError) as info:
        open_store(url)  # what tune and import open
    message = str(info.value)
    assert message.startswith(f"opening the store failed on database {url}: ")
    assert "is read-only" in message and "\n" not in message
    code, out = run_cli("--db", url, "tune", "--batch", "1", "--heads", "2", "--seqlen", "64",
                        "--head-dim", "32", "--dtype", "fp16", "--trials", "2", "--interpret",
                        "--no-progress")
    assert code == 1
    line = one_error_line(out)
    assert url in line and "is read-only" in line
    code, out = run_cli("--db", old_db, "db", "upgrade")  # a migration's write
    assert code == 1 and "is read-only" in one_error_line(out)
    assert run_cli("--db", url, "show")[0] == 0  # reading still works


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes to files whatever their mode")
def test_a_file_without_write_permission_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "ro.db"
    url = f"sqlite:///{path}"
    upgrade(url)
    path.chmod(0o444)
    with pytest.raises(StoreError, match=f"database file {path} is read-only"):
        open_store(url)


# -- the default database: reading creates nothing, writing says where to go ---------------


def test_reading_the_default_database_creates_nothing(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    env = {"FLASHTUNE_DB": None, "XDG_CACHE_HOME": str(cache)}
    default = cache / "flashtune" / "flashtune.db"
    code, out = run_cli("show", env=env)
    assert code == 0
    assert out == (f"no tuned configs (database {default} does not exist yet; run "
                   "`flashtune tune` first)\n")
    code, out = run_cli("export", "-o", str(tmp_path / "out"), env=env)
    assert code == 0 and "nothing to export" in out
    code, out = run_cli("db", "info", env=env)
    assert code == 1 and f"database {default} does not exist" in one_error_line(out)
    assert not cache.exists()


def test_a_default_folder_that_cannot_be_made_is_one_line(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    env = {"FLASHTUNE_DB": None, "XDG_CACHE_HOME": str(blocker)}
    code, out = run_cli("show", env=env)  # nothing tuned: nothing to create either
    assert code == 0 and "no tuned configs" in out
    assert run_cli("export", "-o", str(tmp_path / "out"), env=env)[0] == 0
    for args in (["db", "upgrade"], ["tune", "--batch", "1", "--heads", "2", "--seqlen", "64",
                                     "--head-dim", "32", "--dtype", "fp16", "--trials", "2",
                                     "--interpret", "--no-progress"]):
        code, out = run_cli(*args, env=env)
        assert code == 1, (args, out)
        line = one_error_line(out)
        assert f"cannot create the default database folder {blocker / 'flashtune'}" in line
        assert "--db" in line and "FLASHTUNE_DB" in line
