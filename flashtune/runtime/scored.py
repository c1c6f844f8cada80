"""Calls beyond plain attention: FlashAttention-2's score modifications and packed batches.

:func:`flashtune.attention` with ``window``, ``softcap`` or ``alibi_slopes``, and
:func:`flashtune.attention_varlen` (``flash_attn_varlen_func``'s packed ``(total_tokens,
heads, head_dim)`` tensors with cumulative lengths) come here. Their conventions are
FlashAttention-2's (``flash_attn_interface.py``; its test suite's ``attention_ref`` is the
reference, :func:`~flashtune.kernel_templates.attn_fwd.reference.attn_fwd_reference`):

* ``window = (left, right)``: query ``i``, at key position ``i + Nk - Nq`` (bottom-right
  aligned, per sequence), sees keys ``[pos - left, pos + right]``; -1 leaves a side
  unbounded; with ``causal`` the right bound is 0 whatever ``right`` says;
* ``softcap``: the scaled scores become ``softcap * tanh(s / softcap)`` (Gemma-2);
* ``alibi_slopes``: float32 ``(heads_q,)`` or ``(batch, heads_q)``; the scores get
  ``-slope * |pos - j|``.

torch's SDPA backends serve none of them (a mask makes it fall back to its slower masked
kernels), so these calls run flashtune's kernels that serve them, routed as plain calls are
but for the problem *with* its modifications
(:class:`~flashtune.core.problem.AttentionProblem` keys them: exact, bucket, nearest with
the same modifications, then the nearest without them, then the default): the op's stored
choice where it serves the call (the Gluon forward serves a causal window), short queries
the split-KV ``attn_decode`` where :func:`~flashtune.runtime.kvcache.decode_route` takes
them (it serves all three), else attn_fwd; with gradients attn_fwd and attn_bwd. The route
is memoised per call signature, as the plain path's is; nothing is read per call. Packed
batches run attn_fwd only.

A packed batch is keyed as the problem ``(batch, heads, max_seqlen_q, max_seqlen_k)``. Its
``cu_seqlens`` are checked on the host (one small copy from the device: int32, starting
at 0, not decreasing, ending at the tokens' count), except while a CUDA graph is being
captured, where nothing may synchronise.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

import torch

from flashtune.core.errors import InputError, InputTypeError
from flashtune.core.problem import AttentionProblem, dtype_name
from flashtune.core.space import Config
from flashtune.core.spec import TemplateSpec, join_pair, split_pair
from flashtune.kernel_templates import get_template
from flashtune.kernel_templates.training import pair_fn
from flashtune.runtime.checks import check_attention_inputs, check_grid, check_score_mods
from flashtune.runtime.lookup import ConfigChoice
from flashtune.runtime.routing import (
    _BWD,
    _DISPATCH,
    _DISPATCH_BWD,
    _FWD,
    _device_of,
    _explicit_config,
    _route,
    _train_choice,
)
from flashtune.runtime.routing import _dispatcher as get_dispatcher

__all__ = ["attention_compiled", "attention_scored", "attention_varlen", "check_score_mods",
           "has_mods", "lookup_scored", "lookup_varlen", "varlen", "varlen_compiled"]

# call signature -> (forward spec, forward config, backward config or None)
_ROUTES: dict[tuple[Any, ...], tuple[TemplateSpec, Config, Config | None]] = {}


def has_mods(causal: bool, window: Any, softcap: Any, alibi_slopes: Any) -> bool:
    """Whether the arguments ask for a score modification (any value but the "off" ones:
    None, ``(-1, -1)`` or, with ``causal``, ``(-1, anything)``, softcap 0); values that are
    not valid count as asking, so that :func:`check_score_mods` names them."""
    if alibi_slopes is not None or (softcap is not None and softcap != 0):
        return True
    if window is None:
        return False
    try:
        left, right = window
    except (TypeError, ValueError):
        return True
    return not (left == -1 and (right == -1 or causal) and type(left) is int
                and type(right) is int)


def _wants_grad(q: Any, k: Any, v: Any) -> bool:
    return torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)


def _choose(problem: AttentionProblem, q: torch.Tensor, causal: bool, return_lse: bool,
            grad: bool, config: Mapping[str, Any] | None,
            impl: str | None) -> tuple[TemplateSpec, Config, Config | None]:
    """The forward (and for gradients attn_bwd's config) for ``problem``: the routed
    choice (the op's stored one, or attn_decode's for short queries) where it is one of
    flashtune's kernels that serves the call (attn_fwd serves every one; the Gluon forward a
    causal sliding window; attn_decode short queries; a packed batch only attn_fwd), else
    attn_fwd's own chain; ``impl``/``config`` forced where given."""
    device = _device_of(q)
    if impl is not None and impl != _FWD.name:
        spec = get_template(impl)
        reason = spec.refuse(problem, device, return_lse=return_lse) or (
            "an SDPA backend cannot apply these" if spec.kind == "extern" else None)
        if reason is None and (config is not None or grad):
            reason = "a forced config or gradients run attn_fwd only here"
        if reason is not None:
            raise InputError(f"impl {impl!r} cannot serve {problem.describe()} on "
                             f"{device.name}: {reason}")
        return spec, Config(get_dispatcher(spec).choose(problem, device).config), None
    reason = _FWD.refuse(problem, device, return_lse=return_lse)
    if reason is not None:
        raise InputError(f"flashtune cannot serve {problem.describe()} on {device.name}: "
                         f"{reason}")
    fcfg: Config
    if config is not None:
        fwd_part, bwd_part = split_pair(config)
        fcfg = _explicit_config(fwd_part, problem, device)
        if not grad:
            return _FWD, fcfg, None
        bcfg = (_explicit_config(bwd_part, problem, device, _BWD) if bwd_part
                else _DISPATCH_BWD.choose(problem, device).config)
        return _FWD, fcfg, bcfg
    if grad:
        choice = _train_choice(problem, device, return_lse=return_lse, paired=True)
        spec = get_template(choice.template)
        if _serves(spec, problem, device, return_lse) and spec.backward == _BWD.name:
            f, b = split_pair(choice.config)
            return spec, f, b
        return (_FWD, _DISPATCH.choose(problem, device).config,
                _DISPATCH_BWD.choose(problem, device).config)
    routed = _route(problem, device, return_lse=return_lse)
    spec = get_template(routed.template)
    if _serves(spec, problem, device, return_lse):
        return spec, routed.config, None
    return _FWD, _DISPATCH.choose(problem, device).config, None


