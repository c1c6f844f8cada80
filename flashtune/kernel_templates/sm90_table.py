"""The sm_90 compile tables behind the Gluon templates' validity predicates
(``attn_fwd_gluon``, ``attn_bwd_gluon``): what one compile gave (:class:`Compiled`), how a
table entry is made (:func:`compile_entry`), and the command that writes a table
(:func:`write_table`). Each template's ``space.py`` reads its table and ``prefilter.py``
writes it; both import this module, which no launcher imports, so it is in no source hash.

Each entry records ``ir_hash``, a hash of the kernel's Gluon IR as the frontend makes it
for that compile (:func:`frontend_hash`: source locations left out, so a moved line or a
comment does not count). Regenerating a table reuses an entry of the old one whose key and
IR hash are the new compile's (same Triton version and target): the code ptxas would see is
the same, so are its figures. A kernel change behind a new constexpr off by default
recompiles only the configs that turn it on; a full compile is 2-20 s a config, the
frontend 0.3-0.7 s. ``--hash-only`` adds the hashes to a table compiled from the current
source without compiling anything.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import re
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

__all__ = ["SMEM_LIMIT", "SPILL_LIMIT", "Compiled", "compile_entry", "entry_config",
           "entry_figures", "frontend_hash", "parse_table", "read_table", "smem_limit",
           "write_table"]

SMEM_LIMIT = 227 * 1024  # dynamic shared memory an sm_90 block may opt in to
# spill-store bytes a config may have (each template's space.py says what spills there)
SPILL_LIMIT = 256


@dataclass(frozen=True)
class Compiled:
    """What compiling one config for sm_90a gave: ``error`` (its first line) or the figures."""

    shared: int | None
    registers: int | None
    spill_bytes: int | None
    error: str | None = None

    def reason(self, smem_limit: int = SMEM_LIMIT, spill_limit: int = SPILL_LIMIT) -> str | None:
        """Why this compiled kernel should not run (None: it may).

        Arguments:
            smem_limit: the shared memory a block may use on the device, in bytes.
            spill_limit: the spill-store bytes allowed.
        Returns:
            The reason, or None.
        """
        if self.error is not None:
            return f"does not compile for sm_90a: {self.error}"
        if (self.spill_bytes or 0) > spill_limit:
            return (f"spills {self.spill_bytes} B of registers to local memory (ptxas, sm_90a, "
                    f"{self.registers} registers; at most {spill_limit} B allowed)")
        if self.shared is not None and self.shared > smem_limit:
            return f"needs {self.shared} B of shared memory, an sm_90 block may use {smem_limit} B"
        return None


def smem_limit(device: Any) -> int:
    """The shared memory a block may use on ``device``: :data:`SMEM_LIMIT`, or the device's
    opt-in limit where it is lower (not under the interpreter, whose figure means nothing).

    Arguments:
        device: a :class:`~flashtune.core.device.DeviceFingerprint`.
    Returns:
        Bytes.
    """
    if not device.is_interpreter and 0 < device.shared_mem_per_block < SMEM_LIMIT:
        return int(device.shared_mem_per_block)
    return SMEM_LIMIT


def entry_config(raw: Mapping[str, Any], params: Iterable[str], where: str) -> dict[str, int]:
    """An entry's ``config``: a dict of exactly ``params``, each an int (ValueError naming
    ``where`` otherwise)."""
    names = list(params)
    config = raw["config"]
    if not isinstance(config, dict) or set(config) != set(names) \
            or any(type(config[n]) is not int for n in names):
        raise ValueError(f"{where}: config must map {names} to ints, got {config!r}")
    return config


def entry_figures(raw: Mapping[str, Any], where: str) -> Compiled:
    """An entry's compile figures (``shared``, ``registers``, ``spill_bytes``: ints or null;
    ``error``: a string or null, the three figures required without one), checked
    (ValueError naming ``where``)."""
    for name in ("shared", "registers", "spill_bytes"):
        if raw[name] is not None and type(raw[name]) is not int:
            raise ValueError(f"{where}: {name} must be an int or null, got {raw[name]!r}")
    if raw["error"] is not None and not isinstance(raw["error"], str):
        raise ValueError(f"{where}: error must be a string or null, got {raw['error']!r}")
    if raw["error"] is None and None in (raw["shared"], raw["registers"], raw["spill_bytes"]):
        raise ValueError(f"{where}: an entry without an error needs shared, registers and "
                         f"spill_bytes")
    return Compiled(raw["shared"], raw["registers"], raw["spill_bytes"], raw["error"])


def parse_table(doc: Any, where: str, *, table_format: int, regenerate: str,
                entry: Callable[[Any, str], tuple[str, Compiled]]) -> dict[str, Compiled]:
    """The entries of a table document (``json.load`` of a ``sm90_compile.json``), checked.

    Arguments:
        doc: the document.
        where: what to name in an error (its path).
        table_format: the format the template's tables have.
        regenerate: the command that writes the table (named in an error).
        entry: one entry's ``(key, Compiled)``, checked (ValueError naming where).
    Returns:
        key -> :class:`Compiled`.
    Raises:
        ValueError naming what is wrong and where.
    """
    if not isinstance(doc, dict) or doc.get("format") != table_format \
            or not isinstance(doc.get("entries"), list):
        raise ValueError(f"{where}: expected an object with format {table_format} and a list "
                         f"of entries; regenerate it: {regenerate}")
    table: dict[str, Compiled] = {}
    for i, raw in enumerate(doc["entries"]):
        ir_hash = raw.get("ir_hash") if isinstance(raw, dict) else None
        if ir_hash is not None and not (isinstance(ir_hash, str)
                                        and re.fullmatch(r"[0-9a-f]{16}", ir_hash)):
            raise ValueError(f"{where}, entry {i}: ir_hash must be 16 hex digits or null, "
                             f"got {ir_hash!r}")
        key, compiled = entry(raw, f"{where}, entry {i}")
        if key in table:
            raise ValueError(f"{where}, entry {i}: {key} appears twice")
        table[key] = compiled
    return table


def read_table(path: Path, template: str, regenerate: str,
               parse: Callable[[Any, str], dict[str, Compiled]]) -> dict[str, Compiled]:
    """A template's table read from ``path`` and checked; a source hash that is not the
    template's (its ``kernel.py`` and ``launcher.py`` beside the table) is logged.

    Arguments:
        path: the table.
        template: the template's name (for the log line).
        regenerate: the command that writes the table.
        parse: the template's :func:`parse_table`.
    Returns:
        key -> :class:`Compiled`.
    Raises:
        OSError when it cannot be read; ValueError when it is not a valid table.
    """
    from flashtune.kernel_templates.registry import source_hash

    with open(path, encoding="utf-8") as f:
        doc = json.load(f)
    table = parse(doc, str(path))
    current = source_hash(path.parent / "kernel.py", path.parent / "launcher.py")
    if doc.get("source_hash") != current:
        log.warning("%s was compiled from %s source %s, the source is now %s: its verdicts may "
                    "be stale; regenerate it: %s", path, template, doc.get("source_hash"),
                    current, regenerate)
    return table


class _Frontend(Exception):
    """Carries :func:`frontend_hash`'s hash out of the compile it stopped."""

    def __init__(self, digest: str) -> None:
        super().__init__(digest)
        self.digest = digest


