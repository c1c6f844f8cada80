"""Backends for the store contract suite: every test taking ``store`` runs on each.

SQLite file and SQLite in-memory always; PostgreSQL when ``FLASHTUNE_TEST_PG_URL`` names a
database the tests may wipe (e.g. ``postgresql+psycopg://postgres@127.0.0.1/ft_test``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from flashtune.db import open_store
from flashtune.db.store import TuningStore
from tests.db_tests.support import PG_ENV, PG_URL, Study, make_study, wipe_postgres


@pytest.fixture(params=["sqlite-file", "sqlite-memory", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite-file":
        yield f"sqlite:///{tmp_path / 'flashtune.db'}"
    elif request.param == "sqlite-memory":
        yield "sqlite:///:memory:"
    else:
        url = PG_URL
        if not url:
            pytest.skip(f"PostgreSQL backend: set {PG_ENV} to a database the tests may wipe")
        wipe_postgres(url)
        yield url
        wipe_postgres(url)


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
