"""Eight processes on one database: nothing lost, numbers unique, the best is the fastest.

Two levels, each on a SQLite file and on PostgreSQL (``pg_url``: a throwaway server on
loopback when PostgreSQL is installed, else skipped with the reason):

* store level: 8 processes start, finish and offer trials of one study as fast as they can;
* job level: 8 ``tune`` jobs (the synthetic H100 recording replayed) on one study, and on
  8 different shapes.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from flashtune.db import RunStatus, TrialState, open_store
from tests.db_tests.concurrency_support import (
    check_study,
    fork_context,
    fresh_pg_database,
    sqlite_integrity,
    tune_worker,
)
from tests.db_tests.support import BUCKET, H100, KEY

WORKERS = 8
TRIALS_PER_WORKER = 25
JOB_TRIALS = 6
SHAPE = {"batch": 4, "heads_q": 16, "heads_kv": 16, "seqlen_q": 4096, "seqlen_k": 4096,
         "head_dim": 128, "causal": False, "dtype": "fp16"}


@pytest.fixture(params=["sqlite-file", "postgresql"])
def backend_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A database that does not exist yet (SQLite: the workers race to create the file)."""
    if request.param == "sqlite-file":
        yield f"sqlite:///{tmp_path / 'shared.db'}"
    else:
        yield from fresh_pg_database(request.getfixturevalue("pg_url"))


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


def test_eight_processes_write_one_study(backend_url: str) -> None:
    with fork_context().Pool(WORKERS) as pool:
        results = pool.map(work, [(backend_url, w) for w in range(WORKERS)])
    reported = [r for per_worker in results for r in per_worker]
    assert len(reported) == WORKERS * TRIALS_PER_WORKER
    with open_store(backend_url, read_only=True) as store:
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
    _check_file(backend_url)


@pytest.mark.parametrize("shapes", ["identical", "different"])
def test_eight_tuning_jobs(backend_url: str, shapes: str) -> None:
    keys = [dict(SHAPE) if shapes == "identical" else {**SHAPE, "batch": 1 + w}
            for w in range(WORKERS)]
    with fork_context().Pool(WORKERS) as pool:
        results = pool.map(tune_worker, [(backend_url, w, keys[w], JOB_TRIALS)
                                         for w in range(WORKERS)])
    assert all(r["trials"] == JOB_TRIALS for r in results)
    assert len({r["study"] for r in results}) == (1 if shapes == "identical" else WORKERS)
    with open_store(backend_url, read_only=True) as store:
        problems = store.list_problems()
        assert len(problems) == len({r["study"] for r in results})
        [device], [template] = store.list_devices(), store.list_templates()
        recorded = 0
        for problem in problems:
            study = check_study(store, (device.id, template.id, problem.id))
            recorded += len(study["trials"])
            assert study["best"] is not None  # confirmed and offered
            assert not [t for t in study["trials"] if t.state is TrialState.RUNNING]
        # every trial a job reported is in the database, and nothing else is
        assert recorded == sum(sum(r["states"].values()) for r in results)
        runs = store.list_runs()
        assert len(runs) == WORKERS and all(r.status is RunStatus.COMPLETE for r in runs)
        # the best of each study is the fastest of its confirmed configs: what the last
        # job to finish reported
        for r in results:
            [best] = [b for b in store.list_best() if r["study"].endswith(b.problem.key_json)]
            assert best.median_ms <= r["best_ms"]
    _check_file(backend_url)


def _check_file(url: str) -> None:
    if url.startswith("sqlite:///"):
        assert sqlite_integrity(url[len("sqlite:///"):]) == [("ok",)]
