"""Op choice files: the tuner's cross-implementation decisions of one device and one user op.

Where a per-template file (:mod:`flashtune.db.exchange`) says which config of ONE
implementation is fastest, an op choice file says which implementation (and config) serves
each shape of a user op, and by how much it beat the runner-up and the fastest extern
implementation. One file per device and op, named by :func:`choice_file_name` (the one
naming function: the exporter writes under it, the runtime loader finds a device's file
with it), and written by :func:`choice_document_to_json` with sorted keys::

    {"format": "flashtune-choices", "schema_version": 1,
     "device": {"name", "compute_capability", "sm_count", "shared_mem_per_block",
                "total_memory"},
     "software": {"flashtune", "torch", "triton", "cuda", "driver"},   (strings)
     "op": "fwd",
     "implementations": {"attn_fwd": "<source hash>", "sdpa_cudnn": "<source hash>", ...},
     "exported_at": "2025-01-31T12:00:00+00:00",
     "entries": [{"problem", "implementation", "config", "median_ms", "tflops",
                  "runner_up", "runner_up_ms", "extern", "extern_ms", "decided_at",
                  ["software": {...}], ["candidates": [{"implementation", "config",
                  "median_ms", ["source_hash"]}, ...]]}, ...]}

``implementations`` names every implementation the entries' winners, runners-up and
externs name, with its source hash, and nothing else. The document's ``software`` is that
of its most recently decided entry; an entry decided under other software has its own block
(as in a per-template file of schema version 2). Since schema version 2 an entry may carry
its ``candidates``: everything timed in the decision, each implementation's best config
and time (null: it failed) with the source hash it was timed at. An import stores them, so
the decision can be checked as a tuned one is (``tune --skip-tuned`` then skips a shape
whose every serving implementation was timed at its current source: a table tuned on one
machine resumes from its file on another) and ``flashtune show --op`` can say what each
choice is worth. A document with no candidates is written as version 1, which older
flashtune versions read too.

**Checks** (:func:`parse_choice_object`; every failure one line, ``"<where> <what is
wrong>; expected <what>"``): the op is a user op (``USER_OPS``); every implementation is in
the ``specs`` handed in (the registry's catalog: an unknown one is rejected, naming it and
the implementations of the op) and serves the op (``op in spec.serves``); an extern is of
kind ``"extern"``; a runner-up is not the winner; a time and its name come together.

**Stale entries.** An entry is *current* when the hash ``implementations`` gives its winner
is the winner's current source hash (:meth:`ChoiceDocument.is_current`). Its config must
then validate against the winner's space. A stale entry is accepted, as a per-template file
of an old source hash is, with only the shape of its config checked (the space may have
changed since): an import counts it as stale and writes nothing of it, and the runtime
never serves it. With ``strict=False`` (the runtime loader) an implementation the catalog
does not know is accepted too, and its entries are stale.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from datetime import datetime, timezone
from typing import Any

from flashtune.core.errors import ImportRejected
from flashtune.core.spec import USER_OPS, TemplateSpec, op_implementations
from flashtune.db import exchange_checks as checks
from flashtune.db.exchange_checks import DeviceInfo
from flashtune.db.jsonutil import canonical_json
from flashtune.db.records import ChoiceRecord, ImportedChoice, SoftwareVersions
from flashtune.db.rows import check_op
from flashtune.db.store import TuningStore

__all__ = ["CHOICE_FORMAT", "CHOICE_SCHEMA_VERSION", "ChoiceDocument", "ChoiceDocumentEntry",
           "choice_document_to_json", "choice_file_name", "export_choice_documents",
           "imported_choices", "parse_choice_document", "parse_choice_object",
           "read_choice_document"]

log = logging.getLogger(__name__)

CHOICE_FORMAT = "flashtune-choices"
CHOICE_SCHEMA_VERSION = 2  # 2: entries may carry their candidates
MAX_CANDIDATES = 64  # implementations timed in one decision (a dozen today)
MAX_FILE_BYTES = 8 << 20  # as for per-template files
MAX_ENTRIES = 100_000
MAX_DEPTH = 16  # a valid document needs 4

TOP_KEYS = ("format", "schema_version", "device", "software", "op", "implementations",
            "exported_at", "entries")
ENTRY_KEYS = ("problem", "implementation", "config", "median_ms", "tflops", "runner_up",
              "runner_up_ms", "extern", "extern_ms", "decided_at")
CANDIDATES = "candidates"  # an entry's optional list (schema version 2)
CANDIDATE_KEYS = ("implementation", "config", "median_ms")
_HEX16 = re.compile(r"[0-9a-f]{16}")
_MS = (lambda v: 0 < v < 1e7, "a finite number of milliseconds > 0 and < 1e7")


def choice_file_name(device_name: str, op: str) -> str:
    """``"device_name=<device_name>,op=<op>.json"``: THE name of an op choice file, used by
    the exporter to write and by the runtime loader to find a device's file.

    Arguments:
        device_name: the device's name as the store keeps it (``NVIDIA_H100_80GB_HBM3``),
            under the rule of :func:`flashtune.db.exchange.config_file_name`.
        op: a user op (``fwd``, ``decode``).
    Returns:
        The file name (no folder).
    Raises:
        ValueError for a device name that breaks the rule (no path separators, NUL or
        parent references ever reach a path) or an op that is not a user op.
    """
    if not checks.is_name(device_name):
        raise ValueError(f"device name {checks.show(device_name)} cannot be part of a config "
                         f"file name; expected {checks.NAME_RULE}")
    if op not in USER_OPS:
        raise ValueError(f"op {checks.show(op)} is not a user op; expected one of "
                         f"{', '.join(USER_OPS)}")
    return f"device_name={device_name},op={op}.json"


@dataclass(frozen=True)
class ChoiceDocumentEntry:
    """One decided problem as a file holds it: the winner with its config and times, the
    runner-up and the fastest extern implementation with theirs (None: not timed), when
    it was decided and under which software (None: the document's; a parsed entry always
    has its own)."""

    problem: dict[str, Any]
    implementation: str
    config: dict[str, int]
    median_ms: float
    tflops: float | None
    runner_up: str | None
    runner_up_ms: float | None
    extern: str | None
    extern_ms: float | None
    decided_at: datetime  # timezone-aware UTC
    software: dict[str, str] | None = None
    # everything timed in the decision ({"implementation", "config", "median_ms"[,
    # "source_hash"]} each; median_ms None where it failed); () where the file has none
    candidates: tuple[dict[str, Any], ...] = ()


@dataclass(frozen=True)
class ChoiceDocument:
    """The op choices of one device and one user op, as one file holds them;
    ``implementations`` maps every implementation the entries name to its source hash."""

    device: DeviceInfo
    software: dict[str, str]
    op: str
    implementations: dict[str, str]
    entries: tuple[ChoiceDocumentEntry, ...]
    exported_at: datetime  # timezone-aware UTC

    def file_name(self) -> str:
        """``choice_file_name(device.name, op)``."""
        return choice_file_name(self.device.name, self.op)

    def is_current(self, entry: ChoiceDocumentEntry, hashes: Mapping[str, str]) -> bool:
        """Whether ``entry``'s winner was decided at the source hash ``hashes`` gives it
        (implementation name -> current source hash); else it is stale."""
        known = hashes.get(entry.implementation)
        return known is not None and self.implementations.get(entry.implementation) == known


# -- writing and reading ----------------------------------------------------------------------

def choice_document_to_json(doc: ChoiceDocument) -> str:
    """``doc`` as deterministic JSON text, what :func:`parse_choice_document` reads back.

    Arguments:
        doc: the document (missing ``software`` keys are written as empty strings).
    Returns:
        JSON text: sorted keys, entries sorted by canonical problem key, indent 1, a
        trailing newline. An entry's own ``software`` is written only where it differs
        from the document's, its ``candidates`` where it has some (and then the document
        is schema version 2, else 1).
    Raises:
        ValueError for NaN, a naive timestamp or unknown ``software`` keys.
    """
    software = checks.software_block(doc.software)
    entries = []
    for e in sorted(doc.entries, key=lambda e: canonical_json(e.problem)):
        entry: dict[str, Any] = {
            "problem": dict(e.problem), "implementation": e.implementation,
            "config": dict(e.config), "median_ms": e.median_ms, "tflops": e.tflops,
            "runner_up": e.runner_up, "runner_up_ms": e.runner_up_ms, "extern": e.extern,
            "extern_ms": e.extern_ms, "decided_at": checks.iso(e.decided_at)}
        own = software if e.software is None else checks.software_block(e.software)
        if own != software:
            entry[checks.ENTRY_SOFTWARE] = own
        if e.candidates:
            entry[CANDIDATES] = [dict(c) for c in e.candidates]
        entries.append(entry)
    data = {
        "format": CHOICE_FORMAT,
        # 1 where no entry has candidates, which older flashtune versions read too
        "schema_version": CHOICE_SCHEMA_VERSION if any(e.candidates for e in doc.entries)
        else 1,
        "device": {f.name: getattr(doc.device, f.name) for f in fields(DeviceInfo)},
        "software": software,
        "op": doc.op,
        "implementations": dict(doc.implementations),
        "exported_at": checks.iso(doc.exported_at),
        "entries": entries,
    }
    return checks.dumps(data)


def parse_choice_document(data: str | bytes, *, specs: Mapping[str, TemplateSpec],
                          origin: str = "<input>", strict: bool = True) -> ChoiceDocument:
    """Validate ``data`` (a whole op choice file) strictly and return its document.

    Arguments:
        data: the file's whole content (at most ``MAX_FILE_BYTES``).
        specs: the implementations a document may name, name -> spec
            (:func:`flashtune.kernel_templates.catalog`).
        origin: what to call the input in messages.
        strict: reject an implementation ``specs`` does not know (False: accept it, its
            entries stale; for the runtime loader, which serves what it can).
    Returns:
        The :class:`ChoiceDocument` (current entries' configs validated by their winner's
        space, optional knobs filled in; every entry with its software).
    Raises:
        ImportRejected with one line ``"<origin>: <what is wrong>; expected <what>"``.
    """
    try:
        obj = checks.load(data, max_bytes=MAX_FILE_BYTES, max_depth=MAX_DEPTH)
        return parse_choice_object(obj, specs, strict=strict)
    except checks.Bad as exc:
        raise ImportRejected(f"{checks.printable(origin)}: {exc}") from None


def read_choice_document(path: str | os.PathLike[str], *, specs: Mapping[str, TemplateSpec],
                         strict: bool = True) -> ChoiceDocument:
    """:func:`parse_choice_document` of the file at ``path`` (the origin in messages);
    ``ImportRejected`` too for a file over ``MAX_FILE_BYTES``, not a regular file, or
    unreadable."""
    data = checks.read_file(path, MAX_FILE_BYTES)
    return parse_choice_document(data, specs=specs, origin=os.fspath(path), strict=strict)


def parse_choice_object(obj: Any, specs: Mapping[str, TemplateSpec], *,
                        strict: bool = True) -> ChoiceDocument:
    """The document of a loaded JSON value (see :func:`parse_choice_document`); raises
    ``exchange_checks.Bad`` without the origin."""
    _header(obj)
    device = DeviceInfo(*checks.device(obj["device"]))
    software = checks.software(obj["software"])
    op = obj["op"]
    if not isinstance(op, str) or op not in USER_OPS:
        raise checks.Bad(f"op is {checks.kind(op)}; expected one of "
                         f"{', '.join(map(repr, USER_OPS))} (a user op)")
    names = _implementations(obj["implementations"], specs, op, strict)
    exported_at = checks.timestamp(obj["exported_at"], "exported_at")
    items = checks.entry_list(obj["entries"], MAX_ENTRIES)
    specs = op_implementations(specs, op)  # a training step's spec: its pair's space, hash
    hashes = {n: s.source_hash for n, s in specs.items()}
    entries, seen, named = [], set(), set[str]()
    for i, item in enumerate(items):
        where = f"entries[{i}]"
        entry = _entry(item, where, names, specs, hashes, software, op, strict)
        key = canonical_json(entry.problem)
        if key in seen:
            raise checks.Bad(f"{where}.problem repeats the problem of an earlier entry; "
                             "expected each problem once per document")
        seen.add(key)
        named.update(n for n in (entry.implementation, entry.runner_up, entry.extern) if n)
        entries.append(entry)
    unused = sorted(set(names) - named)
    if unused:
        raise checks.Bad(f"implementations lists {unused[0]!r}, which no entry names; "
                         "expected exactly the implementations the entries name")
    return ChoiceDocument(device, software, op, names, tuple(entries), exported_at)


def _header(obj: Any) -> None:
    if not isinstance(obj, dict):
        raise checks.Bad(f"the top level is {checks.kind(obj)}; expected a JSON object (a "
                         f"{CHOICE_FORMAT} document)")
    if obj.get("format") != CHOICE_FORMAT:
        got = checks.kind(obj["format"]) if "format" in obj else "missing"
        raise checks.Bad(f"format is {got}; expected {CHOICE_FORMAT!r}")
    version = obj.get("schema_version")
    if not isinstance(version, bool) and isinstance(version, int) \
            and version > CHOICE_SCHEMA_VERSION:
        raise checks.Bad(f"schema_version is {version}: written by a newer flashtune (this "
                         f"one reads {CHOICE_FORMAT} schema_version "
                         f"{CHOICE_SCHEMA_VERSION}); expected at most "
                         f"{CHOICE_SCHEMA_VERSION}: upgrade flashtune to import it")
    version = checks.integer(version, "schema_version", 1, CHOICE_SCHEMA_VERSION)
    checks.fields(obj, "", TOP_KEYS)
    if version < 2 and isinstance(obj["entries"], list) and any(
            isinstance(e, dict) and CANDIDATES in e for e in obj["entries"]):
        raise checks.Bad(f"schema_version is {version} but an entry has {CANDIDATES}; "
                         "expected schema_version 2 for entries with candidates")


def _serving(specs: Mapping[str, TemplateSpec], op: str) -> str:
    names = sorted(n for n, s in specs.items() if op in s.serves)
    return f"{', '.join(names) or 'none'} (the implementations of op {op})"


def _implementations(value: Any, specs: Mapping[str, TemplateSpec], op: str,
                     strict: bool) -> dict[str, str]:
    """The ``implementations`` object: names -> 16 hex digit source hashes, each name a
    registered implementation serving ``op`` (unknown names pass when not ``strict``)."""
    if not isinstance(value, dict):
        raise checks.Bad(f"implementations is {checks.kind(value)}; expected an object from "
                         "implementation names to source hashes")
    out = {}
    for name, source_hash in value.items():
        if not checks.is_name(name):
            raise checks.Bad(f"implementations has the key {checks.show(name)}; expected "
                             f"implementation names of {checks.NAME_RULE}")
        where = f"implementations.{name}"
        out[name] = checks.string(source_hash, where, _HEX16, "16 lowercase hex digits")
        spec = specs.get(name)
        if spec is None:
            if strict:
                raise checks.Bad(f"implementations names {name!r}, an unknown "
                                 f"implementation; expected one of {_serving(specs, op)}")
            continue
        if op not in spec.serves:
            serves = ", ".join(spec.serves) or "no user op"
            raise checks.Bad(f"implementations names {name!r}, which does not serve op "
                             f"{op!r} (it serves {serves}); expected one of "
                             f"{_serving(specs, op)}")
    return out


def _listed(value: Any, where: str, names: Mapping[str, str]) -> str:
    name = checks.string(value, where)
    if name not in names:
        raise checks.Bad(f"{where} is {checks.show(name)}, which implementations does not "
                         f"list; expected one of {', '.join(sorted(names)) or 'none'}")
    return name


def _rival(e: dict[str, Any], what: str, where: str,
           names: Mapping[str, str]) -> tuple[str | None, float | None]:
    name, ms = e[what], e[f"{what}_ms"]
    if (name is None) != (ms is None):
        raise checks.Bad(f"{where}.{what} is {checks.kind(name)} and {where}.{what}_ms "
                         f"{checks.kind(ms)}; expected both null or both given")
    if name is None:
        return None, None
    return (_listed(name, f"{where}.{what}", names),
            checks.number(ms, f"{where}.{what}_ms", *_MS))


def _raw_config(value: Any, where: str) -> dict[str, int]:
    """A stale entry's config: only its shape (names -> ints) is checked."""
    if not isinstance(value, dict):
        raise checks.Bad(f"{where} is {checks.kind(value)}; expected an object of parameter "
                         "names to ints")
    for name, v in value.items():
        checks.string(name, f"{where} key")
        checks.integer(v, f"{where}.{name}", -2**31, 2**31)
    return dict(value)


