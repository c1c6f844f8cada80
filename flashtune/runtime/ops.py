"""Public ops: ``flashtune.attention`` and what it resolves configs with.

The API lives here (:func:`attention`, :func:`lookup_config`, :func:`reload_configs`,
:func:`warmup`), the work in two modules. :mod:`flashtune.runtime.routing` picks the kernel
and config and keeps the per-call caches: an inference call goes straight to its
``_attention`` (the hot path, described there: after the first call of a call signature,
one dict read, then the launch). :mod:`flashtune.runtime.autograd` runs the calls with a
tensor that requires grad (attn_fwd, and attn_bwd for the gradients) and registers the
custom op ``flashtune::attention_fwd_v2`` (with a fake implementation) that a call under
``torch.compile`` goes through, so a compiled model traces it without a graph break; eager
calls skip the op dispatcher's overhead.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Any, Literal, overload

import torch

from flashtune.core.device import interpreting
from flashtune.core.problem import AttentionProblem
from flashtune.core.space import config_text
from flashtune.kernel_templates import get_template
from flashtune.runtime import scored as _scored_module
from flashtune.runtime.autograd import _train
from flashtune.runtime.checks import autocast_inputs, check_attention_inputs
from flashtune.runtime.lookup import ConfigChoice
from flashtune.runtime.routing import (
    _DISPATCH,
    _attention,
    _device,
    _device_of,
    _reload,
    _route,
    _train_choice,
)

__all__ = ["attention", "attention_varlen", "lookup_config", "reload_configs", "warmup"]

_F32 = torch.float32
# eager outside torch.compile's tracing; a compiled attention() with score modifications
# or a compiled attention_varlen() takes a custom op instead (no graph break)
_varlen_eager = torch.compiler.disable(  # type: ignore[no-untyped-call]
    _scored_module.attention_varlen)


@functools.wraps(_scored_module.attention_varlen)
def attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                     max_seqlen_q: int, max_seqlen_k: int, **options: Any) -> Any:
    if getattr(q, "dtype", None) is _F32:  # under autocast: its dtype, as torch's SDPA
        q, k, v = autocast_inputs(q, k, v)
    if torch.compiler.is_compiling():
        return _scored_module.varlen_compiled(q, k, v, cu_seqlens_q, cu_seqlens_k,
                                              max_seqlen_q, max_seqlen_k, **options)
    return _varlen_eager(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                         **options)


_scored = torch.compiler.disable(_scored_module.attention_scored)  # type: ignore[no-untyped-call]
has_mods = _scored_module.has_mods


@overload
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = ...,
              scale: float | None = ..., return_lse: Literal[False] = ...,
              config: Mapping[str, int] | None = ...,
              impl: str | None = ..., window: tuple[int, int] | None = ...,
              softcap: float | None = ...,
              alibi_slopes: torch.Tensor | None = ...,
              dropout_p: float = ...) -> torch.Tensor: ...
@overload
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = ...,
              scale: float | None = ..., return_lse: Literal[True],
              config: Mapping[str, int] | None = ...,
              impl: str | None = ..., window: tuple[int, int] | None = ...,
              softcap: float | None = ...,
              alibi_slopes: torch.Tensor | None = ...,
              dropout_p: float = ...) -> tuple[torch.Tensor, torch.Tensor]: ...
@overload
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = ...,
              scale: float | None = ..., return_lse: bool = ...,
              config: Mapping[str, int] | None = ..., impl: str | None = ...,
              window: tuple[int, int] | None = ..., softcap: float | None = ...,
              alibi_slopes: torch.Tensor | None = ..., dropout_p: float = ...
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
    impl: str | None = None,
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Exact attention ``softmax(q k^T * scale) v`` with the fastest implementation tuned
    for the shape: one of flashtune's kernels (Triton, Gluon) or an SDPA backend of torch's.

    Arguments:
        q: ``(batch, heads_q, seqlen_q, head_dim)``.
        k: ``(batch, heads_kv, seqlen_k, head_dim)``; ``heads_q`` a multiple of ``heads_kv``
            (GQA/MQA without copying K/V).
        v: same shape as ``k``.
            All three: float16 or bfloat16 (float32 under autocast runs in autocast's
            dtype, as torch's SDPA runs it), one dtype, one CUDA device (or CPU under
            ``TRITON_INTERPRET=1``), any strides with a contiguous last dimension, so
            ``(batch, seqlen, heads, head_dim)`` storage viewed with ``.transpose(1, 2)``
            runs without a copy. Any head_dim from 1 to 256 (FlashAttention-2's range;
            one that is not a multiple of 8 reads through masked loads instead of the
            tensor-copy engine, still without a copy).
        causal: bottom-right aligned causal mask (flash-attention's convention): query ``i``
            sees key ``j`` iff ``j <= i + seqlen_k - seqlen_q``. Rows that see no key return
            zeros (and LSE ``-inf``).
        scale: softmax scale; default ``1 / sqrt(head_dim)``.
        return_lse: also return the float32 log-sum-exp ``(batch, heads_q, seqlen_q)``.
        config: explicit kernel config (keys of the ``attn_fwd`` space, or of ``impl``'s;
            ``USE_TMA`` and ``REVERSE_M`` optional). Default: the tuned choice for this
            device and shape, found as :func:`lookup_config` describes.
        impl: run this implementation (``"attn_fwd"``, ``"attn_fwd_gluon"``,
            ``"sdpa_cudnn"``...; its tuned config for the shape unless ``config`` is
            given); an error if it cannot serve the call. Default: the router's choice.
            With gradients: ``"attn_fwd"`` runs attn_fwd with attn_bwd (None: the router's
            training step, which may be an SDPA backend's); an SDPA backend runs its own
            backward; others have no backward (InputError).
        window: FlashAttention-2's ``window_size``: ``(left, right)``, query ``i`` (at key
            position ``i + seqlen_k - seqlen_q``) sees keys ``[pos - left, pos + right]``;
            -1 leaves a side unbounded; with ``causal`` the right bound is 0. None or
            ``(-1, -1)``: no window.
        softcap: FlashAttention-2's ``softcap``: scores become ``softcap * tanh(s /
            softcap)`` before the mask (Gemma-2); None or 0.0: none.
        alibi_slopes: float32 ``(heads_q,)`` or ``(batch, heads_q)``: scores get
            ``-slope * |pos - j|`` (ALiBi, as FlashAttention-2's).
        dropout_p: FlashAttention-2's ``dropout_p``, attention dropout in ``[0, 1)``: each
            attention probability is dropped with probability ``dropout_p`` (quantised to
            1/256: 0.1 drops 26/256) and the kept ones divided by the keep probability; the
            LSE is that of every score. Applied whenever it is > 0, as FlashAttention-2
            does (pass 0.0 in evaluation; torch's SDPA also applies its ``dropout_p``
            regardless of ``training``). The mask comes from a seed drawn per call from
            torch's generator on the tensors' device (``torch.manual_seed`` reproduces a
            call; each CUDA-graph replay draws a fresh one) and the backward regenerates
            it; nothing N x N is stored.
            Calls with any of these four run flashtune's kernels that serve them
            (attn_fwd and attn_bwd; short queries attn_decode, as plain ones, except with
            dropout: :mod:`flashtune.runtime.scored`); under ``torch.compile`` through
            custom ops (no graph break).
    Returns:
        ``out`` of ``q``'s shape and dtype, or ``(out, lse)``. flashtune's kernels write
        ``out`` in ``q``'s layout (``torch.empty_like(q)``), and with gradients dQ, dK
        and dV in those of q, k, v: a ``(B, N, H, D)`` tensor viewed per head gets that
        storage order back, so a model's transpose back is a view, not a copy (under
        ``torch.compile`` too: the custom ops declare those layouts). A head dim the
        training step pads (not a multiple of 8 on a GPU) comes back contiguous. An SDPA
        backend's output follows torch's layout.
    Raises:
        InputError / InputTypeError (``ValueError`` / ``TypeError``) for bad tensors (and
        on CUDA for ``batch x heads_q`` over 65535, the launch grid's limit: split the
        batch) or a ``dropout_p`` outside ``[0, 1)``, ConfigError (``ValueError``) for a config outside the space, DeviceError
        for CPU tensors without the interpreter. All before any launch.
    """
    if getattr(q, "dtype", None) is _F32:  # under autocast: its dtype, as torch's SDPA
        q, k, v = autocast_inputs(q, k, v)
    if (window is not None or softcap is not None or alibi_slopes is not None
            or dropout_p) and has_mods(causal, window, softcap, alibi_slopes, dropout_p):
        if torch.compiler.is_compiling():  # the custom op: no graph break
            traced: torch.Tensor | tuple[torch.Tensor, torch.Tensor] = \
                _scored_module.attention_compiled(
                    q, k, v, causal=causal, scale=scale, return_lse=return_lse,
                    config=config, impl=impl, window=window, softcap=softcap,
                    alibi_slopes=alibi_slopes, dropout_p=dropout_p)
            return traced
        scored: torch.Tensor | tuple[torch.Tensor, torch.Tensor] = _scored(
            q, k, v, causal=causal, scale=scale, return_lse=return_lse, config=config,
            impl=impl, window=window, softcap=softcap, alibi_slopes=alibi_slopes,
            dropout_p=dropout_p)
        return scored
    if impl is not None:  # forced (attn_fwd too: with gradients, its own pair)
        return _attention_impl(q, k, v, causal, scale, return_lse, config, impl)
    if torch.compiler.is_compiling():
        out, lse = torch.ops.flashtune.attention_fwd_v2(
            q, k, v, bool(causal), scale, bool(return_lse),
            None if config is None else config_text(config))
        return (out, lse) if return_lse else out
    # _wants_grad, inlined: this runs on every call
    if torch.is_grad_enabled() and (getattr(q, "requires_grad", False)
                                    or getattr(k, "requires_grad", False)
                                    or getattr(v, "requires_grad", False)):
        check_attention_inputs(q, k, v, scale)
        trained: torch.Tensor | tuple[torch.Tensor, torch.Tensor] = _train(
            q, k, v, bool(causal), scale, bool(return_lse), config)
        return trained
    result: torch.Tensor | tuple[torch.Tensor, torch.Tensor] = _attention(
        q, k, v, causal, scale, return_lse, config)
    return result


