"""The score modifications the Gluon kernels serve, as their launchers read them: a causal
sliding window (FlashAttention-2's ``window_size = (left, 0)``) and a softcap. One rule for
the forward (``attn_fwd_gluon``, its launcher and launch plan) and the backward
(``attn_bwd_gluon``), so that a gradient never reads a window its forward read otherwise.
Validation only, as :mod:`flashtune.core.packing`'s checks: nothing here reaches the
kernels' code, and a source hash covers only :mod:`flashtune.kernel_templates`."""

from __future__ import annotations

import math
from typing import Any

from flashtune.core.errors import InputError

__all__ = ["causal_window_left", "softcap_value"]


def causal_window_left(window: Any, causal: bool, kernel: str, others: str) -> int:
    """The left bound of ``window`` (FlashAttention-2's ``window_size``) a Gluon kernel
    serves: ``left`` >= 0 with ``causal`` (the right bound -1 or 0), or -1 for none
    (``(-1, -1)``, or with ``causal`` ``(-1, 0)``, its own right bound). InputError naming
    the window otherwise, and ``others`` (the kernel that serves it): ``(-1, 0)`` without
    ``causal`` is a right bound, the causal mask by another name, not "no window"."""
    try:
        left, right = (int(x) for x in window)
    except (TypeError, ValueError):
        raise InputError(f"window must be a pair of ints (window_size), got {window!r}") \
            from None
    if not (left == -1 and (right == -1 or causal and right == 0)
            or causal and left >= 0 and right in (-1, 0)):
        raise InputError(f"window {tuple(window)}: {kernel} serves a causal sliding window "
                         f"(left >= 0 with causal=True) only; {others} serves the others")
    return left


def softcap_value(softcap: Any) -> float:
    """``softcap`` as the Gluon kernels take it: a finite float > 0, or 0.0 for None or 0
    (off); InputError naming it otherwise."""
    if softcap is None or softcap == 0:
        return 0.0
    try:
        cap = float(softcap)
    except (TypeError, ValueError):
        cap = math.nan
    if not math.isfinite(cap) or cap < 0:
        raise InputError(f"softcap must be a finite number >= 0 (0 or None: off), got "
                         f"{softcap!r}")
    return cap
