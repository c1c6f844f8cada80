"""``flashtune report``: PNG plots and one HTML page of the tuning database.

The store is opened read-only and never created. matplotlib is optional: without it the
command exits 1 with one line saying ``pip install matplotlib``. A database that does not
exist or holds no study (after the filters) prints why and writes nothing (exit 0, like
``show`` and ``export``). The work is done by :mod:`flashtune.report`.
"""

from __future__ import annotations

from pathlib import Path

import click

from flashtune.cli.options import db_url, device_filter_option, fail, template_filter_option

__all__ = ["report_command"]


@click.command("report")
@device_filter_option
@template_filter_option
@click.option("-o", "--output", default="flashtune-report", show_default=True, metavar="DIR",
              type=click.Path(file_okay=False, dir_okay=True, path_type=Path),
              help="Directory for the PNGs and index.html (created).")
@click.pass_context
def report_command(ctx: click.Context, device: str | None, template: str | None,
                   output: Path) -> None:
    """Plot the tuning database: per study the optimisation history and parameter
    importances, and tuned vs default configs; one HTML page shows them all.

    Needs matplotlib (pip install matplotlib). Prints each file written.
    """
    from flashtune.report.plots import MATPLOTLIB_MISSING, load_pyplot

    try:
        load_pyplot()
    except ImportError:
        raise click.ClickException(MATPLOTLIB_MISSING) from None

    from flashtune.core.errors import FlashtuneError
    from flashtune.db import open_store
    from flashtune.db.engine import default_db_url, missing_sqlite_file, safe_url
    from flashtune.report.page import write_report
    from flashtune.report.studies import collect_studies

    url = db_url(ctx) or default_db_url(create=False)
    missing = missing_sqlite_file(url)
    if missing is not None:
        click.echo(f"nothing to report (database {missing} does not exist yet; run "
                   "`flashtune tune` first)")
        return
    filters = "".join(f" {k}={v}" for k, v in (("device", device), ("template", template))
                      if v)
    try:
        with open_store(url, read_only=True, create=False) as store:
            studies = collect_studies(store, device_name=device, template_name=template)
    except FlashtuneError as exc:
        raise fail(exc) from exc
    if not studies:
        click.echo(f"nothing to report: no trials or best configs in {safe_url(url)}"
                   f"{filters and ' matching' + filters}")
        return
    try:
        written = write_report(studies, output, source=safe_url(url),
                               filters=filters and f" (filtered:{filters})")
    except OSError as exc:
        raise fail(exc) from exc
    for path in written.images:
        click.echo(f"wrote {path}")
    n = written.studies
    click.echo(f"wrote {written.page} ({n} stud{'y' if n == 1 else 'ies'}, "
               f"{len(written.images)} plots)")
