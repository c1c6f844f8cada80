"""Engines for the tuning database: where it lives and how SQLite is made safe to share.

Any SQLAlchemy URL works (``postgresql+psycopg://user:pw@host/db``...). For SQLite,
:func:`make_engine` sets up what several tuning processes on one file need:

* ``busy_timeout`` (30 s) and ``foreign_keys=ON`` on every connection;
* WAL journal mode for files (readers never block the writer), not for ``:memory:``;
* SQLAlchemy emits ``BEGIN`` itself (the pysqlite recipe in SQLAlchemy's SQLite docs):
  the driver's own implicit ``BEGIN`` is switched off and a ``begin`` event issues
  ``BEGIN IMMEDIATE`` on connections flagged for writing (``write_engine(engine)``) and a
  plain deferred ``BEGIN`` otherwise, so a write transaction takes the write lock before
  it reads what it will update (no lost updates, no lock upgrade deadlocks);
* ``:memory:`` databases use a ``StaticPool``: every session shares the one database;
* ``read_only=True`` opens the file as ``file:...?mode=ro`` (SQLite itself refuses writes;
  nothing, not even the WAL switch, is written).

"database is locked" can still surface (a writer holding the lock past the timeout);
:func:`is_locked_error` and :func:`lock_retry_delays` let callers retry with backoff.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError, OperationalError
from sqlalchemy.pool import StaticPool

from flashtune.core.errors import StoreError

__all__ = [
    "default_db_url",
    "enable_wal",
    "is_locked_error",
    "is_memory_sqlite",
    "lock_retry_delays",
    "make_engine",
    "missing_sqlite_file",
    "safe_url",
    "serialize_sqlite_writes",
    "store_error",
    "write_engine",
]

log = logging.getLogger(__name__)

BUSY_TIMEOUT_MS = 30_000
LOCK_RETRIES = 5
_WRITE_OPTION = "flashtune_write"
_LEGACY_CONTROL = getattr(sqlite3, "LEGACY_TRANSACTION_CONTROL", None)  # Python >= 3.12


def default_db_url(*, create: bool = True) -> str:
    """The database flashtune uses when given none.

    Arguments:
        create: create the cache folder when missing (a command that only reads passes
            False: a database that does not exist holds nothing, and nothing is created).
    Returns:
        ``$FLASHTUNE_DB`` when set, else
        ``sqlite:///<$XDG_CACHE_HOME or ~/.cache>/flashtune/flashtune.db``.
    Raises:
        StoreError when the home folder is unknown or, with ``create``, the cache folder
        cannot be created; the message names the folder and says how to use a database
        elsewhere.
    """
    env = os.environ.get("FLASHTUNE_DB", "").strip()
    if env:
        return env
    try:
        cache = os.environ.get("XDG_CACHE_HOME", "").strip() or str(Path.home() / ".cache")
    except RuntimeError as exc:  # no $HOME and no passwd entry
        raise StoreError(f"cannot find the home folder for the default database ({exc}): "
                         f"{_ELSEWHERE}") from exc
    folder = Path(cache) / "flashtune"
    if create:
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(f"cannot create the default database folder {folder} "
                             f"({exc.strerror or exc}): {_ELSEWHERE}") from exc
    return f"sqlite:///{folder / 'flashtune.db'}"


_ELSEWHERE = ("set FLASHTUNE_DB or pass `flashtune --db URL` (e.g. sqlite:////abs/path.db) to "
              "use a database elsewhere, or XDG_CACHE_HOME to use another cache folder")


def _sqlite_path(url: str | URL, *, uri: bool = True) -> Path | None:
    """The file of a file-backed SQLite URL (``file:`` URIs too, unless ``uri`` is False),
    else None (other backends, memory databases, unparseable URLs)."""
    try:
        parsed = make_url(url)
    except Exception:  # noqa: BLE001 - not a URL: no file to name, the opener judges it
        return None
    if parsed.get_backend_name() != "sqlite" or is_memory_sqlite(parsed):
        return None
    database = parsed.database or ""
    if database.startswith("file:"):
        if not uri:
            return None
        database = unquote(database[len("file:"):].split("?", 1)[0])
        if database.startswith("//"):  # file://host/path
            database = database[2:]
            database = database[database.find("/"):] if "/" in database else ""
    return Path(database) if database else None


def missing_sqlite_file(url: str | URL) -> str | None:
    """The path of a file-backed SQLite URL whose file does not exist, else None (other
    backends, memory databases, ``file:`` URIs and unparseable URLs: None, for the opener
    to judge)."""
    path = _sqlite_path(url, uri=False)
    try:
        return None if path is None or path.exists() else str(path)
    except OSError:  # a folder on the way cannot be searched: the opener says so
        return None


def _sqlite_trouble(url: str | URL, detail: str) -> str | None:
    """What is wrong with the file of a SQLite URL, where the driver only says "unable to
    open database file", "disk I/O error" or "attempt to write a readonly database"."""
    low = detail.lower()
    if not any(s in low for s in ("unable to open", "disk i/o error", "readonly database")):
        return None
    path = _sqlite_path(url)
    if path is None:
        return None
    try:
        if path.is_dir():
            return f"{path} is a directory, not a database file"
        folder = path.parent
        if not path.exists():
            existing = folder
            while not existing.exists() and existing != existing.parent:
                existing = existing.parent
            if not existing.is_dir():
                return f"{existing} is not a folder, so {path} cannot exist"
            if existing != folder:
                return f"folder {folder} does not exist (create it first)"
            if not os.access(folder, os.W_OK | os.X_OK):
                return (f"file {path} does not exist, and folder {folder} is not writable "
                        f"so it cannot be created")
            return f"file {path} does not exist"
        if "readonly" in low:
            if not os.access(path, os.W_OK):
                return f"database file {path} is read-only (no write permission)"
            if not os.access(folder, os.W_OK | os.X_OK):
                return (f"folder {folder} is read-only; SQLite writes its journal files "
                        f"beside {path.name}")
            return (f"database file {path} is read-only (SQLite cannot write to it or to "
                    f"its folder)")
        if not os.access(path, os.R_OK):
            return f"database file {path} is not readable (no read permission)"
    except OSError:
        return None
    return None