def _serves(spec: TemplateSpec, problem: AttentionProblem, device: Any,
            return_lse: bool) -> bool:
    """Whether ``spec``, a routed choice, runs this call here: one of flashtune's kernels
    (an SDPA backend never applies a score modification) that serves the problem."""
    return spec.kind != "extern" and spec.refuse(problem, device,
                                                 return_lse=return_lse) is None


def lookup_scored(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
                  return_lse: bool, window: Any, softcap: Any,
                  alibi_slopes: Any) -> ConfigChoice:
    """:func:`flashtune.lookup_config` for a call with score modifications: the choice
    :func:`attention_scored` runs (the routed kernel of flashtune's that serves it, else
    attn_fwd's; for a call with gradients the pair's config, the backward's keys under
    ``bwd.``)."""
    check_attention_inputs(q, k, v, None)
    (left, right), cap, slopes = check_score_mods(q, causal=causal, window=window,
                                                  softcap=softcap, alibi_slopes=alibi_slopes)
    problem = AttentionProblem.from_tensors(q, k, causal=causal, window=(left, right),
                                            softcap=cap, alibi=slopes is not None)
    return _lookup(problem, q, k, v, return_lse)


def lookup_varlen(problem: AttentionProblem, q: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor) -> ConfigChoice:
    """The choice :func:`varlen` runs a packed batch keyed as ``problem`` with (as
    :func:`lookup_scored`). Only ``q``, ``k`` and ``v``'s metadata is read (the device,
    whether gradients are wanted)."""
    return _lookup(problem, q, k, v, False)


