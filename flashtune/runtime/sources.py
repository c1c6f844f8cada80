"""Where tuned configs come from at run time, read once into plain values.

Three sources, in order of precedence (an earlier one wins for the same device and problem):

1. ``db``: the tuning database (``$FLASHTUNE_DB``, else the default SQLite file), opened
   read-only and never created;
2. ``dir``: exported JSON files in ``$FLASHTUNE_CONFIG_DIR`` (what a fleet ships);
3. ``package``: the JSON files shipped in ``flashtune/configs/``.

A file is found by :func:`flashtune.db.exchange.config_file_name`, the exporter's own naming
function; every file is validated on read (:func:`flashtune.db.exchange.read_document`).
Only configs tuned for the template's current ``source_hash`` are kept (others are stale).
A stale file of the device asked for, in ``flashtune/configs/`` or ``$FLASHTUNE_CONFIG_DIR``
(a shipped table tuned for an older kernel source), is one of the reasons returned (so the
router warns once per process, naming it and the command that re-tunes it); a stale entry
of the database, which keeps every source's results, is logged at info level.
:func:`stale_tables` lists every stale shipped table, of any device, for ``flashtune show``,
``db info`` and ``db verify``.
A source nobody asked for is silently empty when missing (the default database file before
the first tuning run); a locked, corrupt or unreadable one, and one asked for that is not
there (``$FLASHTUNE_DB`` or a ``db_url`` naming a SQLite file that does not exist,
``$FLASHTUNE_CONFIG_DIR`` missing or not a folder: a typo), is skipped with a reason,
returned to the caller (which warns once): an inference process never dies over its
configs.

:func:`load_choices` reads the tuner's op choices (which implementation, and config,
serves each shape of a user op) from the same three sources, files named by
:func:`flashtune.db.exchange.choice_file_name`. A choice is served only when its winner is
an implementation the caller names with the source hash it was decided at; others are
stale (a shipped file of the device asked for whose own-kernel choices are stale: a reason
returned, as above; else, an SDPA backend's choice timed under another torch or cuDNN
among them, logged at info level, once per source). A stale choice is still returned,
marked ``stale``: it holds its shape's ground, so the router sends calls near it to the
documented default rather than to a fresh choice made for another shape (an SDPA
backend's choice goes stale with the torch or cuDNN version, and the shapes where it beat
flashtune's kernels must not be handed to those kernels by a nearest lookup).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from flashtune.core.problem import AttentionProblem
from flashtune.core.spec import USER_OPS

log = logging.getLogger(__name__)
_T = TypeVar("_T")

__all__ = ["Alternative", "ChoiceEntry", "DeviceKey", "StaleTable", "TunedEntry", "device_key",
           "load_choices", "load_entries", "retune_file_command", "source_dirs",
           "stale_tables"]

# how the runtime matches a device: the hardware key without total memory, which moves
# by a few MiB between drivers on the same card
DeviceKey = tuple[str, str, int, int]


def device_key(dev: Any) -> DeviceKey:
    """``(name, compute_capability, sm_count, shared_mem_per_block)`` of a device record,
    fingerprint or :class:`flashtune.db.exchange.DeviceInfo`."""
    return (dev.name, dev.compute_capability, int(dev.sm_count), int(dev.shared_mem_per_block))


@dataclass(frozen=True)
class TunedEntry:
    """One tuned config as the dispatcher serves it."""

    device: DeviceKey
    problem: AttentionProblem
    config: dict[str, int]
    median_ms: float
    tflops: float | None
    origin: str  # "db <url>", "dir <path>" or "package <path>"


def source_dirs() -> list[tuple[str, Path]]:
    """``[("dir", $FLASHTUNE_CONFIG_DIR)?, ("package", flashtune/configs)]``."""
    dirs = []
    env = os.environ.get("FLASHTUNE_CONFIG_DIR", "").strip()
    if env:
        dirs.append(("dir", Path(env)))
    dirs.append(("package", Path(__file__).resolve().parent.parent / "configs"))
    return dirs


def _db_url(url: str | None) -> str | None:
    """The database to read (``url``, ``$FLASHTUNE_DB``, else the default file), or None
    when it is the default file and does not exist yet (nothing tuned: silently empty)."""
    from flashtune.db import default_db_url
    from flashtune.db.engine import missing_sqlite_file, safe_url

    url = url or os.environ.get("FLASHTUNE_DB", "").strip()
    asked = bool(url)
    url = url or default_db_url()
    missing = missing_sqlite_file(url)
    if missing is not None:
        if asked:  # a typo, most likely; never created here (read-only)
            raise FileNotFoundError(f"{safe_url(url)}: the file {missing} does not exist; "
                                    f"check the path ($FLASHTUNE_DB, --db), or run `flashtune "
                                    f"tune` to create it")
        return None
    return url


def _from_db(template: str, source_hash: str, url: str | None) -> Iterator[TunedEntry]:
    from flashtune.db import open_store
    from flashtune.db.engine import safe_url

    url = _db_url(url)
    if url is None:
        return
    with open_store(url, read_only=True, create=False) as store:
        best = store.list_best(template_name=template, source_hash=source_hash)
    origin = f"db {safe_url(url)}"
    for b in best:
        yield TunedEntry(device_key(b.device), AttentionProblem.from_key(b.problem.key),
                         dict(b.config), b.median_ms, b.tflops, origin)


def _from_file(path: Path, kind: str, template: str, source_hash: str,
               device_name: str | None) -> tuple[list[TunedEntry], str | None]:
    """The entries of a config file and, when it is stale and of ``device_name``, the line
    that says so (else a stale file is logged at info level)."""
    from flashtune.db.exchange import ConfigDocument, read_document
    from flashtune.kernel_templates import catalog

    specs = catalog()
    doc = read_document(path, specs=specs)
    if not isinstance(doc, ConfigDocument) or doc.template != template \
            or doc.file_name() != path.name:
        raise ValueError(f"{path} holds {doc.file_name()}, not what its name says")
    if doc.source_hash != source_hash:
        stale = _config_staleness(path, kind, doc, specs)
        if stale is not None and doc.device.name == device_name:
            return [], stale.line()
        log.info("%s: tuned for %s source %s, this is %s: stale, not served", path, template,
                 doc.source_hash, source_hash)
        return [], None
    key = device_key(doc.device)
    return [TunedEntry(key, AttentionProblem.from_key(e.problem), dict(e.config),
                       e.median_ms, e.tflops, f"{kind} {path}") for e in doc.entries], None


def _files(folder: Path, exact: str | None, suffix: str) -> list[Path]:
    """The file named ``exact`` (a device's, by the exporter's naming function), or with
    ``exact`` None every exported file in ``folder`` whose name ends with ``suffix`` (device
    aliases)."""
    if not folder.is_dir():
        return []
    if exact is not None:
        path = folder / exact
        return [path] if path.is_file() else []
    return sorted(p for p in folder.iterdir()
                  if p.name.startswith("device_name=") and p.name.endswith(suffix))


def _gather(from_db: Callable[[], Iterable[_T]], files: Callable[[Path], list[Path]],
            from_file: Callable[[Path, str], tuple[list[_T], str | None]], what: str
            ) -> tuple[list[_T], list[str]]:
    """The entries of the database, then of every config folder, in precedence order, and
    one line per source that failed or is stale (``what``: ``"config"``, ``"op choice"``,
    for it)."""
    entries: list[_T] = []
    problems: list[str] = []
    try:
        entries.extend(from_db())
    except Exception as exc:  # noqa: BLE001 - locked, corrupt, newer schema...: skip it
        problems.append(f"tuning database skipped: {' '.join(str(exc).split())}")
    for kind, folder in source_dirs():
        if kind == "dir" and not folder.is_dir():
            what_is = "is not a folder" if folder.exists() else "does not exist"
            problems.append(f"$FLASHTUNE_CONFIG_DIR {folder} skipped: it {what_is}")
            continue
        try:
            paths = files(folder)
        except Exception as exc:  # noqa: BLE001 - an unreadable folder never stops the process
            problems.append(f"{kind} {what}s {folder} skipped: {exc}")
            continue
        for path in paths:
            try:
                found, stale = from_file(path, kind)
            except Exception as exc:  # noqa: BLE001 - a bad file never stops the process
                problems.append(f"{kind} {what} file skipped: {' '.join(str(exc).split())}")
                continue
            entries.extend(found)
            if stale is not None:
                problems.append(stale)
    return entries, problems


def load_entries(template: str, source_hash: str, device_name: str, *,
                 aliases: bool = False, db_url: str | None = None
                 ) -> tuple[list[TunedEntry], list[str]]:
    """Every usable entry of every source, in precedence order, and why any source failed.

    Files of other devices are read only when ``aliases`` is set (the database always holds
    every device it has).
    """
    from flashtune.db.exchange import config_file_name

    return _gather(lambda: _from_db(template, source_hash, db_url),
                   lambda folder: _files(
                       folder, None if aliases else config_file_name(device_name, template),
                       f",template={template}.json"),
                   lambda path, kind: _from_file(path, kind, template, source_hash,
                                                 device_name), "config")


# -- op choices -------------------------------------------------------------------------------

@dataclass(frozen=True)
class ChoiceEntry:
    """One op choice as the router serves it: on ``device``, ``problem`` runs
    ``implementation`` with ``config``, which beat the runner-up by ``margin``
    (``runner_up_ms / median_ms``; None when nothing else was timed). ``stale``: decided at
    another source of ``implementation`` (or by one this flashtune does not know): never
    served, it only marks where that choice was made (see the module docstring).
    ``alternatives``: the other implementations timed in the decision, fastest first, each
    its best config and time, those decided at the source hash the caller names only."""

    device: DeviceKey
    problem: AttentionProblem
    implementation: str
    config: dict[str, int]
    median_ms: float
    tflops: float | None
    origin: str  # "db <url>", "dir <path>" or "package <path>"
    margin: float | None
    stale: bool = False
    alternatives: tuple[Alternative, ...] = ()


@dataclass(frozen=True)
class Alternative:
    """One implementation a choice was timed against: its best config and time there."""

    implementation: str
    config: dict[str, int]
    median_ms: float


def _alternatives(candidates: Iterable[Mapping[str, Any]], winner: str,
                  hashes: Mapping[str, str],
                  known: Mapping[str, str] | None = None) -> tuple[Alternative, ...]:
    """``candidates`` (a decision's, as stored) less the winner, those that failed and those
    timed at a source hash other than ``hashes`` names (a candidate's own, else the
    document's ``known`` one), fastest first."""
    out = []
    for c in candidates:
        name, ms = c.get("implementation"), c.get("median_ms")
        if name == winner or not isinstance(name, str) or ms is None:
            continue
        timed_at = c.get("source_hash") or (known or {}).get(name)
        if name in hashes and timed_at == hashes[name]:
            out.append(Alternative(name, dict(c.get("config") or {}), float(ms)))
    return tuple(sorted(out, key=lambda a: a.median_ms))


class _Stale:
    """Counts the choices of one source that are not served, for one info line."""

    def __init__(self, origin: str) -> None:
        self.origin = origin
        self.skipped: dict[str, int] = {}

    def keep(self, implementation: str, source_hash: str | None,
             hashes: Mapping[str, str]) -> bool:
        """Whether a choice of ``implementation`` decided at ``source_hash`` is served
        (else it is counted)."""
        if implementation in hashes and source_hash == hashes[implementation]:
            return True
        self.skipped[implementation] = self.skipped.get(implementation, 0) + 1
        return False

    def log(self, hashes: Mapping[str, str]) -> None:
        """One info line naming what was not served, if anything."""
        if self.skipped:
            what = ", ".join(
                f"{n} of {name} ({'decided at another source' if name in hashes else 'unknown'})"
                for name, n in sorted(self.skipped.items()))
            log.info("%s: op choices not served (stale; calls near them take the default): "
                     "%s", self.origin, what)


def _choices_from_db(op: str, hashes: Mapping[str, str], url: str | None) -> list[ChoiceEntry]:
    from flashtune.db import open_store
    from flashtune.db.engine import safe_url

    url = _db_url(url)
    if url is None:
        return []
    with open_store(url, read_only=True, create=False) as store:
        stored = store.list_choices(op=op)
    stale = _Stale(f"db {safe_url(url)}")
    out = [ChoiceEntry(device_key(c.device), AttentionProblem.from_key(c.problem_key),
                       c.implementation, dict(c.config), c.median_ms, c.tflops, stale.origin,
                       c.margin, not stale.keep(c.implementation, c.source_hash, hashes),
                       _alternatives(c.candidates, c.implementation, hashes))
           for c in stored]
    stale.log(hashes)
    return out


def _choices_from_file(path: Path, kind: str, op: str, hashes: Mapping[str, str],
                       device_name: str | None) -> tuple[list[ChoiceEntry], str | None]:
    from flashtune.db.exchange_choices import read_choice_document
    from flashtune.kernel_templates import catalog

    specs = catalog()
    doc = read_choice_document(path, specs=specs, strict=False)
    if doc.op != op or doc.file_name() != path.name:
        raise ValueError(f"{path} holds {doc.file_name()}, not what its name says")
    key = device_key(doc.device)
    stale = _Stale(f"{kind} {path}")
    out = [ChoiceEntry(key, AttentionProblem.from_key(e.problem), e.implementation,
                       dict(e.config), e.median_ms, e.tflops, stale.origin,
                       None if e.runner_up_ms is None else e.runner_up_ms / e.median_ms,
                       not stale.keep(e.implementation,
                                      doc.implementations.get(e.implementation), hashes),
                       _alternatives(e.candidates, e.implementation, hashes,
                                     doc.implementations))
           for e in doc.entries]
    # warned about: entries of one of flashtune's own kernels whose source moved since (its
    # kernels changed: re-tune); only logged: an SDPA backend's (or a pair with its forward:
    # ``torch_bound``), whose hash is the torch and cuDNN that timed it (any other torch:
    # their shapes take the default, cuDNN on Hopper, as the stale choice would), and one
    # this flashtune does not know (a newer file's)
    moved = [n for n in stale.skipped if n in hashes and not specs[n].torch_bound]
    if moved and doc.device.name == device_name:
        found = _choice_staleness(path, kind, doc, hashes, specs)
        if found is not None:
            return out, found.line()
    stale.log(hashes)
    return out, None


def load_choices(op: str, hashes: Mapping[str, str], device_name: str, *,
                 aliases: bool = False, db_url: str | None = None
                 ) -> tuple[list[ChoiceEntry], list[str]]:
    """Every servable op choice of every source, in precedence order (database, then
    ``$FLASHTUNE_CONFIG_DIR``, then the package's ``flashtune/configs``), and why any
    source failed; never raises over a source.

    Arguments:
        op: the user op (``"fwd"``, ``"decode"``).
        hashes: implementation name -> its current source hash: a choice whose winner is
            not named here, or was decided at another hash, is stale (one info line per
            source), returned marked ``stale``.
        device_name: the device whose files are read (the database holds every device).
        aliases: read the files of every device too (device aliases).
        db_url: the database (None: ``$FLASHTUNE_DB``, else the default file).
    Returns:
        ``(entries, problems)``: the choices, earlier sources first; one line per source
        skipped (locked, corrupt, missing when named, an invalid file...).
    """
    from flashtune.db.exchange import choice_file_name

    if op not in USER_OPS:
        return [], [f"op {op!r} is not a user op; expected one of {', '.join(USER_OPS)}"]
    return _gather(lambda: _choices_from_db(op, hashes, db_url),
                   lambda folder: _files(
                       folder, None if aliases else choice_file_name(device_name, op),
                       f",op={op}.json"),
                   lambda path, kind: _choices_from_file(path, kind, op, hashes,
                                                         device_name), "op choice")


# -- stale shipped tables ---------------------------------------------------------------------

@dataclass(frozen=True)
class StaleTable:
    """A shipped or exported file (``flashtune/configs/``, ``$FLASHTUNE_CONFIG_DIR``) with
    entries that are not served: tuned for another source of their implementation than this
    flashtune's (its kernels changed since), or for an implementation it does not know.

    Attributes:
        kind: ``"package"`` or ``"dir"``.
        path: the file.
        device: the device name it was tuned on.
        what: ``"attn_fwd configs"`` or ``"op fwd choices"``.
        stale: how many of its entries are not served; ``total``: how many it has.
        reason: why, in one clause.
        command: the commands that re-tune and re-export it on that device's GPU.
    """

    kind: str
    path: Path
    device: str
    what: str
    stale: int
    total: int
    reason: str
    command: str

    def line(self) -> str:
        """One line: which file, how many entries, why, and how to re-tune them."""
        count = "all" if self.stale == self.total else f"{self.stale} of"
        return (f"{self.kind} {self.path.name} is stale: {count} {self.total} {self.what} "
                f"not served ({self.reason}); re-tune on a {self.device}: {self.command}")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready values (``path`` as a string)."""
        return {"kind": self.kind, "path": str(self.path), "device": self.device,
                "what": self.what, "stale": self.stale, "total": self.total,
                "reason": self.reason, "command": self.command, "line": self.line()}


def retune_file_command(folder: Path, device: str, *, template: str | None = None,
                        template_op: str | None = None, op: str | None = None) -> str:
    """The commands that re-tune a shipped file's table on its device and write it back:
    ``flashtune tune`` over the packaged plan of its op
    (:data:`flashtune.autotune.plans.SHIPPED_PLANS`), then ``flashtune export`` of that
    template (``template``, whose op is ``template_op``) or op (``op``) into ``folder``."""
    import shlex

    from flashtune.autotune.plans import shipped_plan, tune_command

    plan = shipped_plan(op or template_op or "")
    what = ("--op", op) if op else ("--template", str(template))
    export = (f"flashtune export -o {shlex.quote(str(folder))} --device {shlex.quote(device)} "
              f"{' '.join(what)}")
    if plan is None:  # a template no packaged plan covers: its shapes as tuned
        return f"flashtune tune {' '.join(what)} <each shape>, then {export}"
    return f"{tune_command(None, op=op, template=template, plan=plan)}, then {export}"


def _config_staleness(path: Path, kind: str, doc: Any,
                      specs: Mapping[str, Any]) -> StaleTable | None:
    spec = specs.get(doc.template)
    if spec is not None and spec.source_hash == doc.source_hash:
        return None
    reason = (f"tuned for {doc.template} source {doc.source_hash}, this flashtune's is "
              f"{spec.source_hash}" if spec is not None
              else f"this flashtune has no template {doc.template}")
    return StaleTable(kind, path, doc.device.name, f"{doc.template} configs", len(doc.entries),
                      len(doc.entries), reason,
                      retune_file_command(path.parent, doc.device.name, template=doc.template,
                                          template_op=getattr(spec, "op", None)))


def _choice_staleness(path: Path, kind: str, doc: Any, hashes: Mapping[str, str],
                      specs: Mapping[str, Any]) -> StaleTable | None:
    stale = [e for e in doc.entries if not doc.is_current(e, hashes)]
    if not stale:
        return None
    moved = sorted({e.implementation for e in stale})
    reasons = []
    for name in moved:
        if name in hashes and specs[name].torch_bound:
            reasons.append(f"{name} timed under another torch or cuDNN than this one (source "
                           f"{doc.implementations.get(name)}, here {hashes[name]}): those "
                           f"shapes take the default")
        elif name in hashes:
            reasons.append(f"{name} decided at source {doc.implementations.get(name)}, this "
                           f"flashtune's is {hashes[name]}")
        else:
            reasons.append(f"this flashtune has no implementation {name} of op {doc.op}")
    return StaleTable(kind, path, doc.device.name, f"op {doc.op} choices", len(stale),
                      len(doc.entries), "; ".join(reasons),
                      retune_file_command(path.parent, doc.device.name, op=doc.op))


def stale_tables(device_name: str | None = None) -> tuple[list[StaleTable], list[str]]:
    """Every stale table among the shipped and exported files (``$FLASHTUNE_CONFIG_DIR``,
    then ``flashtune/configs/``), of ``device_name`` or (None) of every device, and one line
    per file or folder that could not be read.

    Reads every file once, on the caller's request (``flashtune show``, ``db info``,
    ``db verify``); the router never calls it.
    """
    from flashtune.db.exchange import ConfigDocument, read_document
    from flashtune.db.exchange_choices import read_choice_document
    from flashtune.kernel_templates import catalog

    specs = catalog()
    out: list[StaleTable] = []
    problems: list[str] = []
    for kind, folder in source_dirs():
        try:
            paths = _files(folder, None, ".json")
        except OSError as exc:
            problems.append(f"{kind} folder {folder} skipped: {exc}")
            continue
        for path in paths:
            try:
                if ",op=" in path.name:
                    doc: Any = read_choice_document(path, specs=specs, strict=False)
                    if device_name not in (None, doc.device.name):
                        continue
                    hashes = {s.name: s.source_hash for s in specs.for_op(doc.op).values()}
                    found = _choice_staleness(path, kind, doc, hashes, specs)
                else:
                    doc = read_document(path, specs=specs)
                    if not isinstance(doc, ConfigDocument) \
                            or device_name not in (None, doc.device.name):
                        continue
                    found = _config_staleness(path, kind, doc, specs)
            except Exception as exc:  # noqa: BLE001 - a bad file is a line, never a crash
                problems.append(f"{kind} file {path.name} skipped: "
                                f"{' '.join(str(exc).split())}")
                continue
            if found is not None:
                out.append(found)
    return out, problems
