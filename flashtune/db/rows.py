"""Row-level helpers of :class:`flashtune.db.sqlalchemy_store.SQLAlchemyStore`.

Each function taking a session works inside a transaction the caller already holds
(``s``) and never commits: the store's ``ensure_*`` methods run ``find_*`` first and
``add_*`` when nothing was found (see ``TransactionRunner._get_or_create``);
``import_best`` runs ``*_row`` (find or add) for many entries in one transaction.
``offer_best`` and ``import_best`` share :func:`best_values` and :func:`software_values`
(checks, before anything is written) and :func:`put_best` (the compare-and-set on the
locked best-config row); ``offer_best`` takes the software of its trial's run from
:func:`trial_software`. Op choices have the same pair: :func:`choice_values` checks a
decision before anything is written, :func:`put_choice` writes it under a policy
(``put_choice`` of the store overwrites, ``import_choices`` takes the caller's).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from flashtune.core.errors import InputError
from flashtune.core.problem import AttentionProblem
from flashtune.core.spec import USER_OPS
from flashtune.db import convert
from flashtune.db.jsonutil import canonical_json
from flashtune.db.models import (
    VERSION_LENGTH,
    BestConfig,
    Choice,
    Device,
    Problem,
    Run,
    Template,
    Trial,
)
from flashtune.db.records import SoftwareVersions

__all__ = ["add_device", "add_problem", "add_template", "aware_utc", "best_row", "best_values",
           "check_op", "choice_row", "choice_values", "device_row", "find_device",
           "find_problem", "find_template", "problem_row", "put_best", "put_choice",
           "software_values", "template_row", "trial_software"]

NAME_LENGTH = 200  # an implementation's name, as ft_choices keeps it
HASH_LENGTH = 64  # a source hash, as ft_choices keeps it

HardwareKey = tuple[str, str, int, int, int]


def find_device(s: Session, key: HardwareKey) -> Device | None:
    """The device with hardware key ``key`` (name, cc, SMs, shared memory, memory)."""
    name, cc, sms, smem, mem = key
    return s.scalars(select(Device).where(
        Device.name == name, Device.compute_capability == cc, Device.sm_count == sms,
        Device.shared_mem_per_block == smem, Device.total_memory == mem)).one_or_none()


def add_device(s: Session, key: HardwareKey) -> Device:
    name, cc, sms, smem, mem = key
    row = Device(name=name, compute_capability=cc, sm_count=sms, shared_mem_per_block=smem,
                 total_memory=mem)
    s.add(row)
    s.flush()
    return row


def device_row(s: Session, key: HardwareKey) -> Device:
    return find_device(s, key) or add_device(s, key)


def find_template(s: Session, name: str, source_hash: str) -> Template | None:
    return s.scalars(select(Template).where(Template.name == name,
                                            Template.source_hash == source_hash)).one_or_none()


def add_template(s: Session, name: str, source_hash: str) -> Template:
    row = Template(name=name, source_hash=source_hash)
    s.add(row)
    s.flush()
    return row


def template_row(s: Session, name: str, source_hash: str) -> Template:
    return find_template(s, name, source_hash) or add_template(s, name, source_hash)


def find_problem(s: Session, template_name: str, key_json: str) -> Problem | None:
    """The problem whose canonical key JSON is ``key_json``."""
    return s.scalars(select(Problem).where(Problem.template_name == template_name,
                                           Problem.key_json == key_json)).one_or_none()


def add_problem(s: Session, template_name: str, key_json: str, bucket: str) -> Problem:
    row = Problem(template_name=template_name, key_json=key_json, bucket=str(bucket))
    s.add(row)
    s.flush()
    return row


def problem_row(s: Session, template_name: str, key_json: str, bucket: str) -> Problem:
    """Find or add; ``bucket`` is only written when the problem is added."""
    return (find_problem(s, template_name, key_json)
            or add_problem(s, template_name, key_json, bucket))


def best_row(s: Session, device_id: int, template_id: int, problem_id: int) -> BestConfig | None:
    """The study's best-config row, locked for the rest of the transaction.

    FOR UPDATE locks the row on PostgreSQL; SQLite's ``BEGIN IMMEDIATE`` already holds the
    write lock, so a compare-and-set on the returned row cannot interleave with another.
    """
    return s.scalars(select(BestConfig).where(
        BestConfig.device_id == device_id, BestConfig.template_id == template_id,
        BestConfig.problem_id == problem_id).with_for_update()).one_or_none()


def best_values(config: Mapping[str, Any], median_ms: float, tflops: float | None,
                trial_id: int | None, trials_count: int) -> dict[str, Any]:
    """A best-config row's values, checked before anything is written (``ValueError``)."""
    if isinstance(median_ms, bool) or not (isinstance(median_ms, (int, float))
                                           and math.isfinite(median_ms) and median_ms > 0):
        raise ValueError(f"median_ms must be a finite positive number, got {median_ms!r}")
    if tflops is not None and (isinstance(tflops, bool) or not (
            isinstance(tflops, (int, float)) and math.isfinite(tflops))):
        raise ValueError(f"tflops must be a finite number or None, got {tflops!r}")
    count = int(trials_count)
    if count < 0:
        raise ValueError(f"trials_count must be >= 0, got {trials_count!r}")
    return dict(config_json=canonical_json(dict(config)), median_ms=float(median_ms),
                tflops=None if tflops is None else float(tflops), trial_id=trial_id,
                trials_count=count)