def _candidates(value: Any, where: str, specs: Mapping[str, TemplateSpec], op: str,
                strict: bool) -> tuple[dict[str, Any], ...]:
    """An entry's ``candidates``: a list of at most :data:`MAX_CANDIDATES` objects, each an
    implementation serving ``op`` (unknown names pass when not ``strict``), its config's
    shape (names to ints), its time (null: it failed) and optionally its source hash."""
    if not isinstance(value, list):
        raise checks.Bad(f"{where} is {checks.kind(value)}; expected a list of the "
                         "implementations timed in the decision")
    if len(value) > MAX_CANDIDATES:
        raise checks.Bad(f"{where} holds {len(value)} candidates; expected at most "
                         f"{MAX_CANDIDATES}")
    out = []
    for i, item in enumerate(value):
        at = f"{where}[{i}]"
        c = checks.fields(item, at, CANDIDATE_KEYS, ("source_hash",))
        name = checks.string(c["implementation"], f"{at}.implementation")
        spec = specs.get(name)
        if spec is None and strict:
            raise checks.Bad(f"{at}.implementation is {checks.show(name)}, an unknown "
                             f"implementation; expected one of {_serving(specs, op)}")
        if spec is not None and op not in spec.serves:
            raise checks.Bad(f"{at}.implementation is {name!r}, which does not serve op "
                             f"{op!r}; expected one of {_serving(specs, op)}")
        got: dict[str, Any] = {
            "implementation": name, "config": _raw_config(c["config"], f"{at}.config"),
            "median_ms": None if c["median_ms"] is None else checks.number(
                c["median_ms"], f"{at}.median_ms", *_MS)}
        if "source_hash" in c:
            got["source_hash"] = checks.string(c["source_hash"], f"{at}.source_hash",
                                               _HEX16, "16 lowercase hex digits")
        out.append(got)
    return tuple(out)


