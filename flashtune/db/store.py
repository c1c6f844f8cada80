"""The tuning store's contract: what every backend provides, promises and raises.

:class:`TuningStore` is the abstract base (the idea of Optuna's ``storages/_base.py``);
:class:`flashtune.db.sqlalchemy_store.SQLAlchemyStore` implements it for any SQLAlchemy
database, and the contract suite in ``tests/db_tests`` runs every backend through the same
tests.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from flashtune._version import __version__
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

if TYPE_CHECKING:  # pragma: no cover - only the hardware key is used at run time
    from flashtune.core.device import DeviceFingerprint

__all__ = ["IMPORT_OUTCOMES", "IMPORT_POLICIES", "STALE_MESSAGE", "TuningStore"]

STALE_MESSAGE = "stale: job died"
IMPORT_POLICIES = ("keep-faster", "overwrite", "skip")
IMPORT_OUTCOMES = ("added", "replaced", "kept", "skipped")


class TuningStore(abc.ABC):
    """Persistent record of tuning: devices, templates, problems, runs, trials, best configs,
    and op choices (which implementation serves a user op's problem on a device).

    **Studies.** A study is one (device, template, problem) triple. Runs are the processes
    that worked on it; trial numbers count within the study (0, 1, 2... across all runs),
    so several processes tuning the same study never reuse a number.

    **Thread safety.** A store instance may be shared by threads: every method opens its
    own short transaction and returns when it has committed; nothing is held between calls.
    Several processes may use one database at once (SQLite in WAL mode with
    ``BEGIN IMMEDIATE`` write transactions, or PostgreSQL): get-or-create methods, trial
    numbering, :meth:`offer_best`, :meth:`put_choice` and the imports are atomic. A store must not
    cross ``fork()``: open one per process.

    **Immutability.** Methods return frozen dataclasses from :mod:`flashtune.db.records`,
    detached from the database, never ORM rows; their ``dict`` fields are fresh copies and
    must be treated as read-only. A record is a snapshot: it does not change when the
    database does.

    **Errors.** Every driver error becomes :class:`flashtune.StoreError` (a
    :class:`flashtune.FlashtuneError`) whose one-line message names the operation and the
    database URL with its password hidden; the failed transaction is rolled back, so a
    method either happens completely or not at all. A schema too old or too new raises
    :class:`flashtune.SchemaError` when the store is opened. Bad arguments (an unknown
    state, a NaN metric, a config that is not JSON) raise ``ValueError`` before anything
    is written. Writes on a read-only store raise ``StoreError``.
    """

    url: str  # the database URL with any password hidden
    read_only: bool

    # -- identities (get-or-create, idempotent and safe under concurrency) ----------------

    @abc.abstractmethod
    def ensure_device(self, fingerprint: DeviceFingerprint) -> DeviceRecord:
        """The device with ``fingerprint.hardware_key()``, created on first use."""

    @abc.abstractmethod
    def ensure_template(self, name: str, source_hash: str) -> TemplateRecord:
        """The template ``name`` at source version ``source_hash``, created on first use."""

    @abc.abstractmethod
    def ensure_problem(self, template_name: str, key: Mapping[str, Any],
                       bucket: str) -> ProblemRecord:
        """The problem ``key`` of ``template_name``, created on first use.

        ``key`` is stored as canonical JSON, so equal mappings are the same problem.
        ``bucket`` is only written when the problem is created.
        """

    @abc.abstractmethod
    def list_devices(self) -> list[DeviceRecord]:
        """Every device, by id."""

    @abc.abstractmethod
    def list_templates(self) -> list[TemplateRecord]:
        """Every (template, source hash), by id."""

    @abc.abstractmethod
    def list_problems(self, template_name: str | None = None) -> list[ProblemRecord]:
        """Every problem (of ``template_name`` when given), by id."""

    # -- runs -------------------------------------------------------------------------------

    @abc.abstractmethod
    def create_run(self, device_id: int, template_id: int, problem_id: int, *,
                   study_name: str, sampler: str, seed: int | None = None,
                   params: Mapping[str, Any] | None = None,
                   flashtune_version: str = __version__, torch_version: str = "",
                   triton_version: str = "", cuda_version: str = "",
                   driver_version: str = "", host: str | None = None,
                   pid: int | None = None) -> RunRecord:
        """Start a run (status RUNNING) of the study; ``host`` defaults to this host name
        and then ``pid`` to this process's id (the run's owner, see :meth:`list_runs`).

        ``params`` holds the search settings (budget, timeouts...) as JSON-able values.
        """

    @abc.abstractmethod
    def finish_run(self, run_id: int, status: RunStatus | str) -> RunRecord:
        """Set a run's final status (not RUNNING) and its finish time."""

    @abc.abstractmethod
    def get_run(self, run_id: int) -> RunRecord | None:
        """The run ``run_id``, or None."""

    @abc.abstractmethod
    def latest_run(self, device_id: int, template_id: int) -> RunRecord | None:
        """The run of ``device_id`` and ``template_id`` (any problem, any status) started
        last, or None."""

    @abc.abstractmethod
    def list_runs(self, device_id: int | None = None, template_id: int | None = None,
                  problem_id: int | None = None, *,
                  status: RunStatus | str | None = None) -> list[RunRecord]:
        """Runs matching every filter given, by id: e.g. the RUNNING runs of a study, whose
        ``host`` and ``pid`` tell a resumed job which of them died."""

    @abc.abstractmethod
    def fail_stale_runs(self, device_id: int | None = None, template_id: int | None = None,
                        problem_id: int | None = None, *, current_run_id: int | None = None,
                        older_than: timedelta | None = None,
                        run_ids: Sequence[int] | None = None) -> int:
        """Mark RUNNING runs (of the study, when ids are given) FAILED; return how many.

        ``current_run_id`` is never touched; ``older_than`` spares runs started more
        recently (another live worker's); ``run_ids`` limits it to those runs (ones known
        dead). Their RUNNING trials are left alone: see :meth:`fail_stale_trials`.
        """

    # -- trials -----------------------------------------------------------------------------

    @abc.abstractmethod
    def start_trial(self, run_id: int, config: Mapping[str, Any]) -> TrialRecord:
        """Record that ``config`` is being tried in ``run_id``: state RUNNING, next number.

        The number is the study's next one, unique even with concurrent processes.
        """

    @abc.abstractmethod
    def claim_trial(self, run_id: int, config: Mapping[str, Any]) -> TrialRecord | None:
        """:meth:`start_trial`, unless the study already has a trial of ``config`` that is
        RUNNING or finished (DUPLICATE trials and trials failed as stale do not count):
        then None and nothing is written. Atomic, so concurrent workers of one study never
        both measure a config."""

    @abc.abstractmethod
    def finish_trial(self, trial_id: int, state: TrialState | str, *,
                     message: str | None = None, median_ms: float | None = None,
                     p20_ms: float | None = None, p80_ms: float | None = None,
                     tflops: float | None = None,
                     compile_s: float | None = None) -> TrialRecord:
        """Set a trial's final ``state`` (not RUNNING), message, timings and finish time.

        Finishing a trial that is no longer RUNNING (e.g. one :meth:`fail_stale_trials`
        marked while its worker was in fact alive) overwrites it and logs a warning: the
        measured result is worth more than the guess.
        """

    @abc.abstractmethod
    def record_trial(self, run_id: int, config: Mapping[str, Any], state: TrialState | str,
                     *, message: str | None = None, median_ms: float | None = None,
                     p20_ms: float | None = None, p80_ms: float | None = None,
                     tflops: float | None = None,
                     compile_s: float | None = None) -> TrialRecord:
        """:meth:`start_trial` + :meth:`finish_trial` in one transaction (e.g. a config the
        validity predicate pruned, recorded as PRUNED_STATIC without ever running)."""

    @abc.abstractmethod
    def find_trial(self, device_id: int, template_id: int, problem_id: int,
                   config: Mapping[str, Any]) -> TrialRecord | None:
        """The latest finished trial of the study with this exact config, or None.

        RUNNING and DUPLICATE trials are skipped: a resumed job uses this to avoid
        measuring a config twice and to reuse the earlier outcome.
        """

    @abc.abstractmethod
    def list_trials(self, *, device_id: int | None = None, template_id: int | None = None,
                    problem_id: int | None = None, run_id: int | None = None,
                    state: TrialState | str | None = None) -> list[TrialRecord]:
        """Trials matching every filter given, in creation order."""

    @abc.abstractmethod
    def fail_stale_trials(self, device_id: int, template_id: int, problem_id: int, *,
                          current_run_id: int | None = None,
                          older_than: timedelta | None = None,
                          message: str = STALE_MESSAGE,
                          run_ids: Sequence[int] | None = None) -> int:
        """Mark the study's RUNNING trials RUNTIME_ERROR with ``message``; return how many.

        Trials of ``current_run_id`` (the caller's run) are left alone. Without
        ``older_than`` every other RUNNING trial counts as stale, which is right when no
        other worker is tuning this study now; with concurrent workers pass ``older_than``
        (longer than any trial can take) so live trials are spared, or ``run_ids`` (runs
        whose owner process is known to be dead) to fail only theirs, at once.
        """

    # -- best configs -----------------------------------------------------------------------

    @abc.abstractmethod
    def offer_best(self, device_id: int, template_id: int, problem_id: int, *,
                   config: Mapping[str, Any], median_ms: float, tflops: float | None,
                   trial_id: int | None, trials_count: int,
                   software: SoftwareVersions | None = None,
                   refreshes: Mapping[str, Any] | None = None) -> bool:
        """Make ``config`` the study's best if there is none or it is strictly faster.

        ``refreshes`` is the stored best's config when the offer was timed beside it in the
        same measurement (the tuner's confirmation round): while it is still the stored
        best, the offer replaces it whatever the two recorded times say, so the record
        follows a fresh measurement rather than the luckiest one ever taken (compare and
        swap: if another writer changed the best in between, keep-faster applies).

        The best config keeps the ``software`` it was tuned under; None (the default)
        takes the versions of ``trial_id``'s run, read in the same transaction (empty
        versions without a trial). Atomic: concurrent offers never lose the fastest.
        Returns whether it became the best; a slower or equal offer returns False and
        changes nothing.
        """

    @abc.abstractmethod
    def import_best(self, entries: Sequence[ImportedBest], *,
                    policy: str = "keep-faster") -> list[str]:
        """Write best configs read from files, all in ONE transaction: all or nothing.

        Devices, templates and problems are found or created as by the ``ensure_*``
        methods (a new problem gets the entry's bucket); each entry's best config gets
        ``trial_id`` None and keeps its ``tuned_at``, ``trials_count``, timings and
        ``software``.
        ``policy`` decides what happens where the study already has a best config:
        ``"keep-faster"`` replaces it only with a strictly faster one (lower
        ``median_ms``), ``"overwrite"`` always replaces it, ``"skip"`` never does. Entries
        are applied in order, so a later entry for the same study sees the earlier one.

        Returns one outcome per entry, in order: ``"added"`` (the study had none),
        ``"replaced"``, ``"kept"`` (keep-faster, the stored one is as fast or faster) or
        ``"skipped"`` (skip policy). An unknown policy or an impossible value (NaN,
        ``median_ms`` <= 0, a naive ``tuned_at``, a config that is not JSON, a version
        over 200 characters) raises
        ``ValueError`` before anything is written; a read-only store raises ``StoreError``.
        """

    @abc.abstractmethod
    def get_best(self, device_id: int, template_id: int,
                 problem_id: int) -> BestConfigRecord | None:
        """The study's best config with its device, template and problem, or None."""

    @abc.abstractmethod
    def list_best(self, *, device_name: str | None = None, template_name: str | None = None,
                  source_hash: str | None = None) -> list[BestConfigRecord]:
        """Best configs matching every filter given (one query), sorted by device name,
        template name, problem bucket and key."""

    # -- op choices -------------------------------------------------------------------------

    @abc.abstractmethod
    def put_choice(self, device_id: int, op: str, problem_key: Mapping[str, Any], *,
                   implementation: str, source_hash: str, config: Mapping[str, int],
                   median_ms: float, tflops: float | None, runner_up: str | None = None,
                   runner_up_ms: float | None = None, extern: str | None = None,
                   extern_ms: float | None = None,
                   candidates: Sequence[Mapping[str, Any]] = (),
                   software: SoftwareVersions | None = None) -> ChoiceRecord:
        """Record the tuner's decision for user op ``op`` and ``problem_key`` on device
        ``device_id``: the winning ``implementation`` (at ``source_hash``) with its
        ``config``, time and throughput, the runner-up and the fastest extern
        implementation timed beside it with their times, and every candidate timed
        (``{"implementation", "config", "median_ms"}`` each).

        An upsert: a new decision replaces the stored one for (device, op, problem)
        whatever either time says (the tuner re-timed every leader side by side, so the
        newest decision is the best informed). The bucket is the problem's
        (``AttentionProblem.from_key(problem_key).bucket()``), ``decided_at`` now;
        ``software`` None records empty versions (unknown). Atomic.

        Returns the stored :class:`ChoiceRecord`. Raises ``InputError`` (a ``ValueError``)
        for an ``op`` not in ``USER_OPS``, ``ValueError`` for another impossible value
        (see :func:`flashtune.db.rows.choice_values`), both before anything is written;
        ``StoreError`` for an unknown device or a read-only store.
        """

    @abc.abstractmethod
    def list_choices(self, *, device_name: str | None = None,
                     op: str | None = None) -> list[ChoiceRecord]:
        """Op choices matching every filter given (one query), sorted by device name, op,
        problem bucket and key; ``InputError`` for an ``op`` not in ``USER_OPS``."""

    @abc.abstractmethod
    def import_choices(self, entries: Sequence[ImportedChoice], *,
                       policy: str = "keep-faster") -> list[str]:
        """Write op choices read from files, all in ONE transaction: all or nothing.

        :meth:`import_best`'s semantics: devices are found or created; ``policy``
        decides what happens where (device, op, problem) already has a choice
        (``"keep-faster"``: replace only with a strictly faster ``median_ms``,
        ``"overwrite"``, ``"skip"``); entries apply in order; each keeps its
        ``decided_at`` and ``software``. Returns one outcome per entry (``"added"``,
        ``"replaced"``, ``"kept"``, ``"skipped"``). An unknown policy or an impossible
        value raises ``ValueError`` (``InputError`` for an op) before anything is written.
        """

    @abc.abstractmethod
    def import_entries(self, bests: Sequence[ImportedBest], choices: Sequence[ImportedChoice],
                       *, policy: str = "keep-faster") -> tuple[list[str], list[str]]:
        """:meth:`import_best` of ``bests`` and :meth:`import_choices` of ``choices`` in ONE
        transaction (what an import of a folder holding both kinds of files needs to be all
        or nothing); returns both outcome lists."""

    # -- the database -----------------------------------------------------------------------

    @abc.abstractmethod
    def info(self) -> dict[str, Any]:
        """``url`` (password hidden), ``dialect``, ``revision``, ``head``, ``read_only`` and
        ``counts`` (rows per table) as JSON-able values."""

    def close(self) -> None:  # noqa: B027 - a hook: a store without connections has none to drop
        """Release connections; the store must not be used afterwards."""

    def __enter__(self) -> TuningStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
