"""Rebuild ``flashtune_0002.db``: a SQLite database frozen at schema revision 0002.

Like ``flashtune_0001.db`` it must not change once released. It is the 0001 asset migrated
to 0002 by migration 0002 itself, plus what a job killed with ``kill -9`` under 0002 left
behind: a second run of the study, on host ``node-7``, still RUNNING, with one trial
(number 5) still RUNNING. Rebuild it only if it is lost::

    python tests/db_tests/assets/make_flashtune_0002.py
"""

from __future__ import annotations

import shutil
import sqlite3
import sys
from datetime import datetime
from pathlib import Path

from alembic import command
from sqlalchemy import MetaData, insert

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "flashtune_0001.db"
ASSET = HERE / "flashtune_0002.db"
T1 = datetime(2025, 2, 20, 14, 0, 0)  # naive UTC, as SQLite keeps it
CONFIG = '{"BLOCK_M":64,"BLOCK_N":64,"num_stages":3,"num_warps":4}'


def build(path: Path = ASSET) -> None:
    sys.path.insert(0, str(HERE.parents[2]))
    from flashtune.db.engine import make_engine, write_engine
    from flashtune.db.jsonutil import hash_canonical
    from flashtune.db.schema import alembic_config

    path.unlink(missing_ok=True)
    shutil.copyfile(SOURCE, path)
    engine = make_engine(f"sqlite:///{path}", wal=False)
    with write_engine(engine).begin() as conn:
        conn.exec_driver_sql("PRAGMA foreign_keys = OFF")
        command.upgrade(alembic_config(conn), "0002")
        meta = MetaData()
        meta.reflect(conn)
        t = meta.tables
        conn.execute(insert(t["ft_runs"]).values(
            id=2, device_id=1, template_id=1, problem_id=1,
            study_name="attn_fwd/NVIDIA_H100_80GB_HBM3/fp16-d128-causal-hq32-hkv8-b4-nq4096"
                       "-nk4096", sampler="TPESampler", seed=1,
            params_json='{"trials":10}', status="RUNNING", started_at=T1, finished_at=None,
            flashtune_version="0.2.0", torch_version="2.6.0+cu124", triton_version="3.2.0",
            cuda_version="12.4", driver_version="550.54.15", host="node-7"))
        conn.execute(insert(t["ft_trials"]).values(
            id=6, run_id=2, device_id=1, template_id=1, problem_id=1, number=5,
            config_json=CONFIG, config_hash=hash_canonical(CONFIG), state="RUNNING",
            message=None, median_ms=None, tflops=None, compile_s=None,
            started_at=T1.replace(minute=1), finished_at=None))
    engine.dispose()
    raw = sqlite3.connect(path, isolation_level=None)
    raw.execute("PRAGMA journal_mode = DELETE")
    raw.execute("VACUUM")
    raw.close()


if __name__ == "__main__":
    build()
    print(f"wrote {ASSET}")  # a script, not library code
