"""Schema versions: which revision a database is at, and bringing it to this code's head.

The migrations live in ``flashtune/db/migrations`` and run programmatically: an alembic
``Config`` is built here, no ``alembic.ini`` needed. Their version table is
``flashtune_alembic_version`` (Optuna keeps its own ``alembic_version``).

Opening a database (:func:`check_schema`) never migrates an existing one: a database at an
older revision is refused with the command that upgrades it, a database at a revision this
code does not know (a newer flashtune wrote it) is refused too, and nothing is written in
either case. Only a database without any flashtune table is created, straight to head.
"""

from __future__ import annotations

import logging
import shlex
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, Engine, func, inspect, select, table, text
from sqlalchemy.engine import URL
from sqlalchemy.exc import SQLAlchemyError

from flashtune._version import __version__
from flashtune.core.errors import SchemaError
from flashtune.db.engine import make_engine, safe_url, store_error, write_engine

__all__ = [
    "HEAD_REVISION",
    "VERSION_TABLE",
    "check_schema",
    "current_revision",
    "downgrade",
    "known_revisions",
    "read_revision",
    "upgrade",
    "upgrade_command",
]

log = logging.getLogger(__name__)

HEAD_REVISION = "0005"
VERSION_TABLE = "flashtune_alembic_version"
MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"
_PG_LOCK_KEY = 0x666C_6173_6874_756E  # "flashtun": advisory lock held while migrating


def alembic_config(connection: Connection | None = None) -> Config:
    """An alembic ``Config`` for flashtune's migrations, optionally bound to ``connection``."""
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    if connection is not None:
        cfg.attributes["connection"] = connection
    return cfg


@lru_cache(maxsize=1)
def known_revisions() -> tuple[str, ...]:
    """Every revision shipped with this flashtune, oldest first."""
    script = ScriptDirectory.from_config(alembic_config())
    return tuple(reversed([rev.revision for rev in script.walk_revisions()]))


@dataclass(frozen=True)
class _State:
    revision: str | None  # None: no version table, or an empty one
    ft_tables: tuple[str, ...]

    @property
    def empty(self) -> bool:
        return self.revision is None and not self.ft_tables


def _read_state(conn: Connection) -> _State:
    tables = inspect(conn).get_table_names()
    ft_tables = tuple(sorted(t for t in tables if t.startswith("ft_")))
    if VERSION_TABLE not in tables:
        return _State(None, ft_tables)
    rows = [r[0] for r in conn.execute(text(f"SELECT version_num FROM {VERSION_TABLE}"))]
    if len(rows) > 1:
        return _State(",".join(sorted(rows)), ft_tables)  # branches: never ours
    return _State(rows[0] if rows else None, ft_tables)


def current_revision(bind: Engine | Connection) -> str | None:
    """The database's flashtune schema revision, or None when it has none.

    Given a ``Connection`` it reads inside that connection's transaction.
    """
    if isinstance(bind, Connection):
        return _read_state(bind).revision
    with _errors(bind.url, "reading the schema revision"), bind.connect() as conn:
        return _read_state(conn).revision


def upgrade_command(url: str) -> str:
    """The shell command that upgrades the database at ``url`` (as shown: password hidden)
    to this flashtune's schema: ``flashtune --db URL db upgrade`` (``--db`` belongs to
    the root command, before ``db``)."""
    return f"flashtune --db {shlex.quote(url)} db upgrade"


def _refusal(url: str, state: _State, *, read_only: bool, create: bool) -> SchemaError | None:
    """The error that refuses ``state``, or None when the schema is usable (at head)."""
    upgrade_hint = f"run `{upgrade_command(url)}`"
    if state.revision == HEAD_REVISION:
        return None
    if state.revision is None and state.ft_tables:
        return SchemaError(
            f"database {url} has flashtune tables ({', '.join(state.ft_tables)}) but no "
            f"{VERSION_TABLE} table, so its schema revision is unknown; it was not created "
            f"by flashtune's migrations: use a new database")
    if state.revision is None:
        if read_only:
            return SchemaError(f"database {url} has no flashtune schema and was opened "
                               f"read-only, so it was not created: {upgrade_hint} first")
        if not create:
            return SchemaError(f"database {url} has no flashtune schema: {upgrade_hint}")
        return None  # the caller creates it
    if state.revision in known_revisions():
        return SchemaError(f"database {url} is at schema revision {state.revision}, this "
                           f"flashtune needs {HEAD_REVISION}: {upgrade_hint}")
    return SchemaError(
        f"database {url} is at schema revision {state.revision}, which flashtune "
        f"{__version__} (schema {HEAD_REVISION}) does not know: it was written by a newer "
        f"flashtune; upgrade flashtune to use it")


def check_schema(engine: Engine, *, create: bool = True, read_only: bool = False,
                 shown_url: str | None = None) -> str:
    """Make sure ``engine``'s database is at :data:`HEAD_REVISION`; return the revision.

    A database without flashtune tables is created (migrated to head) when ``create`` and
    not ``read_only``. Anything else not at head raises :class:`SchemaError` saying what to
    do, and nothing is written. Driver failures raise ``StoreError``. Messages name
    ``shown_url`` (default: the engine's URL, password hidden).
    """
    url = shown_url or safe_url(engine.url)
    with _errors(url, "checking the schema"):
        with engine.connect() as conn:
            state = _read_state(conn)
        refusal = _refusal(url, state, read_only=read_only, create=create)
        if refusal is not None:
            raise refusal
        if state.revision == HEAD_REVISION:
            return HEAD_REVISION
        with _migrating(engine) as conn:  # BEGIN IMMEDIATE: one creator at a time
            state = _read_state(conn)  # another process may have created it meanwhile
            if state.empty:
                log.info("creating flashtune schema %s in %s", HEAD_REVISION, url)
                command.upgrade(alembic_config(conn), "head")
            elif (refusal := _refusal(url, state, read_only=False, create=True)) is not None:
                raise refusal
    return HEAD_REVISION