def _lookup(problem: AttentionProblem, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            return_lse: bool) -> ConfigChoice:
    """What :func:`_choose` picks for ``problem``, as a :class:`ConfigChoice` with its
    source (nothing tuned on a miss)."""
    device = _device_of(q)
    if _wants_grad(q, k, v):
        choice = _train_choice(problem, device, return_lse=return_lse, paired=True,
                               tune=False)
        spec = get_template(choice.template)
        if _serves(spec, problem, device, return_lse) and spec.backward == _BWD.name:
            return choice
        fwd, bwd = _DISPATCH.choose(problem, device), _DISPATCH_BWD.choose(problem, device)
        return replace(fwd, config=join_pair(fwd.config, bwd.config))
    routed = _route(problem, device, tune=False, return_lse=return_lse)
    if _serves(get_template(routed.template), problem, device, return_lse):
        return routed
    return _DISPATCH.choose(problem, device)


def _run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
         problem: Callable[[], AttentionProblem], key: tuple[Any, ...], causal: bool,
         scale: float | None, return_lse: bool, config: Mapping[str, Any] | None,
         impl: str | None, options: dict[str, Any]) -> Any:
    """Route (memoised per ``key``; ``problem`` builds the call's problem, on a miss only)
    and launch."""
    grad = _wants_grad(q, k, v)
    if config is None and impl is None:
        route = _ROUTES.get(key + (grad,))
        if route is None:
            route = _ROUTES[key + (grad,)] = _choose(problem(), q, causal, return_lse, grad,
                                                     None, None)
    else:
        route = _choose(problem(), q, causal, return_lse, grad, config, impl)
    spec, fcfg, bcfg = route
    if spec is not _FWD:  # the Gluon forward (a causal window), attn_decode (short queries)
        options = {n: o for n, o in options.items() if o is not None}
    if grad:
        assert bcfg is not None
        out, lse = pair_fn(q, k, v, causal, scale, spec.launcher, fcfg, _BWD.launcher, bcfg,
                           options)
        return (out, lse) if return_lse else out
    return spec.launcher(q, k, v, fcfg, causal=causal, scale=scale, return_lse=return_lse,
                         **options)


def attention_scored(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
                     scale: float | None, return_lse: bool,
                     config: Mapping[str, Any] | None, impl: str | None, window: Any,
                     softcap: Any, alibi_slopes: Any) -> Any:
    """:func:`flashtune.attention` with a score modification (the module doc): ``out`` or
    ``(out, lse)``, with gradients where q, k or v require them."""
    check_attention_inputs(q, k, v, scale)
    (left, right), cap, slopes = check_score_mods(q, causal=causal, window=window,
                                                  softcap=softcap, alibi_slopes=alibi_slopes)

    def problem() -> AttentionProblem:  # a route's first call: the grid checked with it
        check_grid(q, k)
        return AttentionProblem.from_tensors(q, k, causal=causal, window=(left, right),
                                             softcap=cap, alibi=slopes is not None)

    key = (q.shape, k.shape, q.dtype, q.get_device(), causal, return_lse, left, right, cap,
           slopes is not None)
    options = {"window": (left, right), "softcap": cap, "alibi_slopes": slopes}
    return _run(q, k, v, problem, key, causal, scale, return_lse, config, impl, options)


