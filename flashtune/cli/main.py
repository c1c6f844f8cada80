"""The root ``flashtune`` group: global options, and the command groups added to it.

``flashtune [--db URL] [-v] COMMAND ...``; ``--db`` (or ``$FLASHTUNE_DB``) lands in
``ctx.obj["db_url"]`` for every command (None: the library's default database). Nothing here
imports torch or triton, so ``--help`` stays fast.
"""

from __future__ import annotations

import logging
import os
import re

import click

from flashtune._version import __version__
from flashtune.cli.bench_commands import bench_command
from flashtune.cli.db_commands import db
from flashtune.cli.exchange_commands import export_command, import_command
from flashtune.cli.report_commands import report_command
from flashtune.cli.show_commands import show_command
from flashtune.cli.tune_commands import tune_command

__all__ = ["cli"]

_URL = re.compile(r"^[A-Za-z][\w+.-]*://")  # SQLAlchemy's "dialect[+driver]://..."


def _check_db_url(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """``--db`` must be a URL: a plain path (``/tmp/x.db``) gets the SQLite URL to use."""
    if not value or _URL.match(value):
        return value
    shown = re.sub(r":[^:@/]+@", ":***@", value)  # a mistyped URL's password stays hidden
    suggestion = ("sqlite:///" + os.path.abspath(os.path.expanduser(value))
                  if ":" not in value else "sqlite:////abs/path/to/file.db")
    source = ctx.get_parameter_source(param.name or "")
    where = " (from FLASHTUNE_DB)" if source is click.core.ParameterSource.ENVIRONMENT else ""
    raise click.BadParameter(f"{shown!r}{where} is not a database URL; for a SQLite file use "
                             f"{suggestion} (sqlite:/// then the absolute path)", ctx, param)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--db", "db_url", envvar="FLASHTUNE_DB", default=None, metavar="URL",
              callback=_check_db_url,
              help="Tuning database URL (SQLAlchemy, e.g. sqlite:////abs/path.db); env "
                   "FLASHTUNE_DB; default ~/.cache/flashtune/flashtune.db.")
@click.option("-v", "--verbose", count=True, help="More logging (-v info, -vv debug).")
@click.version_option(__version__, "--version", prog_name="flashtune")
@click.pass_context
def cli(ctx: click.Context, db_url: str | None, verbose: int) -> None:
    """Autotune Triton flash-attention kernels and manage the tuned configs."""
    level = logging.WARNING if verbose == 0 else logging.INFO if verbose == 1 else logging.DEBUG
    # with -v, times: a long job's log says where its time went
    fmt = "%(levelname)s %(name)s: %(message)s" if verbose == 0 \
        else "%(asctime)s %(levelname)s %(name)s: %(message)s"
    # -v is flashtune's info; other libraries' (alembic's plugin setup...) only from -vv
    logging.basicConfig(level=level if verbose > 1 else logging.WARNING, format=fmt)
    logging.getLogger("flashtune").setLevel(level)
    ctx.ensure_object(dict)
    ctx.obj["db_url"] = db_url or None


cli.add_command(db)
cli.add_command(tune_command)
cli.add_command(show_command)
cli.add_command(export_command)
cli.add_command(import_command)
cli.add_command(report_command)
cli.add_command(bench_command)


if __name__ == "__main__":
    cli()