def upgrade(url: str | URL) -> tuple[str | None, str]:
    """Migrate the database at ``url`` to :data:`HEAD_REVISION` (idempotent).

    The whole upgrade is one transaction on SQLite and PostgreSQL (both have transactional
    DDL).

    Arguments:
        url: the database's SQLAlchemy URL (created when it does not exist).
    Returns:
        ``(revision_before, HEAD_REVISION)``; ``revision_before`` is None for a database
        that had no flashtune schema.
    Raises:
        SchemaError (nothing written) for a database at a revision this code does not know
        or with tables of unknown origin; StoreError when the database cannot be opened
        or written.
    """
    engine = _engine(url, "upgrading the schema")
    shown = safe_url(engine.url)
    try:
        with _errors(engine.url, "upgrading the schema"):
            with _migrating(engine) as conn:
                state = _read_state(conn)
                refusal = _refusal(shown, state, read_only=False, create=True)
                if refusal is not None and state.revision not in known_revisions():
                    raise refusal  # unknown revision or tables of unknown origin
                if state.revision != HEAD_REVISION:
                    log.info("upgrading %s from %s to %s", shown, state.revision or "nothing",
                             HEAD_REVISION)
                    command.upgrade(alembic_config(conn), "head")
        return state.revision, HEAD_REVISION
    finally:
        engine.dispose()


def downgrade(url: str | URL, revision: str) -> None:
    """Migrate the database at ``url`` down to ``revision`` (for developers and tests).

    Downgrading drops the columns added after ``revision`` and the data in them.
    """
    engine = _engine(url, f"downgrading the schema to {revision}")
    try:
        with _errors(engine.url, f"downgrading the schema to {revision}"):
            with _migrating(engine) as conn:
                command.downgrade(alembic_config(conn), revision)
    finally:
        engine.dispose()


@contextmanager
def _migrating(engine: Engine) -> Iterator[Connection]:
    """A connection in one write transaction (``BEGIN IMMEDIATE`` on SQLite) for migrations.

    PostgreSQL serializes migrators with a transaction-scoped advisory lock (concurrent
    ``CREATE TABLE`` of one name would otherwise fail in all but one process).

    SQLite cannot alter most of a table in place: alembic's batch mode copies it, drops the
    old one and renames the copy. With foreign keys enforced, dropping a referenced table
    would fail or fire ``ON DELETE`` actions, so they are switched off for the migration
    (SQLite ignores that pragma inside a transaction: it is set before ``BEGIN``) and the
    result is verified with ``PRAGMA foreign_key_check`` before committing, as SQLite's
    documentation of ALTER TABLE prescribes.
    """
    with write_engine(engine).connect() as conn:
        raw = conn.connection.driver_connection if conn.dialect.name == "sqlite" else None
        if raw is not None:
            raw.execute("PRAGMA foreign_keys = OFF")
        try:
            with conn.begin():
                if conn.dialect.name == "postgresql":  # one migrator at a time, per database
                    conn.execute(text("SELECT pg_advisory_xact_lock(:key)"),
                                 {"key": _PG_LOCK_KEY})
                yield conn
                if raw is not None:
                    broken = conn.exec_driver_sql("PRAGMA foreign_key_check").fetchall()
                    if broken:
                        raise SchemaError(
                            f"migrating {safe_url(engine.url)} would break foreign keys "
                            f"(table, rowid, parent, fk): {broken[:5]}; nothing was changed")
        finally:
            if raw is not None:
                raw.execute("PRAGMA foreign_keys = ON")


def read_revision(url: str | URL) -> tuple[str | None, str, dict[str, int]]:
    """What the database at ``url`` holds, read without writing anything and whatever its
    schema revision (a SQLite file is opened read-only): for ``flashtune db info`` on a
    database that the store refuses to open.

    Arguments:
        url: the database's SQLAlchemy URL.
    Returns:
        ``(revision, dialect, counts)``: the flashtune schema revision (None when it has
        none; possibly one this flashtune does not know), the SQLAlchemy dialect name, and
        the row count of every flashtune table (``ft_*``), by table name.
    Raises:
        StoreError when the database cannot be opened or read.
    """
    engine = _engine(url, "reading the schema revision", read_only=True)
    try:
        with _errors(url, "reading the schema revision"), engine.connect() as conn:
            state = _read_state(conn)
            counts = {name: int(conn.execute(select(func.count()).select_from(table(name)))
                                .scalar() or 0) for name in state.ft_tables}
        return state.revision, engine.dialect.name, counts
    finally:
        engine.dispose()


def _engine(url: str | URL, operation: str, *, read_only: bool = False) -> Engine:
    """``make_engine(url, wal=False)``; a malformed URL or a missing driver as StoreError."""
    try:
        return make_engine(url, read_only=read_only, wal=False)
    except (SQLAlchemyError, ImportError) as exc:
        raise store_error(exc, url, operation) from exc


@contextmanager
def _errors(url: str | URL, operation: str) -> Iterator[None]:
    try:
        yield
    except SQLAlchemyError as exc:
        raise store_error(exc, url, operation) from exc
