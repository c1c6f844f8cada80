"""``flashtune show``: list the stored best configs, or (``--op``) the op choices.

The store is opened read-only and never created: a database file that does not exist yet
prints ``no tuned configs (database ... does not exist yet)`` and exits 0, like an empty
one. Other database errors are one-line messages with exit code 1. ``--software`` adds the
versions each config was tuned under to the table (``--json`` always has them, as
``software``).

``--op fwd|train|decode`` lists the tuner's op choices instead: per device and shape, the
implementation (and config) that serves it, its time and throughput, and its margins:
``1.07x over attn_fwd`` (the runner-up's time over the winner's) and the same over the
fastest extern implementation timed beside it (``winner`` when that extern won).
``--template`` then keeps the choices won by that implementation. Under the table, one line
per device says what the choices are worth against torch's backends: over the shapes where
an extern implementation was timed beside the winner, the fastest extern's time over the
chosen one's (what routing by them gains) and over flashtune's fastest own kernel's (what
its kernels reach alone), geomean and range (:func:`worth_lines`). Without ``--op`` the
table of best configs ends with a line counting the op choices, when there are any.

Stale entries are listed after the table (what, why, the command that re-tunes them): the
database's configs or choices tuned for another source of their implementation than this
flashtune's and not replaced since (never served), and the shipped tables in
``flashtune/configs/`` or ``$FLASHTUNE_CONFIG_DIR`` that are
(:func:`flashtune.runtime.sources.stale_tables`). ``--json`` rows carry ``stale``: the
reason, or null.
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
    op_filter_option,
    template_filter_option,
)
from flashtune.cli.tune_commands import format_config, format_tflops
from flashtune.core.problem import AttentionProblem

__all__ = ["best_to_dict", "choice_to_dict", "show_command", "worth_lines"]

_SHAPE_ORDER = ("batch", "heads_q", "heads_kv", "seqlen_q", "seqlen_k", "head_dim", "causal",
                "dtype")
_SOFTWARE_ORDER = ("flashtune", "torch", "triton", "cuda", "driver")  # --software's columns
STALE_LINES = 20  # stale entries listed after the table; the rest are counted


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


def choice_to_dict(choice: Any) -> dict[str, Any]:
    """A :class:`~flashtune.db.ChoiceRecord` as JSON-ready values (margins included)."""
    return {
        "device": choice.device.name,
        "compute_capability": choice.device.compute_capability,
        "op": choice.op,
        "problem": dict(choice.problem_key),
        "bucket": choice.bucket,
        "implementation": choice.implementation,
        "source_hash": choice.source_hash,
        "config": dict(choice.config),
        "median_ms": choice.median_ms,
        "tflops": choice.tflops,
        "runner_up": choice.runner_up,
        "runner_up_ms": choice.runner_up_ms,
        "margin": choice.margin,
        "extern": choice.extern,
        "extern_ms": choice.extern_ms,
        "extern_margin": choice.extern_margin,
        "candidates": [dict(c) for c in choice.candidates],
        "decided_at": choice.decided_at.isoformat(),
        "software": choice.software.as_dict(),  # "" where unknown
    }


def _margin(rival: str | None, margin: float | None, winner: str) -> str:
    """``1.07x over attn_fwd``; ``winner`` when the rival is the winner; ``-`` for none."""
    if rival is None or margin is None:
        return "-"
    return "winner" if rival == winner else f"{margin:.2f}x over {rival}"


def _shape(key: dict[str, Any]) -> str:
    if all(k in key for k in _SHAPE_ORDER):
        try:  # the problem's own line, score modifications included
            return AttentionProblem.from_key(key).describe()
        except (TypeError, ValueError):
            pass
    return " ".join(f"{k}={v}" for k, v in key.items())


def _render(rows: list[dict[str, Any]], software: bool = False) -> str:
    header = ("device", "template", "shape", "config", "median ms", "TFLOP/s", "trials",
              "tuned_at", *(_SOFTWARE_ORDER if software else ()))
    body = [(r["device"], r["template"], _shape(r["problem"]), format_config(r["config"]),
             f"{r['median_ms']:.4f}", format_tflops(r["tflops"]),
             str(r["trials"]), r["tuned_at"][:19].replace("T", " "),
             *(r["software"][k] or "-" for k in (_SOFTWARE_ORDER if software else ())))
            for r in rows]
    return _table(header, body, {4, 5, 6})


def _render_choices(rows: list[dict[str, Any]], software: bool = False) -> str:
    header = ("device", "op", "shape", "implementation", "config", "median ms", "TFLOP/s",
              "vs runner-up", "vs extern", "decided_at",
              *(_SOFTWARE_ORDER if software else ()))
    body = [(r["device"], r["op"], _shape(r["problem"]), r["implementation"],
             format_config(r["config"]), f"{r['median_ms']:.4f}", format_tflops(r["tflops"]),
             _margin(r["runner_up"], r["margin"], r["implementation"]),
             _margin(r["extern"], r["extern_margin"], r["implementation"]),
             r["decided_at"][:19].replace("T", " "),
             *(r["software"][k] or "-" for k in (_SOFTWARE_ORDER if software else ())))
            for r in rows]
    return _table(header, body, {5, 6})


def worth_lines(rows: list[dict[str, Any]]) -> list[str]:
    """Per device and op of the choice rows, against the fastest extern implementation
    timed beside each winner: ``NVIDIA_H100 fwd, 55 shapes against an extern: chosen 1.00x
    (1.00-1.09x), flashtune's own fastest 0.89x (0.63-1.09x) on 55; own kernels chosen on
    5``. Each figure is the extern's time over the other's (above 1:
    faster than torch's best backend). The own fastest comes from the stored candidates, or
    the winner or runner-up where a file carried none. A row whose own winner went stale
    (its kernel changed since) is left out; an extern winner's staleness is this machine's
    torch, not the timing's."""
    from flashtune.kernel_templates import catalog

    own = {name for name, spec in catalog().items() if spec.kind != "extern"}
    groups: dict[tuple[str, str], tuple[list[float], list[float], list[str]]] = {}
    for r in rows:
        if (r.get("stale") and r["implementation"] in own) or not r.get("extern_ms"):
            continue
        chosen, owns, winners = groups.setdefault((r["device"], r["op"]), ([], [], []))
        chosen.append(r["extern_ms"] / r["median_ms"])
        winners.append(r["implementation"])
        timed = [c["median_ms"] for c in r.get("candidates") or ()
                 if c.get("implementation") in own and c.get("median_ms")]
        timed += [ms for name, ms in ((r["implementation"], r["median_ms"]),
                                      (r["runner_up"], r["runner_up_ms"]))
                  if name in own and ms]
        if timed:
            owns.append(r["extern_ms"] / min(timed))
    lines = []
    for (device, op), (chosen, owns, winners) in groups.items():
        line = f"{device} {op}, {len(chosen)} shapes against an extern: chosen {_spread(chosen)}"
        if owns:
            line += f", flashtune's own fastest {_spread(owns)} on {len(owns)}"
        won = sum(w in own for w in winners)
        lines.append(f"{line}; own kernels chosen on {won}")
    return lines


def _spread(ratios: list[float]) -> str:
    """``0.93x (0.64-1.09x)``: the geomean and range of ``ratios``."""
    from flashtune.report.headroom import geomean

    return f"{geomean(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}x)"


def _table(header: tuple[str, ...], body: list[tuple[str, ...]], right: set[int]) -> str:
    widths = [max(len(c) for c in col) for col in zip(header, *body)]
    return "\n".join("  ".join(c.rjust(w) if i in right else c.ljust(w)
                               for i, (c, w) in enumerate(zip(row, widths))).rstrip()
                     for row in [header, *body])


@click.command("show")
@device_filter_option
@template_filter_option
@op_filter_option("List the op choices of this user op instead: which implementation "
                  "(and config) serves each shape, and its margins over the runner-up and "
                  "the fastest extern implementation (--template: won by it).")
@json_option
@click.option("--software", is_flag=True,
              help="Also list the flashtune, torch, Triton, CUDA and driver versions each "
                   "config was tuned under ('-': unknown; --json always has them).")
@click.pass_context
def show_command(ctx: click.Context, device: str | None, template: str | None,
                 op: str | None, as_json: bool, software: bool) -> None:
    """List the stored best configs, or an op's choices (database opened read-only)."""
    from flashtune.core.errors import StoreError
    from flashtune.db import open_store
    from flashtune.db.engine import default_db_url, missing_sqlite_file, safe_url

    url = db_url(ctx) or default_db_url(create=False)
    missing = missing_sqlite_file(url)
    if missing is not None:
        if as_json:
            click.echo("[]")
        else:
            what = "op choices" if op else "tuned configs"
            click.echo(f"no {what} (database {missing} does not exist yet; "
                       "run `flashtune tune` first)")
        return
    try:
        with open_store(url, read_only=True, create=False) as store:
            if op is not None:
                rows = [choice_to_dict(c) for c in store.list_choices(device_name=device, op=op)
                        if template is None or c.implementation == template]
                ops: dict[str, int] = {}
            else:
                rows = [best_to_dict(b) for b in
                        store.list_best(device_name=device, template_name=template)]
                ops = {}
                if not as_json:
                    for c in store.list_choices(device_name=device):
                        ops[c.op] = ops.get(c.op, 0) + 1
    except StoreError as exc:
        raise fail(exc) from exc
    stale_rows, shipped = _stale(rows, op)
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    filters = "".join(f" {k}={v}" for k, v in (("device", device), ("template", template),
                                                ("op", op)) if v)
    if not rows:
        what = "op choices" if op else "tuned configs"
        click.echo(f"no {what} in {safe_url(url)}{filters and ' matching' + filters}")
    else:
        click.echo(_render_choices(rows, software) if op else _render(rows, software))
        if op:
            for line in worth_lines(rows):
                click.echo(line)
    if ops:
        n = sum(ops.values())
        counts = ", ".join(f"{k}: {v}" for k, v in sorted(ops.items()))
        click.echo(f"{n} op choice{'' if n == 1 else 's'} stored ({counts}): list them with "
                   "`flashtune show --op OP`")
    lines = [f"  {r['device']} {r.get('op') and 'op ' + r['op'] + ': ' or ''}"
             f"{r.get('implementation') or r.get('template')} {_shape(r['problem'])}: "
             f"{r['stale']}; re-tune on that GPU: {r['retune']}" for r in stale_rows]
    lines += [f"  {t.line()}" for t in shipped]
    if lines:
        click.echo(f"stale, not served ({len(lines)}):")
        for line in lines[:STALE_LINES]:
            click.echo(line)
        if len(lines) > STALE_LINES:
            click.echo(f"  ... and {len(lines) - STALE_LINES} more (`flashtune show --json` "
                       "and `flashtune db verify` list them)")


def _stale(rows: list[dict[str, Any]], op: str | None
           ) -> tuple[list[dict[str, Any]], list[Any]]:
    """Marks each row ``stale`` (the reason, or None) and ``retune`` (the command); returns
    the stale rows and the stale shipped tables."""
    from flashtune.autotune.plans import tune_command
    from flashtune.kernel_templates import catalog
    from flashtune.runtime.sources import stale_tables

    specs = dict(catalog()) if op is None else dict(catalog().for_op(op))
    name = "implementation" if op else "template"

    def reason(r: dict[str, Any]) -> str | None:
        spec = specs.get(r[name])
        if spec is None:
            return f"this flashtune has no {name} {r[name]}"
        if spec.source_hash != r["source_hash"]:
            return (f"tuned for {r[name]} source {r['source_hash']}, this flashtune's is "
                    f"{spec.source_hash}")
        return None
    current = set()
    for r in rows:
        r["stale"] = reason(r)
        if r["stale"] is None:
            current.add((r["device"], r[name], json.dumps(r["problem"], sort_keys=True)))
    stale = []
    for r in rows:
        if r["stale"] is not None and (r["device"], r[name], json.dumps(
                r["problem"], sort_keys=True)) in current:
            r["stale"] = None  # an older source's result, replaced since: history
        if r["stale"] is None:
            continue
        try:
            problem = AttentionProblem.from_key(r["problem"])
            r["retune"] = tune_command(problem, op=op, template=None if op else r[name])
        except (TypeError, ValueError) as exc:
            r["retune"] = f"(no single command: {exc})"
        stale.append(r)
    tables, _ = stale_tables()
    return stale, tables
