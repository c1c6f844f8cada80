"""Per-hardware export and import of tuned best configs as strictly validated JSON files.

One file holds the best configs of one device and one template (a :class:`ConfigDocument`)
and is named by :func:`config_file_name`, the one naming function: the exporter writes
files under it and the runtime loader finds a device's file with it. A name read from a
file is never used as a path except through that validated function.

The format, written by :func:`document_to_json` with sorted keys::

    {"format": "flashtune-configs", "schema_version": 1 or 2,
     "device": {"name", "compute_capability", "sm_count", "shared_mem_per_block",
                "total_memory"},
     "software": {"flashtune", "torch", "triton", "cuda", "driver"},   (strings)
     "template": {"name", "source_hash"},
     "exported_at": "2025-01-31T12:00:00+00:00",
     "entries": [{"problem", "bucket", "config", "median_ms", "tflops", "trials",
                  "tuned_at", ["software": {...}]}, ...]}

**Software.** Each entry was tuned under some flashtune, torch, Triton, CUDA and driver
versions, and an export -> import -> export round trip keeps them: the two exports are the
same text but for ``exported_at``. The document's ``software`` block is that of its most
recently tuned entry (latest ``tuned_at``; among equal ones, the last by problem key); an
entry tuned under other software has its own ``software`` block, of the same five keys.
An entry without one was tuned under the document's. A document whose entries were all
tuned under one software is written as ``schema_version`` 1, which older flashtune reads
too (the shipped ``flashtune/configs`` files are); one with an entry's own ``software``
is ``schema_version`` 2, which only adds that optional key (version 1 refuses it). Both
are read. :func:`parse_document` gives every entry its software (its own or the
document's), and :func:`import_documents` stores it with the config.

:func:`parse_document` trusts nothing in a file: every key, type, range, name and config
is checked (the checks live in :mod:`flashtune.db.exchange_checks`), and a rejection is
one :class:`flashtune.core.errors.ImportRejected` line naming the file, what was wrong and what
was expected. :func:`import_documents` writes every document in one transaction.

**Op choice files.** The tuner's cross-implementation decisions (which implementation, and
config, serves each shape of a user op on a device) travel in files of their own, one per
device and op, named by :func:`choice_file_name` (``device_name=<device>,op=<op>.json``);
their format and checks are in :mod:`flashtune.db.exchange_choices`, and
:func:`export_choice_documents` writes them. :func:`parse_document` and
:func:`read_document` read either kind (by the ``format`` key: ``flashtune-configs`` or
``flashtune-choices``) and :func:`import_documents` writes both kinds in its one
transaction. The vLLM format (:mod:`flashtune.db.exchange_vllm`) carries per-template
Triton configs only, never op choices.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from datetime import datetime, timezone
from functools import partial
from typing import Any

from flashtune.core.errors import ImportRejected, UnknownTemplateError
from flashtune.core.spec import TemplateSpec, op_implementations
from flashtune.db import exchange_checks as checks
from flashtune.db import exchange_choices as choices
from flashtune.db.exchange_checks import FORMAT, SCHEMA_VERSION, DeviceInfo
from flashtune.db.exchange_choices import (
    CHOICE_FORMAT,
    ChoiceDocument,
    ChoiceDocumentEntry,
    choice_document_to_json,
    choice_file_name,
    export_choice_documents,
)
from flashtune.db.jsonutil import canonical_json
from flashtune.db.records import BestConfigRecord, ImportedBest, ImportedChoice, SoftwareVersions
from flashtune.db.store import IMPORT_OUTCOMES, IMPORT_POLICIES, TuningStore

__all__ = [
    "CHOICE_FORMAT",
    "FORMAT",
    "MAX_DEPTH",
    "MAX_ENTRIES",
    "MAX_FILE_BYTES",
    "SCHEMA_VERSION",
    "ChoiceDocument",
    "ChoiceDocumentEntry",
    "ConfigDocument",
    "ConfigEntry",
    "DeviceInfo",
    "Document",
    "FileReport",
    "ImportReport",
    "choice_document_to_json",
    "choice_file_name",
    "config_file_name",
    "document_to_json",
    "export_choice_documents",
    "export_documents",
    "import_documents",
    "parse_document",
    "read_document",
    "vllm_config_file_name",
]

MAX_FILE_BYTES = 8 << 20  # a bigger file is refused before it is read
MAX_ENTRIES = 100_000  # entries per document
MAX_DEPTH = 16  # nesting of arrays and objects (a valid document needs 4)

_COUNTS = (*IMPORT_OUTCOMES, "stale")  # the counts of a FileReport, in order


def config_file_name(device_name: str, template: str) -> str:
    """``"device_name=<device_name>,template=<template>.json"``: THE name of a config file,
    used by the exporter to write and by the runtime loader to find a device's file.

    Arguments:
        device_name: the device's name as the store keeps it (``NVIDIA_H100_80GB_HBM3``).
        template: a template name (``attn_fwd``).
    Returns:
        The file name (no folder).
    Raises:
        ValueError unless both names are 1-200 characters of ``0-9 A-Z a-z . _ + -``
        starting with a letter or digit, without ``..`` (so no path separators, NUL or
        parent references ever reach a path).
    """
    for what, name in (("device name", device_name), ("template name", template)):
        if not checks.is_name(name):
            raise ValueError(f"{what} {checks.show(name)} cannot be part of a config file "
                             f"name; expected {checks.NAME_RULE}")
    return f"device_name={device_name},template={template}.json"


def vllm_config_file_name(device_name: str, template: str, *, dtype: str, head_dim: int,
                          causal: bool) -> str:
    """``"template=<t>,dtype=<d>,head_dim=<h>,causal=<0|1>,device_name=<device>.json"``:
    the name of a vLLM-style tuned-config file (``flashtune export --format vllm``), named
    like vLLM's ``E=..,N=..,device_name=...json`` fused-MoE configs.

    Arguments:
        device_name: the device's name, as for :func:`config_file_name`.
        template: a template name.
        dtype: the problems' dtype (``bf16``, ``fp16``).
        head_dim: the problems' head dimension.
        causal: whether the problems are causal.
    Returns:
        The file name (no folder).
    Raises:
        ValueError when a name, or ``dtype``, breaks :func:`config_file_name`'s rule, or
        ``head_dim`` is not a positive int.
    """
    config_file_name(device_name, template)  # the same name checks
    if not checks.is_name(dtype):
        raise ValueError(f"dtype {checks.show(dtype)} cannot be part of a config file name; "
                         f"expected {checks.NAME_RULE}")
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 1:
        raise ValueError(f"head_dim {checks.show(head_dim)} is not a positive int")
    return (f"template={template},dtype={dtype},head_dim={head_dim},causal={int(bool(causal))},"
            f"device_name={device_name}.json")


@dataclass(frozen=True)
class ConfigEntry:
    """One tuned problem: its key, bucket, validated config, timings and the software it
    was tuned under (None: the document's; a parsed entry always has its own)."""

    problem: dict[str, Any]
    bucket: str
    config: dict[str, int]
    median_ms: float
    tflops: float | None
    trials: int
    tuned_at: datetime  # timezone-aware UTC
    software: dict[str, str] | None = None


@dataclass(frozen=True)
class ConfigDocument:
    """The best configs of one device and one template, as one file holds them;
    ``software`` is what an entry without its own was tuned under."""

    device: DeviceInfo
    software: dict[str, str]
    template: str
    source_hash: str
    entries: tuple[ConfigEntry, ...]
    exported_at: datetime  # timezone-aware UTC

    def file_name(self) -> str:
        """``config_file_name(device.name, template)``."""
        return config_file_name(self.device.name, self.template)


# a document of either kind: a template's best configs, or an op's choices
Document = ConfigDocument | ChoiceDocument


# -- writing and reading --------------------------------------------------------------------

def document_to_json(doc: ConfigDocument) -> str:
    """``doc`` as deterministic JSON text, what :func:`parse_document` reads back.

    Arguments:
        doc: the document (missing ``software`` keys, the document's or an entry's, are
            written as empty strings).
    Returns:
        JSON text: sorted keys, entries sorted by canonical problem key, indent 1, a
        trailing newline. An entry's own ``software`` is written only where it differs
        from the document's, and then the document is ``schema_version`` 2, else 1.
    Raises:
        ValueError for NaN, a naive timestamp or unknown ``software`` keys.
    """
    software = checks.software_block(doc.software)
    entries = []
    for e in sorted(doc.entries, key=lambda e: canonical_json(e.problem)):
        entry = {"problem": dict(e.problem), "bucket": e.bucket, "config": dict(e.config),
                 "median_ms": e.median_ms, "tflops": e.tflops, "trials": e.trials,
                 "tuned_at": checks.iso(e.tuned_at)}
        own = software if e.software is None else checks.software_block(e.software)
        if own != software:
            entry[checks.ENTRY_SOFTWARE] = own
        entries.append(entry)
    data = {
        "format": FORMAT,
        "schema_version": 2 if any(checks.ENTRY_SOFTWARE in e for e in entries) else 1,
        "device": {f.name: getattr(doc.device, f.name) for f in fields(DeviceInfo)},
        "software": software,
        "template": {"name": doc.template, "source_hash": doc.source_hash},
        "exported_at": checks.iso(doc.exported_at),
        "entries": entries,
    }
    return checks.dumps(data)


def parse_document(data: str | bytes, *, specs: Mapping[str, TemplateSpec],
                   origin: str = "<input>") -> Document:
    """Validate ``data`` (a whole file) strictly and return its document.

    Arguments:
        data: the file's whole content (at most ``MAX_FILE_BYTES``).
        specs: the templates a document may name, name -> spec
            (:func:`flashtune.kernel_templates.catalog`): their spaces validate the configs.
        origin: what to call the input in messages (a path, a URL).
    Returns:
        The :class:`ConfigDocument` of a per-template file (``"format":
        "flashtune-configs"``): configs validated by the template's space, optional knobs
        filled in, every entry with its software (its own block, or a copy of the
        document's). The :class:`ChoiceDocument` of an op choice file (``"format":
        "flashtune-choices"``; see :mod:`flashtune.db.exchange_choices`).
    Raises:
        ImportRejected with one line ``"<origin>: <what is wrong>; expected <what>"`` for
        anything but a well-formed ``schema_version`` 1 or 2 document of a registered
        template, or a well-formed op choice document of registered implementations (see
        the module docstring and :mod:`flashtune.db.exchange_checks`).
    """
    try:
        obj = checks.load(data, max_bytes=MAX_FILE_BYTES, max_depth=MAX_DEPTH)
        if isinstance(obj, dict) and obj.get("format") == CHOICE_FORMAT:
            return choices.parse_choice_object(obj, specs)
        return _document(obj, specs)
    except checks.Bad as exc:
        raise ImportRejected(f"{checks.printable(origin)}: {exc}") from None


def read_document(path: str | os.PathLike[str], *,
                  specs: Mapping[str, TemplateSpec]) -> Document:
    """:func:`parse_document` of the file at ``path`` (the origin in messages).

    Arguments:
        path: a JSON file written by :func:`document_to_json` or
            :func:`choice_document_to_json` (``flashtune export``).
        specs: as for :func:`parse_document`.
    Returns:
        Its :class:`ConfigDocument` or :class:`ChoiceDocument`.
    Raises:
        ImportRejected as :func:`parse_document` does, and also for a file over
        ``MAX_FILE_BYTES`` or not a regular file (refused before it is read) and for an
        unreadable one.
    """
    data = checks.read_file(path, MAX_FILE_BYTES)
    return parse_document(data, specs=specs, origin=os.fspath(path))


def _document(obj: Any, specs: Mapping[str, TemplateSpec]) -> ConfigDocument:
    version = checks.header(obj)
    device = DeviceInfo(*checks.device(obj["device"]))
    software = checks.software(obj["software"])
    template, source_hash, spec, problem_type = checks.template(obj["template"], specs)
    exported_at = checks.timestamp(obj["exported_at"], "exported_at")
    items = checks.entry_list(obj["entries"], MAX_ENTRIES)
    entries, seen = [], set()
    for i, item in enumerate(items):
        where = f"entries[{i}]"
        values = {"software": dict(software),
                  **checks.entry(item, where, spec, problem_type, version)}
        key = canonical_json(values["problem"])
        if key in seen:
            raise checks.Bad(f"{where}.problem repeats the problem of an earlier entry; "
                             "expected each problem once per document")
        seen.add(key)
        entries.append(ConfigEntry(**values))
    return ConfigDocument(device, software, template, source_hash, tuple(entries), exported_at)


# -- export ---------------------------------------------------------------------------------

def export_documents(store: TuningStore, *, specs: Mapping[str, TemplateSpec],
                     device_name: str | None = None,
                     template_name: str | None = None) -> list[ConfigDocument]:
    """One document per (device name, template) of the store's best configs, sorted by
    file name; only configs tuned for the registered template's current ``source_hash``
    (older ones are stale and would never be served).

    Each entry keeps the software its best config was tuned under (empty strings where
    the store never knew it); the document's ``software`` is its most recently tuned
    entry's (see the module docstring). Each document is checked by
    :func:`parse_document` before it is returned, so an export is always importable.

    Arguments:
        store: the tuning database to read.
        specs: the registered templates, name -> spec
            (:func:`flashtune.kernel_templates.catalog`).
        device_name: only this device (None: every device).
        template_name: only this template (None: every template of ``specs``).
    Returns:
        The documents; write each with :func:`document_to_json` under its
        ``file_name()``.
    Raises:
        ImportRejected for a stored entry an import would refuse; UnknownTemplateError
        for an unknown ``template_name``; ValueError for devices sharing a name but
        differing in more than total memory (one file holds one device).
    """
    docs: list[ConfigDocument] = []
    if template_name is not None and template_name not in specs:
        raise UnknownTemplateError(f"unknown template {template_name!r}; known templates: "
                                   f"{', '.join(sorted(specs)) or 'none'}")
    for name in [template_name] if template_name is not None else sorted(specs):
        spec = specs[name]
        groups: dict[str, list[BestConfigRecord]] = {}
        for best in store.list_best(device_name=device_name, template_name=name,
                                    source_hash=spec.source_hash):
            groups.setdefault(best.device.name, []).append(best)
        docs.extend(_export_group(store, records, specs) for records in groups.values())
    return sorted(docs, key=lambda d: d.file_name())


def _export_group(store: TuningStore, records: list[BestConfigRecord],
                  specs: Mapping[str, TemplateSpec]) -> ConfigDocument:
    """The document of one device name (rows that differ only in total memory, which moves
    by a few MiB between drivers, are merged: the fastest entry per problem wins)."""
    device = checks.one_device([r.device for r in records], store.url)
    fastest: dict[str, BestConfigRecord] = {}
    for r in records:
        held = fastest.get(r.problem.key_json)
        if held is None or r.median_ms < held.median_ms:
            fastest[r.problem.key_json] = r
    latest = max(fastest.values(), key=lambda r: (r.tuned_at, r.problem.key_json))
    raw = ConfigDocument(
        device=DeviceInfo(*device.hardware_key()),
        software=latest.software.as_dict(),
        template=records[0].template.name,
        source_hash=records[0].template.source_hash,
        entries=tuple(ConfigEntry(problem=dict(r.problem.key), bucket=r.problem.bucket,
                                  config=dict(r.config), median_ms=r.median_ms,
                                  tflops=r.tflops, trials=r.trials_count, tuned_at=r.tuned_at,
                                  software=r.software.as_dict())
                      for r in fastest.values()),
        exported_at=datetime.now(timezone.utc))
    origin = f"export of {raw.file_name()}"
    try:
        return _document(checks.load(document_to_json(raw), max_bytes=MAX_FILE_BYTES,
                                     max_depth=MAX_DEPTH), specs)
    except checks.Bad as exc:
        raise ImportRejected(f"{origin}: {exc}") from None


# -- import ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class FileReport:
    """What the import did with one document's entries; ``op`` is set (and ``template``
    empty) for an op choice file."""

    origin: str
    device: str
    template: str
    added: int = 0
    replaced: int = 0
    kept: int = 0  # keep-faster: the stored config (choice) was as fast or faster
    skipped: int = 0  # skip policy: the problem already had a best config (choice)
    stale: int = 0  # tuned (decided) for another source_hash: not imported
    op: str | None = None

    @property
    def what(self) -> str:
        """``"attn_fwd"``, or ``"op fwd"`` for an op choice file."""
        return self.template if self.op is None else f"op {self.op}"


@dataclass(frozen=True)
class ImportReport:
    """Per-file counts of one :func:`import_documents` call (one transaction)."""

    policy: str
    files: tuple[FileReport, ...]

    def total(self, count: str) -> int:
        """The sum of one count (``"added"``, ``"replaced"``...) over the files."""
        if count not in _COUNTS:
            raise ValueError(f"unknown count {count!r}; expected one of {', '.join(_COUNTS)}")
        return sum(getattr(f, count) for f in self.files)

    def lines(self) -> list[str]:
        """One line per file and a total line, for printing."""
        out = [f"{checks.printable(f.origin)}: {f.device} {f.what}: "
               f"{_tally(partial(getattr, f))}" for f in self.files]
        n = len(self.files)
        out.append(f"imported {n} file{'' if n == 1 else 's'} (policy {self.policy}): "
                   f"{_tally(self.total)}")
        if any(f.stale for f in self.files if f.op is None):
            out.append("stale entries were tuned for another version of their template's "
                       "source and were not imported")
        if any(f.stale for f in self.files if f.op is not None):
            out.append("stale op choices were decided for another version of their "
                       "implementation's source and were not imported")
        return out


def _tally(count: Callable[[str], Any]) -> str:
    return ", ".join(f"{count(c)} {c}" for c in _COUNTS)


def import_documents(store: TuningStore, docs: Sequence[tuple[str, Document]], *,
                     specs: Mapping[str, TemplateSpec],
                     policy: str = "keep-faster") -> ImportReport:
    """Write the entries of ``docs`` (``(origin, document)`` pairs) under ``policy``, ALL in
    one transaction (:meth:`TuningStore.import_entries`): all or nothing.

    ``"keep-faster"`` replaces a stored best config (op choice) only with a strictly faster
    one (so merging several machines' exports keeps the fastest), ``"overwrite"`` always
    replaces, ``"skip"`` never does. Entries whose document was tuned for another
    ``source_hash`` than the registered template's are counted as stale and not written;
    so are op choices whose winner was decided at another source hash than its current
    one. Entries of several documents for one problem are applied in order. A written
    entry keeps its software (its own, or its document's).

    Arguments:
        store: the tuning database to write.
        docs: ``(origin, document)`` pairs (origin: what the report calls each file);
            per-template documents and op choice documents, in any mix.
        specs: the registered implementations, name -> spec: a document whose
            ``source_hash`` is not its template's current one is stale.
        policy: ``"keep-faster"``, ``"overwrite"`` or ``"skip"``.
    Returns:
        The :class:`ImportReport`: per file, how many entries were added, replaced, kept,
        skipped or stale.
    Raises:
        ValueError for an unknown ``policy``; UnknownTemplateError for a document of an
        unregistered template, or an op choice document naming an unregistered
        implementation; ImportRejected for a document whose device name the store (or
        another document) holds with other hardware; StoreError when the transaction
        fails. Nothing is written on any of them.
    """
    if policy not in IMPORT_POLICIES:
        raise ValueError(f"unknown import policy {policy!r}; expected one of "
                         f"{', '.join(IMPORT_POLICIES)}")
    named = {doc.template for _, doc in docs if isinstance(doc, ConfigDocument)} | \
        {n for _, doc in docs if isinstance(doc, ChoiceDocument) for n in doc.implementations}
    unknown = sorted(named - set(specs))
    if unknown:
        kind = "template" if any(isinstance(d, ConfigDocument) and d.template == unknown[0]
                                 for _, d in docs) else "implementation"
        raise UnknownTemplateError(f"unknown {kind} {unknown[0]!r}; known {kind}s: "
                                   f"{', '.join(sorted(specs)) or 'none'}")
    bests: list[ImportedBest] = []
    picked: list[ImportedChoice] = []
    # per document: where its written entries lie in its batch, and how many are stale
    spans: list[tuple[str, Document, int, int, int]] = []
    for origin, doc in docs:
        if isinstance(doc, ChoiceDocument):
            current, stale = choices.imported_choices(
                doc, {n: s.source_hash for n, s in op_implementations(specs, doc.op).items()})
            start = len(picked)
            picked.extend(current)
            spans.append((origin, doc, start, len(picked), stale))
            continue
        fresh = doc.source_hash == specs[doc.template].source_hash
        start = len(bests)
        if fresh:
            bests.extend(_imported(doc, e) for e in doc.entries)
        spans.append((origin, doc, start, len(bests), 0 if fresh else len(doc.entries)))
    _check_one_device_per_name(store, [(o, d) for o, d, a, b, _ in spans if b > a])
    best_outcomes, choice_outcomes = store.import_entries(bests, picked, policy=policy)
    files = []
    for origin, doc, start, end, stale in spans:
        choice = isinstance(doc, ChoiceDocument)
        tally = Counter((choice_outcomes if choice else best_outcomes)[start:end])
        files.append(FileReport(
            origin, doc.device.name, "" if isinstance(doc, ChoiceDocument) else doc.template,
            added=tally["added"], replaced=tally["replaced"], kept=tally["kept"],
            skipped=tally["skipped"], stale=stale,
            op=doc.op if isinstance(doc, ChoiceDocument) else None))
    return ImportReport(policy, tuple(files))


def _check_one_device_per_name(store: TuningStore,
                               docs: Sequence[tuple[str, Document]]) -> None:
    """Refuse documents that would give one device name several hardware keys (compute
    capability, SM count, shared memory; total memory may differ) in ``store``: the
    dispatcher and export both take a name for one GPU, and export could no longer write
    that name's file. Checked before the import's transaction, so nothing is written."""
    held: dict[str, tuple[str, tuple[Any, ...]]] = {
        d.name: (f"stored in {store.url}", d.hardware_key()[:4]) for d in store.list_devices()}
    for origin, doc in docs:
        key = doc.device.hardware_key()[:4]
        where, other = held.setdefault(doc.device.name, (f"in {origin}", key))
        if other != key:
            raise ImportRejected(
                f"{checks.printable(origin)}: device {doc.device.name!r} is {where} with "
                f"other hardware ({_hardware(other)}) than this file says ({_hardware(key)}); "
                "one device name must mean one GPU. Nothing was imported: import this file "
                "into another database, or fix its device block")


def _hardware(key: tuple[Any, ...]) -> str:
    return f"compute capability {key[1]}, {key[2]} SMs, {key[3]} B shared memory per block"


def _imported(doc: ConfigDocument, e: ConfigEntry) -> ImportedBest:
    software = SoftwareVersions.from_dict(doc.software if e.software is None else e.software)
    return ImportedBest(*doc.device.hardware_key(), template_name=doc.template,
                        source_hash=doc.source_hash, problem_key=dict(e.problem),
                        bucket=e.bucket, config=dict(e.config), median_ms=e.median_ms,
                        tflops=e.tflops, trials_count=e.trials, tuned_at=e.tuned_at,
                        software=software)
