"""How much any tuner could gain in a config space: the ceilings, from exhaustive sweeps.

    python -m flashtune.report.headroom \
        benchmarks/results/explore_fwd_occupancy_d128_h100.json \
        benchmarks/results/explore_fwd_occupancy_d64_h100.json \
        --fix MAXNREG=0,PERSISTENT=0 --tuned benchmarks/results/tune_grid_h100.json

(``python benchmarks/headroom.py ...`` runs the same command.)

Reads sweeps that timed every valid config of a space on each shape (the ``rows`` of
``benchmarks/explore_fwd_knobs.py``: per shape ``trials`` with config, state and median,
and ``picks.default``) and reports what a perfect tuner (one that always
finds the per-shape optimum) would reach:

* optimum vs the template default, per shape and geomean: the ceiling of issue 3's
  "tuned vs default";
* optimum vs the best single config (the one config, over the ``--single`` knobs, that
  minimises the geomean slowdown against each shape's optimum, among configs measured on
  every shape): the ceiling of "tuned vs best single config";

and, with ``--tuned`` (a ``benchmarks/tune_grid.py`` result), the tuner's measured ratios
next to them. Timings are each sweep's own medians, so shapes from different sweeps are never
compared with each other. No GPU needed: :func:`headroom` computes from the rows,
:func:`summary_lines` words the report, :func:`main` is the command line.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["SINGLE_KNOBS", "geomean", "headroom", "main", "parse_fix", "problem_label",
           "summary_lines", "tuned_ratios"]

SINGLE_KNOBS = "BLOCK_M,BLOCK_N,num_warps,num_stages"


def geomean(xs: Sequence[float]) -> float:
    """The geometric mean of positive numbers (``ValueError`` for none)."""
    if not xs:
        raise ValueError("geomean of nothing")
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def parse_fix(text: str) -> dict[str, int]:
    """``"MAXNREG=0,PERSISTENT=0"`` -> ``{"MAXNREG": 0, "PERSISTENT": 0}``."""
    out: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.partition("=")
        if not sep or not name:
            raise ValueError(f"--fix: expected KNOB=INT, got {part!r}")
        try:
            out[name] = int(value)
        except ValueError:
            raise ValueError(f"--fix: {name}'s value must be an integer, got {value!r}") from None
    return out


def problem_label(p: dict[str, Any]) -> str:
    """A problem key as ``"d128 n2048 causal b1 h16/16"``."""
    return (f"d{p['head_dim']} n{p['seqlen_q']}" + (" causal" if p["causal"] else "")
            + f" b{p['batch']} h{p['heads_q']}/{p['heads_kv']}")


def headroom(rows: list[dict[str, Any]], fix: dict[str, int],
             single_knobs: list[str]) -> dict[str, Any]:
    """The ceilings over ``rows`` (one per shape). Only COMPLETE trials whose config has
    every ``fix`` knob at its value count; a config's single-config identity is its values
    of ``single_knobs`` (other knobs, such as REVERSE_M set by causality, may differ)."""
    if not rows:
        raise ValueError("no shapes: the sweep files have no rows")
    shapes = []
    for row in rows:
        times: dict[str, float] = {}
        ident: dict[str, tuple[Any, ...]] = {}
        for t in row["trials"]:
            cfg = t["config"]
            if t["state"] != "COMPLETE" or any(cfg.get(k) != v for k, v in fix.items()):
                continue
            key = json.dumps(cfg, sort_keys=True)
            times[key] = t["median_ms"]
            ident[key] = tuple(cfg.get(k) for k in single_knobs)
        if not times:
            raise ValueError(f"{problem_label(row['problem'])}: no COMPLETE trial matches "
                             f"--fix {fix}")
        default = json.dumps(row["picks"]["default"], sort_keys=True)
        if default not in times:
            raise ValueError(f"{problem_label(row['problem'])}: the default config was not "
                             "measured (or is excluded by --fix)")
        best_key = min(times, key=times.__getitem__)
        by_ident: dict[tuple[Any, ...], float] = {}
        for key, ms in times.items():  # fastest config with these single-config knobs
            by_ident[ident[key]] = min(ms, by_ident.get(ident[key], math.inf))
        shapes.append({"problem": row["problem"], "configs": len(times),
                       "optimum_ms": times[best_key], "optimum": json.loads(best_key),
                       "default_ms": times[default],
                       "optimum_vs_default": times[default] / times[best_key],
                       "_by_ident": by_ident})
    common = set.intersection(*(set(s["_by_ident"]) for s in shapes))
    if not common:
        raise ValueError("no config was measured on every shape: no best single config")

    def slowdown(ident: tuple[Any, ...]) -> float:
        return geomean([s["_by_ident"][ident] / s["optimum_ms"] for s in shapes])

    single = min(sorted(common), key=slowdown)
    for s in shapes:
        s["optimum_vs_single"] = s.pop("_by_ident")[single] / s["optimum_ms"]
    return {
        "shapes": shapes,
        "fix": fix,
        "best_single": dict(zip(single_knobs, single)),
        "configs_on_every_shape": len(common),
        "ceiling_vs_default": geomean([s["optimum_vs_default"] for s in shapes]),
        "ceiling_vs_default_max": max(s["optimum_vs_default"] for s in shapes),
        "ceiling_vs_single": geomean([s["optimum_vs_single"] for s in shapes]),
        "ceiling_vs_single_max": max(s["optimum_vs_single"] for s in shapes),
    }


def tuned_ratios(tune_grid: dict[str, Any]) -> dict[str, float]:
    """What the tuner measured in a ``tune_grid.py`` result (geomeans over its grid)."""
    out = {"tuned_vs_default": tune_grid["summary"]["tuned_vs_default"]}
    single = tune_grid["summary"].get("best_single")
    if single:
        out["tuned_vs_single"] = geomean([r["tuned"] / r["best_single"] for r in single["rows"]])
    return out


def summary_lines(report: dict[str, Any]) -> list[str]:
    """The report as a table of shapes and the ceilings, one line each (what :func:`main`
    prints)."""
    lines = [f"{'shape':<34} {'configs':>7} {'opt/default':>11} {'opt/single':>10}"]
    for s in report["shapes"]:
        lines.append(f"{problem_label(s['problem']):<34} {s['configs']:>7} "
                     f"{s['optimum_vs_default']:>10.3f}x {s['optimum_vs_single']:>9.3f}x")
    lines += [f"best single config {report['best_single']} "
              f"({report['configs_on_every_shape']} configs measured on every shape)",
              f"ceiling, tuned vs default: {report['ceiling_vs_default']:.3f}x geomean "
              f"(max {report['ceiling_vs_default_max']:.3f}x)",
              f"ceiling, tuned vs best single: {report['ceiling_vs_single']:.3f}x geomean "
              f"(max {report['ceiling_vs_single_max']:.3f}x)"]
    for name, value in report.get("tuned", {}).items():
        lines.append(f"measured by the tuner, {name}: {value:.3f}x")
    return lines


def main(argv: list[str] | None = None) -> int:
    """The command line (see the module doc): prints the summary, writes the report as JSON
    with ``--out``; exit status 2 with one line on stderr for unreadable input."""
    ap = argparse.ArgumentParser(prog="python -m flashtune.report.headroom",
                                 description=(__doc__ or "").split("\n")[0])
    ap.add_argument("sweeps", nargs="+", type=Path, help="exhaustive sweep JSON files")
    ap.add_argument("--fix", default="", help="KNOB=INT,...: count only configs with these")
    ap.add_argument("--single", default=SINGLE_KNOBS,
                    help=f"knobs that identify a single config (default {SINGLE_KNOBS})")
    ap.add_argument("--tuned", type=Path, help="a tune_grid.py result to compare with")
    ap.add_argument("--out", type=Path, help="write the report as JSON here")
    args = ap.parse_args(argv)
    try:
        rows = [r for f in args.sweeps for r in json.loads(f.read_text())["rows"]]
        report = headroom(rows, parse_fix(args.fix), args.single.split(","))
    except (OSError, KeyError, ValueError) as exc:
        print(f"headroom: {exc}", file=sys.stderr)
        return 2
    report["sweeps"] = [str(f) for f in args.sweeps]
    if args.tuned:
        report["tuned"] = tuned_ratios(json.loads(args.tuned.read_text()))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    print("\n".join(summary_lines(report)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
