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

__all__ = ["OPS", "DefaultConfig", "Launch", "MakeCase", "TemplateSpec", "WarmupLaunches"]

# what an implementation computes: the forward (optionally saving the LSE), the backward
# (dQ, dK, dV from the forward's output and LSE), or decoding against a KV cache
OPS = ("fwd", "bwd", "decode")

# ``(kernel, args, kwargs, grid)``: ``kernel.warmup(*args, grid=grid, **kwargs)`` compiles it
Launch = tuple[Any, tuple[Any, ...], dict[str, Any], tuple[int, ...]]
DefaultConfig = Callable[[AttentionProblem, DeviceFingerprint], Config]


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

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"op of template {self.name!r} is {self.op!r}; expected one of "
                             f"{', '.join(OPS)}")
