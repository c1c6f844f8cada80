"""Public ops: ``flashtune.attention`` and what it resolves configs with.

The hot path of :func:`attention` on CUDA after the first call of a call signature: one dict
read keyed by the tensors' metadata (shapes, strides, dtypes, devices, 16-byte alignment) and
``causal``/``scale``/``return_lse``, which finds an
:class:`~flashtune.kernel_templates.attn_fwd.plan.AttnFwdPlan` -- the resolved config's
compiled kernel with its fixed arguments -- then the output allocation and the launch. The
key holds everything the input checks and Triton's specialisation depend on, so a hit needs
neither again. No database query, file read or recompile per call; configs come from
:class:`flashtune.runtime.lookup.Dispatcher`, loaded once per process and device. Without
plans (the interpreter, a Triton without the internals :mod:`~flashtune.kernel_templates.direct`
uses, a launch hook installed) calls check their inputs and go through the launcher.

Under ``torch.compile`` the call goes through the custom op ``flashtune::attention_fwd``
(registered with :mod:`torch.library`, with a fake implementation), so a compiled model
traces it without a graph break; eager calls skip the op dispatcher's overhead.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from dataclasses import replace
from functools import lru_cache, wraps
from typing import Any, Callable, Iterable, Literal, Mapping, Optional, overload

import torch

from flashtune.core.device import DeviceFingerprint, current_device, interpreting
from flashtune.core.problem import AttentionProblem
from flashtune.core.space import Config
from flashtune.core.errors import ConfigError
from flashtune.kernel_templates import direct, get_template
from flashtune.kernel_templates.direct import current_device as _current_device
from flashtune.kernel_templates.direct import current_stream as _current_stream
from flashtune.kernel_templates.attn_decode.plan import AttnDecodeDensePlan
from flashtune.kernel_templates.attn_fwd.plan import AttnFwdPlan
from flashtune.runtime import kvcache
from flashtune.runtime.checks import check_attention_inputs, check_grid
from flashtune.runtime.lookup import ConfigChoice, Dispatcher

log = logging.getLogger(__name__)

__all__ = ["attention", "lookup_config", "reload_configs", "warmup"]

_FWD = get_template("attn_fwd")
_BWD = get_template("attn_bwd")
_DEC = get_template("attn_decode")
_DISPATCH = Dispatcher(_FWD)
_DISPATCH_BWD = Dispatcher(_BWD)
# (q.shape, k.shape, dtype, device index, causal) -> (routed to attn_decode?, config): the
# per-call lookup
_FAST: dict[tuple[Any, ...], tuple[bool, Config]] = {}
# the plan key (see _plan_key) -> the launch plan of a CUDA call signature
_PLANS: dict[tuple[Any, ...], AttnFwdPlan | AttnDecodeDensePlan] = {}
_DIRECT = direct.supported()
_Tensor = torch.Tensor
_AUTOTUNED: set[AttentionProblem] = set()
_AUTOTUNE_LOCK = threading.Lock()
AUTOTUNE_TRIALS = 30
_BAD_TRIALS: set[str] = set()  # bad $FLASHTUNE_AUTOTUNE_TRIALS values already warned about


@lru_cache(maxsize=None)
def _device(device_type: str, index: int | None) -> DeviceFingerprint:
    return current_device(torch.device(device_type, index) if index is not None
                          else torch.device(device_type))


def _device_of(q: torch.Tensor) -> DeviceFingerprint:
    return _device(q.device.type, q.device.index)


def _explicit_config(config: Mapping[str, Any], problem: AttentionProblem,
                     device: DeviceFingerprint) -> Config:
    cfg = _FWD.space.validate(config)
    reason = _FWD.space.check(cfg, problem, device)
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
        reload_configs()


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


def _route(problem: AttentionProblem, device: DeviceFingerprint, *,
           tune: bool = True) -> ConfigChoice:
    """attn_decode's choice when :func:`~flashtune.runtime.kvcache.decode_route` takes the
    problem (short queries), else attn_fwd's (see :func:`_choose` for ``tune``)."""
    choice = kvcache.decode_route(problem, device, _DISPATCH)
    return choice if choice is not None else _choose(problem, device, tune=tune)


