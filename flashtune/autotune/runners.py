"""Runners: compile, check and time one config (Kernel Tuner's ``runners/``).

A runner never raises for a bad config: every outcome is a :class:`TrialResult` whose
``state`` says how the trial ended (failures are data). Strategies propose configs; runners
evaluate them. :class:`ReplayRunner` serves recorded results so strategy tests run without
a GPU.
"""

from __future__ import annotations

import functools
import json
import logging
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Protocol, Sequence

from flashtune.autotune.devices import DeviceFingerprint
from flashtune.autotune.problems import AttentionProblem
from flashtune.db.jsonutil import canonical_json
from flashtune.db.records import TrialState

log = logging.getLogger(__name__)

__all__ = ["Case", "LocalRunner", "ReplayRunner", "Runner", "TrialResult", "forward_case",
           "random_inputs", "relative_error", "time_interleaved"]

# relative Frobenius error allowed against the fp32 reference
TOLERANCE = {"bf16": 2e-2, "fp16": 5e-3}
# timed calls per config under the interpreter (timings there are recorded but meaningless)
INTERPRETER_REPS = 2
# above this many q elements the reference is computed on a slice (batch 0, 2 q heads)
FULL_REFERENCE_MAX_ELEMS = 1 << 20
MESSAGE_MAX = 300


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


@dataclass(frozen=True)
class Case:
    """One problem's inputs for one template, as :class:`LocalRunner` uses them.

    ``launch(config)`` runs the template once and returns its outputs; ``error(outputs)``
    is their relative Frobenius error against the fp32 reference (the worst of them when
    there are several; NaN when any output holds a NaN); ``flops`` is the work of one
    launch (ANCHORS.md's count) and ``min_bytes`` the memory traffic it cannot avoid (both
    set the physical floor below which a timing is rejected). ``inputs`` names the tensors
    for scripts that reuse them.
    A template builds its own with ``TemplateSpec.make_case``; :func:`forward_case` is the
    one used otherwise.
    """

    launch: Callable[[Mapping[str, int]], Any]
    error: Callable[[Any], float]
    flops: float
    inputs: Mapping[str, Any] = field(default_factory=dict)
    min_bytes: float = 0.0  # bytes one launch must move at least (for the physical floor)


def relative_error(got: Any, ref: Any) -> float:
    """``||got - ref|| / ||ref||`` in fp32 (NaN when ``got`` holds a NaN)."""
    import torch

    got = got.float()
    if torch.isnan(got).any():
        return float("nan")
    return float(torch.linalg.vector_norm(got - ref)) / (float(torch.linalg.vector_norm(ref))
                                                         or 1.0)


def random_inputs(problem: AttentionProblem, torch_device: str, generator: Any,
                  names: Sequence[str] = ("q", "k", "v")) -> dict[str, Any]:
    """Seeded ``randn`` tensors ``(batch, heads, seqlen, head_dim)`` in the problem's dtype,
    drawn in the order of ``names`` (``q``/``do``: q's shape; others: k's)."""
    import torch

    p = problem
    dtype = torch.float16 if p.dtype == "fp16" else torch.bfloat16
    out = {}
    for name in names:
        h, n = (p.heads_q, p.seqlen_q) if name in ("q", "do") else (p.heads_kv, p.seqlen_k)
        out[name] = torch.randn((p.batch, h, n, p.head_dim), generator=generator,
                                device=torch_device, dtype=torch.float32).to(dtype)
    return out


def forward_case(spec: Any, problem: AttentionProblem, device: DeviceFingerprint, *,
                 torch_device: str, generator: Any, launcher: Any, check_slice: bool) -> Case:
    """``launcher(q, k, v, config, causal=)`` on random q, k, v against ``spec.reference``'s
    output. For big problems (q or k above ``FULL_REFERENCE_MAX_ELEMS`` elements) only batch
    0 and the first two q heads (and their kv heads) are compared, to bound memory."""
    import torch

    p = problem
    t = random_inputs(p, torch_device, generator)
    q, k, v = t["q"], t["k"], t["v"]
    if check_slice and max(q.numel(), k.numel()) > FULL_REFERENCE_MAX_ELEMS:
        hq = min(2, p.heads_q)
        hkv = (hq - 1) // (p.heads_q // p.heads_kv) + 1
        sl: tuple[slice, slice] = (slice(0, 1), slice(0, hq))
        ref, _ = spec.reference(q[:1, :hq], k[:1, :hkv], v[:1, :hkv], causal=p.causal,
                                dtype=torch.float32)
    else:
        sl = (slice(None), slice(None))
        ref, _ = spec.reference(q, k, v, causal=p.causal, dtype=torch.float32)
    io = sum(t.numel() * t.element_size() for t in (q, k, v, q))  # q, k, v read; o written
    return Case(launch=lambda config: launcher(q, k, v, config, causal=p.causal),
                error=lambda out: relative_error(out[sl], ref), flops=p.flops(),
                inputs={"q": q, "k": k, "v": v, "ref": ref, "ref_slice": sl}, min_bytes=io)


