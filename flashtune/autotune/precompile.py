"""Parallel precompilation of candidate configs (GPU only).

Compiling a Triton kernel takes seconds of CPU; timing it takes milliseconds of GPU. A
process pool (spawn context) compiles a batch of candidates with ``JITFunction.warmup``
into a shared ``TRITON_CACHE_DIR``, so the runner's first launch of each is a cache hit.
Errors are returned, never raised: the runner will meet (and record) them again anyway.
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import tempfile
from concurrent.futures import ProcessPoolExecutor, as_completed
from multiprocessing import get_context
from typing import Any, Mapping, Sequence

from flashtune.autotune.problems import AttentionProblem
from flashtune.db.jsonutil import canonical_json

log = logging.getLogger(__name__)

__all__ = ["attn_bwd_warmup_args", "attn_decode_warmup_args", "attn_fwd_warmup_args",
           "precompile", "warmup_launches"]


class _Shaped:
    """A shape-only stand-in for a contiguous tensor (what ``JITFunction.warmup`` needs):
    dtype, shape, strides, a 16-byte aligned address."""

    def __init__(self, dtype: Any, shape: tuple[int, ...]) -> None:
        self.dtype, self.shape = dtype, tuple(shape)
        strides, acc = [], 1
        for size in reversed(self.shape):
            strides.append(acc)
            acc *= size
        self._strides = tuple(reversed(strides))

    def stride(self, dim: int | None = None) -> Any:
        return self._strides if dim is None else self._strides[dim]

    def element_size(self) -> int:
        return int(self.dtype.itemsize)

    @staticmethod
    def data_ptr() -> int:
        return 0


def attn_fwd_warmup_args(problem: AttentionProblem, config: Mapping[str, int], *,
                         return_lse: bool = False
                         ) -> tuple[tuple[Any, ...], dict[str, Any], tuple[int, int]]:
    """``(args, kwargs, grid)`` for ``attn_fwd_kernel.warmup``: what the launcher passes for
    contiguous, aligned q/k/v (built by the launcher's own
    :func:`~flashtune.kernel_templates.attn_fwd.launcher.kernel_args`)."""
    import torch

    from flashtune.kernel_templates.attn_fwd.launcher import kernel_args, tma_ok

    p = problem
    dt = torch.float16 if p.dtype == "fp16" else torch.bfloat16
    q = _Shaped(dt, (p.batch, p.heads_q, p.seqlen_q, p.head_dim))
    k = _Shaped(dt, (p.batch, p.heads_kv, p.seqlen_k, p.head_dim))
    out = _Shaped(dt, q.shape)
    lse = _Shaped(torch.float32, q.shape[:3]) if return_lse else None
    use_tma = bool(config.get("USE_TMA", 0)) and tma_ok(q, k, out)
    return kernel_args(q, k, k, out, lse, config, causal=p.causal,
                       scale=1.0 / math.sqrt(p.head_dim), use_tma=use_tma, upcast_dot=False)


def attn_bwd_warmup_args(problem: AttentionProblem, config: Mapping[str, int]
                         ) -> list[tuple[Any, tuple[Any, ...], dict[str, Any], tuple[int, int]]]:
    """``(kernel, args, kwargs, grid)`` of attn_bwd's three kernels for contiguous inputs
    (built by the launcher's own
    :func:`~flashtune.kernel_templates.attn_bwd.launcher.kernel_args`)."""
    import torch

    from flashtune.kernel_templates.attn_bwd.launcher import (
        kernel_args,
        kv_splits,
        partial_shape,
    )

    p = problem
    dt = torch.float16 if p.dtype == "fp16" else torch.bfloat16
    q = _Shaped(dt, (p.batch, p.heads_q, p.seqlen_q, p.head_dim))
    k = _Shaped(dt, (p.batch, p.heads_kv, p.seqlen_k, p.head_dim))
    lse = _Shaped(torch.float32, q.shape[:3])
    splits = kv_splits(config, p.heads_q // p.heads_kv)
    part = _Shaped(torch.float32, partial_shape(k, splits)) if splits > 1 else None
    launches = kernel_args(q, k, k, q, lse, q, lse, q, k, k, config, causal=p.causal,
                           scale=1.0 / math.sqrt(p.head_dim), upcast_dot=False, part_k=part,
                           part_v=part)
    return list(launches.values())


def attn_decode_warmup_args(problem: AttentionProblem, config: Mapping[str, int], *,
                            return_lse: bool = False
                            ) -> list[tuple[Any, tuple[Any, ...], dict[str, Any], tuple[int, ...]]]:
    """``(kernel, args, kwargs, grid)`` of attn_decode's split (and combine) kernels for
    contiguous dense q/k/v, as the tuner and :func:`flashtune.attention`'s decode route launch
    them (built by the launcher's own
    :func:`~flashtune.kernel_templates.attn_decode.launcher.kernel_args`)."""
    import torch

    from flashtune.kernel_templates.attn_decode.launcher import kernel_args, partial_shapes

    p = problem
    dt = torch.float16 if p.dtype == "fp16" else torch.bfloat16
    q = _Shaped(dt, (p.batch, p.heads_q, p.seqlen_q, p.head_dim))
    k = _Shaped(dt, (p.batch, p.heads_kv, p.seqlen_k, p.head_dim))
    lse = _Shaped(torch.float32, q.shape[:3]) if return_lse else None
    o_part = lse_part = None
    if config["NUM_SPLITS"] > 1:
        o_shape, l_shape = partial_shapes(q, config["NUM_SPLITS"])
        o_part, lse_part = _Shaped(torch.float32, o_shape), _Shaped(torch.float32, l_shape)
    return kernel_args(q, k, k, _Shaped(dt, q.shape), lse, None, None, o_part, lse_part,
                       config, seqlen_k=p.seqlen_k, causal=p.causal,
                       scale=1.0 / math.sqrt(p.head_dim), upcast_dot=False)


def _attn_fwd_warmups(problem: AttentionProblem, config: Mapping[str, int], *,
                      return_lse: bool = False) -> list[Any]:
    from flashtune.kernel_templates.attn_fwd.kernel import attn_fwd_kernel

    return [(attn_fwd_kernel, *attn_fwd_warmup_args(problem, config, return_lse=return_lse))]


def _attn_bwd_warmups(problem: AttentionProblem, config: Mapping[str, int], *,
                      return_lse: bool = False) -> list[Any]:
    return attn_bwd_warmup_args(problem, config)


# template -> the (kernel, args, kwargs, grid) launches one config compiles
_WARMUP_ARGS = {"attn_fwd": _attn_fwd_warmups, "attn_bwd": _attn_bwd_warmups,
                "attn_decode": attn_decode_warmup_args}


def warmup_launches(template: str, problem: AttentionProblem, config: Mapping[str, int], *,
                    return_lse: bool = False) -> list[Any]:
    """The ``(kernel, args, kwargs, grid)`` launches that compile ``config`` of
    ``template`` for ``problem`` (contiguous inputs): ``kernel.warmup(*args, grid=grid,
    **kwargs)`` each."""
    return _WARMUP_ARGS[template](problem, config, return_lse=return_lse)


def _compile_one(template: str, problem_key: dict[str, Any], config: dict[str, int]) -> str | None:
    """Worker: compile one config; the error's first line or None."""
    try:
        problem = AttentionProblem.from_key(problem_key)
        for kernel, args, kwargs, grid in _WARMUP_ARGS[template](problem, config):
            kernel.warmup(*args, grid=grid, **kwargs)
        return None
    except BaseException as exc:  # noqa: BLE001 - returned, never raised
        lines = [t for t in str(exc).splitlines() if t.strip()]
        return f"{type(exc).__name__}: {lines[0].strip() if lines else ''}"[:300]


