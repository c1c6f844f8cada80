"""The implementation spec: everything the tuner, the store's file checks and the dispatcher
need to know about one kernel implementation (Liger-Kernel's frozen ``ImplInfo``, Inductor's
``ChoiceCaller``).

A spec is data plus functions with fixed signatures, so every layer can hold one without
importing the kernel behind it. :mod:`flashtune.kernel_templates.registry` keeps the
registered ones; that registry is the one extension point.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from flashtune.core.case import Case
from flashtune.core.device import DeviceFingerprint
from flashtune.core.problem import AttentionProblem
from flashtune.core.space import Config, SearchSpace

__all__ = ["BWD_PREFIX", "KINDS", "OPS", "USER_OPS", "DefaultConfig", "Launch", "Limits",
           "MakeCase", "SeedConfigs", "TemplateSpec", "WarmupLaunches", "join_pair",
           "op_implementations", "split_pair"]

# what an implementation computes: the forward (optionally saving the LSE), the backward
# (dQ, dK, dV from the forward's output and LSE), decoding against a KV cache, or a training
# step (a forward that saves what its backward needs, and that backward: a pair)
OPS = ("fwd", "bwd", "decode", "train")
# the ops a user calls and the tuner chooses an implementation for (``tune --op``): the
# forward; the training step (a forward whose inputs require grad, and its backward); the
# forward of short queries against a long KV cache
USER_OPS = ("fwd", "train", "decode")
# a training pair's config: the forward's knobs as they are, the backward's under this prefix
# (``{"BLOCK_M": 128, ..., "bwd.BLOCK_M1": 64, ...}``: one flat JSON object of ints, as every
# config is)
BWD_PREFIX = "bwd."
# how an implementation is built: a ``tl`` Triton kernel, a Gluon kernel (compiled code
# only: no interpreter), or a kernel of another library (torch SDPA's backends), no knobs
KINDS = ("triton", "gluon", "extern")
# the score modifications an implementation may serve (Limits.score_mods)
SCORE_MODS: tuple[str, ...] = ("window", "softcap", "alibi")  # (and "causal_window")


@dataclass(frozen=True)
class Limits:
    """What an implementation can serve, declared with it; the tuner searches it only for
    problems it can serve and the router sends it only calls it can serve
    (:meth:`refuse`).

    Attributes:
        head_dims: the head dims it serves (None: every one flashtune accepts).
        dtypes: the problem dtypes it serves.
        gqa: whether ``heads_q`` may differ from ``heads_kv`` (GQA/MQA).
        causal_unaligned: whether it serves causal problems with ``seqlen_q != seqlen_k``
            (flashtune's causal mask is bottom-right aligned; torch SDPA's ``is_causal``
            is top-left, so an SDPA backend serves causal only when the two agree).
        lse: whether it can return the log-sum-exp (``return_lse``, the autograd forward).
        needs_gpu: whether it runs only on a CUDA GPU (no Triton interpreter).
        capabilities: the compute capabilities ``(major, minor)`` it runs on (None: any);
            e.g. ``((9, 0),)`` for Hopper-only code.
        max_seqlen_q: the longest query it serves (None: no limit).
        score_mods: the score modifications it serves, of ``"window"``, ``"softcap"``,
            ``"alibi"`` (FlashAttention-2's ``window_size``, ``softcap``,
            ``alibi_slopes``; :meth:`AttentionProblem.mods`), or ``"causal_window"``: a
            window on causal problems only (a left bound; causal is the right one).
        packed: whether it serves a packed batch (FlashAttention-2's varlen:
            :attr:`AttentionProblem.packed`).
        single_token: whether it serves one query over one key (``seqlen_q == seqlen_k ==
            1``; cuDNN's frontend refuses it).
        dropout: whether it serves attention dropout (FlashAttention-2's ``dropout_p``:
            :attr:`AttentionProblem.dropout`), drawing flashtune's mask from the call's
            seed (``kernel_templates.dropout``).
        deterministic: whether its gradients are bitwise reproducible (the same inputs and
            config give the same bits); False for a backward that sums with atomics in an
            order the hardware picks (attn_bwd_gluon's dQ). Declared, not a refusal: callers
            that need reproducible gradients name a deterministic pair (FlashAttention-2's
            ``deterministic=True`` runs attn_fwd with attn_bwd).
        available: ``available(device) -> reason | None``: a check that only the running
            process can answer (a library built without a backend); None: always.
    """

    head_dims: tuple[int, ...] | None = None
    dtypes: tuple[str, ...] = ("fp16", "bf16")
    gqa: bool = True
    causal_unaligned: bool = True
    lse: bool = True
    needs_gpu: bool = False
    capabilities: tuple[tuple[int, int], ...] | None = None
    max_seqlen_q: int | None = None
    score_mods: tuple[str, ...] = ()
    packed: bool = False
    dropout: bool = False
    single_token: bool = True
    deterministic: bool = True
    available: Callable[[DeviceFingerprint], str | None] | None = field(default=None,
                                                                        compare=False)

    def refuse(self, problem: AttentionProblem, device: DeviceFingerprint, *,
               return_lse: bool = False) -> str | None:
        """Why this implementation cannot serve ``problem`` on ``device`` (None: it can).

        Arguments:
            problem: the call's or the tuning job's problem.
            device: where it runs (the interpreter's fingerprint on a CPU machine).
            return_lse: whether the LSE is asked for too.
        Returns:
            One line naming what it lacks, or None.
        """
        p = problem
        if self.needs_gpu and device.is_interpreter:
            return "needs a CUDA GPU (it does not run under the Triton interpreter)"
        if self.capabilities is not None and device.capability not in self.capabilities:
            have = ", ".join(f"sm_{a}{b}" for a, b in self.capabilities)
            return f"runs on {have} only, not on {device.name} ({device.compute_capability})"
        served = self.score_mods
        if "causal_window" in served and p.causal:  # a left bound: causal is the right one
            served = (*served, "window")
        missing = [m for m in p.mods() if m not in served]
        if missing:
            names = {"window": "a local window", "softcap": "a softcap", "alibi": "ALiBi"}
            return f"{' and '.join(names[m] for m in missing)} (it serves no such scores)"
        if self.head_dims is not None and p.head_dim not in self.head_dims:
            return f"head_dim {p.head_dim} (it serves {list(self.head_dims)})"
        if p.dtype not in self.dtypes:
            return f"dtype {p.dtype} (it serves {', '.join(self.dtypes)})"
        if not self.gqa and p.heads_q != p.heads_kv:
            return f"GQA/MQA (heads_q {p.heads_q} != heads_kv {p.heads_kv})"
        if not self.causal_unaligned and p.causal and p.seqlen_q != p.seqlen_k \
                and p.seqlen_q != 1:
            return (f"causal with seqlen_q {p.seqlen_q} != seqlen_k {p.seqlen_k} (it aligns "
                    f"the mask top-left)")
        if self.max_seqlen_q is not None and p.seqlen_q > self.max_seqlen_q:
            return f"seqlen_q {p.seqlen_q} (it serves at most {self.max_seqlen_q})"
        if return_lse and not self.lse:
            return "cannot return the LSE"
        if p.packed and not self.packed:
            return "a packed batch (it serves no varlen)"
        if not self.single_token and p.seqlen_q == p.seqlen_k == 1:
            return "seqlen_q = seqlen_k = 1 (it serves no single-token attention)"
        if p.dropout and not self.dropout:
            return f"dropout {p.dropout:g} (it applies no attention dropout)"
        if self.available is not None:
            return self.available(device)
        return None

    def both(self, other: Limits) -> Limits:
        """What two kernels run one after the other (a training pair's forward and backward)
        can serve together: every limit of each."""
        def meet(a: tuple[Any, ...] | None, b: tuple[Any, ...] | None) -> tuple[Any, ...] | None:
            return b if a is None else a if b is None else tuple(x for x in a if x in b)

        lengths = [n for n in (self.max_seqlen_q, other.max_seqlen_q) if n is not None]
        checks = [f for f in (self.available, other.available) if f is not None]

        def available(device: DeviceFingerprint) -> str | None:
            return next((r for r in (f(device) for f in checks) if r is not None), None)

        return Limits(head_dims=meet(self.head_dims, other.head_dims),
                      dtypes=meet(self.dtypes, other.dtypes) or (),
                      gqa=self.gqa and other.gqa,
                      causal_unaligned=self.causal_unaligned and other.causal_unaligned,
                      lse=self.lse and other.lse, needs_gpu=self.needs_gpu or other.needs_gpu,
                      capabilities=meet(self.capabilities, other.capabilities),
                      max_seqlen_q=min(lengths) if lengths else None,
                      score_mods=_meet_mods(self.score_mods, other.score_mods),
                      packed=self.packed and other.packed,
                      single_token=self.single_token and other.single_token,
                      dropout=self.dropout and other.dropout,
                      deterministic=self.deterministic and other.deterministic,
                      available=available if checks else None)


def _meet_mods(a: tuple[str, ...], b: tuple[str, ...]) -> tuple[str, ...]:
    """The score modifications two kernels both serve: those in both, and a causal window
    where one serves it and the other any window (a Gluon forward's causal sliding window
    with attn_bwd's windows)."""
    def served(mod: str, other: tuple[str, ...]) -> bool:
        return mod in other or (mod == "causal_window" and "window" in other)

    return tuple(dict.fromkeys([m for m in a if served(m, b)] + [m for m in b if served(m, a)]))


def split_pair(config: Mapping[str, int]) -> tuple[dict[str, int], dict[str, int]]:
    """A training pair's config as ``(forward config, backward config)``
    (:data:`BWD_PREFIX`); a config without backward keys gives an empty backward one."""
    fwd, bwd = {}, {}
    for name, value in config.items():
        if name.startswith(BWD_PREFIX):
            bwd[name[len(BWD_PREFIX):]] = value
        else:
            fwd[name] = value
    return fwd, bwd


def op_implementations(specs: Mapping[str, TemplateSpec], op: str) -> dict[str, TemplateSpec]:
    """The implementations of the user op ``op`` among ``specs``, name -> spec, as the tuner
    and the router see them: ``specs.for_op(op)`` when the mapping has it (the registry's
    :func:`~flashtune.kernel_templates.catalog`: a forward's training step is a spec of its
    own, with its pair's space and source hash), else every spec whose ``serves`` names
    ``op``."""
    for_op = getattr(specs, "for_op", None)
    if callable(for_op):
        return dict(for_op(op))
    return {name: spec for name, spec in specs.items() if op in spec.serves}


def join_pair(fwd: Mapping[str, int], bwd: Mapping[str, int]) -> dict[str, int]:
    """The one config of a training pair (the inverse of :func:`split_pair`)."""
    return {**fwd, **{BWD_PREFIX + name: value for name, value in bwd.items()}}

# ``(kernel, args, kwargs, grid)``: ``kernel.warmup(*args, grid=grid, **kwargs)`` compiles it
Launch = tuple[Any, tuple[Any, ...], dict[str, Any], tuple[int, ...]]
DefaultConfig = Callable[[AttentionProblem, DeviceFingerprint], Config]
# the rival structures a search tries right after the default (TemplateSpec.seed_configs)
SeedConfigs = Callable[[AttentionProblem, DeviceFingerprint], list[Config]]


class MakeCase(Protocol):
    """``make_case(problem, device, *, torch_device, generator, launcher, check_slice)``:
    the tuner's inputs for one problem, the check of a launch against the reference and its
    FLOP count (see :class:`~flashtune.core.case.Case`)."""

    def __call__(self, problem: AttentionProblem, device: DeviceFingerprint, *,
                 torch_device: str, generator: Any, launcher: Callable[..., Any],
                 check_slice: bool = True) -> Case: ...


class WarmupLaunches(Protocol):
    """``warmup_launches(problem, config, *, return_lse=False)``: the launches that compile
    ``config`` for ``problem`` with contiguous inputs, built from shapes alone (no tensors),
    so a process pool can compile candidates before the GPU times them."""

    def __call__(self, problem: AttentionProblem, config: Mapping[str, int], *,
                 return_lse: bool = False) -> list[Launch]: ...


@dataclass(frozen=True)
class TemplateSpec:
    """One kernel implementation, as the registry holds it.

    Attributes:
        name: registry key, e.g. ``"attn_fwd"``; also the name stored with every trial and
            written into exported files.
        op: which of :data:`OPS` it computes.
        source_hash: 16 hex characters over the token stream of the files that decide the
            generated code (:func:`flashtune.kernel_templates.registry.source_hash`); configs
            tuned under another hash are stale.
        launcher: ``launcher(*inputs, config, **options)`` runs the kernel with an explicit
            config (the template's ``launcher.py`` documents its inputs).
        reference: ``reference(*inputs, **options)`` in float32/float64.
        space: the search space and its validity predicate.
        default_config: ``default_config(problem, device) -> Config``: what an untuned shape
            runs.
        make_case: builds the tuner's :class:`~flashtune.core.case.Case` for a problem.
        warmup_launches: the compile-only launches of a config (precompilation and the
            runtime's ``warmup``); None when the implementation has nothing to precompile.
        kernel: the main ``@triton.jit`` entry point (introspection and tests).
        tunable: whether ``flashtune tune`` may search it.
        problem_type: the problem class its entries are keyed on (export/import parse the
            ``problem`` objects of a file with it).
        kind: one of :data:`KINDS`.
        serves: the user ops (:data:`USER_OPS`) it is a candidate for when the tuner
            searches across implementations (``tune --op``); empty for a part of another
            op (attn_bwd). A forward serves ``train`` when it has a backward: its own
            autograd (an extern: torch differentiates it) or ``backward``.
        limits: what it can serve (:class:`Limits`).
        backward: the backward template (``"attn_bwd"``) that a training step pairs with this
            forward (its LSE is that backward's input); None: none, or torch's autograd.
        paired_backward: for an extern whose training step torch's autograd differentiates:
            a backward template that differentiates its forward from its output and LSE
            (``"sdpa_cudnn_bwd"`` for cuDNN's), which a call whose backward must be
            flashtune's custom op (under ``torch.compile``) runs instead; None: none, and
            such a call takes another implementation.
        seed_configs: ``seed_configs(problem, device) -> [Config]``: configs a search
            tries right after the default, before its sampler's own: the default's rivals,
            structures measured to win where the default did not (on another GPU, or a
            neighbouring shape), so a search of a few trials still compares them; None:
            none.
        torch_bound: its timings rest on torch's own kernels, so its source hash carries
            torch's and cuDNN's versions (:func:`~flashtune.kernel_templates.sdpa_extern.
            extern_hash`): an SDPA backend, or a training pair with one's forward. A choice
            of it timed under another torch is stale for that torch alone (its shapes take
            the default there; nothing of flashtune's to re-tune) and is exported as it is.
        plans_per_shape: its backend builds a plan the first time it meets a shape (cuDNN's
            graph: 40-68 ms a new shape on an H200, against under a millisecond for
            flashtune's kernels and torch's FLASH backend:
            ``benchmarks/results/new_shape_h200.json``), so a call without gradients takes
            it only at a shape it was chosen for exactly (:class:`~flashtune.runtime.
            choices.OpRouter`): inference meets a new shape with every decoding step over a
            growing cache and every prompt length, a training step the same shapes again.
        plan: ``plan(q, k, v, config, causal=, scale=, return_lse=)`` -> a launch plan for
            one CUDA call signature of an inference call, called as ``plan(q, k, v,
            stream)``, with a ``device_index``: what the runtime replays instead of the
            launcher's per-call checks and binding (it raises for a call it does not plan;
            the launcher runs that one); None: the launcher every call. A plan that also
            takes ``window=(left, right)`` and ``softcap=`` plans score-modified calls
            (:mod:`flashtune.runtime.scored`; raising for one it does not serve).
    """

    name: str
    op: str
    source_hash: str
    launcher: Callable[..., Any]
    reference: Callable[..., Any]
    space: SearchSpace
    default_config: DefaultConfig
    make_case: MakeCase
    warmup_launches: WarmupLaunches | None = None
    kernel: object | None = field(default=None, compare=False)
    tunable: bool = True
    problem_type: type[AttentionProblem] = AttentionProblem
    kind: str = "triton"
    serves: tuple[str, ...] = ()
    limits: Limits = Limits()
    backward: str | None = None
    paired_backward: str | None = None
    seed_configs: SeedConfigs | None = None
    torch_bound: bool = False
    plan: Callable[..., Any] | None = field(default=None, compare=False)
    plans_per_shape: bool = False

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"op of template {self.name!r} is {self.op!r}; expected one of "
                             f"{', '.join(OPS)}")
        if self.kind not in KINDS:
            raise ValueError(f"kind of template {self.name!r} is {self.kind!r}; expected one "
                             f"of {', '.join(KINDS)}")
        unknown = [o for o in self.serves if o not in USER_OPS]
        if unknown:
            raise ValueError(f"template {self.name!r} serves {unknown}; the user ops are "
                             f"{', '.join(USER_OPS)}")
        if "train" in self.serves and self.op == "fwd" and self.kind != "extern" \
                and self.backward is None:
            raise ValueError(f"template {self.name!r} serves train but names no backward "
                             f"template to pair with")

    def refuse(self, problem: AttentionProblem, device: DeviceFingerprint, *,
               return_lse: bool = False) -> str | None:
        """Why this implementation cannot serve ``problem`` on ``device`` (None: it can);
        :meth:`Limits.refuse`."""
        return self.limits.refuse(problem, device, return_lse=return_lse)
