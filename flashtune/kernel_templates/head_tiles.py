"""The head dim of a ``tl`` kernel's tiles: one power of two, or two (``SPLIT_D``).

``tl.arange`` and ``tl.dot`` take power-of-two extents (at least 16 for a dot's K), so a head
dim that is not one is padded to the next: 96 in a 128-wide tile, a quarter of every load and
multiply on zero columns (80: 37.5%). Read as two tiles, the largest power of two below it
and the rest padded to a power of two >= 16, nothing is padded at 96 (64 + 32) or 80
(64 + 16): two dots for the scores, two for ``P @ V``, two accumulators. Gluon takes tiles
that are not powers of two; FA3 serves 96 natively.
"""

from __future__ import annotations

__all__ = ["d_tiles", "saves_padding"]


def _pow2(n: int) -> int:
    """The next power of two of ``n``, at least 16."""
    return max(16, 1 << (n - 1).bit_length())


def d_tiles(head_dim: int, split: int | bool = 0) -> tuple[int, int]:
    """The head dim's tiles ``(BLOCK_D, BLOCK_D1)``: one power of two covering it
    (``(next power of two >= 16, 0)``), or with ``split`` the largest power of two below it
    and the rest padded to a power of two >= 16: 96 -> (64, 32), 80 -> (64, 16), 192 ->
    (128, 64). A power-of-two head dim (or one of 16 or less) is one tile either way; a
    split that saves no padding (24 -> 16 + 16, 112 -> 64 + 64) is still two tiles here: the
    spaces' predicates refuse it."""
    whole = _pow2(head_dim)
    if not split or whole == head_dim or head_dim <= 16:
        return whole, 0
    first = whole // 2
    return first, _pow2(head_dim - first)


def saves_padding(head_dim: int) -> bool:
    """Whether two tiles (:func:`d_tiles` with ``split``) cover ``head_dim`` with fewer
    columns than one: 96 (64 + 32 against 128), 80 (64 + 16), 72 (64 + 16); not a power of
    two or 16 or less (one tile either way), nor 112 (64 + 64) or 24 (16 + 16). Where a
    template's predicate allows ``SPLIT_D`` 1, its search proposes it
    (``knob_scope.split_d_scope``) and a Hopper default takes it."""
    return sum(d_tiles(head_dim, 1)) < d_tiles(head_dim)[0]