def _wants_grad(q: Any, k: Any, v: Any) -> bool:
    """Whether :func:`attention` takes its autograd path (attn_fwd, never the decode
    route) for these arguments (the test :func:`attention` makes inline)."""
    return torch.is_grad_enabled() and (getattr(q, "requires_grad", False)
                                        or getattr(k, "requires_grad", False)
                                        or getattr(v, "requires_grad", False))


def _resolve(q: torch.Tensor, k: torch.Tensor, causal: bool,
             key: tuple[Any, ...]) -> tuple[bool, Config]:
    choice = _route(AttentionProblem.from_tensors(q, k, causal=causal), _device_of(q))
    decode = choice.template == _DEC.name
    check_grid(q, k, decode=decode)  # once per key: it holds the shapes and the device
    route = _FAST[key] = (decode, choice.config)
    return route


def _plan_key(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
              scale: Any, return_lse: bool) -> tuple[Any, ...]:
    """Everything the input checks, the config choice and Triton's specialisation read."""
    return (q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(),
            q.dtype, k.dtype, v.dtype, q.get_device(), k.get_device(), v.get_device(),
            causal, scale, return_lse, (q.data_ptr() | k.data_ptr() | v.data_ptr()) & 15 == 0)


def _new_plan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: Config, causal: bool,
              scale: float | None, return_lse: bool, key: tuple[Any, ...],
              decode: bool) -> AttnFwdPlan | AttnDecodeDensePlan | None:
    global _DIRECT
    plan_type = AttnDecodeDensePlan if decode else AttnFwdPlan
    try:
        plan = plan_type(q, k, v, cfg, causal=causal, scale=scale, return_lse=return_lse)
    except Exception as exc:  # noqa: BLE001 - Triton internals moved: launch the normal way
        _DIRECT = False
        log.warning("flashtune: direct launches disabled (%s: %s); calls go through "
                    "Triton's launcher", type(exc).__name__, exc)
        return None
    _PLANS[key] = plan
    return plan


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
               scale: float | None, return_lse: bool,
               config: Mapping[str, int] | None) -> Any:
    key = None
    if config is None and _DIRECT and type(q) is _Tensor and type(k) is _Tensor \
            and type(v) is _Tensor and q.is_cuda:
        key = _plan_key(q, k, v, causal, scale, return_lse)
        plan = _PLANS.get(key)
        if plan is not None and _current_device() == plan.device_index \
                and not direct.hooks_installed():
            return plan(q, k, v, _current_stream(plan.device_index))
    check_attention_inputs(q, k, v, scale)
    if config is None:
        fast_key = (q.shape, k.shape, q.dtype, q.get_device(), causal)
        decode, cfg = _FAST.get(fast_key) or _resolve(q, k, causal, fast_key)
        if key is not None and _current_device() == q.get_device() \
                and not direct.hooks_installed():
            plan = _new_plan(q, k, v, cfg, causal, scale, return_lse, key, decode)
            if plan is not None:
                return plan(q, k, v, _current_stream(plan.device_index))
        if decode:
            return _DEC.launcher(q, k, v, cfg, causal=causal, scale=scale,
                                 return_lse=return_lse)
    else:
        check_grid(q, k)
        cfg = _explicit_config(config, AttentionProblem.from_tensors(q, k, causal=causal),
                               _device_of(q))
    return _FWD.launcher(q, k, v, cfg, causal=causal, scale=scale, return_lse=return_lse)




@overload
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = ...,
              scale: float | None = ..., return_lse: Literal[False] = ...,
              config: Mapping[str, int] | None = ...) -> torch.Tensor: ...
@overload
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = ...,
              scale: float | None = ..., return_lse: Literal[True],
              config: Mapping[str, int] | None = ...) -> tuple[torch.Tensor, torch.Tensor]: ...
