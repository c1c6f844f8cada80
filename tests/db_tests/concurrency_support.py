"""Helpers of the multi-process tests: worker entry points (importable by child processes),
fresh PostgreSQL databases, and the study-consistency checks shared by the concurrency and
crash tests."""

from __future__ import annotations

import multiprocessing
import sqlite3
import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any

from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from flashtune.db import TrialState, canonical_json
from flashtune.db.store import STALE_MESSAGE, TuningStore

PRELOAD = ["flashtune.autotune.jobs", "flashtune.kernel_templates", "optuna", "sqlalchemy",
           "tests.autotune_tests.synthetic"]


def fork_context() -> Any:
    """A forkserver context whose server has imported flashtune, torch, triton and optuna
    once: each worker then starts in milliseconds instead of seconds."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def replay_runner(spec: Any, problem: Any, device: Any, options: Any) -> Any:
    from flashtune.autotune.runners import ReplayRunner
    from tests.autotune_tests.synthetic import FIXTURE

    return ReplayRunner.from_json(FIXTURE)


def tune_worker(args: tuple[str, int, dict, int]) -> dict[str, Any]:
    """One tuning process on the synthetic H100 recording: ``(url, slot, problem key,
    trials)``; returns what its ``TuneResult`` says."""
    from flashtune.autotune.jobs import tune
    from flashtune.autotune.options import TuneOptions
    from flashtune.core.problem import AttentionProblem
    from tests.autotune_tests.synthetic import H100, RECORDED_SPACE

    url, slot, key, trials = args
    options = TuneOptions(trials=trials, sampler="random", seed=slot, top_k_confirm=3,
                          isolate=False)
    [res] = tune([AttentionProblem.from_key(key)], options, db_url=url, progress=False,
                 _runner_factory=replay_runner, _device=H100, _space=RECORDED_SPACE)
    return {"states": res.states, "trials": res.trials, "study": res.study_name,
            "best_ms": res.best_ms}


def crash_space() -> Any:
    """120 configs of attn_fwd (some pruned on the H100) for the kill -9 test."""
    from flashtune.core.space import SearchSpace
    from flashtune.kernel_templates.attn_fwd.space import check

    return SearchSpace(params={"BLOCK_M": (16, 32, 64, 128, 256), "BLOCK_N": (16, 32, 64, 128),
                               "num_warps": (4, 8), "num_stages": (2, 3, 4)}, predicate=check)


def slow_replay_runner(spec: Any, problem: Any, device: Any, options: Any,
                       in_trial: Any = None) -> Any:
    """The recording, 60-140 ms per config: most of a job's time is spent inside a trial,
    so a kill at a random moment usually lands in one. ``in_trial`` (an Event) is set when
    the first evaluation starts: the job is past its start-up and inside its loop."""
    import random
    import time

    runner = replay_runner(spec, problem, device, options)
    evaluate = runner.evaluate

    def slow(config: Any) -> Any:
        if in_trial is not None:
            in_trial.set()
        time.sleep(random.uniform(0.06, 0.14))
        return evaluate(config)

    runner.evaluate = slow
    return runner


def crash_job(url: str, seed: int, trials: int, in_trial: Any = None) -> None:
    """A grid-search tuning job on the synthetic recording (the kill -9 test's victim);
    ``in_trial`` is set once it is evaluating configs."""
    import functools

    from flashtune.autotune.jobs import tune
    from flashtune.autotune.options import TuneOptions
    from tests.autotune_tests.synthetic import H100, PROBLEM

    options = TuneOptions(trials=trials, sampler="grid", seed=seed, top_k_confirm=3,
                          isolate=False)
    factory = functools.partial(slow_replay_runner, in_trial=in_trial)
    tune([PROBLEM], options, db_url=url, progress=False, _runner_factory=factory,
         _device=H100, _space=crash_space())


def fresh_pg_database(server_url: str) -> Iterator[str]:
    """A new, empty database on the server of ``server_url`` (dropped afterwards): Optuna's
    tables start empty too."""
    name = f"ft_{uuid.uuid4().hex[:12]}"
    admin = create_engine(server_url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
        yield make_url(server_url).set(database=name).render_as_string(hide_password=False)
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    finally:
        admin.dispose()


def sqlite_integrity(path: Any) -> list[tuple]:
    con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return con.execute("PRAGMA integrity_check").fetchall()
    finally:
        con.close()


def check_study(store: TuningStore, ids: tuple[int, int, int], *,
                settled: bool = True) -> dict[str, Any]:
    """What must hold for every study, whoever wrote it and however they died:

    * trial numbers are 0..n-1, each once;
    * no config was measured twice (trials failed as stale and static prunes aside);
    * no trial is RUNNING unless its run is;
    * the best config row, if any, points at a COMPLETE trial of the same config, and is
      the fastest COMPLETE trial of the study once the last job has finished
      (``settled``; a job killed before its confirmation leaves faster trials unoffered).
    """
    dev, tpl, prob = ids
    trials = store.list_trials(device_id=dev, template_id=tpl, problem_id=prob)
    numbers = sorted(t.number for t in trials)
    assert numbers == list(range(len(trials))), "trial numbers are not 0..n-1"
    measured = [canonical_json(t.config) for t in trials
                if t.state not in (TrialState.PRUNED_STATIC, TrialState.DUPLICATE)
                and t.message != STALE_MESSAGE]
    twice = [k for k, n in Counter(measured).items() if n > 1]
    assert not twice, f"configs measured twice: {twice}"
    running_runs = {r.id for r in store.list_runs(dev, tpl, prob, status="RUNNING")}
    orphans = [t.id for t in trials if t.state is TrialState.RUNNING
               and t.run_id not in running_runs]
    assert not orphans, f"RUNNING trials of finished runs: {orphans}"
    complete = [t for t in trials if t.state is TrialState.COMPLETE]
    best = store.get_best(dev, tpl, prob)
    if best is not None:
        fastest = min(t.median_ms for t in complete)
        assert best.median_ms == fastest if settled else best.median_ms >= fastest, \
            (best.median_ms, fastest)
        winner = next(t for t in trials if t.id == best.trial_id)
        assert winner.state is TrialState.COMPLETE and winner.config == best.config
    return {"trials": trials, "complete": complete, "best": best}
