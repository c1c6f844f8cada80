"""The package's layering, read from the source (AST), so it cannot silently come back.

Layers, lowest first (``STYLE.md``): ``core``; ``kernel_templates`` and ``db`` beside each
other; ``autotune``; ``runtime`` and ``report``; ``integrations``; ``cli``. STYLE.md puts
``cli`` and ``integrations`` side by side; here the CLI sits one above, because ``flashtune
bench --model`` drives a transformers model through the integration (an integration never
imports the CLI, so importing one never pulls click in). A module
imports only from its own package or from a lower layer (siblings of one layer do not import
each other), and no modules import each other in a circle. Imports anywhere count: function
bodies and ``TYPE_CHECKING`` blocks too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "flashtune"

# subpackage -> layer; top-level modules (flashtune/__init__.py, _version.py, __main__.py)
# are listed one by one
LAYERS = {
    "_version": 0, "core": 0,
    "kernel_templates": 1, "db": 1,
    "autotune": 2,
    "runtime": 3, "report": 3,
    "integrations": 4,
    "cli": 5,
    "__init__": 6, "__main__": 6,
    # FlashAttention-2's import path, a thin re-export of integrations/flash_attn.py
    "flash_attn_interface": 6,
}
# what a top-level module may import besides lower layers
TOP = {"__init__", "__main__", "flash_attn_interface"}


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The flashtune modules ``name`` imports (``from x import y`` counts ``x.y`` when that
    is a module, else ``x``)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in known else module
                       for a in node.names]
        for t in targets:
            while t and t not in known and "." in t:
                t = t.rpartition(".")[0]
            if t in known and t != name:
                found.add(t)
    return found


def room(module: str) -> str:
    """The subpackage (or top-level module) a module lives in."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {m: imports_of(m, p, known) for m, p in mods.items()}


def violations(g: dict[str, set[str]]) -> list[str]:
    bad = []
    for m, targets in sorted(g.items()):
        src = room(m)
        for t in sorted(targets):
            dst = room(t)
            if dst == src or t == "flashtune":
                if t == "flashtune" and m != "flashtune":
                    bad.append(f"{m} imports the top-level package flashtune")
                continue
            if src not in LAYERS or dst not in LAYERS:
                bad.append(f"{m} -> {t}: {src if src not in LAYERS else dst} has no layer")
            elif LAYERS[dst] >= LAYERS[src]:
                how = "a sibling" if LAYERS[dst] == LAYERS[src] else "a higher layer"
                bad.append(f"{m} ({src}) imports {t} ({dst}), {how}")
    return bad


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def test_every_subpackage_has_a_layer():
    rooms = {room(m) for m in modules()}
    assert rooms <= set(LAYERS), sorted(rooms - set(LAYERS))


def test_no_import_runs_upward_or_sideways():
    assert violations(graph()) == []


def test_no_modules_import_each_other_in_a_circle():
    # within a package, __init__ re-exporting its modules is not a circle unless a module
    # imports the package back
    assert cycles(graph()) == []


@pytest.mark.parametrize("edge,expected", [
    (("flashtune.db.store", "flashtune.kernel_templates.registry"), "a sibling"),
    (("flashtune.core.problem", "flashtune.autotune.jobs"), "a higher layer"),
])
def test_the_checker_sees_a_violation(edge, expected):
    g = graph()
    src, dst = edge
    g[src] = set(g[src]) | {dst}
    assert any(expected in v and src in v for v in violations(g))


def test_the_checker_sees_a_circle():
    g = graph()
    g["flashtune.core.errors"] = set(g["flashtune.core.errors"]) | {"flashtune.core.spec"}
    assert any("flashtune.core.errors" in c for c in cycles(g))
