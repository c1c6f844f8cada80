"""Runner factories for the ``tune --op`` worker tests. Worker processes import them by name,
so they live at module level: :func:`synthetic_runner` answers every config at once with a
made-up time; :func:`dying_runner` does the same except for head dim 16, where the worker
process exits at once (a crashed driver, say)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from flashtune.autotune.runners import TrialResult
from flashtune.db.records import TrialState

DIES_AT_HEAD_DIM = 16


class SyntheticRunner:
    def __init__(self, spec: Any, problem: Any) -> None:
        self.flops = problem.flops()
        self.bias = 0.5 if spec.kind == "extern" else 0.0
        self.interpreting = True

    def evaluate(self, config: Mapping[str, int]) -> TrialResult:
        ms = 1.0 + self.bias + sum(config.values()) / 10000
        return TrialResult(TrialState.COMPLETE, None, ms, ms, ms, self.flops / ms / 1e9, 0.0)


def synthetic_runner(spec: Any, problem: Any, device: Any, options: Any) -> SyntheticRunner:
    return SyntheticRunner(spec, problem)


def dying_runner(spec: Any, problem: Any, device: Any, options: Any) -> SyntheticRunner:
    if problem.head_dim == DIES_AT_HEAD_DIM:
        os._exit(3)
    return SyntheticRunner(spec, problem)


class PidRunner(SyntheticRunner):
    """:class:`SyntheticRunner` whose results name the process that evaluated them (in the
    trial message): which candidate worker served which search."""

    def evaluate(self, config: Mapping[str, int]) -> TrialResult:
        res = super().evaluate(config)
        return TrialResult(res.state, f"pid {os.getpid()}", res.median_ms, res.p20_ms,
                           res.p80_ms, res.tflops, res.compile_s)


def pid_runner(spec: Any, problem: Any, device: Any, options: Any) -> PidRunner:
    return PidRunner(spec, problem)


def pool_runner(spec: Any, problem: Any, device: Any, options: Any) -> SyntheticRunner:
    """:class:`SyntheticRunner` built after starting this process's compile pool, as a GPU
    worker's first precompile does."""
    from flashtune.autotune.precompile import _pool

    assert _pool(1).submit(os.getpid).result(timeout=60) != os.getpid()
    return SyntheticRunner(spec, problem)
