"""Runners: compile, check and time one config (Kernel Tuner's ``runners/``).

A runner never raises for a bad config: every outcome is a :class:`TrialResult` whose
``state`` says how the trial ended (failures are data). Strategies propose configs; runners
evaluate them. :class:`ReplayRunner` serves recorded results so strategy tests run without
a GPU.
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

from flashtune.autotune.timing import REP_MS
from flashtune.core.case import TOLERANCE, Case
from flashtune.core.device import DeviceFingerprint
from flashtune.core.problem import AttentionProblem
from flashtune.core.spec import TemplateSpec
from flashtune.db.jsonutil import canonical_json
from flashtune.db.records import TrialState

log = logging.getLogger(__name__)

__all__ = ["LocalRunner", "ReplayRunner", "Runner", "TrialResult", "time_interleaved",
           "time_pairs"]

# timed calls per config under the interpreter (timings there are recorded but meaningless)
INTERPRETER_REPS = 2
MESSAGE_MAX = 300
# a config whose one timed launch (after its check) takes this many times the best median
# the runner has measured, and at least ABANDON_MIN_MS, keeps that one timing instead of a
# full measurement: do_bench's estimate runs and the host-bound probe of a 1.8 s backward
# config (the attn_bwd search at N 16k on an H200) took 24 s of its shape's 59
ABANDON_FACTOR = 3.0
ABANDON_MIN_MS = 5.0
# what one pair's rounds of time_pairs measure in all (ms): five rounds of bench's REP_MS.
# More rounds (a close call's) split it, to no less than ROUND_REP_MIN_MS a round: more
# samples of the drift between rounds, not more GPU time (a close call's 15 full rounds of
# four training steps took 32 s of a 110 s shape on the H100)
ROUNDS_REP_MS = 5 * REP_MS
ROUND_REP_MIN_MS = 20.0


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    line = next((t.strip() for t in text if t.strip()), "")
    msg = f"{type(exc).__name__}: {line}" if line else type(exc).__name__
    return msg[:MESSAGE_MAX]


@dataclass(frozen=True)
class TrialResult:
    """How one config did. Timings are None unless ``state`` is COMPLETE."""

    state: TrialState
    message: str | None = None
    median_ms: float | None = None
    p20_ms: float | None = None
    p80_ms: float | None = None
    tflops: float | None = None
    compile_s: float | None = None

    @property
    def ok(self) -> bool:
        return self.state is TrialState.COMPLETE

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["state"] = self.state.value
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TrialResult:
        fields = {k: data.get(k) for k in ("message", "median_ms", "p20_ms", "p80_ms",
                                           "tflops", "compile_s")}
        return cls(state=TrialState(data["state"]), **fields)


class Runner(Protocol):
    def evaluate(self, config: Mapping[str, int]) -> TrialResult: ...


def _classify_launch_error(exc: BaseException) -> TrialState:
    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import OutOfResources

    try:
        from triton.runtime.errors import PTXASError
    except ImportError:  # pragma: no cover - older triton
        PTXASError = CompilationError  # type: ignore[misc,assignment,unused-ignore]  # noqa: N806
    if isinstance(exc, OutOfResources):
        return TrialState.OUT_OF_RESOURCES
    if isinstance(exc, (CompilationError, PTXASError)):
        return TrialState.COMPILE_ERROR
    return TrialState.RUNTIME_ERROR


class LocalRunner:
    """Evaluates configs of ``spec`` on ``problem`` in this process.

    Inputs are seeded ``randn`` tensors on the device (CPU under the interpreter, else
    cuda), built once by the template's ``make_case`` (see :class:`~flashtune.core.case.Case`);
    the fp32 reference is computed once,
    for big problems on a slice.

    Per config: the first launch compiles (timed as ``compile_s``; OutOfResources ->
    OUT_OF_RESOURCES, CompilationError/PTXASError -> COMPILE_ERROR, anything else ->
    RUNTIME_ERROR), its output is checked against the reference (relative Frobenius error
    under ``TOLERANCE[dtype]`` and no NaN, else WRONG_RESULT), then it is timed (``bench``
    on GPU; ``time.perf_counter`` over :data:`INTERPRETER_REPS` calls under the interpreter,
    meaningless but recorded); on a GPU a config whose one timed launch is
    :data:`ABANDON_FACTOR` times the runner's best median or more keeps that timing (its
    message says so) instead of a full measurement. A median that is not positive or is
    below the physical floor (``Case.flops`` over the device's peak, ``Case.min_bytes`` over
    its bandwidth) is a measurement error: re-measured once, then recorded RUNTIME_ERROR.
    ``timeout_s`` is checked *after the fact*: a trial whose compile + check + timing took longer is
    recorded TIMEOUT; a hung kernel is not interrupted, and on GPU an illegal memory access
    may leave the CUDA context unusable: isolated mode
    (:class:`flashtune.autotune.isolation.IsolatedRunner`) runs this runner in a worker
    process that can be killed and replaced.
    """

    def __init__(self, spec: TemplateSpec, problem: AttentionProblem, device: DeviceFingerprint, *,
                 seed: int = 0, check_slice: bool = True, timeout_s: float | None = None,
                 launcher: Any = None, settle_ms: float = 0.0) -> None:
        import torch

        self.spec = spec
        self.settle_ms = settle_ms  # each timing window's settling run (timing.settle)
        self.problem = problem
        self.device = device
        self.timeout_s = timeout_s
        self.launcher = launcher if launcher is not None else spec.launcher
        from flashtune.core.device import interpreting

        self.interpreting = device.is_interpreter or interpreting()
        self.torch_device = "cpu" if self.interpreting else "cuda"
        gen = torch.Generator(device=self.torch_device).manual_seed(seed)
        self.case: Case = spec.make_case(problem, device, torch_device=self.torch_device,
                                    generator=gen, launcher=self.launcher,
                                    check_slice=check_slice)
        self.flops = self.case.flops
        from flashtune.autotune.timing import physical_floor_ms

        self.floor_ms = physical_floor_ms(device, self.case.flops, self.case.min_bytes)
        self._best_ms: float | None = None  # the best full measurement of this runner

    def _launch(self) -> Any:
        return self.case.launch(self._config)

    def _error(self, out: Any) -> float:
        return self.case.error(out)

    def _sync(self) -> None:
        if self.torch_device == "cuda":
            import torch

            torch.cuda.synchronize()

    def evaluate(self, config: Mapping[str, int]) -> TrialResult:
        self._config = dict(config)
        t0 = time.perf_counter()
        try:
            out = self._launch()
            self._sync()
        except Exception as exc:  # failures are data
            return TrialResult(_classify_launch_error(exc), _first_line(exc),
                               compile_s=time.perf_counter() - t0)
        compile_s = time.perf_counter() - t0
        try:
            err = self._error(out)
        except Exception as exc:
            return TrialResult(TrialState.RUNTIME_ERROR, _first_line(exc), compile_s=compile_s)
        tol = TOLERANCE[self.problem.dtype]
        if not err < tol:  # also catches NaN
            return TrialResult(TrialState.WRONG_RESULT,
                               f"relative error {err:.3g} vs fp32 reference (tolerance {tol:g})",
                               compile_s=compile_s)
        message = None
        try:
            once = self._far_behind()
            if once is not None:  # out of the race: its one timing stands
                median = p20 = p80 = once
                message = (f"timed once: {once:.3g} ms, over {ABANDON_FACTOR:g}x the best "
                           f"so far ({self._best_ms:.3g} ms)")
            else:
                median, p20, p80 = self.time_config()
                self._best_ms = min(self._best_ms or median, median)
        except Exception as exc:
            return TrialResult(TrialState.RUNTIME_ERROR, _first_line(exc), compile_s=compile_s)
        wall = time.perf_counter() - t0
        if self.timeout_s is not None and wall > self.timeout_s:
            return TrialResult(TrialState.TIMEOUT,
                               f"took {wall:.1f} s (limit {self.timeout_s:g} s, checked after "
                               f"the fact)", compile_s=compile_s)
        from flashtune.autotune.timing import tflops

        return TrialResult(TrialState.COMPLETE, message, median, p20, p80,
                           tflops(self.flops, median) if median > 0 else None, compile_s)

    def _far_behind(self) -> float | None:
        """On a GPU, once a config was measured: the current config's one timed launch (L2
        flushed) when it is :data:`ABANDON_FACTOR` times the best median or more (and at
        least :data:`ABANDON_MIN_MS`: short launches carry host time), else None."""
        if self.interpreting or self._best_ms is None:
            return None
        once = self._once_ms()
        if once >= max(ABANDON_FACTOR * self._best_ms, ABANDON_MIN_MS):
            return once
        return None

    def _once_ms(self) -> float:
        """One launch's milliseconds, the L2 flushed before it."""
        from flashtune.autotune.timing import bench_once

        return bench_once(self._launch)

    def time_config(self, config: Mapping[str, int] | None = None,
                    rep_ms: float = REP_MS) -> tuple[float, float, float]:
        """(median, p20, p80) ms of the config (the last evaluated one by default), measured
        for ``rep_ms`` (:func:`~flashtune.autotune.timing.bench`).

        A median that cannot be real (see :func:`flashtune.autotune.timing.
        measurement_problem`) is measured again once; ``MeasurementError`` if it still is.
        """
        from flashtune.autotune.timing import MeasurementError, measurement_problem

        if config is not None:
            self._config = dict(config)
        timing = self._measure(rep_ms)
        problem = measurement_problem(timing[0], self.floor_ms)
        if problem is None:
            return timing
        log.warning("%s for %s: re-measuring", problem, self._config)
        timing = self._measure(rep_ms)
        again = measurement_problem(timing[0], self.floor_ms)
        if again is None:
            return timing
        raise MeasurementError(f"{again} (first measurement: {problem.split(' is ')[0]}); "
                               f"re-measured once")

    def _measure(self, rep_ms: float = REP_MS) -> tuple[float, float, float]:
        """One measurement of the current config: (median, p20, p80) ms."""
        if self.interpreting:
            times = []
            for _ in range(INTERPRETER_REPS):
                t = time.perf_counter()
                self._launch()
                times.append((time.perf_counter() - t) * 1e3)
            times.sort()
            return statistics.median(times), times[0], times[-1]
        from flashtune.autotune.timing import bench

        timing = bench(self._launch, rep_ms=rep_ms, settle_ms=self.settle_ms)
        return timing.median_ms, timing.p20_ms, timing.p80_ms


