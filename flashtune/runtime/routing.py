"""Routing: which kernel and config a :func:`flashtune.attention` call runs with, and the
per-call fast path that remembers the answer.

The hot path on CUDA after the first call of a call signature (:func:`_attention`): one dict
read keyed by the tensors' metadata (shapes, strides, dtypes, devices, 16-byte alignment) and
``causal``/``scale``/``return_lse``, which finds an
:class:`~flashtune.kernel_templates.attn_fwd.plan.AttnFwdPlan` -- the resolved config's
compiled kernel with its fixed arguments -- then the output allocation and the launch (an
SDPA backend's plan is its op with the options bound, :class:`_BoundPlan`). The
key holds everything the input checks and Triton's specialisation depend on, so a hit needs
neither again. A signature routed to the backend torch's own SDPA would pick is served
before that key is built: a shorter one (shapes, dtype, device, options) finds
``F.scaled_dot_product_attention`` with the options bound, which checks the tensors itself,
so such a call costs flashtune one short key and one dict read over SDPA's own cost. No
database query, file read or recompile per call; configs come from
:class:`flashtune.runtime.lookup.Dispatcher`, loaded once per process and device. Without
plans (the interpreter, a Triton without the internals :mod:`~flashtune.kernel_templates.direct`
uses, a launch hook installed) calls check their inputs and go through the launcher, with
the route memoised per shape in ``_FAST``.

Routing a call without gradients (:func:`_route`): the op's stored choice first
(:class:`~flashtune.runtime.choices.OpRouter`: ``flashtune tune --op`` decided which
implementation -- a Triton or Gluon kernel of flashtune's, or an SDPA backend of torch's --
is fastest for the shape; exact, bucket, nearest, device alias), for short queries the
``decode`` op's before the ``fwd`` op's; without a choice that can serve the call, the
documented default: short-query problems may go to attn_decode
(:func:`~flashtune.runtime.kvcache.decode_route`), the rest to attn_fwd with the user's own
tuned configs (database, config folder), else its shipped table or its default; with
``FLASHTUNE_AUTOTUNE=1`` a problem attn_fwd has no exact tuned config for is tuned on its
first call, once per process (``tune --op fwd`` searches across implementations). cuDNN's
forward serves a call without gradients only at a shape it was chosen for exactly (an op
choice): it builds a plan for every new shape, 40-68 ms on an H200, and inference meets a
new shape with every decoding step over a growing cache and every prompt length
(:attr:`~flashtune.core.spec.TemplateSpec.plans_per_shape`); a call near such a choice runs
the fastest implementation timed beside it that plans nothing (SDPA's FLASH or one of
flashtune's kernels, with the config it was timed with), else the default.
A call with gradients takes its training route (:func:`_train_route`, memoised per call
signature in ``_TRAIN_FAST``): the ``train`` op's stored choice (a forward of flashtune's
with its backward's config, or an SDPA backend that torch differentiates), else attn_fwd's
config with attn_bwd's tuned config (else its default). Under
``torch.use_deterministic_algorithms(True)`` a pair whose backward is not deterministic
(``Limits.deterministic``: the Gluon backward's atomic dQ) gives way to attn_fwd with attn_bwd.
:func:`_reload` drops what every dispatcher and router loaded and every memoised route and
plan (``flashtune.reload_configs`` and that tuning run call it).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Mapping
from functools import cache
from typing import Any, Protocol

import torch

from flashtune.core.device import DeviceFingerprint, current_device
from flashtune.core.errors import ConfigError, InputError
from flashtune.core.problem import AttentionProblem
from flashtune.core.space import Config
from flashtune.core.spec import USER_OPS, TemplateSpec, join_pair, split_pair
from flashtune.kernel_templates import direct, get_template, implementations
from flashtune.kernel_templates.attn_decode.plan import AttnDecodeDensePlan
from flashtune.kernel_templates.attn_fwd.plan import AttnFwdPlan
from flashtune.kernel_templates.direct import current_device as _current_device
from flashtune.kernel_templates.direct import current_stream as _current_stream
from flashtune.kernel_templates.sdpa_extern import any_layout, bound_inference
from flashtune.runtime import kvcache
from flashtune.runtime.checks import check_attention_inputs, check_grid
from flashtune.runtime.choices import OpRouter, paired_refusal
from flashtune.runtime.lookup import ConfigChoice, Dispatcher, remember

log = logging.getLogger(__name__)


class TrainRoute:
    """How a call with gradients runs: ``fwd`` (the forward implementation's spec) with
    ``fwd_config``, then ``bwd`` (its backward template's spec) with ``bwd_config``; for an
    extern ``bwd`` is None (torch's autograd differentiates it)."""

    __slots__ = ("bwd", "bwd_config", "fwd", "fwd_config")

    def __init__(self, fwd: TemplateSpec, fwd_config: Config, bwd: TemplateSpec | None,
                 bwd_config: Config) -> None:
        self.fwd, self.fwd_config, self.bwd, self.bwd_config = fwd, fwd_config, bwd, bwd_config


class _LaunchPlan:
    """A CUDA call signature routed to an implementation without a direct-launch plan (an
    SDPA backend, the Gluon kernel): its launcher with the call's config and options bound;
    call it as ``plan(q, k, v, stream)``."""

    __slots__ = ("_cfg", "_launcher", "_options", "device_index")

    def __init__(self, spec: TemplateSpec, cfg: Config, causal: bool, scale: float | None,
                 return_lse: bool, device_index: int) -> None:
        self._launcher, self._cfg = spec.launcher, cfg
        self._options = {"causal": causal, "scale": scale, "return_lse": return_lse}
        self.device_index = device_index

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, stream: Any) -> Any:
        return self._launcher(q, k, v, self._cfg, **self._options)


class _OwnPlan(Protocol):
    """An implementation's own launch plan (``TemplateSpec.plan``: the Gluon forward's)."""

    device_index: int

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 stream: Any) -> Any: ...


class _BoundPlan:
    """A CUDA call signature routed to an SDPA backend: its op with the options bound and
    the checks done (:func:`~flashtune.kernel_templates.sdpa_extern.bound_inference`);
    call it as ``plan(q, k, v, stream)``."""

    __slots__ = ("device_index", "fn")

    def __init__(self, fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], Any],
                 device_index: int) -> None:
        self.fn, self.device_index = fn, device_index

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, stream: Any) -> Any:
        return self.fn(q, k, v)


