"""The public API is typed and documented (issue 9): ``py.typed`` ships, mypy is clean on the
package with the configuration in ``pyproject.toml`` (``mypy --strict`` flags on the public
modules), and every public function and class has a docstring in the codebase's style.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

import flashtune

PACKAGE = Path(flashtune.__file__).resolve().parent
PYPROJECT = PACKAGE.parent / "pyproject.toml"

# the modules users import; every function and class in their __all__ is public API
PUBLIC_MODULES = (
    "flashtune",
    "flashtune.runtime",
    "flashtune.runtime.kvcache",
    "flashtune.runtime.lookup",
    "flashtune.runtime.sdpa",
    "flashtune.db",
    "flashtune.db.exchange",
    "flashtune.autotune.jobs",
    "flashtune.kernel_templates",
    "flashtune.integrations.transformers",
)
# public names of modules without an __all__
PUBLIC_EXTRA = (("flashtune.core.problem", "AttentionProblem"),)


def _load_toml(path: Path) -> dict[str, Any]:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - 3.10
        import tomli as tomllib
    with open(path, "rb") as f:
        return tomllib.load(f)


def _public_objects() -> list[tuple[str, Any]]:
    out = []
    for module_name in PUBLIC_MODULES:
        if module_name == "flashtune.integrations.transformers":
            try:
                import transformers  # noqa: F401
            except ImportError:
                continue
        module = importlib.import_module(module_name)
        for name in module.__all__:
            obj = getattr(module, name)
            if inspect.isclass(obj) or callable(obj):  # constants carry no docstring
                out.append((f"{module_name}.{name}", obj))
    for module_name, name in PUBLIC_EXTRA:
        out.append((f"{module_name}.{name}", getattr(importlib.import_module(module_name), name)))
    return out


def _own_doc(obj: Any) -> str:
    """The object's own docstring: not a base class's, not a dataclass's generated
    signature."""
    if inspect.isclass(obj):
        doc = obj.__dict__.get("__doc__") or ""
        if dataclasses.is_dataclass(obj) and doc.startswith(obj.__name__ + "("):
            doc = ""
        return doc.strip()
    return (getattr(obj, "__doc__", None) or "").strip()


def test_py_typed_ships() -> None:
    assert (PACKAGE / "py.typed").is_file(), "flashtune/py.typed is missing"
    if not PYPROJECT.is_file():
        pytest.skip("not a source checkout (no pyproject.toml next to the package)")
    package_data = _load_toml(PYPROJECT)["tool"]["setuptools"]["package-data"]["flashtune"]
    assert "py.typed" in package_data, "pyproject.toml's package-data must list py.typed"


def test_mypy_clean() -> None:
    api = pytest.importorskip("mypy.api", reason="mypy is not installed (the test extra has it)")
    if not PYPROJECT.is_file():
        pytest.skip("not a source checkout (no pyproject.toml next to the package)")
    # a cache that outlives the session: a cold run checks torch's stubs too (~40 s), a
    # warm one takes seconds
    version = f"{sys.version_info[0]}{sys.version_info[1]}"
    cache = Path(tempfile.gettempdir()) / f"flashtune-mypy-cache-py{version}"
    stdout, stderr, status = api.run(["--config-file", str(PYPROJECT), "--cache-dir", str(cache),
                                      "--no-pretty", "--show-error-codes", str(PACKAGE)])
    errors = [line for line in stdout.splitlines() if ": error:" in line]
    assert status == 0 and not errors, (
        f"mypy found {len(errors)} error(s) in flashtune (pyproject.toml's [tool.mypy]):\n"
        + "\n".join(errors or stdout.splitlines()) + ("\n" + stderr if stderr else ""))


def test_public_names_have_docstrings() -> None:
    missing = [name for name, obj in _public_objects() if not _own_doc(obj)]
    assert not missing, f"public names without a docstring: {', '.join(missing)}"


def test_public_methods_have_docstrings() -> None:
    """Public methods of public classes: their own docstring or the one they override."""
    missing = []
    for name, cls in _public_objects():
        if not inspect.isclass(cls) or not cls.__module__.startswith("flashtune"):
            continue
        for attr, value in vars(cls).items():
            if attr.startswith("_"):
                continue
            func = value.__func__ if isinstance(value, (staticmethod, classmethod)) else value
            if isinstance(func, property):
                func = func.fget
            if inspect.isfunction(func) and not inspect.getdoc(getattr(cls, attr)):
                missing.append(f"{name}.{attr}")
    assert not missing, f"public methods without a docstring: {', '.join(missing)}"


def test_public_functions_document_arguments_and_returns() -> None:
    """Google style, as :func:`flashtune.attention`: an ``Arguments:`` (or ``Args:``)
    section when the function takes public arguments, ``Returns:`` unless it returns
    None."""
    bad = []
    for name, obj in _public_objects():
        if not inspect.isfunction(obj) or not obj.__module__.startswith("flashtune"):
            continue
        doc = inspect.getdoc(obj) or ""
        params = [p for p in inspect.signature(obj).parameters if not p.startswith("_")]
        if params and "Arguments:" not in doc and "Args:" not in doc:
            bad.append(f"{name} (no Arguments: section)")
        if obj.__annotations__.get("return") not in ("None", None) and "Returns:" not in doc:
            bad.append(f"{name} (no Returns: section)")
    assert not bad, "public functions with incomplete docstrings: " + ", ".join(bad)