def _check_cu_seqlens(name: str, cu: Any, total: int, device: torch.device,
                      batch: int | None, read: bool = True) -> list[int] | None:
    """``cu`` checked as the cumulative lengths of ``total`` tokens (the values only with
    ``read`` and when no CUDA graph is being captured); returns them, or None when not
    read."""
    if not isinstance(cu, torch.Tensor):
        raise InputTypeError(f"{name} must be a torch.Tensor of int32, got {type(cu).__name__}")
    if cu.dtype != torch.int32:
        raise InputTypeError(f"{name} must be int32 (as flash_attn_varlen_func's), got "
                             f"{cu.dtype}")
    if cu.dim() != 1 or cu.numel() < 2:
        raise InputError(f"{name} must be 1-D with batch + 1 >= 2 entries, got shape "
                         f"{tuple(cu.shape)}")
    if batch is not None and cu.numel() != batch + 1:
        raise InputError(f"{name} has {cu.numel()} entries and cu_seqlens_q "
                         f"{batch + 1}: both must be batch + 1")
    if cu.device != device:
        raise InputError(f"{name} is on {cu.device}, q on {device}; they must share a device")
    if not read or (cu.is_cuda and torch.cuda.is_current_stream_capturing()):
        return None
    values = [int(x) for x in cu.tolist()]
    if values[0] != 0:
        raise InputError(f"{name}[0] must be 0, got {values[0]}")
    bad = next((i for i in range(1, len(values)) if values[i] < values[i - 1]), None)
    if bad is not None:
        raise InputError(f"{name} must not decrease, but {name}[{bad}] = {values[bad]} < "
                         f"{name}[{bad - 1}] = {values[bad - 1]}")
    if values[-1] != total:
        raise InputError(f"{name}[-1] = {values[-1]} must equal the number of tokens, "
                         f"{total}")
    return values


def attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                     max_seqlen_q: int, max_seqlen_k: int, *, causal: bool = False,
                     scale: float | None = None, window: tuple[int, int] | None = None,
                     softcap: float | None = None, alibi_slopes: torch.Tensor | None = None,
                     return_lse: bool = False, config: Mapping[str, Any] | None = None,
                     impl: str | None = None) -> Any:
    """Attention over a packed batch of sequences of different lengths, as
    ``flash_attn_varlen_func``: no padding, no token attends across sequences.

    Arguments:
        q: ``(total_q, heads_q, head_dim)``: the batch's queries one sequence after the
            other; k, v: ``(total_k, heads_kv, head_dim)``. float16 or bfloat16, one
            device, last dimension contiguous (other strides free: slices of a packed qkv
            run without a copy); ``heads_q`` a multiple of ``heads_kv``.
        cu_seqlens_q, cu_seqlens_k: int32 ``(batch + 1,)``: sequence ``b`` has queries
            ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]`` and keys likewise.
        max_seqlen_q, max_seqlen_k: the longest sequence's lengths (the launch grid; a
            value under the true maximum would leave queries unwritten, so it is checked
            with the lengths).
        causal, scale, window, softcap, alibi_slopes: as :func:`flashtune.attention`, per
            sequence (bottom-right aligned to each one's own lengths); ``alibi_slopes``
            ``(heads_q,)`` or ``(batch, heads_q)``.
        return_lse: also return the float32 LSE ``(heads_q, total_q)``.
        config, impl: as :func:`flashtune.attention` (only ``"attn_fwd"`` serves packed
            batches).
    Returns:
        ``out`` ``(total_q, heads_q, head_dim)`` (contiguous), or ``(out, lse)``; with
        gradients (q, k or v requiring grad) through attn_bwd.
    Raises:
        InputError / InputTypeError naming the argument, before any launch.
    """
    return varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                  causal=causal, scale=scale, window=window, softcap=softcap,
                  alibi_slopes=alibi_slopes, return_lse=return_lse, config=config, impl=impl)


def varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
           cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, *,
           causal: bool = False, scale: float | None = None,
           window: tuple[int, int] | None = None, softcap: float | None = None,
           alibi_slopes: torch.Tensor | None = None, return_lse: bool = False,
           config: Mapping[str, Any] | None = None, impl: str | None = None,
           read_lengths: bool = True) -> Any:
    """:func:`attention_varlen`; ``read_lengths`` False skips reading ``cu_seqlens``' values
    back to the host (a device sync per call) for a caller that built them itself and
    knows them valid (the transformers integration, once per layer); every other check
    stays."""
    (left, right), cap, slopes, problem = _varlen_checks(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale,
        window, softcap, alibi_slopes, read_lengths)
    key = ("varlen", cu_seqlens_q.numel() - 1, max_seqlen_q, max_seqlen_k, q.shape[0],
           k.shape[0], q.shape[1], k.shape[1], q.shape[2], q.dtype, q.get_device(), causal,
           return_lse, left, right, cap, slopes is not None)
    options = {"window": (left, right), "softcap": cap, "alibi_slopes": slopes,
               "cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k,
               "max_seqlen_q": max_seqlen_q, "max_seqlen_k": max_seqlen_k}
    return _run(q, k, v, problem, key, causal, scale, return_lse, config, impl, options)


def _varlen_checks(q: Any, k: Any, v: Any, cu_seqlens_q: Any, cu_seqlens_k: Any,
                   max_seqlen_q: Any, max_seqlen_k: Any, causal: bool, scale: Any,
                   window: Any, softcap: Any, alibi_slopes: Any, read_lengths: bool
                   ) -> tuple[tuple[int, int], float | None, torch.Tensor | None,
                              Callable[[], AttentionProblem]]:
    """:func:`varlen`'s checks (``cu_seqlens``' values only with ``read_lengths``): the
    window, softcap and slopes as checked, and a function building the call's packed
    problem."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise InputTypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3:
            raise InputError(f"{name} must have 3 dimensions (total_tokens, heads, head_dim) "
                             f"for attention_varlen, got shape {tuple(t.shape)}")
    if k.shape != v.shape:
        raise InputError(f"k and v must have the same shape, got k {tuple(k.shape)} and "
                         f"v {tuple(v.shape)}")
    for name, n in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise InputError(f"{name} must be a positive int, got {n!r}")
    # the 4-D checks on (1, heads, tokens, head_dim) views: dtype, device, heads, head dim
    check_attention_inputs(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                           v.transpose(0, 1)[None], scale)
    lens_q = _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0], q.device, None,
                               read_lengths)
    batch = cu_seqlens_q.numel() - 1
    lens_k = _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, k.shape[0], q.device, batch,
                               read_lengths)
    for name, values, given in (("max_seqlen_q", lens_q, max_seqlen_q),
                                ("max_seqlen_k", lens_k, max_seqlen_k)):
        if values is not None:
            longest = max(b - a for a, b in zip(values, values[1:]))
            if given < longest:
                raise InputError(f"{name} = {given}, but a sequence has {longest} tokens")
    (left, right), cap, slopes = check_score_mods(q, causal=causal, window=window,
                                                  softcap=softcap, alibi_slopes=alibi_slopes,
                                                  batch=batch)
    heads_q, heads_kv, head_dim = q.shape[1], k.shape[1], q.shape[2]
    for name, tokens, longest in (("max_seqlen_q", q.shape[0], max_seqlen_q),
                                  ("max_seqlen_k", k.shape[0], max_seqlen_k)):
        if tokens > batch * longest:  # free to check: the shapes alone say so
            raise InputError(f"{name} = {longest}, but {tokens} tokens in {batch} sequences "
                             f"need a longer one")
    if q.is_cuda and batch * heads_q > 65535:
        raise InputError(f"batch x heads_q = {batch * heads_q} programs on the launch "
                         f"grid's axis 1, more than CUDA's limit of 65535; split the batch")

    def problem() -> AttentionProblem:  # a route's first call (an empty side keys as 1)
        return AttentionProblem(batch, heads_q, heads_kv, max_seqlen_q, max_seqlen_k,
                                head_dim, bool(causal), dtype_name(q.dtype), left,
                                -1 if causal else right, cap or 0.0, slopes is not None,
                                max(1, q.shape[0]), max(1, k.shape[0]))

    return (left, right), cap, slopes, problem


def reset() -> None:
    """Drop the memoised routes (``flashtune.reload_configs``)."""
    _ROUTES.clear()


# -- torch.compile: the custom ops a compiled model traces (no graph break) -------------------


def _pair_route(q: torch.Tensor, k: torch.Tensor, causal: bool, window_left: int,
                window_right: int, softcap: float, alibi: bool, config_json: str | None,
                impl: str | None) -> tuple[TemplateSpec, Config, Config]:
    """The pair (forward, attn_bwd config) a compiled call runs: always one that saves the
    LSE for attn_bwd, as the plain custom op's route does; memoised."""
    key = ("compiled", q.shape, k.shape, q.dtype, q.get_device(), causal, window_left,
           window_right, softcap, alibi, config_json, impl)
    route = _ROUTES.get(key)
    if route is None:
        problem = AttentionProblem.from_tensors(q, k, causal=causal,
                                                window=(window_left, window_right),
                                                softcap=softcap or None, alibi=alibi)
        check_grid(q, k)
        config = json.loads(config_json) if config_json else None
        route = _ROUTES[key] = _choose(problem, q, causal, True, True, config, impl)
    spec, fcfg, bcfg = route
    assert bcfg is not None
    return spec, fcfg, bcfg


