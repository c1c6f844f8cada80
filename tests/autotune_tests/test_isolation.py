"""Candidate isolation: a candidate that segfaults, aborts or hangs costs its worker, not
the job (CPU; the GPU proof with a faulty kernel is test_isolation_gpu)."""

from __future__ import annotations

import dataclasses
import os

import pytest

from flashtune.autotune import trial_loop as loop
from flashtune.autotune.isolation import IsolatedRunner, IsolationError, factory_path
from flashtune.autotune.jobs import tune
from flashtune.autotune.options import TuneOptions
from flashtune.core.device import interpreter_device
from flashtune.core.errors import ConfigError
from flashtune.core.problem import AttentionProblem
from flashtune.core.space import SearchSpace
from flashtune.db import RunStatus, TrialState, open_store
from flashtune.kernel_templates import get_template
from tests.autotune_tests import faulty
from tests.conftest import DEVICE

PROBLEM = AttentionProblem(1, 2, 2, 64, 48, 32, True, "fp16")
SPACE = SearchSpace(params={"BLOCK_M": (16, 32), "BLOCK_N": (16, 32, 64), "num_warps": (2,),
                            "num_stages": (1,)}, predicate=lambda c, p, d: None)
OPTS = TuneOptions(trials=10, sampler="grid", seed=0, interpret=True, top_k_confirm=2,
                   isolate=True, trial_timeout_s=3.0)


def test_crashes_and_hangs_are_recorded_and_the_job_goes_on(tmp_path):
    url = f"sqlite:///{tmp_path / 'ft.db'}"
    [res] = tune([PROBLEM], OPTS, db_url=url, progress=False,
                 _runner_factory=faulty.crashing_runner, _space=SPACE)
    assert res.states == {"COMPLETE": 3, "RUNTIME_ERROR": 2, "TIMEOUT": 1}
    assert res.best_config == {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 2, "num_stages": 1}
    assert res.best_ms == pytest.approx(faulty.synthetic_ms(res.best_config))
    with open_store(url) as store:
        trials = store.list_trials()
        [run] = store.list_runs()
    assert run.status is RunStatus.COMPLETE
    by_mode = {(t.config["BLOCK_M"], t.config["BLOCK_N"]): t for t in trials}
    assert len(by_mode) == len(trials) == 6
    segv, abort, hang = by_mode[(16, 64)], by_mode[(32, 32)], by_mode[(32, 64)]
    assert segv.state is TrialState.RUNTIME_ERROR and "killed by SIGSEGV" in segv.message
    assert abort.state is TrialState.RUNTIME_ERROR and "killed by SIGABRT" in abort.message
    assert hang.state is TrialState.TIMEOUT and hang.message.startswith("no result within 3 s")
    assert all("\n" not in t.message for t in (segv, abort, hang))
    assert sorted(t.number for t in trials) == list(range(6))


def test_isolated_runner_restarts_its_worker(tmp_path):
    spec = get_template("attn_fwd")
    with IsolatedRunner(faulty.crashing_runner, spec, PROBLEM, interpreter_device(), OPTS,
                        timeout_s=60) as runner:
        first = runner.pid
        good = {"BLOCK_M": 16, "BLOCK_N": 32}
        assert runner.evaluate(good).state is TrialState.COMPLETE
        assert runner.pid == first  # one worker serves many configs
        bad = runner.evaluate(faulty.SEGFAULT)
        assert bad.state is TrialState.RUNTIME_ERROR and runner.pid is None
        again = runner.evaluate(good)
        assert again.state is TrialState.COMPLETE and runner.pid not in (None, first)
        assert again.median_ms == pytest.approx(faulty.synthetic_ms(good))
        assert runner.restarts == 1
    assert runner.pid is None  # closed


def test_one_worker_serves_every_problem_of_a_job(tmp_path):
    """A worker costs seconds to start on a GPU: the job's problems share one, re-initialised
    for each problem (its runner sees that problem), and it is stopped when the job ends."""
    problems = [dataclasses.replace(PROBLEM, seqlen_q=n) for n in (40, 64, 80)]
    url = f"sqlite:///{tmp_path / 'ft.db'}"
    options = dataclasses.replace(OPTS, trials=2)
    safe = SearchSpace(params={"BLOCK_M": (16,), "BLOCK_N": (16, 32), "num_warps": (2,),
                               "num_stages": (1,)}, predicate=lambda c, p, d: None)
    results = tune(problems, options, db_url=url, progress=False,
                   _runner_factory=faulty.tagged_runner, _space=safe)
    assert [r.states for r in results] == [{"COMPLETE": 2}] * 3
    with open_store(url) as store:
        runs = {r.id: r for r in store.list_runs()}
        tags = {(runs[t.run_id].study_name, t.message) for t in store.list_trials()}
    pids = {m.split()[1] for _, m in tags}
    assert len(pids) == 1, tags
    for name, message in tags:  # each run's runner was built for that run's problem
        assert f'"seqlen_q":{message.split()[-1]}' in name
    with pytest.raises(ProcessLookupError):  # stopped (and reaped) at the end of the job
        os.kill(int(pids.pop()), 0)


