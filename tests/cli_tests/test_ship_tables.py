"""``benchmarks/ship_tables.sh``, the resumable run of the shipped plans (issue 26), on the
CPU under the interpreter: tiny plans in its PLAN_DIR, two worker slots as its "GPUs"; a
second command skips what the first tuned, and the database it copies out is one file."""

from __future__ import annotations

import json
import os
import re
import sqlite3
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PLAN = """op = "{op}"
[[shape]]
batch = 1
heads = 2
seqlen = 32
head_dim = 16
causal = true
dtype = "fp16"
"""


def _ship(tmp_path: Path, out: str, **more: str) -> str:
    env = {**os.environ, "SHIP_DB": str(tmp_path / "ship.db"), "PLAN_DIR": str(tmp_path),
           "OPS": "fwd", "GPUS": "0,1", "TRIALS": "1", "LIMIT": "300", "MARGIN": "60",
           "TUNE_ARGS": "--interpret", "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
           **more}
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "ship_tables.sh"), "tune",
                           str(tmp_path / out)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_the_ship_script_tunes_a_plan_then_skips_it_and_copies_one_database(tmp_path):
    (tmp_path / "shipped-fwd.toml").write_text(PLAN.format(op="fwd"))
    first = _ship(tmp_path, "one", VERBOSE="1")
    assert "== tune --op fwd" in first and "1 shape: 1 tuned" in first, first
    # VERBOSE: each worker's log, with times and its GPU (a spawned process logs nothing
    # unless told to): where a device command's time went
    assert re.search(r"\d\d:\d\d:\d\d,\d+ gpu0 INFO flashtune.autotune.workers: worker 0 on "
                     r"GPU 0: ready", first), first
    assert re.search(r"gpu[01] INFO flashtune.autotune.select: B=1 .*: \w+ chosen in [\d.]+ s",
                     first), first
    assert "worker 0 on GPU 0: ready" in (tmp_path / "one" / "tune_fwd.log").read_text()
    copy = tmp_path / "one" / "ship.db"
    assert copy.is_file() and not (tmp_path / "one" / "ship.db-wal").exists()
    with sqlite3.connect(copy) as db:  # the copy holds the choice
        assert db.execute("select count(*) from ft_choices").fetchone()[0] == 1
    second = _ship(tmp_path, "two")
    assert "already tuned (skipped)" in second, second


def _export(db: Path, to: Path, *more: str) -> list[Path]:
    subprocess.run([sys.executable, "-m", "flashtune", "--db", f"sqlite:///{db}", "export",
                    "-o", str(to), *more], cwd=ROOT, check=True, capture_output=True,
                   timeout=300)
    return sorted(to.glob("device_name=*.json"))


def test_a_new_database_starts_from_the_exported_files_of_this_device(tmp_path):
    """The database that carried a table between commands can be lost (it is git-ignored,
    and a new checkout lacks it): a first command imports this device's files from SEED,
    op files whose candidates make them current and the templates' files, and tunes only
    what they lack; an export from it then holds every entry it was seeded with."""
    (tmp_path / "shipped-fwd.toml").write_text(PLAN.format(op="fwd"))
    _ship(tmp_path, "one")
    seed = tmp_path / "seed"
    files = _export(tmp_path / "ship.db", seed)
    templates = [f for f in files if ",template=" in f.name]
    assert templates and len(files) == len(templates) + 1, files
    (tmp_path / "ship.db").unlink()
    again = _ship(tmp_path, "two", SEED=str(seed))
    assert (f"== a new database: importing {len(files)} file(s) of " in again
            and f"(1 op, {len(templates)} template)" in again), again
    assert "already tuned (skipped)" in again and "0 added" not in again, again
    def entries(paths: list[Path]) -> dict[str, int]:
        return {p.name: len(json.loads(p.read_text())["entries"]) for p in paths}

    assert entries(_export(tmp_path / "ship.db", tmp_path / "out")) == entries(files)
    assert "1 shape: 1 tuned" not in again
    # the next command finds the database and imports nothing
    third = _ship(tmp_path, "three", SEED=str(seed))
    assert "importing" not in third and "already tuned (skipped)" in third, third
