"""A study's lifecycle: its Optuna storage and name, its run rows, its warm start, and the
resume of a study a dead job left behind.

One Optuna study per (device, template, problem), named
``"{device}/{template}@{source_hash}/{canonical problem key}"`` (:func:`study_name`), is
recorded in the store next to flashtune's own trials. :func:`open_study` opens it (or
resumes it) for one run; :func:`_warm_start` queues the template default, its rivals and
the best configs of the nearest tuned problems.

A job killed mid-trial (``kill -9``, the OOM killer, a lost node) leaves its run and trial
RUNNING. On resume, a RUNNING run of this host whose owner process (``RunRecord.pid``) is
gone is dead at once: its trials become RUNTIME_ERROR "stale: job died" and its Optuna
trials (tagged with the run id, :data:`RUN_ATTR`) FAIL, so the config is tried again. Runs
of other hosts, or without a pid, are failed once older than :func:`_stale_after`. Optuna's
grid sampler counts such a FAIL as a visited point: once it has visited every point, configs
of the grid with no trial but stale ones are queued again (:func:`_requeue_lost`), so a
rerun finishes the grid with every config measured once.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from flashtune.autotune.options import TuneOptions
from flashtune.core.device import DeviceFingerprint
from flashtune.core.problem import AttentionProblem
from flashtune.core.space import SearchSpace
from flashtune.db.jsonutil import canonical_json
from flashtune.db.records import RunStatus, TrialState
from flashtune.db.store import STALE_MESSAGE, TuningStore

log = logging.getLogger(__name__)

WARM_START_NEIGHBOURS = 3
STALE_AFTER = timedelta(minutes=5)  # at least; see _stale_after
RUN_ATTR = "flashtune_run_id"  # user attribute of each Optuna trial: the run that asked it


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


def study_name(device: DeviceFingerprint, template: str, source_hash: str,
               problem: AttentionProblem) -> str:
    """The Optuna study's name: one study per device, template version and problem."""
    return f"{device.name}/{template}@{source_hash}/{canonical_json(problem.key())}"


@dataclass(frozen=True)
class OpenStudy:
    """One run of a study: the store's ids of its (device, template, problem), the study's
    name, the run row's id, the Optuna study, and the age past which a RUNNING trial of
    another job counts as dead."""

    ids: tuple[int, int, int]
    name: str
    run_id: int
    optuna: Any
    stale: timedelta


def open_study(store: TuningStore, url: str, spec: Any, problem: AttentionProblem,
               device: DeviceFingerprint, options: TuneOptions,
               space: SearchSpace) -> OpenStudy:
    """Open (or resume) the study of ``problem`` for a new run: fail what dead jobs left
    RUNNING (see the module docstring), record the run, and load the Optuna study with the
    sampler ``options`` asks for."""
    import optuna

    from flashtune.autotune.strategies import make_sampler

    dev = store.ensure_device(device)
    tpl = store.ensure_template(spec.name, spec.source_hash)
    prob = store.ensure_problem(spec.name, problem.key(), problem.bucket())
    ids = (dev.id, tpl.id, prob.id)
    name = study_name(device, spec.name, spec.source_hash, problem)
    stale = _stale_after(options)
    dead = _dead_runs(store, ids)
    if dead:
        log.info("%s: failing %d RUNNING run(s) whose process died: %s", problem.describe(),
                 len(dead), dead)
        store.fail_stale_trials(*ids, run_ids=dead)
        store.fail_stale_runs(*ids, run_ids=dead)
    store.fail_stale_trials(*ids, older_than=stale)
    store.fail_stale_runs(*ids, older_than=stale)
    run = store.create_run(*ids, study_name=name, sampler=options.sampler,
                           seed=options.seed,
                           params={k: v for k, v in options.__dict__.items()},
                           torch_version=device.torch_version,
                           triton_version=device.triton_version,
                           cuda_version=device.cuda_version,
                           driver_version=device.driver_version)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(study_name=name, storage=_optuna_storage(url),
                                load_if_exists=True, direction="minimize",
                                sampler=make_sampler(options.sampler, options.seed, space))
    _fail_dead_optuna_trials(study, stale, dead)
    return OpenStudy(ids=ids, name=name, run_id=run.id, optuna=study, stale=stale)


def abandon_run(store: TuningStore, study: OpenStudy, status: RunStatus) -> None:
    """End a run that did not complete (``status``: INTERRUPTED or FAILED): its RUNNING
    trials fail as stale, in the store and in Optuna, so a rerun tries those configs
    again."""
    store.fail_stale_trials(*study.ids, run_ids=[study.run_id])
    _fail_dead_optuna_trials(study.optuna, study.stale, [study.run_id])
    store.finish_run(study.run_id, status)


def _stale_after(options: TuneOptions) -> timedelta:
    return max(STALE_AFTER, timedelta(seconds=3 * options.trial_timeout_s))


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


def _warm_start(study: Any, store: TuningStore, space: SearchSpace, problem: AttentionProblem,
                device: DeviceFingerprint, template: str, default: Mapping[str, int],
                ids: tuple[int, int, int],
                seeds: Sequence[Mapping[str, int]] = ()) -> None:
    """Queue the template default, the stored best of ``problem``, the template's ``seeds``
    (its default's rivals: :attr:`~flashtune.core.spec.TemplateSpec.seed_configs`) and the
    best configs of the nearest tuned problems on this hardware, in that order, each unless
    it has a trial in the study (trials failed as stale aside)."""
    from flashtune.autotune.strategies import enqueue

    candidates = [dict(default)]
    rivals = [dict(seed) for seed in seeds]
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
    candidates += rivals + [c for _, _, c in near[:WARM_START_NEIGHBOURS]]
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
