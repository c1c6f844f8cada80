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
    dropout = 0.1       # optional: attention dropout probability (FA2's dropout_p)

    [[shape]]           # a packed batch (flashtune.attention_varlen): no batch
    heads = 32
    kv_heads = 8
    head_dim = 128
    causal = true
    seqlen = 16384      # with "random:SEED": the tokens to fill
    varlen_lengths = "random:0"   # or [4096, 1000, ...], or "random:SEED:MIN-MAX"

A packed batch's lengths (``varlen_lengths``, ``flashtune tune --varlen-lengths``) are a
list of token counts, a file of them, or ``random:SEED[:MIN-MAX]``: documents of uniformly
drawn lengths in MIN-MAX (default 128-4096, the issue's packed-training mix) until they
fill ``seqlen`` tokens, the last one cut to fit (:func:`varlen_lengths`). The problem keeps
their count, longest and total (:meth:`AttentionProblem.from_lengths`).

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

__all__ = ["RANDOM_LENGTHS", "PlanError", "load_plan", "parse_plan", "read_lengths",
           "varlen_lengths"]

_INT_FIELDS = ("batch", "heads", "kv_heads", "seqlen", "kv_seqlen", "head_dim")
_REQUIRED = ("batch", "heads", "seqlen", "head_dim")
_FIELDS = (*_INT_FIELDS, "causal", "dtype", "window", "softcap", "alibi", "dropout",
           "varlen_lengths")
# random:SEED's document lengths when no MIN-MAX is given
RANDOM_LENGTHS = (128, 4096)


class PlanError(FlashtuneError, ValueError):
    """A plan file that cannot be read or has an invalid entry."""


def _shape(where: str, entry: Any, base: Path | None = None) -> AttentionProblem:
    if not isinstance(entry, Mapping):
        raise PlanError(f"{where}: expected a table, got {type(entry).__name__}")
    unknown = sorted(set(entry) - set(_FIELDS))
    if unknown:
        raise PlanError(f"{where}: unknown field(s) {', '.join(unknown)}; "
                        f"allowed: {', '.join(_FIELDS)}")
    packed = "varlen_lengths" in entry
    for name in _REQUIRED:
        if name not in entry and not (packed and name in ("batch", "seqlen")):
            raise PlanError(f"{where}: missing required field '{name}'")
    if packed and ("batch" in entry or "kv_seqlen" in entry):
        raise PlanError(f"{where}: a packed batch (varlen_lengths) takes no batch or "
                        f"kv_seqlen: its lengths give them")
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
    dropout = entry.get("dropout", 0.0)
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) \
            or not 0 <= dropout < 1:
        raise PlanError(f"{where}.dropout: expected a probability in [0, 1), got {dropout!r}")
    heads = entry["heads"]
    if packed:
        spec = entry["varlen_lengths"]
        if isinstance(spec, str) and not spec.startswith("random:") and base is not None:
            spec = str(base / spec)  # a lengths file beside the plan
        lengths = varlen_lengths(spec, entry.get("seqlen"), f"{where}.varlen_lengths")
        try:
            return AttentionProblem.from_lengths(
                lengths, None, heads_q=heads, heads_kv=entry.get("kv_heads", heads),
                head_dim=entry["head_dim"], causal=causal, dtype=dtype,
                window_left=window[0], window_right=-1 if causal else window[1],
                softcap=float(softcap), alibi=alibi, dropout=float(dropout))
        except ValueError as exc:
            raise PlanError(f"{where}: {exc}") from exc
    try:
        return AttentionProblem(entry["batch"], heads, entry.get("kv_heads", heads),
                                entry["seqlen"], entry.get("kv_seqlen", entry["seqlen"]),
                                entry["head_dim"], causal, dtype, window[0],
                                -1 if causal else window[1], float(softcap), alibi,
                                dropout=float(dropout))
    except ValueError as exc:
        raise PlanError(f"{where}: {exc}") from exc


def parse_plan(text: str, source: str = "<plan>",
               base: Path | None = None) -> list[AttentionProblem]:
    """The problems of the plan ``text``; ``source`` names it in error messages; a
    lengths file it names is read relative to ``base`` (the plan's folder)."""
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
    return [_shape(f"{source}: shape[{i}]", entry, base) for i, entry in enumerate(shapes, 1)]


def load_plan(path: str | Path) -> list[AttentionProblem]:
    """The problems of the plan file at ``path``."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise PlanError(f"cannot read plan {path}: {exc}") from exc
    return parse_plan(text, str(path), path.parent)


def varlen_lengths(spec: Any, total: int | None, where: str = "varlen_lengths") -> list[int]:
    """A packed batch's sequence lengths from ``spec``: a list of token counts,
    ``"random:SEED[:MIN-MAX]"`` (documents of uniform random lengths in MIN-MAX, default
    :data:`RANDOM_LENGTHS`, drawn with ``random.Random(SEED)`` until they fill ``total``
    tokens, the last cut to fit), or a file's path (:func:`read_lengths`). ``PlanError``
    naming ``where`` for anything else."""
    import random

    if isinstance(spec, list):
        if not spec or any(isinstance(n, bool) or not isinstance(n, int) or n < 1
                           for n in spec):
            raise PlanError(f"{where}: expected a non-empty list of positive token counts, "
                            f"got {spec!r}")
        return list(spec)
    if not isinstance(spec, str) or not spec:
        raise PlanError(f"{where}: expected a list of token counts, a file or "
                        f"'random:SEED[:MIN-MAX]', got {spec!r}")
    if not spec.startswith("random:"):
        return read_lengths(spec, where)
    parts = spec.split(":")
    try:
        seed = int(parts[1])
        low, high = (int(x) for x in parts[2].split("-")) if len(parts) == 3 \
            else RANDOM_LENGTHS
        if len(parts) > 3 or not 1 <= low <= high:
            raise ValueError
    except (ValueError, IndexError):
        raise PlanError(f"{where}: expected 'random:SEED' or 'random:SEED:MIN-MAX' "
                        f"(integers, 1 <= MIN <= MAX), got {spec!r}") from None
    if total is None or isinstance(total, bool) or not isinstance(total, int) or total < 1:
        raise PlanError(f"{where}: {spec!r} needs the tokens to fill (--seqlen, or seqlen "
                        f"in a plan), got {total!r}")
    rng = random.Random(seed)
    lengths: list[int] = []
    while sum(lengths) < total:
        lengths.append(min(rng.randint(low, high), total - sum(lengths)))
    return lengths


def read_lengths(path: str | Path, where: str = "varlen_lengths") -> list[int]:
    """The token counts in the file at ``path``: integers separated by whitespace or
    commas (a JSON list reads too), ``#`` starting a comment."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise PlanError(f"{where}: cannot read lengths file {path}: {exc}") from exc
    body = " ".join(line.split("#", 1)[0] for line in text.splitlines())
    words = body.replace(",", " ").replace("[", " ").replace("]", " ").split()
    try:
        lengths = [int(w) for w in words]
    except ValueError:
        raise PlanError(f"{where}: {path} must hold integers (token counts), separated by "
                        f"whitespace or commas") from None
    return varlen_lengths(lengths, None, f"{where} ({path})")