def test_a_dead_worker_is_not_carried_to_the_next_problem():
    from flashtune.autotune.isolation import isolated

    spec, dev = get_template("attn_fwd"), interpreter_device()
    other = dataclasses.replace(PROBLEM, seqlen_q=80)
    good = {"BLOCK_M": 16, "BLOCK_N": 32}
    with isolated(faulty.crashing_runner) as factory:
        first = factory(spec, PROBLEM, dev, OPTS)
        pid = first.pid
        assert first.evaluate(good).state is TrialState.COMPLETE
        first.close()  # parked, not stopped
        assert first.pid is None
        second = factory(spec, other, dev, OPTS)
        assert second.pid == pid and second.flops == other.flops() and second.restarts == 0
        assert second.evaluate(faulty.SEGFAULT).state is TrialState.RUNTIME_ERROR
        second.close()  # nothing left to park
        third = factory(spec, PROBLEM, dev, OPTS)
        assert third.pid not in (None, pid)
        assert third.evaluate(good).state is TrialState.COMPLETE
        third_pid = third.pid
        third.close()  # parked
        assert factory._parked is not None and factory._parked[0].pid == third_pid
    assert factory._parked is None  # the context manager stopped the parked worker
    with pytest.raises(ProcessLookupError):
        os.kill(third_pid, 0)


def test_a_parked_worker_lets_go_of_its_runner(tmp_path, monkeypatch):
    """A parked worker holds no runner: its inputs and the GPU memory cached for them are
    freed before the parent goes on (the parent's side-by-side timing, or the next runner,
    needs that memory; a 32k-token math-SDPA candidate left 138 GB cached on an H200)."""
    from flashtune.autotune.isolation import isolated

    marks = tmp_path / "released"
    monkeypatch.setenv(faulty.RELEASED_ENV, str(marks))
    spec, dev = get_template("attn_fwd"), interpreter_device()
    with isolated(faulty.release_marking_runner) as factory:
        first = factory(spec, PROBLEM, dev, OPTS)
        pid = first.pid
        assert first.evaluate({"BLOCK_M": 16, "BLOCK_N": 32}).state is TrialState.COMPLETE
        assert not marks.exists()
        first.close()  # parked: the worker lives on, without the runner
        assert factory._parked is not None and factory._parked[0].pid == pid
        assert marks.read_text() == f"{pid} {PROBLEM.seqlen_q}\n"
        second = factory(spec, dataclasses.replace(PROBLEM, seqlen_q=80), dev, OPTS)
        assert second.pid == pid
        assert second.evaluate({"BLOCK_M": 16, "BLOCK_N": 32}).state is TrialState.COMPLETE


def test_a_factory_that_fails_in_the_worker_is_a_clear_error():
    with pytest.raises(IsolationError, match="did not start: RuntimeError: cannot build the "
                                             "runner here"):
        IsolatedRunner(faulty.failing_factory, get_template("attn_fwd"), PROBLEM,
                       interpreter_device(), OPTS)


def test_closures_cannot_be_isolated(tmp_path):
    def local_factory(*args):  # not importable by the worker
        raise AssertionError("never called")

    with pytest.raises(ConfigError, match="import by name .*got tests.autotune_tests.test_isolation.test_closures"):
        factory_path(local_factory)
    with pytest.raises(ConfigError, match="isolate=False"):
        tune([PROBLEM], OPTS, db_url=f"sqlite:///{tmp_path / 'ft.db'}", progress=False,
             _runner_factory=local_factory, _space=SPACE)
    assert not (tmp_path / "ft.db").exists()
    assert factory_path(faulty.crashing_runner) == "tests.autotune_tests.faulty:crashing_runner"


def test_when_isolation_is_on_by_default(monkeypatch):
    gpu = dataclasses.replace(interpreter_device(), name="NVIDIA_H100_80GB_HBM3")
    auto = TuneOptions()
    monkeypatch.setenv("TRITON_CACHE_DIR", "")  # restored after the test
    monkeypatch.delenv("TRITON_CACHE_DIR")
    # the worker must read the folder the compile pool writes: it is set before it starts
    loop.runner_factory_for(auto, None, gpu)
    assert os.environ["TRITON_CACHE_DIR"].endswith("flashtune-triton-cache")
    assert loop.runner_factory_for(auto, None, gpu) is not loop._default_runner  # GPU: on
    assert loop.runner_factory_for(auto, None, interpreter_device()) is loop._default_runner
    assert loop.runner_factory_for(auto, faulty.crashing_runner, gpu) is \
        faulty.crashing_runner  # custom factories: only when asked
    off = dataclasses.replace(auto, isolate=False)
    assert loop.runner_factory_for(off, None, gpu) is loop._default_runner


@pytest.mark.skipif(DEVICE != "cpu", reason="interpreter mode: the CPU run's TRITON_INTERPRET=1")
def test_the_real_runner_works_isolated_under_the_interpreter(tmp_path, monkeypatch):
    url = f"sqlite:///{tmp_path / 'ft.db'}"
    options = dataclasses.replace(OPTS, trials=2, sampler="random", trial_timeout_s=300)
    [res] = tune([PROBLEM], options, db_url=url, progress=False)
    assert res.states == {"COMPLETE": 2} and res.best_config is not None


def test_the_cli_has_the_switch():
    from click.testing import CliRunner

    from flashtune.cli.main import cli

    out = CliRunner().invoke(cli, ["tune", "--help"]).output
    assert "--isolate / --no-isolate" in out
