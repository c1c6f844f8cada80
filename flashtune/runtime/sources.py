"""Where tuned configs come from at run time, read once into plain values.

Three sources, in order of precedence (an earlier one wins for the same device and problem):

1. ``db``: the tuning database (``$FLASHTUNE_DB``, else the default SQLite file), opened
   read-only and never created;
2. ``dir``: exported JSON files in ``$FLASHTUNE_CONFIG_DIR`` (what a fleet ships);
3. ``package``: the JSON files shipped in ``flashtune/configs/``.

A file is found by :func:`flashtune.db.exchange.config_file_name`, the exporter's own naming
function; every file is validated on read (:func:`flashtune.db.exchange.read_document`).
Only configs tuned for the template's current ``source_hash`` are kept (others are stale).
A source nobody asked for is silently empty when missing (the default database file before
the first tuning run); a locked, corrupt or unreadable one, and one asked for that is not
there (``$FLASHTUNE_DB`` or a ``db_url`` naming a SQLite file that does not exist,
``$FLASHTUNE_CONFIG_DIR`` missing or not a folder: a typo), is skipped with a reason,
returned to the caller (which warns once): an inference process never dies over its
configs.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flashtune.core.problem import AttentionProblem

log = logging.getLogger(__name__)

__all__ = ["DeviceKey", "TunedEntry", "device_key", "load_entries", "source_dirs"]

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


def _from_db(template: str, source_hash: str, url: str | None) -> Iterator[TunedEntry]:
    from flashtune.db import default_db_url, open_store
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
        return
    with open_store(url, read_only=True, create=False) as store:
        best = store.list_best(template_name=template, source_hash=source_hash)
    origin = f"db {safe_url(url)}"
    for b in best:
        yield TunedEntry(device_key(b.device), AttentionProblem.from_key(b.problem.key),
                         dict(b.config), b.median_ms, b.tflops, origin)


def _from_file(path: Path, kind: str, template: str, source_hash: str) -> Iterator[TunedEntry]:
    from flashtune.db.exchange import read_document
    from flashtune.kernel_templates import catalog

    doc = read_document(path, specs=catalog())
    if doc.template != template or doc.file_name() != path.name:
        raise ValueError(f"{path} holds {doc.file_name()}, not what its name says")
    if doc.source_hash != source_hash:
        log.info("%s: tuned for %s source %s, this is %s: stale, not served", path, template,
                 doc.source_hash, source_hash)
        return
    key = device_key(doc.device)
    for e in doc.entries:
        yield TunedEntry(key, AttentionProblem.from_key(e.problem), dict(e.config),
                         e.median_ms, e.tflops, f"{kind} {path}")


def _files(folder: Path, template: str, device_name: str | None) -> list[Path]:
    """The file of ``device_name`` (by the exporter's naming function), or every file of
    ``template`` in ``folder`` when ``device_name`` is None (device aliases)."""
    from flashtune.db.exchange import config_file_name

    if not folder.is_dir():
        return []
    if device_name is not None:
        path = folder / config_file_name(device_name, template)
        return [path] if path.is_file() else []
    suffix = f",template={template}.json"
    return sorted(p for p in folder.iterdir()
                  if p.name.startswith("device_name=") and p.name.endswith(suffix))


def load_entries(template: str, source_hash: str, device_name: str, *,
                 aliases: bool = False, db_url: str | None = None
                 ) -> tuple[list[TunedEntry], list[str]]:
    """Every usable entry of every source, in precedence order, and why any source failed.

    Files of other devices are read only when ``aliases`` is set (the database always holds
    every device it has).
    """
    entries: list[TunedEntry] = []
    problems: list[str] = []
    try:
        entries.extend(_from_db(template, source_hash, db_url))
    except Exception as exc:  # noqa: BLE001 - locked, corrupt, newer schema...: skip it
        problems.append(f"tuning database skipped: {' '.join(str(exc).split())}")
    for kind, folder in source_dirs():
        if kind == "dir" and not folder.is_dir():
            what = "is not a folder" if folder.exists() else "does not exist"
            problems.append(f"$FLASHTUNE_CONFIG_DIR {folder} skipped: it {what}")
            continue
        try:
            paths = _files(folder, template, None if aliases else device_name)
        except Exception as exc:  # noqa: BLE001 - an unreadable folder never stops the process
            problems.append(f"{kind} configs {folder} skipped: {exc}")
            continue
        for path in paths:
            try:
                entries.extend(_from_file(path, kind, template, source_hash))
            except Exception as exc:  # noqa: BLE001 - a bad file never stops the process
                problems.append(f"{kind} config file skipped: {' '.join(str(exc).split())}")
    return entries, problems