_FWD = get_template("attn_fwd")
_BWD = get_template("attn_bwd")
_DEC = get_template("attn_decode")
_DISPATCH = Dispatcher(_FWD)
_DISPATCH_BWD = Dispatcher(_BWD)
# each implementation's own tuned configs (attn_fwd's and attn_decode's are the ones above
# and kvcache's; the others are made when an ``impl=`` call first asks)
_DISPATCHERS: dict[str, Dispatcher] = {_FWD.name: _DISPATCH, _BWD.name: _DISPATCH_BWD,
                                       _DEC.name: kvcache.DISPATCH}


def _tuned_at(implementation: str, problem: AttentionProblem,
              device: DeviceFingerprint) -> tuple[dict[str, int], float] | None:
    """``implementation``'s own config tuned for exactly ``problem`` on ``device`` and its
    time (its per-template table), or None: what the op routers compare a planning choice
    stored without candidates with."""
    entry = _dispatcher(get_template(implementation)).exact(problem, device)
    return None if entry is None else (dict(entry.config), float(entry.median_ms))


# the stored choices of each op, across its implementations
_ROUTERS = {op: OpRouter(op, {s.name: s for s in implementations(op)}, _tuned_at)
            for op in USER_OPS}
# (q.shape, k.shape, dtype, device index, causal, return_lse) -> (implementation, config):
# the per-call lookup
_FAST: dict[tuple[Any, ...], tuple[TemplateSpec, Config]] = {}
# the same key and ``paired`` -> the training route of a call with gradients (_train_route)
_TRAIN_FAST: dict[tuple[Any, ...], TrainRoute] = {}
# the plan key (see _plan_key) -> the launch plan of a CUDA call signature
_PLANS: dict[tuple[Any, ...],
             AttnFwdPlan | AttnDecodeDensePlan | _LaunchPlan | _BoundPlan | _OwnPlan] = {}