class ReplayRunner:
    """Serves recorded results: ``records`` maps canonical config JSON to a result dict
    (``state``, ``message``, ``median_ms``...). An unknown config is a RUNTIME_ERROR
    "not in recording". ``calls`` lists the configs asked for, in order."""

    def __init__(self, records: Mapping[str, Mapping[str, Any]],
                 meta: Mapping[str, Any] | None = None) -> None:
        self.records = {k: TrialResult.from_dict(v) for k, v in records.items()}
        self.meta = dict(meta or {})
        self.calls: list[dict[str, int]] = []

    @classmethod
    def from_json(cls, path: str | Path) -> ReplayRunner:
        """Read ``{"meta": {...}, "trials": [{"config": {...}, "state": ..., ...}]}``."""
        data = json.loads(Path(path).read_text())
        records = {canonical_json(t["config"]): t for t in data["trials"]}
        return cls(records, data.get("meta"))

    def evaluate(self, config: Mapping[str, int]) -> TrialResult:
        self.calls.append(dict(config))
        found = self.records.get(canonical_json(dict(config)))
        if found is None:
            return TrialResult(TrialState.RUNTIME_ERROR, "not in recording")
        return found


def round_rep_ms(rounds: int) -> float:
    """Each round's measuring time when a pair is timed in ``rounds`` rounds: bench's
    REP_MS up to five rounds, then ROUNDS_REP_MS split among them (at least
    ROUND_REP_MIN_MS)."""
    return min(REP_MS, max(ROUND_REP_MIN_MS, ROUNDS_REP_MS / max(1, rounds)))


