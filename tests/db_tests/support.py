"""Shared data and helpers of the db tests (the fixtures are in conftest.py)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import create_engine, text

from flashtune.core.device import DeviceFingerprint
from flashtune.db.models import Base
from flashtune.db.records import DeviceRecord, ProblemRecord, RunRecord, TemplateRecord
from flashtune.db.schema import VERSION_TABLE
from flashtune.db.store import TuningStore

PG_ENV = "FLASHTUNE_TEST_PG_URL"
PG_URL = os.environ.get(PG_ENV, "").strip()
ASSETS = Path(__file__).resolve().parent / "assets"

H100 = DeviceFingerprint(name="NVIDIA_H100_80GB_HBM3", compute_capability="9.0", sm_count=132,
                         shared_mem_per_block=232448, total_memory=85520809984,
                         cuda_version="12.4", driver_version="550.54.15",
                         torch_version="2.5.1", triton_version="3.1.0")
A100 = DeviceFingerprint(name="NVIDIA_A100-SXM4-80GB", compute_capability="8.0", sm_count=108,
                         shared_mem_per_block=166912, total_memory=85095874560)
KEY = {"batch": 4, "heads_q": 32, "heads_kv": 8, "seqlen_q": 4096, "seqlen_k": 4096,
       "head_dim": 128, "causal": True, "dtype": "fp16"}
BUCKET = "fp16-d128-causal-hq32-hkv8-b4-nq4096-nk4096"


def wipe_postgres(url: str) -> None:
    """Drop flashtune's tables and version table (never Optuna's or anything else)."""
    engine = create_engine(url)
    try:
        with engine.begin() as conn:
            Base.metadata.drop_all(conn)
            conn.execute(text(f"DROP TABLE IF EXISTS {VERSION_TABLE}"))
    finally:
        engine.dispose()


@dataclass(frozen=True)
class Study:
    device: DeviceRecord
    template: TemplateRecord
    problem: ProblemRecord
    run: RunRecord

    @property
    def ids(self) -> tuple[int, int, int]:
        return self.device.id, self.template.id, self.problem.id


def make_study(store: TuningStore, device: DeviceFingerprint = H100,
               template: str = "attn_fwd", key: dict | None = None,
               bucket: str = BUCKET) -> Study:
    d = store.ensure_device(device)
    t = store.ensure_template(template, "5f0c2a9e41d7b3c8")
    p = store.ensure_problem(template, key or KEY, bucket)
    r = store.create_run(d.id, t.id, p.id, study_name="s", sampler="TPESampler", seed=0)
    return Study(d, t, p, r)


