"""Runner factories for the isolation tests: candidates that crash, hang or break the GPU.

The worker process of :class:`flashtune.autotune.isolation.IsolatedRunner` imports these by
name, so they live at module level. :func:`crashing_runner` (CPU) fails by config::

    BLOCK_M 16, BLOCK_N 64  -> segfault (reads address 0 through ctypes)
    BLOCK_M 32, BLOCK_N 64  -> hangs forever (time.sleep in a loop)
    BLOCK_M 32, BLOCK_N 32  -> os.abort() (SIGABRT)
    anything else           -> COMPLETE, 1 ms + BLOCK_M / 1000 + BLOCK_N / 100000

:func:`faulty_gpu_runner` runs a real Triton kernel on the GPU whose ``BLOCK_N`` 64 configs
store far out of bounds (an illegal memory access: the CUDA context is lost) and whose
``BLOCK_M`` 32 + ``BLOCK_N`` 16 config spins forever.
"""

from __future__ import annotations

import ctypes
import os
import time
from collections.abc import Mapping
from typing import Any

from flashtune.autotune.runners import TrialResult
from flashtune.db.records import TrialState

SEGFAULT = {"BLOCK_M": 16, "BLOCK_N": 64}
HANG = {"BLOCK_M": 32, "BLOCK_N": 64}
ABORT = {"BLOCK_M": 32, "BLOCK_N": 32}


def _is(config: Mapping[str, int], which: Mapping[str, int]) -> bool:
    return all(config.get(k) == v for k, v in which.items())


def synthetic_ms(config: Mapping[str, int]) -> float:
    return 1.0 + config["BLOCK_M"] / 1000 + config["BLOCK_N"] / 100000


class CrashingRunner:
    def __init__(self, problem: Any) -> None:
        self.flops = problem.flops()
        self.interpreting = True

    def evaluate(self, config: Mapping[str, int]) -> TrialResult:
        if _is(config, SEGFAULT):
            ctypes.string_at(0)  # SIGSEGV
        if _is(config, HANG):
            while True:
                time.sleep(1)
        if _is(config, ABORT):
            os.abort()
        ms = synthetic_ms(config)
        return TrialResult(TrialState.COMPLETE, None, ms, ms, ms, self.flops / ms / 1e9, 0.0)


def crashing_runner(spec: Any, problem: Any, device: Any, options: Any) -> CrashingRunner:
    return CrashingRunner(problem)


def failing_factory(spec: Any, problem: Any, device: Any, options: Any) -> Any:
    raise RuntimeError("cannot build the runner here")


# -- the GPU proof --------------------------------------------------------------------------

def _gpu_kernels() -> tuple[Any, Any]:
    import triton
    import triton.language as tl

    @triton.jit
    def wild_store(out_ptr, n, OFFSET: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK).to(tl.int64)
        tl.store(out_ptr + offs + OFFSET, tl.zeros((BLOCK,), tl.float32), mask=offs < n)

    @triton.jit
    def spin(flag_ptr, out_ptr):
        i = tl.load(flag_ptr)
        step = tl.load(flag_ptr + 1)  # 0 at run time: the loop never ends
        while i >= 0:
            i = i + step
        tl.store(out_ptr, i)

    return wild_store, spin


class FaultyGpuRunner:
    """A real GPU runner: the good configs run ``torch.add`` on the problem's q and time it
    with do_bench; the faulty ones launch the kernels above."""

    def __init__(self, problem: Any) -> None:
        import torch

        self.flops = problem.flops()
        self.interpreting = False
        self.x = torch.randn(1 << 20, device="cuda")
        self.flag = torch.tensor([0, 0], device="cuda", dtype=torch.int64)
        self.wild_store, self.spin = _gpu_kernels()

    def evaluate(self, config: Mapping[str, int]) -> TrialResult:
        import torch

        try:
            if config["BLOCK_N"] == 64:
                self.wild_store[(1,)](self.x, 128, OFFSET=1 << 40, BLOCK=128)
            elif config["BLOCK_M"] == 32 and config["BLOCK_N"] == 16:
                self.spin[(1,)](self.flag, self.x)
            else:
                torch.add(self.x, 1.0)
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001 - failures are data
            return TrialResult(TrialState.RUNTIME_ERROR, f"{type(exc).__name__}: {exc}"[:300])
        ms = synthetic_ms(config)
        return TrialResult(TrialState.COMPLETE, None, ms, ms, ms, None, 0.0)

    def time_config(self, config: Mapping[str, int] | None = None,
                    rep_ms: float = 100.0) -> tuple[float, float, float]:
        ms = synthetic_ms(config or {"BLOCK_M": 64, "BLOCK_N": 16})
        return ms, ms, ms


def faulty_gpu_runner(spec: Any, problem: Any, device: Any, options: Any) -> FaultyGpuRunner:
    return FaultyGpuRunner(problem)


class TaggedRunner(CrashingRunner):
    """:class:`CrashingRunner` whose COMPLETE results name the worker process and the problem
    the runner was built for (in the trial message)."""

    def __init__(self, problem: Any) -> None:
        super().__init__(problem)
        self.tag = f"pid {os.getpid()} seqlen_q {problem.seqlen_q}"

    def evaluate(self, config: Mapping[str, int]) -> TrialResult:
        res = super().evaluate(config)
        return TrialResult(res.state, self.tag, res.median_ms, res.p20_ms, res.p80_ms,
                           res.tflops, res.compile_s)


def tagged_runner(spec: Any, problem: Any, device: Any, options: Any) -> TaggedRunner:
    return TaggedRunner(problem)


RELEASED_ENV = "FLASHTUNE_TEST_RELEASED"  # a file each dropped ReleaseMarkingRunner writes to


class ReleaseMarkingRunner(CrashingRunner):
    """:class:`CrashingRunner` that notes in the file ``$FLASHTUNE_TEST_RELEASED`` when it is
    freed (its process id and problem): whether a parked worker let go of its runner."""

    def __init__(self, problem: Any) -> None:
        super().__init__(problem)
        self.problem = problem

    def __del__(self) -> None:
        path = os.environ.get(RELEASED_ENV)
        if path:
            with open(path, "a") as f:
                f.write(f"{os.getpid()} {self.problem.seqlen_q}\n")


def release_marking_runner(spec: Any, problem: Any, device: Any,
                           options: Any) -> ReleaseMarkingRunner:
    return ReleaseMarkingRunner(problem)
