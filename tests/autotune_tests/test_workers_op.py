"""``tune --op`` on several GPUs (flashtune.autotune.workers.tune_op_on_gpus), run on CPU as
interpreter slots with made-up timings: whole shapes spread over the workers into one
database, results in the plan's order, a worker that dies or cannot tune a shape reported
while the others go on, and ``skip_tuned`` honoured in the workers."""

from __future__ import annotations

import dataclasses
import os

import pytest

from flashtune.autotune.options import TuneOptions
from flashtune.autotune.select import tune_op
from flashtune.autotune.workers import WorkerError, tune_op_on_gpus
from flashtune.core.problem import AttentionProblem
from flashtune.db import open_store
from tests.autotune_tests.op_runners import (
    DIES_AT_HEAD_DIM,
    dying_runner,
    pid_runner,
    pool_runner,
    synthetic_runner,
)

P1 = AttentionProblem(1, 2, 2, 48, 48, 32, False, "fp16")
P2 = AttentionProblem(1, 2, 1, 24, 56, 32, False, "fp16")
DIES = AttentionProblem(1, 2, 2, 40, 40, DIES_AT_HEAD_DIM, True, "fp16")
OPTS = TuneOptions(trials=1, interpret=True, seed=0, top_k_confirm=1)


def test_two_workers_choose_for_every_shape_and_a_rerun_skips_them(tmp_path):
    url = f"sqlite:///{tmp_path / 'w.db'}"
    results = tune_op_on_gpus([P1, P2], "fwd", OPTS, db_url=url, gpus=[0, 1],
                              _runner_factory=synthetic_runner)
    assert [r.problem for r in results] == [P1, P2]
    assert all(r.winner is not None and not r.reused for r in results)
    assert all(r.results and r.results[0].problem == r.problem for r in results)
    with open_store(url) as store:
        choices = store.list_choices(op="fwd")
    assert sorted(c.problem_key["seqlen_q"] for c in choices) == [24, 48]

    again = tune_op_on_gpus([P1, P2], "fwd", OPTS, db_url=url, gpus=[0, 1],
                            skip_tuned=True, _runner_factory=synthetic_runner)
    assert [(r.problem, r.reused) for r in again] == [(P1, True), (P2, True)]
    assert [x.implementation for x in again[0].leaders] \
        == [x.implementation for x in results[0].leaders]


def _evaluating_pids(url: str) -> tuple[set[str], int]:
    """The processes that evaluated the database's trials, and how many searches ran."""
    with open_store(url) as store:
        trials, runs = store.list_trials(), store.list_runs()
    assert trials and all(t.message and t.message.startswith("pid ") for t in trials)
    return {t.message.split()[1] for t in trials}, len(runs)


def test_one_candidate_worker_serves_every_search_of_a_tune_op_call(tmp_path):
    """A candidate worker costs seconds to start on a GPU (a process, torch, a CUDA
    context): every implementation of every shape of one call is searched in the same one,
    and it is stopped when the call ends."""
    url = f"sqlite:///{tmp_path / 'one.db'}"
    isolated = dataclasses.replace(OPTS, isolate=True)
    results = tune_op([P1, P2], "fwd", isolated, db_url=url, progress=False, rounds=1,
                      _runner_factory=pid_runner)
    assert all(r.winner is not None for r in results)
    pids, searches = _evaluating_pids(url)
    assert searches >= 4  # attn_fwd and sdpa_math on each shape
    assert len(pids) == 1 and str(os.getpid()) not in pids, pids
    with pytest.raises(ProcessLookupError):
        os.kill(int(pids.pop()), 0)


def test_each_gpu_worker_keeps_one_candidate_worker_for_all_its_shapes(tmp_path):
    url = f"sqlite:///{tmp_path / 'two.db'}"
    isolated = dataclasses.replace(OPTS, isolate=True)
    shapes = [dataclasses.replace(P1, seqlen_q=n, seqlen_k=n) for n in (24, 32, 40, 48)]
    results = tune_op_on_gpus(shapes, "fwd", isolated, db_url=url, gpus=[0, 1],
                              _runner_factory=pid_runner)
    assert len(results) == 4
    pids, searches = _evaluating_pids(url)
    assert searches >= 8 and 1 <= len(pids) <= 2, pids


def test_a_gpu_worker_with_a_compile_pool_exits_when_its_shapes_are_done(tmp_path):
    """A worker process runs no atexit handler: its compile pool is stopped before it
    returns, or multiprocessing's exit waits on the pool's idle workers forever (on two
    H200s each command hung after its last shape until its timeout)."""
    import multiprocessing
    import threading

    url = f"sqlite:///{tmp_path / 'pool.db'}"
    out: list[object] = []
    call = threading.Thread(target=lambda: out.append(tune_op_on_gpus(
        [P1, P2], "fwd", OPTS, db_url=url, gpus=[0, 1], _runner_factory=pool_runner)))
    call.start()
    call.join(240)
    hung = call.is_alive()
    if hung:  # the workers wait on their pools: kill them so the session can go on
        for child in multiprocessing.active_children():
            child.kill()
        call.join(60)
    assert not hung, "the workers did not exit after their last shape"
    assert [r.problem for r in out[0]] == [P1, P2]


def test_a_dead_worker_and_a_refused_shape_are_reported_and_the_rest_finishes(tmp_path):
    url = f"sqlite:///{tmp_path / 'd.db'}"
    refused = AttentionProblem(1, 2, 2, 40, 40, 300, False, "fp16")  # no kernel serves D300
    with pytest.raises(WorkerError) as err:
        tune_op_on_gpus([P1, DIES, refused], "fwd", OPTS, db_url=url, gpus=[0, 1],
                        _runner_factory=dying_runner)
    message = str(err.value)
    assert f"died (exit code 3) while tuning {DIES.describe()}" in message
    assert f"could not tune {refused.describe()}: head_dim 300 is not supported" in message
    assert "--skip-tuned" in message
    assert [r.problem for r in err.value.results] == [P1]
    with open_store(url) as store:
        (choice,) = store.list_choices(op="fwd")
    assert choice.problem_key == P1.key()


def test_bad_arguments_are_refused_before_any_worker_starts(tmp_path):
    with pytest.raises(ValueError, match="in-memory database is private"):
        tune_op_on_gpus([P1], "fwd", OPTS, db_url="sqlite://", gpus=[0, 1])
    with pytest.raises(ValueError, match="duplicates"):
        tune_op_on_gpus([P1], "fwd", OPTS, db_url=f"sqlite:///{tmp_path / 'x.db'}",
                        gpus=[0, 0])