def _compiled_options(spec: TemplateSpec, window_left: int, window_right: int,
                      softcap: float, alibi_slopes: torch.Tensor | None) -> dict[str, Any]:
    options = {"window": (window_left, window_right), "softcap": softcap or None,
               "alibi_slopes": alibi_slopes}
    if spec is not _FWD:
        options = {n: o for n, o in options.items() if o is not None}
    return options


@torch.library.custom_op("flashtune::attention_scored_fwd", mutates_args=())
def _scored_fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                   scale: float | None, window_left: int, window_right: int, softcap: float,
                   alibi_slopes: torch.Tensor | None, config_json: str | None,
                   impl: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    spec, fcfg, _ = _pair_route(q, k, causal, window_left, window_right, softcap,
                                alibi_slopes is not None, config_json, impl)
    out, lse = spec.launcher(q, k, v, fcfg, causal=causal, scale=scale, return_lse=True,
                             **_compiled_options(spec, window_left, window_right, softcap,
                                                 alibi_slopes))
    return out, lse


@_scored_fwd_op.register_fake
def _scored_fwd_fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                     scale: float | None, window_left: int, window_right: int,
                     softcap: float, alibi_slopes: torch.Tensor | None,
                     config_json: str | None, impl: str | None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    return out, q.new_empty(tuple(q.shape[:3]), dtype=torch.float32)


@torch.library.custom_op("flashtune::attention_scored_bwd", mutates_args=())
def _scored_bwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, dout: torch.Tensor, dlse: torch.Tensor | None,
                   causal: bool, scale: float | None, window_left: int, window_right: int,
                   softcap: float, alibi_slopes: torch.Tensor | None,
                   config_json: str | None, impl: str | None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    spec, _, bcfg = _pair_route(q, k, causal, window_left, window_right, softcap,
                                alibi_slopes is not None, config_json, impl)
    options = {"window": (window_left, window_right), "softcap": softcap or None,
               "alibi_slopes": alibi_slopes}
    grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor] = _BWD.launcher(
        q, k, v, out, lse, dout, bcfg, causal=causal, scale=scale, dlse=dlse, **options)
    return grads


@_scored_bwd_op.register_fake
def _scored_bwd_fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                     lse: torch.Tensor, dout: torch.Tensor, dlse: torch.Tensor | None,
                     causal: bool, scale: float | None, window_left: int, window_right: int,
                     softcap: float, alibi_slopes: torch.Tensor | None,
                     config_json: str | None, impl: str | None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            torch.empty_like(k, memory_format=torch.contiguous_format),
            torch.empty_like(v, memory_format=torch.contiguous_format))


def _scored_setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    q, k, v, causal, scale, wl, wr, cap, slopes, config_json, impl = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.slopes = slopes
    ctx.args = (causal, scale, wl, wr, cap)
    ctx.route = (config_json, impl)


