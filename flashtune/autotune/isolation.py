"""Candidate isolation: configs are evaluated in a worker subprocess that may die.

A candidate config can do worse than raise: an illegal memory access leaves the CUDA
context unusable, a kernel can spin forever, a driver bug can kill the process. In isolated
mode (the default on GPUs, see ``TuneOptions.isolate``) :class:`IsolatedRunner` keeps the
real runner in one long-lived worker process (spawn context) and asks it for one config at
a time:

* the worker dies (a signal, ``os.abort``, ``exit``): the trial is RUNTIME_ERROR with the
  signal or exit code in its message, and a fresh worker starts for the next config;
* no answer within ``timeout_s``: the worker is killed, the trial is TIMEOUT, a fresh
  worker starts;
* the runner reports a RUNTIME_ERROR on a GPU and the worker then finds its CUDA context
  broken (a probe launch fails): it says so and exits, and a fresh one starts.

Starting a worker costs seconds (spawn, import torch and triton, a CUDA context). A job's
problems share one: when a runner built by :func:`isolated`'s factory is closed, its live
worker is parked, and the next runner re-initialises it for its own problem (an ``init``
request: the old runner and its tensors are dropped first) instead of spawning another; the
kernels it compiled stay in its in-memory cache. The trial loop
(:func:`flashtune.autotune.trial_loop.tune_on_device`) closes the factory (and the parked
worker) at the end.

Messages are JSON over a pipe (``send_bytes``/``recv_bytes``, at most :data:`WIRE_MAX`
bytes): nothing the worker sends is unpickled. The worker rebuilds its runner from a
factory named ``"module:function"`` (called as ``factory(spec, problem, device, options)``,
like ``tune``'s runner factories) and JSON arguments: the template's name, the problem's
key, the device fingerprint and the tuning options.
"""

from __future__ import annotations

import importlib
import json
import logging
import signal
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict
from multiprocessing import get_context
from typing import Any, TypeVar

from flashtune.autotune.runners import TrialResult
from flashtune.autotune.timing import REP_MS
from flashtune.core.device import DeviceFingerprint
from flashtune.core.errors import ConfigError, FlashtuneError
from flashtune.core.problem import AttentionProblem
from flashtune.db.records import TrialState

log = logging.getLogger(__name__)

__all__ = ["IsolatedFactory", "IsolatedRunner", "IsolationError", "factory_path", "isolated",
           "release_cached_memory"]

WIRE_MAX = 1 << 20  # bytes of one message from the worker
START_TIMEOUT_S = 600.0  # importing torch/triton and building the inputs
STOP_TIMEOUT_S = 5.0


class IsolationError(FlashtuneError, RuntimeError):
    """The candidate worker could not be started, or broke the protocol while re-timing."""


def factory_path(factory: Callable[..., Any] | str) -> str:
    """``"module:qualname"`` of a module-level runner factory (what the worker imports)."""
    if isinstance(factory, str):
        module_part, _, name_part = factory.partition(":")
        if not module_part or not name_part:
            raise ConfigError(f"a runner factory path is 'module:function', got {factory!r}")
        return factory
    module = getattr(factory, "__module__", None)
    name = getattr(factory, "__qualname__", None)
    if not module or not name or "<" in name or module == "__main__":
        raise ConfigError(f"isolated tuning needs a runner factory the worker process can "
                          f"import by name (a module-level function), got {module}.{name}; "
                          f"pass isolate=False to evaluate candidates in this process")
    return f"{module}:{name}"


def _load_factory(path: str) -> Callable[..., Any]:
    module, _, name = path.partition(":")
    obj: Any = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj  # type: ignore[no-any-return]


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _first_line(exc: BaseException) -> str:
    from flashtune.autotune.runners import _first_line as first_line

    return first_line(exc)


# -- the worker process ---------------------------------------------------------------------

def _cuda_broken(runner: Any) -> bool:
    """After a RUNTIME_ERROR on a GPU: can this process still launch work? (An illegal
    memory access poisons the CUDA context for good.)"""
    if getattr(runner, "interpreting", True):
        return False
    try:
        import torch

        torch.cuda.synchronize()
        (torch.ones(1, device="cuda") + 1).item()
        return False
    except Exception:  # noqa: BLE001 - any failure means the context is gone
        return True