# the shape key (_shape_key, the plan key's head) -> torch's SDPA with the options bound,
# for signatures routed to the backend torch itself would pick (sdpa_extern.any_layout):
# such a call needs neither the rest of the plan key nor a plan
_BY_SHAPE: dict[tuple[Any, ...], Callable[..., Any]] = {}
_DIRECT = direct.supported()
_Tensor = torch.Tensor
_AUTOTUNED: set[AttentionProblem] = set()
_AUTOTUNE_LOCK = threading.Lock()
AUTOTUNE_TRIALS = 30
# the training step of a call nothing tuned serves, by compute capability: on sm_90 cuDNN's
# forward and backward (it beat flashtune's tuned pairs by 1.04-1.54x on every training
# shape tuned on the H100: benchmarks/results/route_train_tuned_h100.json); elsewhere, and
# where it cannot serve the call, attn_fwd with attn_bwd
TRAIN_DEFAULT: tuple[tuple[tuple[int, int], ...], str] = (((9, 0),), "sdpa_cudnn")
# no such default for a call without gradients: its shapes are new ones (every decoding step
# over a growing cache, every prompt length), and cuDNN builds a plan for each shape it meets,
# 40-68 ms on an H200 against under a millisecond for flashtune's kernels
# (benchmarks/results/new_shape_h200.json; TemplateSpec.plans_per_shape). A Llama-3-8B-shaped
# model generating on the H100 ran 8.2 ms a token on attn_decode's default against 7.7 on
# cuDNN, but only with every step's shape planned in an earlier round
# (benchmarks/results/model_llama_h100.json)
_BAD_TRIALS: set[str] = set()  # bad $FLASHTUNE_AUTOTUNE_TRIALS values already warned about


@cache
def _device(device_type: str, index: int | None) -> DeviceFingerprint:
    return current_device(torch.device(device_type, index) if index is not None
                          else torch.device(device_type))


def _device_of(q: torch.Tensor) -> DeviceFingerprint:
    return _device(q.device.type, q.device.index)


def _dispatcher(spec: TemplateSpec) -> Dispatcher:
    """The implementation's own tuned configs (made on first use)."""
    found = _DISPATCHERS.get(spec.name)
    if found is None:
        found = _DISPATCHERS.setdefault(spec.name, Dispatcher(spec))
    return found


def _implementation(impl: str) -> TemplateSpec:
    """The implementation ``impl`` of the forward (``attention(..., impl=)``), or
    InputError naming the ones there are."""
    spec = get_template(impl)
    if not spec.serves:
        names = sorted({s.name for op in USER_OPS for s in implementations(op)})
        raise InputError(f"impl {impl!r} is not an attention forward; the implementations: "
                         f"{', '.join(names)}")
    return spec


def _explicit_config(config: Mapping[str, Any], problem: AttentionProblem,
                     device: DeviceFingerprint, spec: TemplateSpec = _FWD) -> Config:
    cfg = spec.space.validate(config)
    reason = spec.space.check(cfg, problem, device)
    if reason is not None:
        raise ConfigError(f"config {cfg} cannot run {problem.describe()} on {device.name}: {reason}")
    return cfg


def _autotune_enabled() -> bool:
    return os.environ.get("FLASHTUNE_AUTOTUNE", "").strip().lower() in ("1", "true", "yes", "on")


def _autotune_trials() -> int:
    """``$FLASHTUNE_AUTOTUNE_TRIALS``, else :data:`AUTOTUNE_TRIALS`; a value that is not a
    positive integer gets the default too, with one warning per value (call under
    ``_AUTOTUNE_LOCK``)."""
    raw = os.environ.get("FLASHTUNE_AUTOTUNE_TRIALS", "").strip()
    if not raw:
        return AUTOTUNE_TRIALS
    try:
        trials = int(raw)
    except ValueError:
        trials = 0
    if trials > 0:
        return trials
    if raw not in _BAD_TRIALS:
        _BAD_TRIALS.add(raw)
        log.warning("flashtune: FLASHTUNE_AUTOTUNE_TRIALS=%r is not a positive integer; "
                    "tuning with the default, %d trials", raw, AUTOTUNE_TRIALS)
    return AUTOTUNE_TRIALS


