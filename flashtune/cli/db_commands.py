"""``flashtune db``: upgrade the tuning database's schema, show what it holds, verify the
shipped and stored entries on this GPU (``db verify``, :mod:`flashtune.runtime.verify`).

The root group (``flashtune.cli.main``) stores the ``--db`` URL in ``ctx.obj["db_url"]``;
None means :func:`flashtune.db.default_db_url`. Heavy imports (torch, triton) never happen
here, and database errors become one-line ``click.ClickException`` messages.
"""

from __future__ import annotations

import json
from typing import Any

import click

__all__ = ["VERIFY_SOURCES", "db", "info_command", "upgrade_command", "verify_command"]

# flashtune.runtime.verify.SOURCES, spelled out so --help imports no torch (a test keeps the
# two equal)
VERIFY_SOURCES = ("shipped", "db", "all")


def _db_url(ctx: click.Context, *, create: bool = True) -> str:
    """The ``--db`` URL, else the default database (``create``: its folder made when
    missing; a StoreError as a one-line error when that fails)."""
    from flashtune.core.errors import StoreError
    from flashtune.db.engine import default_db_url

    url = (ctx.obj or {}).get("db_url") if isinstance(ctx.obj, dict) else None
    try:
        return url or default_db_url(create=create)
    except StoreError as exc:
        raise _fail(exc) from exc


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
    from flashtune.core.errors import StoreError
    from flashtune.db.engine import safe_url
    from flashtune.db.schema import upgrade

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
    """Show the database's URL, schema revision and row counts (opened read-only).

    A database at an older schema revision is shown too, with the command that upgrades
    it; nothing is ever written or created.
    """
    from flashtune.core.errors import SchemaError, StoreError
    from flashtune.db import open_store
    from flashtune.db.engine import missing_sqlite_file, safe_url
    from flashtune.db.schema import upgrade_command as upgrade_hint

    url = _db_url(ctx, create=False)
    missing = missing_sqlite_file(url)
    if missing is not None:
        raise click.ClickException(f"database {missing} does not exist (nothing tuned into "
                                   f"it yet; `flashtune tune` or `{upgrade_hint(safe_url(url))}` "
                                   "creates it)")
    stale: list[dict[str, Any]] = []
    try:
        with open_store(url, read_only=True) as store:
            info = store.info()
            stale = _stale_entries(store)
    except SchemaError as exc:
        info = _unopened_info(url, exc)
    except StoreError as exc:
        raise _fail(exc) from exc
    from flashtune.runtime.sources import stale_tables

    info["stale_entries"] = len(stale)
    info["stale_tables"] = [t.to_dict() for t in stale_tables()[0]]
    if as_json:
        click.echo(json.dumps(info, indent=2, sort_keys=True))
    else:
        click.echo(_render(info))


def _stale_entries(store: Any) -> list[dict[str, Any]]:
    """The stored best configs and op choices that are stale and not replaced (as
    ``flashtune show`` lists them)."""
    from flashtune.cli.show_commands import _stale, best_to_dict, choice_to_dict
    from flashtune.core.spec import USER_OPS

    out = _stale([best_to_dict(b) for b in store.list_best()], None)[0]
    for op in USER_OPS:
        out += _stale([choice_to_dict(c) for c in store.list_choices(op=op)], op)[0]
    return out


def _unopened_info(url: str, refusal: Exception) -> dict[str, Any]:
    """``store.info()``'s keys for a database the store refuses at its schema revision
    (older: with ``upgrade``, the command that upgrades it; newer: with ``note``); the
    refusal itself as a one-line error for anything else (no or unknown schema)."""
    from flashtune.core.errors import StoreError
    from flashtune.db.engine import safe_url
    from flashtune.db.schema import HEAD_REVISION, known_revisions, read_revision
    from flashtune.db.schema import upgrade_command as upgrade_hint

    try:
        revision, dialect, counts = read_revision(url)
    except StoreError as exc:
        raise _fail(exc) from exc
    if revision is None or "," in revision:
        raise _fail(refusal)
    info: dict[str, Any] = {"url": safe_url(url), "dialect": dialect, "revision": revision,
                            "head": HEAD_REVISION, "read_only": True, "counts": counts}
    if revision in known_revisions():
        info["upgrade"] = upgrade_hint(safe_url(url))
    else:
        info["note"] = ("written by a newer flashtune: this one cannot use it; upgrade "
                        "flashtune")
    return info


