"""Which of FlashAttention-2's ~10^5 parametrized cases a run takes: a fixed-seed sample of
``n`` cases per test function (every function covered), optionally one shard of it. Pure
functions of the cases' ids, so the same seed picks the same cases on every machine."""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from typing import TypeVar

T = TypeVar("T")

DEFAULT_CASES = 40   # per test function: 11 large functions x 40 + the 6 small ones whole
DEFAULT_SEED = 0


def parse_cases(text: str | None) -> int | None:
    """``$FLASHTUNE_FA2_CASES``: cases per function; ``"all"`` or 0 for every case (None)."""
    if text is None or not text.strip():
        return DEFAULT_CASES
    if text.strip().lower() == "all":
        return None
    n = int(text)
    if n < 0:
        raise ValueError(f"FLASHTUNE_FA2_CASES must be >= 0 or 'all', got {text!r}")
    return n or None


def parse_shard(text: str | None) -> tuple[int, int] | None:
    """``$FLASHTUNE_FA2_SHARD`` ``"i/n"`` (1 <= i <= n): this run's part of the sample."""
    if text is None or not text.strip():
        return None
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise ValueError(f"FLASHTUNE_FA2_SHARD must be 'i/n', got {text!r}") from None
    if not 1 <= i <= n:
        raise ValueError(f"FLASHTUNE_FA2_SHARD {text!r}: need 1 <= i <= n")
    return i, n


def sample(groups: dict[str, Sequence[tuple[str, T]]], n: int | None,
           seed: int = DEFAULT_SEED) -> dict[str, list[T]]:
    """Per group (test function): ``n`` of its ``(case id, case)`` pairs, drawn by an RNG
    seeded with the seed and the group's name (adding a function does not move another's
    sample), in id order; every case when ``n`` is None or the group is smaller."""
    picked: dict[str, list[T]] = {}
    for name, cases in groups.items():
        ordered = sorted(cases, key=lambda c: c[0])
        if n is None or len(ordered) <= n:
            chosen = ordered
        else:
            rng = random.Random(f"{seed}:{name}")
            chosen = sorted(rng.sample(ordered, n), key=lambda c: c[0])
        picked[name] = [case for _, case in chosen]
    return picked


def shard(items: Iterable[T], part: tuple[int, int] | None) -> list[T]:
    """Part ``i`` of ``n`` of ``items``: every n-th, starting at the (i-1)-th."""
    items = list(items)
    if part is None:
        return items
    i, n = part
    return items[i - 1::n]
