"""Shared data of the export/import tests: databases built with the store API, dumps."""

from __future__ import annotations

import re
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import create_engine, text

from flashtune.core.device import DeviceFingerprint
from flashtune.core.problem import AttentionProblem
from flashtune.db import TrialState, open_store
from flashtune.db.exchange import ConfigDocument, ConfigEntry, DeviceInfo, document_to_json
from flashtune.db.models import FT_TABLES
from flashtune.kernel_templates import get_template

SOURCE = get_template("attn_fwd").source_hash  # the REAL current source hash
OLD_SOURCE = "0123456789abcdef"
PROBLEMS = (
    AttentionProblem(2, 8, 2, 256, 256, 64, True, "bf16"),
    AttentionProblem(1, 4, 4, 77, 133, 64, False, "fp16"),
    AttentionProblem(4, 32, 8, 4096, 4096, 128, True, "fp16"),
    AttentionProblem(3, 6, 3, 500, 1000, 96, False, "bf16"),
    AttentionProblem(1, 16, 16, 8192, 8192, 128, False, "bf16"),
)
CONFIGS = (
    {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2},
    {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3, "USE_TMA": 1},
    {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3, "USE_TMA": 1,
     "REVERSE_M": 1},
)
VERSIONS = dict(torch_version="2.5.1", triton_version="3.1.0", cuda_version="12.4",
                driver_version="550.54.15")
T0 = datetime(2025, 1, 31, 12, 0, 0, tzinfo=timezone.utc)


def populate(url: str, device: DeviceFingerprint, timings: dict[int, float], *,
             source: str = SOURCE, config: int = 0, versions: dict[str, str] = VERSIONS) -> None:
    """Tune ``PROBLEMS[i]`` at ``timings[i]`` ms on ``device`` (one run, one trial each)
    under ``versions`` (``create_run``'s version arguments)."""
    with open_store(url) as store:
        d = store.ensure_device(device)
        t = store.ensure_template("attn_fwd", source)
        for i, ms in timings.items():
            problem = PROBLEMS[i]
            p = store.ensure_problem("attn_fwd", problem.key(), problem.bucket())
            run = store.create_run(d.id, t.id, p.id, study_name=f"s{i}", sampler="tpe",
                                   **versions)
            cfg = CONFIGS[(i + config) % len(CONFIGS)]
            trial = store.record_trial(run.id, cfg, TrialState.COMPLETE, median_ms=ms,
                                       tflops=100.0 / ms)
            store.offer_best(d.id, t.id, p.id, config=cfg, median_ms=ms, tflops=100.0 / ms,
                             trial_id=trial.id, trials_count=10 + i)


def dump(url: str) -> dict[str, list[tuple[Any, ...]]]:
    """Every row of every ft_ table, in id order: the database's content."""
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return {table: [tuple(r) for r in conn.execute(text(
                f"SELECT * FROM {table} ORDER BY id"))] for table in FT_TABLES}
    finally:
        engine.dispose()


def without_exported_at(doc_json: str) -> str:
    """A document's JSON text with the value of ``exported_at`` blanked, all else as it
    is: what an export -> import -> export round trip gives back byte for byte."""
    text, n = re.subn(r'^ "exported_at": "[^"]*",$', ' "exported_at": "",', doc_json,
                      flags=re.M)
    assert n == 1, doc_json[:200]
    return text


def make_document(device: DeviceInfo | None = None, n: int = 3, *, source: str = SOURCE,
                  ms: float = 1.0) -> ConfigDocument:
    """A valid document of the first ``n`` problems."""
    entries = tuple(ConfigEntry(problem=p.key(), bucket=p.bucket(), config=dict(CONFIGS[i % 3]),
                                median_ms=ms + i, tflops=None if i == 1 else 50.0 + i,
                                trials=20 + i, tuned_at=T0)
                    for i, p in enumerate(PROBLEMS[:n]))
    return ConfigDocument(device or DeviceInfo("NVIDIA_H100_80GB_HBM3", "9.0", 132, 232448,
                                               85520809984),
                          {"flashtune": "0.1.0", "torch": "2.5.1", "triton": "3.1.0",
                           "cuda": "12.4", "driver": "550.54.15"},
                          "attn_fwd", source, entries, T0)


def valid_json(n: int = 3) -> str:
    return document_to_json(make_document(n=n))
