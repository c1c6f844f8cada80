"""Search across implementations: for each shape, the fastest implementation of an op and its
config (Inductor's ``select_algorithm``: Triton templates and extern kernels timed side by
side, the fastest kept).

:func:`tune_op` does, per problem:

1. **Applicable implementations.** Every implementation serving the op
   (:func:`flashtune.kernel_templates.implementations`), or those named; each declares its
   limits (:meth:`~flashtune.core.spec.TemplateSpec.refuse`). One that cannot serve the
   problem on this device (a GPU-only kernel under the interpreter, a head dim it lacks,
   GQA for an SDPA backend...) is skipped with its reason. A named one (``impls``) that
   cannot serve a problem is an error before any work starts.
2. **Search each.** Each applicable implementation is tuned as ``tune --template`` tunes it
   (:func:`~flashtune.autotune.trial_loop.tune_on_device`: Optuna over its space, every
   candidate checked against the fp32 reference before it is timed, the top configs
   confirmed); a space of one point (an extern: no knobs) is measured once. For ``train``
   a pair of flashtune's kernels is its forward's search and its backward's, each on its
   own (the backward once per problem however many forwards pair with it), joined into
   the pair's config (:mod:`flashtune.kernel_templates.training`); an extern's training
   step has nothing to search.
3. **Leaders side by side.** The best config of each implementation is checked again as
   the op runs it (for ``train``: the whole step, the output and dQ, dK, dV against fp32
   autograd) and re-timed
   interleaved with the others (:func:`time_side_by_side`: same seeded inputs, L2 flushed
   by :func:`~flashtune.autotune.timing.bench`, ``rounds`` rounds A, B, C, A, B, C...), so
   clock and thermal drift hit them alike; when the fastest own kernel and the fastest
   extern come out within :data:`CLOSE_CALL` of each other, the leaders within
   :data:`RETIME_WITHIN` of the fastest are timed again with :data:`CLOSE_CALL_ROUNDS` times
   the rounds, and that timing decides.
4. **Record.** The fastest there is stored as the op's choice for the (device, problem)
   (``store.put_choice``) with its margin over the runner-up and over the fastest extern,
   and every leader's time: what ``flashtune show --op`` lists and the router serves. One
   exception, the tie rule: flashtune's own kernel is chosen over the fastest extern (torch's
   SDPA backend, what the user has without flashtune) only when it is faster by more than
   :data:`EXTERN_TIE`; within that, the extern stays first (its ``margin`` over the
   runner-up is then below 1). On the H100, winners 1-2% ahead in the side-by-side timing
   measured 0.95-0.97x the extern in the next run at N 8k-16k, where round medians spread
   by 10-18% (``benchmarks/README.md``): a lead inside the noise is not a reason to leave
   the library the user already runs.

A plan of many shapes is finished over several commands with ``skip_tuned``
(:mod:`flashtune.autotune.resume`): a shape whose stored choice is current is not tuned again
(its :class:`OpResult` is rebuilt from the store, ``reused``), a stale one is, and an
implementation whose search of the shape finished at its current source is not searched
again; ``deadline`` stops starting shapes after a point in time. :func:`flashtune.autotune.
workers.tune_op_on_gpus` spreads the shapes over several GPUs.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, replace
from typing import Any

from flashtune.autotune.isolation import release_cached_memory
from flashtune.autotune.options import TuneOptions, TuneResult, tuning_device
from flashtune.autotune.runners import TrialResult
from flashtune.core.case import shared_inputs
from flashtune.core.device import DeviceFingerprint
from flashtune.core.errors import InputError
from flashtune.core.problem import AttentionProblem
from flashtune.core.spec import USER_OPS, TemplateSpec, join_pair
from flashtune.db.records import SoftwareVersions

log = logging.getLogger(__name__)

__all__ = ["EXTERN_TIE", "Leader", "OpResult", "applicable", "prefer_extern_on_ties",
           "time_side_by_side", "tune_op"]

SIDE_BY_SIDE_ROUNDS = 5
# an own implementation must beat the fastest extern by more than this to be chosen over it
EXTERN_TIE = 0.02
# when the fastest own leader and the fastest extern come out this close (either way), the
# leaders within RETIME_WITHIN of the fastest are timed again with CLOSE_CALL_ROUNDS times
# the rounds and that timing decides: at N 8k-16k on the H100 one run's round medians
# spread by 10%, and 5 rounds kept cuDNN at D128 N16k where the next run measured the Gluon
# forward 8% ahead (benchmarks/README.md). The others keep their first timing: on two
# H200s the re-timing of every leader was a third of a training shape's tuning time
CLOSE_CALL = 0.05
CLOSE_CALL_ROUNDS = 3
RETIME_WITHIN = 0.10
# a checked candidate this many times slower than the fastest checked one is out of the
# race: it keeps its check's timing and is not timed in the rounds (SDPA flash or the
# efficient kernel against cuDNN and the Gluon kernels: 1.5-3x behind, a third of a long
# training shape's side-by-side); one run's round medians spread 10%, far below it
FAR_BEHIND = 1.3


@dataclass(frozen=True)
class Leader:
    """One implementation's best config as timed beside the others (``median_ms`` None
    when it failed there, with ``message``)."""

    implementation: str
    kind: str
    config: dict[str, int]
    median_ms: float | None
    tflops: float | None
    message: str | None = None
    source_hash: str = ""  # the implementation's when it was timed ("" unknown)

    def as_dict(self) -> dict[str, Any]:
        out = {"implementation": self.implementation, "config": dict(self.config),
               "median_ms": self.median_ms}
        return out | ({"source_hash": self.source_hash} if self.source_hash else {})


@dataclass(frozen=True)
class OpResult:
    """What :func:`tune_op` decided for one problem.

    ``winner`` is None when no implementation completed (every one failed its checks or
    none applies); ``margin`` is the runner-up's time over the winner's, ``extern_margin``
    the fastest extern's over the winner's (1.0 when the winner is that extern).
    ``reused``: the choice was current in the store and not made again (``skip_tuned``;
    ``leaders`` are then the stored candidates); ``stale``: why a stored choice was made
    again (None when there was none, or it was current). ``seconds``: the wall time this
    call spent on the problem (searches, side-by-side timing, storing; 0 for a reused one).
    """

    problem: AttentionProblem
    op: str
    device_name: str
    leaders: tuple[Leader, ...]  # fastest first; failures last
    skipped: tuple[tuple[str, str], ...]  # (implementation, why it cannot serve the problem)
    results: tuple[TuneResult, ...]  # each implementation's search
    reused: bool = False
    stale: str | None = None
    seconds: float = 0.0

    @property
    def ranked(self) -> list[Leader]:
        return [x for x in self.leaders if x.median_ms is not None]

    @property
    def winner(self) -> Leader | None:
        ranked = self.ranked
        return ranked[0] if ranked else None

    @property
    def runner_up(self) -> Leader | None:
        ranked = self.ranked
        return ranked[1] if len(ranked) > 1 else None

    @property
    def best_extern(self) -> Leader | None:
        return next((x for x in self.ranked if x.kind == "extern"), None)

    def _over(self, other: Leader | None) -> float | None:
        win = self.winner
        if win is None or other is None or not win.median_ms or other.median_ms is None:
            return None
        return other.median_ms / win.median_ms

    @property
    def margin(self) -> float | None:
        return self._over(self.runner_up)

    @property
    def extern_margin(self) -> float | None:
        return self._over(self.best_extern)


# implementations searched on a GPU only when named (--impl): torch's math SDPA
# materialises the scores (128 GB of them at 32k tokens, 32 heads), so it never wins there
# and can run the GPU out of memory; under the interpreter it stands in for an extern
REFERENCE_ONLY = frozenset({"sdpa_math"})


def applicable(op: str, problem: AttentionProblem, device: DeviceFingerprint,
               impls: Sequence[str] | None = None
               ) -> tuple[list[TemplateSpec], list[tuple[str, str]]]:
    """The implementations of ``op`` that can serve ``problem`` on ``device``, and the others
    with the reason each cannot.

    Arguments:
        op: one of :data:`~flashtune.core.spec.USER_OPS`.
        problem: the shape.
        device: where it would run.
        impls: only these implementations (each must serve ``op``); None: every one
            (on a GPU, less :data:`REFERENCE_ONLY`).
    Returns:
        ``(specs, skipped)``: the specs that can, sorted by name; ``(name, reason)`` for
        the others.
    Raises:
        InputError for an unknown op, or a named implementation that does not serve it;
        UnknownTemplateError for an unknown name.
    """
    from flashtune.kernel_templates import get_template, implementations

    if op not in USER_OPS:
        raise InputError(f"op must be one of {', '.join(USER_OPS)}, got {op!r}")
    serving = {s.name: s for s in implementations(op)}
    if impls is None:
        specs = list(serving.values())
    else:
        specs = []
        for name in dict.fromkeys(impls):
            get_template(name)  # an unknown name: UnknownTemplateError listing the known
            if name not in serving:
                raise InputError(f"implementation {name!r} does not serve op {op!r}; the "
                                 f"implementations of {op!r}: {', '.join(serving)}")
            specs.append(serving[name])
    ok, skipped = [], []
    for spec in specs:
        reason = spec.refuse(problem, device)
        if reason is None and impls is None and spec.name in REFERENCE_ONLY \
                and not device.is_interpreter:
            reason = ("a reference, never a contender on a GPU (it writes the N x N scores "
                      "to memory); name it with --impl to time it")
        if reason is None:
            ok.append(spec)
        else:
            skipped.append((spec.name, reason))
    return ok, skipped


def _check_forced(op: str, problems: Sequence[AttentionProblem], device: DeviceFingerprint,
                  impls: Sequence[str]) -> None:
    """InputError, before any work, when a named implementation cannot serve a problem."""
    for problem in problems:
        _, skipped = applicable(op, problem, device, impls)
        if skipped:
            name, reason = skipped[0]
            raise InputError(f"--impl {name} cannot serve {problem.describe()} on "
                             f"{device.name}: {reason}")


def time_side_by_side(runners: Sequence[tuple[Any, Mapping[str, int]]],
                      rounds: int = SIDE_BY_SIDE_ROUNDS) -> list[tuple[float | None, str | None]]:
    """Time each ``(runner, config)`` interleaved with the others
    (:func:`~flashtune.autotune.runners.time_pairs`: ``rounds`` rounds, the median of a
    runner's round medians; a runner without GPU timing is evaluated once).

    Returns:
        ``(median_ms, None)`` or ``(None, message)`` per runner, in order.
    """
    from flashtune.autotune.runners import time_pairs

    return [(r.median_ms, None) if r.ok and r.median_ms is not None
            else (None, r.message or r.state.value) for r in time_pairs(runners, rounds)]


def _leader_runner(spec: TemplateSpec, problem: AttentionProblem, device: DeviceFingerprint,
                   options: TuneOptions, factory: Callable[..., Any] | None) -> Any:
    """A runner in this process for the side-by-side timing: the leaders passed their
    checks already, so no isolation; every runner draws the same seeded inputs."""
    if factory is not None:
        return factory(spec, problem, device, options)
    from flashtune.autotune.runners import LocalRunner

    return LocalRunner(spec, problem, device, seed=options.seed or 0,
                       timeout_s=options.trial_timeout_s, settle_ms=options.settle_ms)


class _Unbuilt:
    """A leader whose runner could not be built (its inputs did not fit the GPU, say): its
    check fails with why, and the other leaders race on."""

    def __init__(self, message: str) -> None:
        self.message = message

    def evaluate(self, config: Mapping[str, int]) -> TrialResult:
        from flashtune.autotune.runners import TrialState

        return TrialResult(TrialState.RUNTIME_ERROR, self.message)


def _built_leader(spec: TemplateSpec, problem: AttentionProblem, device: DeviceFingerprint,
                  options: TuneOptions, factory: Callable[..., Any] | None) -> Any:
    """:func:`_leader_runner`, or an :class:`_Unbuilt` one saying why it failed (a failing
    leader is data: the shape is still decided and stored)."""
    from flashtune.autotune.runners import _first_line

    try:
        return _leader_runner(spec, problem, device, options, factory)
    except Exception as exc:
        log.warning("%s: %s's runner: %s", problem.describe(), spec.name, _first_line(exc))
        return _Unbuilt(f"could not build its inputs: {_first_line(exc)}")


def tune_op(problems: Sequence[AttentionProblem], op: str, options: TuneOptions, *,
            impls: Sequence[str] | None = None, db_url: str | None = None,
            progress: bool = True, rounds: int = SIDE_BY_SIDE_ROUNDS,
            skip_tuned: bool = False, deadline: float | None = None,
            progress_position: int = 0,
            shared_factory: Callable[..., Any] | None = None,
            _runner_factory: Callable[..., Any] | None = None,
            _device: DeviceFingerprint | None = None) -> list[OpResult]:
    """Choose, per problem, the fastest implementation of ``op`` and its config, and store
    the choice; see the module docstring.

    Arguments:
        problems: the shapes, in order.
        op: ``"fwd"``, ``"train"`` or ``"decode"``.
        options: trials and budgets per implementation (per template: a training pair
            searches its forward and its backward with them) (``options.template`` is ignored).
        impls: search only these implementations (each must serve ``op`` and every
            problem); None: every applicable one. The others' stored best configs still
            take part in the side-by-side timing, so the stored choice is made across
            every implementation measured here.
        db_url: the tuning database (None: ``$FLASHTUNE_DB`` or the default file).
        progress: a progress bar per implementation and problem.
        rounds: rounds of the side-by-side timing of the leaders.
        skip_tuned: skip a problem whose stored choice is current
            (:func:`~flashtune.autotune.resume.stored_choice`; its result is rebuilt from
            the store, ``reused``), and reuse an implementation's finished search of a
            problem at its current source (:func:`~flashtune.autotune.resume.
            finished_search`) instead of searching it again.
        deadline: a :func:`time.time` past which no problem is started once one was
            tuned (not reused) in this call, so every call makes progress (one started
            finishes): none that the longest one tuned so far in this call would carry
            past it (:func:`past_deadline`); None: no limit.
        progress_position: the progress bars' line (one per worker process).
        shared_factory: the candidates' runner factory
            (:func:`~flashtune.autotune.trial_loop.runner_factory_for`), owned and closed
            by the caller, which calls ``tune_op`` again with it (a GPU worker, shape after
            shape); None: one is made here. Either way every search of the call shares it,
            so an isolated job starts one candidate worker, not one per implementation and
            shape (seconds each on a GPU).
    Returns:
        One :class:`OpResult` per problem started, in order: every problem unless
        ``deadline`` passed before the last.
    Raises:
        InputError for an unknown op, a named implementation that cannot serve a problem
        (before any work), or a problem the runtime would refuse; the store's errors.
    """
    from flashtune.autotune.options import check_tunable
    from flashtune.db import default_db_url

    url = default_db_url() if db_url is None else str(db_url)
    device = _device or tuning_device(options)
    if op not in USER_OPS:
        raise InputError(f"op must be one of {', '.join(USER_OPS)}, got {op!r}")
    check_tunable(problems, "attn_fwd", custom_runner=True)  # head dims, before any work
    if impls is not None:
        _check_forced(op, problems, device, impls)
    from flashtune._version import __version__

    software = SoftwareVersions(cuda=device.cuda_version, driver=device.driver_version,
                                flashtune=__version__, torch=device.torch_version,
                                triton=device.triton_version)
    from flashtune.autotune.trial_loop import shared_runner_factory

    owned = shared_runner_factory(options, _runner_factory, device) \
        if shared_factory is None else nullcontext(shared_factory)
    with owned as factory:
        return _tune_problems(problems, op, options, impls, url, progress, rounds,
                              skip_tuned, deadline, progress_position, factory,
                              _runner_factory, device, software)


def _tune_problems(problems: Sequence[AttentionProblem], op: str, options: TuneOptions,
                   impls: Sequence[str] | None, url: str, progress: bool, rounds: int,
                   skip_tuned: bool, deadline: float | None, progress_position: int,
                   factory: Callable[..., Any], custom: Callable[..., Any] | None,
                   device: DeviceFingerprint, software: SoftwareVersions) -> list[OpResult]:
    """:func:`tune_op`'s loop over the problems, every search with ``factory``."""
    from flashtune.db import open_store
    from flashtune.kernel_templates import implementations

    out: list[OpResult] = []
    longest = 0.0  # the longest shape tuned in this call, seconds
    for problem in problems:
        # no shape is started that the longest one so far would carry past the deadline,
        # once one was tuned here: every call makes progress, however short its time
        if past_deadline(deadline, longest) and any(not r.reused for r in out):
            log.info("deadline passed: %d of %d shape(s) not started", len(problems) - len(out),
                     len(problems))
            break
        started = time.time()
        specs, skipped = applicable(op, problem, device, impls)
        stale = None
        if skip_tuned:
            stored = _stored_choice(url, op, problem, device, specs, impls)
            if stored.current:
                log.info("%s: already tuned on %s (%s): skipped", problem.describe(),
                         device.name, stored.choice.implementation)
                out.append(_reused(stored.choice, problem, op, device))
                continue
            stale = stored.stale
            if stale is not None:
                log.info("%s: the stored choice is stale (%s): tuning again",
                         problem.describe(), stale)
        for name, reason in skipped:
            log.warning("%s: %s skipped: %s", problem.describe(), name, reason)
        log.info("%s: searching %s", problem.describe(), ", ".join(s.name for s in specs))
        results: list[TuneResult] = []
        search = functools.partial(_search, results, problem, options, url, progress,
                                   progress_position, skip_tuned, custom, factory, device,
                                   software)
        entries = [(spec, _searched(spec, search)) for spec in specs]
        # with --impl, the other applicable implementations' stored bests still take part
        # in the side-by-side timing: --impl narrows the search, not the choice
        if impls is not None:
            entries += _stored_leaders(url, op, problem, device,
                                       {s.name for s in specs})
        leaders = _side_by_side(entries, problem, device, options, rounds, custom)
        result = OpResult(problem, op, device.name, leaders, tuple(skipped), tuple(results),
                          stale=stale)
        win = result.winner
        if win is not None and win.median_ms is not None:
            ext, up = result.best_extern, result.runner_up
            spec = {s.name: s for s in implementations(op)}[win.implementation]
            with open_store(url) as store:
                dev = store.ensure_device(device)
                store.put_choice(dev.id, op, problem.key(), implementation=spec.name,
                                 source_hash=spec.source_hash, config=win.config,
                                 median_ms=win.median_ms, tflops=win.tflops,
                                 runner_up=up.implementation if up else None,
                                 runner_up_ms=up.median_ms if up else None,
                                 extern=ext.implementation if ext else None,
                                 extern_ms=ext.median_ms if ext else None,
                                 candidates=[x.as_dict() for x in leaders],
                                 software=software)
        elapsed = time.time() - started
        log.info("%s: %s chosen in %.1f s", problem.describe(),
                 win.implementation if win is not None else "nothing", elapsed)
        out.append(replace(result, seconds=elapsed))
        longest = max(longest, elapsed)
    return out


def past_deadline(deadline: float | None, longest_s: float) -> bool:
    """Whether a shape started now, taking as long as the longest one so far
    (``longest_s``), would end past ``deadline`` (a :func:`time.time`; None: never)."""
    return deadline is not None and time.time() + longest_s >= deadline


def _stored_choice(url: str, op: str, problem: AttentionProblem, device: DeviceFingerprint,
                   specs: Sequence[TemplateSpec], impls: Sequence[str] | None) -> Any:
    """:func:`~flashtune.autotune.resume.stored_choice` against every implementation that
    can serve ``problem`` here (``specs``); with ``impls`` against what such a run times:
    ``specs`` (the named ones) and every other that has a stored best
    (:func:`_stored_leaders`). One with neither cannot be timed by the run, so requiring it
    made the choice stale at every run, and ``--skip-tuned`` tuned the same shapes again
    (a 12-shape plan whose first 8 were redone by the second command, 2026-11-30)."""
    from flashtune.autotune.resume import stored_choice
    from flashtune.db import open_store

    serving = list(specs)
    if impls is not None:
        serving += [spec for spec, _ in _stored_leaders(url, op, problem, device,
                                                        {s.name for s in specs})]
    with open_store(url) as store:
        return stored_choice(store, op, problem, device, serving)


def _reused(choice: Any, problem: AttentionProblem, op: str,
            device: DeviceFingerprint) -> OpResult:
    """The :class:`OpResult` of a stored current choice: its candidates as the leaders, in
    the stored order (the decision's, tie rule included)."""
    from flashtune.autotune.timing import tflops
    from flashtune.kernel_templates import implementations

    kinds = {s.name: s.kind for s in implementations(op)}
    flops = _work(problem, op)
    leaders = tuple(
        Leader(c["implementation"], kinds.get(c["implementation"], "?"), dict(c["config"]),
               c["median_ms"], tflops(flops, c["median_ms"]) if c["median_ms"] else None,
               None if c["median_ms"] else "failed in the stored decision",
               c.get("source_hash") or "")
        for c in choice.candidates)
    return OpResult(problem, op, device.name, leaders, (), (), reused=True)


def _work(problem: AttentionProblem, op: str | None) -> float:
    """The FLOPs of what is timed: a training step's are its forward's and its backward's."""
    return problem.flops() + (problem.flops(backward=True) if op == "train" else 0.0)


def _search(results: list[TuneResult], problem: AttentionProblem, options: TuneOptions,
            url: str, progress: bool, position: int, reuse: bool,
            custom: Callable[..., Any] | None, factory: Callable[..., Any],
            device: DeviceFingerprint, software: SoftwareVersions,
            name: str) -> dict[str, int] | None:
    """Template ``name``'s best config for ``problem`` (:func:`~flashtune.autotune.
    trial_loop.tune_on_device`), its search appended to ``results``; a template searched
    already for the problem (a backward two pairs share, or a twin: :func:`_twin`) is not
    searched again, nor, with ``reuse``, one whose search finished in the store at its
    current source. ``custom`` is the tests' runner factory (None: the real runner),
    ``factory`` the one every search of the call shares (:func:`tune_op`)."""
    from flashtune.autotune.trial_loop import tune_on_device

    found = next((r for r in results if r.template == name), None)
    if found is None:
        twin = next((r for r in results if _twins(r.template, name)), None)
        if twin is not None:
            found = _twin(twin, name, problem, url, device, software)
            results.append(found)
    if found is None and reuse:
        from flashtune.autotune.resume import finished_search
        from flashtune.db import open_store

        with open_store(url) as store:
            finished, best = finished_search(store, name, problem, device)
        if finished:
            log.info("%s: %s was searched here already: its stored best", problem.describe(),
                     name)
            return best
    if found is None:
        found, = tune_on_device([problem], replace(options, template=name), db_url=url,
                                progress=progress, progress_position=position,
                                runner_factory=custom, device=device,
                                shared_factory=factory)
        results.append(found)
    return found.best_config


def _twins(a: str, b: str) -> bool:
    """Whether templates ``a`` and ``b`` search the same thing: one kernel (source hash and
    launcher), one space, one case. The Gluon training pair's forward is attn_fwd_gluon
    under another name; a training shape searched it twice, 12 s of a 44-70 s shape."""
    from flashtune.kernel_templates import get_template

    x, y = get_template(a), get_template(b)
    return a != b and x.op == y.op and x.source_hash == y.source_hash \
        and x.launcher is y.launcher and x.space is y.space and x.make_case is y.make_case


def _twin(found: TuneResult, name: str, problem: AttentionProblem, url: str,
          device: DeviceFingerprint, software: SoftwareVersions) -> TuneResult:
    """Template ``name``'s result as its twin's search ``found`` (:func:`_twins`), its best
    stored under ``name`` as well (exports and ``--impl`` runs read it there)."""
    from flashtune.db import open_store
    from flashtune.kernel_templates import get_template

    log.info("%s: %s is %s's kernel, searched already: its best", problem.describe(), name,
             found.template)
    if found.best_config is not None and found.best_ms is not None:
        with open_store(url) as store:
            dev = store.ensure_device(device)
            tpl = store.ensure_template(name, get_template(name).source_hash)
            prob = store.ensure_problem(name, problem.key(), problem.bucket())
            store.offer_best(dev.id, tpl.id, prob.id, config=found.best_config,
                             median_ms=found.best_ms, tflops=found.best_tflops, trial_id=None,
                             trials_count=0, software=software)
    return replace(found, template=name, trials=0, states={}, wall_s=0.0)


def _searched(spec: TemplateSpec,
              search: Callable[[str], dict[str, int] | None]) -> dict[str, int] | None:
    """An implementation's best config for the problem (None: none passed its checks):
    its own search (``search(template name)``); for a training pair the forward's and the
    backward's, each searched on its own (two kernels, two launches: their times add), then
    joined; for an extern's training step ``{}`` (no knobs)."""
    if spec.op != "train":
        return search(spec.name)
    if spec.backward is None:
        return {}
    fwd, bwd = search(spec.name), search(spec.backward)
    return None if fwd is None or bwd is None else join_pair(fwd, bwd)


def _stored_leaders(url: str, op: str, problem: AttentionProblem, device: DeviceFingerprint,
                    searched: set[str]) -> list[tuple[TemplateSpec, dict[str, int] | None]]:
    """The stored best config of every implementation of ``op`` that can serve ``problem``
    here and was not searched in this run (those with one; a training pair's from its
    forward's and its backward's stored bests); an implementation without knobs (the SDPA
    backends) with ``{}``, stored or not: a database seeded from exported files holds no
    search of them, and a choice timed without them is no choice (the H100's forward
    table, re-tuned with ``--impl attn_fwd_gluon``, lost cuDNN from 12 shapes)."""
    from flashtune.db import open_store
    from flashtune.kernel_templates import get_template

    out: list[tuple[TemplateSpec, dict[str, int] | None]] = []
    specs = [s for s in applicable(op, problem, device)[0] if s.name not in searched]
    if not specs:
        return out
    with open_store(url) as store:
        dev = store.ensure_device(device)

        def best(name: str) -> dict[str, int] | None:
            template = get_template(name)
            if not template.space.params:  # an extern without knobs: nothing to search
                return {}
            tpl = store.ensure_template(name, template.source_hash)
            prob = store.ensure_problem(name, problem.key(), problem.bucket())
            found = store.get_best(dev.id, tpl.id, prob.id)
            return None if found is None else dict(found.config)

        for spec in specs:
            config = _searched(spec, best)
            if config is not None:
                out.append((spec, config))
    return out


def _op_of(candidates: Sequence[tuple[TemplateSpec, Any]]) -> str | None:
    """The op the candidates' specs compute (``train`` for training steps)."""
    return candidates[0][0].op if candidates else None


def _side_by_side(candidates: Sequence[tuple[TemplateSpec, Mapping[str, int] | None]],
                  problem: AttentionProblem, device: DeviceFingerprint, options: TuneOptions,
                  rounds: int, factory: Callable[..., Any] | None) -> tuple[Leader, ...]:
    """Each implementation's best config (None: it has none) timed beside the others' (see
    :func:`time_side_by_side`); fastest first, failures last."""
    from flashtune.autotune.timing import tflops

    entries = [(spec, dict(config)) for spec, config in candidates if config is not None]
    runners = []
    try:
        with shared_inputs():  # one copy of the seeded inputs, however many leaders
            for spec, config in entries:
                runners.append((_built_leader(spec, problem, device, options, factory),
                                config))
        # every candidate is checked before it is timed (a training pair's or an extern's
        # step is checked here for the first time), and its kernels compiled
        checked = [runner.evaluate(config) for runner, config in runners]
        ok = _contenders(checked)
        timed_ok = time_side_by_side([runners[i] for i in ok], rounds)
        if _close_call([entries[i][0].kind for i in ok], timed_ok) \
                and all(_gpu_timed(runners[i][0]) for i in ok):
            near = _near_fastest(timed_ok)
            log.info("%s: own kernel and extern within %.0f%%: timing the %d leader(s) "
                     "within %.0f%% of the fastest again with %d rounds", problem.describe(),
                     100 * CLOSE_CALL, len(near), 100 * RETIME_WITHIN,
                     rounds * CLOSE_CALL_ROUNDS)
            again = time_side_by_side([runners[ok[j]] for j in near],
                                      rounds * CLOSE_CALL_ROUNDS)
            for j, t in zip(near, again, strict=True):
                timed_ok[j] = t
        timed: list[tuple[float | None, str | None]] = [
            (r.median_ms, None) if r.ok and r.median_ms else (None, r.message or r.state.value)
            for r in checked]  # the far-behind keep their check's timing
        for i, t in zip(ok, timed_ok, strict=True):
            timed[i] = t
    finally:
        _drop(runners)
    flops = _work(problem, _op_of(candidates))
    leaders = [Leader(spec.name, spec.kind, config, ms,
                      tflops(flops, ms) if ms else None, message, spec.source_hash)
               for (spec, config), (ms, message) in zip(entries, timed, strict=True)]
    for spec, missing in candidates:
        if missing is None:
            leaders.append(Leader(spec.name, spec.kind, {}, None, None,
                                  "no config passed its checks", spec.source_hash))
    leaders.sort(key=lambda x: (x.median_ms is None, x.median_ms or 0.0, x.implementation))
    return prefer_extern_on_ties(tuple(leaders))


def _drop(runners: list[tuple[Any, dict[str, int]]]) -> None:
    """Close the leaders' runners, drop them and give torch's cached blocks back: their
    inputs, their checks' references and their steps' blocks would otherwise stay cached in
    this process while the next shape's search starts its candidate worker (the H100
    training plan: this process held 58 GiB after the GQA shapes at 8k-16k tokens, and the
    worker of a 28:4 shape at 16k could not build its 7 GiB of inputs)."""
    _close_each(runner for runner, _ in runners)  # (a loop here would keep the last alive)
    runners.clear()
    release_cached_memory()


def _close_each(runners: Iterable[Any]) -> None:
    for runner in runners:
        close = getattr(runner, "close", None)
        if callable(close):
            close()


def _contenders(checked: Sequence[TrialResult]) -> list[int]:
    """The indices of the checked candidates to time side by side: those that passed their
    check, less those :data:`FAR_BEHIND` the fastest check's timing."""
    times = {i: r.median_ms for i, r in enumerate(checked) if r.ok}
    fastest = min((t for t in times.values() if t), default=None)
    return [i for i, t in times.items() if fastest is None or not t or t <= FAR_BEHIND * fastest]


def _near_fastest(times: Sequence[tuple[float | None, str | None]]) -> list[int]:
    """The positions of the timed entries of ``times`` within :data:`RETIME_WITHIN` of the
    fastest: those a close call times again."""
    fastest = min((ms for ms, _ in times if ms), default=None)
    return [i for i, (ms, _) in enumerate(times)
            if ms and fastest is not None and ms <= (1.0 + RETIME_WITHIN) * fastest]


def _gpu_timed(runner: Any) -> bool:
    """Whether ``runner`` times on a GPU (else it is evaluated once: nothing to re-time)."""
    return callable(getattr(runner, "time_config", None)) \
        and not getattr(runner, "interpreting", True)


def _close_call(kinds: Sequence[str], times: Sequence[tuple[float | None, str | None]]
                ) -> bool:
    """Whether the fastest own leader and the fastest extern, both timed, are within
    :data:`CLOSE_CALL` of each other."""
    own = [ms for k, (ms, _) in zip(kinds, times, strict=True) if ms and k != "extern"]
    ext = [ms for k, (ms, _) in zip(kinds, times, strict=True) if ms and k == "extern"]
    return bool(own and ext) and abs(min(ext) / min(own) - 1.0) <= CLOSE_CALL


def prefer_extern_on_ties(leaders: Sequence[Leader], tie: float = EXTERN_TIE
                          ) -> tuple[Leader, ...]:
    """``leaders`` (fastest first, failures last) with the fastest extern moved first when
    the fastest is flashtune's own and leads it by ``tie`` or less (its time at most
    ``1 + tie`` times the winner's); the others keep their order."""
    ranked = [x for x in leaders if x.median_ms is not None]
    if not ranked or ranked[0].kind == "extern":
        return tuple(leaders)
    ext = next((x for x in ranked if x.kind == "extern"), None)
    own_ms = ranked[0].median_ms or 0.0  # ranked: timed leaders only
    if ext is None or (ext.median_ms or 0.0) > own_ms * (1.0 + tie):
        return tuple(leaders)
    log.info("%s leads %s by %.1f%%, within the %.0f%% tie: the extern stays the choice",
             ranked[0].implementation, ext.implementation,
             100.0 * ((ext.median_ms or 0.0) / own_ms - 1.0), 100.0 * tie)
    return (ext,) + tuple(x for x in leaders if x is not ext)
