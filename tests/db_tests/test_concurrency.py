"""Several tuning processes on one SQLite file: nothing lost, numbers unique, best is min."""

from __future__ import annotations

import multiprocessing
import sqlite3
from pathlib import Path

import pytest

from flashtune.db import TrialState, open_store
from tests.db_tests.support import BUCKET, H100, KEY, PG_URL, wipe_postgres

WORKERS = 4
TRIALS_PER_WORKER = 25


def timing(worker: int, i: int) -> float:
    """A distinct, scrambled median per (worker, trial) so offers arrive in no order."""
    return 1.0 + ((worker * 31 + i * 17) % 97) / 10 + worker / 1000 + i / 100000


def work(args: tuple[str, int]) -> list[tuple[int, int, float, bool]]:
    """One tuning process: it creates the database if nobody has yet, then tunes."""
    url, worker = args
    out = []
    with open_store(url) as store:
        d = store.ensure_device(H100)
        t = store.ensure_template("attn_fwd", "5f0c2a9e41d7b3c8")
        p = store.ensure_problem("attn_fwd", KEY, BUCKET)
        run = store.create_run(d.id, t.id, p.id, study_name="race", sampler="random",
                               seed=worker)
        for i in range(TRIALS_PER_WORKER):
            ms = timing(worker, i)
            trial = store.start_trial(run.id, {"worker": worker, "i": i})
            store.finish_trial(trial.id, TrialState.COMPLETE, median_ms=ms, tflops=100 / ms)
            won = store.offer_best(d.id, t.id, p.id, config=trial.config, median_ms=ms,
                                   tflops=100 / ms, trial_id=trial.id, trials_count=i + 1)
            out.append((trial.id, trial.number, ms, won))
        store.finish_run(run.id, "COMPLETE")
    return out


@pytest.mark.parametrize("backend", ["sqlite-file", "postgresql"])
def test_four_processes_tune_one_study(tmp_path: Path, backend: str) -> None:
    path = tmp_path / "shared.db"  # does not exist yet: the workers race to create it
    url = f"sqlite:///{path}"
    if backend == "postgresql":
        if not PG_URL:
            pytest.skip("PostgreSQL backend: set FLASHTUNE_TEST_PG_URL")
        url = PG_URL
        wipe_postgres(url)
    try:
        with multiprocessing.get_context("spawn").Pool(WORKERS) as pool:
            results = pool.map(work, [(url, w) for w in range(WORKERS)])
        check(url, results)
        if backend == "sqlite-file":
            con = sqlite3.connect(path)
            try:
                assert con.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
                assert con.execute("PRAGMA journal_mode").fetchall() == [("wal",)]
            finally:
                con.close()
    finally:
        if backend == "postgresql":
            wipe_postgres(url)


def check(url: str, results: list[list[tuple[int, int, float, bool]]]) -> None:

    reported = [r for per_worker in results for r in per_worker]
    assert len(reported) == WORKERS * TRIALS_PER_WORKER
    with open_store(url, read_only=True) as store:
        trials = store.list_trials()
        assert len(trials) == WORKERS * TRIALS_PER_WORKER  # no trial lost
        assert sorted(t.number for t in trials) == list(range(WORKERS * TRIALS_PER_WORKER))
        assert {t.id for t in trials} == {r[0] for r in reported}
        assert all(t.state is TrialState.COMPLETE for t in trials)
        assert len(store.list_devices()) == len(store.list_templates()) == 1
        assert len(store.list_problems()) == 1
        info = store.info()
        assert info["counts"]["ft_runs"] == WORKERS and info["counts"]["ft_best_configs"] == 1
        [best] = store.list_best()
        fastest = min(reported, key=lambda r: r[2])
        assert best.median_ms == fastest[2] and best.trial_id == fastest[0]
        assert any(r[3] for r in reported if r[0] == fastest[0])  # its offer won
