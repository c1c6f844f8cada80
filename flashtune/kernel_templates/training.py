"""The training step as an op of its own: a forward that saves what its backward needs, and
that backward, chosen together (``flashtune tune --op train``).

An implementation of ``train`` is a forward that has a backward:

* **a pair of flashtune's kernels**: a forward template whose spec names a ``backward``
  template (attn_fwd and the Gluon forward name attn_bwd): the forward returns the LSE and
  the backward recomputes P tile by tile from it (FlashAttention-2's backward). The pair
  has one config: the forward's knobs, and the backward's under ``bwd.``
  (:func:`~flashtune.core.spec.join_pair`); the forward's and the backward's searches are
  independent (two kernels, two launches), so the tuner searches each template on its own
  and pairs the bests, then times the pair as a whole. The forward may be torch's: SDPA
  cuDNN's returns the LSE the Gluon backward reads (``sdpa_cudnn_bwd_gluon``, no forward
  knobs);
* **an extern** (torch SDPA's backends): torch's autograd differentiates the aten op; the
  config is ``{}``.

:func:`train_spec` turns a forward's spec into the spec of its training step: the same name
(a choice names ``attn_fwd`` or ``sdpa_cudnn``, whichever op it is for), the pair's space
and validity predicate, both kernels' limits, a source hash over both (a choice goes stale
when either kernel changes), and a tuning case (:func:`train_case`) that launches the step
as a user's training step runs it -- forward through the autograd function, then
``torch.autograd.grad`` -- and checks the output and all three gradients against fp32
autograd. The flop count is the forward's plus the backward's (3.5x the forward,
ANCHORS.md).

:class:`PairFn` is the autograd function the runtime and the tuner share: the forward
launches the forward kernel with the LSE, saves q, k, v, out and the LSE (nothing N x N);
the backward launches the backward kernel with the config chosen with the forward.

The LSE of an extern has no gradient (torch's derivative formulas mark it
non-differentiable), so an extern's training step refuses calls that ask for it
(``Limits.lse`` is False in its training spec): a loss built on it would silently miss its
term.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Mapping
from dataclasses import replace
from functools import wraps
from typing import Any

import torch

from flashtune.core.case import (
    FULL_REFERENCE_MAX_ELEMS,
    Case,
    least_bytes,
    mods_options,
    packed_gradients,
    packed_inputs,
    random_inputs,
    reference_options,
    relative_error,
)
from flashtune.core.device import DeviceFingerprint
from flashtune.core.problem import AttentionProblem
from flashtune.core.space import Config, SearchSpace
from flashtune.core.spec import BWD_PREFIX, TemplateSpec, join_pair, split_pair
from flashtune.kernel_templates.tma import (
    pad_head_dim,
    padded_head_dim,
    pads_head_dim,
    unpad_head_dim,
)

__all__ = ["PairFn", "TrainStep", "once_differentiable", "pair_fn", "pair_space",
           "train_case", "train_spec"]


def once_differentiable(backward: Callable[..., Any]) -> Callable[..., Any]:
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


class PairFn(torch.autograd.Function):
    """A forward kernel and its backward kernel as one differentiable call: the forward
    saves q, k, v, out and the LSE, nothing N x N; the backward recomputes P tile by tile.
    A head dim the launchers run padded on a GPU (``tma.pads_head_dim``) is padded here
    once for both kernels: the padded q, k, v and output are saved (as FlashAttention-2
    saves its own), the backward pads the incoming gradient only, and the output and the
    gradients are cut back to the head dim. The backward is not itself differentiable: a double backward (a gradient penalty)
    raises torch's error instead of silently getting a gradient with no graph.

    ``PairFn.apply(q, k, v, causal, scale, fwd, fwd_config, bwd, bwd_config[, options])``:
    ``fwd`` and ``bwd`` are the launchers (``fwd(q, k, v, config, causal=, scale=,
    return_lse=True, **options)``, ``bwd(q, k, v, out, lse, dout, config, causal=, scale=,
    dlse=, **options)``); ``options`` the keywords both take beyond those (the score
    modifications, a packed batch's ``cu_seqlens``: the same for both); returns
    ``(out, lse)``.
    """

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                scale: float | None, fwd: Callable[..., Any], fwd_config: Config,
                bwd: Callable[..., Any], bwd_config: Config,
                options: Mapping[str, Any] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        options = options or {}
        head_dim = q.shape[-1]
        ctx.head_dim = head_dim if pads_head_dim(q) else None
        if ctx.head_dim is not None:
            # a head dim whose rows cannot be 16-byte aligned (tma.pads_head_dim): q, k, v
            # padded once for both kernels, and the padded tensors and output saved, as
            # FlashAttention-2 saves its own (the launchers would each pad them again)
            width = padded_head_dim(head_dim)
            if scale is None:
                scale = 1.0 / math.sqrt(head_dim)
            q, k, v = (pad_head_dim(t, width) for t in (q, k, v))
        out, lse = fwd(q, k, v, fwd_config, causal=causal, scale=scale, return_lse=True,
                       **options)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.scale, ctx.bwd, ctx.bwd_config = causal, scale, bwd, bwd_config
        ctx.options = options
        ctx.set_materialize_grads(False)  # an unused LSE (or out) gets None, not zeros
        if ctx.head_dim is not None:
            out = unpad_head_dim(out, head_dim)
        return out, lse

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, dout: torch.Tensor | None, dlse: torch.Tensor | None) -> Any:
        q, k, v, out, lse = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        else:
            if dout.stride(-1) != 1:
                dout = dout.contiguous()
            if ctx.head_dim is not None:  # saved padded: the incoming gradient too
                dout = pad_head_dim(dout, out.shape[-1])
        dq, dk, dv = ctx.bwd(q, k, v, out, lse, dout, ctx.bwd_config, causal=ctx.causal,
                             scale=ctx.scale, dlse=dlse, **ctx.options)
        if ctx.head_dim is not None:
            dq, dk, dv = (unpad_head_dim(g, ctx.head_dim) for g in (dq, dk, dv))
        return dq, dk, dv, None, None, None, None, None, None, None


# torch leaves Function.apply unannotated; this is PairFn.forward's signature
pair_fn: Callable[..., tuple[torch.Tensor, torch.Tensor]] = PairFn.apply


def pair_space(fwd: SearchSpace, bwd: SearchSpace) -> SearchSpace:
    """The search space of a pair: the forward's parameters and the backward's under
    :data:`~flashtune.core.spec.BWD_PREFIX`; a config is valid when both halves are."""
    def check(config: Mapping[str, int], problem: Any, device: Any) -> str | None:
        f, b = split_pair(config)
        reason = fwd.check(f, problem, device)
        if reason is not None:
            return f"forward: {reason}"
        reason = bwd.check(b, problem, device)
        return None if reason is None else f"backward: {reason}"

    def narrow(problem: Any) -> dict[str, tuple[int, ...]]:
        pins = dict(fwd.narrow(problem)) if fwd.narrow is not None else {}
        if bwd.narrow is not None:
            pins.update({BWD_PREFIX + n: v for n, v in bwd.narrow(problem).items()})
        return pins

    return SearchSpace(
        params={**fwd.params, **{BWD_PREFIX + n: v for n, v in bwd.params.items()}},
        predicate=check,
        defaults={**fwd.defaults, **{BWD_PREFIX + n: v for n, v in bwd.defaults.items()}},
        narrow=narrow if fwd.narrow is not None or bwd.narrow is not None else None)


class TrainStep:
    """One training step of an implementation, as a user's step runs it:
    ``step(q, k, v, dout, config, causal=, scale=) -> (out, dq, dk, dv)`` with q, k, v that
    require grad (leaves): the forward (through :class:`PairFn` for a pair, the extern's
    differentiable launcher otherwise), then ``torch.autograd.grad`` with ``dout``."""

    def __init__(self, fwd: TemplateSpec, bwd: TemplateSpec | None) -> None:
        self.fwd, self.bwd = fwd, bwd

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                config: Mapping[str, int], *, causal: bool = False,
                scale: float | None = None, **options: Any) -> torch.Tensor:
        """The step's differentiable output; ``options``: the score modifications, passed
        to both kernels (:class:`PairFn`)."""
        if self.bwd is None:
            out: torch.Tensor = self.fwd.launcher(q, k, v, config, causal=causal, scale=scale,
                                                  **options)
            return out
        fcfg, bcfg = split_pair(config)
        out, _ = pair_fn(q, k, v, causal, scale, self.fwd.launcher, fcfg,
                         self.bwd.launcher, bcfg, options)
        return out

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor,
                 config: Mapping[str, int], *, causal: bool = False,
                 scale: float | None = None, **options: Any) -> tuple[torch.Tensor, ...]:
        with torch.enable_grad():
            out = self.forward(q, k, v, config, causal=causal, scale=scale, **options)
            dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
        return out.detach(), dq, dk, dv


def train_case(problem: AttentionProblem, device: DeviceFingerprint, *, torch_device: str,
               generator: Any, launcher: Callable[..., Any], check_slice: bool = True) -> Case:
    """The tuning case of a training step (``launcher`` a :class:`TrainStep`): random q, k,
    v (leaves that require grad) and dout; the output and dq, dk, dv checked against fp32
    autograd (the worst relative error of the four); forward plus backward FLOPs.

    For big problems the reference covers batch 0 and the first kv head with every q head of
    its group (dK/dV sum over the group, so no smaller slice checks them).
    """
    from flashtune.kernel_templates.attn_bwd.reference import attn_bwd_reference
    from flashtune.kernel_templates.attn_fwd.reference import attn_fwd_reference
    from flashtune.kernel_templates.dropout import dropout_mask

    p = problem
    if p.packed:
        return _packed_train_case(p, torch_device=torch_device, generator=generator,
                                  launcher=launcher, check_slice=check_slice)
    t = random_inputs(p, torch_device, generator, ("q", "k", "v", "do"))
    q, k, v, do = (t[n].requires_grad_(n != "do") for n in ("q", "k", "v", "do"))
    if check_slice and max(q.numel(), k.numel()) > FULL_REFERENCE_MAX_ELEMS:
        sq: tuple[slice, slice] = (slice(0, 1), slice(0, p.heads_q // p.heads_kv))
        skv: tuple[slice, slice] = (slice(0, 1), slice(0, 1))
    else:
        sq = skv = (slice(None), slice(None))
    options = mods_options(p, torch_device, generator)
    if options:  # the modified scores' gradients: autograd through the fp32 reference
        # dropout's seed (one for the case: every launch drops the same scores) as the
        # mask it draws, of the sequences and heads checked
        sliced = sq[1].stop is not None
        ref_options = reference_options(options, p, dropout_mask,
                                        batches=1 if sliced else None,
                                        heads=sq[1].stop if sliced else None)
        if "alibi_slopes" in ref_options:
            ref_options["alibi_slopes"] = ref_options["alibi_slopes"][sq[1]]
        leaves = [t.detach()[s].float().requires_grad_(True)
                  for t, s in ((q, sq), (k, skv), (v, skv))]
        with torch.enable_grad():
            ref_out, _ = attn_fwd_reference(*leaves, causal=p.causal, dtype=torch.float32,
                                            **ref_options)
            grads = torch.autograd.grad(ref_out, leaves, do[sq].float())
        refs = (ref_out.detach(), *grads)
    else:
        with torch.no_grad():
            ref_out, _ = attn_fwd_reference(q[sq], k[skv], v[skv], causal=p.causal,
                                            dtype=torch.float32)
        refs = (ref_out, *attn_bwd_reference(q[sq], k[skv], v[skv], do[sq], causal=p.causal,
                                             dtype=torch.float32))

    def error(got: Any) -> float:
        errs = [relative_error(g.detach()[s], r)
                for g, s, r in zip(got, (sq, sq, skv, skv), refs, strict=True)]
        return float("nan") if any(e != e for e in errs) else max(errs)

    io = 2 * least_bytes(p, q, k, v)  # read, then their gradients written
    return Case(launch=lambda config: launcher(q, k, v, do, config, causal=p.causal,
                                               **options),
                error=error, flops=p.flops() + p.flops(backward=True),
                inputs={"q": q, "k": k, "v": v, "do": do}, min_bytes=io)


def _packed_train_case(problem: AttentionProblem, *, torch_device: str, generator: Any,
                       launcher: Callable[..., Any], check_slice: bool) -> Case:
    """:func:`train_case` for a packed batch (its ``cu_seqlens`` passed to the step)."""
    from flashtune.kernel_templates.attn_fwd.reference import attn_fwd_reference
    from flashtune.kernel_templates.dropout import dropout_mask

    p = problem
    t, packing = packed_inputs(p, torch_device, generator, ("q", "k", "v", "do"))
    q, k, v, do = (t[n].requires_grad_(n != "do") for n in ("q", "k", "v", "do"))
    mods = mods_options(p, torch_device, generator)
    heads, refs = packed_gradients(attn_fwd_reference, p, q, k, v, do, mods, check_slice,
                                   dropout_mask)
    kv_heads = (slice(None), slice(0, refs[2].shape[1]))
    options = {**mods, **packing}

    def error(got: Any) -> float:
        errs = [relative_error(g.detach()[s], r)
                for g, s, r in zip(got, (heads, heads, kv_heads, kv_heads), refs, strict=True)]
        return float("nan") if any(e != e for e in errs) else max(errs)

    io = 2 * least_bytes(p, q, k, v)  # read, then their gradients written
    return Case(launch=lambda config: launcher(q, k, v, do, config, causal=p.causal,
                                               **options),
                error=error, flops=p.flops() + p.flops(backward=True),
                inputs={"q": q, "k": k, "v": v, "do": do}, min_bytes=io)


def _pair_hash(fwd: TemplateSpec, bwd: TemplateSpec) -> str:
    text = f"{fwd.name}\x00{fwd.source_hash}\x00{bwd.name}\x00{bwd.source_hash}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# (forward name, its hash, backward name or None, its hash) -> the training spec
_SPECS: dict[tuple[str, str, str | None, str | None], TemplateSpec] = {}


def _train_spec(fwd: TemplateSpec, bwd: TemplateSpec | None) -> TemplateSpec:
    step = TrainStep(fwd, bwd)
    if bwd is None:  # an extern: torch's autograd; its LSE carries no gradient
        return replace(fwd, op="train", launcher=step, make_case=train_case,
                       warmup_launches=None, serves=("train",), seed_configs=None,
                       limits=replace(fwd.limits, lse=False))

    def default_config(problem: AttentionProblem, device: DeviceFingerprint) -> Config:
        return join_pair(fwd.default_config(problem, device),
                         bwd.default_config(problem, device))

    return replace(fwd, op="train", source_hash=_pair_hash(fwd, bwd), launcher=step,
                   space=pair_space(fwd.space, bwd.space), default_config=default_config,
                   make_case=train_case, warmup_launches=None, serves=("train",),
                   seed_configs=None, limits=fwd.limits.both(bwd.limits))


def train_spec(spec: TemplateSpec, backward: TemplateSpec | None) -> TemplateSpec:
    """The training step of the forward ``spec`` with ``backward``, the spec its
    ``spec.backward`` names (None for an extern, which torch differentiates; see the module
    docstring): named as the forward, of op ``train``; its launcher a :class:`TrainStep`.
    Built once per (forward, backward) source. ``registry.train_step`` looks the backward up.

    Raises:
        ValueError when ``spec`` does not serve ``train``, or ``backward`` is not the
        template ``spec.backward`` names.
    """
    if "train" not in spec.serves:
        raise ValueError(f"template {spec.name!r} does not serve train (it has no backward)")
    bwd_name, bwd_hash = (backward.name, backward.source_hash) if backward else (None, None)
    if bwd_name != spec.backward:
        raise ValueError(f"template {spec.name!r} pairs with backward {spec.backward!r}, got "
                         f"{bwd_name!r}")
    key = (spec.name, spec.source_hash, bwd_name, bwd_hash)
    found = _SPECS.get(key)
    if found is None:
        found = _SPECS.setdefault(key, _train_spec(spec, backward))
    return found
