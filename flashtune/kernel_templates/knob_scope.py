"""Where a template's knobs apply: the values the tuner proposes for a problem
(:attr:`flashtune.core.space.SearchSpace.narrow`), so a knob that a problem cannot take is not
sampled, then refused by the predicate and recorded as pruned, trial after trial.

Imported by the templates' packages only, never by a launcher: outside every source hash
(it decides what is searched, not what a config compiles to).
"""

from __future__ import annotations

from typing import Any

from flashtune.kernel_templates.head_tiles import saves_padding

__all__ = ["split_d_scope"]


def split_d_scope(problem: Any) -> dict[str, tuple[int, ...]]:
    """``SPLIT_D`` only 0 where two tiles save no padding (a power-of-two head dim, or one
    like 112 = 64 + 64), else nothing narrowed."""
    return {} if saves_padding(problem.head_dim) else {"SPLIT_D": (0,)}
