"""Rebuild ``flashtune_0003.db``: a SQLite database frozen at schema revision 0003.

Like the older assets it must not change once released. It is the 0002 asset migrated to
0003 by migration 0003 itself, plus two best configs beside the first study's (whose
trial 5 is of run 1, flashtune 0.1.0):

- problem 2 was tuned by run 3 (flashtune 0.3.0, torch 2.6.0+cu126, host node-7, pid
  4242): trial 7 is its best config;
- problem 3's best config was imported from a file: no trial, no run, so 0003 kept no
  software for it at all.

Rebuild it only if it is lost::

    python tests/db_tests/assets/make_flashtune_0003.py
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
SOURCE = HERE / "flashtune_0002.db"
ASSET = HERE / "flashtune_0003.db"
T2 = datetime(2026, 12, 1, 8, 0, 0)  # naive UTC, as SQLite keeps it
KEY_2 = ('{"batch":1,"causal":false,"dtype":"bf16","head_dim":64,"heads_kv":4,'
         '"heads_q":4,"seqlen_k":133,"seqlen_q":77}')
BUCKET_2 = "bf16-d64-full-hq4-hkv4-b1-nq128-nk256"
KEY_3 = ('{"batch":2,"causal":true,"dtype":"bf16","head_dim":64,"heads_kv":2,'
         '"heads_q":8,"seqlen_k":256,"seqlen_q":256}')
BUCKET_3 = "bf16-d64-causal-hq8-hkv2-b2-nq256-nk256"
CONFIG_2 = '{"BLOCK_M":64,"BLOCK_N":32,"num_stages":2,"num_warps":4}'
CONFIG_3 = '{"BLOCK_M":128,"BLOCK_N":64,"num_stages":3,"num_warps":8}'


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
        command.upgrade(alembic_config(conn), "0003")
        meta = MetaData()
        meta.reflect(conn)
        t = meta.tables
        for pid, key, bucket in ((2, KEY_2, BUCKET_2), (3, KEY_3, BUCKET_3)):
            conn.execute(insert(t["ft_problems"]).values(
                id=pid, template_name="attn_fwd", key_json=key, bucket=bucket, created_at=T2))
        conn.execute(insert(t["ft_runs"]).values(
            id=3, device_id=1, template_id=1, problem_id=2,
            study_name="attn_fwd/NVIDIA_H100_80GB_HBM3/" + BUCKET_2, sampler="TPESampler",
            seed=3, params_json='{"trials":1}', status="COMPLETE", started_at=T2,
            finished_at=T2.replace(minute=5), flashtune_version="0.3.0",
            torch_version="2.6.0+cu126", triton_version="3.2.0", cuda_version="12.6",
            driver_version="560.35.03", host="node-7", pid=4242))
        conn.execute(insert(t["ft_trials"]).values(
            id=7, run_id=3, device_id=1, template_id=1, problem_id=2, number=0,
            config_json=CONFIG_2, config_hash=hash_canonical(CONFIG_2), state="COMPLETE",
            message=None, median_ms=0.031, p20_ms=0.030, p80_ms=0.033, tflops=12.5,
            compile_s=2.5, started_at=T2.replace(minute=1),
            finished_at=T2.replace(minute=1, second=30)))
        conn.execute(insert(t["ft_best_configs"]).values(
            id=2, device_id=1, template_id=1, problem_id=2, config_json=CONFIG_2,
            median_ms=0.031, tflops=12.5, trial_id=7, trials_count=1,
            tuned_at=T2.replace(minute=5)))
        conn.execute(insert(t["ft_best_configs"]).values(
            id=3, device_id=1, template_id=1, problem_id=3, config_json=CONFIG_3,
            median_ms=0.052, tflops=None, trial_id=None, trials_count=40,
            tuned_at=datetime(2026, 11, 20, 17, 45, 0)))
    engine.dispose()
    raw = sqlite3.connect(path, isolation_level=None)
    raw.execute("PRAGMA journal_mode = DELETE")
    raw.execute("VACUUM")
    raw.close()


if __name__ == "__main__":
    build()
    print(f"wrote {ASSET}")  # a script, not library code