def _send(conn: Any, message: Mapping[str, Any]) -> None:
    conn.send_bytes(json.dumps(message, allow_nan=False).encode())


def _build(conn: Any, path: str, init_json: str) -> Any:
    """Build the runner ``init_json`` describes and tell the parent it is ready (or why not:
    then None, and the worker exits)."""
    try:
        from flashtune.autotune.options import TuneOptions
        from flashtune.kernel_templates import get_template

        init = json.loads(init_json)
        runner = _load_factory(path)(
            get_template(init["template"]), AttentionProblem.from_key(init["problem"]),
            DeviceFingerprint(**init["device"]), TuneOptions(**init["options"]))
    except Exception as exc:  # noqa: BLE001 - reported to the parent, then exit
        _send(conn, {"error": _first_line(exc)})
        conn.close()
        return None
    retimes = callable(getattr(runner, "time_config", None)) and \
        not getattr(runner, "interpreting", True)
    flops = getattr(runner, "flops", None)
    _send(conn, {"ready": True, "retimes": retimes,
                 "flops": float(flops) if isinstance(flops, (int, float)) else None})
    return runner


def release_cached_memory() -> None:
    """Free what dropped runners held (their inputs, their references, the blocks torch's
    CUDA allocator cached for them): a parked worker must not keep GPU memory that the
    parent's side-by-side timing or the next runner needs (a math-SDPA candidate at 32k
    tokens left 138 GB cached on an H200), nor the parent what the next shape's worker
    needs (see ``select._side_by_side``)."""
    import gc
    import sys

    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def _serve(conn: Any, path: str, init_json: str) -> None:
    """The worker: build the runner, then answer requests until told to stop; an ``init``
    request replaces the runner with one for another problem, a ``release`` request drops
    it (the worker is parked) and frees its memory."""
    runner = _build(conn, path, init_json)
    if runner is None:
        return
    while True:
        try:
            request = json.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return
        op, config = request.get("op"), request.get("config")
        if op == "init":
            runner = None  # freed before the next one is built
            release_cached_memory()
            runner = _build(conn, path, request["init"])
            if runner is None:
                return
        elif op == "release":
            runner = None
            release_cached_memory()
            _send(conn, {"released": True})
        elif runner is None:  # parked: only init, release or stop
            return
        elif op == "evaluate":
            try:
                res = runner.evaluate(config)
            except Exception as exc:  # noqa: BLE001 - a runner must not raise
                res = TrialResult(TrialState.RUNTIME_ERROR, _first_line(exc))
            broken = res.state is TrialState.RUNTIME_ERROR and _cuda_broken(runner)
            _send(conn, {"result": res.to_dict(), "broken": broken})
            if broken:
                return
        elif op == "time":
            try:
                rep_ms = float(request.get("rep_ms", REP_MS))
                _send(conn, {"timing": list(runner.time_config(config, rep_ms=rep_ms))})
            except Exception as exc:  # noqa: BLE001
                _send(conn, {"error": _first_line(exc), "broken": _cuda_broken(runner)})
        else:
            return


# -- the parent side ------------------------------------------------------------------------

_C = TypeVar("_C", bound="_Closing")


