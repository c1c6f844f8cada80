"""attn_fwd's compile-only launches (``TemplateSpec.warmup_launches``): the kernels and
arguments the launcher passes for contiguous, aligned inputs, built from shapes alone."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from flashtune.core.case import mods_kwargs
from flashtune.core.problem import AttentionProblem
from flashtune.core.spec import Launch
from flashtune.kernel_templates.shaped import Shaped


def attn_fwd_warmup_args(problem: AttentionProblem, config: Mapping[str, int], *,
                         return_lse: bool = False
                         ) -> tuple[tuple[Any, ...], dict[str, Any], tuple[int, int]]:
    """``(args, kwargs, grid)`` for ``attn_fwd_kernel.warmup``: what the launcher passes for
    contiguous, aligned q/k/v (built by the launcher's own
    :func:`~flashtune.kernel_templates.attn_fwd.launcher.kernel_args`)."""
    import torch

    from flashtune.kernel_templates.attn_fwd.launcher import kernel_args, tma_ok

    p = problem
    dt = torch.float16 if p.dtype == "fp16" else torch.bfloat16
    q = Shaped(dt, (p.batch, p.heads_q, p.seqlen_q, p.head_dim))
    k = Shaped(dt, (p.batch, p.heads_kv, p.seqlen_k, p.head_dim))
    out = Shaped(dt, q.shape)
    lse = Shaped(torch.float32, q.shape[:3]) if return_lse else None
    use_tma = bool(config.get("USE_TMA", 0)) and tma_ok(q, k, out)
    return kernel_args(q, k, k, out, lse, config, causal=p.causal,
                       scale=1.0 / math.sqrt(p.head_dim), use_tma=use_tma, upcast_dot=False,
                       **warmup_mods(p))


def warmup_mods(problem: AttentionProblem) -> dict[str, Any]:
    """The score modifications' and dropout's keywords of ``problem`` for ``kernel_args``,
    with shape-only stand-ins for ALiBi slopes ``(heads_q,)`` and dropout's seed ``(1,)``
    (the values do not reach the compiler); empty for a plain problem."""
    import torch

    return mods_kwargs(problem, Shaped(torch.float32, (problem.heads_q,)),
                       Shaped(torch.int64, (1,)))


def warmup_launches(problem: AttentionProblem, config: Mapping[str, int], *,
                    return_lse: bool = False) -> list[Launch]:
    """``[(attn_fwd_kernel, args, kwargs, grid)]`` for ``config`` on ``problem``."""
    from flashtune.kernel_templates.attn_fwd.kernel import attn_fwd_kernel

    return [(attn_fwd_kernel, *attn_fwd_warmup_args(problem, config, return_lse=return_lse))]
