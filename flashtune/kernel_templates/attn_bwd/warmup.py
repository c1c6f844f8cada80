"""attn_bwd's compile-only launches (``TemplateSpec.warmup_launches``): the kernels and
arguments the launcher passes for contiguous, aligned inputs, built from shapes alone."""

from __future__ import annotations

import math
from collections.abc import Mapping

from flashtune.core.problem import AttentionProblem
from flashtune.core.spec import Launch
from flashtune.kernel_templates.attn_fwd.warmup import warmup_mods
from flashtune.kernel_templates.shaped import Shaped


def attn_bwd_warmup_args(problem: AttentionProblem, config: Mapping[str, int]) -> list[Launch]:
    """``(kernel, args, kwargs, grid)`` of attn_bwd's three kernels for contiguous inputs
    (built by the launcher's own
    :func:`~flashtune.kernel_templates.attn_bwd.launcher.kernel_args`)."""
    import torch

    from flashtune.kernel_templates.attn_bwd.launcher import (
        dropout_bits_shape,
        kernel_args,
        kv_splits,
        partial_shape,
    )

    p = problem
    dt = torch.float16 if p.dtype == "fp16" else torch.bfloat16
    q = Shaped(dt, (p.batch, p.heads_q, p.seqlen_q, p.head_dim))
    k = Shaped(dt, (p.batch, p.heads_kv, p.seqlen_k, p.head_dim))
    lse = Shaped(torch.float32, q.shape[:3])
    splits = kv_splits(config, p.heads_q // p.heads_kv)
    part = Shaped(torch.float32, partial_shape(k, splits)) if splits > 1 else None
    mods = warmup_mods(p)
    bits = None
    if mods.get("dropout_p", 0) > 0 and config.get("DROPOUT_BITS", 0):
        bits = Shaped(torch.int32, dropout_bits_shape(config, p.batch, p.heads_q, p.seqlen_q,
                                                      p.seqlen_k))
    launches = kernel_args(q, k, k, q, lse, q, lse, q, k, k, config, causal=p.causal,
                           scale=1.0 / math.sqrt(p.head_dim), upcast_dot=False, part_k=part,
                           part_v=part, bits=bits, **mods)
    return list(launches.values())


def warmup_launches(problem: AttentionProblem, config: Mapping[str, int], *,
                    return_lse: bool = False) -> list[Launch]:
    """attn_bwd's launches for ``config`` on ``problem`` (``return_lse`` does not apply)."""
    return attn_bwd_warmup_args(problem, config)
