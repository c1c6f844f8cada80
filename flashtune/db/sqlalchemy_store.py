""":class:`SQLAlchemyStore`: the tuning store on any SQLAlchemy database.

Each public method is one short transaction run through ``self._run`` (see
:mod:`flashtune.db.transactions`, which holds the engine, the schema check and the one
context manager that commits, rolls back and converts driver errors).
"""

from __future__ import annotations

import logging
import math
import os
import socket
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from flashtune._version import __version__
from flashtune.db import convert, rows, schema
from flashtune.db.jsonutil import canonical_json, hash_canonical
from flashtune.db.models import (
    BestConfig,
    Choice,
    Device,
    Problem,
    Run,
    Template,
    Trial,
    utcnow,
)
from flashtune.db.records import (
    BestConfigRecord,
    ChoiceRecord,
    DeviceRecord,
    ImportedBest,
    ImportedChoice,
    ProblemRecord,
    RunRecord,
    RunStatus,
    SoftwareVersions,
    TemplateRecord,
    TrialRecord,
    TrialState,
)
from flashtune.db.store import IMPORT_POLICIES, STALE_MESSAGE, TuningStore
from flashtune.db.transactions import TransactionRunner, get_row, rowcount

if TYPE_CHECKING:  # pragma: no cover
    from flashtune.core.device import DeviceFingerprint

__all__ = ["SQLAlchemyStore"]

log = logging.getLogger(__name__)
CONFLICT_RETRIES = 20
R = TypeVar("R")
T = TypeVar("T")


