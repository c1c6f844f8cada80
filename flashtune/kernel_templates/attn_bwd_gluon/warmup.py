"""attn_bwd_gluon's compile-only launches (``TemplateSpec.warmup_launches``): the three
launches the launcher makes for contiguous inputs, built from shapes alone
(:func:`~flashtune.kernel_templates.attn_bwd_gluon.launcher.plan` over
:class:`~flashtune.kernel_templates.shaped.Shaped` stand-ins)."""

from __future__ import annotations

import math
from collections.abc import Mapping

from flashtune.core.problem import AttentionProblem
from flashtune.core.spec import Launch
from flashtune.kernel_templates.shaped import Shaped


def warmup_launches(problem: AttentionProblem, config: Mapping[str, int], *,
                    return_lse: bool = False) -> list[Launch]:
    """``[preprocess, main, convert]`` as ``(kernel, args, kwargs, grid)`` for ``config`` on
    ``problem`` (a backward has no LSE output: ``return_lse`` changes nothing)."""
    import torch

    from flashtune.kernel_templates.attn_bwd_gluon.launcher import expanded, plan, scratch_shapes

    p = problem
    dt = torch.float16 if p.dtype == "fp16" else torch.bfloat16
    q = Shaped(dt, (p.batch, p.heads_q, p.seqlen_q, p.head_dim))
    k = Shaped(dt, (p.batch, p.heads_kv, p.seqlen_k, p.head_dim))
    # dK and dV: each query head's with EXPAND_GQA
    dkv = Shaped(dt, (p.batch, p.heads_q if expanded(p.heads_q, p.heads_kv, config)
                      else p.heads_kv, p.seqlen_k, p.head_dim))
    scratch = {n: Shaped(torch.float32, s)
               for n, s in scratch_shapes(tuple(q.shape), config).items()}
    launches = plan(q, k, k, Shaped(dt, q.shape), Shaped(torch.float32, q.shape[:3]),
                    Shaped(dt, q.shape), Shaped(dt, q.shape), dkv, dkv, scratch, config,
                    causal=p.causal, scale=1.0 / math.sqrt(p.head_dim),
                    window_left=p.window_left, softcap=p.softcap or 0.0)
    return list(launches.values())