def _entry(value: Any, where: str, names: Mapping[str, str],
           specs: Mapping[str, TemplateSpec], hashes: Mapping[str, str],
           software: dict[str, str], op: str, strict: bool) -> ChoiceDocumentEntry:
    e = checks.fields(value, where, ENTRY_KEYS, (checks.ENTRY_SOFTWARE, CANDIDATES))
    problem = checks.problem(e["problem"], f"{where}.problem")
    winner = _listed(e["implementation"], f"{where}.implementation", names)
    current = hashes.get(winner) is not None and names[winner] == hashes[winner]
    config = (checks.config(e["config"], f"{where}.config", specs[winner]) if current else
              _raw_config(e["config"], f"{where}.config"))
    runner_up, runner_up_ms = _rival(e, "runner_up", where, names)
    if runner_up == winner:
        raise checks.Bad(f"{where}.runner_up is {winner!r}, the winner itself; expected "
                         "another implementation, or null")
    extern, extern_ms = _rival(e, "extern", where, names)
    if extern is not None and extern in specs and specs[extern].kind != "extern":
        raise checks.Bad(f"{where}.extern is {extern!r}, a {specs[extern].kind} "
                         "implementation; expected an extern one, or null")
    tflops = e["tflops"]
    own = software if checks.ENTRY_SOFTWARE not in e else \
        checks.software(e[checks.ENTRY_SOFTWARE], f"{where}.{checks.ENTRY_SOFTWARE}")
    return ChoiceDocumentEntry(
        problem=problem.key(), implementation=winner, config=config,
        median_ms=checks.number(e["median_ms"], f"{where}.median_ms", *_MS),
        tflops=None if tflops is None else checks.number(
            tflops, f"{where}.tflops", lambda v: 0 <= v <= 1e5,
            "null or a finite number from 0 to 1e5"),
        runner_up=runner_up, runner_up_ms=runner_up_ms, extern=extern, extern_ms=extern_ms,
        decided_at=checks.timestamp(e["decided_at"], f"{where}.decided_at"),
        software=dict(own),
        candidates=_candidates(e[CANDIDATES], f"{where}.{CANDIDATES}", specs, op, strict)
        if CANDIDATES in e else ())