_LOCATION = re.compile(r"\s*loc\((?:[^()]|\([^()]*\))*\)")


def ir_digest(text: str) -> str:
    """A hash of an MLIR module's text without its source locations (``loc(...)``
    annotations and ``#loc`` definitions): 16 hex digits."""
    kept = [line for line in _LOCATION.sub("", text).splitlines()
            if not line.startswith("#loc")]
    return hashlib.sha256("\n".join(kept).encode()).hexdigest()[:16]


def frontend_hash(compile_fn: Callable[[], Any]) -> str | None:
    """The :func:`ir_digest` of the Gluon/Triton IR that ``compile_fn`` (a function that
    calls ``triton.compile`` once, as the launchers' ``compile_sm90`` do) hands to the
    compiler's passes: ``triton.compile`` is stood in for while it runs, the source's
    ``make_ir`` is run with the target's options, and nothing else is compiled. None when
    the frontend itself fails (the full compile then records the error)."""
    import triton
    from triton._C.libtriton import ir
    from triton.compiler.compiler import make_backend

    def stand_in(src: Any, target: Any = None, options: Any = None, **_: Any) -> Any:
        backend = make_backend(target)
        opts = backend.parse_options(dict(options or {}))
        context = ir.context()
        ir.load_dialects(context)
        backend.load_dialects(context)
        module = src.make_ir(target, opts, backend.get_codegen_implementation(opts),
                             backend.get_module_map(), context)
        raise _Frontend(ir_digest(str(module)))

    real = triton.compile
    triton.compile = stand_in
    try:
        compile_fn()
    except _Frontend as found:
        return found.digest
    except Exception:  # noqa: BLE001 - the full compile reports it
        return None
    finally:
        triton.compile = real
    raise RuntimeError("compile_fn did not call triton.compile")


