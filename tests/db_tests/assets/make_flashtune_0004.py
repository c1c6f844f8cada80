"""Rebuild ``flashtune_0004.db``: a SQLite database frozen at schema revision 0004.

Like the older assets it must not change once released. It is the 0003 asset migrated to
0004 by migration 0004 itself (best configs 1 and 2 took their trial's run's software,
the imported best config 3 none), plus what 0004 added: a best config imported from a
file with the software it was tuned under (problem 4: no trial, torch 2.7.0, Triton 3.3.0).

Rebuild it only if it is lost::

    python tests/db_tests/assets/make_flashtune_0004.py
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
SOURCE = HERE / "flashtune_0003.db"
ASSET = HERE / "flashtune_0004.db"
T3 = datetime(2026, 12, 20, 9, 30, 0)  # naive UTC, as SQLite keeps it
KEY_4 = ('{"batch":1,"causal":false,"dtype":"fp16","head_dim":128,"heads_kv":8,'
         '"heads_q":32,"seqlen_k":8192,"seqlen_q":1}')
BUCKET_4 = "fp16-d128-full-hq32-hkv8-b1-nq1-nk8192"
CONFIG_4 = '{"BLOCK_M":16,"BLOCK_N":128,"num_stages":2,"num_warps":4}'


def build(path: Path = ASSET) -> None:
    sys.path.insert(0, str(HERE.parents[2]))
    from flashtune.db.engine import make_engine, write_engine
    from flashtune.db.schema import alembic_config

    path.unlink(missing_ok=True)
    shutil.copyfile(SOURCE, path)
    engine = make_engine(f"sqlite:///{path}", wal=False)
    with write_engine(engine).begin() as conn:
        conn.exec_driver_sql("PRAGMA foreign_keys = OFF")
        command.upgrade(alembic_config(conn), "0004")
        meta = MetaData()
        meta.reflect(conn)
        t = meta.tables
        conn.execute(insert(t["ft_problems"]).values(
            id=4, template_name="attn_fwd", key_json=KEY_4, bucket=BUCKET_4, created_at=T3))
        conn.execute(insert(t["ft_best_configs"]).values(
            id=4, device_id=1, template_id=1, problem_id=4, config_json=CONFIG_4,
            median_ms=0.021, tflops=3.2, trial_id=None, trials_count=25, tuned_at=T3,
            flashtune_version="0.4.0", torch_version="2.7.0", triton_version="3.3.0",
            cuda_version="12.8", driver_version="570.86.10"))
    engine.dispose()
    raw = sqlite3.connect(path, isolation_level=None)
    raw.execute("PRAGMA journal_mode = DELETE")
    raw.execute("VACUUM")
    raw.close()


if __name__ == "__main__":
    build()
    print(f"wrote {ASSET}")  # a script, not library code
