"""The lookup chain: which config a call runs with, and why.

For a problem on a device, :meth:`Dispatcher.choose` walks one chain and stops at the first
step that yields a config the template's validity predicate accepts for *this* problem and
device:

1. ``exact``: a config tuned for this very problem on this device;
2. ``bucket``: one tuned for a problem of the same bucket
   (:meth:`AttentionProblem.bucket`: sequence lengths and batch rounded up to powers of
   two), the nearest of them;
3. ``nearest``: the nearest tuned problem on this device by :meth:`AttentionProblem.distance`
   (finite only when dtype, head_dim, causal and the GQA group agree; otherwise the sum of
   ``|log2|`` ratios of the sequence lengths plus half that of batch x heads). A forward
   template's (``spec.op`` not ``bwd``) lends across GQA groups after a penalty
   (:data:`~flashtune.core.problem.GROUP_DISTANCE`), so another group serves only when none
   of the call's is near; a backward's never (its dK/dV programs split the group, and on a
   GQA shape issue 24 measured a backward config 4x slower than the one tuned for it);
4. ``device-alias`` (opt-in: ``FLASHTUNE_DEVICE_ALIAS=1`` or ``reload_configs(
   device_alias=True)``): the same three steps over configs tuned on another device of
   the same compute capability and shared-memory size;
5. ``default``: the template's default config for the problem and device (logged once per
   bucket of problems, never per call).

Ties are broken by the faster measured config. A source holds its own shapes at every
step: an entry of a shape an earlier source also holds (the database before
``$FLASHTUNE_CONFIG_DIR`` before the package) is dropped (:func:`split_by_device`), so it
is neither served nor a neighbour. Entries are loaded lazily, once per process and device,
from :mod:`flashtune.runtime.sources`; :meth:`Dispatcher.reload` drops them.
Choices are memoised per (device, problem): after the first call a lookup is one dict read
(up to :data:`MEMO_LIMIT` problems, then the memo starts again). A problem not seen before
is ranked against its bucket's or its head dim's entries only (:class:`Nearest`).
Thread-safe: loading and memoising happen under a lock; reads of the memo need none.
"""

from __future__ import annotations

import logging
import math
import os
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, overload

from flashtune.core.problem import AttentionProblem, NearFeatures, features_distance
from flashtune.runtime.sources import DeviceKey, TunedEntry, device_key, load_entries

log = logging.getLogger(__name__)

__all__ = ["MEMO_LIMIT", "ConfigChoice", "Dispatcher", "Nearest", "SOURCES", "pick_nearest",
           "remember", "split_by_device"]

# how many call signatures a per-process memo (a route, a launch plan, a choice) holds
# before it starts again: a decode loop over a dynamic cache meets a new key length every
# step, and a server a new shape with every request, so an unbounded memo would grow for
# the life of the process
MEMO_LIMIT = 4096

_K = TypeVar("_K")
_V = TypeVar("_V")


def remember(memo: dict[_K, _V], key: _K, value: _V, limit: int = MEMO_LIMIT) -> _V:
    """``memo[key] = value``, emptying ``memo`` first when it holds ``limit`` entries (one
    step, safe under threads; the signatures still in use come back at one lookup each).

    Arguments:
        memo: a per-process memo (call signature -> route, plan or choice).
        key, value: the entry to add.
        limit: the most entries ``memo`` holds.
    Returns:
        ``value``.
    """
    if len(memo) >= limit:
        memo.clear()
    memo[key] = value
    return value


class _Entry(Protocol):
    """What the chain reads of a stored entry (a tuned config or an op choice)."""

    @property
    def device(self) -> DeviceKey: ...
    @property
    def problem(self) -> AttentionProblem: ...
    @property
    def median_ms(self) -> float: ...
    @property
    def origin(self) -> str: ...


_E = TypeVar("_E", bound=_Entry)

SOURCES = ("explicit", "exact", "bucket", "nearest", "device-alias", "default")

# the source problems already warned about, shared by every template's dispatcher: a bad
# source is one warning per process, not one per template (cleared by a reload)
_SOURCE_WARNED: set[str] = set()
_SOURCE_LOCK = threading.Lock()


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


