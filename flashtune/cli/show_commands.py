"""``flashtune show``: list the stored best configs.

The store is opened read-only and never created: a database file that does not exist yet
prints ``no tuned configs (database ... does not exist yet)`` and exits 0, like an empty
one. Other database errors are one-line messages with exit code 1. ``--software`` adds the
versions each config was tuned under to the table (``--json`` always has them, as
``software``).
"""

from __future__ import annotations

import json
from typing import Any

import click

from flashtune.cli.options import (
    db_url,
    device_filter_option,
    fail,
    json_option,
    template_filter_option,
)
from flashtune.cli.tune_commands import format_config, format_tflops

__all__ = ["best_to_dict", "show_command"]

_SHAPE_ORDER = ("batch", "heads_q", "heads_kv", "seqlen_q", "seqlen_k", "head_dim", "causal",
                "dtype")
_SOFTWARE_ORDER = ("flashtune", "torch", "triton", "cuda", "driver")  # --software's columns


def best_to_dict(best: Any) -> dict[str, Any]:
    """A :class:`~flashtune.db.BestConfigRecord` as JSON-ready values."""
    return {
        "device": best.device.name,
        "compute_capability": best.device.compute_capability,
        "template": best.template.name,
        "source_hash": best.template.source_hash,
        "problem": dict(best.problem.key),
        "bucket": best.problem.bucket,
        "config": dict(best.config),
        "median_ms": best.median_ms,
        "tflops": best.tflops,
        "trials": best.trials_count,
        "trial_id": best.trial_id,
        "tuned_at": best.tuned_at.isoformat(),
        "software": best.software.as_dict(),  # "" where unknown
    }


def _shape(key: dict[str, Any]) -> str:
    if all(k in key for k in _SHAPE_ORDER):
        causal = " causal" if key["causal"] else ""
        return (f"B={key['batch']} Hq={key['heads_q']} Hkv={key['heads_kv']} "
                f"Nq={key['seqlen_q']} Nk={key['seqlen_k']} D={key['head_dim']} "
                f"{key['dtype']}{causal}")
    return " ".join(f"{k}={v}" for k, v in key.items())


def _render(rows: list[dict[str, Any]], software: bool = False) -> str:
    header = ("device", "template", "shape", "config", "median ms", "TFLOP/s", "trials",
              "tuned_at", *(_SOFTWARE_ORDER if software else ()))
    body = [(r["device"], r["template"], _shape(r["problem"]), format_config(r["config"]),
             f"{r['median_ms']:.4f}", format_tflops(r["tflops"]),
             str(r["trials"]), r["tuned_at"][:19].replace("T", " "),
             *(r["software"][k] or "-" for k in (_SOFTWARE_ORDER if software else ())))
            for r in rows]
    widths = [max(len(c) for c in col) for col in zip(header, *body)]
    right = {4, 5, 6}
    return "\n".join("  ".join(c.rjust(w) if i in right else c.ljust(w)
                               for i, (c, w) in enumerate(zip(row, widths))).rstrip()
                     for row in [header, *body])


@click.command("show")
@device_filter_option
@template_filter_option
@json_option
@click.option("--software", is_flag=True,
              help="Also list the flashtune, torch, Triton, CUDA and driver versions each "
                   "config was tuned under ('-': unknown; --json always has them).")
@click.pass_context
def show_command(ctx: click.Context, device: str | None, template: str | None,
                 as_json: bool, software: bool) -> None:
    """List the stored best configs (database opened read-only)."""
    from flashtune.core.errors import StoreError
    from flashtune.db import open_store
    from flashtune.db.engine import default_db_url, missing_sqlite_file, safe_url

    url = db_url(ctx) or default_db_url(create=False)
    missing = missing_sqlite_file(url)
    if missing is not None:
        if as_json:
            click.echo("[]")
        else:
            click.echo(f"no tuned configs (database {missing} does not exist yet; "
                       "run `flashtune tune` first)")
        return
    try:
        with open_store(url, read_only=True, create=False) as store:
            rows = [best_to_dict(b) for b in
                    store.list_best(device_name=device, template_name=template)]
    except StoreError as exc:
        raise fail(exc) from exc
    if as_json:
        click.echo(json.dumps(rows, indent=2))
    elif not rows:
        filters = "".join(f" {k}={v}" for k, v in (("device", device), ("template", template))
                          if v)
        click.echo(f"no tuned configs in {safe_url(url)}{filters and ' matching' + filters}")
    else:
        click.echo(_render(rows, software))
