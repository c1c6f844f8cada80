"""Several GPUs on one host: one tuning worker process per GPU, one shared database.

:func:`tune_on_gpus` splits the work into tasks and runs them on worker processes (spawn
context), one per GPU, each started with ``CUDA_VISIBLE_DEVICES`` set to its GPU so torch
and triton see that one device. Workers take tasks from a shared queue until it is empty,
so a GPU that finishes early takes the next problem.

* With at least as many problems as GPUs, a task is one whole problem.
* With fewer, each problem's study is shared by ``len(gpus) // len(problems)`` workers,
  each running its share of ``trials``: the store numbers trials per study atomically and
  ``offer_best`` keeps the fastest confirmed config, so concurrent workers of one study
  neither collide nor lose the best; TPE's constant liar keeps them apart.

Results come back as JSON over a queue. A worker that dies (a crashed driver, say) loses
only the task it held: the parent reports which, the other workers go on, and running the
same command again resumes that study (its stale trials are failed on resume). Under the
Triton interpreter the "GPUs" are just worker slots, which is how the tests run this on CPU.
"""

from __future__ import annotations

import json
import logging
import os
import queue as queue_mod
from collections.abc import Sequence
from dataclasses import asdict, replace
from multiprocessing import get_context
from typing import Any

from flashtune.autotune.options import TuneOptions, TuneResult
from flashtune.core.errors import FlashtuneError
from flashtune.core.problem import AttentionProblem

log = logging.getLogger(__name__)

__all__ = ["WorkerError", "plan_tasks", "tune_on_gpus"]


class WorkerError(FlashtuneError, RuntimeError):
    """A tuning worker process died; ``results`` holds what the others finished."""

    def __init__(self, message: str, results: list[Any]) -> None:
        super().__init__(message)
        self.results = results


def plan_tasks(problems: Sequence[AttentionProblem], trials: int,
               n_workers: int) -> list[tuple[int, int]]:
    """``(problem index, trials)`` tasks: one per problem, or a problem's trials split over
    ``n_workers // len(problems)`` workers when there are fewer problems than workers."""
    shares = max(1, n_workers // max(1, len(problems)))
    tasks = []
    for i in range(len(problems)):
        n = min(shares, trials)
        for j in range(n):
            tasks.append((i, trials // n + (1 if j < trials % n else 0)))
    return tasks


def _result_to_json(result: TuneResult) -> str:
    data = asdict(result)
    data["problem"] = result.problem.key()
    return json.dumps(data)


def _result_from_json(text: str) -> TuneResult:
    data = json.loads(text)
    data["problem"] = AttentionProblem.from_key(data["problem"])
    return TuneResult(**data)


def _worker(slot: int, gpu: int, problem_keys: list[dict[str, Any]], options_json: str,
            db_url: str, tasks: Any, results: Any, progress: bool) -> None:
    """One worker: pin the GPU, then run tasks until the queue is empty."""
    options = TuneOptions(**json.loads(options_json))
    if options.seed is not None:  # workers sharing a study must not propose the same configs
        options = replace(options, seed=(options.seed + slot) % 2**32)  # Optuna's range
    if not options.interpret:
        os.environ["CUDA_VISIBLE_DEVICES"] = str(gpu)  # before torch initialises CUDA
    from flashtune.autotune.trial_loop import tune_on_device

    while True:
        try:
            index, trials = tasks.get_nowait()
        except queue_mod.Empty:
            return
        results.put(("start", slot, index, None))
        problem = AttentionProblem.from_key(problem_keys[index])
        [res] = tune_on_device([problem], replace(options, trials=trials), db_url=db_url,
                               progress=progress, progress_position=slot)
        results.put(("done", slot, index, _result_to_json(res)))


def tune_on_gpus(problems: Sequence[AttentionProblem], options: TuneOptions, *, db_url: str,
                 gpus: Sequence[int], progress: bool = False) -> list[TuneResult]:
    """Tune ``problems`` with one worker process per entry of ``gpus``; see the module doc.

    Returns one ``TuneResult`` per task, by problem (a problem split over several workers
    gives one result per share; each reports the study's stored best). Raises
    :class:`WorkerError` if a worker died, after the others have finished.
    """
    if not gpus:
        raise ValueError("gpus must name at least one GPU index")
    if len(set(gpus)) != len(gpus):
        raise ValueError(f"gpus has duplicates: {list(gpus)}")
    # create both schemas (flashtune's and Optuna's) once, before the workers race to
    from flashtune.autotune.study import _optuna_storage
    from flashtune.db import open_store

    open_store(db_url).close()
    _optuna_storage(db_url)
    ctx = get_context("spawn")
    tasks_plan = plan_tasks(problems, options.trials, len(gpus))
    tasks, results = ctx.Queue(), ctx.Queue()
    for task in tasks_plan:
        tasks.put(task)
    keys = [p.key() for p in problems]
    options_json = json.dumps(asdict(options))
    procs = [ctx.Process(target=_worker, name=f"flashtune-gpu{gpu}",
                         args=(slot, gpu, keys, options_json, db_url, tasks, results, progress))
             for slot, gpu in enumerate(gpus)]
    for p in procs:
        p.start()
    held: dict[int, int] = {}  # worker slot -> problem index it is tuning
    done: list[tuple[int, TuneResult]] = []
    lost: list[str] = []

    def drain(timeout: float) -> bool:
        """Handle one message from the workers; False if none came within ``timeout``."""
        try:
            kind, slot, index, payload = results.get(timeout=timeout)
        except queue_mod.Empty:
            return False
        if kind == "start":
            held[slot] = index
        else:
            held.pop(slot, None)
            done.append((index, _result_from_json(payload)))
        return True

    alive = set(range(len(procs)))
    while alive:
        drain(0.5)
        for slot in [s for s in alive if not procs[s].is_alive()]:
            procs[slot].join()
            while drain(0.1):  # what it sent before it exited
                pass
            alive.discard(slot)
            if procs[slot].exitcode != 0:
                what = problems[held.pop(slot)].describe() if slot in held else "no task"
                lost.append(f"worker on GPU {gpus[slot]} died (exit code "
                            f"{procs[slot].exitcode}) while tuning {what}")
    done.sort(key=lambda item: item[0])
    out = [res for _, res in done]
    if lost:
        raise WorkerError("; ".join(lost) + ". Run the same command again to resume.", out)
    return out
