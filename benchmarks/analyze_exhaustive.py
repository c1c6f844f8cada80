"""Optuna vs the exhaustive grid, from the tuning databases a GPU run left behind.

    python benchmarks/analyze_exhaustive.py benchmarks/results/h100_tuning_dbs \
        > benchmarks/results/exhaustive_vs_optuna_h100.json

For each problem measured exhaustively (every valid config of the space): the optimum, the
exhaustive wall time (first trial start to last trial end), and for the TPE study of the
same problem the number of trials and seconds until a config within 2% of the optimum was
measured. Also the best single config over those problems (geomean of optimum / its time).
Reads the SQLite files directly (read-only), so it needs no GPU.
"""

from __future__ import annotations

import json
import math
import sqlite3
import sys
from datetime import datetime
from pathlib import Path


def trials(db: Path) -> dict[str, list[tuple]]:
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    rows = con.execute(
        "select p.key_json, t.run_id, t.number, t.state, t.median_ms, t.config_json, "
        "t.started_at, t.finished_at from ft_trials t join ft_problems p on p.id = t.problem_id "
        "order by p.key_json, t.number").fetchall()
    out: dict[str, list[tuple]] = {}
    for r in rows:
        out.setdefault(r[0], []).append(r[1:])
    return out


def ts(text: str) -> datetime:
    return datetime.fromisoformat(text)


def main() -> None:
    folder = Path(sys.argv[1])
    ex, tpe = trials(folder / "exhaustive.db"), trials(folder / "tpe.db")
    report, per_cfg = [], {}
    for key, rows in ex.items():
        done = [r for r in rows if r[2] == "COMPLETE"]
        best = min(done, key=lambda r: r[3])
        wall = (max(ts(r[6]) for r in rows) - min(ts(r[5]) for r in rows)).total_seconds()
        first_run = min(r[0] for r in tpe[key])
        tpe_rows = [r for r in tpe[key] if r[0] == first_run]
        t0 = min(ts(r[5]) for r in tpe_rows)
        hit = next(((i, (ts(r[6]) - t0).total_seconds()) for i, r in enumerate(tpe_rows, 1)
                    if r[2] == "COMPLETE" and r[3] <= 1.02 * best[3]), (None, None))
        tpe_best = min(r[3] for r in tpe_rows if r[2] == "COMPLETE")
        report.append({"problem": json.loads(key), "exhaustive_best_ms": best[3],
                       "exhaustive_best_config": json.loads(best[4]),
                       "exhaustive_configs": len(done), "exhaustive_wall_s": wall,
                       "tpe_trials_run": len(tpe_rows), "tpe_best_ms": tpe_best,
                       "tpe_best_over_optimum": tpe_best / best[3],
                       "tpe_trials_to_2pct": hit[0], "tpe_seconds_to_2pct": hit[1],
                       "tpe_fraction_of_exhaustive_wall": hit[1] / wall if hit[1] else None})
        for r in done:
            per_cfg.setdefault(r[4], {})[key] = best[3] / r[3]
    full = {c: v for c, v in per_cfg.items() if len(v) == len(ex)}
    geo = {c: 2 ** (sum(math.log2(x) for x in v.values()) / len(v)) for c, v in full.items()}
    single = max(geo, key=geo.get)
    print(json.dumps({"problems": report, "best_single_config": json.loads(single),
                      "best_single_fraction_of_optimum_geomean": geo[single],
                      "optimum_over_best_single_geomean": 1 / geo[single]}, indent=1))


if __name__ == "__main__":
    main()
