"""GPU timing: medians with L2 flushing (``triton.testing.do_bench``) and sanity floors.

A time that is not positive, or below the physical floor of the device (the problem's
FLOPs over the tensor-core peak, its minimum bytes over the memory bandwidth), is a
measurement error: :func:`measurement_problem` says why, and the runners re-measure once
before recording the trial as a RUNTIME_ERROR.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Timing:
    median_ms: float
    p20_ms: float
    p80_ms: float


# below this do_bench median (ms) a launch's host cost can show in the events around it
# (the decode launcher costs ~0.13 ms of host time per call on the H100 box, a Python
# launcher with more checks can cost more): such medians are re-timed by bench_queued
SHORT_KERNEL_MS = 1.0
# a longer median whose host time per call is at least this share of it may hold launch
# gaps too (the host launching a dozen kernels behind a short GPU step): re-timed queued
HOST_BOUND_SHARE = 0.5
# L2 flush buffer, as do_bench's (larger than any GPU's L2)
FLUSH_BYTES = 256 * 1024 * 1024
# do_bench's measuring time (ms) in one call of bench, and the runs bench_queued times for it
# (a shorter rep_ms, as in the many rounds of a close call, takes proportionally fewer runs,
# no fewer than MIN_QUEUED_REPS)
REP_MS = 100
QUEUED_REPS = 100
MIN_QUEUED_REPS = 20
# GPU clock assumed when sizing the queueing sleep: above any GPU's, so the sleep lasts at
# least as long as asked
_SLEEP_CYCLES_PER_MS = 2.5e6


def settle(fn: Callable[[], object], ms: float, *, sync: Callable[[], object] | None = None,
           clock: Callable[[], float] | None = None) -> int:
    """Run ``fn`` back to back for ``ms`` milliseconds of wall time (no L2 flush), so a
    power-capped GPU's clock settles on ``fn``'s own draw before it is timed; returns the
    calls made. The host waits for the GPU every 2 ms of work or so (the calls between two
    waits sized from the first call's time), so the work queued never runs far past
    ``ms``. ``sync`` and ``clock`` (tests): ``torch.cuda.synchronize`` and
    ``time.perf_counter`` by default.

    On an H200 every attention kernel runs at the 700 W software power cap within 0.1-0.2 s
    of sustained use (``benchmarks/sustained_load.py``); a window timed right after another
    candidate, or after an idle compile, carries the clock that one left. 0 does nothing.
    """
    if ms <= 0:
        return 0
    if sync is None or clock is None:
        import time

        import torch

        sync = sync or torch.cuda.synchronize
        clock = clock or time.perf_counter
    start = clock()
    fn()
    sync()
    calls, first_ms = 1, max((clock() - start) * 1e3, 1e-3)
    per_wait = max(1, int(2.0 / first_ms))
    while (clock() - start) * 1e3 < ms:
        for _ in range(per_wait):
            fn()
        sync()
        calls += per_wait
    return calls


def bench(fn: Callable[[], object], *, warmup_ms: int = 25, rep_ms: float = REP_MS,
          settle_ms: float = 0.0) -> Timing:
    """Median, p20 and p80 of ``fn``'s GPU time in milliseconds, with a cold L2 before every
    run; ``settle_ms`` > 0: :func:`settle` first (the figure at the clock ``fn``'s own
    power leaves, on a power-capped GPU the sustained one).

    ``do_bench`` times with CUDA events around each call and clears the L2 cache before
    every run, so the figures are for cold K/V reads, as in a real model step. Where the
    host cannot keep ahead of the GPU, the time the host takes to launch ``fn`` shows as GPU
    idle time between the events (a decode kernel of 10 us behind a launcher of 100 us
    measures 100 us; a 0.6 ms padded training step of a dozen launches measured 1.2 ms):
    a median under :data:`SHORT_KERNEL_MS`, or one whose host time per call is at least
    :data:`HOST_BOUND_SHARE` of it (:func:`host_bound`), is re-timed by
    :func:`bench_queued`, which keeps the host ahead of the GPU. So two contenders of one
    case are both timed for their GPU work, whatever their host costs. ``rep_ms`` is the
    measuring time of either (:func:`queued_reps` runs for bench_queued).
    """
    from triton.testing import do_bench

    settle(fn, settle_ms)
    p50, p20, p80 = do_bench(fn, warmup=warmup_ms, rep=rep_ms, quantiles=[0.5, 0.2, 0.8])
    if p50 < SHORT_KERNEL_MS or host_bound(float(p50), _host_ms(fn)):
        return bench_queued(fn, reps=queued_reps(rep_ms))
    return Timing(float(p50), float(p20), float(p80))


def queued_reps(rep_ms: float) -> int:
    """The runs :func:`bench_queued` times for a measuring time of ``rep_ms``: QUEUED_REPS
    for REP_MS, in proportion below it, never fewer than MIN_QUEUED_REPS."""
    return max(MIN_QUEUED_REPS, min(QUEUED_REPS, round(QUEUED_REPS * rep_ms / REP_MS)))


def host_bound(median_ms: float, host_ms: float) -> bool:
    """Whether a ``do_bench`` median of ``median_ms`` may hold launch gaps: the host spends
    at least :data:`HOST_BOUND_SHARE` of it launching one call (``host_ms``, the calls
    queued without waiting for the GPU), so the GPU can wait for the host."""
    return median_ms < SHORT_KERNEL_MS or host_ms >= HOST_BOUND_SHARE * median_ms


def _host_ms(fn: Callable[[], object], flush: Any = None, calls: int = 5) -> float:
    """Host milliseconds per call of ``fn`` (with an L2 flush before each, as timed),
    launched back to back without waiting for the GPU."""
    import time

    import torch

    if flush is None:
        flush = torch.empty(FLUSH_BYTES // 4, dtype=torch.int32, device="cuda")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        flush.zero_()
        fn()
    host = (time.perf_counter() - t0) * 1e3 / calls
    torch.cuda.synchronize()
    return host


def bench_once(fn: Callable[[], object]) -> float:
    """Milliseconds of one call of ``fn`` between CUDA events, the L2 flushed before it (its
    host launch included: a screen for calls far slower than others, not a measurement)."""
    import torch

    flush = torch.empty(FLUSH_BYTES // 4, dtype=torch.int32, device="cuda")
    start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
    flush.zero_()
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return float(start.elapsed_time(end))


def bench_queued(fn: Callable[[], object], *, reps: int = QUEUED_REPS) -> Timing:
    """GPU time of ``fn`` without its host launch cost, with a cold L2 before every run.

    The GPU is first held by a sleep kernel long enough for the host to enqueue every
    run (an L2 flush, a start event, ``fn``, an end event, ``reps`` times); it then runs them
    back to back, so the events bracket only the GPU work of ``fn`` (several kernels and
    the gaps between them included). Median, p20 and p80 over the runs.
    """
    import torch

    flush = torch.empty(FLUSH_BYTES // 4, dtype=torch.int32, device="cuda")
    fn()
    host_ms = _host_ms(fn, flush)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    sleep_ms = 1.0 + 2.0 * reps * host_ms
    torch.cuda._sleep(int(sleep_ms * _SLEEP_CYCLES_PER_MS))
    for start, end in zip(starts, ends):
        flush.zero_()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    times = sorted(s.elapsed_time(e) for s, e in zip(starts, ends))

    def q(f: float) -> float:
        return float(times[min(len(times) - 1, int(f * len(times)))])

    return Timing(q(0.5), q(0.2), q(0.8))


def bench_graph(fn: Callable[[], object], *, reps: int = 20, rounds: int = 5,
                cold: bool = False) -> float:
    """GPU time of one call of ``fn`` in milliseconds, from CUDA-graph replays: ``reps``
    calls captured in one graph (no launch cost), the median over ``rounds`` replays. The L2
    stays warm between calls (a lower bound for :func:`bench`: a call whose data fit in the
    L2 finds them there), unless ``cold``: then the graph zeroes a :data:`FLUSH_BYTES`
    buffer before each call, and a graph of the zeroing alone is subtracted (the cold L2 of
    a layer in a real model's step, without the host)."""
    import torch

    flush = torch.empty(FLUSH_BYTES // 4, dtype=torch.int32, device="cuda") if cold else None

    def step() -> None:
        if flush is not None:
            flush.zero_()
        fn()

    ms = _replayed(step, reps, rounds)
    if flush is not None:
        ms -= _replayed(flush.zero_, reps, rounds)
    return ms


def _replayed(fn: Callable[[], object], reps: int, rounds: int) -> float:
    """Median milliseconds a call over ``rounds`` replays of a graph of ``reps`` calls."""
    import statistics

    import torch

    fn()
    torch.cuda.synchronize()
    side = torch.cuda.Stream()  # the warm-up run before capture, as torch recommends
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / reps)
    return float(statistics.median(times))


def tflops(flops: float, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12


# -- the physical floor -----------------------------------------------------------------------
# Dense fp16/bf16 tensor-core peak (FLOP/s) and HBM bandwidth (bytes/s) per GPU family, from
# the datasheets (ANCHORS.md: H100 SXM 989 TFLOP/s, 3.35 TB/s). Where a family has variants
# the fastest of each figure is taken, so the floor stays a true lower bound. First match wins
# (H200 before H20). An unknown GPU gets :data:`ANY_GPU`, above any GPU made so far.
PEAKS: tuple[tuple[str, float, float], ...] = (
    ("B200", 2.25e15, 8.0e12),
    ("GB200", 2.5e15, 8.0e12),
    ("H200", 989.4e12, 4.8e12),
    ("H100", 989.4e12, 3.9e12),
    ("H800", 989.4e12, 3.35e12),
    ("A100", 312e12, 2.04e12),
    ("L40S", 366e12, 0.864e12),
)
ANY_GPU = (10e15, 20e12)
FLOOR_SLACK = 0.9  # a measurement must reach 90% of the floor (flop-count conventions vary)


class MeasurementError(RuntimeError):
    """A timing that cannot be right (not positive, or faster than the hardware can go)."""


def device_peaks(device: Any) -> tuple[float, float] | None:
    """(FLOP/s, bytes/s) ceilings of ``device`` (a DeviceFingerprint); None for the CPU
    interpreter, where timings mean nothing."""
    if getattr(device, "is_interpreter", False):
        return None
    name = str(getattr(device, "name", "")).upper()
    for family, flops, bw in PEAKS:
        if family in name:
            return flops, bw
    return ANY_GPU


def physical_floor_ms(device: Any, flops: float, min_bytes: float = 0.0) -> float:
    """The least time one launch can take: FLOPs over peak, bytes over bandwidth (0 when
    the device has no known ceiling)."""
    peaks = device_peaks(device)
    if peaks is None:
        return 0.0
    return max(flops / peaks[0], min_bytes / peaks[1]) * 1e3


def measurement_problem(median_ms: float, floor_ms: float) -> str | None:
    """Why ``median_ms`` cannot be a real measurement, or None when it can."""
    if not (isinstance(median_ms, (int, float)) and math.isfinite(median_ms) and median_ms > 0):
        return f"a median of {median_ms!r} ms is not a positive time"
    if median_ms < floor_ms * FLOOR_SLACK:
        return (f"a median of {median_ms:.4g} ms is below the physical floor of {floor_ms:.4g} "
                f"ms (FLOPs over peak, bytes over bandwidth)")
    return None
