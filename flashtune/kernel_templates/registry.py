"""The template registry: one frozen :class:`TemplateSpec` per kernel family.

Templates register themselves on import of :mod:`flashtune.kernel_templates`; look them up
with :func:`get_template`. An unknown name raises :class:`UnknownTemplateError` listing the
known ones.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from flashtune.autotune.spaces import Config, SearchSpace
from flashtune.errors import UnknownTemplateError


@dataclass(frozen=True)
class TemplateSpec:
    """Everything the tuner and the dispatcher need to know about one kernel family.

    Attributes:
        name: registry key, e.g. ``"attn_fwd"``.
        source_hash: sha256 (16 hex chars) of the files that decide the generated code;
            configs tuned under another hash are stale.
        launcher: ``launcher(*inputs, config, **options)`` runs the kernel.
        reference: ``reference(*inputs, **options)`` in float64/float32.
        space: the search space and its validity predicate.
        default_config: ``default_config(problem, device) -> Config``.
        kernel: the ``@triton.jit`` entry point (for precompilation).
        tunable: whether ``flashtune tune`` has a candidate runner for it.
        make_case: ``make_case(problem, device, *, torch_device, generator, launcher,
            check_slice) -> flashtune.autotune.runners.Case``: the tuner's inputs, the check
            of a launch against the reference and the FLOP count, for templates whose launch
            is not the forward's ``launcher(q, k, v, config, causal=)`` (None: that one).
    """

    name: str
    source_hash: str
    launcher: Callable[..., Any]
    reference: Callable[..., Any]
    space: SearchSpace
    default_config: Callable[[Any, Any], Config]
    kernel: Any = None
    tunable: bool = True
    make_case: Callable[..., Any] | None = None


_REGISTRY: dict[str, TemplateSpec] = {}


def source_hash(*paths: str | Path) -> str:
    """Hash of the given source files' bytes, in order.

    Arguments:
        paths: the files that decide a template's generated code, in a fixed order.
    Returns:
        The first 16 hex characters of the sha256 of their bytes.
    Raises:
        OSError when a file cannot be read.
    """
    h = hashlib.sha256()
    for path in paths:
        h.update(Path(path).read_bytes())
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
    """The names of every registered template.

    Returns:
        The registry keys, sorted.
    """
    return sorted(_REGISTRY)
