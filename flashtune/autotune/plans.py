"""Tuning plans: a TOML file listing the shapes ``flashtune tune --plan FILE`` tunes.

Format::

    [[shape]]
    batch = 4
    heads = 32          # query heads
    kv_heads = 8        # optional, default: heads (MHA)
    seqlen = 4096       # query length
    kv_seqlen = 4096    # optional, default: seqlen
    head_dim = 128
    causal = true       # optional, default: false
    dtype = "bf16"      # optional, default: "bf16"; "fp16" or "bf16"
    window = [4095, 0]  # optional: FlashAttention-2's window_size (left, right), -1 unbounded
    softcap = 50.0      # optional: logit softcap (Gemma-2)
    alibi = true        # optional: ALiBi slopes (random ones when tuning)

Every error is a :class:`PlanError` naming the file, the entry (``shape[2]``, 1-based) and
the field. Light to import: no torch or triton.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from flashtune.core.errors import FlashtuneError
from flashtune.core.problem import DTYPES, AttentionProblem

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = ["PlanError", "load_plan", "parse_plan"]

_INT_FIELDS = ("batch", "heads", "kv_heads", "seqlen", "kv_seqlen", "head_dim")
_REQUIRED = ("batch", "heads", "seqlen", "head_dim")
_FIELDS = (*_INT_FIELDS, "causal", "dtype", "window", "softcap", "alibi")


class PlanError(FlashtuneError, ValueError):
    """A plan file that cannot be read or has an invalid entry."""


def _shape(where: str, entry: Any) -> AttentionProblem:
    if not isinstance(entry, Mapping):
        raise PlanError(f"{where}: expected a table, got {type(entry).__name__}")
    unknown = sorted(set(entry) - set(_FIELDS))
    if unknown:
        raise PlanError(f"{where}: unknown field(s) {', '.join(unknown)}; "
                        f"allowed: {', '.join(_FIELDS)}")
    for name in _REQUIRED:
        if name not in entry:
            raise PlanError(f"{where}: missing required field '{name}'")
    for name in _INT_FIELDS:
        if name in entry:
            value = entry[name]
            if isinstance(value, bool) or not isinstance(value, int):
                raise PlanError(f"{where}.{name}: expected an integer, got {value!r}")
            if value < 1:
                raise PlanError(f"{where}.{name}: must be positive, got {value}")
    causal = entry.get("causal", False)
    if not isinstance(causal, bool):
        raise PlanError(f"{where}.causal: expected true or false, got {causal!r}")
    dtype = entry.get("dtype", "bf16")
    if dtype not in DTYPES:
        raise PlanError(f"{where}.dtype: expected one of {', '.join(DTYPES)}, got {dtype!r}")
    window = entry.get("window", [-1, -1])
    if not isinstance(window, list) or len(window) != 2 or any(
            isinstance(w, bool) or not isinstance(w, int) or w < -1 for w in window):
        raise PlanError(f"{where}.window: expected [left, right], integers >= -1 (-1: "
                        f"unbounded), got {window!r}")
    softcap = entry.get("softcap", 0.0)
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or softcap < 0:
        raise PlanError(f"{where}.softcap: expected a number >= 0, got {softcap!r}")
    alibi = entry.get("alibi", False)
    if not isinstance(alibi, bool):
        raise PlanError(f"{where}.alibi: expected true or false, got {alibi!r}")
    heads = entry["heads"]
    try:
        return AttentionProblem(entry["batch"], heads, entry.get("kv_heads", heads),
                                entry["seqlen"], entry.get("kv_seqlen", entry["seqlen"]),
                                entry["head_dim"], causal, dtype, window[0],
                                -1 if causal else window[1], float(softcap), alibi)
    except ValueError as exc:
        raise PlanError(f"{where}: {exc}") from exc


def parse_plan(text: str, source: str = "<plan>") -> list[AttentionProblem]:
    """The problems of the plan ``text``; ``source`` names it in error messages."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise PlanError(f"{source}: not valid TOML: {exc}") from exc
    extra = sorted(set(data) - {"shape"})
    if extra:
        raise PlanError(f"{source}: unknown top-level key(s) {', '.join(extra)}; "
                        "expected only [[shape]] tables")
    shapes = data.get("shape")
    if not isinstance(shapes, list) or not shapes:
        raise PlanError(f"{source}: no [[shape]] tables; add at least one")
    return [_shape(f"{source}: shape[{i}]", entry) for i, entry in enumerate(shapes, 1)]


def load_plan(path: str | Path) -> list[AttentionProblem]:
    """The problems of the plan file at ``path``."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise PlanError(f"cannot read plan {path}: {exc}") from exc
    return parse_plan(text, str(path))
