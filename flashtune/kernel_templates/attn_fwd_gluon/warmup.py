"""attn_fwd_gluon's compile-only launch (``TemplateSpec.warmup_launches``): the kernel and
arguments the launcher passes for contiguous, aligned inputs, built from shapes alone
(:func:`~flashtune.kernel_templates.attn_fwd_gluon.launcher.kernel_args` over
:class:`~flashtune.kernel_templates.shaped.Shaped` stand-ins: a TMA descriptor's
specialization reads its base's dtype only)."""

from __future__ import annotations

import math
from collections.abc import Mapping

from flashtune.core.problem import AttentionProblem
from flashtune.core.spec import Launch
from flashtune.kernel_templates.shaped import Shaped


def warmup_launches(problem: AttentionProblem, config: Mapping[str, int], *,
                    return_lse: bool = False) -> list[Launch]:
    """``[(gluon_attn_fwd_kernel, args, kwargs, grid)]`` for ``config`` on ``problem`` (the
    kernel always stores the LSE, so ``return_lse`` changes nothing)."""
    import torch

    from flashtune.kernel_templates.attn_fwd_gluon.kernel import gluon_attn_fwd_kernel
    from flashtune.kernel_templates.attn_fwd_gluon.launcher import kernel_args

    p = problem
    dt = torch.float16 if p.dtype == "fp16" else torch.bfloat16
    q = Shaped(dt, (p.batch, p.heads_q, p.seqlen_q, p.head_dim))
    k = Shaped(dt, (p.batch, p.heads_kv, p.seqlen_k, p.head_dim))
    lse = Shaped(torch.float32, q.shape[:3])
    args, kwargs, grid = kernel_args(q, k, k, Shaped(dt, q.shape), lse, config,
                                     causal=p.causal, scale=1.0 / math.sqrt(p.head_dim),
                                     window_left=p.window_left, softcap=p.softcap or 0.0)
    return [(gluon_attn_fwd_kernel, args, kwargs, grid)]
