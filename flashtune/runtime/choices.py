"""The op router: which implementation, and which of its configs, serves a call.

``flashtune tune --op`` stores, per (device, op, shape), the implementation that won the
side-by-side timing (:mod:`flashtune.autotune.select`). :class:`OpRouter` serves those
choices at run time through the lookup chain of :mod:`flashtune.runtime.lookup`: a choice
made for this exact problem on this device (``exact``), else for a problem of its bucket
(``bucket``), else the nearest one (``nearest``), else one made on a similar device
(``device-alias``, opt-in). A choice serves a call only when its implementation can give
what the call asks for (:meth:`~flashtune.core.spec.TemplateSpec.refuse`: an SDPA backend
never gets a causal call whose mask it would align differently, nor a ``return_lse`` it
cannot return) and its config passes the implementation's validity predicate for the call's
problem; otherwise the chain goes on. An implementation that builds a plan for every new
shape (:attr:`~flashtune.core.spec.TemplateSpec.plans_per_shape`: cuDNN's, 40-68 ms the
first call of a shape on an H200) serves the ``fwd`` and ``decode`` ops only at the shapes it
was chosen for: a call that only its bucket or nearest match would serve gets the fastest
implementation timed beside it there that plans nothing and serves the call (its config as
timed there; for a choice stored without what was timed beside it, a table written before
choices carried it, the fastest of those implementations' own configs tuned for exactly
that shape, ``tuned_at``), else None, as a stale choice does (a decoding step over a growing cache is a
new shape every token). A training call under ``torch.compile`` (``paired``: its backward
is flashtune's custom op, so torch's autograd cannot differentiate an SDPA backend there)
met by an extern's training choice runs that extern's forward with its ``paired_backward``
(cuDNN's forward and backward, the same kernels), else the fastest of flashtune's own pairs
timed beside it there. With no choice that serves it, :meth:`OpRouter.choose`
answers None and the caller takes the per-template route (the documented default: attn_fwd's
tuned configs, the shipped table, the template default; short queries over long caches on
attn_decode).

Choices come from :func:`flashtune.runtime.sources.load_choices` (the database read-only,
``$FLASHTUNE_CONFIG_DIR``, the shipped ``flashtune/configs``), read once per process and
device; a choice tuned for another source hash of its implementation is stale and not
served, but it keeps its place: a call whose exact, bucket or nearest match is a stale
choice gets None (the documented default), not the next fresh choice further away, which
was made for another shape (when cuDNN's choices go stale with a torch upgrade, the shapes
where cuDNN beat flashtune's kernels stay off those kernels). A fresh choice of the same
device and shape, from any source, replaces a stale one. Answers are memoised per (device,
problem, LSE asked, paired): after the first call a lookup is one dict read.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from flashtune.core.problem import AttentionProblem
from flashtune.core.spec import TemplateSpec
from flashtune.kernel_templates import get_template
from flashtune.runtime.lookup import (
    _SOURCE_LOCK,
    _SOURCE_WARNED,
    ConfigChoice,
    Nearest,
    _warn_once,
    pick_nearest,
    remember,
    split_by_device,
)
from flashtune.runtime.sources import (
    Alternative,
    ChoiceEntry,
    DeviceKey,
    device_key,
    load_choices,
)

log = logging.getLogger(__name__)

__all__ = ["OpRouter"]


class OpRouter:
    """Per-process resolution of one op's stored choices (see the module docstring).

    Arguments:
        op: the user op (``"fwd"``, ``"decode"``).
        specs: the implementations that may serve it, by name (the registry's).
        tuned_at: ``(implementation, problem, device)`` -> that implementation's own
            config tuned for exactly ``problem`` on ``device`` and its time,
            ``(config, median_ms)``, or None (the runtime's per-template tables); what a
            planning choice stored without candidates is compared with.
    """

    def __init__(self, op: str, specs: Mapping[str, TemplateSpec],
                 tuned_at: Callable[[str, AttentionProblem, Any],
                                    tuple[dict[str, int], float] | None] | None = None) -> None:
        self.op = op
        self.specs = dict(specs)
        self._tuned_at = tuned_at
        self._lock = threading.RLock()
        self._tables: dict[DeviceKey, tuple[Nearest[ChoiceEntry], Nearest[ChoiceEntry]]] = {}
        self._memo: dict[tuple[Any, ...], ConfigChoice | None] = {}
        self._aliases: bool | None = None
        self._db_url: str | None = None

    def reload(self, *, device_alias: bool | None = None, db_url: str | None = None) -> None:
        """Forget loaded choices and memoised answers."""
        with self._lock:
            self._tables.clear()
            self._memo.clear()
            self._aliases, self._db_url = device_alias, db_url

    def _table(self, device: Any) -> tuple[Nearest[ChoiceEntry], Nearest[ChoiceEntry]]:
        key = device_key(device)
        table = self._tables.get(key)
        if table is not None:
            return table
        with self._lock:
            table = self._tables.get(key)
            if table is not None:
                return table
            from flashtune.runtime.lookup import _env_flag

            aliases = _env_flag("FLASHTUNE_DEVICE_ALIAS") if self._aliases is None \
                else self._aliases
            hashes = {name: spec.source_hash for name, spec in self.specs.items()}
            entries, problems = load_choices(self.op, hashes, device.name, aliases=aliases,
                                             db_url=self._db_url)
            # a bad source is one warning per process, shared with the per-template
            # dispatchers, which read the same sources
            for reason in problems:
                _warn_once(_SOURCE_WARNED, _SOURCE_LOCK, reason, "flashtune: %s; serving "
                           "what the other sources have (else defaults)", reason)
            own, alias = split_by_device(_unshadowed(entries), key, aliases)
            table = self._tables[key] = (Nearest(own), Nearest(alias))
            return table

    def choose(self, problem: AttentionProblem, device: Any, *, return_lse: bool = False,
               paired: bool = False) -> ConfigChoice | None:
        """The stored choice that serves this call, or None.

        Arguments:
            problem: the call's problem.
            device: its device fingerprint.
            return_lse: the call asks for the LSE.
            paired: the call's LSE feeds flashtune's backward (the ``torch.compile`` path):
                only flashtune's own kernels, whose LSE that backward is checked with.
        Returns:
            A :class:`ConfigChoice` whose ``template`` is the implementation, or None.
        """
        memo_key = (device_key(device), problem, return_lse, paired)
        try:
            return self._memo[memo_key]
        except KeyError:
            pass
        with self._lock:
            if memo_key in self._memo:
                return self._memo[memo_key]
            return remember(self._memo, memo_key,
                            self._walk(problem, device, return_lse, paired))

    def _serves(self, entry: ChoiceEntry, problem: AttentionProblem, device: Any,
                return_lse: bool, paired: bool) -> bool:
        spec = self.specs.get(entry.implementation)
        if spec is None:
            return False
        if paired and spec.backward is None:  # torch's autograd: its paired backward, if any
            if paired_refusal(spec, problem, device) is not None:
                return False
        elif spec.refuse(problem, device, return_lse=return_lse) is not None:
            return False
        try:
            config = spec.space.validate(entry.config)
        except ValueError:
            return False
        return spec.space.check(config, problem, device) is None

    def _walk(self, problem: AttentionProblem, device: Any, return_lse: bool,
              paired: bool) -> ConfigChoice | None:
        own, alias = self._table(device)

        def served(e: ChoiceEntry) -> ChoiceEntry | None:
            """``e`` where it serves the call (a stale choice answers "the default"; a
            paired call takes an extern's choice with its ``paired_backward``); else, for a
            paired call, an extern's choice as its fastest own pair timed beside it."""
            if e.stale or self._serves(e, problem, device, return_lse, paired):
                return e
            return self._own_pair(e, problem, device, return_lse) if paired else None

        def usable(e: ChoiceEntry) -> bool:
            return served(e) is not None

        for e in own.exact(problem):
            chosen = served(e)
            if chosen is not None:
                return _choice(chosen, "exact", problem, self.op)
        for source, entries, same_bucket in (("bucket", own, True), ("nearest", own, False),
                                             ("device-alias", alias, False)):
            # a training step's choice holds its backward's config: never across groups
            pick = pick_nearest(entries, problem, same_bucket, usable,
                                across_groups=self.op != "train")
            if pick is None:
                continue
            if self._plans_per_shape(pick.implementation) and not pick.stale:
                # cuDNN's choices keep their place too: a new shape near them takes the
                # fastest of what was timed beside cuDNN there, else the default, not a
                # choice made further away
                return self._instead(pick, source, problem, device, return_lse, paired)
            chosen = served(pick)
            assert chosen is not None
            return _choice(chosen, source, problem, self.op,
                           self._lent(chosen, problem, device))
        return None

    def _own_pair(self, pick: ChoiceEntry, problem: AttentionProblem, device: Any,
                  return_lse: bool) -> ChoiceEntry | None:
        """For a call whose backward must be flashtune's (``paired``: the ``torch.compile``
        path), a choice of an extern (cuDNN's training step won there): the fastest of
        flashtune's own pairs timed beside it that serves the call, as a choice of its
        own (its config and time as timed there); None where none was timed or serves
        (then the walk goes on, as for any choice that cannot serve the call)."""
        spec = self.specs.get(pick.implementation)
        if pick.stale or spec is None or spec.backward is not None:
            return None
        for alt in pick.alternatives:
            entry = _as_chosen(pick, alt)
            if self._serves(entry, problem, device, return_lse, True):
                log.info("%s: op %s under torch.compile served by %s, timed beside %s's "
                         "choice for %s (%s): the compiled path runs flashtune's own pairs",
                         problem.describe(), self.op, alt.implementation,
                         pick.implementation, pick.problem.describe(), pick.origin)
                return entry
        return None

    def _instead(self, pick: ChoiceEntry, source: str, problem: AttentionProblem, device: Any,
                 return_lse: bool, paired: bool) -> ConfigChoice | None:
        """For a call that ``pick``, a choice of an implementation that plans per shape,
        would serve from another shape: the fastest implementation timed beside it there
        that builds no plan and serves the call (its config as timed, lent to ``problem``;
        for a choice stored without candidates, the implementations' own configs tuned for
        that shape), else None (the default)."""
        alternatives, how = ((pick.alternatives, "timed beside") if pick.alternatives
                             else (self._tuned_beside(pick, device), "tuned for the shape of"))
        for alt in alternatives:
            if self._plans_per_shape(alt.implementation):
                continue
            entry = _as_chosen(pick, alt)
            if self._serves(entry, problem, device, return_lse, paired):
                log.info("%s: op %s served by %s, %s %s's choice for %s (%s, %s): "
                         "%s builds a plan for every new shape", problem.describe(), self.op,
                         alt.implementation, how, pick.implementation, pick.problem.describe(),
                         source, pick.origin, pick.implementation)
                return ConfigChoice(self._lent(entry, problem, device), source, entry.tflops,
                                    entry.median_ms, entry.problem, entry.origin,
                                    entry.implementation)
        log.info("%s: op %s takes the default: its %s match, %s for %s (%s), builds a plan "
                 "for every new shape, and nothing timed beside it serves the call",
                 problem.describe(), self.op, source, pick.implementation,
                 pick.problem.describe(), pick.origin)
        return None

    def _tuned_beside(self, pick: ChoiceEntry, device: Any) -> list[Alternative]:
        """For ``pick``, stored without candidates: each other implementation's own config
        tuned for exactly its problem on this device (``tuned_at``), fastest first."""
        if self._tuned_at is None:
            return []
        found = []
        for name in sorted(self.specs):
            if self._plans_per_shape(name):  # ``pick``'s own among them
                continue
            tuned = self._tuned_at(name, pick.problem, device)
            if tuned is not None:
                found.append(Alternative(name, tuned[0], tuned[1]))
        return sorted(found, key=lambda a: a.median_ms)

    def _plans_per_shape(self, implementation: str) -> bool:
        """Whether a choice of ``implementation`` serves a call without gradients only at
        its own shape (:attr:`~flashtune.core.spec.TemplateSpec.plans_per_shape`); a
        training step's choice serves near shapes too, which a training run meets again
        every step."""
        spec = self.specs.get(implementation)
        return self.op != "train" and spec is not None and spec.plans_per_shape

    def _lent(self, entry: ChoiceEntry, problem: AttentionProblem,
              device: Any) -> dict[str, int]:
        """``entry``'s config fitted to ``problem`` by its implementation's space
        (:meth:`~flashtune.core.space.SearchSpace.lent`); a stale entry's as it is."""
        spec = self.specs.get(entry.implementation)
        if spec is None or entry.stale:
            return dict(entry.config)
        return spec.space.lent(spec.space.validate(entry.config), entry.problem, problem,
                               device)


def paired_refusal(spec: TemplateSpec, problem: AttentionProblem, device: Any) -> str | None:
    """Why ``spec``, a training step that torch's autograd differentiates (an extern), cannot
    serve a call whose backward must be flashtune's custom op (``paired``: the
    ``torch.compile`` path), or None: it names a ``paired_backward`` (cuDNN's own backward,
    from its forward's output and LSE) and both serve the call. The LSE's gradient is that
    backward's to take (it hands such a call to one that takes it), so the extern's refusal
    of ``return_lse`` does not count here."""
    if spec.paired_backward is None:
        return "its backward is torch's autograd"
    reason = spec.refuse(problem, device)
    if reason is None:
        reason = get_template(spec.paired_backward).refuse(problem, device)
    return reason


def _as_chosen(pick: ChoiceEntry, alt: Alternative) -> ChoiceEntry:
    """``alt``, timed beside ``pick``'s winner at its problem, as a choice of its own there
    (its config and time; its TFLOP/s from the winner's by the time ratio)."""
    return replace(pick, implementation=alt.implementation, config=alt.config,
                   median_ms=alt.median_ms, margin=None, alternatives=(),
                   tflops=None if pick.tflops is None
                   else pick.tflops * pick.median_ms / alt.median_ms)


def _choice(entry: ChoiceEntry, source: str, problem: AttentionProblem,
            op: str, config: dict[str, int] | None = None) -> ConfigChoice | None:
    """``entry`` as the answer for ``problem`` (found by ``source``; ``config``: its config as
    lent to ``problem``, else its own); None for a stale one."""
    if entry.stale:
        log.info("%s: op %s takes the default: its %s match, %s for %s (%s), is stale",
                 problem.describe(), op, source, entry.implementation,
                 entry.problem.describe(), entry.origin)
        return None
    if source != "exact":
        log.info("%s: op %s served by %s as chosen for %s (%s, %s)", problem.describe(), op,
                 entry.implementation, entry.problem.describe(), source, entry.origin)
    return ConfigChoice(dict(entry.config if config is None else config), source,
                        entry.tflops, entry.median_ms, entry.problem, entry.origin,
                        entry.implementation)


def _unshadowed(entries: list[ChoiceEntry]) -> list[ChoiceEntry]:
    """``entries`` less the stale ones whose device and shape have a fresh choice."""
    fresh = {(e.device, e.problem) for e in entries if not e.stale}
    return [e for e in entries if not e.stale or (e.device, e.problem) not in fresh]