def safe_url(url: str | URL) -> str:
    """``url`` as text with any password replaced by ``***`` (for messages and logs)."""
    try:
        u = make_url(url)
        text = u.render_as_string(hide_password=True)
        # SQLite URLs hold no password; show their path as typed, not percent-escaped
        return unquote(text) if u.get_backend_name() == "sqlite" else text
    except Exception:  # not parseable: still never echo a password we cannot find
        return "<unparseable database URL>"


def is_memory_sqlite(url: str | URL) -> bool:
    """True for ``sqlite://`` and ``sqlite:///:memory:`` (a private in-process database)."""
    u = make_url(url)
    if u.get_backend_name() != "sqlite":
        return False
    database = u.database or ""
    return database in ("", ":memory:") or "mode=memory" in database or \
        u.query.get("mode") == "memory"


def _sqlite_file_url(u: URL, read_only: bool) -> URL:
    if not read_only:
        return u
    database = u.database or ""
    if database.startswith("file:"):  # already a URI: add mode=ro
        sep = "&" if "?" in database else "?"
        return u.set(database=f"{database}{sep}mode=ro", query={**u.query, "uri": "true"})
    path = Path(database).expanduser().resolve().as_posix()
    return u.set(database=f"file:{path}", query={**u.query, "mode": "ro", "uri": "true"})


def make_engine(url: str | URL, read_only: bool = False, *, wal: bool = True,
                **kwargs: Any) -> Engine:
    """A SQLAlchemy engine for ``url`` with flashtune's SQLite settings (see module doc).

    Arguments:
        url: a SQLAlchemy URL (``sqlite:///path``, ``postgresql+psycopg://...``).
        read_only: open a SQLite file read-only (``mode=ro``); other backends ignore it.
        wal: switch a SQLite file to WAL on connect; ``False`` leaves the journal mode
            alone (the store checks the schema first and switches to WAL afterwards with
            :func:`enable_wal`, so refusing a database never writes to it).
        kwargs: passed on to :func:`sqlalchemy.create_engine`.
    Returns:
        The engine (connections are opened lazily, on first use).
    Raises:
        sqlalchemy.exc.ArgumentError for a malformed URL; ImportError when the URL's
        driver is not installed.
    """
    u = make_url(url)
    if u.get_backend_name() != "sqlite":
        kwargs.setdefault("pool_pre_ping", True)
        return create_engine(u, **kwargs)

    memory = is_memory_sqlite(u)
    if memory:
        kwargs.setdefault("poolclass", StaticPool)
        connect_args = dict(kwargs.pop("connect_args", {}))
        connect_args.setdefault("check_same_thread", False)
        kwargs["connect_args"] = connect_args
    else:
        u = _sqlite_file_url(u, read_only)
    engine = create_engine(u, **kwargs)
    use_wal = wal and not memory and not read_only

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, connection_record: Any) -> None:
        _prepare_connection(dbapi_connection, foreign_keys=True, wal=use_wal)

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Any) -> None:
        write = conn.get_execution_options().get(_WRITE_OPTION, False) and not read_only
        conn.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN")

    return engine