# -- export -----------------------------------------------------------------------------------

def export_choice_documents(store: TuningStore, *, specs: Mapping[str, TemplateSpec],
                            device_name: str | None = None,
                            op: str | None = None) -> list[ChoiceDocument]:
    """One document per (device name, op) of the store's op choices, sorted by file name;
    only choices whose winner is registered, serves the op and was decided at its current
    source hash (others are stale and would never be served), except that a torch-bound
    implementation's choices (an SDPA backend's, or a pair with one's forward:
    ``TemplateSpec.torch_bound``) keep the hash they were decided at: that hash carries the
    torch and cuDNN of the machine that timed it, so a database tuned on a GPU box exports
    whole from any machine, and each reader judges the hash against its own torch. Where
    such choices of one document were decided at several hashes, the latest hash's are
    kept.

    The store keeps the winner's hash only: ``implementations`` gives a runner-up and an
    extern their current hash, and a runner-up or extern that ``specs`` does not know (or
    that does not serve the op) is left out of its entry, with a warning. Each document is
    checked by :func:`parse_choice_document` before it is returned, so an export is always
    importable.

    Arguments:
        store: the tuning database to read.
        specs: the registered implementations (:func:`flashtune.kernel_templates.catalog`).
        device_name: only this device (None: every device).
        op: only this user op (None: every one).
    Returns:
        The documents; write each with :func:`choice_document_to_json` under its
        ``file_name()``.
    Raises:
        InputError for an ``op`` that is not a user op; ImportRejected for a stored choice
        an import would refuse (a config outside its space); ValueError for devices
        sharing a name but differing in more than total memory.
    """
    docs: list[ChoiceDocument] = []
    for user_op in USER_OPS if op is None else (check_op(op),):
        groups: dict[str, list[ChoiceRecord]] = {}
        serving = op_implementations(specs, user_op)
        for c in store.list_choices(device_name=device_name, op=user_op):
            spec = serving.get(c.implementation)
            if spec is not None and (spec.source_hash == c.source_hash or spec.torch_bound):
                groups.setdefault(c.device.name, []).append(c)
        docs.extend(_export_group(store.url, user_op, records, specs)
                    for records in groups.values())
    return sorted(docs, key=lambda d: d.file_name())


