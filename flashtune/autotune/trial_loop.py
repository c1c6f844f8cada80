"""The trial loop: tuning in this process, on its device (one GPU, or the interpreter).

:func:`tune_on_device` tunes each problem in turn. Per problem it opens (or resumes) the
problem's study (:func:`flashtune.autotune.study.open_study`), warm-starts it with the
template default and the best configs of the nearest tuned problems, then asks configs of
the sampler until the budget is spent:

* a config the space's predicate rejects: told PRUNED, recorded PRUNED_STATIC;
* a config already measured in this study (this run or an earlier one, found with
  ``store.find_trial``): told its stored value (or FAIL) and *not* re-run nor recorded
  again, so a resumed job never duplicates a flashtune trial;
* otherwise: ``claim_trial`` (None when a concurrent worker of the study has just taken
  the same config: told FAIL, not counted), runner ``evaluate``, ``finish_trial``; told
  ``median_ms``, or FAIL for every failure state.

``trials`` counts configs evaluated in this run; the same command run again continues the
study with ``trials`` more. At the end the ``top_k_confirm`` fastest configs of the study and
the template default are re-timed interleaved, and the fastest is offered as the study's best
(:func:`_confirm`).

Isolated mode (``TuneOptions.isolate``; default on for the real runner on a GPU) evaluates
candidates in a worker process (:mod:`flashtune.autotune.isolation`): a candidate that
crashes or hangs costs its worker, not the job.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from flashtune.autotune import stop
from flashtune.autotune.isolation import isolated
from flashtune.autotune.options import TuneOptions, TuneResult, check_tunable, tuning_device
from flashtune.autotune.study import (
    RUN_ATTR,
    OpenStudy,
    _requeue_lost,
    _unmeasured,
    _warm_start,
    abandon_run,
    open_study,
)
from flashtune.core.device import DeviceFingerprint
from flashtune.core.problem import AttentionProblem
from flashtune.core.space import SearchSpace
from flashtune.db import open_store
from flashtune.db.jsonutil import canonical_json
from flashtune.db.records import RunStatus, TrialState
from flashtune.db.store import STALE_MESSAGE, TuningStore

log = logging.getLogger(__name__)

__all__ = ["runner_factory_for", "shared_runner_factory", "tune_on_device"]

DEFAULT_WORKERS = 8  # precompile processes on a GPU when none are asked for
EXHAUSTION_CHECK = 25  # fruitless asks in a row before the study is checked for configs left


def _default_runner(spec: Any, problem: AttentionProblem, device: DeviceFingerprint,
                    options: TuneOptions) -> Any:
    from flashtune.autotune.runners import LocalRunner

    return LocalRunner(spec, problem, device, seed=options.seed or 0,
                       timeout_s=options.trial_timeout_s, settle_ms=options.settle_ms)


def runner_factory_for(options: TuneOptions, custom: Callable[..., Any] | None,
                       device: DeviceFingerprint) -> Callable[..., Any]:
    """The runner factory a job uses: ``custom`` or the default one, wrapped in a worker
    process when isolated (see ``TuneOptions.isolate``). An isolated factory keeps one
    worker for all the runners it makes (a worker costs seconds to start on a GPU): a
    caller that runs several searches (``tune --op``: every implementation of every shape)
    makes it once, passes it to each :func:`tune_on_device` as ``shared_factory`` and
    closes it at the end."""
    factory = custom or _default_runner
    isolate = options.isolate
    if isolate is None:
        isolate = custom is None and not device.is_interpreter
    if not isolate:
        return factory
    if not device.is_interpreter:
        from flashtune.autotune.precompile import share_cache_dir

        share_cache_dir()  # before the worker starts: it reads what the compile pool writes
    return isolated(factory)


def default_workers() -> int:
    """Configs asked for and compiled at once on a GPU when ``TuneOptions.workers`` is None:
    :data:`DEFAULT_WORKERS`, at most the CPU count. Compiling dominates a trial (4-10 s of
    a search's 6-10 s of trials on an H200), so a batch compiles side by side in a process
    pool and is then timed config by config; one at a time, each trial waited for its own
    compile on its first launch."""
    return max(1, min(DEFAULT_WORKERS, os.cpu_count() or 1))


@contextmanager
def shared_runner_factory(options: TuneOptions, custom: Callable[..., Any] | None,
                          device: DeviceFingerprint) -> Iterator[Callable[..., Any]]:
    """:func:`runner_factory_for` for a caller's several searches, closed (its parked worker
    stopped) when the block ends."""
    factory = runner_factory_for(options, custom, device)
    try:
        yield factory
    finally:
        _close(factory)


def _close(runner: Any) -> None:
    close = getattr(runner, "close", None)
    if callable(close):
        close()


def tune_on_device(problems: Sequence[AttentionProblem], options: TuneOptions, *,
                   db_url: str, progress: bool = True, progress_position: int = 0,
                   runner_factory: Callable[..., Any] | None = None,
                   device: DeviceFingerprint | None = None,
                   space: SearchSpace | None = None,
                   shared_factory: Callable[..., Any] | None = None) -> list[TuneResult]:
    """Tune each problem in turn in this process; see the module docstring.

    ``shared_factory``: the factory :func:`runner_factory_for` made for the caller, who
    closes it (its worker then serves the caller's next search too); None: one is made
    for this call and closed at its end.

    ``runner_factory(spec, problem, device, options)`` replaces :class:`LocalRunner`,
    ``device`` the device fingerprint (None: the interpreter's or the current GPU's) and
    ``space`` the template's search space (:func:`flashtune.autotune.jobs.tune`'s private
    hooks for tests). Raises as ``tune`` does, :func:`check_tunable`'s errors first.
    """
    from flashtune.kernel_templates import get_template

    check_tunable(problems, options.template, custom_runner=runner_factory is not None)
    spec = get_template(options.template)
    device = device or tuning_device(options)
    factory = shared_factory or runner_factory_for(options, runner_factory, device)
    results = []
    try:
        with open_store(db_url) as store:
            for problem in problems:
                results.append(_tune_one(problem, options, store, db_url, spec, device,
                                         factory, space or spec.space,
                                         progress, progress_position))
    finally:
        if shared_factory is None:
            _close(factory)  # an isolated factory's parked worker
    return results


def _tell(study: Any, trial: Any, value: float | None = None, *, state: Any = None) -> None:
    """``study.tell``, except when the trial is finished already (a defence: two workers
    that both got one trial, the first to tell it wins)."""
    try:
        study.tell(trial, value, state=state, skip_if_finished=True)
    except (ValueError, RuntimeError) as exc:
        if not study._storage.get_trial(trial._trial_id).state.is_finished():
            raise
        log.debug("optuna trial %d was told by another worker: %s", trial.number, exc)


def _tune_one(problem: AttentionProblem, options: TuneOptions, store: TuningStore, url: str,
              spec: Any, device: DeviceFingerprint, runner_factory: Callable[..., Any],
              space: SearchSpace, progress: bool, progress_position: int = 0) -> TuneResult:
    import optuna

    from flashtune.autotune.precompile import precompile
    from flashtune.autotune.runners import TrialResult
    from flashtune.autotune.strategies import config_from_trial

    t_start = time.monotonic()
    space = space.for_problem(problem)  # knobs the problem cannot take are not proposed
    opened = open_study(store, url, spec, problem, device, options, space)
    ids, study, run_id = opened.ids, opened.optuna, opened.run_id
    # the default in the study's own terms (a replayed recording may cover fewer knobs)
    default = {n: v for n, v in spec.default_config(problem, device).items() if n in space.params}
    seeds = [{n: v for n, v in seed.items() if n in space.params}
             for seed in (spec.seed_configs(problem, device) if spec.seed_configs else [])]
    _warm_start(study, store, space, problem, device, spec.name, default, ids, seeds)

    runner = runner_factory(spec, problem, device, options)
    states: dict[str, int] = {}
    evaluated = 0
    best_ms: float | None = None
    since_best = 0
    seen: set[str] = set()
    asks = 0
    max_asks = 20 * max(1, options.trials) + 2 * space.size
    batch_size = 1 if device.is_interpreter else max(1, options.workers or default_workers())
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
            stop.check()
            # ask a batch of fresh candidates (static prunes and duplicates are told at once)
            batch: list[tuple[Any, dict[str, int]]] = []
            while len(batch) < batch_size and evaluated + len(batch) < options.trials \
                    and asks < max_asks and len(seen) < space.size \
                    and fruitless < EXHAUSTION_CHECK:
                trial = study.ask()
                asks += 1
                cfg = config_from_trial(trial, space)
                trial.set_user_attr(RUN_ATTR, run_id)
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
                    store.record_trial(run_id, cfg, TrialState.PRUNED_STATIC, message=reason)
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
                stop.check()  # a SIGTERM whose exception a finalizer swallowed
                rec = store.claim_trial(run_id, cfg)
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
        stop.check()  # a request that came with the last trial: no confirmation round
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
            abandon_run(store, opened, status)

    became_best, retimed = _confirm(store, opened, problem, options, default, runner)
    store.finish_run(run_id, RunStatus.COMPLETE)

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
        became_best=became_best, study_name=opened.name)


def _confirm(store: TuningStore, opened: OpenStudy, problem: AttentionProblem,
             options: TuneOptions, default: Mapping[str, int],
             runner: Any) -> tuple[bool, dict[str, Any]]:
    """Re-time the study's ``top_k_confirm`` fastest configs, the default and the stored
    best interleaved, offer the fastest there as the study's best, and close ``runner``.
    Returns whether it became the best, and the re-timed results by canonical config.

    The stored best takes part, so the offer is decided on numbers of one measurement and
    replaces the record even when it is slower than what an earlier run recorded (the
    figure users get is this run's, not the luckiest one ever taken).
    """
    from flashtune.autotune.runners import TrialResult, time_interleaved

    dev, tpl, prob = ids = opened.ids
    complete = [(t.median_ms, t) for t in store.list_trials(
                    device_id=dev, template_id=tpl, problem_id=prob,
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
    stored = store.get_best(*ids)
    configs = [t.config for t in top]
    stored_key = canonical_json(dict(stored.config)) if stored is not None else None
    if stored is not None and stored_key not in {canonical_json(c) for c in configs}:
        configs.append(dict(stored.config))
    retimed: dict[str, TrialResult] = {}
    try:
        if len(configs) > 1:
            retimed = time_interleaved(runner, configs)
    finally:
        _close(runner)
    # (config, ms, TFLOP/s, trial id, software) of each candidate: this run's re-timing
    # where there is one; the stored best only when re-timed here (software None: its
    # trial's run's, read by the store)
    candidates: list[tuple[dict[str, Any], float, float | None, int | None, Any]] = []
    for t in top:
        r = retimed.get(canonical_json(t.config))
        if r is not None and not r.ok:  # e.g. a measurement error that re-measuring kept
            log.warning("%s: %s failed its confirmation (%s): it cannot be the best",
                        problem.describe(), t.config, r.message)
            continue
        ms, tf = (r.median_ms, r.tflops) if r is not None else (t.median_ms, t.tflops)
        if ms is not None:
            candidates.append((t.config, ms, tf, t.id, None))
    s = retimed.get(stored_key) if stored_key is not None else None
    fresh = stored is not None and s is not None and s.ok and s.median_ms is not None
    if fresh and stored_key not in {canonical_json(c[0]) for c in candidates}:
        assert stored is not None and s is not None and s.median_ms is not None  # fresh
        candidates.append((dict(stored.config), s.median_ms, s.tflops, stored.trial_id,
                           stored.software))
    became_best = False
    if candidates:
        config, win_ms, win_tf, trial_id, software = min(candidates, key=lambda c: c[1])
        n_trials = len(store.list_trials(device_id=dev, template_id=tpl, problem_id=prob))
        # the stored best was timed beside the winner (it is the winner, or it lost): the
        # record follows this measurement
        became_best = store.offer_best(*ids, config=config, median_ms=win_ms, tflops=win_tf,
                                       trial_id=trial_id, trials_count=n_trials,
                                       software=software,
                                       refreshes=stored.config if fresh and stored else None)
    return became_best, retimed
