"""``flashtune db``: upgrade the tuning database's schema, show what it holds.

The root group (``flashtune.cli.main``) stores the ``--db`` URL in ``ctx.obj["db_url"]``;
None means :func:`flashtune.db.default_db_url`. Heavy imports (torch, triton) never happen
here, and database errors become one-line ``click.ClickException`` messages.
"""

from __future__ import annotations

import json
from typing import Any

import click

__all__ = ["db", "info_command", "upgrade_command"]


def _db_url(ctx: click.Context) -> str:
    from flashtune.db.engine import default_db_url

    url = (ctx.obj or {}).get("db_url") if isinstance(ctx.obj, dict) else None
    return url or default_db_url()


def _fail(exc: Exception) -> click.ClickException:
    return click.ClickException(" ".join(str(exc).split()))


@click.group("db")
def db() -> None:
    """Manage the tuning database (schema upgrades, contents)."""


@db.command("upgrade")
@click.pass_context
def upgrade_command(ctx: click.Context) -> None:
    """Bring the database's schema to this flashtune's version (creates it if empty).

    Safe to run again; refuses a database written by a newer flashtune.
    """
    from flashtune.db.engine import safe_url
    from flashtune.db.schema import upgrade
    from flashtune.errors import StoreError

    url = _db_url(ctx)
    try:
        before, after = upgrade(url)
    except StoreError as exc:
        raise _fail(exc) from exc
    shown = safe_url(url)
    if before == after:
        click.echo(f"{shown} is already at schema revision {after}")
    elif before is None:
        click.echo(f"created the flashtune schema (revision {after}) in {shown}")
    else:
        click.echo(f"upgraded {shown} from schema revision {before} to {after}")


@db.command("info")
@click.option("--json", "as_json", is_flag=True, help="Print the information as JSON.")
@click.pass_context
def info_command(ctx: click.Context, as_json: bool) -> None:
    """Show the database's URL, schema revision and row counts (opened read-only)."""
    from flashtune.db import open_store
    from flashtune.errors import StoreError

    try:
        with open_store(_db_url(ctx), read_only=True) as store:
            info = store.info()
    except StoreError as exc:
        raise _fail(exc) from exc
    if as_json:
        click.echo(json.dumps(info, indent=2, sort_keys=True))
    else:
        click.echo(_render(info))


def _render(info: dict[str, Any]) -> str:
    lines = [
        f"database   {info['url']}",
        f"dialect    {info['dialect']}",
        f"revision   {info['revision']} (this flashtune: {info['head']})",
        "rows",
    ]
    width = max(len(name) for name in info["counts"])
    lines += [f"  {name:<{width}}  {count:>8}" for name, count in info["counts"].items()]
    return "\n".join(lines)