class SQLAlchemyStore(TransactionRunner, TuningStore):
    """The store on the database at ``url`` (any SQLAlchemy URL). See :class:`TuningStore`.

    Opening checks the schema (``flashtune.db.schema.check_schema``): an empty database is
    created at head when ``create`` (and not ``read_only``); an older or newer one raises
    ``SchemaError``. ``read_only=True`` never writes (SQLite opens the file ``mode=ro``).
    """

    def __repr__(self) -> str:
        return f"SQLAlchemyStore({self.url!r}, read_only={self.read_only})"

    # -- identities -------------------------------------------------------------------------

    def ensure_device(self, fingerprint: DeviceFingerprint) -> DeviceRecord:
        key = fingerprint.hardware_key()
        return self._get_or_create(
            f"ensure_device({key[0]})",
            lambda s: _maybe(convert.device, rows.find_device(s, key)),
            lambda s: convert.device(rows.add_device(s, key)))

    def ensure_template(self, name: str, source_hash: str) -> TemplateRecord:
        return self._get_or_create(
            f"ensure_template({name})",
            lambda s: _maybe(convert.template, rows.find_template(s, name, source_hash)),
            lambda s: convert.template(rows.add_template(s, name, source_hash)))

    def ensure_problem(self, template_name: str, key: Mapping[str, Any],
                       bucket: str) -> ProblemRecord:
        key_json = canonical_json(dict(key))
        return self._get_or_create(
            f"ensure_problem({template_name})",
            lambda s: _maybe(convert.problem, rows.find_problem(s, template_name, key_json)),
            lambda s: convert.problem(rows.add_problem(s, template_name, key_json, bucket)))

    def list_devices(self) -> list[DeviceRecord]:
        return self._run("list_devices", lambda s: [
            convert.device(r) for r in s.scalars(select(Device).order_by(Device.id))])

    def list_templates(self) -> list[TemplateRecord]:
        return self._run("list_templates", lambda s: [
            convert.template(r) for r in s.scalars(select(Template).order_by(Template.id))])

    def list_problems(self, template_name: str | None = None) -> list[ProblemRecord]:
        stmt = select(Problem).order_by(Problem.id)
        if template_name is not None:
            stmt = stmt.where(Problem.template_name == template_name)
        return self._run("list_problems", lambda s: [convert.problem(r) for r in s.scalars(stmt)])

    # -- runs -------------------------------------------------------------------------------

    def create_run(self, device_id: int, template_id: int, problem_id: int, *,
                   study_name: str, sampler: str, seed: int | None = None,
                   params: Mapping[str, Any] | None = None,
                   flashtune_version: str = __version__, torch_version: str = "",
                   triton_version: str = "", cuda_version: str = "",
                   driver_version: str = "", host: str | None = None,
                   pid: int | None = None) -> RunRecord:
        params_json = canonical_json(dict(params or {}))
        if host is None:
            host, pid = socket.gethostname(), os.getpid() if pid is None else pid

        def work(s: Session) -> RunRecord:
            row = Run(device_id=device_id, template_id=template_id, problem_id=problem_id,
                      study_name=study_name, sampler=sampler, seed=seed,
                      params_json=params_json, status=RunStatus.RUNNING.value,
                      started_at=utcnow(), finished_at=None,
                      flashtune_version=flashtune_version, torch_version=torch_version,
                      triton_version=triton_version, cuda_version=cuda_version,
                      driver_version=driver_version, host=host, pid=pid)
            s.add(row)
            s.flush()
            return convert.run(row)

        return self._run(f"create_run({study_name})", work, write=True)

    def finish_run(self, run_id: int, status: RunStatus | str) -> RunRecord:
        status = RunStatus(status)
        if status is RunStatus.RUNNING:
            raise ValueError("finish_run needs a final status, not RUNNING")

        def work(s: Session) -> RunRecord:
            row = get_row(s, Run, run_id, self.url)
            row.status, row.finished_at = status.value, utcnow()
            s.flush()
            return convert.run(row)

        return self._run(f"finish_run({run_id})", work, write=True)

    def get_run(self, run_id: int) -> RunRecord | None:
        def work(s: Session) -> RunRecord | None:
            row = s.get(Run, run_id)
            return convert.run(row) if row else None

        return self._run(f"get_run({run_id})", work)

    def latest_run(self, device_id: int, template_id: int) -> RunRecord | None:
        stmt = (select(Run).where(Run.device_id == device_id, Run.template_id == template_id)
                .order_by(Run.started_at.desc(), Run.id.desc()).limit(1))

        def work(s: Session) -> RunRecord | None:
            row = s.scalars(stmt).first()
            return convert.run(row) if row else None

        return self._run("latest_run", work)

    def list_runs(self, device_id: int | None = None, template_id: int | None = None,
                  problem_id: int | None = None, *,
                  status: RunStatus | str | None = None) -> list[RunRecord]:
        stmt = select(Run).order_by(Run.id)
        for column, value in ((Run.device_id, device_id), (Run.template_id, template_id),
                              (Run.problem_id, problem_id)):
            if value is not None:
                stmt = stmt.where(column == value)
        if status is not None:
            stmt = stmt.where(Run.status == RunStatus(status).value)
        return self._run("list_runs", lambda s: [convert.run(r) for r in s.scalars(stmt)])

    def fail_stale_runs(self, device_id: int | None = None, template_id: int | None = None,
                        problem_id: int | None = None, *, current_run_id: int | None = None,
                        older_than: timedelta | None = None,
                        run_ids: Sequence[int] | None = None) -> int:
        now = utcnow()
        stmt = update(Run).where(Run.status == RunStatus.RUNNING.value)
        if run_ids is not None:
            stmt = stmt.where(Run.id.in_([int(i) for i in run_ids]))
        for column, value in ((Run.device_id, device_id), (Run.template_id, template_id),
                              (Run.problem_id, problem_id)):
            if value is not None:
                stmt = stmt.where(column == value)
        if current_run_id is not None:
            stmt = stmt.where(Run.id != current_run_id)
        if older_than is not None:
            stmt = stmt.where(Run.started_at < now - older_than)
        stmt = stmt.values(status=RunStatus.FAILED.value, finished_at=now)
        return self._run("fail_stale_runs", lambda s: rowcount(s.execute(stmt)), write=True)

    # -- trials -----------------------------------------------------------------------------

    def _insert_trial(self, s: Session, run_id: int, config_json: str,
                      state: TrialState) -> Trial:
        run = get_row(s, Run, run_id, self.url)
        _lock_study(s, run)
        study = (Trial.device_id == run.device_id, Trial.template_id == run.template_id,
                 Trial.problem_id == run.problem_id)
        last = s.scalar(select(func.max(Trial.number)).where(*study))
        row = Trial(run_id=run_id, device_id=run.device_id, template_id=run.template_id,
                    problem_id=run.problem_id, number=0 if last is None else last + 1,
                    config_json=config_json, config_hash=hash_canonical(config_json),
                    state=state.value, started_at=utcnow())
        s.add(row)
        s.flush()
        return row

    def start_trial(self, run_id: int, config: Mapping[str, Any]) -> TrialRecord:
        config_json = canonical_json(dict(config))
        return self._run(
            f"start_trial(run {run_id})",
            lambda s: convert.trial(self._insert_trial(s, run_id, config_json,
                                                       TrialState.RUNNING)),
            write=True, conflict_retries=CONFLICT_RETRIES)

    def claim_trial(self, run_id: int, config: Mapping[str, Any]) -> TrialRecord | None:
        config_json = canonical_json(dict(config))

        def work(s: Session) -> TrialRecord | None:
            run = get_row(s, Run, run_id, self.url)
            _lock_study(s, run)
            taken = s.scalar(
                select(Trial.id)
                .where(Trial.device_id == run.device_id, Trial.template_id == run.template_id,
                       Trial.problem_id == run.problem_id,
                       Trial.config_hash == hash_canonical(config_json),
                       Trial.config_json == config_json,
                       Trial.state != TrialState.DUPLICATE.value,
                       (Trial.message.is_(None)) | (Trial.message != STALE_MESSAGE))
                .limit(1))
            if taken is not None:
                return None
            return convert.trial(self._insert_trial(s, run_id, config_json, TrialState.RUNNING))

        return self._run(f"claim_trial(run {run_id})", work, write=True,
                         conflict_retries=CONFLICT_RETRIES)

    def finish_trial(self, trial_id: int, state: TrialState | str, *,
                     message: str | None = None, median_ms: float | None = None,
                     p20_ms: float | None = None, p80_ms: float | None = None,
                     tflops: float | None = None,
                     compile_s: float | None = None) -> TrialRecord:
        outcome = _outcome(state, message, median_ms, p20_ms, p80_ms, tflops, compile_s)

        def work(s: Session) -> TrialRecord:
            row = get_row(s, Trial, trial_id, self.url)
            if row.state != TrialState.RUNNING.value:
                log.warning("trial %d (number %d) was already %s; overwriting with %s",
                            row.id, row.number, row.state, outcome["state"])
            _apply(row, outcome)
            s.flush()
            return convert.trial(row)

        return self._run(f"finish_trial({trial_id})", work, write=True)

    def record_trial(self, run_id: int, config: Mapping[str, Any], state: TrialState | str,
                     *, message: str | None = None, median_ms: float | None = None,
                     p20_ms: float | None = None, p80_ms: float | None = None,
                     tflops: float | None = None,
                     compile_s: float | None = None) -> TrialRecord:
        config_json = canonical_json(dict(config))
        outcome = _outcome(state, message, median_ms, p20_ms, p80_ms, tflops, compile_s)

        def work(s: Session) -> TrialRecord:
            row = self._insert_trial(s, run_id, config_json, TrialState(outcome["state"]))
            _apply(row, outcome)
            s.flush()
            return convert.trial(row)

        return self._run(f"record_trial(run {run_id})", work, write=True,
                         conflict_retries=CONFLICT_RETRIES)

    def find_trial(self, device_id: int, template_id: int, problem_id: int,
                   config: Mapping[str, Any]) -> TrialRecord | None:
        config_json = canonical_json(dict(config))
        stmt = (select(Trial)
                .where(Trial.device_id == device_id, Trial.template_id == template_id,
                       Trial.problem_id == problem_id,
                       Trial.config_hash == hash_canonical(config_json),
                       Trial.config_json == config_json,
                       Trial.state.not_in([TrialState.RUNNING.value,
                                           TrialState.DUPLICATE.value]))
                .order_by(Trial.number.desc()).limit(1))

        def work(s: Session) -> TrialRecord | None:
            row = s.scalars(stmt).first()
            return convert.trial(row) if row else None

        return self._run("find_trial", work)

    def list_trials(self, *, device_id: int | None = None, template_id: int | None = None,
                    problem_id: int | None = None, run_id: int | None = None,
                    state: TrialState | str | None = None) -> list[TrialRecord]:
        stmt = select(Trial).order_by(Trial.id)
        for column, value in ((Trial.device_id, device_id), (Trial.template_id, template_id),
                              (Trial.problem_id, problem_id), (Trial.run_id, run_id)):
            if value is not None:
                stmt = stmt.where(column == value)
        if state is not None:
            stmt = stmt.where(Trial.state == TrialState(state).value)
        return self._run("list_trials", lambda s: [convert.trial(r) for r in s.scalars(stmt)])

    def fail_stale_trials(self, device_id: int, template_id: int, problem_id: int, *,
                          current_run_id: int | None = None,
                          older_than: timedelta | None = None,
                          message: str = STALE_MESSAGE,
                          run_ids: Sequence[int] | None = None) -> int:
        now = utcnow()
        stmt = update(Trial).where(Trial.device_id == device_id,
                                   Trial.template_id == template_id,
                                   Trial.problem_id == problem_id,
                                   Trial.state == TrialState.RUNNING.value)
        if run_ids is not None:
            stmt = stmt.where(Trial.run_id.in_([int(i) for i in run_ids]))
        if current_run_id is not None:
            stmt = stmt.where(Trial.run_id != current_run_id)
        if older_than is not None:
            stmt = stmt.where(Trial.started_at < now - older_than)
        stmt = stmt.values(state=TrialState.RUNTIME_ERROR.value, message=message,
                           finished_at=now)
        return self._run("fail_stale_trials", lambda s: rowcount(s.execute(stmt)), write=True)

    # -- best configs -----------------------------------------------------------------------

    def offer_best(self, device_id: int, template_id: int, problem_id: int, *,
                   config: Mapping[str, Any], median_ms: float, tflops: float | None,
                   trial_id: int | None, trials_count: int,
                   software: SoftwareVersions | None = None,
                   refreshes: Mapping[str, Any] | None = None) -> bool:
        values = rows.best_values(config, median_ms, tflops, trial_id, trials_count)
        given = None if software is None else rows.software_values(software)
        against = None if refreshes is None else canonical_json(dict(refreshes))

        def work(s: Session) -> bool:
            versions = given if given is not None else \
                rows.software_values(rows.trial_software(s, trial_id))
            # a concurrent first offer fails on the unique constraint: retried as a comparison
            outcome = rows.put_best(s, (device_id, template_id, problem_id),
                                    {**values, **versions}, utcnow(), "keep-faster",
                                    refreshes=against)
            return outcome != "kept"

        return self._run("offer_best", work, write=True, conflict_retries=CONFLICT_RETRIES)

    def import_best(self, entries: Sequence[ImportedBest], *,
                    policy: str = "keep-faster") -> list[str]:
        return self.import_entries(entries, (), policy=policy)[0]

    def import_choices(self, entries: Sequence[ImportedChoice], *,
                       policy: str = "keep-faster") -> list[str]:
        return self.import_entries((), entries, policy=policy)[1]

    def import_entries(self, bests: Sequence[ImportedBest], choices: Sequence[ImportedChoice],
                       *, policy: str = "keep-faster") -> tuple[list[str], list[str]]:
        if policy not in IMPORT_POLICIES:
            raise ValueError(f"unknown import policy {policy!r}; expected one of "
                             f"{', '.join(IMPORT_POLICIES)}")
        best_batch = [(e, canonical_json(dict(e.problem_key)),
                       {**rows.best_values(e.config, e.median_ms, e.tflops, None,
                                           e.trials_count),
                        **rows.software_values(e.software)},
                       rows.aware_utc(e.tuned_at, "tuned_at")) for e in bests]
        choice_batch = [(c, _choice_values(c), rows.aware_utc(c.decided_at, "decided_at"))
                        for c in choices]

        def work(s: Session) -> tuple[list[str], list[str]]:
            devices: dict[Any, int] = {}
            templates: dict[Any, int] = {}
            problems: dict[Any, int] = {}

            def device_id(hw: rows.HardwareKey) -> int:
                if hw not in devices:
                    devices[hw] = rows.device_row(s, hw).id
                return devices[hw]

            best_outcomes = []
            for e, key_json, values, tuned_at in best_batch:
                tpl, prob = (e.template_name, e.source_hash), (e.template_name, key_json)
                if tpl not in templates:
                    templates[tpl] = rows.template_row(s, *tpl).id
                if prob not in problems:
                    problems[prob] = rows.problem_row(s, *prob, e.bucket).id
                best_outcomes.append(rows.put_best(
                    s, (device_id(e.hardware_key()), templates[tpl], problems[prob]),
                    values, tuned_at, policy))
            choice_outcomes = [
                rows.put_choice(s, device_id(c.hardware_key()), values, decided_at, policy)[0]
                for c, values, decided_at in choice_batch]
            return best_outcomes, choice_outcomes

        what = ", ".join(f"{len(batch)} {kind}" for kind, batch in
                         (("best configs", best_batch), ("choices", choice_batch)) if batch)
        operation = (f"import_best({len(best_batch)} entries)" if not choice_batch else
                     f"import_choices({len(choice_batch)} entries)" if not best_batch else
                     f"import_entries({what})")
        return self._run(operation, work, write=True, conflict_retries=CONFLICT_RETRIES)

    def _best_query(self) -> Any:
        return (select(BestConfig, Device, Template, Problem)
                .join(Device, BestConfig.device_id == Device.id)
                .join(Template, BestConfig.template_id == Template.id)
                .join(Problem, BestConfig.problem_id == Problem.id))

    def get_best(self, device_id: int, template_id: int,
                 problem_id: int) -> BestConfigRecord | None:
        stmt = self._best_query().where(BestConfig.device_id == device_id,
                                        BestConfig.template_id == template_id,
                                        BestConfig.problem_id == problem_id)

        def work(s: Session) -> BestConfigRecord | None:
            row = s.execute(stmt).one_or_none()
            return convert.best(*row) if row else None

        return self._run("get_best", work)

    def list_best(self, *, device_name: str | None = None, template_name: str | None = None,
                  source_hash: str | None = None) -> list[BestConfigRecord]:
        stmt = self._best_query().order_by(Device.name, Device.id, Template.name,
                                           Template.id, Problem.bucket, Problem.key_json)
        if device_name is not None:
            stmt = stmt.where(Device.name == device_name)
        if template_name is not None:
            stmt = stmt.where(Template.name == template_name)
        if source_hash is not None:
            stmt = stmt.where(Template.source_hash == source_hash)
        return self._run("list_best", lambda s: [convert.best(*r) for r in s.execute(stmt)])

    # -- op choices -------------------------------------------------------------------------

    def put_choice(self, device_id: int, op: str, problem_key: Mapping[str, Any], *,
                   implementation: str, source_hash: str, config: Mapping[str, int],
                   median_ms: float, tflops: float | None, runner_up: str | None = None,
                   runner_up_ms: float | None = None, extern: str | None = None,
                   extern_ms: float | None = None,
                   candidates: Sequence[Mapping[str, Any]] = (),
                   software: SoftwareVersions | None = None) -> ChoiceRecord:
        values = rows.choice_values(
            op, problem_key, implementation=implementation, source_hash=source_hash,
            config=config, median_ms=median_ms, tflops=tflops, runner_up=runner_up,
            runner_up_ms=runner_up_ms, extern=extern, extern_ms=extern_ms,
            candidates=candidates, software=software or SoftwareVersions())

        def work(s: Session) -> ChoiceRecord:
            device = get_row(s, Device, device_id, self.url)
            _, row = rows.put_choice(s, device.id, values, utcnow(), "overwrite")
            return convert.choice(row, device)

        # a concurrent first decision fails on the unique constraint: retried as a replace
        return self._run(f"put_choice({op})", work, write=True,
                         conflict_retries=CONFLICT_RETRIES)

    def list_choices(self, *, device_name: str | None = None,
                     op: str | None = None) -> list[ChoiceRecord]:
        stmt = (select(Choice, Device).join(Device, Choice.device_id == Device.id)
                .order_by(Device.name, Device.id, Choice.op, Choice.bucket, Choice.key_json))
        if device_name is not None:
            stmt = stmt.where(Device.name == device_name)
        if op is not None:
            stmt = stmt.where(Choice.op == rows.check_op(op))
        return self._run("list_choices",
                         lambda s: [convert.choice(*r) for r in s.execute(stmt)])

    # -- the database -----------------------------------------------------------------------

    def info(self) -> dict[str, Any]:
        models = (Device, Template, Problem, Run, Trial, BestConfig, Choice)

        def work(s: Session) -> dict[str, Any]:
            counts = {m.__tablename__: int(s.scalar(select(func.count()).select_from(m)) or 0)
                      for m in models}
            return {"url": self.url, "dialect": self._engine.dialect.name,
                    "revision": schema.current_revision(s.connection()),
                    "head": schema.HEAD_REVISION, "read_only": self.read_only,
                    "counts": counts}

        return self._run("info", work)


