"""Stopping a tuning job on request (SIGTERM) even where the signal's exception is lost.

A signal handler's exception is raised wherever the main thread happens to be. Inside a
weakref callback or a ``__del__`` (a garbage collection in the middle of a trial, say)
CPython prints "Exception ignored in ..." and carries on, and the job would run to its end.
So the handler also records the request here, and the trial loop checks it between trials:
a lost exception costs at most the trial in flight.
"""

from __future__ import annotations

import threading
from types import FrameType

__all__ = ["Terminated", "check", "clear", "in_finalizer", "request", "requested"]

_REQUEST = threading.Event()
_REASON = ["SIGTERM"]


class Terminated(KeyboardInterrupt):
    """What a stop request raises: every ``except KeyboardInterrupt`` (the job's, the
    libraries') handles it as Ctrl-C, but it is not *exactly* ``KeyboardInterrupt``. CPython
    3.11 remembers an exact ``KeyboardInterrupt`` that passed out of code run by
    ``exec(str)`` (triton, dataclasses and namedtuple build functions that way) and, under
    ``python -m``, then ends the process with SIGINT even though the exception was caught
    and 143 returned (python/cpython gh-128130); a subclass is not remembered."""


def request(reason: str = "SIGTERM") -> None:
    """Ask the running job to stop (from a signal handler: sets a flag, nothing else).

    Arguments:
        reason: what asked, for the exception's message.
    """
    _REASON[0] = reason
    _REQUEST.set()


def requested() -> bool:
    """Whether a stop was asked for and not cleared.

    Returns:
        True after :func:`request` until :func:`clear`.
    """
    return _REQUEST.is_set()


def check() -> None:
    """Raise :class:`Terminated` if a stop was asked for (the trial loop calls this between
    trials).

    Raises:
        Terminated: after :func:`request`.
    """
    if _REQUEST.is_set():
        raise Terminated(_REASON[0])


def in_finalizer(frame: FrameType | None) -> bool:
    """Whether ``frame`` runs inside a finalizer (a ``__del__``, a weakref callback), where an
    exception is printed as "Exception ignored" and dropped: a signal handler then only
    records the request.

    Arguments:
        frame: the frame a signal handler was given.
    Returns:
        True when it or a caller is such a finalizer.
    """
    while frame is not None:
        code = frame.f_code
        if code.co_name == "__del__" or code.co_filename.endswith(("weakref.py",
                                                                   "_weakrefset.py")):
            return True
        frame = frame.f_back
    return False


def clear() -> None:
    """Forget a stop request (the command that installed the handler, when it is done)."""
    _REQUEST.clear()