def _scored_backward(ctx: Any, dout: torch.Tensor, dlse: torch.Tensor) -> Any:
    q, k, v, out, lse = ctx.saved_tensors
    causal, scale, wl, wr, cap = ctx.args
    dq, dk, dv = torch.ops.flashtune.attention_scored_bwd(
        q, k, v, out, lse, dout.contiguous(), dlse, causal, scale, wl, wr, cap, ctx.slopes,
        *ctx.route)
    return dq, dk, dv, None, None, None, None, None, None, None, None


_scored_fwd_op.register_autograd(_scored_backward, setup_context=_scored_setup_context)


def attention_compiled(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
                       scale: float | None, return_lse: bool,
                       config: Mapping[str, Any] | None, impl: str | None, window: Any,
                       softcap: Any, alibi_slopes: Any) -> Any:
    """:func:`attention_scored` under ``torch.compile``: the custom op
    ``flashtune::attention_scored_fwd`` (its backward ``attention_scored_bwd``), so a
    compiled model traces the call without a graph break. It runs the pair the route
    chooses for a call with gradients (a forward that saves the LSE, and attn_bwd)."""
    (left, right), cap, slopes = check_score_mods(q, causal=causal, window=window,
                                                  softcap=softcap, alibi_slopes=alibi_slopes)
    out, lse = torch.ops.flashtune.attention_scored_fwd(
        q, k, v, bool(causal), scale, left, right, float(cap or 0.0), slopes,
        None if config is None else json.dumps(dict(config), sort_keys=True), impl)
    return (out, lse) if return_lse else out


def _varlen_route(q: torch.Tensor, k: torch.Tensor, cu_seqlens_q: torch.Tensor,
                  max_seqlen_q: int, max_seqlen_k: int, causal: bool, window_left: int,
                  window_right: int, softcap: float, alibi: bool, config_json: str | None,
                  impl: str | None) -> tuple[TemplateSpec, Config, Config]:
    """The pair (attn_fwd saving the LSE, attn_bwd) the compiled varlen ops run; memoised
    as the eager route is."""
    key = ("compiled-varlen", cu_seqlens_q.numel() - 1, max_seqlen_q, max_seqlen_k,
           q.shape, k.shape, q.dtype, q.get_device(), causal, window_left, window_right,
           softcap, alibi, config_json, impl)
    route = _ROUTES.get(key)
    if route is None:
        problem = AttentionProblem(
            cu_seqlens_q.numel() - 1, q.shape[1], k.shape[1], max_seqlen_q, max_seqlen_k,
            q.shape[2], causal, dtype_name(q.dtype), window_left,
            -1 if causal else window_right, softcap, alibi, max(1, q.shape[0]),
            max(1, k.shape[0]))
        config = json.loads(config_json) if config_json else None
        route = _ROUTES[key] = _choose(problem, q, causal, True, True, config, impl)
    spec, fcfg, bcfg = route
    assert bcfg is not None
    return spec, fcfg, bcfg


def _varlen_options(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                    max_seqlen_q: int, max_seqlen_k: int, window_left: int,
                    window_right: int, softcap: float,
                    alibi_slopes: torch.Tensor | None) -> dict[str, Any]:
    return {"window": (window_left, window_right), "softcap": softcap or None,
            "alibi_slopes": alibi_slopes, "cu_seqlens_q": cu_seqlens_q,
            "cu_seqlens_k": cu_seqlens_k, "max_seqlen_q": max_seqlen_q,
            "max_seqlen_k": max_seqlen_k}


