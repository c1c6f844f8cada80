"""The database half of :class:`flashtune.db.sqlalchemy_store.SQLAlchemyStore`.

:class:`TransactionRunner` opens the engine, checks the schema, and runs every store
operation as one short transaction: :meth:`TransactionRunner._transaction` is the one
place that commits, rolls back and turns driver errors into ``StoreError``;
:meth:`TransactionRunner._run` retries a transaction when SQLite reports "database is
locked" (with backoff) or when a unique constraint shows that a concurrent writer got
there first (get-or-create, trial numbers, first best config).
"""

from __future__ import annotations

import logging
import random
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, TypeVar

from sqlalchemy.engine import URL
from sqlalchemy.exc import IntegrityError, SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from flashtune.core.errors import StoreError
from flashtune.db import schema
from flashtune.db.engine import (
    enable_wal,
    is_locked_error,
    is_memory_sqlite,
    lock_retry_delays,
    make_engine,
    safe_url,
    store_error,
    write_engine,
)

__all__ = ["TransactionRunner", "get_row", "rowcount"]

log = logging.getLogger(__name__)
T = TypeVar("T")


class _Conflict(StoreError):
    """A unique constraint failed: a concurrent writer won; the operation may be retried."""


class _Locked(StoreError):
    """SQLite stayed locked past its busy timeout; the operation may be retried."""


class TransactionRunner:
    """Engine, schema check and transactions for a store on the database at ``url``."""

    url: str
    read_only: bool

    def __init__(self, url: str | URL, *, read_only: bool = False, create: bool = True) -> None:
        self.url = safe_url(url)
        self.read_only = read_only
        try:
            self._engine = make_engine(url, read_only=read_only, wal=False)
        except (SQLAlchemyError, ImportError) as exc:  # bad URL, driver not installed
            raise store_error(exc, url, "opening the store") from exc
        # one shared connection for :memory: (StaticPool): let one thread at a time use it
        memory = is_memory_sqlite(self._engine.url)
        self._lock: AbstractContextManager[Any] = threading.RLock() if memory else nullcontext()
        try:
            with self._lock:
                self.revision = schema.check_schema(self._engine, create=create,
                                                    read_only=read_only, shown_url=self.url)
                if not read_only:
                    enable_wal(self._engine)  # only once the schema is known to be ours
        except (SQLAlchemyError, sqlite3.Error) as exc:  # enable_wal's raw driver errors too
            self._engine.dispose()
            raise store_error(exc, self.url, "opening the store") from exc
        except BaseException:
            self._engine.dispose()
            raise
        self._reader = sessionmaker(self._engine, expire_on_commit=False)
        self._writer = sessionmaker(write_engine(self._engine), expire_on_commit=False)

    def close(self) -> None:
        self._engine.dispose()

    # -- transactions -----------------------------------------------------------------------

    @contextmanager
    def _transaction(self, operation: str, *, write: bool = False) -> Iterator[Session]:
        """One transaction: commit on success, roll back on any error; driver errors become
        ``StoreError`` (``_Conflict`` / ``_Locked`` for the retryable ones)."""
        if write and self.read_only:
            raise StoreError(f"{operation} refused: database {self.url} was opened read-only")
        with self._lock:
            try:
                with (self._writer if write else self._reader)() as session, session.begin():
                    yield session
            except IntegrityError as exc:
                raise _Conflict(str(store_error(exc, self.url, operation))) from exc
            except SQLAlchemyError as exc:
                error = store_error(exc, self.url, operation)
                if is_locked_error(exc):
                    raise _Locked(str(error)) from exc
                raise error from exc

    def _run(self, operation: str, work: Callable[[Session], T], *, write: bool = False,
             conflict_retries: int = 0) -> T:
        """``work(session)`` in a transaction, retried on lock timeouts (with backoff) and
        up to ``conflict_retries`` times on unique-constraint conflicts."""
        delays = lock_retry_delays()
        conflicts = 0
        while True:
            try:
                with self._transaction(operation, write=write) as session:
                    return work(session)
            except _Locked:
                delay = next(delays, None)
                if delay is None:
                    raise
                log.debug("%s: database is locked, retrying in %.2fs", operation, delay)
                time.sleep(delay * (1 + random.random()))
            except _Conflict:
                conflicts += 1
                if conflicts > conflict_retries:
                    raise
                log.debug("%s: concurrent writer won, retrying (%d)", operation, conflicts)

    def _get_or_create(self, operation: str, find: Callable[[Session], T | None],
                       create: Callable[[Session], T]) -> T:
        found = self._run(operation, find)
        if found is not None:
            return found
        try:
            return self._run(operation, lambda s: find(s) or create(s), write=True)
        except _Conflict:  # created by a concurrent writer between our two transactions
            found = self._run(operation, find)
            if found is None:
                raise
            return found


def get_row(s: Session, model: type[T], ident: int, url: str) -> T:
    row = s.get(model, ident)
    if row is None:
        table = getattr(model, "__tablename__", model.__name__)
        raise StoreError(f"no row {ident} in {table} of database {url}")
    return row


def rowcount(result: Any) -> int:
    return int(getattr(result, "rowcount", 0) or 0)
