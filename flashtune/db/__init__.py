"""The tuning database: SQLAlchemy models, the store, migrations.

Light to import (SQLAlchemy and alembic only; never torch or triton)::

    from flashtune.db import open_store
    with open_store() as store:          # $FLASHTUNE_DB or ~/.cache/flashtune/flashtune.db
        for best in store.list_best(device_name="NVIDIA_H100_80GB_HBM3"):
            ...
"""

from __future__ import annotations

from sqlalchemy.engine import URL

from flashtune.db.engine import default_db_url, make_engine
from flashtune.db.jsonutil import canonical_json, config_hash
from flashtune.db.records import (
    BestConfigRecord,
    ChoiceRecord,
    DeviceRecord,
    ProblemRecord,
    RunRecord,
    RunStatus,
    SoftwareVersions,
    TemplateRecord,
    TrialRecord,
    TrialState,
)
from flashtune.db.schema import HEAD_REVISION, upgrade
from flashtune.db.sqlalchemy_store import SQLAlchemyStore
from flashtune.db.store import TuningStore

__all__ = [
    "HEAD_REVISION",
    "BestConfigRecord",
    "ChoiceRecord",
    "DeviceRecord",
    "ProblemRecord",
    "RunRecord",
    "RunStatus",
    "SQLAlchemyStore",
    "SoftwareVersions",
    "TemplateRecord",
    "TrialRecord",
    "TrialState",
    "TuningStore",
    "canonical_json",
    "config_hash",
    "default_db_url",
    "make_engine",
    "open_store",
    "upgrade",
]


def open_store(url: str | URL | None = None, *, read_only: bool = False,
               create: bool = True) -> TuningStore:
    """The store at ``url``, schema checked on opening.

    Arguments:
        url: a SQLAlchemy URL or ``URL``; None: :func:`default_db_url`.
        read_only: open without ever writing (no schema creation, no WAL switch).
        create: create the schema in an empty database (ignored when ``read_only``).
    Returns:
        A :class:`TuningStore` (use it as a context manager, or call ``close()``).
    Raises:
        SchemaError for a database at another schema revision (the message says which
        command upgrades it); StoreError when the database cannot be opened.
    """
    return SQLAlchemyStore(default_db_url() if url is None else url, read_only=read_only,
                           create=create)