class LocalRunner:
    """Evaluates configs of ``spec`` on ``problem`` in this process.

    Inputs are seeded ``randn`` tensors on the device (CPU under the interpreter, else
    cuda), built once by the template's ``make_case`` (see :class:`Case`), or by
    :func:`forward_case` for templates without one; the fp32 reference is computed once,
    for big problems on a slice.

    Per config: the first launch compiles (timed as ``compile_s``; OutOfResources ->
    OUT_OF_RESOURCES, CompilationError/PTXASError -> COMPILE_ERROR, anything else ->
    RUNTIME_ERROR), its output is checked against the reference (relative Frobenius error
    under ``TOLERANCE[dtype]`` and no NaN, else WRONG_RESULT), then it is timed (``bench``
    on GPU; ``time.perf_counter`` over :data:`INTERPRETER_REPS` calls under the interpreter,
    meaningless but recorded). A median that is not positive or is below the physical
    floor (``Case.flops`` over the device's peak, ``Case.min_bytes`` over its bandwidth) is
    a measurement error: re-measured once, then recorded RUNTIME_ERROR. ``timeout_s`` is
    checked *after the fact*: a trial whose compile + check + timing took longer is
    recorded TIMEOUT; a hung kernel is not interrupted, and on GPU an illegal memory access
    may leave the CUDA context unusable: isolated mode
    (:class:`flashtune.autotune.isolation.IsolatedRunner`) runs this runner in a worker
    process that can be killed and replaced.
    """

    def __init__(self, spec: Any, problem: AttentionProblem, device: DeviceFingerprint, *,
                 seed: int = 0, check_slice: bool = True, timeout_s: float | None = None,
                 launcher: Any = None) -> None:
        import torch

        self.spec = spec
        self.problem = problem
        self.device = device
        self.timeout_s = timeout_s
        self.launcher = launcher if launcher is not None else spec.launcher
        from flashtune.autotune.devices import interpreting

        self.interpreting = device.is_interpreter or interpreting()
        self.torch_device = "cpu" if self.interpreting else "cuda"
        gen = torch.Generator(device=self.torch_device).manual_seed(seed)
        make_case = getattr(spec, "make_case", None) or functools.partial(forward_case, spec)
        self.case: Case = make_case(problem, device, torch_device=self.torch_device,
                                    generator=gen, launcher=self.launcher,
                                    check_slice=check_slice)
        self.flops = self.case.flops
        from flashtune.autotune.timing import physical_floor_ms

        self.floor_ms = physical_floor_ms(device, self.case.flops, self.case.min_bytes)

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
        try:
            median, p20, p80 = self.time_config()
        except Exception as exc:
            return TrialResult(TrialState.RUNTIME_ERROR, _first_line(exc), compile_s=compile_s)
        wall = time.perf_counter() - t0
        if self.timeout_s is not None and wall > self.timeout_s:
            return TrialResult(TrialState.TIMEOUT,
                               f"took {wall:.1f} s (limit {self.timeout_s:g} s, checked after "
                               f"the fact)", compile_s=compile_s)
        from flashtune.autotune.timing import tflops

        return TrialResult(TrialState.COMPLETE, None, median, p20, p80,
                           tflops(self.flops, median) if median > 0 else None, compile_s)

    def time_config(self, config: Mapping[str, int] | None = None) -> tuple[float, float, float]:
        """(median, p20, p80) ms of the config (the last evaluated one by default).

        A median that cannot be real (see :func:`flashtune.autotune.timing.
        measurement_problem`) is measured again once; ``MeasurementError`` if it still is.
        """
        from flashtune.autotune.timing import MeasurementError, measurement_problem

        if config is not None:
            self._config = dict(config)
        timing = self._measure()
        problem = measurement_problem(timing[0], self.floor_ms)
        if problem is None:
            return timing
        log.warning("%s for %s: re-measuring", problem, self._config)
        timing = self._measure()
        again = measurement_problem(timing[0], self.floor_ms)
        if again is None:
            return timing
        raise MeasurementError(f"{again} (first measurement: {problem.split(' is ')[0]}); "
                               f"re-measured once")

    def _measure(self) -> tuple[float, float, float]:
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

        timing = bench(self._launch)
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


def time_interleaved(runner: Any, configs: Iterable[Mapping[str, int]],
                     rounds: int = 3) -> dict[str, TrialResult]:
    """Re-time ``configs`` round-robin (config A, B, C, A, B, C...) so clock and thermal
    drift hit them alike; keyed by canonical config JSON. The median of the per-round
    medians is reported; a config whose timing fails (e.g. a measurement error that a
    re-measurement did not cure) is a RUNTIME_ERROR. Runners without GPU timing (the
    interpreter, replay) are simply evaluated once per config."""
    configs = [dict(c) for c in configs]
    keys = [canonical_json(c) for c in configs]
    gpu = callable(getattr(runner, "time_config", None)) and \
        not getattr(runner, "interpreting", True)
    if not gpu:
        return {k: runner.evaluate(c) for k, c in zip(keys, configs)}
    samples: dict[str, list[tuple[float, float, float]]] = {k: [] for k in keys}
    failed: dict[str, TrialResult] = {}
    for _ in range(max(1, rounds)):
        for key, cfg in zip(keys, configs):
            if key in failed:
                continue
            try:
                samples[key].append(runner.time_config(cfg))
            except Exception as exc:
                failed[key] = TrialResult(TrialState.RUNTIME_ERROR, _first_line(exc))
    from flashtune.autotune.timing import tflops

    out: dict[str, TrialResult] = dict(failed)
    for key, got in samples.items():
        if key in failed or not got:
            continue
        med = statistics.median(g[0] for g in got)
        out[key] = TrialResult(TrialState.COMPLETE, None, med,
                               statistics.median(g[1] for g in got),
                               statistics.median(g[2] for g in got),
                               tflops(runner.flops, med) if med > 0 and runner.flops else None)
    return out