def precompile(spec: Any, problem: AttentionProblem, configs: Sequence[Mapping[str, int]], *,
               workers: int | None) -> dict[str, str | None]:
    """Compile ``configs`` in a process pool; canonical config JSON -> error or None.

    Returns ``{}`` under the Triton interpreter (nothing to compile), for templates without
    a warmup-argument builder, and for ``workers`` <= 1 or an empty batch. Sets
    ``TRITON_CACHE_DIR`` (inherited by the workers and used by this process) if unset.
    """
    from flashtune.autotune.devices import interpreting

    if interpreting() or not configs or spec.name not in _WARMUP_ARGS:
        return {}
    workers = workers if workers is not None else min(len(configs), os.cpu_count() or 1)
    if workers <= 1:
        return {}
    if not os.environ.get("TRITON_CACHE_DIR"):
        os.environ["TRITON_CACHE_DIR"] = os.path.join(tempfile.gettempdir(),
                                                      "flashtune-triton-cache")
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
        _shutdown_pool()
    if any(r is not None and r.startswith("BrokenProcessPool") for r in results.values()):
        _shutdown_pool()  # a worker died: start a fresh pool next time
    return results


# One pool per process, kept across batches and problems: spawning workers (each importing
# torch and triton and creating a CUDA context) costs seconds, far more than a batch's compile.
_POOL: tuple[int, ProcessPoolExecutor] | None = None


def _pool(workers: int) -> ProcessPoolExecutor:
    global _POOL
    if _POOL is None or _POOL[0] != workers:
        _shutdown_pool()
        _POOL = (workers, ProcessPoolExecutor(max_workers=workers,
                                              mp_context=get_context("spawn")))
    return _POOL[1]


def _shutdown_pool() -> None:
    global _POOL
    if _POOL is not None:
        _POOL[1].shutdown(wait=False, cancel_futures=True)
        _POOL = None


atexit.register(_shutdown_pool)