def _lock_study(s: Session, run: Run) -> None:
    """Writers of one study's trials take turns until commit: on PostgreSQL a row lock on
    the study's problem (numbering by max + 1 would otherwise collide under contention,
    and a claim could miss a concurrent one); SQLite's ``BEGIN IMMEDIATE`` already
    serializes every writer. Re-entrant within a transaction."""
    s.execute(select(Problem.id).where(Problem.id == run.problem_id).with_for_update())


def _choice_values(c: ImportedChoice) -> dict[str, Any]:
    return rows.choice_values(
        c.op, c.problem_key, implementation=c.implementation, source_hash=c.source_hash,
        config=c.config, median_ms=c.median_ms, tflops=c.tflops, runner_up=c.runner_up,
        runner_up_ms=c.runner_up_ms, extern=c.extern, extern_ms=c.extern_ms,
        candidates=c.candidates, software=c.software)


def _maybe(to_record: Callable[[R], T], row: R | None) -> T | None:
    return None if row is None else to_record(row)


def _check_finite(name: str, value: float | None) -> None:
    if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value)):
        raise ValueError(f"{name} must be a finite number or None, got {value!r}")


def _outcome(state: TrialState | str, message: str | None, median_ms: float | None,
             p20_ms: float | None, p80_ms: float | None, tflops: float | None,
             compile_s: float | None) -> dict[str, Any]:
    final = TrialState(state)
    if final is TrialState.RUNNING:
        raise ValueError("a finished trial needs a final state, not RUNNING")
    metrics = dict(median_ms=median_ms, p20_ms=p20_ms, p80_ms=p80_ms, tflops=tflops,
                   compile_s=compile_s)
    for name, value in metrics.items():
        _check_finite(name, value)
        if value is not None:
            metrics[name] = float(value)
    return dict(state=final.value, message=message, **metrics)


def _apply(row: Trial, outcome: Mapping[str, Any]) -> None:
    for name, value in outcome.items():
        setattr(row, name, value)
    row.finished_at = utcnow()