def software_values(software: SoftwareVersions) -> dict[str, str]:
    """A best-config row's version columns, checked before anything is written
    (``ValueError`` unless each is a string of at most ``VERSION_LENGTH`` characters)."""
    values = {}
    for name, version in software.as_dict().items():
        if not isinstance(version, str) or len(version) > VERSION_LENGTH:
            raise ValueError(f"software.{name} must be a string of at most {VERSION_LENGTH} "
                             f"characters, got {version!r:.80}")
        values[f"{name}_version"] = version
    return values


def trial_software(s: Session, trial_id: int | None) -> SoftwareVersions:
    """The versions the run of trial ``trial_id`` recorded; empty without a trial."""
    if trial_id is None:
        return SoftwareVersions()
    run = s.scalars(select(Run).join(Trial, Trial.run_id == Run.id)
                    .where(Trial.id == trial_id)).one_or_none()
    if run is None:  # no such trial: the insert's foreign key check says so
        return SoftwareVersions()
    return convert.software(run)


def put_best(s: Session, study: tuple[int, int, int], values: Mapping[str, Any],
             tuned_at: datetime, policy: str, *, refreshes: str | None = None) -> str:
    """Write one best config of ``study`` (device, template, problem ids) under ``policy``
    (see ``TuningStore.import_best``; ``offer_best`` is keep-faster); returns
    ``"added"``, ``"replaced"``, ``"kept"`` (keep-faster, not faster) or ``"skipped"``.
    ``refreshes``: the canonical JSON of the config the offer was timed against; while that
    is still the stored one, the offer replaces it whatever its time (``offer_best``)."""
    device_id, template_id, problem_id = study
    row = best_row(s, device_id, template_id, problem_id)
    if row is not None and refreshes is not None and row.config_json == refreshes:
        policy = "overwrite"
    if row is None:
        s.add(BestConfig(device_id=device_id, template_id=template_id, problem_id=problem_id,
                         tuned_at=tuned_at, **values))
        s.flush()
        return "added"
    if policy == "skip":
        return "skipped"
    if policy == "keep-faster" and not values["median_ms"] < row.median_ms:
        return "kept"
    for name, value in values.items():
        setattr(row, name, value)
    row.tuned_at = tuned_at
    return "replaced"


def aware_utc(when: datetime, name: str) -> datetime:
    """``when`` in UTC; ``ValueError`` naming ``name`` for a naive datetime."""
    if not isinstance(when, datetime) or when.tzinfo is None:
        raise ValueError(f"{name} must be a timezone-aware datetime, got {when!r}")
    return when.astimezone(timezone.utc)


# -- op choices -------------------------------------------------------------------------------

def check_op(op: object) -> str:
    """``op`` when it is a user op (``USER_OPS``), else ``InputError`` naming them."""
    if not isinstance(op, str) or op not in USER_OPS:
        raise InputError(f"op {op!r} is not a user op; expected one of {', '.join(USER_OPS)}")
    return op


def _positive_ms(name: str, value: object) -> float:
    if isinstance(value, bool) or not (isinstance(value, (int, float))
                                       and math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite positive number, got {value!r}")
    return float(value)


def _name(what: str, value: object, length: int = NAME_LENGTH) -> str:
    if not isinstance(value, str) or not value or len(value) > length:
        raise ValueError(f"{what} must be a non-empty string of at most {length} characters, "
                         f"got {value!r:.80}")
    return value


def _rival(what: str, name: object, ms: object) -> tuple[str | None, float | None]:
    """A runner-up or extern: its name and time, both given or both None."""
    if name is None and ms is None:
        return None, None
    if name is None or ms is None:
        raise ValueError(f"{what} and {what}_ms go together: got {what}={name!r}, "
                         f"{what}_ms={ms!r}")
    return _name(what, name), _positive_ms(f"{what}_ms", ms)


def _config(config: object, what: str = "config") -> dict[str, int]:
    if not isinstance(config, Mapping) or any(
            not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, int)
            for k, v in config.items()):
        raise ValueError(f"{what} must map parameter names to ints, got {config!r:.80}")
    return {k: int(v) for k, v in config.items()}


