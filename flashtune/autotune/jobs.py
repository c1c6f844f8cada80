"""Tuning jobs: one Optuna study per (device, template, problem), recorded in the store.

:func:`tune` is the library entry point the CLI calls. Per problem it opens (or resumes)
the study ``"{device}/{template}@{source_hash}/{canonical problem key}"``, warm-starts it
with the template default and the best configs of the nearest tuned problems, then asks
configs of the sampler until the budget is spent:

* a config the space's predicate rejects: told PRUNED, recorded PRUNED_STATIC;
* a config already measured in this study (this run or an earlier one, found with
  ``store.find_trial``): told its stored value (or FAIL) and *not* re-run nor recorded
  again, so a resumed job never duplicates a flashtune trial;
* otherwise: ``claim_trial`` (None when a concurrent worker of the study has just taken
  the same config: told FAIL, not counted), runner ``evaluate``, ``finish_trial``; told
  ``median_ms``, or FAIL for every failure state.

``trials`` counts configs evaluated in this run; the same command run again continues the
study with ``trials`` more. At the end the ``top_k_confirm`` fastest configs of the study and
the template default are re-timed interleaved, and the fastest is offered as the study's best.

A job killed mid-trial (``kill -9``, the OOM killer, a lost node) leaves its run and trial
RUNNING. On resume, a RUNNING run of this host whose owner process (``RunRecord.pid``) is
gone is dead at once: its trials become RUNTIME_ERROR "stale: job died" and its Optuna
trials (tagged with the run id) FAIL, so the config is tried again. Runs of other hosts,
or without a pid, are failed once older than :func:`_stale_after`. Optuna's grid sampler
counts such a FAIL as a visited point: once it has visited every point, configs of the
grid with no trial but stale ones are queued again (:func:`_requeue_lost`), so a rerun
finishes the grid with every config measured once.

Isolated mode (``TuneOptions.isolate``; default on for the real runner on a GPU) evaluates
candidates in a worker process (:mod:`flashtune.autotune.isolation`): a candidate that
crashes or hangs costs its worker, not the job.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Mapping, Sequence

from flashtune.core.device import DeviceFingerprint, cuda_device, interpreter_device
from flashtune.core.problem import AttentionProblem
from flashtune.core.space import SearchSpace
from flashtune.db.jsonutil import canonical_json
from flashtune.db.records import RunStatus, TrialState
from flashtune.db.store import STALE_MESSAGE, TuningStore

log = logging.getLogger(__name__)

__all__ = ["TuneOptions", "TuneResult", "tune"]

WARM_START_NEIGHBOURS = 3
EXHAUSTION_CHECK = 25  # fruitless asks in a row before the study is checked for configs left
STALE_AFTER = timedelta(minutes=5)  # at least; see _stale_after
FAILED_STATES = frozenset(s for s in TrialState
                          if s not in (TrialState.COMPLETE, TrialState.RUNNING))


@dataclass(frozen=True)
class TuneOptions:
    """How :func:`tune` searches: the template, the sampler and the budgets (per problem).

    ``sampler`` is one of :data:`flashtune.autotune.strategies.SAMPLERS`; ``interpret``
    tunes under the Triton CPU interpreter (timings meaningless, pipeline checked).
    A value :func:`tune` cannot use (``seed`` outside 0 .. 2**32 - 1, a ``timeout_s`` that
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
    workers: int | None = None  # precompile processes (GPU); None = CPU count
    trial_timeout_s: float = 120.0
    top_k_confirm: int = 3
    # evaluate candidates in a worker process (crash/hang isolation); None: on for the
    # real runner on a GPU, off under the interpreter and for custom runner factories
    isolate: bool | None = None

    def __post_init__(self) -> None:
        # refused here, before tune() opens the store: later they would fail inside Optuna
        # or the database with a RUNNING run left behind
        _check_options(self)


def _check_options(o: TuneOptions) -> None:
    """InputError naming the first field of ``o`` that :func:`tune` cannot use."""
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


@dataclass(frozen=True)
class TuneResult:
    """What :func:`tune` did for one problem: the best config found and stored (None when
    no candidate completed), the template default's timing on the same device, the speedup
    of one over the other, trial counts per final state, and the Optuna study's name."""

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


def _is_memory_url(url: str) -> bool:
    u = url.strip()
    return u in ("sqlite://", "sqlite:///:memory:", ":memory:") or u.endswith(":memory:")


def _optuna_storage(url: str) -> Any:
    """Optuna's storage at ``url``. Optuna creates its schema on first use without a lock,
    so two processes opening a fresh database at once can collide ("table ... already
    exists"): the loser retries, and then finds the schema made. On SQLite its
    transactions start with ``BEGIN IMMEDIATE`` (:func:`serialize_sqlite_writes`), so
    concurrent jobs never pop the same queued trial."""
    import optuna
    import sqlalchemy.exc

    from flashtune.db.engine import serialize_sqlite_writes

    if _is_memory_url(url):
        return optuna.storages.InMemoryStorage()
    for attempt in range(5):
        try:
            storage = optuna.storages.RDBStorage(url)
            serialize_sqlite_writes(storage.engine)
            return storage
        except sqlalchemy.exc.SQLAlchemyError as exc:
            if attempt == 4:
                raise
            log.debug("opening Optuna's storage failed (%s); retrying", exc)
            time.sleep(0.2 * (attempt + 1))
    raise AssertionError("unreachable")  # pragma: no cover


def _stale_after(options: TuneOptions) -> timedelta:
    return max(STALE_AFTER, timedelta(seconds=3 * options.trial_timeout_s))


RUN_ATTR = "flashtune_run_id"  # user attribute of each Optuna trial: the run that asked it


def _owner_alive(pid: int) -> bool:
    """Whether process ``pid`` of this host still runs (a zombie counts as dead)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
        return state not in (b"Z", b"X")
    except (OSError, IndexError):
        return True


def _dead_runs(store: TuningStore, ids: tuple[int, int, int]) -> list[int]:
    """RUNNING runs of the study whose owner process, on this host, is gone."""
    host, me = socket.gethostname(), os.getpid()
    return [r.id for r in store.list_runs(*ids, status=RunStatus.RUNNING)
            if r.host == host and r.pid is not None and r.pid != me
            and not _owner_alive(r.pid)]


def _fail_dead_optuna_trials(study: Any, older_than: timedelta,
                             dead_runs: Sequence[int] = ()) -> int:
    """Optuna trials left RUNNING by a dead job (asked by one of ``dead_runs``, or started
    longer ago than ``older_than``) become FAIL, so samplers stop treating them as
    pending."""
    from datetime import datetime

    import optuna

    n = 0
    dead = set(dead_runs)
    for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        start = t.datetime_start
        if t.user_attrs.get(RUN_ATTR) not in dead and start is not None \
                and datetime.now() - start < older_than:
            continue
        try:
            study._storage.set_trial_state_values(t._trial_id, optuna.trial.TrialState.FAIL)
            n += 1
        except Exception as exc:  # noqa: BLE001 - another worker finished it meanwhile
            log.debug("could not fail optuna trial %s: %s", t.number, exc)
    return n


def _requeue_lost(study: Any, store: TuningStore, ids: tuple[int, int, int],
                  space: SearchSpace, requeued: set[str]) -> int:
    """Queue again every config of ``space`` that has no trial in the study, trials failed
    as stale aside: points a dead job lost after Optuna handed them out (killed before
    its trial was recorded, or while measuring it). Optuna's grid sampler counts every
    finished Optuna trial, FAIL included, as a visited point, so without this a resumed
    grid study would end with those configs never measured. Each config is queued at most
    once per run (``requeued``); returns how many were queued now."""
    from flashtune.autotune.strategies import enqueue

    recorded = _recorded_configs(store, ids)
    n = 0
    for cfg in space:
        key = canonical_json(cfg)
        if key in recorded or key in requeued:
            continue
        requeued.add(key)
        n += enqueue(study, cfg, space, skip_if_exists=False)
    return n


def _unmeasured(store: TuningStore, ids: tuple[int, int, int], space: SearchSpace,
                problem: AttentionProblem, device: DeviceFingerprint) -> int:
    """How many configs the predicate accepts for ``problem`` have no trial in the study
    (trials failed as stale and DUPLICATE records aside; a RUNNING trial counts: a live
    worker is measuring it). 0: the space is exhausted and asking the sampler for more can
    only return configs measured already."""
    taken = _recorded_configs(store, ids)
    return sum(canonical_json(c) not in taken for c in space.valid_configs(problem, device))


def _recorded_configs(store: TuningStore, ids: tuple[int, int, int]) -> set[str]:
    """The canonical JSON of every config with a trial in the study (RUNNING ones too),
    DUPLICATE records and trials failed as stale aside."""
    dev, tpl, prob = ids
    return {canonical_json(t.config)
            for t in store.list_trials(device_id=dev, template_id=tpl, problem_id=prob)
            if t.state is not TrialState.DUPLICATE and t.message != STALE_MESSAGE}


def _tell(study: Any, trial: Any, value: float | None = None, *, state: Any = None) -> None:
    """``study.tell``, except when the trial is finished already (a defence: two workers
    that both got one trial, the first to tell it wins)."""
    try:
        study.tell(trial, value, state=state, skip_if_finished=True)
    except (ValueError, RuntimeError) as exc:
        if not study._storage.get_trial(trial._trial_id).state.is_finished():
            raise
        log.debug("optuna trial %d was told by another worker: %s", trial.number, exc)


def _warm_start(study: Any, store: TuningStore, space: SearchSpace, problem: AttentionProblem,
                device: DeviceFingerprint, template: str, default: Mapping[str, int],
                ids: tuple[int, int, int]) -> None:
    from flashtune.autotune.strategies import enqueue

    candidates = [dict(default)]
    near = []
    for best in store.list_best(device_name=device.name, template_name=template):
        if best.device.hardware_key() != device.hardware_key():
            continue
        try:
            other = AttentionProblem.from_key(best.problem.key)
        except (KeyError, TypeError, ValueError):
            continue
        if other == problem:
            candidates.append(dict(best.config))
            continue
        dist = problem.distance(other)
        if dist != float("inf"):
            near.append((dist, best.problem.id, dict(best.config)))
    near.sort(key=lambda x: (x[0], x[1]))
    candidates += [c for _, _, c in near[:WARM_START_NEIGHBOURS]]
    seen = set()
    for cfg in candidates:
        key = canonical_json(cfg)
        if key in seen:
            continue
        seen.add(key)
        prior = store.find_trial(*ids, cfg)
        if prior is not None and prior.message != STALE_MESSAGE:
            continue
        enqueue(study, cfg, space)


def _check_supported(problems: Sequence[AttentionProblem]) -> None:
    """Refuse problems the runtime would refuse too, before any work starts."""
    from flashtune.core.errors import InputError
    from flashtune.core.problem import SUPPORTED_HEAD_DIMS

    for p in problems:
        if p.head_dim not in SUPPORTED_HEAD_DIMS:
            raise InputError(f"head_dim {p.head_dim} is not supported ({p.describe()}); "
                             f"supported: {list(SUPPORTED_HEAD_DIMS)}")


def _default_runner(spec: Any, problem: AttentionProblem, device: DeviceFingerprint,
                    options: TuneOptions) -> Any:
    from flashtune.autotune.runners import LocalRunner

    return LocalRunner(spec, problem, device, seed=options.seed or 0,
                       timeout_s=options.trial_timeout_s)


def _runner_factory_for(options: TuneOptions, custom: Callable[..., Any] | None,
                        device: DeviceFingerprint) -> Callable[..., Any]:
    """The runner factory a job uses: ``custom`` or the default one, wrapped in a worker
    process when isolated (see ``TuneOptions.isolate``)."""
    factory = custom or _default_runner
    isolate = options.isolate
    if isolate is None:
        isolate = custom is None and not device.is_interpreter
    if not isolate:
        return factory
    from flashtune.autotune.isolation import isolated

    return isolated(factory)


def _close(runner: Any) -> None:
    close = getattr(runner, "close", None)
    if callable(close):
        close()


def tune(problems: Sequence[AttentionProblem], options: TuneOptions, *,
         db_url: str | None = None, progress: bool = True, progress_position: int = 0,
         gpus: Sequence[int] | None = None,
         _runner_factory: Callable[..., Any] | None = None,
         _device: DeviceFingerprint | None = None,
         _space: SearchSpace | None = None) -> list[TuneResult]:
    """Tune each problem in turn; see the module docstring.

    Private hooks for tests: ``_runner_factory(spec, problem, device, options)`` replaces
    :class:`LocalRunner` (e.g. a :class:`ReplayRunner`), ``_device`` the device fingerprint
    and ``_space`` the template's search space.

    Arguments:
        problems: the shapes to tune, in order.
        options: the template, sampler and budgets (:class:`TuneOptions`).
        db_url: the tuning database (None: ``$FLASHTUNE_DB`` or the default file).
        progress: show a progress bar per problem.
        progress_position: the bar's line (one per worker process).
        gpus: tune on these GPU indices, one worker process each, all writing to the same
            database (:func:`flashtune.autotune.workers.tune_on_gpus`); None tunes here, on
            the current GPU.
    Returns:
        One :class:`TuneResult` per problem (every trial and the best config are also
        in the database).
    Raises:
        InputError for a problem the runtime would refuse (e.g. its head_dim);
        ConfigError for a template that cannot be tuned yet; ValueError for ``gpus`` with
        an in-memory database; StoreError / SchemaError when the database cannot be
        used; WorkerError when a GPU worker process dies.
    """
    from flashtune.db import default_db_url, open_store
    from flashtune.kernel_templates import get_template

    url = default_db_url() if db_url is None else str(db_url)
    _check_supported(problems)
    if _runner_factory is None and not get_template(options.template).tunable:
        from flashtune.core.errors import ConfigError

        raise ConfigError(f"template {options.template!r} cannot be tuned yet (no candidate "
                          f"runner for it); it runs with its default config")
    if gpus is not None:
        from flashtune.autotune.workers import tune_on_gpus

        if _is_memory_url(url):
            raise ValueError("several GPU workers need a database they can share; an "
                             "in-memory database is private to one process")
        return tune_on_gpus(problems, options, db_url=url, gpus=gpus, progress=progress)
    spec = get_template(options.template)
    device = _device or (interpreter_device() if options.interpret else cuda_device())
    factory = _runner_factory_for(options, _runner_factory, device)
    results = []
    try:
        with open_store(url) as store:
            for problem in problems:
                results.append(_tune_one(problem, options, store, url, spec, device,
                                         factory, _space or spec.space,
                                         progress, progress_position))
    finally:
        _close(factory)  # an isolated factory's parked worker
    return results


def _tune_one(problem: AttentionProblem, options: TuneOptions, store: TuningStore, url: str,
              spec: Any, device: DeviceFingerprint, runner_factory: Callable[..., Any],
              space: SearchSpace, progress: bool, progress_position: int = 0) -> TuneResult:
    import optuna

    from flashtune.autotune.precompile import precompile
    from flashtune.autotune.runners import TrialResult, time_interleaved
    from flashtune.autotune.strategies import config_from_trial, make_sampler

    t_start = time.monotonic()
    dev = store.ensure_device(device)
    tpl = store.ensure_template(spec.name, spec.source_hash)
    prob = store.ensure_problem(spec.name, problem.key(), problem.bucket())
    ids = (dev.id, tpl.id, prob.id)
    study_name = f"{device.name}/{spec.name}@{spec.source_hash}/{canonical_json(problem.key())}"
    stale = _stale_after(options)
    dead = _dead_runs(store, ids)
    if dead:
        log.info("%s: failing %d RUNNING run(s) whose process died: %s", problem.describe(),
                 len(dead), dead)
        store.fail_stale_trials(*ids, run_ids=dead)
        store.fail_stale_runs(*ids, run_ids=dead)
    store.fail_stale_trials(*ids, older_than=stale)
    store.fail_stale_runs(*ids, older_than=stale)
    run = store.create_run(*ids, study_name=study_name, sampler=options.sampler,
                           seed=options.seed,
                           params={k: v for k, v in options.__dict__.items()},
                           torch_version=device.torch_version,
                           triton_version=device.triton_version,
                           cuda_version=device.cuda_version,
                           driver_version=device.driver_version)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(study_name=study_name, storage=_optuna_storage(url),
                                load_if_exists=True, direction="minimize",
                                sampler=make_sampler(options.sampler, options.seed, space))
    _fail_dead_optuna_trials(study, stale, dead)
    # the default in the study's own terms (a replayed recording may cover fewer knobs)
    default = {n: v for n, v in spec.default_config(problem, device).items() if n in space.params}
    _warm_start(study, store, space, problem, device, spec.name, default, ids)

    runner = runner_factory(spec, problem, device, options)
    states: dict[str, int] = {}
    evaluated = 0
    best_ms: float | None = None
    since_best = 0
    seen: set[str] = set()
    asks = 0
    max_asks = 20 * max(1, options.trials) + 2 * space.size
    batch_size = 1 if device.is_interpreter else max(1, options.workers or 1)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=options.trials, desc=problem.describe(), unit="trial",
                   position=progress_position)
    status = RunStatus.COMPLETE
    requeued: set[str] = set()
    # asks in a row that gave nothing to measure (configs measured already, static prunes):
    # every EXHAUSTION_CHECK of them the study is checked for configs left, so a study whose
    # space is fully measured ends at once instead of asking up to ``max_asks`` times
    fruitless = 0
    exhausted = _unmeasured(store, ids, space, problem, device) == 0
    if exhausted:
        log.warning("%s: every valid config of the space has been measured already; nothing "
                    "left to search (the best is re-confirmed)", problem.describe())

    def grid_done() -> bool:
        # a grid study that has asked every point (this run or an earlier one) is done
        # once queued points are asked and no point lost by a dead job is left; without
        # this a re-run would spin on the sampler's random re-evaluations
        is_exhausted = getattr(study.sampler, "is_exhausted", None)
        if is_exhausted is None or not is_exhausted(study):
            return False
        if study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.WAITING,)):
            return False
        lost = _requeue_lost(study, store, ids, space, requeued)
        if lost:
            log.info("%s: %d config(s) of the grid lost by a dead job, queued again",
                     problem.describe(), lost)
        return lost == 0

    def out_of_budget() -> bool:
        nonlocal fruitless, exhausted
        if exhausted or evaluated >= options.trials or asks >= max_asks \
                or len(seen) >= space.size:
            return True
        if fruitless >= EXHAUSTION_CHECK:
            fruitless = 0
            if _unmeasured(store, ids, space, problem, device) == 0:
                exhausted = True
                log.info("%s: every valid config of the space is measured; search ends",
                         problem.describe())
                return True
        if grid_done():
            return True
        # the wall budget is checked between batches, never before the first one (as
        # Optuna's optimize(timeout=) runs at least one trial): a runner slower to start than
        # the whole budget still gets the default measured
        if options.timeout_s is not None and asks > 0 \
                and time.monotonic() - t_start > options.timeout_s:
            return True
        return options.patience is not None and since_best >= options.patience

    try:
        while not out_of_budget():
            # ask a batch of fresh candidates (static prunes and duplicates are told at once)
            batch: list[tuple[Any, dict[str, int]]] = []
            while len(batch) < batch_size and evaluated + len(batch) < options.trials \
                    and asks < max_asks and len(seen) < space.size \
                    and fruitless < EXHAUSTION_CHECK:
                trial = study.ask()
                asks += 1
                cfg = config_from_trial(trial, space)
                trial.set_user_attr(RUN_ATTR, run.id)
                key = canonical_json(cfg)
                seen.add(key)
                fruitless += 1
                prior = store.find_trial(*ids, cfg)
                if prior is not None and prior.message != STALE_MESSAGE:
                    if prior.state is TrialState.COMPLETE and prior.median_ms is not None:
                        _tell(study, trial, prior.median_ms)
                    elif prior.state is TrialState.PRUNED_STATIC:
                        _tell(study, trial, state=optuna.trial.TrialState.PRUNED)
                    else:
                        _tell(study, trial, state=optuna.trial.TrialState.FAIL)
                    continue
                if any(canonical_json(c) == key for _, c in batch):
                    _tell(study, trial, state=optuna.trial.TrialState.FAIL)
                    continue
                reason = space.check(cfg, problem, device)
                if reason is not None:
                    store.record_trial(run.id, cfg, TrialState.PRUNED_STATIC, message=reason)
                    states[TrialState.PRUNED_STATIC.value] = \
                        states.get(TrialState.PRUNED_STATIC.value, 0) + 1
                    _tell(study, trial, state=optuna.trial.TrialState.PRUNED)
                    continue
                batch.append((trial, cfg))
                fruitless = 0
            if not batch:
                continue
            if len(batch) > 1:
                errors = precompile(spec, problem, [c for _, c in batch], workers=batch_size)
                for k, err in errors.items():
                    if err:
                        log.debug("precompile %s: %s", k, err)
            for trial, cfg in batch:
                rec = store.claim_trial(run.id, cfg)
                if rec is None:  # a concurrent worker of this study measures it
                    _tell(study, trial, state=optuna.trial.TrialState.FAIL)
                    continue
                try:
                    res = runner.evaluate(cfg)
                except Exception as exc:  # a runner must not raise; record it anyway
                    res = TrialResult(TrialState.RUNTIME_ERROR,
                                      f"{type(exc).__name__}: {exc}"[:300])
                store.finish_trial(rec.id, res.state, message=res.message,
                                   median_ms=res.median_ms, p20_ms=res.p20_ms,
                                   p80_ms=res.p80_ms, tflops=res.tflops,
                                   compile_s=res.compile_s)
                states[res.state.value] = states.get(res.state.value, 0) + 1
                evaluated += 1
                if res.state is TrialState.COMPLETE and res.median_ms is not None:
                    _tell(study, trial, res.median_ms)
                    if best_ms is None or res.median_ms < best_ms:
                        best_ms, since_best = res.median_ms, 0
                    else:
                        since_best += 1
                else:
                    _tell(study, trial, state=optuna.trial.TrialState.FAIL)
                    since_best += 1
                if bar is not None:
                    bar.update(1)
                    if best_ms is not None:
                        bar.set_postfix(best_ms=f"{best_ms:.4g}")
                else:
                    log.info("%s trial %d/%d %s: %s %s", problem.describe(), evaluated,
                             options.trials, cfg, res.state.value,
                             f"{res.median_ms:.4g} ms" if res.median_ms else (res.message or ""))
    except KeyboardInterrupt:
        status = RunStatus.INTERRUPTED
        raise
    except BaseException:
        status = RunStatus.FAILED
        raise
    finally:
        if bar is not None:
            bar.close()
        if status is not RunStatus.COMPLETE:
            _close(runner)
            store.fail_stale_trials(*ids, run_ids=[run.id])
            _fail_dead_optuna_trials(study, stale, [run.id])
            store.finish_run(run.id, status)

    # confirm: re-time the study's fastest configs interleaved; the fastest there wins
    complete = [(t.median_ms, t) for t in store.list_trials(
                    device_id=dev.id, template_id=tpl.id, problem_id=prob.id,
                    state=TrialState.COMPLETE) if t.median_ms is not None]
    by_config: dict[str, Any] = {}
    for _, t in sorted(complete, key=lambda mt: mt[0]):
        by_config.setdefault(canonical_json(t.config), t)
    top = list(by_config.values())[:max(1, options.top_k_confirm)]
    # the default config takes part in the re-timing too, so a winner that does not beat
    # it in the same interleaved measurement never replaces it
    default_trial = by_config.get(canonical_json(default))
    if default_trial is not None and default_trial not in top:
        top.append(default_trial)
    retimed: dict[str, TrialResult] = {}
    try:
        if len(top) > 1:
            retimed = time_interleaved(runner, [t.config for t in top])
    finally:
        _close(runner)
    winner = None
    win_ms = win_tf = None
    for t in top:
        r = retimed.get(canonical_json(t.config))
        if r is not None and not r.ok:  # e.g. a measurement error that re-measuring kept
            log.warning("%s: %s failed its confirmation (%s): it cannot be the best",
                        problem.describe(), t.config, r.message)
            continue
        ms, tf = (r.median_ms, r.tflops) if r is not None else (t.median_ms, t.tflops)
        if ms is not None and (win_ms is None or ms < win_ms):
            winner, win_ms, win_tf = t, ms, tf
    became_best = False
    if winner is not None and win_ms is not None:
        n_trials = len(store.list_trials(device_id=dev.id, template_id=tpl.id,
                                         problem_id=prob.id))
        became_best = store.offer_best(*ids, config=winner.config, median_ms=win_ms,
                                       tflops=win_tf, trial_id=winner.id, trials_count=n_trials)
    store.finish_run(run.id, RunStatus.COMPLETE)

    best = store.get_best(*ids)
    default_rec = store.find_trial(*ids, default)
    d_ms = d_tf = None
    if default_rec is not None and default_rec.state is TrialState.COMPLETE:
        d_ms, d_tf = default_rec.median_ms, default_rec.tflops
        r = retimed.get(canonical_json(default))
        if r is not None and r.ok:
            d_ms, d_tf = r.median_ms, r.tflops
    b_ms = best.median_ms if best else None
    return TuneResult(
        problem=problem, device_name=device.name, template=spec.name,
        best_config=dict(best.config) if best else None, best_ms=b_ms,
        best_tflops=best.tflops if best else None, default_config=default,
        default_ms=d_ms, default_tflops=d_tf,
        speedup=(d_ms / b_ms) if d_ms and b_ms else None,
        trials=evaluated, states=states, wall_s=time.monotonic() - t_start,
        became_best=became_best, study_name=study_name)
