"""Engines: default location, SQLite pragmas, BEGIN IMMEDIATE, memory, read-only; JSON."""

from __future__ import annotations

import math
import sqlite3
from pathlib import Path

import pytest
from sqlalchemy import Engine, event, text
from sqlalchemy.exc import OperationalError

from flashtune.core.errors import StoreError
from flashtune.db.engine import (
    default_db_url,
    is_locked_error,
    lock_retry_delays,
    make_engine,
    safe_url,
    write_engine,
)
from flashtune.db.jsonutil import canonical_json, config_hash


def test_default_db_url_prefers_the_environment(monkeypatch: pytest.MonkeyPatch,
                                                tmp_path: Path) -> None:
    monkeypatch.setenv("FLASHTUNE_DB", "postgresql+psycopg://tuner@db/flashtune")
    assert default_db_url() == "postgresql+psycopg://tuner@db/flashtune"
    monkeypatch.delenv("FLASHTUNE_DB")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert default_db_url() == f"sqlite:///{tmp_path}/cache/flashtune/flashtune.db"
    assert (tmp_path / "cache" / "flashtune").is_dir()
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_db_url() == f"sqlite:///{tmp_path}/home/.cache/flashtune/flashtune.db"


def test_default_db_url_for_a_reader_creates_nothing(monkeypatch: pytest.MonkeyPatch,
                                                    tmp_path: Path) -> None:
    monkeypatch.delenv("FLASHTUNE_DB", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    url = default_db_url(create=False)
    assert url == f"sqlite:///{tmp_path}/cache/flashtune/flashtune.db"
    assert not (tmp_path / "cache").exists()


def test_default_db_url_that_cannot_be_created_says_where_to_go(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("FLASHTUNE_DB", raising=False)
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "file"))
    with pytest.raises(StoreError) as info:
        default_db_url()
    message = str(info.value)
    assert message.startswith(f"cannot create the default database folder "
                              f"{tmp_path / 'file' / 'flashtune'} (Not a directory)")
    assert "FLASHTUNE_DB" in message and "--db" in message
    assert default_db_url(create=False).endswith("/file/flashtune/flashtune.db")


def test_safe_url_hides_passwords_and_keeps_sqlite_paths_readable() -> None:
    assert safe_url("postgresql+psycopg://u:s3cret@h:5432/db") == "postgresql+psycopg://u:***@h:5432/db"
    assert safe_url("sqlite:///:memory:") == "sqlite:///:memory:"
    assert safe_url("sqlite:////tmp/a b.db") == "sqlite:////tmp/a b.db"


def pragma(engine: Engine, name: str) -> object:
    with engine.connect() as conn:
        return conn.exec_driver_sql(f"PRAGMA {name}").scalar()


def test_sqlite_file_engine_settings(tmp_path: Path) -> None:
    engine = make_engine(f"sqlite:///{tmp_path / 'e.db'}")
    try:
        assert pragma(engine, "journal_mode") == "wal"
        assert pragma(engine, "foreign_keys") == 1
        assert pragma(engine, "busy_timeout") == 30_000
    finally:
        engine.dispose()
    engine = make_engine(f"sqlite:///{tmp_path / 'f.db'}", wal=False)
    try:
        assert pragma(engine, "journal_mode") == "delete"  # left alone
    finally:
        engine.dispose()


def test_writes_begin_immediate_reads_begin_deferred(tmp_path: Path) -> None:
    engine = make_engine(f"sqlite:///{tmp_path / 'b.db'}")
    seen: list[str] = []
    event.listen(engine, "before_cursor_execute",
                 lambda conn, cur, stmt, *a: seen.append(stmt) if stmt.startswith("BEGIN") else None)
    try:
        with write_engine(engine).begin() as conn:
            conn.execute(text("CREATE TABLE t (x INTEGER)"))
        with engine.begin() as conn:
            conn.execute(text("SELECT count(*) FROM t"))
        assert seen == ["BEGIN IMMEDIATE", "BEGIN"]
        # the write lock is taken at BEGIN: a second writer waits, then gives up
        other = sqlite3.connect(tmp_path / "b.db", timeout=0.05, isolation_level=None)
        with write_engine(engine).begin():
            with pytest.raises(sqlite3.OperationalError, match="locked"):
                other.execute("BEGIN IMMEDIATE")
        other.close()
    finally:
        engine.dispose()


def test_memory_engine_is_one_shared_database() -> None:
    engine = make_engine("sqlite:///:memory:")
    try:
        with write_engine(engine).begin() as conn:
            conn.execute(text("CREATE TABLE t (x INTEGER)"))
            conn.execute(text("INSERT INTO t VALUES (1)"))
        with engine.connect() as conn:  # another checkout sees the same database
            assert conn.execute(text("SELECT x FROM t")).scalar() == 1
        assert pragma(engine, "journal_mode") == "memory"
    finally:
        engine.dispose()


def test_read_only_engine_never_writes(tmp_path: Path) -> None:
    path = tmp_path / "ro.db"
    con = sqlite3.connect(path)
    con.execute("CREATE TABLE t (x INTEGER)")
    con.commit()
    con.close()
    before = path.read_bytes()
    engine = make_engine(f"sqlite:///{path}", read_only=True)
    try:
        assert pragma(engine, "journal_mode") == "delete"  # no WAL switch
        with pytest.raises(OperationalError, match="readonly"):
            with write_engine(engine).begin() as conn:
                conn.execute(text("INSERT INTO t VALUES (1)"))
    finally:
        engine.dispose()
    assert path.read_bytes() == before


def test_locked_errors_are_recognised() -> None:
    locked = OperationalError("INSERT", {}, sqlite3.OperationalError("database is locked"))
    other = OperationalError("INSERT", {}, sqlite3.OperationalError("no such table: t"))
    assert is_locked_error(locked) and not is_locked_error(other)
    assert list(lock_retry_delays(4)) == [0.05, 0.1, 0.2, 0.4]


def test_canonical_json_and_config_hash() -> None:
    a = {"num_warps": 8, "BLOCK_M": 128, "nested": {"b": 1, "a": [1, 2.5]}}
    b = {"nested": {"a": [1, 2.5], "b": 1}, "BLOCK_M": 128, "num_warps": 8}
    assert canonical_json(a) == canonical_json(b) == \
        '{"BLOCK_M":128,"nested":{"a":[1,2.5],"b":1},"num_warps":8}'
    assert config_hash(a) == config_hash(b)
    assert len(config_hash(a)) == 16 and int(config_hash(a), 16) >= 0
    assert config_hash(a) != config_hash({**a, "num_warps": 4})
    for bad in (math.nan, math.inf, -math.inf):
        with pytest.raises(ValueError, match="canonical JSON"):
            config_hash({"x": bad})
    with pytest.raises(ValueError, match="canonical JSON"):
        canonical_json({"x": object()})
