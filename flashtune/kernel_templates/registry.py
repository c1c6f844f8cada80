"""The implementation registry: one frozen :class:`~flashtune.core.spec.TemplateSpec` per
kernel implementation, and the one extension point.

A new kernel is a new folder of :mod:`flashtune.kernel_templates`, named as the template,
whose ``__init__.py`` makes one :func:`register_template` call. The registry finds those
folders itself and imports them (torch and triton with them) on the first question it is
asked; :func:`known_names` answers from the folder names alone, without importing a kernel,
for ``--help``. Implementations from elsewhere (a plugin, a test) call
:func:`register_template` directly. Everything that lists templates (CLI choices, export and
import checks, precompilation, reports, benchmarks) asks :func:`catalog` or
:func:`template_names`. An unknown name raises :class:`UnknownTemplateError` listing the
known ones.
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import io
import threading
import tokenize
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import MappingProxyType

from flashtune.core.errors import UnknownTemplateError
from flashtune.core.spec import TemplateSpec

__all__ = ["Catalog", "TemplateSpec", "catalog", "get_template", "hash_files", "implementations",
           "known_names", "register_template", "source_hash", "template_names", "train_step",
           "unregister_template"]

_REGISTRY: dict[str, TemplateSpec] = {}
_PACKAGE = Path(__file__).resolve().parent  # flashtune/kernel_templates
_PACKAGE_NAME = "flashtune.kernel_templates"
_LOAD_LOCK = threading.RLock()
_loaded = False


def _builtin_folders() -> list[str]:
    """The template folders of the package: those whose ``__init__.py`` registers one."""
    return sorted(d.name for d in _PACKAGE.iterdir()
                  if (d / "__init__.py").is_file()
                  and "register_template(" in (d / "__init__.py").read_text())


def _load_builtins() -> None:
    """Import every template folder once (each registers its spec on import)."""
    global _loaded
    if _loaded:
        return
    with _LOAD_LOCK:
        if _loaded:
            return
        for name in _builtin_folders():
            importlib.import_module(f"{_PACKAGE_NAME}.{name}")
            if name not in _REGISTRY:
                raise RuntimeError(f"{_PACKAGE_NAME}.{name} registers no template named "
                                   f"{name!r}; a template folder is named as its template")
        _loaded = True


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
    rest = sorted(seen[len(given):], key=_label)
    return given + rest


def _label(path: Path) -> str:
    """How a file enters the hash: its path inside the package (a file elsewhere, e.g. a
    plugin's, by its name), so the hash does not depend on where flashtune is installed."""
    return path.relative_to(_PACKAGE).as_posix() if path.is_relative_to(_PACKAGE) else path.name


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
        h.update(_label(path).encode())
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

    Arguments:
        name: a registered template's name.
    Returns:
        The spec that was registered under it.
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
    spec = _REGISTRY.get(name)
    if spec is not None:
        return spec
    _load_builtins()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UnknownTemplateError(
            f"unknown template {name!r}; known templates: {', '.join(sorted(_REGISTRY)) or 'none'}"
        ) from None


def template_names() -> list[str]:
    """The names of every registered template.

    Returns:
        The registry keys, sorted (the package's template folders are imported first).
    """
    _load_builtins()
    return sorted(_REGISTRY)


def known_names() -> list[str]:
    """The template names known without importing any kernel (for ``--help``;
    :func:`template_names` is the authority).

    Returns:
        The package's template folders and whatever is registered already, sorted.
    """
    return sorted(set(_builtin_folders()) | set(_REGISTRY))


class Catalog(Mapping[str, TemplateSpec]):
    """A read-only live view of the registry, name -> spec, that also answers
    :meth:`for_op` (:func:`~flashtune.core.spec.op_implementations` asks it)."""

    def __init__(self) -> None:
        self._view = MappingProxyType(_REGISTRY)

    def __getitem__(self, name: str) -> TemplateSpec:
        return self._view[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._view)

    def __len__(self) -> int:
        return len(self._view)

    def for_op(self, op: str) -> dict[str, TemplateSpec]:
        """The implementations of the user op ``op``, name -> spec (:func:`implementations`)."""
        return {spec.name: spec for spec in implementations(op)}


def catalog() -> Catalog:
    """The registry as a read-only mapping: what layers that may not import the kernels (the
    store's export and import checks) are handed; its ``for_op(op)`` gives an op's
    implementations as the tuner and the router see them (a training step's spec).

    Returns:
        name -> :class:`TemplateSpec` of every registered template (a live view).
    """
    _load_builtins()
    return Catalog()


def implementations(op: str) -> list[TemplateSpec]:
    """The implementations the tuner searches across for the user op ``op`` and the router
    chooses between: every registered spec whose ``serves`` names it; for ``train``, each
    one's training step (:func:`train_step`: the forward
    paired with its backward, under the forward's name).

    Arguments:
        op: one of :data:`~flashtune.core.spec.USER_OPS` (``"fwd"``, ``"train"``,
            ``"decode"``).
    Returns:
        Their specs, sorted by name.
    Raises:
        ValueError for an unknown op.
    """
    from flashtune.core.spec import USER_OPS

    if op not in USER_OPS:
        raise ValueError(f"unknown op {op!r}; the ops are {', '.join(USER_OPS)}")
    _load_builtins()
    specs = [spec for _, spec in sorted(_REGISTRY.items()) if op in spec.serves]
    return [train_step(s) for s in specs] if op == "train" else specs


def train_step(spec: TemplateSpec) -> TemplateSpec:
    """The training step of the forward ``spec`` (a forward and the backward template it
    names, or an extern's step through torch's autograd):
    :func:`flashtune.kernel_templates.training.train_spec` with the backward looked up here.

    Raises:
        ValueError when ``spec`` does not serve ``train``; KeyError for an unknown backward.
    """
    from flashtune.kernel_templates.training import train_spec

    return train_spec(spec, get_template(spec.backward) if spec.backward else None)
