"""Backends for the store contract suite: every test taking ``store`` runs on each.

SQLite file and SQLite in-memory always; PostgreSQL on the database that
``FLASHTUNE_TEST_PG_URL`` names (one the tests may wipe, e.g.
``postgresql+psycopg://postgres@127.0.0.1/ft_test``), else on a throwaway server the
session starts on loopback when PostgreSQL is installed (:mod:`tests.db_tests.pg_server`),
else skipped with the reason.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from flashtune.db import open_store
from flashtune.db.store import TuningStore
from tests.db_tests import pg_server
from tests.db_tests.support import PG_ENV, PG_URL, Study, make_study, wipe_postgres


@pytest.fixture(params=["sqlite-file", "sqlite-memory", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite-file":
        yield f"sqlite:///{tmp_path / 'flashtune.db'}"
    elif request.param == "sqlite-memory":
        yield "sqlite:///:memory:"
    else:
        url = request.getfixturevalue("pg_url")
        wipe_postgres(url)
        yield url
        wipe_postgres(url)


@pytest.fixture(scope="session")
def pg_url() -> Iterator[str]:
    """A PostgreSQL database the tests may wipe: ``$FLASHTUNE_TEST_PG_URL``, or a throwaway
    server started for this session; skips (with the reason) when neither is possible."""
    if PG_URL:
        yield PG_URL
        return
    try:
        server = pg_server.start()
    except pg_server.Unavailable as exc:
        pytest.skip(f"PostgreSQL backend: {exc} (or set {PG_ENV})")
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture
def store(db_url: str) -> Iterator[TuningStore]:
    s = open_store(db_url)
    try:
        yield s
    finally:
        s.close()


@pytest.fixture
def study(store: TuningStore) -> Study:
    return make_study(store)
