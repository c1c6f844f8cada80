"""``flashtune export`` / ``flashtune import``: tuned best configs and op choices as
per-device JSON files.

``export`` opens the store read-only and never creates it (a database file that does not
exist has nothing to export: a message, exit 0). ``-o DIR`` (an existing directory, or a
path not ending in ``.json``) writes one file per device and template, named by
:func:`flashtune.db.exchange.config_file_name`, and one per device and user op for the
tuner's op choices (which implementation serves each shape), named by
:func:`flashtune.db.exchange.choice_file_name`; ``-o FILE.json`` takes exactly one.
``--template`` alone exports only template files, ``--op`` alone only op choice files,
both: both, filtered.

``--format vllm`` writes vLLM-style files instead: one per device x template x (dtype,
head_dim, causal), each a flat JSON object from a shape key to a config (see
:mod:`flashtune.db.exchange_vllm`). That format carries per-template Triton configs only:
op choices are never in it (the command says how many were left out).

``import`` reads and validates EVERY file (template files and op choice files alike) before
it opens the database: one rejection is a one-line error, exit 1, and nothing is written. Then all documents go in one
transaction, and the per-file report is printed. See :mod:`flashtune.db.exchange`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import click

from flashtune.cli.options import (
    db_url,
    device_filter_option,
    fail,
    op_filter_option,
    template_filter_option,
)

__all__ = ["FORMATS", "POLICIES", "export_command", "import_command"]

# flashtune.db.store.IMPORT_POLICIES, spelled out so --help imports no database code
# (tests/cli_tests/test_exchange_commands.py checks that the two agree)
POLICIES = ("keep-faster", "overwrite", "skip")
FORMATS = ("flashtune", "vllm")


def _to_single_file(output: Path) -> bool:
    """Whether ``-o`` names one ``.json`` file (else a directory, created when missing)."""
    if output.is_dir():
        return False
    if output.suffix.lower() == ".json":
        return True
    if output.exists():
        raise click.BadParameter(f"{output} exists and is not a directory; expected a "
                                 "directory or a path ending in .json", param_hint="'-o'")
    return False


def _write(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file, so a reader never sees half."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _entries(n: int) -> str:
    return f"{n} entr{'y' if n == 1 else 'ies'}"


@click.command("export")
@device_filter_option
@template_filter_option
@op_filter_option("Only the op choices of this user op (with --template too: both kinds).")
@click.option("-o", "--output", required=True, metavar="PATH",
              type=click.Path(dir_okay=True, file_okay=True, path_type=Path),
              help="A directory (one file per device and template, and per device and op) "
                   "or one FILE.json.")
@click.option("--format", "fmt", type=click.Choice(FORMATS), default="flashtune",
              show_default=True,
              help="flashtune: validated documents that `flashtune import` and "
                   "$FLASHTUNE_CONFIG_DIR read; vllm: vLLM-style files, one per device, "
                   "template, dtype, head_dim and causal, mapping shape keys to configs "
                   "(Triton configs only: op choices are not exported).")
@click.pass_context
def export_command(ctx: click.Context, device: str | None, template: str | None,
                   op: str | None, output: Path, fmt: str) -> None:
    """Export best configs and op choices as per-device JSON files (database opened
    read-only).

    Only configs tuned for the current template sources, and op choices whose winner was
    decided at its current source, are written (older ones would never be served); an SDPA
    backend's choices keep the torch and cuDNN they were timed with, whatever this
    machine's, and each reader judges them against its own. -o DIR
    writes one file per device and template and one per device and op (with --format vllm:
    per device, template, dtype, head_dim and causal; the vLLM format carries Triton
    configs only, never op choices); -o FILE.json needs exactly one.
    """
    from flashtune.core.errors import FlashtuneError
    from flashtune.db import open_store
    from flashtune.db.engine import default_db_url, missing_sqlite_file, safe_url
    from flashtune.db.exchange import (
        choice_document_to_json,
        document_to_json,
        export_choice_documents,
        export_documents,
    )
    from flashtune.db.exchange_vllm import vllm_files, vllm_to_json
    from flashtune.kernel_templates import catalog

    if fmt == "vllm" and op is not None:
        raise click.UsageError("--op selects op choice files, which the vLLM format does not "
                               "carry (Triton configs only); drop --op or use --format "
                               "flashtune")
    single = _to_single_file(output)
    url = db_url(ctx) or default_db_url(create=False)
    missing = missing_sqlite_file(url)
    if missing is not None:
        click.echo(f"nothing to export (database {missing} does not exist yet)")
        return
    templates = op is None or template is not None
    ops = template is None or op is not None
    try:
        specs = catalog()
        with open_store(url, read_only=True, create=False) as store:
            docs = export_documents(store, specs=specs, device_name=device,
                                    template_name=template) if templates else []
            choices = export_choice_documents(store, specs=specs, device_name=device,
                                              op=op) if ops else []
        # (file name, text, entries) per file to write
        if fmt == "flashtune":
            files = [(d.file_name(), document_to_json(d), len(d.entries)) for d in docs]
            files += [(c.file_name(), choice_document_to_json(c), len(c.entries))
                      for c in choices]
            files.sort(key=lambda f: f[0])
        else:  # Triton templates only: op choices and other kinds' configs are left out
            triton = [d for d in docs if specs[d.template].kind == "triton"]
            files = [(f.name, vllm_to_json(f), len(f.configs)) for f in vllm_files(triton)]
    except (FlashtuneError, ValueError) as exc:
        raise fail(exc) from exc
    left_out = (sum(len(c.entries) for c in choices),
                sum(len(d.entries) for d in docs if specs[d.template].kind != "triton")) \
        if fmt == "vllm" else (0, 0)
    if not files:
        filters = "".join(f" {k}={v}" for k, v in (("device", device), ("template", template),
                                                    ("op", op)) if v)
        what = ("no best configs tuned for the current template sources" if templates else
                "no op choices decided for the current implementation sources")
        click.echo(f"nothing to export from {safe_url(url)}: {what}"
                   f"{filters and ' matching' + filters}")
        _note_left_out(left_out)
        return
    if single and len(files) != 1:
        names = ", ".join(name for name, _, _ in files)
        raise click.UsageError(f"-o {output} names one .json file but there are {len(files)} "
                               f"documents ({names}); pass a directory to write one file each")
    try:
        if single:
            output.parent.mkdir(parents=True, exist_ok=True)
        else:
            output.mkdir(parents=True, exist_ok=True)
        for name, text, n in files:
            path = output if single else output / name
            _write(path, text)
            click.echo(f"wrote {path} ({_entries(n)})")
    except OSError as exc:
        raise fail(exc) from exc
    _note_left_out(left_out)


def _note_left_out(left_out: tuple[int, int]) -> None:
    """What ``--format vllm`` did not write: op choices, and best configs of
    implementations that are not Triton templates."""
    choices, others = left_out
    parts = [f"{n} {one if n == 1 else many}" for n, one, many in
             ((choices, "op choice", "op choices"),
              (others, "config of a non-Triton implementation",
               "configs of non-Triton implementations")) if n]
    if parts:
        click.echo(f"vLLM format carries Triton configs only; {' and '.join(parts)} not "
                   "exported (use --format flashtune for them)")


def _json_files(paths: Sequence[Path]) -> list[Path]:
    """The files named, a directory standing for its ``*.json`` files (sorted); each once."""
    files: list[Path] = []
    for path in paths:
        if path.is_dir():
            found = sorted(p for p in path.glob("*.json") if p.is_file())
            if not found:
                raise click.BadParameter(f"directory {path} holds no *.json files",
                                         param_hint="'PATH...'")
            files.extend(found)
        else:
            files.append(path)
    seen: set[Path] = set()
    unique = []
    for path in files:
        if path.resolve() not in seen:
            seen.add(path.resolve())
            unique.append(path)
    return unique


@click.command("import")
@click.argument("paths", nargs=-1, required=True, metavar="PATH...",
                type=click.Path(exists=True, path_type=Path))
@click.option("--policy", type=click.Choice(POLICIES), default="keep-faster",
              show_default=True,
              help="Where a problem already has a best config (or an op choice): keep the "
                   "faster one, overwrite it, or skip the imported one.")
@click.pass_context
def import_command(ctx: click.Context, paths: tuple[Path, ...], policy: str) -> None:
    """Import exported config files and op choice files, all or nothing.

    A directory stands for its *.json files. Every file is validated first: one bad file
    (an op choice naming an implementation this flashtune does not know, a config outside
    its implementation's space...) writes nothing. Then all are written in one
    transaction.
    """
    from flashtune.core.errors import FlashtuneError
    from flashtune.db import open_store
    from flashtune.db.exchange import import_documents, read_document
    from flashtune.kernel_templates import catalog

    files = _json_files(paths)
    try:
        specs = catalog()
        docs: list[tuple[str, Any]] = [(str(p), read_document(p, specs=specs)) for p in files]
        with open_store(db_url(ctx)) as store:
            report = import_documents(store, docs, specs=specs, policy=policy)
    except (FlashtuneError, ValueError) as exc:
        raise fail(exc) from exc
    for line in report.lines():
        click.echo(line)
