"""Several GPUs on one host: one tuning worker process per GPU, one shared database.

:func:`tune_on_gpus` splits the work into tasks and runs them on worker processes (spawn
context), one per GPU, each started with ``CUDA_VISIBLE_DEVICES`` set to its GPU so torch
and triton see that one device. Workers take the next task from a shared counter until none
is left, so a GPU that finishes early takes the next problem. (Not from a queue: a
``get_nowait`` while another worker reads the queue answers Empty, and that worker would
stop with tasks still waiting.)

* With at least as many problems as GPUs, a task is one whole problem.
* With fewer, each problem's study is shared by ``len(gpus) // len(problems)`` workers,
  each running its share of ``trials``: the store numbers trials per study atomically and
  ``offer_best`` keeps the fastest confirmed config, so concurrent workers of one study
  neither collide nor lose the best; TPE's constant liar keeps them apart.

Results come back as JSON over a pipe per worker, written before the worker goes on, so
what a worker reported survives its death (a queue's feeder thread would drop it). A
worker that dies (a crashed driver, say) loses
only the task it held: the parent reports which, the other workers go on, and running the
same command again resumes that study (its stale trials are failed on resume). Under the
Triton interpreter the "GPUs" are just worker slots, which is how the tests run this on CPU.

:func:`tune_op_on_gpus` does the same for ``tune --op``: a task is one whole problem, on which
a worker runs :func:`flashtune.autotune.select.tune_op` (every implementation searched, the
leaders timed side by side on that worker's GPU, the choice stored). A worker's
:class:`~flashtune.core.errors.FlashtuneError` for a problem (one the runtime would refuse,
say) is reported for that problem and the worker goes on; a worker that dies loses the
problem it held. With ``deadline`` a worker starts no problem after that time once it has
tuned one (so every command makes progress).

Every worker stops on SIGTERM as the CLI does (the trial in flight failed, its run recorded
INTERRUPTED); the parent, stopped or interrupted itself, sends SIGTERM to the workers still
running and waits for them, so a killed command leaves no RUNNING run behind a live worker.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, replace
from multiprocessing import get_context
from multiprocessing.connection import wait
from typing import TYPE_CHECKING, Any

from flashtune.autotune.options import TuneOptions, TuneResult, tuning_device
from flashtune.core.errors import FlashtuneError
from flashtune.core.problem import AttentionProblem

if TYPE_CHECKING:
    from flashtune.autotune.select import OpResult

log = logging.getLogger(__name__)

__all__ = ["WorkerError", "plan_tasks", "tune_on_gpus", "tune_op_on_gpus"]

# how long the parent waits for workers to finish their run records after SIGTERM
_STOP_WAIT_S = 30.0


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


def _take(counter: Any, count: int) -> int | None:
    """The next task's index from the shared ``counter`` (a ``multiprocessing.Value``), or
    None once all ``count`` are taken. It waits for the counter's lock, so a worker never
    stops because another is taking a task at the same moment."""
    with counter.get_lock():
        index = counter.value
        if index >= count:
            return None
        counter.value = index + 1
    return index


def _result_to_json(result: TuneResult) -> str:
    data = asdict(result)
    data["problem"] = result.problem.key()
    return json.dumps(data)


def _result_from_json(text: str) -> TuneResult:
    data = json.loads(text)
    data["problem"] = AttentionProblem.from_key(data["problem"])
    return TuneResult(**data)


def _leader_from_dict(data: dict[str, Any]) -> Any:
    from flashtune.autotune.select import Leader

    return Leader(**data)


def _op_result_to_json(result: OpResult) -> str:
    return json.dumps({
        "problem": result.problem.key(), "op": result.op, "device_name": result.device_name,
        "leaders": [asdict(x) for x in result.leaders],
        "skipped": [list(x) for x in result.skipped],
        "results": [_result_to_json(r) for r in result.results],
        "reused": result.reused, "stale": result.stale, "seconds": result.seconds})


def _op_result_from_json(text: str) -> OpResult:
    from flashtune.autotune.select import OpResult

    data = json.loads(text)
    return OpResult(AttentionProblem.from_key(data["problem"]), data["op"],
                    data["device_name"], tuple(_leader_from_dict(x) for x in data["leaders"]),
                    tuple((a, b) for a, b in data["skipped"]),
                    tuple(_result_from_json(r) for r in data["results"]),
                    reused=data["reused"], stale=data["stale"], seconds=data["seconds"])


def _stop_on_sigterm() -> None:
    """SIGTERM stops this worker as it stops the CLI (``flashtune.cli.tune_commands``): the
    request is recorded (:mod:`flashtune.autotune.stop`) and raised as Ctrl-C, so the run in
    flight is recorded INTERRUPTED."""
    from flashtune.autotune import stop

    def handler(signum: int, frame: Any) -> None:
        stop.request("SIGTERM")
        if not stop.in_finalizer(frame):
            raise stop.Terminated("SIGTERM")

    signal.signal(signal.SIGTERM, handler)


def _pin(slot: int, gpu: int, options_json: str, log_level: int) -> TuneOptions:
    """A worker's options, its GPU made the only one it sees, SIGTERM handled, and below
    WARNING (the parent runs with ``-v``) its log on stderr as the parent's, with times and
    its GPU (a spawned process configures no logging of its own)."""
    _stop_on_sigterm()
    if log_level < logging.WARNING:
        # as the parent's: other libraries' info only with -vv
        logging.basicConfig(level=log_level if log_level <= logging.DEBUG else logging.WARNING,
                            format=f"%(asctime)s gpu{gpu} %(levelname)s %(name)s: %(message)s")
        logging.getLogger("flashtune").setLevel(log_level)
    options = TuneOptions(**json.loads(options_json))
    if options.seed is not None:  # workers sharing a study must not propose the same configs
        options = replace(options, seed=(options.seed + slot) % 2**32)  # Optuna's range
    if not options.interpret:
        os.environ["CUDA_VISIBLE_DEVICES"] = str(gpu)  # before torch initialises CUDA
    return options


@contextmanager
def _compile_pool_stopped() -> Iterator[None]:
    """Stop the worker's compile pool when its work ends: a process multiprocessing
    started would otherwise wait on the pool's idle workers forever as it exits
    (:func:`flashtune.autotune.precompile.shutdown_pool`)."""
    try:
        yield
    finally:
        from flashtune.autotune.precompile import shutdown_pool

        shutdown_pool(wait=True)


def _worker(slot: int, gpu: int, problem_keys: list[dict[str, Any]], options_json: str,
            db_url: str, tasks: list[tuple[int, int]], counter: Any, results: Any,
            progress: bool, log_level: int) -> None:
    """One worker: pin the GPU, then run ``tasks`` (taken through ``counter``) until none
    is left."""
    options = _pin(slot, gpu, options_json, log_level)
    from flashtune.autotune.trial_loop import shared_runner_factory, tune_on_device

    # one candidate worker for every task this GPU takes (each costs seconds to start)
    with _compile_pool_stopped(), \
            shared_runner_factory(options, None, tuning_device(options)) as factory:
        while (taken := _take(counter, len(tasks))) is not None:
            index, trials = tasks[taken]
            results.send(("start", slot, index, None))
            problem = AttentionProblem.from_key(problem_keys[index])
            try:
                [res] = tune_on_device([problem], replace(options, trials=trials),
                                       db_url=db_url, progress=progress,
                                       progress_position=slot, shared_factory=factory)
            except KeyboardInterrupt:
                raise SystemExit(128 + signal.SIGTERM) from None  # recorded INTERRUPTED
            results.send(("done", slot, index, _result_to_json(res)))


def _op_worker(slot: int, gpu: int, problem_keys: list[dict[str, Any]], op: str,
               impls: list[str] | None, options_json: str, db_url: str, counter: Any,
               results: Any, progress: bool, skip_tuned: bool, deadline: float | None,
               runner_factory: Callable[..., Any] | None, log_level: int) -> None:
    """One ``tune --op`` worker: pin the GPU, then choose for the problems it takes through
    ``counter`` until none is left or ``deadline`` has passed (once it has tuned one)."""
    options = _pin(slot, gpu, options_json, log_level)
    from flashtune.autotune.select import past_deadline, tune_op
    from flashtune.autotune.trial_loop import shared_runner_factory

    tuned = False  # past the deadline a worker starts no shape once it has tuned one
    longest = 0.0  # nor one that its longest shape so far would carry past it
    # one candidate worker for every shape this GPU takes (each costs seconds to start)
    with _compile_pool_stopped(), \
            shared_runner_factory(options, runner_factory, tuning_device(options)) as factory:
        log.info("worker %d on GPU %d: ready", slot, gpu)
        while not tuned or not past_deadline(deadline, longest):
            if (index := _take(counter, len(problem_keys))) is None:
                return
            results.send(("start", slot, index, None))
            problem = AttentionProblem.from_key(problem_keys[index])
            try:
                [res] = tune_op([problem], op, options, impls=impls, db_url=db_url,
                                progress=progress, progress_position=slot,
                                skip_tuned=skip_tuned, shared_factory=factory,
                                _runner_factory=runner_factory)
            except FlashtuneError as exc:  # this problem's: report it, go on with the next
                results.send(("error", slot, index, str(exc)))
                continue
            except KeyboardInterrupt:
                raise SystemExit(128 + signal.SIGTERM) from None  # recorded INTERRUPTED
            if not res.reused:
                tuned, longest = True, max(longest, res.seconds)
            results.send(("done", slot, index, _op_result_to_json(res)))


def tune_on_gpus(problems: Sequence[AttentionProblem], options: TuneOptions, *, db_url: str,
                 gpus: Sequence[int], progress: bool = False) -> list[TuneResult]:
    """Tune ``problems`` with one worker process per entry of ``gpus``; see the module doc.

    Returns one ``TuneResult`` per task, by problem (a problem split over several workers
    gives one result per share; each reports the study's stored best). Raises
    :class:`WorkerError` if a worker died, after the others have finished.
    """
    _prepare(db_url, gpus)
    ctx = get_context("spawn")
    tasks = plan_tasks(problems, options.trials, len(gpus))
    counter = ctx.Value("q", 0)
    channels = [ctx.Pipe(duplex=False) for _ in gpus]
    keys = [p.key() for p in problems]
    options_json = json.dumps(asdict(options))
    procs = [ctx.Process(target=_worker, name=f"flashtune-gpu{gpu}",
                         args=(slot, gpu, keys, options_json, db_url, tasks, counter,
                               channels[slot][1], progress, _log_level()))
             for slot, gpu in enumerate(gpus)]
    done, lost = _supervise(procs, channels, problems, gpus, _result_from_json)
    done.sort(key=lambda item: item[0])
    out = [res for _, res in done]
    if lost:
        raise WorkerError("; ".join(lost) + ". Run the same command again to resume.", out)
    return out


def _log_level() -> int:
    """The level flashtune's log runs at here, for the workers to log at."""
    return logging.getLogger("flashtune").getEffectiveLevel()


def _prepare(db_url: str, gpus: Sequence[int]) -> None:
    """Check ``gpus``; create both schemas (flashtune's and Optuna's) once, before the
    workers race to."""
    if not gpus:
        raise ValueError("gpus must name at least one GPU index")
    if len(set(gpus)) != len(gpus):
        raise ValueError(f"gpus has duplicates: {list(gpus)}")
    from flashtune.autotune.study import _optuna_storage
    from flashtune.db import open_store

    open_store(db_url).close()
    _optuna_storage(db_url)


def _supervise(procs: list[Any], channels: Sequence[tuple[Any, Any]],
               problems: Sequence[AttentionProblem], gpus: Sequence[int],
               decode: Callable[[str], Any]) -> tuple[list[tuple[int, Any]], list[str]]:
    """Start the workers and collect their messages until every one has exited.

    ``channels`` holds each worker's ``(reader, writer)`` pipe, by slot. Returns
    ``(done, lost)``: ``(problem index, decoded result)`` per task finished, and one line
    per problem lost (a worker died holding it, or reported an error for it). If this
    process is interrupted (SIGTERM, Ctrl-C), the workers still running get SIGTERM and are
    waited for (up to :data:`_STOP_WAIT_S`, then killed) before the exception goes on.
    """
    held: dict[int, int] = {}  # worker slot -> problem index it is tuning
    done: list[tuple[int, Any]] = []
    lost: list[str] = []
    readers = [reader for reader, _ in channels]
    listening = set(range(len(readers)))  # slots whose pipe has not reached its end

    def handle(slot: int) -> None:
        """Handle one message on ``slot``'s pipe, or note that the pipe has ended."""
        try:
            kind, _, index, payload = readers[slot].recv()
        except EOFError:
            listening.discard(slot)
            return
        if kind == "start":
            held[slot] = index
        elif kind == "error":
            held.pop(slot, None)
            lost.append(f"worker on GPU {gpus[slot]} could not tune "
                        f"{problems[index].describe()}: {payload}")
        else:
            held.pop(slot, None)
            done.append((index, decode(payload)))

    try:
        for p in procs:
            p.start()
        for _, writer in channels:  # the workers hold theirs: a pipe ends when its worker does
            writer.close()
        alive = set(range(len(procs)))
        while alive:
            for reader in wait([readers[s] for s in listening], 0.5):
                handle(readers.index(reader))
            for slot in [s for s in alive if not procs[s].is_alive()]:
                procs[slot].join()
                while slot in listening and readers[slot].poll(0):  # what it sent
                    handle(slot)
                alive.discard(slot)
                if procs[slot].exitcode != 0:
                    what = problems[held.pop(slot)].describe() if slot in held else "no task"
                    lost.append(f"worker on GPU {gpus[slot]} died (exit code "
                                f"{procs[slot].exitcode}) while tuning {what}")
    except BaseException:
        _stop_workers(procs)
        raise
    finally:
        for reader in readers:
            reader.close()
    return done, lost


def _stop_workers(procs: Sequence[Any]) -> None:
    """SIGTERM to the workers still running, then wait for them to record their runs."""
    running = [p for p in procs if p.pid is not None and p.is_alive()]
    for p in running:
        p.terminate()
    until = time.monotonic() + _STOP_WAIT_S
    for p in running:
        p.join(max(0.0, until - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()


def tune_op_on_gpus(problems: Sequence[AttentionProblem], op: str, options: TuneOptions, *,
                    db_url: str | None, gpus: Sequence[int], impls: Sequence[str] | None = None,
                    progress: bool = False, skip_tuned: bool = False,
                    deadline: float | None = None,
                    _runner_factory: Callable[..., Any] | None = None) -> list[OpResult]:
    """:func:`~flashtune.autotune.select.tune_op` over ``problems`` with one worker process
    per entry of ``gpus``, each taking whole problems through a shared counter; see the module
    doc. ``db_url`` None: ``$FLASHTUNE_DB`` or the default file. ``_runner_factory``
    (tests) must be importable by name in the workers.

    Returns:
        One :class:`~flashtune.autotune.select.OpResult` per problem finished, in the order
        of ``problems``: every problem unless ``deadline`` passed (each worker starts no
        problem after it once it has tuned one; those no worker started are left out).
    Raises:
        WorkerError (after the others have finished) when a worker died or could not tune
        a problem, with the finished results; ValueError for ``gpus`` empty or repeated,
        or an in-memory database.
    """
    from flashtune.autotune.study import _is_memory_url
    from flashtune.db import default_db_url

    db_url = default_db_url() if db_url is None else str(db_url)
    if _is_memory_url(db_url):
        raise ValueError("several GPU workers need a database they can share; an "
                         "in-memory database is private to one process")
    _prepare(db_url, gpus)
    ctx = get_context("spawn")
    counter = ctx.Value("q", 0)
    channels = [ctx.Pipe(duplex=False) for _ in gpus]
    keys = [p.key() for p in problems]
    options_json = json.dumps(asdict(options))
    impl_list = None if impls is None else list(impls)
    log.info("%d shape(s) of op %s on GPUs %s: starting the workers", len(problems), op,
             ",".join(map(str, gpus)))
    procs = [ctx.Process(target=_op_worker, name=f"flashtune-gpu{gpu}",
                         args=(slot, gpu, keys, op, impl_list, options_json, db_url, counter,
                               channels[slot][1], progress, skip_tuned, deadline, _runner_factory,
                               _log_level()))
             for slot, gpu in enumerate(gpus)]
    done, lost = _supervise(procs, channels, problems, gpus, _op_result_from_json)
    done.sort(key=lambda item: item[0])
    out = [res for _, res in done]
    if lost:
        raise WorkerError("; ".join(lost) + ". Run the same command again (with "
                          "--skip-tuned) to finish.", out)
    return out
