"""GPU timing: medians with L2 flushing (``triton.testing.do_bench``) and sanity floors."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Timing:
    median_ms: float
    p20_ms: float
    p80_ms: float


def bench(fn: Callable[[], object], *, warmup_ms: int = 25, rep_ms: int = 100) -> Timing:
    """Median, p20 and p80 of ``fn`` in milliseconds.

    ``do_bench`` times with CUDA events and clears the L2 cache before every run, so the
    figures are for cold K/V reads, as in a real model step.
    """
    from triton.testing import do_bench

    p50, p20, p80 = do_bench(fn, warmup=warmup_ms, rep=rep_ms, quantiles=[0.5, 0.2, 0.8])
    return Timing(float(p50), float(p20), float(p80))


def tflops(flops: float, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12
