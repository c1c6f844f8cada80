"""``flashtune db verify``: re-time a sample of the shipped or stored entries on this GPU.

An *entry* is a tuned config of one template or an op's choice (implementation and config)
for one problem on one device: the files in ``flashtune/configs/`` and
``$FLASHTUNE_CONFIG_DIR`` (``shipped``, as the router reads them, through
:mod:`flashtune.runtime.sources`'s folders and naming functions) and the tuning database
(``db``). Only entries of the current device are verified.

Per entry, before any timing:

* **stale**: tuned for another source hash of its implementation than this flashtune's (or
  for an implementation it does not know): never served, so not timed; a database entry is
  stale only where no current entry replaced it. Whole stale shipped files are reported as
  :class:`~flashtune.runtime.sources.StaleTable` s, with the plan command that re-tunes them.
* **software**: the torch, Triton, CUDA or driver version it was tuned under differs from
  what runs here (unknown versions are not compared).

A sample of the current entries (``sample``, drawn with ``random.Random(seed)``; 0: all) is
then re-timed the way the tuner times a candidate: a
:class:`~flashtune.autotune.runners.LocalRunner` builds the same seeded inputs, the config
is compiled and its output checked against the fp32 reference first (a wrong result is
reported, not timed), then :func:`~flashtune.autotune.runners.time_pairs` times it
(``rounds`` rounds, the median of the round medians: the tuner's confirmation and
side-by-side timing). ``drift`` is measured against recorded throughput, as ``flashtune
bench``'s ``vs recorded`` column: recorded ms / measured ms (0.93x: 7% slower); an entry
more than ``tolerance`` slower (measured > recorded x (1 + tolerance)) is reported. Under
the Triton interpreter the timings mean nothing; the pipeline runs the same.

Every reported entry carries the exact ``flashtune tune`` command that re-tunes it
(:func:`flashtune.autotune.plans.tune_command`).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from flashtune.core.device import DeviceFingerprint
from flashtune.core.problem import AttentionProblem

log = logging.getLogger(__name__)

__all__ = ["SOFTWARE_KEYS", "SOURCES", "VerifyEntry", "VerifyReport", "collect", "render",
           "summary_counts", "verify"]

SOURCES = ("shipped", "db", "all")
# the versions compared (flashtune's own version is not: the source hash covers the kernels)
SOFTWARE_KEYS = ("torch", "triton", "cuda", "driver")


@dataclass(frozen=True)
class VerifyEntry:
    """One entry to verify, and (after :func:`verify`) what was found.

    Attributes:
        origin: ``"package <path>"``, ``"dir <path>"`` or ``"db <url>"``.
        implementation: the template (a config entry) or the op's winner (a choice).
        op: the user op of a choice; None for a template's config.
        problem, config, median_ms: what was recorded.
        source_hash: the implementation's source when it was recorded.
        software: the versions it was recorded under (``""``: unknown).
        status: ``"ok"``, ``"slower"``, ``"fails"`` (its check or launch failed here),
            ``"stale"``, ``"not sampled"``, or ``"skipped"`` (cannot run here).
        measured_ms: the re-timing (None: not timed).
        drift: recorded ms / measured ms (bench's ``vs recorded``).
        software_changed: ``"torch 2.6.0 -> 2.7.0"`` per differing version.
        message: why it failed, was skipped or is stale.
        command: the ``flashtune tune`` command that re-tunes it.
    """

    origin: str
    implementation: str
    op: str | None
    problem: AttentionProblem
    config: dict[str, int]
    median_ms: float
    source_hash: str
    software: dict[str, str]
    status: str = "not sampled"
    measured_ms: float | None = None
    drift: float | None = None
    software_changed: tuple[str, ...] = ()
    message: str = ""
    command: str = ""

    @property
    def what(self) -> str:
        """``attn_fwd`` for a template's config, ``op fwd: sdpa_cudnn`` for a choice."""
        return self.implementation if self.op is None else f"op {self.op}: {self.implementation}"

    @property
    def reported(self) -> bool:
        """Whether it needs re-tuning: slower, failing, stale, or tuned under other software."""
        return self.status in ("slower", "fails", "stale") or bool(self.software_changed)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready values."""
        return {"origin": self.origin, "implementation": self.implementation, "op": self.op,
                "problem": self.problem.key(), "label": self.problem.describe(),
                "config": dict(self.config), "recorded_ms": self.median_ms,
                "source_hash": self.source_hash, "software": dict(self.software),
                "status": self.status, "measured_ms": self.measured_ms, "drift": self.drift,
                "software_changed": list(self.software_changed), "message": self.message,
                "reported": self.reported, "command": self.command}


@dataclass
class VerifyReport:
    """What :func:`verify` found: the entries (sampled or not), the stale shipped files,
    and one line per source that could not be read."""

    device: DeviceFingerprint
    entries: list[VerifyEntry] = field(default_factory=list)
    stale_tables: list[Any] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def reported(self) -> list[VerifyEntry]:
        return [e for e in self.entries if e.reported]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready values."""
        return {"device": self.device.to_dict(),
                "entries": [e.to_dict() for e in self.entries],
                "stale_tables": [t.to_dict() for t in self.stale_tables],
                "problems": list(self.problems),
                "timed": sum(e.measured_ms is not None for e in self.entries),
                "reported": len(self.reported) + len(self.stale_tables)}


def _current_software(device: DeviceFingerprint) -> dict[str, str]:
    return {"torch": device.torch_version, "triton": device.triton_version,
            "cuda": device.cuda_version, "driver": device.driver_version}


def _software_changed(recorded: Mapping[str, str], device: DeviceFingerprint) -> tuple[str, ...]:
    now = _current_software(device)
    return tuple(f"{k} {recorded[k]} -> {now[k] or 'none'}" for k in SOFTWARE_KEYS
                 if recorded.get(k) and recorded[k] != now[k])


def _specs(op: str | None) -> dict[str, Any]:
    from flashtune.kernel_templates import catalog, implementations

    return dict(catalog()) if op is None else {s.name: s for s in implementations(op)}


def _from_files(device: DeviceFingerprint) -> tuple[list[VerifyEntry], list[str]]:
    """The current entries of this device's shipped files (the stale ones are reported as
    whole files by :func:`flashtune.runtime.sources.stale_tables`)."""
    from flashtune.core.spec import USER_OPS
    from flashtune.db.exchange import ConfigDocument, config_file_name, read_document
    from flashtune.db.exchange_choices import choice_file_name, read_choice_document
    from flashtune.kernel_templates import catalog
    from flashtune.runtime.sources import device_key, source_dirs

    specs = catalog()
    here = device_key(device)
    out: list[VerifyEntry] = []
    problems: list[str] = []
    for kind, folder in source_dirs():
        names = [config_file_name(device.name, t) for t in sorted(specs)]
        names += [choice_file_name(device.name, op) for op in USER_OPS]
        for path in (folder / n for n in names):
            if not path.is_file():
                continue
            origin = f"{kind} {path}"
            try:
                if ",op=" in path.name:
                    choices = read_choice_document(path, specs=specs, strict=False)
                    if device_key(choices.device) != here:
                        continue
                    hashes = {n: s.source_hash for n, s in _specs(choices.op).items()}
                    out += [VerifyEntry(origin, e.implementation, choices.op,
                                        AttentionProblem.from_key(e.problem), dict(e.config),
                                        e.median_ms, choices.implementations[e.implementation],
                                        dict(e.software or choices.software))
                            for e in choices.entries if choices.is_current(e, hashes)]
                    continue
                doc = read_document(path, specs=specs)
                if not isinstance(doc, ConfigDocument) or device_key(doc.device) != here \
                        or doc.source_hash != specs[doc.template].source_hash:
                    continue
                out += [VerifyEntry(origin, doc.template, None,
                                    AttentionProblem.from_key(e.problem), dict(e.config),
                                    e.median_ms, doc.source_hash, dict(e.software or doc.software))
                        for e in doc.entries]
            except Exception as exc:  # noqa: BLE001 - a bad file is a line, never a crash
                problems.append(f"{kind} file {path.name} skipped: {' '.join(str(exc).split())}")
    return out, problems


def _from_db(device: DeviceFingerprint, url: str | None) -> list[VerifyEntry]:
    """This device's stored best configs and op choices; an old source's entry that a
    current one replaced is left out (history, not stale)."""
    from flashtune.db import default_db_url, open_store
    from flashtune.db.engine import missing_sqlite_file, safe_url
    from flashtune.runtime.sources import device_key

    url = url or default_db_url(create=False)
    if missing_sqlite_file(url) is not None:
        return []
    here = device_key(device)
    with open_store(url, read_only=True, create=False) as store:
        best = [b for b in store.list_best(device_name=device.name)
                if device_key(b.device) == here]
        choices = [c for c in store.list_choices(device_name=device.name)
                   if device_key(c.device) == here]
    origin = f"db {safe_url(url)}"
    out = [VerifyEntry(origin, b.template.name, None, AttentionProblem.from_key(b.problem.key),
                       dict(b.config), b.median_ms, b.template.source_hash,
                       b.software.as_dict()) for b in best]
    out += [VerifyEntry(origin, c.implementation, c.op, AttentionProblem.from_key(c.problem_key),
                        dict(c.config), c.median_ms, c.source_hash or "", c.software.as_dict())
            for c in choices]
    current = {(e.op, e.implementation, e.problem) for e in out if _stale_reason(e) is None}
    return [e for e in out if _stale_reason(e) is None
            or (e.op, e.implementation, e.problem) not in current]


def _stale_reason(entry: VerifyEntry) -> str | None:
    spec = _specs(entry.op).get(entry.implementation)
    if spec is None:
        where = "template" if entry.op is None else f"implementation of op {entry.op}"
        return f"this flashtune has no {where} {entry.implementation}"
    if spec.source_hash != entry.source_hash:
        return (f"tuned for {entry.implementation} source {entry.source_hash}, this "
                f"flashtune's is {spec.source_hash}")
    return None


def collect(device: DeviceFingerprint, source: str = "all", db_url: str | None = None
            ) -> VerifyReport:
    """The entries of ``source`` (``shipped``, ``db`` or ``all``) for ``device``, each
    marked stale or with its software changes and its re-tune command; nothing timed."""
    from flashtune.autotune.plans import tune_command
    from flashtune.runtime.sources import stale_tables

    if source not in SOURCES:
        raise ValueError(f"source must be one of {', '.join(SOURCES)}, got {source!r}")
    report = VerifyReport(device)
    entries: list[VerifyEntry] = []
    if source in ("shipped", "all"):
        found, problems = _from_files(device)
        entries += found
        report.problems += problems
        stale, problems = stale_tables(device.name)
        report.stale_tables += stale
        report.problems += [p for p in problems if p not in report.problems]
    if source in ("db", "all"):
        entries += _from_db(device, db_url)
    for e in entries:
        try:
            command = tune_command(e.problem, op=e.op, template=None if e.op else
                                   e.implementation)
        except ValueError as exc:
            command = f"(no single command: {exc})"
        reason = _stale_reason(e)
        e = replace(e, command=command, software_changed=_software_changed(e.software, device))
        report.entries.append(e if reason is None
                              else replace(e, status="stale", message=reason))
    return report


def verify(device: DeviceFingerprint, *, source: str = "all", sample: int = 8,
           tolerance: float = 0.05, rounds: int = 3, seed: int = 0,
           db_url: str | None = None) -> VerifyReport:
    """Collect the entries (:func:`collect`) and re-time a sample of the current ones.

    Arguments:
        device: this machine's GPU (:func:`~flashtune.core.device.cuda_device`), or the
            interpreter's fingerprint (timings meaningless).
        source: ``shipped``, ``db`` or ``all``.
        sample: how many current entries to re-time (0: every one).
        tolerance: an entry more than this fraction slower than recorded is reported.
        rounds: timing rounds (the median of the round medians is kept).
        seed: draws the sample.
        db_url: the database (None: ``$FLASHTUNE_DB``, else the default file).
    Raises:
        ValueError for a bad argument; the store's errors.
    """
    if sample < 0:
        raise ValueError(f"sample must be >= 0 (0: every entry), got {sample}")
    if not 0 <= tolerance < 10:
        raise ValueError(f"tolerance must be a fraction in [0, 10), got {tolerance}")
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    report = collect(device, source, db_url)
    current = [i for i, e in enumerate(report.entries) if e.status != "stale"]
    chosen = sorted(random.Random(seed).sample(current, sample)) \
        if 0 < sample < len(current) else current
    for i in chosen:
        report.entries[i] = _retime(report.entries[i], device, tolerance, rounds)
    return report


def _retime(entry: VerifyEntry, device: DeviceFingerprint, tolerance: float,
            rounds: int) -> VerifyEntry:
    """``entry`` checked and timed as the tuner times a candidate."""
    from flashtune.autotune.runners import LocalRunner, time_pairs

    spec = _specs(entry.op)[entry.implementation]
    refused = spec.refuse(entry.problem, device)
    if refused is not None:
        return replace(entry, status="skipped", message=f"cannot run here: {refused}")
    try:
        config = spec.space.validate(entry.config)
        invalid = spec.space.check(config, entry.problem, device)
    except ValueError as exc:
        invalid = str(exc)
    if invalid is not None:
        return replace(entry, status="fails", message=f"config no longer valid: {invalid}")
    runner = LocalRunner(spec, entry.problem, device, seed=0)
    try:
        checked = runner.evaluate(config)  # compiles, checks against fp32, times once
        if not checked.ok:
            return replace(entry, status="fails",
                           message=f"{checked.state.value}: {checked.message or ''}".strip())
        (timed,) = time_pairs([(runner, config)], rounds)
    finally:
        close = getattr(runner, "close", None)
        if callable(close):
            close()
    if not timed.ok or not timed.median_ms:
        return replace(entry, status="fails",
                       message=f"{timed.state.value}: {timed.message or ''}".strip())
    measured = timed.median_ms
    drift = entry.median_ms / measured
    slower = measured > entry.median_ms * (1.0 + tolerance)
    return replace(entry, status="slower" if slower else "ok", measured_ms=measured,
                   drift=drift,
                   message=f"{measured / entry.median_ms - 1:.0%} slower than recorded "
                           f"(tolerance {tolerance:.0%})" if slower else "")


def render(report: VerifyReport, interpret: bool = False) -> str:
    """The report as text: a table of the timed and reported entries, then each reported
    entry's re-tune command, the stale shipped files and the sources that failed."""
    rows = [e for e in report.entries if e.measured_ms is not None or e.reported
            or e.status in ("fails", "skipped")]
    header = ("source", "what", "shape", "recorded ms", "measured ms", "vs recorded",
              "status")
    body = [(e.origin.split(" ", 1)[0], e.what, e.problem.describe(), f"{e.median_ms:.4g}",
             "-" if e.measured_ms is None else f"{e.measured_ms:.4g}",
             "-" if e.drift is None else f"{e.drift:.2f}x",
             ", ".join([e.status, *(["software"] if e.software_changed else [])]))
            for e in rows]
    lines = []
    timed = sum(e.measured_ms is not None for e in report.entries)
    lines.append(f"{report.device.name}: {len(report.entries)} entries, {timed} re-timed"
                 + (" (under the Triton interpreter: timings mean nothing)" if interpret
                    else ""))
    if body:
        widths = [max(len(c) for c in col) for col in zip(header, *body)]
        lines += ["  ".join(c.rjust(w) if 3 <= i <= 5 else c.ljust(w)
                            for i, (c, w) in enumerate(zip(row, widths))).rstrip()
                  for row in [header, *body]]
    reported = report.reported
    if reported:
        lines.append(f"{len(reported)} entr{'y' if len(reported) == 1 else 'ies'} to re-tune:")
        for e in reported:
            why = "; ".join(x for x in (e.message, *e.software_changed) if x)
            lines.append(f"  {e.what} {e.problem.describe()} ({e.origin}): {why}")
            lines.append(f"    {e.command}")
    for table in report.stale_tables:
        lines.append(table.line())
    for problem in report.problems:
        lines.append(f"skipped: {problem}")
    if not reported and not report.stale_tables:
        lines.append("nothing to re-tune" if timed else "nothing verified (no entries for "
                     "this device in the sources read)")
    return "\n".join(lines)


def summary_counts(entries: Sequence[VerifyEntry]) -> dict[str, int]:
    """How many entries have each status."""
    out: dict[str, int] = {}
    for e in entries:
        out[e.status] = out.get(e.status, 0) + 1
    return out