def _autotune(problem: AttentionProblem, device: DeviceFingerprint) -> None:
    """Opt-in (``FLASHTUNE_AUTOTUNE=1``): tune ``problem`` now, once per process, into the
    tuning database, then reload. Failures are logged, never raised."""
    with _AUTOTUNE_LOCK:
        if problem in _AUTOTUNED:
            return
        _AUTOTUNED.add(problem)
        from flashtune.autotune.jobs import tune
        from flashtune.autotune.options import TuneOptions

        trials = _autotune_trials()
        log.warning("flashtune: FLASHTUNE_AUTOTUNE=1: tuning %s now (%d trials)",
                    problem.describe(), trials)
        try:
            tune([problem], TuneOptions(trials=trials, interpret=device.is_interpreter),
                 progress=False)
        except Exception as exc:  # noqa: BLE001 - a failed tuning must not fail the call
            log.warning("flashtune: tuning %s failed: %s", problem.describe(), exc)
        _reload()


def _choose(problem: AttentionProblem, device: DeviceFingerprint, *,
            tune: bool = True) -> ConfigChoice:
    """attn_fwd's choice; with ``tune`` an untuned problem is tuned first when
    ``FLASHTUNE_AUTOTUNE=1``."""
    choice = _DISPATCH.choose(problem, device)
    if tune and choice.source != "exact" and _autotune_enabled() \
            and problem not in _AUTOTUNED:
        _autotune(problem, device)
        choice = _DISPATCH.choose(problem, device)
    return choice


def _route_ops(problem: AttentionProblem) -> tuple[str, ...]:
    """The ops whose stored choices may serve ``problem``, in order: short queries ask the
    decode op's first."""
    return ("decode", "fwd") if problem.seqlen_q <= kvcache.DECODE_MAX_QUERIES else ("fwd",)


def _route(problem: AttentionProblem, device: DeviceFingerprint, *, tune: bool = True,
           return_lse: bool = False) -> ConfigChoice:
    """The implementation and config a call without gradients runs with (see the module
    docstring): the op's stored choice that can serve the call, else attn_decode's when
    :func:`~flashtune.runtime.kvcache.decode_route` takes the problem (short queries),
    else attn_fwd's (its tuned config, else the shipped or default one; see :func:`_choose`
    for ``tune``)."""
    for op in _route_ops(problem):
        chosen = _ROUTERS[op].choose(problem, device, return_lse=return_lse)
        if chosen is not None:
            return chosen
    return kvcache.decode_route(problem, device, _DISPATCH) \
        or _choose(problem, device, tune=tune)


def _train_default(problem: AttentionProblem, device: DeviceFingerprint,
                   return_lse: bool, paired: bool = False) -> ConfigChoice | None:
    """The extern that serves a training step untuned on ``device``'s compute capability
    (:data:`TRAIN_DEFAULT`), if it can serve the call (``paired``: with its
    ``paired_backward``, :func:`~flashtune.runtime.choices.paired_refusal`); else None."""
    capabilities, name = TRAIN_DEFAULT
    extern = _ROUTERS["train"].specs.get(name)
    if extern is None or device.capability not in capabilities:
        return None
    refusal = paired_refusal(extern, problem, device) if paired \
        else extern.refuse(problem, device, return_lse=return_lse)
    if refusal is not None:
        return None
    return ConfigChoice({}, "default",
                        origin=f"default training step on {device.compute_capability}",
                        template=extern.name)


def _resolve(q: torch.Tensor, k: torch.Tensor, causal: bool, return_lse: bool,
             key: tuple[Any, ...]) -> tuple[TemplateSpec, Config]:
    choice = _route(AttentionProblem.from_tensors(q, k, causal=causal), _device_of(q),
                    return_lse=return_lse)
    spec = get_template(choice.template)
    if spec.kind != "extern":  # once per key: it holds the shapes and the device
        check_grid(q, k, decode=spec is _DEC)
    return remember(_FAST, key, (spec, choice.config))