@dataclass(frozen=True)
class ConfigChoice:
    """The config a call runs with and why.

    Attributes:
        config: the kernel config (every key of the template's space); from an entry of
            another problem, that entry's config as its space lends it to this one
            (:meth:`~flashtune.core.space.SearchSpace.lent`: attn_decode's split count).
        source: one of :data:`SOURCES`.
        tflops: measured TFLOP/s of the entry's own config on ``tuned_problem`` (None if
            unknown).
        median_ms: measured time of the entry's own config on ``tuned_problem`` (None if
            unknown).
        tuned_problem: the problem the config was tuned for (None for default/explicit).
        origin: where the config came from (``db <url>``, ``dir <path>``,
            ``package <path>``, ``template default``, ``argument``).
        template: the implementation the config is for (``attn_fwd``; ``attn_decode``
            when :func:`flashtune.attention` routes a short-query call to the split-KV
            decode kernel; whichever implementation an op's stored choice names, e.g.
            ``attn_fwd_gluon`` or ``sdpa_cudnn``, when ``source`` comes from one).
    """

    config: dict[str, int]
    source: str
    tflops: float | None = None
    median_ms: float | None = None
    tuned_problem: AttentionProblem | None = None
    origin: str = ""
    template: str = "attn_fwd"


class _Table:
    """The entries usable on one device: own (by device key) and aliases."""

    def __init__(self, own: list[TunedEntry], alias: list[TunedEntry]) -> None:
        self.own = Nearest(own)
        self.alias = Nearest(alias)


class Dispatcher:
    """Per-process config resolution for one template (see the module docstring)."""

    def __init__(self, spec: Any) -> None:
        self.spec = spec
        self._lock = threading.RLock()
        self._tables: dict[DeviceKey, _Table] = {}
        self._memo: dict[tuple[DeviceKey, AttentionProblem], ConfigChoice] = {}
        self._warned: set[Any] = set()
        self._aliases: bool | None = None  # None: read FLASHTUNE_DEVICE_ALIAS
        self._db_url: str | None = None

    # -- loading ----------------------------------------------------------------------------

    def reload(self, *, device_alias: bool | None = None, db_url: str | None = None) -> None:
        """Forget loaded entries and memoised choices; the next lookup reads the sources."""
        with self._lock:
            self._tables.clear()
            self._memo.clear()
            self._warned.clear()
            with _SOURCE_LOCK:
                _SOURCE_WARNED.clear()
            self._aliases = device_alias
            self._db_url = db_url

    def _aliases_on(self) -> bool:
        return _env_flag("FLASHTUNE_DEVICE_ALIAS") if self._aliases is None else self._aliases

    def _table(self, device: Any) -> _Table:
        key = device_key(device)
        table = self._tables.get(key)
        if table is not None:
            return table
        with self._lock:
            table = self._tables.get(key)
            if table is not None:
                return table
            aliases = self._aliases_on()
            entries, problems = load_entries(self.spec.name, self.spec.source_hash,
                                             device.name, aliases=aliases,
                                             db_url=self._db_url)
            for reason in problems:
                _warn_once(_SOURCE_WARNED, _SOURCE_LOCK, reason, "flashtune: %s; serving what "
                           "the other sources have (else defaults)", reason)
            own, alias = split_by_device(entries, key, aliases)
            table = self._tables[key] = _Table(own, alias)
            log.debug("%s on %s: %d tuned configs, %d from similar devices", self.spec.name,
                      device.name, len(own), len(alias))
            return table

    def exact(self, problem: AttentionProblem, device: Any) -> TunedEntry | None:
        """The entry tuned for exactly ``problem`` on ``device`` (None if none); no warning,
        no memo."""
        found = self._table(device).own.exact(problem)
        return found[0] if found else None  # the first: sources come in precedence order

    def tuned_problems(self, device: Any) -> list[AttentionProblem]:
        """Every problem with a config tuned on ``device`` itself, in source order."""
        return self._table(device).own.problems()

    # -- choosing ---------------------------------------------------------------------------

    def choose(self, problem: AttentionProblem, device: Any) -> ConfigChoice:
        """The config for ``problem`` on ``device`` (memoised); the template default comes
        with a warning, once per bucket (a decoding loop meets a new Nk every step, and
        would otherwise log a line per generated token; templates the tuner cannot tune yet
        stay quiet, and so do those with no knobs, whose default is their one config: an
        extern backward, sdpa_cudnn_bwd)."""
        found = self.peek(problem, device)
        if found.source == "default" and getattr(self.spec, "tunable", True) \
                and self.spec.space.params:
            self._warn_once(("default", device.name, problem.bucket()),
                            "flashtune: no tuned %s config for %s on %s; using the template "
                            "default for it and the other shapes of its bucket %s (run "
                            "`flashtune tune` for this shape)", self.spec.name,
                            problem.describe(), device.name, problem.bucket())
        return found

    def peek(self, problem: AttentionProblem, device: Any) -> ConfigChoice:
        """:meth:`choose` without its warning."""
        memo_key = (device_key(device), problem)
        found = self._memo.get(memo_key)
        if found is not None:
            return found
        with self._lock:
            found = self._memo.get(memo_key)
            if found is None:
                found = remember(self._memo, memo_key, self._walk(problem, device))
        return found

    def _usable(self, entry: TunedEntry, problem: AttentionProblem, device: Any) -> bool:
        return self.spec.space.check(entry.config, problem, device) is None

    def _pick(self, entries: Nearest[TunedEntry], problem: AttentionProblem, device: Any,
              same_bucket: bool) -> TunedEntry | None:
        return pick_nearest(entries, problem, same_bucket,
                            lambda e: self._usable(e, problem, device),
                            across_groups=self.spec.op != "bwd")

    def _walk(self, problem: AttentionProblem, device: Any) -> ConfigChoice:
        table = self._table(device)
        exact = self.exact(problem, device)
        if exact is not None and self._usable(exact, problem, device):
            return _choice(exact, "exact", self.spec.name)
        for source, entries, same_bucket in (("bucket", table.own, True),
                                             ("nearest", table.own, False),
                                             ("device-alias", table.alias, False)):
            entry = self._pick(entries, problem, device, same_bucket)
            if entry is not None:
                log.info("%s: using the config tuned for %s (%s, %s)", problem.describe(),
                         entry.problem.describe(), source, entry.origin)
                lent = self.spec.space.lent(entry.config, entry.problem, problem, device)
                return _choice(entry, source, self.spec.name, lent)
        return ConfigChoice(dict(self.spec.default_config(problem, device)), "default",
                            origin="template default", template=self.spec.name)

    def _warn_once(self, key: Any, msg: str, *args: Any) -> None:
        _warn_once(self._warned, self._lock, key, msg, *args)