def _attention_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                    scale: float | None, return_lse: bool, config: Mapping[str, int] | None,
                    impl: str) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """:func:`attention` with ``impl`` given: an SDPA backend runs as it is
    (torch's autograd and torch.compile know it); a kernel of flashtune's goes through the
    custom op under torch.compile, and with gradients pairs with its backward template (one
    without is an InputError)."""
    spec = get_template(impl)
    if spec.kind != "extern":
        if _wants_grad(q, k, v) and not torch.compiler.is_compiling():
            check_attention_inputs(q, k, v, scale)
            trained: torch.Tensor | tuple[torch.Tensor, torch.Tensor] = _train(
                q, k, v, bool(causal), scale, bool(return_lse), config, impl)
            return trained
        if torch.compiler.is_compiling():
            out, lse = torch.ops.flashtune.attention_fwd_v2(
                q, k, v, bool(causal), scale, bool(return_lse),
                None if config is None else config_text(config), impl)
            return (out, lse) if return_lse else out
    result: torch.Tensor | tuple[torch.Tensor, torch.Tensor] = _attention(
        q, k, v, causal, scale, return_lse, config, impl)
    return result


def _wants_grad(q: Any, k: Any, v: Any) -> bool:
    """Whether :func:`attention` takes its autograd path (attn_fwd, never the decode
    route) for these arguments (the test :func:`attention` makes inline)."""
    return torch.is_grad_enabled() and (getattr(q, "requires_grad", False)
                                        or getattr(k, "requires_grad", False)
                                        or getattr(v, "requires_grad", False))


