"""Parallel precompilation of candidate configs (GPU only).

Compiling a Triton kernel takes seconds of CPU; timing it takes milliseconds of GPU. A
process pool (spawn context) compiles a batch of candidates with ``JITFunction.warmup``
into a shared ``TRITON_CACHE_DIR``, so the runner's first launch of each is a cache hit.
Errors are returned, never raised: the runner will meet (and record) them again anyway.
"""

from __future__ import annotations

import atexit
import logging
import os
import tempfile
from collections.abc import Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from multiprocessing import get_context
from typing import Any

from flashtune.core.problem import AttentionProblem
from flashtune.core.spec import TemplateSpec
from flashtune.db.jsonutil import canonical_json

log = logging.getLogger(__name__)

__all__ = ["precompile", "share_cache_dir", "shutdown_pool"]


def _compile_one(template: str, problem_key: dict[str, Any], config: dict[str, int]) -> str | None:
    """Worker: compile one config; the error's first line or None."""
    try:
        from flashtune.kernel_templates import get_template

        spec = get_template(template)
        assert spec.warmup_launches is not None
        problem = spec.problem_type.from_key(problem_key)
        for kernel, args, kwargs, grid in spec.warmup_launches(problem, config):
            kernel.warmup(*args, grid=grid, **kwargs)
        return None
    except BaseException as exc:  # noqa: BLE001 - returned, never raised
        lines = [t for t in str(exc).splitlines() if t.strip()]
        return f"{type(exc).__name__}: {lines[0].strip() if lines else ''}"[:300]


def share_cache_dir() -> str:
    """Set ``TRITON_CACHE_DIR`` if unset (to a folder under the temp dir) and return it:
    the compile pool's processes, the candidate worker and this process must all find the
    kernels there, so a process that will start them calls this first (a candidate worker
    spawned before it was set would look in Triton's default folder and compile again)."""
    if not os.environ.get("TRITON_CACHE_DIR"):
        os.environ["TRITON_CACHE_DIR"] = os.path.join(tempfile.gettempdir(),
                                                      "flashtune-triton-cache")
    return os.environ["TRITON_CACHE_DIR"]


def precompile(spec: TemplateSpec, problem: AttentionProblem, configs: Sequence[Mapping[str, int]], *,
               workers: int | None) -> dict[str, str | None]:
    """Compile ``configs`` in a process pool; canonical config JSON -> error or None.

    Returns ``{}`` under the Triton interpreter (nothing to compile), for templates without
    a warmup-argument builder, and for ``workers`` <= 1 or an empty batch. Sets
    ``TRITON_CACHE_DIR`` (inherited by the workers and used by this process) if unset.
    """
    from flashtune.core.device import interpreting

    if interpreting() or not configs or spec.warmup_launches is None:
        return {}
    workers = workers if workers is not None else min(len(configs), os.cpu_count() or 1)
    if workers <= 1:
        return {}
    share_cache_dir()
    results: dict[str, str | None] = {}
    key = problem.key()
    try:
        pool = _pool(workers)
        futures = {pool.submit(_compile_one, spec.name, key, dict(c)): canonical_json(dict(c))
                   for c in configs}
        for fut in as_completed(futures):
            try:
                results[futures[fut]] = fut.result()
            except BaseException as exc:  # noqa: BLE001 - a dead worker, say
                results[futures[fut]] = f"{type(exc).__name__}: {exc}"[:300]
    except Exception as exc:  # noqa: BLE001 - the pool itself failed: compile lazily instead
        log.warning("precompile pool failed (%s); configs compile on first launch", exc)
        shutdown_pool()
    if any(r is not None and r.startswith("BrokenProcessPool") for r in results.values()):
        shutdown_pool()  # a worker died: start a fresh pool next time
    return results


# One pool per process, kept across batches and problems: spawning workers (each importing
# torch and triton and creating a CUDA context) costs seconds, far more than a batch's compile.
_POOL: tuple[int, ProcessPoolExecutor] | None = None


def _pool(workers: int) -> ProcessPoolExecutor:
    global _POOL
    if _POOL is None or _POOL[0] != workers:
        shutdown_pool()
        _POOL = (workers, ProcessPoolExecutor(max_workers=workers,
                                              mp_context=get_context("spawn")))
    return _POOL[1]


def shutdown_pool(*, wait: bool = False) -> None:
    """Stop this process's compile pool (``wait``: until its workers have exited).

    A process that :mod:`multiprocessing` started must call it, with ``wait``, before its
    target returns: such a process runs no ``atexit`` handler, and multiprocessing's own
    exit joins the pool's idle workers, which never return (a ``tune --gpus`` worker so
    hung after its last shape until the command's timeout killed it)."""
    global _POOL
    if _POOL is not None:
        pool, _POOL = _POOL[1], None
        pool.shutdown(wait=wait, cancel_futures=True)


atexit.register(shutdown_pool)
