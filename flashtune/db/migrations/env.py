"""Alembic environment for flashtune's tables, run programmatically (no alembic.ini).

:mod:`flashtune.db.schema` builds the ``Config`` in code and passes an open connection in
``config.attributes["connection"]``; the whole upgrade then runs inside that connection's
transaction (``BEGIN IMMEDIATE`` on SQLite), so it is all-or-nothing. The version table is
``flashtune_alembic_version``: Optuna's own ``alembic_version`` may share the database.

Developers writing a new revision by hand can also run the alembic CLI with
``-x url=sqlite:///path.db`` and ``script_location`` pointing here.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import Connection

from flashtune.db.models import Base

VERSION_TABLE = "flashtune_alembic_version"


def _include_object(obj: object, name: str | None, type_: str, reflected: bool,
                    compare_to: object) -> bool:
    # only flashtune's tables: leave Optuna's (or anyone's) alone in autogenerate/compare
    if type_ == "table":
        return bool(name and name.startswith("ft_"))
    return True


def _run(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=Base.metadata,
        version_table=VERSION_TABLE,
        include_object=_include_object,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = context.config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    from flashtune.db.engine import make_engine, write_engine

    url = context.get_x_argument(as_dictionary=True).get("url") or \
        context.config.get_main_option("sqlalchemy.url")
    if not url:
        raise RuntimeError("no database: pass -x url=... or set sqlalchemy.url")
    engine = make_engine(url, wal=False)
    try:
        with write_engine(engine).begin() as conn:
            _run(conn)
    finally:
        engine.dispose()


if context.is_offline_mode():
    raise RuntimeError("flashtune's migrations run online only (they use the live schema)")
run_migrations_online()
