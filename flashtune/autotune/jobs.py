"""Tuning jobs: the library entry point, :func:`tune`, which the CLI calls.

A job tunes each problem in its own Optuna study (one per device, template and problem,
:mod:`flashtune.autotune.study`), recorded in the store next to flashtune's trials, and
resumes it when run again: ``trials`` more configs are evaluated, a config measured once is
never measured again, and what a dead job left RUNNING is failed and tried again.

:func:`tune` checks its input, then hands the work to one of two places:

* this process, on its device (:func:`flashtune.autotune.trial_loop.tune_on_device`: the
  trial loop, the confirmation of the fastest configs, isolation of candidates);
* several GPUs of this host, one worker process each, all writing to one database
  (:func:`flashtune.autotune.workers.tune_on_gpus`, whose workers run the same loop).

The options and the result (:class:`TuneOptions`, :class:`TuneResult`) live in
:mod:`flashtune.autotune.options`; they are re-exported here, the module users import.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from flashtune.autotune.options import TuneOptions, TuneResult, check_tunable
from flashtune.autotune.study import _is_memory_url
from flashtune.autotune.trial_loop import tune_on_device
from flashtune.autotune.workers import tune_on_gpus
from flashtune.core.device import DeviceFingerprint
from flashtune.core.problem import AttentionProblem
from flashtune.core.space import SearchSpace
from flashtune.db import default_db_url

__all__ = ["TuneOptions", "TuneResult", "tune"]


def tune(problems: Sequence[AttentionProblem], options: TuneOptions, *,
         db_url: str | None = None, progress: bool = True, progress_position: int = 0,
         gpus: Sequence[int] | None = None,
         _runner_factory: Callable[..., Any] | None = None,
         _device: DeviceFingerprint | None = None,
         _space: SearchSpace | None = None) -> list[TuneResult]:
    """Tune each problem in turn; see the module docstring.

    Private hooks for tests: ``_runner_factory(spec, problem, device, options)`` replaces
    :class:`LocalRunner` (e.g. a :class:`ReplayRunner`), ``_device`` the device fingerprint
    and ``_space`` the template's search space.

    Arguments:
        problems: the shapes to tune, in order.
        options: the template, sampler and budgets (:class:`TuneOptions`).
        db_url: the tuning database (None: ``$FLASHTUNE_DB`` or the default file).
        progress: show a progress bar per problem.
        progress_position: the bar's line (one per worker process).
        gpus: tune on these GPU indices, one worker process each, all writing to the same
            database (:func:`flashtune.autotune.workers.tune_on_gpus`); None tunes here, on
            the current GPU.
    Returns:
        One :class:`TuneResult` per problem (every trial and the best config are also
        in the database).
    Raises:
        InputError for a problem the runtime would refuse (e.g. its head_dim);
        ConfigError for a template that cannot be tuned yet; ValueError for ``gpus`` with
        an in-memory database; StoreError / SchemaError when the database cannot be
        used; WorkerError when a GPU worker process dies.
    """
    url = default_db_url() if db_url is None else str(db_url)
    if gpus is None:
        return tune_on_device(problems, options, db_url=url, progress=progress,
                              progress_position=progress_position,
                              runner_factory=_runner_factory, device=_device, space=_space)
    # refused here, before any worker starts (each worker checks again)
    check_tunable(problems, options.template, custom_runner=_runner_factory is not None)
    if _is_memory_url(url):
        raise ValueError("several GPU workers need a database they can share; an "
                         "in-memory database is private to one process")
    return tune_on_gpus(problems, options, db_url=url, gpus=gpus, progress=progress)