def time_interleaved(runner: Any, configs: Iterable[Mapping[str, int]],
                     rounds: int = 3) -> dict[str, TrialResult]:
    """Re-time ``configs`` of one runner round-robin (:func:`time_pairs`); keyed by
    canonical config JSON."""
    configs = [dict(c) for c in configs]
    results = time_pairs([(runner, c) for c in configs], rounds)
    return {canonical_json(c): r for c, r in zip(configs, results, strict=True)}


def time_pairs(pairs: Sequence[tuple[Any, Mapping[str, int]]],
               rounds: int = 3) -> list[TrialResult]:
    """Time each ``(runner, config)`` round-robin (A, B, C, A, B, C...) so clock and thermal
    drift hit them alike: one runner's configs (the confirmation) or the leaders of several
    implementations (:mod:`flashtune.autotune.select`). The median of the per-round medians
    is reported; a pair whose timing fails (e.g. a measurement error that a re-measurement
    did not cure) is a RUNTIME_ERROR and is not timed again. Each round measures a pair for
    :func:`round_rep_ms`. Runners without GPU timing (the interpreter, replay) are simply
    evaluated once per config.

    Returns:
        One :class:`TrialResult` per pair, in order.
    """
    from flashtune.autotune.timing import tflops

    def gpu(runner: Any) -> bool:
        return callable(getattr(runner, "time_config", None)) and \
            not getattr(runner, "interpreting", True)

    out: list[TrialResult | None] = [None if gpu(r) else r.evaluate(dict(c)) for r, c in pairs]
    samples: list[list[tuple[float, float, float]]] = [[] for _ in pairs]
    rep_ms = round_rep_ms(rounds)
    for _ in range(max(1, rounds)):
        for i, (runner, config) in enumerate(pairs):
            if out[i] is not None:
                continue
            try:
                samples[i].append(runner.time_config(dict(config), rep_ms=rep_ms))
            except Exception as exc:
                out[i] = TrialResult(TrialState.RUNTIME_ERROR, _first_line(exc))
    done: list[TrialResult] = []
    for (runner, _), result, got in zip(pairs, out, samples, strict=True):
        if result is None:
            med = statistics.median(g[0] for g in got)
            flops = getattr(runner, "flops", None)
            result = TrialResult(TrialState.COMPLETE, None, med,
                                 statistics.median(g[1] for g in got),
                                 statistics.median(g[2] for g in got),
                                 tflops(flops, med) if med > 0 and flops else None)
        done.append(result)
    return done