def _export_group(url: str, op: str, records: list[ChoiceRecord],
                  specs: Mapping[str, TemplateSpec]) -> ChoiceDocument:
    device = checks.one_device([r.device for r in records], url)
    fastest: dict[str, ChoiceRecord] = {}
    for r in records:
        key = canonical_json(r.problem_key)
        if key not in fastest or r.median_ms < fastest[key].median_ms:
            fastest[key] = r
    # one hash per winner: a torch-bound one's latest (its choices may span torch versions)
    names: dict[str, str] = {}
    for r in sorted(fastest.values(), key=lambda r: r.decided_at, reverse=True):
        names.setdefault(r.implementation, r.source_hash)
    kept = [r for r in fastest.values() if names[r.implementation] == r.source_hash]
    latest = max(kept, key=lambda r: (r.decided_at, canonical_json(r.problem_key)))
    serving = op_implementations(specs, op)
    entries = []
    for r in kept:
        runner_up, runner_up_ms = _exportable(r, "runner_up", r.runner_up, r.runner_up_ms,
                                              op, specs)
        extern, extern_ms = _exportable(r, "extern", r.extern, r.extern_ms, op, specs)
        for rival in (runner_up, extern):
            if rival is not None:
                names.setdefault(rival, serving[rival].source_hash)
        entries.append(ChoiceDocumentEntry(
            problem=dict(r.problem_key), implementation=r.implementation,
            config=dict(r.config), median_ms=r.median_ms, tflops=r.tflops,
            runner_up=runner_up, runner_up_ms=runner_up_ms, extern=extern,
            extern_ms=extern_ms, decided_at=r.decided_at, software=r.software.as_dict(),
            candidates=_exported_candidates(r, serving)))
    raw = ChoiceDocument(device=DeviceInfo(*device.hardware_key()),
                         software=latest.software.as_dict(), op=op, implementations=names,
                         entries=tuple(entries), exported_at=datetime.now(timezone.utc))
    return parse_choice_document(choice_document_to_json(raw), specs=specs,
                                 origin=f"export of {raw.file_name()}")