def _render(info: dict[str, Any]) -> str:
    lines = [
        f"database   {info['url']}",
        f"dialect    {info['dialect']}",
        f"revision   {info['revision']} (this flashtune: {info['head']})",
    ]
    if "upgrade" in info:
        lines.append(f"           older than this flashtune's: upgrade it with "
                     f"`{info['upgrade']}`")
    if "note" in info:
        lines.append(f"           {info['note']}")
    lines.append("rows")
    width = max((len(name) for name in info["counts"]), default=0)
    lines += [f"  {name:<{width}}  {count:>8}" for name, count in info["counts"].items()]
    if info.get("stale_entries"):
        lines.append(f"stale      {info['stale_entries']} stored entries tuned for an older "
                     "kernel source, not served: `flashtune show` (and `show --op OP`) lists "
                     "them with their re-tune commands")
    for table in info.get("stale_tables", []):
        lines.append(f"stale      {table['line']}")
    return "\n".join(lines)


@db.command("verify")
@click.option("--source", type=click.Choice(VERIFY_SOURCES), default="all", show_default=True,
              help="Verify the shipped tables (flashtune/configs and $FLASHTUNE_CONFIG_DIR, "
                   "as the router reads them), the tuning database's entries, or both.")
@click.option("--sample", type=click.IntRange(min=0), default=8, show_default=True,
              help="Re-time this many current entries of this GPU, drawn at random "
                   "(--seed); 0: every one.")
@click.option("--tolerance", type=click.FloatRange(min=0, max=10, max_open=True),
              default=0.05, show_default=True,
              help="Report an entry measured more than this fraction slower than recorded.")
@click.option("--rounds", type=click.IntRange(min=1), default=3, show_default=True,
              help="Timing rounds per entry (the median of the round medians, as the "
                   "tuner times).")
@click.option("--seed", type=int, default=0, show_default=True, help="Draws the sample.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option("--interpret", is_flag=True,
              help="Run on CPU under the Triton interpreter: checks the pipeline; its "
                   "timings mean nothing.")
@click.pass_context
def verify_command(ctx: click.Context, source: str, sample: int, tolerance: float,
                   rounds: int, seed: int, as_json: bool, interpret: bool) -> None:
    """Re-time a sample of this GPU's shipped or stored entries and report what to re-tune.

    Every entry of this GPU is checked first: one tuned for another source of its kernel
    (stale: never served) or under other torch, Triton, CUDA or driver versions is
    reported. A sample of the current ones is then checked against the fp32 reference and
    timed as the tuner times a candidate; one now more than --tolerance slower than its
    recorded time is reported. Each reported entry comes with the `flashtune tune` command
    that re-tunes it. Exit status 1 when anything is reported. Without a GPU it says so and
    stops (--interpret runs the pipeline on CPU).
    """
    from flashtune.cli.bench_modes import _gpu_or_interpret

    _gpu_or_interpret(interpret, "db verify re-times entries on this machine's GPU; "
                                 "--interpret checks the pipeline on CPU")
    from flashtune.core.device import cuda_device, interpreter_device
    from flashtune.core.errors import FlashtuneError
    from flashtune.runtime.verify import render, verify

    device = interpreter_device() if interpret else cuda_device()
    url = (ctx.obj or {}).get("db_url") if isinstance(ctx.obj, dict) else None
    try:
        report = verify(device, source=source, sample=sample, tolerance=tolerance,
                        rounds=rounds, seed=seed, db_url=url)
    except (FlashtuneError, ValueError) as exc:
        raise _fail(exc) from exc
    if as_json:
        data = report.to_dict()
        data.update(source=source, sample=sample, tolerance=tolerance, rounds=rounds,
                    seed=seed, interpret=interpret)
        click.echo(json.dumps(data, indent=2, sort_keys=True))
    else:
        click.echo(render(report, interpret))
    if report.reported or report.stale_tables:
        ctx.exit(1)