def _train_choice(problem: AttentionProblem, device: DeviceFingerprint, *,
                  return_lse: bool = False, paired: bool = False,
                  tune: bool = True) -> ConfigChoice:
    """The training step a call with gradients runs (``choice.template`` the forward's
    implementation, ``choice.config`` the pair's config, ``{}`` for an extern): the
    ``train`` op's stored choice that can serve it (``paired``: the ``torch.compile`` path,
    whose backward is flashtune's custom op: flashtune's own pairs, or an extern with its
    ``paired_backward``; where an extern without one won, the fastest own pair timed beside
    it), else the documented default: on the compute capabilities
    of :data:`TRAIN_DEFAULT` its SDPA backend where it serves the call, else attn_fwd's
    config (see :func:`_choose` for ``tune``) with attn_bwd's tuned config (else its
    default)."""
    chosen = _ROUTERS["train"].choose(problem, device, return_lse=return_lse, paired=paired)
    if chosen is not None:
        return chosen
    default = _train_default(problem, device, return_lse, paired)
    if default is not None:
        return default
    fwd = _choose(problem, device, tune=tune)
    bwd = _DISPATCH_BWD.choose(problem, device)
    source = fwd.source if fwd.source == bwd.source else f"{fwd.source}+{bwd.source}"
    return ConfigChoice(join_pair(fwd.config, bwd.config), source,
                        tuned_problem=fwd.tuned_problem, origin=fwd.origin,
                        template=_FWD.name)


def _train_route(q: torch.Tensor, k: torch.Tensor, causal: bool, return_lse: bool,
                 config: Mapping[str, Any] | None = None, impl: str | None = None,
                 paired: bool = False) -> TrainRoute:
    """The :class:`TrainRoute` of a call with gradients, memoised per call signature when
    neither ``config`` nor ``impl`` is given: the routed choice (:func:`_train_choice`);
    else ``impl`` (attn_fwd when None) with ``config`` (the forward's keys, and the
    backward's under ``bwd.``; without them the backward's tuned config), checked against
    the implementation's limits and spaces."""
    if config is None and impl is None:
        strict = torch.are_deterministic_algorithms_enabled()
        key = (q.shape, k.shape, q.dtype, q.get_device(), causal, return_lse, paired, strict)
        route = _TRAIN_FAST.get(key)
        if route is not None:
            return route
    problem, device = AttentionProblem.from_tensors(q, k, causal=causal), _device_of(q)
    if config is None and impl is None:
        choice = _train_choice(problem, device, return_lse=return_lse, paired=paired)
        spec = get_template(choice.template)
        fcfg, bcfg = split_pair(choice.config)
        # an extern under the custom ops: its forward with its paired backward
        backward = spec.backward or (spec.paired_backward if paired else None)
        if strict and backward is not None \
                and not get_template(backward).limits.deterministic:
            # torch.use_deterministic_algorithms(True): not a backward with atomics (the
            # Gluon backward's dQ); attn_fwd with attn_bwd sums every gradient in order
            spec = _FWD
            backward = _FWD.backward
            fcfg = _dispatcher(_FWD).choose(problem, device).config
            bcfg = _dispatcher(get_template(_FWD.backward or "attn_bwd")).choose(
                problem, device).config
    else:
        spec = _FWD if impl is None else _implementation(impl)
        if "train" not in spec.serves:
            raise InputError(f"impl {spec.name!r} has no backward; for gradients run one "
                             f"of {', '.join(s.name for s in implementations('train'))}")
        reason = spec.refuse(problem, device, return_lse=return_lse)
        if reason is None and return_lse and spec.backward is None:
            reason = "its LSE has no gradient (torch's backward ignores it)"
        if reason is not None:
            raise InputError(f"impl {spec.name!r} cannot serve {problem.describe()} with "
                             f"gradients on {device.name}: {reason}")
        fcfg, bcfg = split_pair(config or {})
        if bcfg and spec.backward is None:
            raise ConfigError(f"config has backward keys {sorted(bcfg)}, but {spec.name!r} "
                              f"has no backward template (torch differentiates it)")
        if bcfg:  # the pair's config: checked as one, so errors name its keys
            from flashtune.kernel_templates.registry import train_step

            fcfg, bcfg = split_pair(_explicit_config(config or {}, problem, device,
                                                     train_step(spec)))
        else:
            fcfg = _dispatcher(spec).choose(problem, device).config if config is None \
                else _explicit_config(fcfg, problem, device, spec)
            if spec.backward is not None:
                bcfg = _dispatcher(get_template(spec.backward)).choose(problem, device).config
        backward = spec.backward
    bwd_spec = get_template(backward) if backward is not None else None
    if spec.kind != "extern":
        check_grid(q, k)  # the forward's grid, and the backward's
    route = TrainRoute(spec, fcfg, bwd_spec, bcfg)
    if config is None and impl is None:
        remember(_TRAIN_FAST, key, route)
    return route