class _Closing:
    """``close()`` at the end of a ``with`` block and when garbage-collected."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self: _C) -> _C:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


class IsolatedRunner(_Closing):
    """A runner whose candidates run in a worker process; see the module docstring.

    ``factory`` is a module-level runner factory (or its ``"module:function"`` path);
    ``timeout_s`` bounds each candidate (compile, check and timing), ``start_timeout_s``
    each worker start. ``restarts`` counts fresh workers after the first. Use as a
    context manager or call :meth:`close`.
    """

    def __init__(self, factory: Callable[..., Any] | str, spec: Any, problem: AttentionProblem,
                 device: DeviceFingerprint, options: Any, *, timeout_s: float | None = None,
                 start_timeout_s: float = START_TIMEOUT_S,
                 parking: IsolatedFactory | None = None) -> None:
        self.path = factory_path(factory)
        self._parking = parking  # where close() leaves a live worker, and _start takes one
        self.timeout_s = timeout_s if timeout_s is not None else options.trial_timeout_s
        self.start_timeout_s = start_timeout_s
        self._init = json.dumps({"template": spec.name, "problem": problem.key(),
                                 "device": device.to_dict(), "options": asdict(options)})
        self._ctx = get_context("spawn")
        self._proc: Any = None
        self._conn: Any = None
        self.restarts = -1
        self.interpreting = True
        self.flops: float | None = None
        self._start()

    # -- worker lifecycle

    def _start(self) -> None:
        if self._adopt():
            return
        parent, child = self._ctx.Pipe(duplex=True)
        proc = self._ctx.Process(target=_serve, args=(child, self.path, self._init),
                                 name="flashtune-candidate", daemon=True)
        proc.start()
        child.close()
        self._proc, self._conn = proc, parent
        self.restarts += 1
        reply, failure = self._receive(self.start_timeout_s)
        if reply is None or not reply.get("ready"):
            self._kill()
            why = failure or str((reply or {}).get("error", "no ready message"))
            raise IsolationError(f"the candidate worker ({self.path}) did not start: {why}")
        self._ready(reply)
        log.debug("candidate worker pid %s ready", proc.pid)

    def _ready(self, reply: Mapping[str, Any]) -> None:
        self.interpreting = not reply.get("retimes", False)
        flops = reply.get("flops")
        self.flops = float(flops) if isinstance(flops, (int, float)) else None

    def _adopt(self) -> bool:
        """Take over the worker a closed runner of the same factory parked, re-initialised
        for this runner's problem; False when there is none or it fails to re-initialise
        (it is stopped then)."""
        parked = self._parking.take() if self._parking is not None else None
        if parked is None:
            return False
        self._proc, self._conn = parked
        try:
            self._conn.send_bytes(json.dumps({"op": "init", "init": self._init}).encode())
        except (OSError, ValueError):
            self._kill()
            return False
        reply, failure = self._receive(self.start_timeout_s)
        if reply is None or not reply.get("ready"):
            log.debug("parked worker not reusable (%s); starting a fresh one",
                      failure or (reply or {}).get("error"))
            self._kill()
            return False
        self.restarts += 1
        self._ready(reply)
        log.debug("candidate worker pid %s re-initialised", self._proc.pid)
        return True

    def _kill(self) -> None:
        proc, conn = self._proc, self._conn
        self._proc = self._conn = None
        if conn is not None:
            conn.close()
        if proc is not None:
            if proc.is_alive():
                proc.kill()
            proc.join(STOP_TIMEOUT_S)

    def _receive(self, timeout: float) -> tuple[dict[str, Any] | None, str | None]:
        """(reply, None), or (None, why there is none) with the worker stopped."""
        conn, proc = self._conn, self._proc
        try:
            ready = conn.poll(timeout)
            data = conn.recv_bytes(WIRE_MAX) if ready else None
        except (EOFError, OSError) as exc:  # died, or an oversized message
            proc.join(STOP_TIMEOUT_S)
            why = _describe_exit(proc.exitcode) if proc.exitcode is not None else \
                f"broke the pipe ({type(exc).__name__})"
            self._kill()
            return None, f"the candidate worker died ({why})"
        if data is None:
            self._kill()
            return None, f"no result within {timeout:g} s"
        try:
            reply = json.loads(data)
            if not isinstance(reply, dict):
                raise ValueError("not a JSON object")
        except ValueError as exc:
            self._kill()
            return None, f"the candidate worker sent an unreadable reply ({exc})"
        return reply, None

    def _request(self, message: Mapping[str, Any]) -> tuple[dict[str, Any] | None, str | None]:
        if self._proc is None:
            self._start()
        try:
            self._conn.send_bytes(json.dumps(message).encode())
        except (OSError, ValueError):
            pass  # it died since the last request: _receive says how
        reply, failure = self._receive(self.timeout_s)
        if reply is not None and reply.get("broken"):
            self._proc.join(STOP_TIMEOUT_S)  # it exits by itself
            self._kill()
        return reply, failure

    # -- the Runner protocol

    def evaluate(self, config: Mapping[str, int]) -> TrialResult:
        t0 = time.perf_counter()
        reply, failure = self._request({"op": "evaluate", "config": dict(config)})
        if reply is None:
            assert failure is not None
            timed_out = failure.startswith("no result")
            state = TrialState.TIMEOUT if timed_out else TrialState.RUNTIME_ERROR
            what = "killed" if timed_out else "restarted"
            return TrialResult(state, f"{failure}; worker {what}, a fresh one takes the next "
                                      f"config"[:300], compile_s=None)
        try:
            res = TrialResult.from_dict(reply["result"])
        except (KeyError, TypeError, ValueError) as exc:
            self._kill()
            return TrialResult(TrialState.RUNTIME_ERROR,
                               f"the candidate worker sent an invalid result ({exc})"[:300])
        log.debug("isolated %s: %s in %.2f s", dict(config), res.state.value,
                  time.perf_counter() - t0)
        return res

    def time_config(self, config: Mapping[str, int] | None = None,
                    rep_ms: float = REP_MS) -> tuple[float, float, float]:
        """(median, p20, p80) ms, measured by the worker for ``rep_ms`` (for interleaved
        re-timing)."""
        reply, failure = self._request({"op": "time", "config": dict(config or {}),
                                        "rep_ms": rep_ms})
        if reply is None:
            raise IsolationError(failure)
        if "timing" not in reply:
            raise IsolationError(str(reply.get("error", "no timing in the reply")))
        median, p20, p80 = (float(x) for x in reply["timing"])
        return median, p20, p80

    def close(self) -> None:
        """Stop the worker (politely, then by force), or park it with the factory that made
        this runner for that factory's next runner."""
        if self._proc is None:
            return
        parking = self._parking
        if parking is not None and not (self._proc.is_alive() and self._released()):
            parking = None
        if self._proc is None:  # it did not release: stopped
            return
        proc, conn = self._proc, self._conn
        self._proc = self._conn = None
        if parking is not None:
            parking.park(proc, conn)
        else:
            _stop(proc, conn)

    def _released(self) -> bool:
        """Ask the worker to drop this runner and free its GPU memory before it is parked;
        False (the worker stopped) when it does not confirm."""
        try:
            self._conn.send_bytes(json.dumps({"op": "release"}).encode())
        except (OSError, ValueError):
            self._kill()
            return False
        reply, _ = self._receive(STOP_TIMEOUT_S)
        if reply is not None and reply.get("released"):
            return True
        if self._proc is not None:
            self._kill()
        return False

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid


class IsolatedFactory(_Closing):
    """A runner factory whose runners evaluate in a worker process, one worker carried from
    each closed runner to the next (see the module docstring). :meth:`close` stops the
    parked worker; also a context manager."""

    def __init__(self, factory: Callable[..., Any] | str) -> None:
        self.path = factory_path(factory)
        self._parked: tuple[Any, Any] | None = None  # (process, connection)

    def __call__(self, spec: Any, problem: AttentionProblem, device: DeviceFingerprint,
                 options: Any) -> IsolatedRunner:
        return IsolatedRunner(self.path, spec, problem, device, options,
                              timeout_s=options.trial_timeout_s, parking=self)

    def park(self, proc: Any, conn: Any) -> None:
        """Keep a live worker for the next runner (stopping one parked before)."""
        self.close()
        self._parked = (proc, conn)

    def take(self) -> tuple[Any, Any] | None:
        """The parked ``(process, connection)``, if its worker is alive."""
        parked, self._parked = self._parked, None
        if parked is not None and not parked[0].is_alive():
            _stop(*parked)
            return None
        return parked

    def close(self) -> None:
        parked, self._parked = self._parked, None
        if parked is not None:
            _stop(*parked)


def _stop(proc: Any, conn: Any) -> None:
    """Ask a worker to stop, then make sure it has."""
    try:
        conn.send_bytes(json.dumps({"op": "stop"}).encode())
        proc.join(STOP_TIMEOUT_S)
    except (OSError, ValueError):
        pass
    conn.close()
    if proc.is_alive():
        proc.kill()
    proc.join(STOP_TIMEOUT_S)


def isolated(factory: Callable[..., Any] | str) -> IsolatedFactory:
    """A runner factory like ``factory`` whose runners evaluate in a worker process (one
    worker carried from problem to problem)."""
    return IsolatedFactory(factory)