def compile_entry(case: Mapping[str, Any], compile_fn: Callable[[], Any],
                  old: Mapping[str, Any] | None = None, keep: bool = False) -> dict[str, Any]:
    """One table entry: ``case`` with the shared memory, registers and spill-store bytes of
    ``compile_fn()`` (a Triton compiled kernel for sm_90a), or the error's first line, and
    its ``ir_hash`` (:func:`frontend_hash`); ``old``'s figures, not compiled again, when it
    is the old table's entry for the same key with the same IR hash (``reused``: True), or
    with ``keep`` whatever its hash (``--hash-only``: a table compiled from this source).

    Arguments:
        case: the compile's fields (head dim, causal flag, config...).
        compile_fn: compiles it.
        old: the entry of the same key in the table being regenerated, if any.
        keep: take ``old``'s figures as this compile's (only its hash is computed).
    Returns:
        The entry (``shared``, ``registers``, ``spill_bytes``, ``error``, ``ir_hash``).
    """
    ir_hash = frontend_hash(compile_fn)
    # reused: both hashes known and equal (or keep)
    if old is not None and (keep or (ir_hash is not None and old.get("ir_hash") == ir_hash)):
        return dict(case, shared=old["shared"], registers=old["registers"],
                    spill_bytes=old["spill_bytes"], error=old["error"], ir_hash=ir_hash,
                    reused=True)
    entry = _compiled_entry(case, compile_fn)
    entry["ir_hash"] = ir_hash
    return entry


def _compiled_entry(case: Mapping[str, Any], compile_fn: Callable[[], Any]) -> dict[str, Any]:
    from flashtune.kernel_templates.attn_fwd_gluon.launcher import ptxas_stats

    entry = dict(case, shared=None, registers=None, spill_bytes=None, error=None)
    try:
        compiled = compile_fn()
        stats = ptxas_stats(compiled.asm["ptx"])
        figures = dict(shared=int(compiled.metadata.shared), registers=max(stats["registers"]),
                       spill_bytes=sum(stats["spill_store_bytes"]))
    except Exception as exc:  # noqa: BLE001 - a failure is a verdict
        lines = [t.strip() for t in str(exc).splitlines() if t.strip()]
        entry["error"] = f"{type(exc).__name__}: {lines[0] if lines else ''}"[:300]
        return entry
    entry.update(figures)
    return entry