@overload
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = ...,
              scale: float | None = ..., return_lse: bool = ...,
              config: Mapping[str, int] | None = ...
              ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    return_lse: bool = False,
    config: Mapping[str, int] | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Exact attention ``softmax(q k^T * scale) v`` with a flash-attention Triton kernel.

    Arguments:
        q: ``(batch, heads_q, seqlen_q, head_dim)``.
        k: ``(batch, heads_kv, seqlen_k, head_dim)``; ``heads_q`` a multiple of ``heads_kv``
            (GQA/MQA without copying K/V).
        v: same shape as ``k``.
            All three: float16 or bfloat16, one dtype, one CUDA device (or CPU under
            ``TRITON_INTERPRET=1``), any strides with a contiguous last dimension, so
            ``(batch, seqlen, heads, head_dim)`` storage viewed with ``.transpose(1, 2)``
            runs without a copy. head_dim in 16, 32, 64, 96, 128, 192, 256.
        causal: bottom-right aligned causal mask (flash-attention's convention): query ``i``
            sees key ``j`` iff ``j <= i + seqlen_k - seqlen_q``. Rows that see no key return
            zeros (and LSE ``-inf``).
        scale: softmax scale; default ``1 / sqrt(head_dim)``.
        return_lse: also return the float32 log-sum-exp ``(batch, heads_q, seqlen_q)``.
        config: explicit kernel config (keys of the ``attn_fwd`` space; ``USE_TMA`` and
            ``REVERSE_M`` optional). Default: the tuned config for this device and shape,
            found as :func:`lookup_config` describes.
    Returns:
        ``out`` of ``q``'s shape and dtype (contiguous), or ``(out, lse)``.
    Raises:
        InputError / InputTypeError (``ValueError`` / ``TypeError``) for bad tensors (and
        on CUDA for ``batch x heads_q`` over 65535, the launch grid's limit: split the
        batch), ConfigError (``ValueError``) for a config outside the space, DeviceError
        for CPU tensors without the interpreter. All before any launch.
    """
    if torch.compiler.is_compiling():
        out, lse = torch.ops.flashtune.attention_fwd(
            q, k, v, bool(causal), scale, bool(return_lse),
            None if config is None else json.dumps(dict(config), sort_keys=True))
        return (out, lse) if return_lse else out
    # _wants_grad, inlined: this runs on every call
    if torch.is_grad_enabled() and (getattr(q, "requires_grad", False)
                                    or getattr(k, "requires_grad", False)
                                    or getattr(v, "requires_grad", False)):
        check_attention_inputs(q, k, v, scale)
        check_grid(q, k)  # attn_fwd's grid, and attn_bwd's for the gradients
        out, lse = _attention_fn(q, k, v, bool(causal), scale, _forward_config(
            q, k, causal, config))
        return (out, lse) if return_lse else out
    result: torch.Tensor | tuple[torch.Tensor, torch.Tensor] = _attention(
        q, k, v, causal, scale, return_lse, config)
    return result


def _forward_config(q: torch.Tensor, k: torch.Tensor, causal: bool,
                    config: Mapping[str, int] | None) -> Config:
    problem = AttentionProblem.from_tensors(q, k, causal=causal)
    if config is not None:
        return _explicit_config(config, problem, _device_of(q))
    return _choose(problem, _device_of(q)).config


def _backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
              lse: torch.Tensor, dout: torch.Tensor, dlse: torch.Tensor | None, causal: bool,
              scale: float | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """attn_bwd with the config the dispatcher picks for the problem (tuned, else default)."""
    check_grid(q, k)
    problem = AttentionProblem.from_tensors(q, k, causal=causal)
    cfg = _DISPATCH_BWD.choose(problem, _device_of(q)).config
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor] = _BWD.launcher(
        q, k, v, out, lse, dout, cfg, causal=causal, scale=scale, dlse=dlse)
    return grads


def _once_differentiable(backward: Callable[..., Any]) -> Callable[..., Any]:
    """torch's ``once_differentiable`` (the backward runs without a graph; differentiating
    its gradients again raises torch's "differentiate twice" error), also for the usual
    gradient penalty, ``grad(loss, q, create_graph=True)``: there only the saved q/k/v
    require grad, not the incoming gradients, which are all torch's decorator looks at, so
    it would hand back gradients with no graph and a penalty on them would silently add
    nothing. Then one incoming gradient is passed on as a detached leaf that requires grad
    (the backward never differentiates it: it runs under ``no_grad``)."""
    once = torch.autograd.function.once_differentiable(backward)

    @wraps(backward)
    def wrapper(ctx: Any, *grads: Any) -> Any:
        if torch.is_grad_enabled() \
                and not any(g is not None and g.requires_grad for g in grads) \
                and any(t.requires_grad for t in ctx.saved_tensors):
            i = next((i for i, g in enumerate(grads) if g is not None), None)
            if i is not None:
                grads = (*grads[:i], grads[i].detach().requires_grad_(), *grads[i + 1:])
        return once(ctx, *grads)

    return wrapper


class _AttentionFn(torch.autograd.Function):
    """Eager autograd: the forward saves q, k, v, out and the LSE, nothing N x N; the
    backward recomputes P tile by tile (attn_bwd). The backward is not itself
    differentiable: a double backward (a gradient penalty) raises torch's error instead of
    silently getting a gradient with no graph."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                scale: float | None, cfg: Config) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse = _FWD.launcher(q, k, v, cfg, causal=causal, scale=scale, return_lse=True)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.scale = causal, scale
        ctx.set_materialize_grads(False)  # an unused LSE (or out) gets None, not zeros
        return out, lse

    @staticmethod
    @_once_differentiable
    def backward(ctx: Any, dout: torch.Tensor | None, dlse: torch.Tensor | None) -> Any:
        q, k, v, out, lse = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dk, dv = _backward(q, k, v, out, lse, dout, dlse, ctx.causal, ctx.scale)
        return dq, dk, dv, None, None, None


# torch leaves Function.apply unannotated; this is _AttentionFn.forward's signature
_attention_fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool, float | None, Config],
                        tuple[torch.Tensor, torch.Tensor]] = _AttentionFn.apply


