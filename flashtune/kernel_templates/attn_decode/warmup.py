"""attn_decode's compile-only launches (``TemplateSpec.warmup_launches``): the kernels and
arguments the launcher passes for contiguous, aligned inputs, built from shapes alone."""

from __future__ import annotations

import math
from collections.abc import Mapping

from flashtune.core.problem import AttentionProblem
from flashtune.core.spec import Launch
from flashtune.kernel_templates.attn_fwd.warmup import warmup_mods
from flashtune.kernel_templates.shaped import Shaped


def attn_decode_warmup_args(problem: AttentionProblem, config: Mapping[str, int], *,
                            return_lse: bool = False
                            ) -> list[Launch]:
    """``(kernel, args, kwargs, grid)`` of attn_decode's split (and combine) kernels for
    contiguous dense q/k/v, as the tuner and :func:`flashtune.attention`'s decode route launch
    them (the cache variant, every length full: :mod:`~flashtune.kernel_templates.attn_decode.
    full`), with the problem's score modifications (built by the launcher's own
    :func:`~flashtune.kernel_templates.attn_decode.launcher.kernel_args`)."""
    import torch

    from flashtune.kernel_templates.attn_decode.launcher import kernel_args, partial_shapes

    p = problem
    dt = torch.float16 if p.dtype == "fp16" else torch.bfloat16
    q = Shaped(dt, (p.batch, p.heads_q, p.seqlen_q, p.head_dim))
    k = Shaped(dt, (p.batch, p.heads_kv, p.seqlen_k, p.head_dim))
    lse = Shaped(torch.float32, q.shape[:3]) if return_lse else None
    o_part = lse_part = None
    if config["NUM_SPLITS"] > 1:
        o_shape, l_shape = partial_shapes(q, config["NUM_SPLITS"])
        o_part, lse_part = Shaped(torch.float32, o_shape), Shaped(torch.float32, l_shape)
    lens = Shaped(torch.int32, (p.batch,))
    return kernel_args(q, k, k, Shaped(dt, q.shape), lse, lens, None, o_part, lse_part,
                       config, seqlen_k=p.seqlen_k, causal=p.causal,
                       scale=1.0 / math.sqrt(p.head_dim), upcast_dot=False,
                       **warmup_mods(p))


warmup_launches = attn_decode_warmup_args
