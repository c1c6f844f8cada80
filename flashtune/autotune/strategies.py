"""Strategies: Optuna samplers over a :class:`SearchSpace` (Kernel Tuner's ``strategies/``).

Each parameter is suggested as an ordinal index, ``trial.suggest_int(name + "_idx", 0,
len(values) - 1)``, into the space's ordered tuple of values, so TPE and CMA-ES see
neighbouring block sizes as neighbours and the grid sampler walks the index grid.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from flashtune.core.space import Config, SearchSpace

if TYPE_CHECKING:  # pragma: no cover
    import optuna

__all__ = ["MAX_SEED", "SAMPLERS", "cmaes_installed", "config_from_trial", "enqueue",
           "make_sampler", "params_of"]

SAMPLERS = ("tpe", "random", "grid", "cmaes")
MAX_SEED = 2**32 - 1  # Optuna's samplers seed numpy's RandomState: 0 .. 2**32 - 1
GRID_SEED = 0  # the one order of every grid study (see make_sampler)


def _idx(name: str) -> str:
    return name + "_idx"


def cmaes_installed() -> bool:
    """Whether the ``cmaes`` package (Optuna's CMA-ES sampler needs it) can be imported."""
    import importlib.util

    return importlib.util.find_spec("cmaes") is not None


def make_sampler(name: str, seed: int | None, space: SearchSpace) -> optuna.samplers.BaseSampler:
    """The sampler ``name`` (one of :data:`SAMPLERS`) seeded with ``seed``.

    The grid sampler ignores ``seed``: Optuna records a grid point in the study only as its
    index in the grid's seeded shuffle, so every job of one study (a resumed one, the
    workers of ``tune --gpus``, which get seeds of their own) must shuffle alike, or each
    would read the others' visited points as different configs and stop with configs
    never measured.
    """
    import optuna

    if name == "tpe":
        return optuna.samplers.TPESampler(seed=seed, multivariate=True, constant_liar=True)
    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if name == "grid":
        grid = {_idx(n): list(range(len(v))) for n, v in space.params.items()}
        return _NoStopGridSampler(grid, seed=GRID_SEED)
    if name == "cmaes":
        if not cmaes_installed():
            raise ValueError("sampler 'cmaes' needs the cmaes package: pip install cmaes")
        return optuna.samplers.CmaEsSampler(seed=seed)
    raise ValueError(f"unknown sampler {name!r}; expected one of {list(SAMPLERS)}")


def _grid_sampler_class() -> type[optuna.samplers.GridSampler]:
    import optuna

    class NoStopGridSampler(optuna.samplers.GridSampler):
        """GridSampler that does not call ``study.stop()`` when the grid is exhausted (that
        only works inside ``study.optimize``; the job loop uses ask/tell and stops itself
        once every distinct config has been seen)."""

        def after_trial(self, study: optuna.Study, trial: optuna.trial.FrozenTrial,
                        state: optuna.trial.TrialState, values: Sequence[float] | None
                        ) -> None:
            return None

    return NoStopGridSampler


def _NoStopGridSampler(grid: dict[str, list[int]],  # noqa: N802
                       seed: int | None) -> optuna.samplers.GridSampler:
    return _grid_sampler_class()(grid, seed=seed)


def config_from_trial(trial: optuna.Trial, space: SearchSpace) -> Config:
    """Ask ``trial`` for every parameter of ``space`` and return the config."""
    return {n: int(v[trial.suggest_int(_idx(n), 0, len(v) - 1)]) for n, v in space.params.items()}


def params_of(config: Mapping[str, int], space: SearchSpace) -> dict[str, int]:
    """The Optuna params (indices) of ``config``; ValueError if a value is outside the space."""
    out = {}
    for n, values in space.params.items():
        value = config[n] if n in config else space.defaults[n]
        if value not in values:
            raise ValueError(f"{n}={value!r} is not one of {list(values)}")
        out[_idx(n)] = values.index(value)
    return out


def enqueue(study: optuna.Study, config: Mapping[str, Any], space: SearchSpace, *,
            skip_if_exists: bool = True) -> bool:
    """Queue ``config`` as the study's next trial (warm start); False if outside the space.

    ``skip_if_exists``: not when the study has a trial of these params already, in any
    state (Optuna's rule); False queues it all the same (a point a dead job lost).
    """
    try:
        params = params_of(config, space)
    except (KeyError, ValueError):
        return False
    study.enqueue_trial(params, skip_if_exists=skip_if_exists)
    return True