def serialize_sqlite_writes(engine: Engine) -> Engine:
    """Make ``engine``, a SQLite engine made elsewhere (Optuna's ``RDBStorage``), start
    every transaction with ``BEGIN IMMEDIATE`` and wait up to the busy timeout for the lock.

    A transaction that reads what it then updates needs this on SQLite, where ``SELECT ...
    FOR UPDATE`` locks nothing: Optuna pops a queued trial by reading it WAITING and setting
    it RUNNING, which two processes in deferred transactions can both do (and a deferred
    transaction that finds its snapshot stale when it starts writing fails at once with
    "database is locked"). Other backends are left as they are. Returns ``engine``.
    """
    if engine.dialect.name != "sqlite":
        return engine

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, connection_record: Any) -> None:
        _prepare_connection(dbapi_connection, foreign_keys=False, wal=False)

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Any) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE")

    engine.dispose()  # pooled connections were opened before the hooks
    return engine


def write_engine(engine: Engine) -> Engine:
    """``engine`` whose transactions start with ``BEGIN IMMEDIATE`` on SQLite (same pool)."""
    return engine.execution_options(**{_WRITE_OPTION: True})


def _prepare_connection(dbapi_connection: Any, *, foreign_keys: bool, wal: bool) -> None:
    """A new sqlite3 connection of an engine whose transactions SQLAlchemy begins itself
    (its ``begin`` listener emits BEGIN): sqlite3's legacy transaction control (its default
    until Python 3.16) with the implicit BEGIN switched off, the busy timeout, and
    optionally foreign keys and WAL mode."""
    if _LEGACY_CONTROL is not None and hasattr(dbapi_connection, "autocommit"):
        dbapi_connection.autocommit = _LEGACY_CONTROL
    dbapi_connection.isolation_level = None
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        if foreign_keys:
            cursor.execute("PRAGMA foreign_keys = ON")
        if wal:
            _set_wal(cursor)
    finally:
        cursor.close()


def _set_wal(cursor: Any) -> None:
    # A file already in WAL is left alone: setting the mode takes a lock that SQLite does
    # not always wait for (busy_timeout aside), so concurrent openers of one file would
    # fail with "database is locked"; the first switch is retried with backoff.
    delays = lock_retry_delays()
    while True:
        try:
            cursor.execute("PRAGMA journal_mode")
            mode = cursor.fetchone()
            if mode and str(mode[0]).lower() == "wal":
                return
            cursor.execute("PRAGMA journal_mode = WAL")
            break
        except sqlite3.OperationalError as exc:
            delay = next(delays, None)
            if delay is None or "locked" not in str(exc).lower():
                raise
            time.sleep(delay)
    mode = cursor.fetchone()
    if mode and str(mode[0]).lower() != "wal":  # e.g. a file system without shared memory
        log.warning("SQLite stayed in journal_mode=%s (WAL not available)", mode[0])


def enable_wal(engine: Engine) -> None:
    """Switch a writable SQLite file database to WAL (persistent; no-op elsewhere).

    Raises ``sqlite3.Error`` (the driver's own, not SQLAlchemy's) when that fails, e.g.
    "attempt to write a readonly database" for a file or folder without write permission.
    """
    if engine.dialect.name != "sqlite" or is_memory_sqlite(engine.url):
        return
    if engine.url.query.get("mode") == "ro":
        return
    raw = engine.raw_connection()
    try:
        cursor = raw.cursor()
        try:
            _set_wal(cursor)
        finally:
            cursor.close()
    finally:
        raw.close()


def is_locked_error(exc: BaseException) -> bool:
    """True for SQLite's "database is locked" / "database is busy" operational errors."""
    if not isinstance(exc, OperationalError):
        return False
    text = str(getattr(exc, "orig", exc)).lower()
    return "database is locked" in text or "database is busy" in text or "database table is locked" in text


def lock_retry_delays(retries: int = LOCK_RETRIES, first: float = 0.05) -> Iterator[float]:
    """Backoff delays (seconds) between retries of a locked write: 0.05, 0.1, 0.2..."""
    delay = first
    for _ in range(retries):
        yield delay
        delay = min(delay * 2, 2.0)


def store_error(exc: BaseException, url: str | URL, operation: str) -> StoreError:
    """A one-line :class:`StoreError` naming the database (password hidden) and operation.

    The driver's own message is kept (whitespace collapsed); SQLAlchemy's SQL text and
    bound parameters are not, so values never leak into logs.
    """
    if isinstance(exc, ImportError):
        detail = f"the database driver is not installed ({exc}); install it with pip"
    else:
        detail = " ".join(str(getattr(exc, "orig", None) or exc).split()) or type(exc).__name__
        trouble = _sqlite_trouble(url, detail)
        if trouble is not None:
            detail = f"{trouble} ({detail})"
        elif isinstance(exc, ArgumentError) and "parse" in detail.lower():
            detail += ("; expected a SQLAlchemy URL such as sqlite:////abs/path/to/file.db "
                       "(sqlite:/// then the absolute path)")
    return StoreError(f"{operation} failed on database {safe_url(url)}: {detail}")
