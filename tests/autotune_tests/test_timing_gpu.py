"""GPU timing of short kernels: the host's launch cost must not be measured as kernel time."""

from __future__ import annotations

import time

import pytest
import torch

from flashtune.autotune.timing import SHORT_KERNEL_MS, bench, bench_graph, bench_queued

pytestmark = pytest.mark.gpu


def _behind_host_work(fn, seconds):
    """``fn`` launched after ``seconds`` of busy host work (a slow Python launcher)."""
    def launch():
        t = time.perf_counter()
        while time.perf_counter() - t < seconds:
            pass
        fn()
    return launch


def test_a_slow_launcher_is_not_timed_as_kernel_time():
    """A ~20 us kernel behind 300 us of host work: bench() reports the kernel (cold L2), not
    the host; the kernel alone, CUDA-graph timed with a warm L2, is a lower bound."""
    x = torch.randn(4 * 1024 * 1024, device="cuda")  # 16 MB: fits L2 when warm
    y = torch.empty_like(x)

    def kernel():
        torch.mul(x, 2.0, out=y)

    graph = bench_graph(kernel, reps=50)
    got = bench(_behind_host_work(kernel, 3e-4))
    assert got.median_ms < SHORT_KERNEL_MS, got
    # the host's 0.3 ms do not show; a cold L2 costs at most a few x the warm graph time
    assert graph * 0.7 <= got.median_ms <= max(4 * graph, graph + 0.03), (got, graph)
    queued = bench_queued(kernel)
    assert abs(queued.median_ms - got.median_ms) <= 0.3 * got.median_ms + 0.005


def test_a_cold_graph_reads_from_memory_what_a_warm_one_finds_in_the_l2():
    """A copy of 16 MB: replayed back to back its input stays in the L2; with ``cold`` the
    graph zeroes 256 MB before each call and subtracts that, so the copy reads from HBM:
    slower than warm, and near bench()'s cold L2 (which times the same thing eagerly)."""
    x = torch.randn(4 * 1024 * 1024, device="cuda")
    y = torch.empty_like(x)

    def kernel():
        torch.mul(x, 2.0, out=y)

    warm = bench_graph(kernel, reps=50)
    cold = bench_graph(kernel, reps=20, cold=True)
    eager = bench_queued(kernel).median_ms
    assert cold > 1.1 * warm, (cold, warm)
    assert abs(cold - eager) <= 0.3 * eager + 0.005, (cold, eager)


def test_a_host_bound_step_over_a_millisecond_is_timed_for_its_gpu_work():
    """A ~0.2 ms kernel behind 1.5 ms of host work: do_bench's median passes the 1 ms line
    (the GPU waits for the host), so bench() must see the host share and re-time it queued:
    the kernel's time, not the host's."""
    x = torch.randn(16 * 1024 * 1024, device="cuda")  # 64 MB each way: ~0.05-0.1 ms
    y = torch.empty_like(x)

    def kernel():
        for _ in range(3):
            torch.mul(x, 2.0, out=y)

    queued = bench_queued(kernel)
    got = bench(_behind_host_work(kernel, 1.5e-3))
    assert got.median_ms < 1.0, got
    assert abs(queued.median_ms - got.median_ms) <= 0.3 * queued.median_ms + 0.01, (got, queued)


def test_settling_keeps_the_gpu_busy_for_its_time_and_no_longer():
    """A ~1 ms matmul settled for 150 ms: the GPU runs it back to back for about that long
    (the host waits every ~2 ms of work, so little is left queued when it returns), and a
    settled bench still reports the call's time."""
    from flashtune.autotune.timing import settle

    x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)

    def matmul():
        torch.matmul(x, x, out=y)

    matmul()
    torch.cuda.synchronize()
    t = time.perf_counter()
    calls = settle(matmul, 150.0)
    returned = time.perf_counter() - t
    torch.cuda.synchronize()
    drained = time.perf_counter() - t
    assert 0.15 <= returned < 0.3, returned
    assert drained - returned < 0.02, (returned, drained)  # at most a wait's worth queued
    assert calls >= 20, calls
    plain, settled = bench(matmul), bench(matmul, settle_ms=150.0)
    assert 0.5 * plain.median_ms <= settled.median_ms <= 2.0 * plain.median_ms, (plain, settled)