def _shape_key(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: Any,
               return_lse: bool) -> tuple[Any, ...]:
    """What the route of a call reads (its problem, device and options): the key of
    ``_BY_SHAPE``, and the head of :func:`_plan_key`."""
    return (q.shape, k.shape, q.dtype, q.get_device(), causal, scale, return_lse)


def _plan_key(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              head: tuple[Any, ...]) -> tuple[Any, ...]:
    """Everything the input checks, the config choice and Triton's specialisation read:
    ``head`` (:func:`_shape_key`) and the rest of the three tensors' metadata."""
    return head + (v.shape, q.stride(), k.stride(), v.stride(), k.dtype, v.dtype,
                   k.get_device(), v.get_device(),
                   (q.data_ptr() | k.data_ptr() | v.data_ptr()) & 15 == 0)


def _new_plan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: TemplateSpec,
              cfg: Config, causal: bool, scale: float | None, return_lse: bool,
              key: tuple[Any, ...]
              ) -> AttnFwdPlan | AttnDecodeDensePlan | _LaunchPlan | _BoundPlan | _OwnPlan | None:
    global _DIRECT
    if spec.kind == "extern":
        fn = bound_inference(spec.name, q, k, causal=causal, scale=scale,
                             return_lse=return_lse)
        if fn is not None:
            if any_layout(fn):  # torch's SDPA: later calls of these shapes skip the plan key
                remember(_BY_SHAPE, _shape_key(q, k, causal, scale, return_lse), fn)
            return remember(_PLANS, key, _BoundPlan(fn, q.get_device()))
    if spec.plan is not None:  # the implementation's own plan, where it plans the call
        try:
            own: _OwnPlan = spec.plan(q, k, v, cfg, causal=causal, scale=scale,
                                      return_lse=return_lse)
        except Exception as exc:  # noqa: BLE001 - a call it does not plan: the launcher's
            log.debug("flashtune: no %s plan for this call (%s: %s)", spec.name,
                      type(exc).__name__, exc)
        else:
            return remember(_PLANS, key, own)
    if spec is not _FWD and spec is not _DEC:
        # the launcher (an attn_fwd plan also runs a head dim padded, see AttnFwdPlan)
        return remember(_PLANS, key, _LaunchPlan(spec, cfg, causal, scale, return_lse,
                                                 q.get_device()))
    plan_type = AttnDecodeDensePlan if spec is _DEC else AttnFwdPlan
    try:
        plan = plan_type(q, k, v, cfg, causal=causal, scale=scale, return_lse=return_lse)
    except Exception as exc:  # noqa: BLE001 - Triton internals moved: launch the normal way
        _DIRECT = False
        log.warning("flashtune: direct launches disabled (%s: %s); calls go through "
                    "Triton's launcher", type(exc).__name__, exc)
        return None
    return remember(_PLANS, key, plan)


