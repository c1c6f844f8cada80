"""What a tuning database already holds for ``tune --op``: finishing a plan over several
commands (``--skip-tuned``).

A plan of many shapes does not fit one sitting (a device command of 10 minutes, a job
pre-empted), so the same command is run again and goes on where the last one stopped:

* :func:`stored_choice` says whether a shape's op choice is stored for this device and still
  current: made with every implementation that can serve it here now, each at its current
  source hash. A current choice is skipped; a missing or stale one is tuned (again).
* :func:`finished_search` gives an implementation's stored best for a shape when a search of
  it at its current source finished on this device (a COMPLETE run): a shape killed half-way
  (``timeout`` sends SIGTERM; what a dead process left RUNNING is failed when its study is
  opened again) does not search again what it had finished.

Both only read the store, apart from the device, template and problem rows they look up by
``ensure_*``, which the tuning that follows would create anyway.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from flashtune.core.device import DeviceFingerprint
from flashtune.core.problem import AttentionProblem
from flashtune.core.spec import TemplateSpec

__all__ = ["StoredChoice", "finished_search", "stored_choice"]


@dataclass(frozen=True)
class StoredChoice:
    """A shape's op choice in the store: ``choice`` (a
    :class:`~flashtune.db.records.ChoiceRecord`, None when there is none) and ``stale``,
    why it must be made again (None when it is current)."""

    choice: Any
    stale: str | None

    @property
    def current(self) -> bool:
        return self.choice is not None and self.stale is None


def stored_choice(store: Any, op: str, problem: AttentionProblem, device: DeviceFingerprint,
                  serving: Sequence[TemplateSpec]) -> StoredChoice:
    """The stored choice of ``op`` for ``problem`` on ``device`` and whether it is current.

    Current means: the store has a choice for this device (its hardware key), op and problem;
    its winner is a registered implementation at the source hash it was decided with; and
    every implementation in ``serving`` (those that can serve the problem here now) was
    timed in it
    (:attr:`~flashtune.db.records.ChoiceRecord.candidates`), at its current source hash.
    A choice without candidates (imported from a file) or whose candidates carry no source
    hash (decided before they were recorded) cannot be checked, so it counts as stale.

    Arguments:
        store: an open :class:`~flashtune.db.store.TuningStore`.
        op: the user op.
        problem: the shape.
        device: the device the choice is for.
        serving: the implementations of ``op`` that can serve ``problem`` on ``device``
            (:func:`flashtune.autotune.select.applicable`).
    Returns:
        A :class:`StoredChoice`: ``choice`` None when there is none; else ``stale`` says
        what moved, or is None.
    """
    from flashtune.db import canonical_json
    from flashtune.kernel_templates import implementations

    key = canonical_json(problem.key())
    found = [c for c in store.list_choices(device_name=device.name, op=op)
             if c.device.hardware_key() == device.hardware_key()
             and canonical_json(c.problem_key) == key]
    if not found:
        return StoredChoice(None, None)
    choice = found[0]
    specs = {s.name: s for s in implementations(op)}
    winner = specs.get(choice.implementation)
    if winner is None:
        return StoredChoice(choice, f"its winner {choice.implementation} is no longer an "
                                    f"implementation of {op}")
    if winner.source_hash != choice.source_hash:
        return StoredChoice(choice, f"{winner.name}'s source changed ({choice.source_hash} "
                                    f"-> {winner.source_hash})")
    if not choice.candidates:
        return StoredChoice(choice, "it lists no candidates (imported from a file?)")
    timed = {c["implementation"]: c.get("source_hash") for c in choice.candidates}
    for spec in serving:
        if spec.name not in timed:
            return StoredChoice(choice, f"{spec.name} was not timed in it")
        if timed[spec.name] is None:
            return StoredChoice(choice, "it does not record its candidates' source hashes")
        if timed[spec.name] != spec.source_hash:
            return StoredChoice(choice, f"{spec.name}'s source changed ({timed[spec.name]} "
                                        f"-> {spec.source_hash})")
    return StoredChoice(choice, None)


def finished_search(store: Any, name: str, problem: AttentionProblem,
                    device: DeviceFingerprint) -> tuple[bool, dict[str, int] | None]:
    """Whether a search of template ``name`` at its current source finished for ``problem``
    on ``device`` (a COMPLETE run of its study), and then its stored best config (None when
    no config passed its checks).

    Arguments:
        store: an open :class:`~flashtune.db.store.TuningStore`.
        name: a template (for a training pair: its forward or its backward).
        problem: the shape.
        device: where it was searched.
    Returns:
        ``(finished, best config or None)``; ``(False, None)`` when no search finished.
    """
    from flashtune.db import RunStatus
    from flashtune.kernel_templates import get_template

    spec = get_template(name)
    dev = store.ensure_device(device)
    tpl = store.ensure_template(name, spec.source_hash)
    prob = store.ensure_problem(name, problem.key(), problem.bucket())
    if not store.list_runs(dev.id, tpl.id, prob.id, status=RunStatus.COMPLETE):
        return False, None
    best = store.get_best(dev.id, tpl.id, prob.id)
    return True, None if best is None else dict(best.config)