def split_by_device(entries: Sequence[_E], key: DeviceKey,
                    aliases: bool) -> tuple[list[_E], list[_E]]:
    """The entries tuned on the device of ``key`` itself, and (with ``aliases``) those tuned
    on another device of the same compute capability and shared-memory size, less those of
    a device and problem an earlier source holds.

    The sources' precedence (:mod:`~flashtune.runtime.sources`) thus holds at every step of
    the chain, not only the exact one: without it a nearest lookup ranked both sources'
    entries of one problem (the same distance) and took the faster measured, so a table in
    ``$FLASHTUNE_CONFIG_DIR`` lost its shapes' neighbours to the shipped table's entries
    for the same shapes.

    Arguments:
        entries: tuned configs or op choices, in source order.
        key: the running device's :func:`~flashtune.runtime.sources.device_key`.
        aliases: whether similar devices' entries are served.
    Returns:
        ``(own, alias)``, each in source order.
    """
    owner: dict[tuple[DeviceKey, AttentionProblem], str] = {}
    entries = [e for e in entries
               if owner.setdefault((e.device, e.problem), e.origin) == e.origin]
    own = [e for e in entries if e.device == key]
    alias = [e for e in entries if aliases and e.device != key
             and (e.device[1], e.device[3]) == (key[1], key[3])]
    return own, alias