def replay_plan(spec: TemplateSpec, cfg: Mapping[str, int], q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor, *, causal: bool, scale: float | None = None,
                return_lse: bool = False
                ) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], Any] | None:
    """What a plain inference call of one of flashtune's own implementations replays after
    a shape's first call (the plan :func:`_new_plan` keeps: the implementation's own, else
    attn_fwd's or attn_decode's), built from ``q, k, v`` and not kept, as a function of
    later tensors of the same shapes, strides and alignment; None where such a call runs
    the launcher or torch's op, or off the GPU. Building raises what the plan raises (the
    runtime then runs the launcher). A plan binds its fixed arguments once, from the build
    call: only a call with other tensors than those shows what it kept (``bench`` checks
    one so, beside the launcher)."""
    if not q.is_cuda or spec.kind == "extern":
        return None
    plan_type: Any = spec.plan or (AttnFwdPlan if spec is _FWD else
                                   AttnDecodeDensePlan if spec is _DEC else None)
    if plan_type is None:
        return None
    plan = plan_type(q, k, v, cfg, causal=causal, scale=scale, return_lse=return_lse)
    return lambda q, k, v: plan(q, k, v, _current_stream(plan.device_index))


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
               scale: float | None, return_lse: bool,
               config: Mapping[str, int] | None, impl: str | None = None) -> Any:
    """:func:`flashtune.attention` without gradients: ``out``, or ``(out, lse)`` with
    ``return_lse`` (see the module docstring for the path it takes); ``impl`` forces an
    implementation (``config`` is then one of its configs)."""
    key = None
    if config is None and impl is None and _DIRECT and type(q) is _Tensor \
            and type(k) is _Tensor and type(v) is _Tensor and q.is_cuda:
        head = _shape_key(q, k, causal, scale, return_lse)
        if _BY_SHAPE:  # routes to torch's SDPA whatever the layout: it checks the tensors
            sdpa = _BY_SHAPE.get(head)
            if sdpa is not None:
                return sdpa(q, k, v)
        key = _plan_key(q, k, v, head)
        plan = _PLANS.get(key)
        if plan is not None:
            if plan.__class__ is _BoundPlan:  # torch's op: no Triton launch, hook or stream
                return plan.fn(q, k, v)
            if _current_device() == plan.device_index and not direct.hooks_installed():
                return plan(q, k, v, _current_stream(plan.device_index))
    check_attention_inputs(q, k, v, scale)
    if config is None and impl is None:
        fast_key = (q.shape, k.shape, q.dtype, q.get_device(), causal, return_lse)
        spec, cfg = _FAST.get(fast_key) or _resolve(q, k, causal, return_lse, fast_key)
        if key is not None and _current_device() == q.get_device() \
                and not direct.hooks_installed():
            plan = _new_plan(q, k, v, spec, cfg, causal, scale, return_lse, key)
            if plan is not None:
                return plan(q, k, v, _current_stream(plan.device_index))
    else:
        spec, cfg = _forced(q, k, causal, return_lse, config, impl)
    return spec.launcher(q, k, v, cfg, causal=causal, scale=scale, return_lse=return_lse)


def _forced(q: torch.Tensor, k: torch.Tensor, causal: bool, return_lse: bool,
            config: Mapping[str, int] | None,
            impl: str | None) -> tuple[TemplateSpec, Config]:
    """The implementation and config of a call that names them (``impl=``, ``config=``):
    checked against the implementation's limits and space; an ``impl`` without a config
    runs that implementation's own tuned config for the shape (else its default)."""
    spec = _FWD if impl is None else _implementation(impl)
    problem, device = AttentionProblem.from_tensors(q, k, causal=causal), _device_of(q)
    reason = spec.refuse(problem, device, return_lse=return_lse)
    if reason is not None:
        raise InputError(f"impl {spec.name!r} cannot serve {problem.describe()} on "
                         f"{device.name}: {reason}")
    if spec.kind != "extern":
        check_grid(q, k, decode=spec is _DEC)
    if config is not None:
        return spec, _explicit_config(config, problem, device, spec)
    return spec, _dispatcher(spec).choose(problem, device).config


def _reload(*, device_alias: bool | None = None, db_url: str | None = None) -> None:
    """Drop the configs every dispatcher (attn_fwd, attn_bwd, attn_decode) loaded and the
    memoised routes and launch plans; the arguments are :func:`flashtune.reload_configs`'s."""
    for dispatcher in list(_DISPATCHERS.values()):
        dispatcher.reload(device_alias=device_alias, db_url=db_url)
    for router in _ROUTERS.values():
        router.reload(device_alias=device_alias, db_url=db_url)
    _FAST.clear()
    _TRAIN_FAST.clear()
    _PLANS.clear()
    _BY_SHAPE.clear()
    kvcache.reset()
