"""What the store returns: frozen dataclasses and the two state enums.

Records are plain values, detached from any database session: safe to keep, pass between
threads and compare. The dataclasses are frozen; the ``dict`` fields (``key``, ``params``,
``config``, ``problem_key``, a choice's ``candidates``) are fresh copies decoded for each
record, and callers must treat them as read-only (mutating one changes nothing in the
database and surprises other holders). Timestamps are timezone-aware UTC ``datetime`` objects.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from datetime import datetime
from enum import Enum
from typing import Any

__all__ = [
    "BestConfigRecord",
    "ChoiceRecord",
    "DeviceRecord",
    "ImportedBest",
    "ImportedChoice",
    "ProblemRecord",
    "RunRecord",
    "RunStatus",
    "SoftwareVersions",
    "TemplateRecord",
    "TrialRecord",
    "TrialState",
]


class TrialState(str, Enum):
    """How a trial ended (failures are data, not exceptions). ``RUNNING`` until finished."""

    RUNNING = "RUNNING"
    COMPLETE = "COMPLETE"
    PRUNED_STATIC = "PRUNED_STATIC"  # rejected by the space's validity predicate, never built
    OUT_OF_RESOURCES = "OUT_OF_RESOURCES"  # shared memory / registers exceeded at launch
    COMPILE_ERROR = "COMPILE_ERROR"
    RUNTIME_ERROR = "RUNTIME_ERROR"  # also what a trial of a dead job is marked as
    WRONG_RESULT = "WRONG_RESULT"  # ran, but failed the reference comparison
    TIMEOUT = "TIMEOUT"
    DUPLICATE = "DUPLICATE"  # same config already measured in this study; not re-run

    @property
    def is_finished(self) -> bool:
        """Whether a trial in this state is over (every state but RUNNING)."""
        return self is not TrialState.RUNNING

    def __str__(self) -> str:
        return self.value


class RunStatus(str, Enum):
    """Status of one tuning run (one process working on one study)."""

    RUNNING = "RUNNING"
    COMPLETE = "COMPLETE"
    FAILED = "FAILED"  # ended by an error, or found dead by ``fail_stale_runs``
    INTERRUPTED = "INTERRUPTED"  # stopped on purpose (Ctrl-C, time budget)

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class SoftwareVersions:
    """The software a result was measured under; ``""`` where unknown.

    The field names are the keys of a config file's ``software`` block
    (``flashtune.db.exchange_checks.SOFTWARE_KEYS``); :meth:`as_dict` and
    :meth:`from_dict` convert.
    """

    cuda: str = ""
    driver: str = ""
    flashtune: str = ""
    torch: str = ""
    triton: str = ""

    @classmethod
    def from_dict(cls, versions: Mapping[str, str]) -> SoftwareVersions:
        """From a ``software`` block; missing keys are ``""``, unknown ones a ValueError."""
        names = [f.name for f in fields(cls)]
        unknown = sorted(set(versions) - set(names))
        if unknown:
            raise ValueError(f"unknown software keys {unknown}; expected some of {names}")
        return cls(**{k: versions[k] for k in names if k in versions})

    def as_dict(self) -> dict[str, str]:
        """``{"cuda": ..., "driver": ..., "flashtune": ..., "torch": ..., "triton": ...}``."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class DeviceRecord:
    """A device as identified by its hardware key (see ``DeviceFingerprint.hardware_key``)."""

    id: int
    name: str
    compute_capability: str
    sm_count: int
    shared_mem_per_block: int
    total_memory: int

    def hardware_key(self) -> tuple[str, str, int, int, int]:
        """``(name, compute_capability, sm_count, shared_mem_per_block, total_memory)``:
        what identifies a device in the store."""
        return (self.name, self.compute_capability, self.sm_count,
                self.shared_mem_per_block, self.total_memory)


@dataclass(frozen=True)
class TemplateRecord:
    """A kernel template at one version of its source (``source_hash``)."""

    id: int
    name: str
    source_hash: str


@dataclass(frozen=True)
class ProblemRecord:
    """A problem key of one template; ``key_json`` is its canonical JSON text."""

    id: int
    template_name: str
    key: dict[str, Any]
    key_json: str
    bucket: str


@dataclass(frozen=True)
class RunRecord:
    """One tuning run: which study, which search settings, which software versions."""

    id: int
    device_id: int
    template_id: int
    problem_id: int
    study_name: str
    sampler: str
    seed: int | None
    params: dict[str, Any]
    status: RunStatus
    started_at: datetime
    finished_at: datetime | None
    flashtune_version: str
    torch_version: str
    triton_version: str
    cuda_version: str
    driver_version: str
    host: str
    pid: int | None = None  # the owner process on ``host`` (None before schema 0003)


