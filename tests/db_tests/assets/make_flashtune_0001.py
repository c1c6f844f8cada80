"""Rebuild ``flashtune_0001.db``: a SQLite database frozen at schema revision 0001.

The asset is committed and must not change once released: it stands for databases that
users created with the first schema. Rebuild it only if it is lost::

    python tests/db_tests/assets/make_flashtune_0001.py

It is built with migration 0001 itself, in rollback-journal mode (one self-contained
file), and holds one H100 study: a device, a template, a problem, a finished run, five
trials in various states and the best config.
"""

from __future__ import annotations

import sqlite3
import sys
from datetime import datetime
from pathlib import Path

from alembic import command
from sqlalchemy import MetaData, insert

HERE = Path(__file__).resolve().parent
ASSET = HERE / "flashtune_0001.db"

KEY_JSON = ('{"batch":4,"causal":true,"dtype":"fp16","head_dim":128,"heads_kv":8,'
            '"heads_q":32,"seqlen_k":4096,"seqlen_q":4096}')
BUCKET = "fp16-d128-causal-hq32-hkv8-b4-nq4096-nk4096"
T0 = datetime(2025, 1, 21, 9, 30, 0)  # naive UTC, as SQLite keeps it

TRIALS = [  # number, config json, state, message, median ms, tflops
    (0, '{"BLOCK_M":128,"BLOCK_N":64,"num_stages":3,"num_warps":8}', "COMPLETE", None,
     1.482, 371.2),
    (1, '{"BLOCK_M":256,"BLOCK_N":128,"num_stages":4,"num_warps":8}', "PRUNED_STATIC",
     "needs 294912 bytes of shared memory, device allows 232448", None, None),
    (2, '{"BLOCK_M":64,"BLOCK_N":64,"num_stages":2,"num_warps":4}', "COMPLETE", None,
     2.105, 261.3),
    (3, '{"BLOCK_M":128,"BLOCK_N":128,"num_stages":3,"num_warps":8}', "OUT_OF_RESOURCES",
     "out of resource: shared memory, Required: 262144, Hardware limit: 232448", None, None),
    (4, '{"BLOCK_M":128,"BLOCK_N":64,"num_stages":4,"num_warps":4}', "COMPLETE", None,
     1.397, 393.8),
]


def build(path: Path = ASSET) -> None:
    sys.path.insert(0, str(HERE.parents[2]))
    from flashtune.db.engine import make_engine, write_engine
    from flashtune.db.jsonutil import hash_canonical
    from flashtune.db.schema import alembic_config

    path.unlink(missing_ok=True)
    engine = make_engine(f"sqlite:///{path}", wal=False)
    with write_engine(engine).begin() as conn:
        command.upgrade(alembic_config(conn), "0001")
        meta = MetaData()
        meta.reflect(conn)
        t = meta.tables
        conn.execute(insert(t["ft_devices"]).values(
            id=1, name="NVIDIA_H100_80GB_HBM3", compute_capability="9.0", sm_count=132,
            shared_mem_per_block=232448, total_memory=85520809984, created_at=T0))
        conn.execute(insert(t["ft_templates"]).values(
            id=1, name="attn_fwd", source_hash="5f0c2a9e41d7b3c8", created_at=T0))
        conn.execute(insert(t["ft_problems"]).values(
            id=1, template_name="attn_fwd", key_json=KEY_JSON, bucket=BUCKET, created_at=T0))
        conn.execute(insert(t["ft_runs"]).values(
            id=1, device_id=1, template_id=1, problem_id=1,
            study_name="attn_fwd/NVIDIA_H100_80GB_HBM3/" + BUCKET, sampler="TPESampler",
            seed=0, params_json='{"n_trials":5,"timeout_s":600}', status="COMPLETE",
            started_at=T0, finished_at=T0.replace(minute=41), flashtune_version="0.1.0",
            torch_version="2.5.1+cu124", triton_version="3.1.0", cuda_version="12.4"))
        for number, cfg, state, message, ms, tflops in TRIALS:
            start = T0.replace(minute=31 + 2 * number)
            conn.execute(insert(t["ft_trials"]).values(
                id=number + 1, run_id=1, device_id=1, template_id=1, problem_id=1,
                number=number, config_json=cfg, config_hash=hash_canonical(cfg), state=state,
                message=message, median_ms=ms, tflops=tflops,
                compile_s=None if state == "PRUNED_STATIC" else 3.5 + number / 10,
                started_at=start, finished_at=start.replace(second=40)))
        conn.execute(insert(t["ft_best_configs"]).values(
            id=1, device_id=1, template_id=1, problem_id=1, config_json=TRIALS[4][1],
            median_ms=1.397, tflops=393.8, trial_id=5, trials_count=5,
            tuned_at=T0.replace(minute=41)))
    engine.dispose()
    raw = sqlite3.connect(path, isolation_level=None)
    raw.execute("VACUUM")  # compact, and outside any transaction
    raw.close()


if __name__ == "__main__":
    build()
    print(f"wrote {ASSET}")  # a script, not library code