def lookup_config(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                  causal: bool = False) -> ConfigChoice:
    """Which config :func:`attention` runs these inputs with, and why.

    Short-query problems (at most 16 queries) may be routed to the split-KV decode template
    (``choice.template == "attn_decode"``; see
    :func:`~flashtune.runtime.kvcache.decode_route`), unless a tensor requires grad with
    grad mode on (then :func:`attention` runs attn_fwd, and so does this answer); then the
    chain below runs over attn_decode's tuned configs. The chain: tuned for this exact problem on this device
    (``source="exact"``), else for
    a problem of the same bucket (``"bucket"``), else the nearest tuned problem
    (``"nearest"``), else one tuned on a similar device when ``FLASHTUNE_DEVICE_ALIAS=1``
    (``"device-alias"``), else the template default (``"default"``). Sources: the tuning
    database (``$FLASHTUNE_DB``, read-only), JSON files in ``$FLASHTUNE_CONFIG_DIR``, and
    the configs shipped in ``flashtune/configs/``. The returned
    :class:`~flashtune.runtime.lookup.ConfigChoice` carries the config, its source, the
    measured TFLOP/s when known and where the config came from.

    Nothing is tuned here, ``FLASHTUNE_AUTOTUNE=1`` or not: for a problem not tuned yet
    the answer is the choice before the tuning run :func:`attention`'s first call would
    start (:func:`warmup` runs it).

    Arguments:
        q, k, v: the tensors :func:`attention` would get (same rules, ``requires_grad``
            included); only their metadata is read, nothing is launched.
        causal: as for :func:`attention`.
    Returns:
        The :class:`~flashtune.runtime.lookup.ConfigChoice` (``config``, ``source``,
        ``template``, ``tflops``, ``median_ms``, ``tuned_problem``, ``origin``), memoised
        per problem and device until :func:`reload_configs`; its ``config`` is a copy,
        the caller's to change.
    Raises:
        InputError / InputTypeError (``ValueError`` / ``TypeError``) for tensors
        :func:`attention` would refuse, DeviceError for CPU tensors without the
        interpreter.
    """
    check_attention_inputs(q, k, v, None)
    problem, device = AttentionProblem.from_tensors(q, k, causal=causal), _device_of(q)
    if _wants_grad(q, k, v):  # attention's autograd path: attn_fwd, whatever the shape
        return _copy(_choose(problem, device, tune=False))
    return _copy(_route(problem, device, tune=False))


def _copy(choice: ConfigChoice) -> ConfigChoice:
    """The memoised ``choice`` with a config dict of its own: the dispatcher's is the one
    later calls run with, and must not change under them."""
    return replace(choice, config=dict(choice.config))


def reload_configs(*, device_alias: bool | None = None, db_url: str | None = None) -> None:
    """Drop the loaded configs; the next call reads the sources again.

    Arguments:
        device_alias: also serve configs tuned on another device of the same compute
            capability and shared-memory size (None: ``$FLASHTUNE_DEVICE_ALIAS``).
        db_url: read this database instead of ``$FLASHTUNE_DB`` / the default one.
    Returns:
        None. Nothing is read here: the sources are read lazily, so a missing or broken
        source shows up (as one warning) at the next call, never as an exception.
    """
    for dispatcher in (_DISPATCH, _DISPATCH_BWD, kvcache.DISPATCH):
        dispatcher.reload(device_alias=device_alias, db_url=db_url)
    _FAST.clear()
    _PLANS.clear()
    kvcache.reset()


