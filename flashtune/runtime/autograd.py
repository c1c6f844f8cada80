"""Gradients for :func:`flashtune.attention`, eager and under ``torch.compile``.

Eager calls with a tensor that requires grad run their training route
(:func:`~flashtune.runtime.routing._train_route`: the ``train`` op's stored choice, else
attn_fwd with attn_bwd's tuned config): a pair of flashtune's kernels through
:class:`~flashtune.kernel_templates.training.PairFn` (the forward saves q, k, v, out and the
LSE, nothing N x N; the backward recomputes P tile by tile with the backward config chosen
with the forward), or an SDPA backend that torch's autograd differentiates.

Under ``torch.compile`` the call goes through the custom op ``flashtune::attention_fwd_v2``
(registered with :mod:`torch.library`, with a fake implementation, on import of this
module), so a compiled model traces it without a graph break; its backward is the custom op
``flashtune::attention_bwd_v2``. Both run the training route with ``paired`` (the custom
op's backward is flashtune's): flashtune's own pairs, or an SDPA backend's forward with the
``paired_backward`` it names (cuDNN's own backward, from the forward's output and LSE).
Eager calls skip the op dispatcher's overhead.

The ops declare ``out`` and the gradients in the inputs' layout (:func:`like_layout`), as
flashtune's kernels write them: transformers hands attention ``(B, N, H, D)`` projections
viewed per head and transposes the output back, a view where the output lies in that order
(a copy of the output forward and of dQ, dK and dV backward where it was contiguous).

The ops' names carry the version of what their fakes declare (``_v2``: the inputs' layout;
the unsuffixed ops declared contiguous tensors). Inductor's FX graph cache keys a compiled
graph by its code, which names the op but not its fake: a graph cached under an older
declaration and replayed with the new kernels fails its stride asserts. A new name is a new
graph. Bump the suffix whenever a fake's outputs change.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from flashtune.core.space import config_from_text
from flashtune.kernel_templates import get_template
from flashtune.kernel_templates.training import pair_fn
from flashtune.runtime.lookup import remember
from flashtune.runtime.routing import _attention, _train_route


def _train(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
           scale: float | None, return_lse: bool, config: Mapping[str, Any] | None = None,
           impl: str | None = None) -> Any:
    """:func:`flashtune.attention` with gradients: ``out``, or ``(out, lse)``."""
    route = _train_route(q, k, causal, return_lse, config, impl)
    if route.bwd is None:  # an extern: torch's autograd differentiates it
        return route.fwd.launcher(q, k, v, route.fwd_config, causal=causal, scale=scale,
                                  return_lse=return_lse)
    out, lse = pair_fn(q, k, v, causal, scale, route.fwd.launcher, route.fwd_config,
                       route.bwd.launcher, route.bwd_config)
    return (out, lse) if return_lse else out


def _paired(q: torch.Tensor, k: torch.Tensor, causal: bool, config_str: str | None,
            impl: str | None) -> Any:
    """The custom ops' route: flashtune's own pairs (their LSE feeds the backward op)."""
    config = config_from_text(config_str) if config_str is not None else None
    return _train_route(q, k, causal, True, config, impl, paired=True)


# -- torch.library: the op torch.compile sees -------------------------------------------------


_STRIDES: dict[tuple[torch.Size, tuple[int, ...]], tuple[int, ...]] = {}


def _declared_strides(like: torch.Tensor) -> tuple[int, ...]:
    """The strides ``torch.empty_like(like)`` gives (``like``'s where it is dense, else
    dense ones in its strides' order), found once per shape and strides on the meta
    device, then remembered."""
    key = (like.shape, like.stride())
    strides = _STRIDES.get(key)
    if strides is None:
        strides = remember(_STRIDES, key, torch.empty_like(like, device="meta").stride())
    return strides


def like_layout(like: torch.Tensor) -> torch.Tensor:
    """A fake implementation's output shaped and laid out like ``like``:
    ``torch.empty_like(like)`` (``like``'s strides where it is dense, else dense ones in
    the same order).
    What flashtune's kernels write: ``out`` and the gradients in the inputs' layout, so a
    ``(B, N, H, D)`` tensor viewed per head, as transformers hands it, gets that storage
    back and its transpose back is a view."""
    return torch.empty_like(like)


def as_declared(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A custom op's output ``t`` as its fake implementation declares it
    (:func:`like_layout` of ``like``). Inductor lays out what follows an op by the fake's
    strides and asserts them on the real outputs, while an implementation may write
    another layout (torch's SDPA backends write theirs; a kernel handed a copy of a
    non-dense input writes the copy's). ``t`` is returned as it is where it already has
    the declared strides, else copied into them."""
    if t.stride() == _declared_strides(like):
        return t
    return torch.empty_like(like, dtype=t.dtype).copy_(t)


_Grads = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def grads_like(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> _Grads:
    """The backward ops' fake gradients: laid out like q, k, v (:func:`like_layout`)."""
    return like_layout(q), like_layout(k), like_layout(v)


def grads_as_declared(grads: _Grads, q: torch.Tensor, k: torch.Tensor,
                      v: torch.Tensor) -> _Grads:
    """A backward op's gradients as :func:`grads_like` declares them (:func:`as_declared`)."""
    return as_declared(grads[0], q), as_declared(grads[1], k), as_declared(grads[2], v)


def lse_as_declared(lse: torch.Tensor) -> torch.Tensor:
    """The LSE as the fakes declare it: contiguous float32."""
    return lse.contiguous()


@torch.library.custom_op("flashtune::attention_fwd_v2", mutates_args=())
def _attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                  scale: float | None, return_lse: bool,
                  config_str: str | None, impl: str | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    # the LSE is always computed here: the backward needs it (return_lse only says what
    # flashtune.attention hands back)
    if impl is not None and "train" not in get_template(impl).serves:  # no backward:
        config = config_from_text(config_str) if config_str is not None else None  # its backward op raises
        out, lse = _attention(q, k, v, causal, scale, True, config, impl)
    else:
        route = _paired(q, k, causal, config_str, impl)
        out, lse = route.fwd.launcher(q, k, v, route.fwd_config, causal=causal, scale=scale,
                                      return_lse=True)
    return as_declared(out, q), lse_as_declared(lse)


@_attention_op.register_fake
def _attention_fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                    scale: float | None, return_lse: bool,
                    config_str: str | None, impl: str | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    return like_layout(q), q.new_empty(tuple(q.shape[:3]), dtype=torch.float32)


@torch.library.custom_op("flashtune::attention_bwd_v2", mutates_args=())
def _attention_bwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                      lse: torch.Tensor, dout: torch.Tensor, dlse: torch.Tensor | None,
                      causal: bool, scale: float | None, config_str: str | None = None,
                      impl: str | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    route = _paired(q, k, causal, config_str, impl)
    dq, dk, dv = route.bwd.launcher(q, k, v, out, lse, dout, route.bwd_config, causal=causal,
                                    scale=scale, dlse=dlse)
    return grads_as_declared((dq, dk, dv), q, k, v)


@_attention_bwd_op.register_fake
def _attention_bwd_fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                        lse: torch.Tensor, dout: torch.Tensor, dlse: torch.Tensor | None,
                        causal: bool, scale: float | None, config_str: str | None = None,
                        impl: str | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return grads_like(q, k, v)


def _op_setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    q, k, v, causal, scale, _, config_str, impl = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.causal, ctx.scale, ctx.config_str, ctx.impl = causal, scale, config_str, impl
    # an output the loss does not use gets None, not zeros, as eager's PairFn: a compiled
    # step that does not use the LSE hands its backward no dLSE (a backward that takes
    # none, cuDNN's in attn_fwd_gluon_bwd_cudnn, would otherwise hand the call to another)
    ctx.set_materialize_grads(False)


def dout_or_zeros(dout: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
    """The output's gradient for a custom op's backward: zeros where the loss used only the
    LSE (the op's context hands over None for an unused output, not zeros). The backward
    kernels read any strides with a contiguous last dim (as eager's ``PairFn`` hands them
    over): a ``(B, N, H, D)`` gradient viewed per head, transformers' transpose of the
    output's, is not copied.

    Arguments:
        dout: the output's gradient, or None.
        out: the forward's output.
    Returns:
        ``dout``, copied only where its last dim is strided, or zeros like ``out``.
    """
    if dout is None:
        return torch.zeros_like(out)
    return dout if dout.stride(-1) == 1 else dout.contiguous()


def _op_backward(ctx: Any, dout: torch.Tensor | None, dlse: torch.Tensor | None) -> Any:
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = torch.ops.flashtune.attention_bwd_v2(q, k, v, out, lse, dout_or_zeros(dout, out),
                                                   dlse, ctx.causal, ctx.scale,
                                                   ctx.config_str, ctx.impl)
    return dq, dk, dv, None, None, None, None, None


_attention_op.register_autograd(_op_backward, setup_context=_op_setup_context)
