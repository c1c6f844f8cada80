"""kill -9 a tuning job at random moments, many times; then resume it to the end.

Each victim is a real ``tune`` job (grid search over 120 attn_fwd configs, the synthetic
H100 recording replayed at 60-140 ms per config) in a process forked from a preloaded
server, killed with SIGKILL after a random delay: one victim in four counted from its start
(start-up included), the others from its first evaluation (so the kills land inside the
tuning loop however slow the machine is to import and open the database; a fixed delay
from the start missed every trial on a loaded CI machine). After every kill the database must be
consistent; the next job must fail the dead job's RUNNING trial at once (the dead run's
pid is gone), not after the time-based stale limit; the final job must finish the study
with every config measured exactly once. Each victim has a seed of its own (the grid
order must not depend on it).
"""

from __future__ import annotations

import os
import random
import signal
import time

import pytest

from flashtune.autotune.study import _optuna_storage
from flashtune.db import RunStatus, TrialState, canonical_json, open_store
from flashtune.db.store import STALE_MESSAGE
from tests.autotune_tests.synthetic import H100, PROBLEM
from tests.db_tests.concurrency_support import (
    check_study,
    crash_job,
    crash_space,
    fork_context,
    sqlite_integrity,
)

KILLS = 20


def _interrupting_factory(after: int):
    """The synthetic recording, except that the ``after``-th evaluation is a Ctrl-C."""
    from flashtune.autotune.runners import ReplayRunner
    from tests.autotune_tests.synthetic import FIXTURE

    def factory(spec, problem, device, options):
        runner = ReplayRunner.from_json(FIXTURE)
        evaluate, calls = runner.evaluate, []

        def interrupting(config):
            calls.append(config)
            if len(calls) == after:
                raise KeyboardInterrupt
            return evaluate(config)

        runner.evaluate = interrupting
        return runner

    return factory


@pytest.mark.parametrize("workers", [1, 4])
def test_interrupted_grid_study_resumed_with_other_seeds_measures_every_config_once(
        tmp_path, workers):
    """Deterministic: each interrupted job leaves a grid point Optuna counts as visited
    but whose config was never measured, and each job has a seed of its own (as the
    workers of ``tune --gpus`` do). The last job must still measure every config of the
    grid, each once; with batches of ``workers`` configs asked at once (a GPU compiles them
    side by side), an interrupted job can leave up to a batch of them."""
    import optuna

    from flashtune.autotune.jobs import tune
    from flashtune.autotune.options import TuneOptions

    space = crash_space()
    url = f"sqlite:///{tmp_path / 'grid.db'}"

    def job(seed, after):
        options = TuneOptions(sampler="grid", seed=seed, trials=10_000, top_k_confirm=2,
                              workers=workers)
        return tune([PROBLEM], options, db_url=url, progress=False, _device=H100,
                    _runner_factory=_interrupting_factory(after), _space=space)

    for seed, after in ((1, 7), (2, 30), (3, 2)):
        with pytest.raises(KeyboardInterrupt):
            job(seed, after)
    [res] = job(4, 0)
    with open_store(url, read_only=True) as store:
        ids = _study_ids(store)
        study = check_study(store, ids)
        interrupted = [t for t in study["trials"] if t.message == STALE_MESSAGE]
        assert 3 <= len(interrupted) <= 3 * workers
        measured = sorted(canonical_json(t.config) for t in study["trials"]
                          if t.state is not TrialState.PRUNED_STATIC
                          and t.message != STALE_MESSAGE)
        valid = sorted(canonical_json(c) for c in space.valid_configs(PROBLEM, H100))
        assert measured == valid
        assert {r.status for r in store.list_runs()} == {RunStatus.INTERRUPTED,
                                                        RunStatus.COMPLETE}
    assert res.best_ms == study["best"].median_ms
    # every job walked the one grid order: each point asked about once, plus the points
    # lost (a batch at most per interrupted job) and queued again and the warm start's default
    asked = optuna.load_study(study_name=res.study_name, storage=url).trials
    assert len(asked) <= space.size + 3 * workers + 1, len(asked)


def _study_ids(store):
    [device], [template], [problem] = (store.list_devices(), store.list_templates(),
                                       store.list_problems())
    return device.id, template.id, problem.id


def test_kill_9_at_random_points_then_resume(tmp_path):
    path = tmp_path / "crash.db"
    url = f"sqlite:///{path}"
    open_store(url).close()  # both schemas exist before the first victim starts
    _optuna_storage(url)
    ctx = fork_context()
    rng = random.Random(20261130)
    left_running = []  # RUNNING trials found right after a kill
    t0 = time.monotonic()
    for i in range(KILLS):
        in_trial = ctx.Event()
        proc = ctx.Process(target=crash_job, args=(url, i, 1000, in_trial))
        proc.start()
        if i % 4 == 0:  # anywhere, start-up included
            time.sleep(rng.uniform(0.0, 1.0))
        else:  # somewhere in the tuning loop, however slow the machine is to get there
            assert in_trial.wait(120), f"victim {i} never reached its first trial"
            time.sleep(rng.uniform(0.0, 0.6))
        try:
            os.kill(proc.pid, signal.SIGKILL)
        except ProcessLookupError:  # it ended (and the fork server reaped it): see below
            pass
        proc.join()
        assert proc.exitcode == -signal.SIGKILL, f"victim {i} ended before its kill"
        assert sqlite_integrity(path) == [("ok",)]
        with open_store(url, read_only=True) as store:
            if not store.list_problems():
                continue  # killed before it wrote anything
            study = check_study(store, _study_ids(store), settled=False)
            left_running += [t.id for t in study["trials"] if t.state is TrialState.RUNNING]
    kill_s = time.monotonic() - t0
    assert len(left_running) >= 3, "too few kills landed inside a trial to prove anything"

    # resume: the final job finishes the study
    start = time.monotonic()
    crash_job(url, KILLS, 1000)
    resume_s = time.monotonic() - start
    assert sqlite_integrity(path) == [("ok",)]
    space = crash_space()
    with open_store(url, read_only=True) as store:
        ids = _study_ids(store)
        study = check_study(store, ids)
        trials = {t.id: t for t in study["trials"]}
        # every RUNNING trial a kill left behind was failed as stale, not left hanging
        for tid in left_running:
            assert trials[tid].state is TrialState.RUNTIME_ERROR
            assert trials[tid].message == STALE_MESSAGE
        runs = store.list_runs()
        assert runs[-1].status is RunStatus.COMPLETE
        assert all(r.status is RunStatus.FAILED for r in runs[:-1]), \
            [(r.id, r.status) for r in runs]
        # every config measured exactly once; every invalid one pruned
        valid = {canonical_json(c) for c in space.valid_configs(PROBLEM, H100)}
        measured = [canonical_json(t.config) for t in study["trials"]
                    if t.state not in (TrialState.PRUNED_STATIC, TrialState.RUNNING)
                    and t.message != STALE_MESSAGE]
        assert sorted(measured) == sorted(valid)
        assert study["best"] is not None
    # facts for RELIABILITY.md
    print(f"\n{KILLS} kills in {kill_s:.1f} s, {len(left_running)} inside a trial; "
          f"resume {resume_s:.1f} s; {len(runs)} runs, {len(trials)} trials")