class Nearest(Sequence[_E]):
    """Entries in source order (a sequence of them), indexed for :func:`pick_nearest`: by
    bucket, and by what a finite distance needs (dtype, head_dim, causal), with each one's
    measured time per FLOP. Built once per table, so a call of a shape not seen before (a
    decode step's new cache length, every step) ranks only the entries that can be near
    it instead of measuring its distance to every entry of the table."""

    def __init__(self, entries: Sequence[_E]) -> None:
        self.entries: list[_E] = list(entries)
        self._bucket: dict[str, list[int]] = {}
        self._kind: dict[tuple[str, int, bool], list[int]] = {}
        self._exact: dict[AttentionProblem, list[int]] = {}
        # what the distance reads of each entry's problem, computed once
        self.features: list[NearFeatures] = []
        for i, e in enumerate(self.entries):
            p = e.problem
            self.features.append(p.near_features())
            self._exact.setdefault(p, []).append(i)
            self._bucket.setdefault(p.bucket(), []).append(i)
            self._kind.setdefault((p.dtype, p.head_dim, p.causal), []).append(i)
        self._speed: dict[int, float] = {}

    def __len__(self) -> int:
        return len(self.entries)

    @overload
    def __getitem__(self, i: int) -> _E: ...
    @overload
    def __getitem__(self, i: slice) -> list[_E]: ...

    def __getitem__(self, i: int | slice) -> _E | list[_E]:
        return self.entries[i]

    def __iter__(self) -> Iterator[_E]:
        return iter(self.entries)

    def exact(self, problem: AttentionProblem) -> list[_E]:
        """The entries of exactly ``problem``, in source order."""
        return [self.entries[i] for i in self._exact.get(problem, ())]

    def problems(self) -> list[AttentionProblem]:
        """Every problem with an entry, once each, in source order."""
        return list(self._exact)

    def candidates(self, problem: AttentionProblem, same_bucket: bool) -> list[int]:
        """The positions of the entries that can be at a finite distance from ``problem``
        (with ``same_bucket``, those of its bucket), in source order."""
        if same_bucket:
            return self._bucket.get(problem.bucket(), [])
        return self._kind.get((problem.dtype, problem.head_dim, problem.causal), [])

    def speed(self, i: int) -> float:
        """Entry ``i``'s measured milliseconds per FLOP (the tie-break), computed once."""
        found = self._speed.get(i)
        if found is None:
            e = self.entries[i]
            found = self._speed[i] = e.median_ms / max(e.problem.flops(), 1.0)
        return found


def pick_nearest(entries: Sequence[_E], problem: AttentionProblem, same_bucket: bool,
                 usable: Callable[[_E], bool], *, across_groups: bool = False) -> _E | None:
    """The entry nearest ``problem`` (:meth:`AttentionProblem.distance`; with
    ``same_bucket`` only those of its bucket) that ``usable`` accepts; ties go to the faster
    measured one, then to the earlier source.

    Arguments:
        entries: tuned configs or op choices, in source order; a :class:`Nearest` (what
            the tables hold) is searched through its index, any other sequence is indexed
            for this call.
        problem: the call's problem.
        same_bucket: only entries of ``problem``'s bucket.
        usable: whether an entry can serve this call; asked nearest first, and only until
            one can.
        across_groups: entries of other GQA group sizes too, farther
            (:meth:`AttentionProblem.distance`).
    Returns:
        The entry, or None when none is at a finite distance and usable.
    """
    index = entries if isinstance(entries, Nearest) else Nearest(entries)
    ranked = []
    own, features = problem.near_features(), index.features
    for i in index.candidates(problem, same_bucket):  # dtype, head_dim and causal agree
        dist = features_distance(own, features[i], across_groups=across_groups)
        if math.isfinite(dist):
            ranked.append((dist, index.speed(i), i))
    ranked.sort()
    for _, _, i in ranked:
        if usable(index.entries[i]):
            return index.entries[i]
    return None


def _warn_once(seen: set[Any], lock: Any, key: Any, msg: str, *args: Any) -> None:
    """``log.warning(msg, *args)`` unless ``key`` is in ``seen`` (then nothing)."""
    with lock:
        if key in seen:
            return
        seen.add(key)
    log.warning(msg, *args)


def _choice(entry: TunedEntry, source: str, template: str,
            config: Mapping[str, int] | None = None) -> ConfigChoice:
    """``entry`` as a choice; ``config``: the entry's config as lent to another problem
    (:meth:`~flashtune.core.space.SearchSpace.lent`), else the entry's own."""
    return ConfigChoice(dict(entry.config if config is None else config), source, entry.tflops,
                        entry.median_ms, entry.problem, entry.origin, template)
