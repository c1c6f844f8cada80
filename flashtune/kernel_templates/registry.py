"""The implementation registry: one frozen :class:`~flashtune.core.spec.TemplateSpec` per
kernel implementation, and the one extension point.

Templates register themselves on import of :mod:`flashtune.kernel_templates`; a new kernel
is a new folder plus one :func:`register_template` call. Everything that lists templates
(CLI choices, export and import checks, precompilation, reports) asks :func:`catalog` or
:func:`template_names`. An unknown name raises :class:`UnknownTemplateError` listing the
known ones.
"""

from __future__ import annotations

import ast
import hashlib
import io
import tokenize
from pathlib import Path
from types import MappingProxyType
from typing import Iterator, Mapping

from flashtune.core.errors import UnknownTemplateError
from flashtune.core.spec import TemplateSpec

__all__ = ["TemplateSpec", "catalog", "get_template", "hash_files", "register_template",
           "source_hash", "template_names", "unregister_template"]

_REGISTRY: dict[str, TemplateSpec] = {}
_PACKAGE = Path(__file__).resolve().parent  # flashtune/kernel_templates
_PACKAGE_NAME = "flashtune.kernel_templates"


def _docstring_lines(tree: ast.AST) -> set[int]:
    """The source lines of every module, class and function docstring."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                doc = body[0]
                lines.update(range(doc.lineno, (doc.end_lineno or doc.lineno) + 1))
    return lines


def _tokens(text: str) -> Iterator[str]:
    """The code tokens of ``text``: no comments, no docstrings, no layout beyond the block
    structure, and f-strings as their source text (so CPython 3.11 and 3.12, which tokenize
    f-strings differently, give the same stream)."""
    doc_lines = _docstring_lines(ast.parse(text))
    lines = text.splitlines(keepends=True)
    toks = list(tokenize.generate_tokens(io.StringIO(text).readline))
    i = 0
    while i < len(toks):
        tok = toks[i]
        name = tokenize.tok_name[tok.type]
        if name == "FSTRING_START":  # 3.12+: gather the whole f-string's source text
            depth, j = 1, i + 1
            while depth:
                kind = tokenize.tok_name[toks[j].type]
                depth += (kind == "FSTRING_START") - (kind == "FSTRING_END")
                j += 1
            (r0, c0), (r1, c1) = tok.start, toks[j - 1].end
            if r0 == r1:
                yield lines[r0 - 1][c0:c1]
            else:
                yield lines[r0 - 1][c0:] + "".join(lines[r0:r1 - 1]) + lines[r1 - 1][:c1]
            i = j
            continue
        i += 1
        if name in ("COMMENT", "NL", "ENCODING", "ENDMARKER", "TYPE_COMMENT"):
            continue
        if name == "STRING" and tok.start[0] in doc_lines:
            continue
        if name in ("NEWLINE", "INDENT", "DEDENT"):
            yield f"<{name[0]}>"
        else:
            yield tok.string


def _normalized(text: str) -> str:
    out: list[str] = []
    for tok in _tokens(text):
        if tok == "<N>" and out and out[-1] in ("<N>", "<I>", "<D>"):
            continue  # a docstring's own line leaves an empty statement behind
        out.append(tok)
    return "\x00".join(out)


def _local_imports(path: Path) -> list[Path]:
    """The files of :mod:`flashtune.kernel_templates` that ``path`` imports (anywhere in it,
    function bodies included): the helpers its code calls."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                and node.module.startswith(_PACKAGE_NAME + "."):
            rel = node.module[len(_PACKAGE_NAME) + 1:].split(".")
            for candidate in (_PACKAGE.joinpath(*rel).with_suffix(".py"),
                              _PACKAGE.joinpath(*rel, "__init__.py")):
                if candidate.is_file():
                    found.append(candidate)
                    break
    return found


def hash_files(*paths: str | Path) -> list[Path]:
    """The files a source hash covers: ``paths`` and, transitively, every module of
    :mod:`flashtune.kernel_templates` they import, in a fixed order (the given files first,
    then the rest sorted by path)."""
    given = [Path(p).resolve() for p in paths]
    seen = list(given)
    todo = list(given)
    while todo:
        for dep in _local_imports(todo.pop()):
            if dep not in seen:
                seen.append(dep)
                todo.append(dep)
    rest = sorted(seen[len(given):], key=lambda p: p.relative_to(_PACKAGE).as_posix())
    return given + rest


def source_hash(*paths: str | Path) -> str:
    """Hash of the code that decides a template's generated kernels.

    Covers ``paths`` (the kernel and its launcher) and every helper module of
    :mod:`flashtune.kernel_templates` they import (:func:`hash_files`). What is hashed is
    the token stream without comments, docstrings and formatting, so editing those keeps
    tuned configs current; any change to the code makes them stale.

    Arguments:
        paths: the files that decide the generated code, in a fixed order.
    Returns:
        The first 16 hex characters of the sha256.
    Raises:
        OSError when a file cannot be read; SyntaxError when one does not parse.
    """
    h = hashlib.sha256()
    for path in hash_files(*paths):
        h.update(path.relative_to(_PACKAGE).as_posix().encode())
        h.update(b"\x01")
        h.update(_normalized(path.read_text()).encode())
        h.update(b"\x02")
    return h.hexdigest()[:16]


def register_template(spec: TemplateSpec) -> TemplateSpec:
    """Add ``spec`` to the registry under ``spec.name`` (a template package does this on
    import).

    Arguments:
        spec: the template's frozen :class:`TemplateSpec`.
    Returns:
        ``spec``, so a module can keep it: ``SPEC = register_template(TemplateSpec(...))``.
    Raises:
        ValueError when another spec is already registered under that name (registering an
        equal spec again is a no-op).
    """
    existing = _REGISTRY.get(spec.name)
    if existing is not None and existing != spec:
        raise ValueError(f"template {spec.name!r} is already registered")
    _REGISTRY[spec.name] = spec
    return spec


def unregister_template(name: str) -> TemplateSpec:
    """Remove the template ``name`` (tests that register a toy implementation undo it).

    Raises:
        UnknownTemplateError when no template is registered under ``name``.
    """
    spec = get_template(name)
    del _REGISTRY[name]
    return spec


def get_template(name: str) -> TemplateSpec:
    """The registered template ``name``.

    Arguments:
        name: a registry key such as ``"attn_fwd"``, ``"attn_bwd"`` or ``"attn_decode"``.
    Returns:
        Its :class:`TemplateSpec`.
    Raises:
        UnknownTemplateError (a ``KeyError``) naming the known templates.
    """
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UnknownTemplateError(
            f"unknown template {name!r}; known templates: {', '.join(sorted(_REGISTRY)) or 'none'}"
        ) from None


def template_names() -> list[str]:
    """The names of every registered template, sorted."""
    return sorted(_REGISTRY)


def catalog() -> Mapping[str, TemplateSpec]:
    """A read-only view of the registry, name -> spec: what layers that may not import the
    kernels (the store's export and import checks) are handed."""
    return MappingProxyType(_REGISTRY)