def _candidates(candidates: object) -> str:
    """The canonical JSON list of everything timed: each an object with at least
    ``implementation`` (a name), ``config`` (names to ints) and ``median_ms`` (a finite
    positive number, or None for one that failed when re-timed)."""
    if isinstance(candidates, (str, bytes, Mapping)) or not isinstance(candidates, Sequence):
        raise ValueError(f"candidates must be a sequence of mappings, got {candidates!r:.80}")
    out = []
    for i, c in enumerate(candidates):
        where = f"candidates[{i}]"
        if not isinstance(c, Mapping) or not {"implementation", "config", "median_ms"} <= set(c):
            raise ValueError(f"{where} must be a mapping with implementation, config and "
                             f"median_ms, got {c!r:.80}")
        item = dict(c)
        _name(f"{where}.implementation", item["implementation"])
        item["config"] = _config(item["config"], f"{where}.config")
        if item["median_ms"] is not None:
            item["median_ms"] = _positive_ms(f"{where}.median_ms", item["median_ms"])
        out.append(item)
    return canonical_json(out)


def choice_values(op: str, problem_key: Mapping[str, Any], *, implementation: str,
                  source_hash: str, config: Mapping[str, Any], median_ms: float,
                  tflops: float | None, runner_up: str | None, runner_up_ms: float | None,
                  extern: str | None, extern_ms: float | None,
                  candidates: Sequence[Mapping[str, Any]],
                  software: SoftwareVersions) -> dict[str, Any]:
    """An op choice row's values (all but device and time), checked before anything is
    written: ``InputError`` for an op that is not a user op, ``ValueError`` for anything
    else impossible (a problem key that is not an attention problem's, a time that is not
    a finite positive number, a runner-up without its time, the winner as its own
    runner-up, a config that does not map names to ints, an over-long name or version)."""
    check_op(op)
    if not isinstance(problem_key, Mapping):
        raise ValueError(f"problem_key must be a mapping, got {problem_key!r:.80}")
    try:
        problem = AttentionProblem.from_key(problem_key)
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"problem_key {dict(problem_key)!r:.200} is not an attention "
                         f"problem's key ({exc})") from None
    extra = sorted(set(problem_key) - set(problem.key()))
    if extra:
        raise ValueError(f"problem_key has the unknown keys {extra}; expected exactly "
                         f"{sorted(problem.key())}")
    winner = _name("implementation", implementation)
    runner, runner_ms = _rival("runner_up", runner_up, runner_up_ms)
    if runner == winner:
        raise ValueError(f"runner_up {runner!r} is the winner itself; expected another "
                         "implementation, or None")
    ext, ext_ms = _rival("extern", extern, extern_ms)
    if tflops is not None and (isinstance(tflops, bool) or not (
            isinstance(tflops, (int, float)) and math.isfinite(tflops))):
        raise ValueError(f"tflops must be a finite number or None, got {tflops!r}")
    return dict(op=op, key_json=canonical_json(problem.key()), bucket=problem.bucket(),
                implementation=winner,
                source_hash=_name("source_hash", source_hash, HASH_LENGTH),
                config_json=canonical_json(_config(config)),
                median_ms=_positive_ms("median_ms", median_ms),
                tflops=None if tflops is None else float(tflops),
                runner_up=runner, runner_up_ms=runner_ms, extern=ext, extern_ms=ext_ms,
                candidates_json=_candidates(candidates), **software_values(software))


def choice_row(s: Session, device_id: int, op: str, key_json: str) -> Choice | None:
    """The choice of (device, op, problem), locked for the rest of the transaction (as
    :func:`best_row`)."""
    return s.scalars(select(Choice).where(
        Choice.device_id == device_id, Choice.op == op,
        Choice.key_json == key_json).with_for_update()).one_or_none()


def put_choice(s: Session, device_id: int, values: Mapping[str, Any], decided_at: datetime,
               policy: str) -> tuple[str, Choice]:
    """Write one op choice of ``device_id`` (``values`` from :func:`choice_values`) under
    ``policy`` (as :func:`put_best`: keep-faster compares ``median_ms``); returns the
    outcome (``"added"``, ``"replaced"``, ``"kept"``, ``"skipped"``) and the stored row."""
    row = choice_row(s, device_id, values["op"], values["key_json"])
    if row is None:
        row = Choice(device_id=device_id, decided_at=decided_at, **values)
        s.add(row)
        s.flush()
        return "added", row
    if policy == "skip":
        return "skipped", row
    if policy == "keep-faster" and not values["median_ms"] < row.median_ms:
        return "kept", row
    for name, value in values.items():
        setattr(row, name, value)
    row.decided_at = decided_at
    s.flush()
    return "replaced", row
