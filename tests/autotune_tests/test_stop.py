"""A stop request whose exception was lost (raised inside a garbage collector's callback,
where CPython prints "Exception ignored" and carries on) still stops the job at the next
trial: the run is recorded INTERRUPTED and nothing is left RUNNING."""

from __future__ import annotations

from typing import Any

import pytest

from flashtune.autotune import stop
from flashtune.autotune.jobs import tune
from flashtune.autotune.options import TuneOptions
from flashtune.autotune.runners import ReplayRunner, TrialResult
from flashtune.db import RunStatus, TrialState, open_store
from tests.autotune_tests.synthetic import FIXTURE, H100, PROBLEM
from tests.autotune_tests.synthetic import RECORDED_SPACE as SPACE


class _SwallowedSigterm:
    """Replays recorded results; during its second evaluation a SIGTERM arrives whose
    exception is lost, as the handler's is inside a weakref callback: only the request
    stays."""

    def __init__(self) -> None:
        self.replay = ReplayRunner.from_json(FIXTURE)
        self.calls = 0

    def evaluate(self, config: Any) -> TrialResult:
        self.calls += 1
        if self.calls == 2:
            stop.request("SIGTERM")
        return self.replay.evaluate(config)


@pytest.fixture(autouse=True)
def _no_request_left() -> Any:
    stop.clear()
    yield
    stop.clear()


def test_a_lost_sigterm_stops_the_job_at_the_next_trial(tmp_path) -> None:
    url = f"sqlite:///{tmp_path / 'ft.db'}"
    runners: list[_SwallowedSigterm] = []

    def factory(spec: Any, problem: Any, device: Any, options: Any) -> _SwallowedSigterm:
        runners.append(_SwallowedSigterm())
        return runners[-1]

    with pytest.raises(stop.Terminated, match="SIGTERM"):
        tune([PROBLEM], TuneOptions(trials=20, sampler="random", seed=0), db_url=url,
             progress=False, _runner_factory=factory, _device=H100, _space=SPACE)
    assert runners[0].calls == 2  # the trial in flight finished; no third one started
    with open_store(url, read_only=True) as store:
        [run] = store.list_runs()
        assert run.status is RunStatus.INTERRUPTED
        trials = store.list_trials()
        assert len([t for t in trials if t.state is TrialState.COMPLETE]) == 2
        assert not any(t.state is TrialState.RUNNING for t in trials)


def test_a_request_is_forgotten_once_cleared() -> None:
    stop.request("SIGTERM")
    assert stop.requested()
    with pytest.raises(stop.Terminated):
        stop.check()
    stop.clear()
    assert not stop.requested()
    stop.check()  # nothing to raise


def test_a_finalizer_frame_is_recognised() -> None:
    import sys
    import weakref

    seen: list[bool] = []

    class Probe:
        def __del__(self) -> None:
            seen.append(stop.in_finalizer(sys._getframe()))

    Probe()  # collected at once: __del__ runs
    assert seen == [True]
    assert not stop.in_finalizer(sys._getframe())

    class Target:
        pass

    t = Target()
    weakref.finalize(t, lambda: seen.append(stop.in_finalizer(sys._getframe())))
    del t
    assert seen[-1] is True  # weakref.finalize's callback runs from weakref.py
