"""Candidate isolation on the GPU: a kernel that makes an illegal memory access (the CUDA
context is lost for good) and one that spins forever each cost a worker process, not the
tuning job; the job records them and goes on to measure the good configs.

Run with ``FLASHTUNE_TEST_DEVICE=cuda pytest tests/autotune_tests/test_isolation_gpu.py``.
"""

from __future__ import annotations

import dataclasses

import pytest

from flashtune.autotune.jobs import tune
from flashtune.autotune.options import TuneOptions
from flashtune.core.problem import AttentionProblem
from flashtune.core.space import SearchSpace
from flashtune.db import RunStatus, TrialState, open_store
from tests.autotune_tests import faulty

pytestmark = pytest.mark.gpu

PROBLEM = AttentionProblem(1, 2, 2, 128, 128, 64, False, "fp16")
# BLOCK_N 64: illegal memory access (3 configs); BLOCK_M 32 + BLOCK_N 16: hangs; 5 good
SPACE = SearchSpace(params={"BLOCK_M": (16, 32, 64), "BLOCK_N": (16, 32, 64),
                            "num_warps": (4,), "num_stages": (2,)},
                    predicate=lambda c, p, d: None)


def test_faulty_gpu_kernels_cost_a_worker_not_the_job(tmp_path):
    url = f"sqlite:///{tmp_path / 'ft.db'}"
    options = TuneOptions(trials=20, sampler="grid", seed=0, top_k_confirm=2, isolate=True,
                          trial_timeout_s=20.0)
    [res] = tune([PROBLEM], options, db_url=url, progress=False,
                 _runner_factory=faulty.faulty_gpu_runner, _space=SPACE)
    assert res.states == {"COMPLETE": 5, "RUNTIME_ERROR": 3, "TIMEOUT": 1}, res.states
    assert res.best_config == {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 2}
    with open_store(url) as store:
        trials = store.list_trials()
        [run] = store.list_runs()
    assert run.status is RunStatus.COMPLETE
    by = {(t.config["BLOCK_M"], t.config["BLOCK_N"]): t for t in trials}
    for bm in (16, 32, 64):
        t = by[(bm, 64)]
        assert t.state is TrialState.RUNTIME_ERROR, (t.state, t.message)
        assert "illegal" in t.message.lower() or "died" in t.message, t.message
    hang = by[(32, 16)]
    assert hang.state is TrialState.TIMEOUT and hang.message.startswith("no result within 20 s")
    # every good config measured after a fault, in a fresh worker
    for key in ((16, 16), (16, 32), (32, 32), (64, 16), (64, 32)):
        assert by[key].state is TrialState.COMPLETE, (key, by[key].message)


def test_the_real_runner_is_isolated_by_default_on_a_gpu(tmp_path):
    """The default tuning path on a GPU (no isolate option given): real attn_fwd
    candidates, compiled, checked and timed in the worker."""
    url = f"sqlite:///{tmp_path / 'ft.db'}"
    options = TuneOptions(trials=4, sampler="random", seed=0, top_k_confirm=2)
    assert options.isolate is None
    [res] = tune([PROBLEM], options, db_url=url, progress=False)
    assert res.states.get("COMPLETE", 0) >= 1, res.states
    assert res.best_config is not None and res.best_ms is not None and res.best_ms > 0
    with open_store(url) as store:
        best = store.list_best()
    assert len(best) == 1 and best[0].config == res.best_config
    # and with isolation off the same job runs in-process
    off = dataclasses.replace(options, isolate=False, seed=1)
    [res2] = tune([PROBLEM], off, db_url=url, progress=False)
    assert res2.best_config is not None
