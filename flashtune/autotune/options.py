"""What a tuning job is asked to do and what it answers: :class:`TuneOptions` (checked on
construction), :class:`TuneResult`, and the checks on the problems and the template that
run before any work starts (:func:`check_tunable`).

:func:`flashtune.autotune.jobs.tune` is the entry point that takes and returns these.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from flashtune.core.device import DeviceFingerprint, cuda_device, interpreter_device
from flashtune.core.problem import AttentionProblem

__all__ = ["TuneOptions", "TuneResult", "check_tunable", "tuning_device"]


MAX_SETTLE_MS = 10_000  # a settling run longer than this is a typo, not a measurement


@dataclass(frozen=True)
class TuneOptions:
    """How :func:`~flashtune.autotune.jobs.tune` searches: the template, the sampler and the
    budgets (per problem).

    ``sampler`` is one of :data:`flashtune.autotune.strategies.SAMPLERS`; ``interpret``
    tunes under the Triton CPU interpreter (timings meaningless, pipeline checked).
    A value ``tune`` cannot use (``seed`` outside 0 .. 2**32 - 1, a ``timeout_s`` that
    is not a finite number > 0, ``"cmaes"`` without the cmaes package...) raises
    ``InputError`` on construction.
    """

    template: str = "attn_fwd"
    trials: int = 50  # configs evaluated per run (duplicates and static prunes not counted)
    timeout_s: float | None = None  # wall budget per problem, checked after the first batch
    sampler: str = "tpe"
    seed: int | None = None
    patience: int | None = None  # early stop after K evaluated trials w/o improvement
    interpret: bool = False
    workers: int | None = None  # precompile processes (GPU); None: trial_loop.default_workers
    trial_timeout_s: float = 120.0
    top_k_confirm: int = 3
    # evaluate candidates in a worker process (crash/hang isolation); None: on for the
    # real runner on a GPU, off under the interpreter and for custom runner factories
    isolate: bool | None = None
    # ms each timing window first runs its candidate back to back (timing.settle): 0 times
    # as before; 200 or more times every candidate at the clock its own power leaves
    settle_ms: float = 0.0

    def __post_init__(self) -> None:
        # refused here, before tune() opens the store: later they would fail inside Optuna
        # or the database with a RUNNING run left behind
        _check_options(self)


def _check_options(o: TuneOptions) -> None:
    """InputError naming the first field of ``o`` that ``tune`` cannot use."""
    import math

    from flashtune.autotune.strategies import MAX_SEED, SAMPLERS, cmaes_installed
    from flashtune.core.errors import InputError

    def integer(name: str, low: int, high: int | None = None, *, none: bool = False) -> None:
        value = getattr(o, name)
        if value is None and none:
            return
        if isinstance(value, bool) or not isinstance(value, int) or value < low \
                or (high is not None and value > high):
            span = f"from {low} to {high}" if high is not None else f">= {low}"
            raise InputError(f"TuneOptions.{name} must be an integer {span}"
                             f"{' or None' if none else ''}, got {value!r}")

    def seconds(name: str, *, none: bool = False) -> None:
        value = getattr(o, name)
        if value is None and none:
            return
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not math.isfinite(value) or value <= 0:
            raise InputError(f"TuneOptions.{name} must be a finite number of seconds > 0"
                             f"{' or None' if none else ''}, got {value!r}")

    integer("trials", 1)
    seconds("timeout_s", none=True)
    if o.sampler not in SAMPLERS:
        raise InputError(f"TuneOptions.sampler must be one of {', '.join(SAMPLERS)}, got "
                         f"{o.sampler!r}")
    if o.sampler == "cmaes" and not cmaes_installed():
        raise InputError("sampler 'cmaes' needs the cmaes package: pip install cmaes")
    integer("seed", 0, MAX_SEED, none=True)
    integer("patience", 1, none=True)
    integer("workers", 1, none=True)
    seconds("trial_timeout_s")
    integer("top_k_confirm", 0)
    if isinstance(o.settle_ms, bool) or not isinstance(o.settle_ms, (int, float)) \
            or not math.isfinite(o.settle_ms) or not 0 <= o.settle_ms <= MAX_SETTLE_MS:
        raise InputError(f"TuneOptions.settle_ms must be a number of milliseconds from 0 to "
                         f"{MAX_SETTLE_MS}, got {o.settle_ms!r}")


@dataclass(frozen=True)
class TuneResult:
    """What :func:`~flashtune.autotune.jobs.tune` did for one problem: the best config found
    and stored (None when no candidate completed), the template default's timing on the
    same device, the speedup of one over the other, trial counts per final state, and the
    Optuna study's name."""

    problem: AttentionProblem
    device_name: str
    template: str
    best_config: dict[str, int] | None
    best_ms: float | None
    best_tflops: float | None
    default_config: dict[str, int]
    default_ms: float | None
    default_tflops: float | None
    speedup: float | None  # default_ms / best_ms
    trials: int  # evaluated in this run (not counting duplicates/static prunes)
    states: dict[str, int]
    wall_s: float
    became_best: bool
    study_name: str


def check_tunable(problems: Sequence[AttentionProblem], template: str, *,
                  custom_runner: bool) -> None:
    """Refuse, before any work starts, a problem the runtime would refuse too (InputError,
    e.g. its head_dim) and, unless a custom runner factory measures the candidates, a
    template that cannot be tuned yet or needs a GPU under the Triton interpreter
    (ConfigError)."""
    from flashtune.core.errors import ConfigError, InputError
    from flashtune.core.problem import MAX_HEAD_DIM

    for p in problems:
        if p.head_dim > MAX_HEAD_DIM:
            raise InputError(f"head_dim {p.head_dim} is not supported ({p.describe()}); "
                             f"flashtune serves head dims 1 to {MAX_HEAD_DIM}")
    if custom_runner:
        return
    from flashtune.kernel_templates import get_template

    spec = get_template(template)
    if not spec.tunable:
        raise ConfigError(f"template {template!r} cannot be tuned yet (no candidate "
                          f"runner for it); it runs with its default config")
    from flashtune.core.device import interpreting

    if spec.limits.needs_gpu and interpreting():  # every trial would fail
        raise ConfigError(f"template {template!r} ({spec.kind}) needs a CUDA GPU: it does "
                          f"not run under the Triton interpreter; tune it on a GPU")


def tuning_device(options: TuneOptions) -> DeviceFingerprint:
    """The device a job with ``options`` tunes on: the interpreter's, else the current
    GPU's."""
    return interpreter_device() if options.interpret else cuda_device()