def warmup(problems: Iterable[AttentionProblem] | None = None, *,
           device: torch.device | str | None = None,
           return_lse: bool = False) -> list[tuple[AttentionProblem, ConfigChoice]]:
    """Compile, in this process, the kernels :func:`attention` will launch for ``problems``
    (default: every problem tuned exactly for this device), so their first calls do not
    compile. Returns each problem with the config it resolved to. Kernels are specialised
    for contiguous inputs; ``return_lse`` selects the variant that also stores the LSE.
    Under the Triton interpreter nothing is compiled. With ``FLASHTUNE_AUTOTUNE=1`` an
    attn_fwd problem without a config tuned for it is tuned first, as its first
    :func:`attention` call would be (that launches kernels), so that the tuned kernel is
    the one compiled. The kernels are those of inference calls: a problem
    :func:`attention` routes to the decode template gets that template's.

    Arguments:
        problems: the :class:`~flashtune.core.problem.AttentionProblem` shapes to
            compile for; None: every problem tuned exactly for ``device``.
        device: the CUDA device to compile for (default: the current one; the CPU under
            ``TRITON_INTERPRET=1``).
        return_lse: compile the variant of :func:`attention` that also returns the LSE.
    Returns:
        ``[(problem, choice), ...]``: each problem with the
        :class:`~flashtune.runtime.lookup.ConfigChoice` it resolved to, in order.
    Raises:
        RuntimeError (torch's) when no CUDA device is available outside the interpreter;
        a Triton compilation error if a config cannot compile for ``device``.
    """
    torch_device = torch.device(device) if device is not None else (
        torch.device("cpu") if interpreting() else torch.device("cuda", torch.cuda.current_device()))
    dev = _device(torch_device.type, torch_device.index)
    todo = list(problems) if problems is not None else _DISPATCH.tuned_problems(dev)
    done = []
    for problem in todo:
        choice = _route(problem, dev)
        if not dev.is_interpreter:
            with torch.cuda.device(torch_device):
                launches = get_template(choice.template).warmup_launches
                for kernel, args, kwargs, grid in (launches(problem, choice.config,
                                                            return_lse=return_lse)
                                                   if launches is not None else []):
                    kernel.warmup(*args, grid=grid, **kwargs)
        done.append((problem, _copy(choice)))
    return done


# -- torch.library: the op torch.compile sees -------------------------------------------------


@torch.library.custom_op("flashtune::attention_fwd", mutates_args=())
def _attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                  scale: Optional[float], return_lse: bool,
                  config_json: Optional[str]) -> tuple[torch.Tensor, torch.Tensor]:
    # the LSE is always computed here: the backward needs it (return_lse only says what
    # flashtune.attention hands back)
    config = json.loads(config_json) if config_json else None
    out, lse = _attention(q, k, v, causal, scale, True, config)
    return out, lse


@_attention_op.register_fake
def _attention_fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                    scale: Optional[float], return_lse: bool,
                    config_json: Optional[str]) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    return out, q.new_empty(tuple(q.shape[:3]), dtype=torch.float32)


@torch.library.custom_op("flashtune::attention_bwd", mutates_args=())
def _attention_bwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                      lse: torch.Tensor, dout: torch.Tensor, dlse: Optional[torch.Tensor],
                      causal: bool, scale: Optional[float]
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backward(q, k, v, out, lse, dout, dlse, causal, scale)


@_attention_bwd_op.register_fake
def _attention_bwd_fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                        lse: torch.Tensor, dout: torch.Tensor, dlse: Optional[torch.Tensor],
                        causal: bool, scale: Optional[float]
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            torch.empty_like(k, memory_format=torch.contiguous_format),
            torch.empty_like(v, memory_format=torch.contiguous_format))


def _op_setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    q, k, v, causal, scale, _, _ = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.causal, ctx.scale = causal, scale


def _op_backward(ctx: Any, dout: torch.Tensor, dlse: torch.Tensor) -> Any:
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = torch.ops.flashtune.attention_bwd(q, k, v, out, lse, dout.contiguous(),
                                                   dlse, ctx.causal, ctx.scale)
    return dq, dk, dv, None, None, None, None


_attention_op.register_autograd(_op_backward, setup_context=_op_setup_context)