def _exported_candidates(r: ChoiceRecord,
                         serving: Mapping[str, TemplateSpec]) -> tuple[dict[str, Any], ...]:
    """``r``'s candidates as a file carries them: those of an implementation registered
    here and serving the op (an import would refuse the others; a warning names them)."""
    out, dropped = [], []
    for c in r.candidates:
        if c.get("implementation") not in serving:
            dropped.append(str(c.get("implementation")))
            continue
        item = {k: c[k] for k in CANDIDATE_KEYS}
        item["config"] = dict(item["config"])
        if c.get("source_hash"):
            item["source_hash"] = c["source_hash"]
        out.append(item)
    if dropped:
        log.warning("%s choice of %s on %s: candidate(s) %s not registered implementations "
                    "of op %s here; exported without them", r.op, r.bucket, r.device.name,
                    ", ".join(dropped), r.op)
    return tuple(out)


def _exportable(r: ChoiceRecord, what: str, name: str | None, ms: float | None, op: str,
                specs: Mapping[str, TemplateSpec]) -> tuple[str | None, float | None]:
    """A rival as an exported entry names it, or (None, None) where an import would refuse
    it (unknown here, not serving the op, an extern that is not of kind extern)."""
    if name is None:
        return None, None
    spec = specs.get(name)
    if spec is None or op not in spec.serves or (what == "extern" and spec.kind != "extern"):
        log.warning("%s choice of %s on %s: its %s %r is not a registered implementation of "
                    "op %s here; exported without it", op, r.bucket, r.device.name, what,
                    name, op)
        return None, None
    return name, ms


# -- import -----------------------------------------------------------------------------------

def imported_choices(doc: ChoiceDocument,
                     hashes: Mapping[str, str]) -> tuple[list[ImportedChoice], int]:
    """The current entries of ``doc`` as the store imports them, and how many are stale
    (decided for another source hash of their winner than ``hashes`` gives, or for an
    implementation it does not name)."""
    out = []
    for e in doc.entries:
        if not doc.is_current(e, hashes):
            continue
        software = SoftwareVersions.from_dict(doc.software if e.software is None
                                              else e.software)
        out.append(ImportedChoice(
            *doc.device.hardware_key(), op=doc.op, problem_key=dict(e.problem),
            implementation=e.implementation, source_hash=doc.implementations[e.implementation],
            config=dict(e.config), median_ms=e.median_ms, tflops=e.tflops,
            decided_at=e.decided_at, runner_up=e.runner_up, runner_up_ms=e.runner_up_ms,
            extern=e.extern, extern_ms=e.extern_ms,
            candidates=tuple(dict(c) for c in e.candidates), software=software))
    return out, len(doc.entries) - len(out)