def lookup_config(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                  causal: bool = False, return_lse: bool = False,
                  window: tuple[int, int] | None = None, softcap: float | None = None,
                  alibi_slopes: torch.Tensor | None = None,
                  dropout_p: float = 0.0) -> ConfigChoice:
    """Which implementation and config :func:`attention` runs these inputs with, and why.

    First the op's stored choice (``flashtune tune --op``, which times every implementation
    side by side; ``choice.template`` is the implementation): made for this exact problem,
    its bucket, the nearest problem or a similar device, and able to serve the call (an
    SDPA backend never gets a causal call it would mask differently, nor an LSE it cannot
    return); short-query problems ask the ``decode`` op's choices before the ``fwd`` op's.
    Without one, the per-template route below. Short-query problems (at most 16 queries) may be routed to the split-KV decode template
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
        causal, return_lse: as for :func:`attention` (an implementation that cannot return
            the LSE is not chosen for a call that asks for it).
        window, softcap, alibi_slopes, dropout_p: as for :func:`attention`; with any of
            them the answer is attn_fwd's choice for the problem with its modifications
            (the pair's config, the backward's keys under ``bwd.``, for a call with
            gradients).
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
    if getattr(q, "dtype", None) is _F32:  # under autocast: its dtype, as attention runs it
        q, k, v = autocast_inputs(q, k, v)
    if (window is not None or softcap is not None or alibi_slopes is not None
            or dropout_p) and has_mods(causal, window, softcap, alibi_slopes, dropout_p):
        return _copy(_scored_module.lookup_scored(
            q, k, v, causal=causal, return_lse=return_lse, window=window, softcap=softcap,
            alibi_slopes=alibi_slopes, dropout_p=dropout_p))
    check_attention_inputs(q, k, v, None)
    problem, device = AttentionProblem.from_tensors(q, k, causal=causal), _device_of(q)
    if _wants_grad(q, k, v):  # attention's training route, whatever the shape
        return _copy(_train_choice(problem, device, return_lse=return_lse, tune=False))
    return _copy(_route(problem, device, tune=False, return_lse=return_lse))


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
    _reload(device_alias=device_alias, db_url=db_url)
    _scored_module.reset()


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

