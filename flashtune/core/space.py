"""Search spaces as data: named discrete parameters plus a validity predicate.

A template's ``space.py`` builds one :class:`SearchSpace`. The space knows nothing of
Optuna: strategies read ``params`` to build their distributions, and call
:meth:`SearchSpace.check` before anything is compiled.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from flashtune.core.errors import ConfigError

Config = dict[str, int]
# predicate(config, problem, device) -> None when valid, else the reason it is not
Predicate = Callable[[Mapping[str, int], Any, Any], "str | None"]
# lend(config, tuned_for, problem, device) -> the config tuned for the problem ``tuned_for``,
# fitted to run ``problem`` (see SearchSpace.lent)
Lend = Callable[[Mapping[str, int], Any, Any, Any], Config]
# problem -> the values a parameter may take for it, for parameters that cannot take all
Narrow = Callable[[Any], Mapping[str, tuple[int, ...]]]


def config_text(config: Mapping[str, int]) -> str:
    """A config as the text a custom op takes (``"NAME=value,..."``, sorted by name), built
    with string operations ``torch.compile`` traces (``json.dumps`` is a graph break).

    Arguments:
        config: parameter name -> integer value.
    Returns:
        The text; :func:`config_from_text` reads it back.
    """
    return ",".join(f"{name}={int(value)}" for name, value in sorted(config.items()))


def config_from_text(text: str) -> Config:
    """The config :func:`config_text` wrote.

    Arguments:
        text: ``"NAME=value,..."`` ("" for an empty config).
    Returns:
        parameter name -> integer value.
    Raises:
        ConfigError for text that is not of that form.
    """
    config: Config = {}
    for item in filter(None, text.split(",")):
        name, sep, value = item.partition("=")
        try:
            config[name] = int(value)
        except ValueError:
            sep = ""
        if not sep or not name:
            raise ConfigError(f"config text {text!r}: {item!r} is not NAME=integer")
    return config


@dataclass(frozen=True)
class SearchSpace:
    """Discrete parameters (name -> allowed values, in order) and a validity predicate.

    ``defaults`` names the parameters a config may leave out (optional knobs) and the value
    they then take; :meth:`validate` fills them in. ``lend``, where a parameter's best value
    follows the shape (a split-KV kernel's split count follows the batch), fits a config
    tuned for one shape to another (:meth:`lent`). ``narrow`` names, per problem, the
    values of the parameters that cannot take all of theirs there (a head-dim split at a
    power-of-two head dim: only 0), so a search over the problem does not propose what the
    predicate would refuse (:meth:`for_problem`).
    """

    params: Mapping[str, tuple[int, ...]]
    predicate: Predicate
    defaults: Mapping[str, int] = field(default_factory=dict)
    lend: Lend | None = None
    narrow: Narrow | None = None

    def for_problem(self, problem: Any) -> SearchSpace:
        """The space a search over ``problem`` walks: ``narrow``'s values in place of those
        parameters' (each a subset of its values, in order); this space where nothing is
        narrowed. Configs keep every parameter; the predicate is the same."""
        pins = self.narrow(problem) if self.narrow is not None else {}
        if not pins:
            return self
        params = dict(self.params)
        for name, values in pins.items():
            params[name] = tuple(v for v in params[name] if v in values)
            if not params[name]:
                raise ValueError(f"narrow leaves parameter {name!r} no value for {problem}")
        return replace(self, params=params)

    @property
    def size(self) -> int:
        n = 1
        for values in self.params.values():
            n *= len(values)
        return n

    def validate(self, config: Mapping[str, Any], *, argname: str = "config") -> Config:
        """Return ``config`` as a plain dict after checking keys and values against the space.

        Raises :class:`ConfigError` naming every unknown or missing key and any value that
        is not one of the allowed ones. Does not run the predicate (see :meth:`check`).
        """
        if not isinstance(config, Mapping):
            raise ConfigError(f"{argname} must be a mapping of parameter names to ints, "
                              f"got {type(config).__name__}")
        unknown = sorted(set(config) - set(self.params))
        missing = sorted(set(self.params) - set(config) - set(self.defaults))
        if unknown or missing:
            parts = []
            if unknown:
                parts.append(f"unknown keys {unknown}")
            if missing:
                parts.append(f"missing keys {missing}")
            optional = f" (optional: {sorted(self.defaults)})" if self.defaults else ""
            raise ConfigError(f"{argname} has {' and '.join(parts)}; expected the keys "
                              f"{sorted(self.params)}{optional}")
        out: Config = {}
        for name, allowed in self.params.items():
            value = config[name] if name in config else self.defaults[name]
            if isinstance(value, bool) or not isinstance(value, int) or value not in allowed:
                raise ConfigError(f"{argname}[{name!r}] = {value!r} is outside the search space; "
                                  f"allowed values: {list(allowed)}")
            out[name] = int(value)
        return out

    def check(self, config: Mapping[str, int], problem: Any, device: Any) -> str | None:
        """The predicate's verdict: ``None`` if the config can run, else why not."""
        return self.predicate(config, problem, device)

    def lent(self, config: Mapping[str, int], tuned_for: Any, problem: Any,
             device: Any) -> Config:
        """``config``, tuned for the problem ``tuned_for``, as it should run ``problem``: the
        space's ``lend`` applied where it has one and its result passes :meth:`check`, else
        ``config`` unchanged (the router serves a nearest entry through this).

        Arguments:
            config: a config of this space, valid for ``problem``.
            tuned_for: the problem it was tuned for.
            problem: the problem it is lent to.
            device: the device it runs on.
        Returns:
            A new dict.
        """
        if self.lend is None or tuned_for == problem:
            return dict(config)
        fitted = self.lend(config, tuned_for, problem, device)
        return fitted if self.check(fitted, problem, device) is None else dict(config)

    def __iter__(self) -> Iterator[Config]:
        names = list(self.params)
        for values in itertools.product(*(self.params[n] for n in names)):
            yield dict(zip(names, values))

    def valid_configs(self, problem: Any, device: Any) -> list[Config]:
        """Every config of the grid that passes the predicate for this problem and device."""
        return [c for c in self if self.check(c, problem, device) is None]
