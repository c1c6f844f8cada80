"""What a report shows, read from the store: one :class:`StudyReport` per study.

A study is one (device, template at one source version, problem), as in
:class:`flashtune.db.TuningStore`. Its trials come from flashtune's own tables (every state,
with timings), not from Optuna's: those hold ordinal indices rather than configs and miss
nothing flashtune lacks. Nothing here draws: :mod:`flashtune.report.plots` does.
"""

from __future__ import annotations

import logging
import math
import statistics
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from flashtune.db.records import (
    BestConfigRecord,
    DeviceRecord,
    ProblemRecord,
    TemplateRecord,
    TrialRecord,
    TrialState,
)
from flashtune.db.store import TuningStore

log = logging.getLogger(__name__)

__all__ = ["MIN_TRIALS_FOR_IMPORTANCE", "Importances", "StudyReport", "collect_studies",
           "default_config", "param_importances", "problem_label"]

MIN_TRIALS_FOR_IMPORTANCE = 5


@dataclass(frozen=True)
class StudyReport:
    """One study's records: its trials in number order, its best config (if any), the
    template default config and that config's completed trial (when it was measured)."""

    device: DeviceRecord
    template: TemplateRecord
    problem: ProblemRecord
    trials: tuple[TrialRecord, ...]
    best: BestConfigRecord | None
    default_config: dict[str, Any] | None
    default_trial: TrialRecord | None
    study_name: str | None  # the Optuna study name of its latest run (None: no run)

    @property
    def complete(self) -> list[TrialRecord]:
        """The COMPLETE trials with a timing."""
        return [t for t in self.trials
                if t.state is TrialState.COMPLETE and t.median_ms is not None]

    @property
    def failed(self) -> list[TrialRecord]:
        """Finished trials that are not COMPLETE (static prunes included)."""
        return [t for t in self.trials
                if t.state not in (TrialState.COMPLETE, TrialState.RUNNING)]

    @property
    def uses_tflops(self) -> bool:
        """Whether to show TFLOP/s (every completed trial, and the best, have one) rather
        than median ms."""
        done = self.complete
        if not done and self.best is None:
            return False
        return (all(t.tflops is not None for t in done)
                and (self.best is None or self.best.tflops is not None))

    def value(self, trial: TrialRecord) -> float | None:
        """The trial's TFLOP/s or median ms, as :attr:`uses_tflops` says."""
        return trial.tflops if self.uses_tflops else trial.median_ms

    @property
    def best_value(self) -> float | None:
        """The stored best config's TFLOP/s or median ms (re-timed at the end of its run)."""
        if self.best is None:
            return None
        return self.best.tflops if self.uses_tflops else self.best.median_ms

    @property
    def median_value(self) -> float | None:
        """The median over completed trials: what a config picked at random gives."""
        values = [v for v in (self.value(t) for t in self.complete) if v is not None]
        return statistics.median(values) if values else None

    @property
    def unit(self) -> str:
        """``"TFLOP/s"`` or ``"median ms"``."""
        return "TFLOP/s" if self.uses_tflops else "median ms"

    def label(self) -> str:
        """``"<device> <template>@<hash> <shape>"``, one line."""
        return (f"{self.device.name} {self.template.name}@{self.template.source_hash[:8]} "
                f"{problem_label(self.problem.key)}")


def problem_label(key: Mapping[str, Any]) -> str:
    """``"B=1 Hq=2 Hkv=2 Nq=64 Nk=64 D=32 fp16 causal"`` for an attention problem key, else
    the key's ``name=value`` pairs."""
    from flashtune.core.problem import AttentionProblem

    try:
        return AttentionProblem.from_key(key).describe()
    except (KeyError, TypeError, ValueError):
        return " ".join(f"{k}={v}" for k, v in key.items())


def default_config(template: TemplateRecord, device: DeviceRecord,
                   key: Mapping[str, Any]) -> dict[str, Any] | None:
    """The registered template's default config for the problem on the device, or None
    (template not registered here, or not an attention problem)."""
    from flashtune.core.device import DeviceFingerprint
    from flashtune.core.errors import FlashtuneError
    from flashtune.core.problem import AttentionProblem
    from flashtune.kernel_templates import get_template

    try:
        spec = get_template(template.name)
        problem = AttentionProblem.from_key(key)
        fingerprint = DeviceFingerprint(*device.hardware_key())
        return dict(spec.default_config(problem, fingerprint))
    except (FlashtuneError, KeyError, TypeError, ValueError) as exc:
        log.debug("no default config for %s %s: %s", template.name, dict(key), exc)
        return None


