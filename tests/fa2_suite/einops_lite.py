"""``einops.rearrange`` and ``einops.repeat`` for torch tensors, for FlashAttention-2's test
file and its vendored helpers where the einops package is missing (the GPU machine has no
network). ``tests/fa2_suite/conftest.py`` installs it as ``einops`` only when
``import einops`` fails.

Patterns as einops writes them: axis names, parenthesised groups (``(b s)``), one ellipsis
(``...``, alone or as ``(...)`` on the right), and integer literals: a unit axis ``1``, or on
the right of ``repeat`` an anonymous new axis such as ``(2 d)``. Sizes of composed axes come
from the tensor (at most one unknown per group) or from keyword arguments; ``repeat`` takes
the sizes of its new axes there. No reductions, no lists of tensors.
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["rearrange", "repeat"]

_ELLIPSIS = "..."


class EinopsError(ValueError):
    """A pattern this stand-in cannot read, or sizes that do not fit it."""


def _groups(side: str) -> list[tuple[list[str], bool]]:
    """``[(tokens, parenthesised), ...]`` of one side of a pattern."""
    out: list[tuple[list[str], bool]] = []
    current: list[str] | None = None
    for tok in side.replace("(", " ( ").replace(")", " ) ").split():
        if tok == "(":
            if current is not None:
                raise EinopsError(f"nested parentheses in {side!r}")
            current = []
        elif tok == ")":
            if current is None:
                raise EinopsError(f"unbalanced ')' in {side!r}")
            out.append((current, True))
            current = None
        elif current is not None:
            current.append(tok)
        else:
            out.append(([tok], False))
    if current is not None:
        raise EinopsError(f"unbalanced '(' in {side!r}")
    return out


def _transform(tensor: torch.Tensor, pattern: str, lengths: dict[str, int],
               new_axes: bool) -> torch.Tensor:
    if pattern.count("->") != 1:
        raise EinopsError(f"pattern {pattern!r} must have one '->'")
    left_text, right_text = pattern.split("->")
    left, right = _groups(left_text), _groups(right_text)
    sizes: dict[Any, int] = dict(lengths)
    n_ell = 0
    if any(_ELLIPSIS in toks for toks, _ in left):
        n_ell = tensor.dim() - (len(left) - 1)
    elif len(left) != tensor.dim():
        raise EinopsError(f"pattern {left_text.strip()!r} has {len(left)} axes, the tensor "
                          f"{tensor.dim()} (shape {tuple(tensor.shape)})")
    # the input's elementary axes, with their sizes
    elementary: list[Any] = []
    dims = iter(tensor.shape)
    for position, (toks, _) in enumerate(left):
        if toks == [_ELLIPSIS]:
            for j in range(n_ell):
                sizes[(_ELLIPSIS, j)] = next(dims)
                elementary.append((_ELLIPSIS, j))
            continue
        size = next(dims)
        names: list[Any] = []
        for tok in toks:
            if tok.isdigit():
                name: Any = ("#left", position, len(names))
                sizes[name] = int(tok)
            else:
                name = tok
            names.append(name)
        unknown = [n for n in names if n not in sizes]
        known = math.prod(sizes[n] for n in names if n in sizes)
        if len(unknown) > 1:
            raise EinopsError(f"cannot split axis of size {size} into {toks}: sizes unknown")
        if unknown:
            sizes[unknown[0]] = size // known if known else 0
        if math.prod(sizes[n] for n in names) != size:
            raise EinopsError(f"axis of size {size} does not split into {toks} "
                              f"{[sizes[n] for n in names]}")
        elementary.extend(names)
    x = tensor.reshape([sizes[n] for n in elementary])
    # unit literals on the left are dropped
    kept = [n for n in elementary if not (isinstance(n, tuple) and n[0] == "#left")]
    if any(sizes[n] != 1 for n in elementary if n not in kept):
        raise EinopsError(f"a literal axis on the left of {pattern!r} is not of size 1")
    x = x.reshape([sizes[n] for n in kept])
    # the output's elementary axes, groups remembered
    out_axes: list[Any] = []
    out_groups: list[list[Any]] = []
    for position, (toks, grouped) in enumerate(right):
        group: list[Any] = []
        for tok in toks:
            if tok == _ELLIPSIS:
                names = [(_ELLIPSIS, j) for j in range(n_ell)]
                if grouped:
                    group.extend(names)
                else:
                    out_groups.extend([n] for n in names)
                out_axes.extend(names)
                continue
            if tok.isdigit():
                name = ("#right", position, len(group))
                sizes[name] = int(tok)
            else:
                name = tok
                if name not in kept:
                    if not new_axes:
                        raise EinopsError(f"axis {name!r} is not on the left of {pattern!r}")
                    if name not in sizes:
                        raise EinopsError(f"repeat needs the size of new axis {name!r}")
            group.append(name)
            out_axes.append(name)
        if group or grouped:
            out_groups.append(group)
    missing = [n for n in kept if n not in out_axes]
    if missing:
        raise EinopsError(f"axes {missing} of the left are missing on the right of {pattern!r}")
    existing = [n for n in out_axes if n in kept]
    x = x.permute([kept.index(n) for n in existing])
    x = x.reshape([sizes[n] if n in kept else 1 for n in out_axes])
    x = x.expand([sizes[n] for n in out_axes])
    return x.reshape([math.prod(sizes[n] for n in g) for g in out_groups])


def rearrange(tensor: torch.Tensor, pattern: str, **axes_lengths: int) -> torch.Tensor:
    """``einops.rearrange``: transpose, split and merge axes (plus unit axes)."""
    return _transform(tensor, pattern, axes_lengths, new_axes=False)


def repeat(tensor: torch.Tensor, pattern: str, **axes_lengths: int) -> torch.Tensor:
    """``einops.repeat``: ``rearrange`` that may add axes, named (their sizes as keyword
    arguments) or literal, copying the data along them."""
    return _transform(tensor, pattern, axes_lengths, new_axes=True)
