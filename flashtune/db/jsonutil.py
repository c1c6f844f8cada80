"""Canonical JSON: the one encoding used for everything the store keys or hashes on.

Problem keys and kernel configs are stored as canonical JSON text (sorted keys, no
spaces), so two equal mappings always give byte-identical text, the same unique-constraint
value and the same :func:`config_hash`. NaN and Infinity are refused: they are not JSON,
PostgreSQL's JSON parser rejects them and they never compare equal to themselves.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

__all__ = ["canonical_json", "config_hash", "hash_canonical", "loads_object"]

CONFIG_HASH_LENGTH = 16  # hex characters of the sha256 digest kept


def canonical_json(value: Any) -> str:
    """``value`` as canonical JSON text: sorted keys, ``(",", ":")`` separators, ASCII.

    Arguments:
        value: JSON-representable data (tuples become lists, as ``json`` always does).
    Returns:
        The one text every equal value encodes to.
    Raises:
        ValueError naming the value when it holds NaN/Infinity or a type JSON cannot
        represent.
    """
    try:
        return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"cannot store {value!r} as canonical JSON: {exc}; use finite "
                         f"numbers, strings, bools, None, lists and str-keyed dicts") from exc


def config_hash(config: Mapping[str, Any]) -> str:
    """The hash a config is stored and deduplicated under.

    Arguments:
        config: a kernel config (parameter name -> value).
    Returns:
        The sha256 of ``canonical_json(config)``, first 16 hex characters (64 bits).
    Raises:
        ValueError as :func:`canonical_json` does.
    """
    return hash_canonical(canonical_json(dict(config)))


def hash_canonical(text: str) -> str:
    """:func:`config_hash` of a config already encoded by :func:`canonical_json`."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:CONFIG_HASH_LENGTH]


def loads_object(text: str) -> dict[str, Any]:
    """Parse JSON text that must hold an object (a stored config, key or params)."""
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError(f"expected a JSON object, got {type(value).__name__}: {text[:80]!r}")
    return value