@torch.library.custom_op("flashtune::attention_varlen_fwd", mutates_args=())
def _varlen_fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int,
                   max_seqlen_k: int, causal: bool, scale: float | None, window_left: int,
                   window_right: int, softcap: float, alibi_slopes: torch.Tensor | None,
                   config_json: str | None, impl: str | None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    spec, fcfg, _ = _varlen_route(q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k, causal,
                                  window_left, window_right, softcap,
                                  alibi_slopes is not None, config_json, impl)
    out, lse = spec.launcher(q, k, v, fcfg, causal=causal, scale=scale, return_lse=True,
                             **_varlen_options(cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                               max_seqlen_k, window_left, window_right,
                                               softcap, alibi_slopes))
    return out, lse


@_varlen_fwd_op.register_fake
def _varlen_fwd_fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                     max_seqlen_q: int, max_seqlen_k: int, causal: bool,
                     scale: float | None, window_left: int, window_right: int,
                     softcap: float, alibi_slopes: torch.Tensor | None,
                     config_json: str | None, impl: str | None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    return out, q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@torch.library.custom_op("flashtune::attention_varlen_bwd", mutates_args=())
def _varlen_bwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, dout: torch.Tensor, dlse: torch.Tensor | None,
                   cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int,
                   max_seqlen_k: int, causal: bool, scale: float | None, window_left: int,
                   window_right: int, softcap: float, alibi_slopes: torch.Tensor | None,
                   config_json: str | None, impl: str | None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _, _, bcfg = _varlen_route(q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k, causal,
                               window_left, window_right, softcap, alibi_slopes is not None,
                               config_json, impl)
    grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor] = _BWD.launcher(
        q, k, v, out, lse, dout, bcfg, causal=causal, scale=scale, dlse=dlse,
        **_varlen_options(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                          window_left, window_right, softcap, alibi_slopes))
    return grads


@_varlen_bwd_op.register_fake
def _varlen_bwd_fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                     lse: torch.Tensor, dout: torch.Tensor, dlse: torch.Tensor | None,
                     cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                     max_seqlen_q: int, max_seqlen_k: int, causal: bool,
                     scale: float | None, window_left: int, window_right: int,
                     softcap: float, alibi_slopes: torch.Tensor | None,
                     config_json: str | None, impl: str | None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            torch.empty_like(k, memory_format=torch.contiguous_format),
            torch.empty_like(v, memory_format=torch.contiguous_format))


def _varlen_setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, wl, wr, cap, slopes, config_json, \
        impl = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)
    ctx.slopes = slopes
    ctx.args = (max_q, max_k, causal, scale, wl, wr, cap)
    ctx.route = (config_json, impl)


def _varlen_backward(ctx: Any, dout: torch.Tensor, dlse: torch.Tensor) -> Any:
    q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
    dq, dk, dv = torch.ops.flashtune.attention_varlen_bwd(
        q, k, v, out, lse, dout.contiguous(), dlse, cu_q, cu_k, *ctx.args, ctx.slopes,
        *ctx.route)
    return (dq, dk, dv) + (None,) * 12


_varlen_fwd_op.register_autograd(_varlen_backward, setup_context=_varlen_setup_context)


def varlen_compiled(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                    max_seqlen_q: int, max_seqlen_k: int, *, causal: bool = False,
                    scale: float | None = None, window: tuple[int, int] | None = None,
                    softcap: float | None = None, alibi_slopes: torch.Tensor | None = None,
                    return_lse: bool = False, config: Mapping[str, Any] | None = None,
                    impl: str | None = None) -> Any:
    """:func:`attention_varlen` under ``torch.compile``: the custom op
    ``flashtune::attention_varlen_fwd`` (its backward ``attention_varlen_bwd``), so a
    compiled model traces the call without a graph break. Every check but the values of
    ``cu_seqlens`` (a device sync, as under CUDA-graph capture) runs while tracing."""
    (left, right), cap, slopes, _ = _varlen_checks(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale,
        window, softcap, alibi_slopes, False)
    out, lse = torch.ops.flashtune.attention_varlen_fwd(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, bool(causal), scale,
        left, right, float(cap or 0.0), slopes,
        None if config is None else json.dumps(dict(config), sort_keys=True), impl)
    return (out, lse) if return_lse else out