def write_table(argv: list[str] | None, *, command: str, description: str | None,
                table: Path, cases: list[dict[str, Any]],
                compile_case: Callable[[dict[str, Any]], dict[str, Any]],
                label: Callable[[dict[str, Any]], str], header: Mapping[str, Any],
                check: Callable[[dict[str, Any], str], Any]) -> int:
    """The ``--prefilter`` command: compile ``cases`` in a process pool and write the table.

    Arguments:
        argv: the command line (``--prefilter --jobs N --out PATH``).
        command: how the command is run (its name for ``--help``).
        description: ``--help``'s text.
        table: the default output path.
        cases: every compile the table holds.
        compile_case: a module-level function (the pool pickles it) making one entry.
        label: an entry's table key, for the progress lines.
        header: the table's fields before ``entries`` (format, about, command, source
            hash...).
        check: reads the new table back as the predicate will (raises on a bad one).
    Returns:
        0, or 2 under ``TRITON_INTERPRET`` (nothing compiles there).
    """
    parser = argparse.ArgumentParser(prog=command.rsplit(" ", 1)[0], description=description,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefilter", action="store_true", help="(the mode flag)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                        help="compile processes (default: every core)")
    parser.add_argument("--out", type=Path, default=table, help=f"default: {table}")
    parser.add_argument("--reuse", type=Path, default=None, metavar="TABLE",
                        help="the table whose entries may be reused (default: --out's file "
                             "when it exists): an entry of the same key and frontend IR hash, "
                             "compiled by the same Triton for the same target, is not "
                             "compiled again")
    parser.add_argument("--no-reuse", action="store_true", help="compile every entry")
    parser.add_argument("--hash-only", action="store_true",
                        help="compile nothing: add each entry's frontend IR hash to the "
                             "--reuse table, which must be compiled from the current source "
                             "by this Triton for this target")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET"):
        print("unset TRITON_INTERPRET: this compiles for sm_90", file=sys.stderr)
        return 2
    source = args.reuse if args.reuse is not None else args.out
    old_doc = None if args.no_reuse or not source.exists() else \
        json.loads(source.read_text(encoding="utf-8"))
    why_not = reuse_refusal(old_doc, header)
    old_entries: dict[str, Any] = {}
    if old_doc is not None and why_not is None:
        old_entries = {label(e): e for e in old_doc.get("entries", [])}
    elif old_doc is not None:
        print(f"not reusing {source}: {why_not}", file=sys.stderr)
    olds = [old_entries.get(label(case)) for case in cases]
    if args.hash_only:
        problem = hash_only_refusal(old_doc, why_not, header, olds.count(None))
        if problem is not None:
            print(f"--hash-only: {problem}", file=sys.stderr)
            return 2
    start = time.monotonic()
    entries = []
    reused = 0
    with ProcessPoolExecutor(max_workers=max(1, args.jobs),
                             mp_context=get_context("spawn")) as pool:
        for i, entry in enumerate(pool.map(compile_case, cases, olds,
                                           [args.hash_only] * len(cases)), 1):
            reused += bool(entry.pop("reused", False))
            entries.append(entry)
            print(f"[{i}/{len(cases)} {time.monotonic() - start:.0f}s] {label(entry)}: shared "
                  f"{entry['shared']}, registers {entry['registers']}, spills "
                  f"{entry['spill_bytes']}{', ' + entry['error'] if entry['error'] else ''}",
                  file=sys.stderr, flush=True)
    doc = {**header, "entries": entries}
    check(doc, "the new table")  # what the predicate will read back
    args.out.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {len(entries)} entries to {args.out} in {time.monotonic() - start:.0f}s "
          f"({reused} reused from {source}, {len(entries) - reused} compiled)", file=sys.stderr)
    return 0


def hash_only_refusal(old_doc: Any, why_not: str | None, header: Mapping[str, Any],
                      missing: int) -> str | None:
    """Why ``--hash-only`` cannot take an old table's figures as this source's (no table,
    one :func:`reuse_refusal` refuses, another source, cases it lacks), or None."""
    if old_doc is None:
        return "no table to add hashes to"
    if why_not is not None:
        return why_not
    if old_doc.get("source_hash") != header.get("source_hash"):
        return (f"the table was compiled from source {old_doc.get('source_hash')}, the "
                f"source is now {header.get('source_hash')}: regenerate it instead")
    if missing:
        return f"the table lacks {missing} of the cases: regenerate it instead"
    return None


def reuse_refusal(old_doc: Any, header: Mapping[str, Any]) -> str | None:
    """Why an old table's entries cannot stand for this run's compiles (another Triton,
    another target, another format), or None."""
    if old_doc is None:
        return None
    if not isinstance(old_doc, dict) or not isinstance(old_doc.get("entries"), list):
        return "not a table"
    for field in ("format", "triton", "target"):
        if old_doc.get(field) != header.get(field):
            return f"its {field} is {old_doc.get(field)!r}, this run's {header.get(field)!r}"
    return None