def _is_default(config: Mapping[str, Any], default: Mapping[str, Any]) -> bool:
    """Whether a trial's config is the default in the study's own terms (its space may
    cover fewer knobs: the tuner then keeps only those, see ``autotune.trial_loop``)."""
    return bool(config) and all(k in default and default[k] == v for k, v in config.items())


def collect_studies(store: TuningStore, *, device_name: str | None = None,
                    template_name: str | None = None) -> list[StudyReport]:
    """Every study with trials or a best config (imported ones too), filtered by device
    and template name, sorted by device, template, source hash and problem bucket."""
    devices = {d.id: d for d in store.list_devices()
               if device_name is None or d.name == device_name}
    templates = {t.id: t for t in store.list_templates()
                 if template_name is None or t.name == template_name}
    problems = {p.id: p for p in store.list_problems(template_name)}
    trials: dict[tuple[int, int, int], list[TrialRecord]] = {}
    for t in store.list_trials():
        if t.device_id in devices and t.template_id in templates:
            trials.setdefault((t.device_id, t.template_id, t.problem_id), []).append(t)
    bests = {(b.device.id, b.template.id, b.problem.id): b
             for b in store.list_best(device_name=device_name, template_name=template_name)}
    studies = []
    for ids in sorted(set(trials) | set(bests)):
        device, template = devices[ids[0]], templates[ids[1]]
        best = bests.get(ids)
        problem = problems.get(ids[2]) or (best.problem if best else None)
        if problem is None:  # pragma: no cover - a trial always has its problem row
            continue
        own = sorted(trials.get(ids, []), key=lambda t: t.number)
        default = default_config(template, device, problem.key)
        default_trial = None
        if default is not None:
            matches = [t for t in own if t.state is TrialState.COMPLETE
                       and t.median_ms is not None and _is_default(t.config, default)]
            default_trial = matches[-1] if matches else None
        run = store.get_run(own[-1].run_id) if own else None
        studies.append(StudyReport(device, template, problem, tuple(own), best, default,
                                   default_trial, run.study_name if run else None))
    studies.sort(key=lambda s: (s.device.name, s.template.name, s.template.source_hash,
                                s.problem.bucket, s.problem.key_json))
    return studies


@dataclass(frozen=True)
class Importances:
    """Parameter importances of one study (name -> share, summing to 1), or why not."""

    values: dict[str, float]
    note: str | None  # set when ``values`` is empty: why there are none


def param_importances(study: StudyReport, *,
                      min_trials: int = MIN_TRIALS_FOR_IMPORTANCE) -> Importances:
    """``optuna.importance.get_param_importances`` (PED-ANOVA: needs no scikit-learn) on
    the study's completed trials, each parameter as the ordinal index of its value among
    the study's distinct values, the objective the median ms (minimised).

    Parameters with a single value are left out; with fewer than ``min_trials`` completed
    trials, or no parameter that varies, the result is empty with a note.
    """
    import optuna

    done = study.complete
    if len(done) < min_trials:
        return Importances({}, f"{len(done)} completed trial{'' if len(done) == 1 else 's'}; "
                               f"parameter importances need at least {min_trials}")
    names = sorted({k for t in done for k in t.config})
    levels = {n: sorted({t.config.get(n, -1) for t in done}) for n in names}
    varying = [n for n in names if len(levels[n]) > 1]
    if not varying:
        return Importances({}, "every parameter has one distinct value in the completed "
                               "trials; nothing to rank")
    dists: dict[str, optuna.distributions.BaseDistribution] = {
        n: optuna.distributions.IntDistribution(0, len(levels[n]) - 1) for n in varying}
    frozen = [optuna.trial.create_trial(
        params={n: levels[n].index(t.config.get(n, -1)) for n in varying},
        distributions=dists, value=t.median_ms) for t in done]
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    scratch = optuna.create_study(direction="minimize")
    scratch.add_trials(frozen)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            values = optuna.importance.get_param_importances(
                scratch, evaluator=optuna.importance.PedAnovaImportanceEvaluator())
    except (ValueError, RuntimeError, ZeroDivisionError) as exc:
        return Importances({}, f"parameter importances failed: {' '.join(str(exc).split())}")
    total = sum(values.values())
    if not total or math.isnan(total):  # all zero, or NaN
        return Importances({}, "the completed trials do not separate the parameters "
                               "(all importances are zero)")
    return Importances({k: float(v) / total for k, v in values.items()}, None)
