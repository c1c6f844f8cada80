"""Gradients for :func:`flashtune.attention`, eager and under ``torch.compile``.

Eager calls with a tensor that requires grad go through :class:`_AttentionFn`
(``_attention_fn``): the forward launches attn_fwd with the LSE and saves q, k, v, out and
the LSE, nothing N x N; the backward recomputes P tile by tile (attn_bwd, with the config the
attn_bwd dispatcher picks).

Under ``torch.compile`` the call goes through the custom op ``flashtune::attention_fwd``
(registered with :mod:`torch.library`, with a fake implementation, on import of this
module), so a compiled model traces it without a graph break; its backward is the custom op
``flashtune::attention_bwd``. Eager calls skip the op dispatcher's overhead.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import wraps
from typing import Any

import torch

from flashtune.core.problem import AttentionProblem
from flashtune.core.space import Config
from flashtune.runtime.checks import check_grid
from flashtune.runtime.routing import _BWD, _DISPATCH_BWD, _FWD, _attention, _device_of


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


# -- torch.library: the op torch.compile sees -------------------------------------------------


@torch.library.custom_op("flashtune::attention_fwd", mutates_args=())
def _attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                  scale: float | None, return_lse: bool,
                  config_json: str | None, impl: str | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    # the LSE is always computed here: the backward needs it (return_lse only says what
    # flashtune.attention hands back); the route is one of flashtune's own kernels, whose
    # LSE attn_bwd is checked with (paired)
    config = json.loads(config_json) if config_json else None
    out, lse = _attention(q, k, v, causal, scale, True, config, impl, paired=True)
    return out, lse


@_attention_op.register_fake
def _attention_fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                    scale: float | None, return_lse: bool,
                    config_json: str | None, impl: str | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    return out, q.new_empty(tuple(q.shape[:3]), dtype=torch.float32)


@torch.library.custom_op("flashtune::attention_bwd", mutates_args=())
def _attention_bwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                      lse: torch.Tensor, dout: torch.Tensor, dlse: torch.Tensor | None,
                      causal: bool, scale: float | None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backward(q, k, v, out, lse, dout, dlse, causal, scale)


@_attention_bwd_op.register_fake
def _attention_bwd_fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                        lse: torch.Tensor, dout: torch.Tensor, dlse: torch.Tensor | None,
                        causal: bool, scale: float | None
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            torch.empty_like(k, memory_format=torch.contiguous_format),
            torch.empty_like(v, memory_format=torch.contiguous_format))


def _op_setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    q, k, v, causal, scale, _, _, _ = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.causal, ctx.scale = causal, scale


def _op_backward(ctx: Any, dout: torch.Tensor, dlse: torch.Tensor) -> Any:
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = torch.ops.flashtune.attention_bwd(q, k, v, out, lse, dout.contiguous(),
                                                   dlse, ctx.causal, ctx.scale)
    return dq, dk, dv, None, None, None, None, None


_attention_op.register_autograd(_op_backward, setup_context=_op_setup_context)