@dataclass(frozen=True)
class TrialRecord:
    """One config tried in one run; ``number`` counts within the study (0, 1, 2...)."""

    id: int
    run_id: int
    device_id: int
    template_id: int
    problem_id: int
    number: int
    config: dict[str, Any]
    config_hash: str
    state: TrialState
    message: str | None
    median_ms: float | None
    p20_ms: float | None
    p80_ms: float | None
    tflops: float | None
    compile_s: float | None
    started_at: datetime
    finished_at: datetime | None


@dataclass(frozen=True)
class BestConfigRecord:
    """The fastest known config of a (device, template, problem) study, with its context."""

    id: int
    device: DeviceRecord
    template: TemplateRecord
    problem: ProblemRecord
    config: dict[str, Any]
    median_ms: float
    tflops: float | None
    trial_id: int | None  # None when imported from a file rather than measured here
    trials_count: int
    tuned_at: datetime
    # what it was tuned under: its trial's run's versions, or the imported file's
    software: SoftwareVersions


@dataclass(frozen=True)
class ImportedBest:
    """A best config read from an exported file, to be written by ``TuningStore.import_best``.

    Names its device by the hardware key fields and its template and problem by value (the
    store finds or creates the rows); it has no trial in this database.
    """

    device_name: str
    compute_capability: str
    sm_count: int
    shared_mem_per_block: int
    total_memory: int
    template_name: str
    source_hash: str
    problem_key: dict[str, Any]
    bucket: str
    config: dict[str, Any]
    median_ms: float
    tflops: float | None
    trials_count: int
    tuned_at: datetime  # timezone-aware
    software: SoftwareVersions = SoftwareVersions()  # what the entry was tuned under

    def hardware_key(self) -> tuple[str, str, int, int, int]:
        return (self.device_name, self.compute_capability, self.sm_count,
                self.shared_mem_per_block, self.total_memory)


@dataclass(frozen=True)
class ChoiceRecord:
    """The tuner's decision for one user op and problem on one device: which implementation
    (and config) won when the leaders of every implementation were timed side by side, and
    by how much.

    Attributes:
        op: the user op (``flashtune.core.spec.USER_OPS``: ``"fwd"``, ``"decode"``).
        problem_key: the problem's key (``AttentionProblem.key()``).
        bucket: the problem's bucket.
        implementation: the winner (a registered implementation's name).
        source_hash: the winner's source hash when it was decided.
        config: the winner's config (``{}`` for an extern implementation).
        median_ms, tflops: the winner's time and throughput in the decision.
        runner_up, runner_up_ms: the fastest other implementation and its time, or None.
        extern, extern_ms: the fastest extern implementation timed beside the winner (may
            be the winner itself) and its time, or None when none was timed.
        candidates: everything timed in the decision, ``{"implementation", "config",
            "median_ms"}`` each.
        decided_at: when it was decided (or, for an imported one, when the file says).
        software: what it was timed under.
    """

    id: int
    device: DeviceRecord
    op: str
    problem_key: dict[str, Any]
    bucket: str
    implementation: str
    source_hash: str
    config: dict[str, Any]
    median_ms: float
    tflops: float | None
    runner_up: str | None
    runner_up_ms: float | None
    extern: str | None
    extern_ms: float | None
    candidates: tuple[dict[str, Any], ...]
    decided_at: datetime
    software: SoftwareVersions

    @property
    def margin(self) -> float | None:
        """How many times slower the runner-up was (``runner_up_ms / median_ms``), or None."""
        return None if self.runner_up_ms is None else self.runner_up_ms / self.median_ms

    @property
    def extern_margin(self) -> float | None:
        """How many times slower the best extern implementation was (``extern_ms /
        median_ms``; 1.0 when the winner is that extern), or None."""
        return None if self.extern_ms is None else self.extern_ms / self.median_ms


@dataclass(frozen=True)
class ImportedChoice:
    """An op choice read from an exported file, to be written by
    ``TuningStore.import_choices``: its device by the hardware key fields (found or
    created), the decision by value; ``candidates`` those the file carries (schema version
    2; empty for an older file)."""

    device_name: str
    compute_capability: str
    sm_count: int
    shared_mem_per_block: int
    total_memory: int
    op: str
    problem_key: dict[str, Any]
    implementation: str
    source_hash: str
    config: dict[str, Any]
    median_ms: float
    tflops: float | None
    decided_at: datetime  # timezone-aware
    runner_up: str | None = None
    runner_up_ms: float | None = None
    extern: str | None = None
    extern_ms: float | None = None
    candidates: tuple[dict[str, Any], ...] = ()
    software: SoftwareVersions = SoftwareVersions()

    def hardware_key(self) -> tuple[str, str, int, int, int]:
        return (self.device_name, self.compute_capability, self.sm_count,
                self.shared_mem_per_block, self.total_memory)
