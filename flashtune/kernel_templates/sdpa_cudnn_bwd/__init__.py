"""sdpa_cudnn_bwd: torch SDPA cuDNN's backward as a backward of its own (op ``bwd``, no
knobs), and its training pair ``attn_fwd_gluon_bwd_cudnn``: the Gluon forward with cuDNN's
backward.

The Gluon forward (``attn_fwd_gluon``) leads cuDNN's forward at long sequences (on an H200,
D64 N 8k-16k without a mask 1.17-1.21x, D128 N16k 1.05x, causal 1.10x; the training step's
kernels in ``benchmarks/results/train_breakdown_mask_d{64,128}_h200.json``), where cuDNN's
backward leads the Gluon backward (D64 N 4k-16k without a mask 1.05-1.10x, D128 causal
1.05-1.07x). cuDNN's backward reads a forward's output and natural-log LSE
(:mod:`.launcher`), so the two halves pair. ``sdpa_cudnn_bwd_gluon`` (cuDNN's forward
with the Gluon backward) is the mirror pair, for the other regime.

It is also cuDNN's own training step where a call's backward must be flashtune's custom
op (``torch.compile``): ``sdpa_cudnn`` names it as its ``paired_backward``, so such a call
near a training choice cuDNN won runs cuDNN's forward with its LSE and this backward, the
kernels torch's autograd would run.

Limits: cuDNN's backward: its mask aligned top-left (causal only with ``seqlen_q ==
seqlen_k`` or one query), GQA, no single query over a single key, the head dims cuDNN's
forward serves, on sm_90. cuDNN's backward takes no gradient of the LSE, so a call with one
(a loss on the returned LSE, eager or under ``torch.compile``, whose op hands the backward
an LSE gradient only where the loss uses the LSE) runs ``attn_bwd_gluon`` with its default
config where it serves the call, else ``attn_bwd`` with its default. The Gluon pair keeps
head dims 64 and 128. dQ is summed with atomics: ``Limits.deterministic`` is False.

Its hash is SDPA cuDNN's (torch's and cuDNN's versions) with this launcher's; the pair is
``torch_bound``, as an SDPA backend is (a choice timed under another torch is stale there
and exported as it was timed). Nothing routes to the pair by default: ``flashtune tune
--op train`` times it beside the others and the router runs it where it was stored as the
measured winner.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from flashtune.core.device import current_device
from flashtune.core.problem import AttentionProblem
from flashtune.core.space import Config
from flashtune.core.spec import Limits
from flashtune.kernel_templates.attn_bwd import SPEC as TL_BWD
from flashtune.kernel_templates.attn_bwd import attn_bwd
from flashtune.kernel_templates.attn_bwd.case import make_case
from flashtune.kernel_templates.attn_bwd.reference import attn_bwd_reference
from flashtune.kernel_templates.attn_bwd_gluon import SPEC as GLUON_BWD
from flashtune.kernel_templates.attn_bwd_gluon.launcher import attn_bwd_gluon
from flashtune.kernel_templates.attn_bwd_gluon.space import default_config as gluon_default
from flashtune.kernel_templates.attn_fwd_gluon import SPEC as FWD_GLUON
from flashtune.kernel_templates.registry import TemplateSpec, register_template, source_hash
from flashtune.kernel_templates.sdpa_cudnn import SPEC as FWD_CUDNN
from flashtune.kernel_templates.sdpa_cudnn_bwd.launcher import sdpa_cudnn_bwd
from flashtune.kernel_templates.sdpa_extern import EMPTY_SPACE, no_config
from flashtune.kernel_templates.shaped import Shaped

_HERE = Path(__file__).parent
# the training pair's name: attn_fwd_gluon's forward with this backward
PAIR_NAME = "attn_fwd_gluon_bwd_cudnn"


@functools.lru_cache(maxsize=256)
def _lse_gradient_route(q_shape: torch.Size, k_shape: torch.Size, dtype: torch.dtype,
                        device: torch.device, causal: bool) -> tuple[Any, Config]:
    """The backward of a call signature with the LSE's gradient (chosen once, not per
    step): the Gluon backward with its default config where it serves the problem, else
    attn_bwd with its default."""
    problem = AttentionProblem.from_tensors(Shaped(dtype, q_shape), Shaped(dtype, k_shape),
                                            causal=causal)
    fingerprint = current_device(device)
    if GLUON_BWD.refuse(problem, fingerprint) is None:
        return attn_bwd_gluon, gluon_default(problem, fingerprint)
    return attn_bwd, TL_BWD.default_config(problem, fingerprint)


def _lse_gradient_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor, *,
                           causal: bool, scale: float | None, dlse: torch.Tensor
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A call with the LSE's gradient: a backward that takes it (:func:`_lse_gradient_route`)."""
    launcher, config = _lse_gradient_route(q.shape, k.shape, q.dtype, q.device, causal)
    grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor] = launcher(
        q, k, v, out, lse, dout, config, causal=causal, scale=scale, dlse=dlse)
    return grads


def launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
           lse: torch.Tensor, dout: torch.Tensor, config: Config, *, causal: bool = False,
           scale: float | None = None, dlse: torch.Tensor | None = None
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`~.launcher.sdpa_cudnn_bwd`, a call with ``dlse`` run by the Gluon backward."""
    return sdpa_cudnn_bwd(q, k, v, out, lse, dout, config, causal=causal, scale=scale,
                          dlse=dlse, fallback=_lse_gradient_backward)


def _hash(*parts: Any) -> str:
    return hashlib.sha256("\x00".join(map(str, parts)).encode()).hexdigest()[:16]


SPEC = register_template(TemplateSpec(
    name="sdpa_cudnn_bwd",
    op="bwd",
    source_hash=_hash(FWD_CUDNN.source_hash, source_hash(_HERE / "launcher.py")),
    launcher=launch,
    reference=attn_bwd_reference,
    space=EMPTY_SPACE,
    default_config=no_config,
    make_case=make_case,
    kind="extern",
    torch_bound=True,
    limits=Limits(head_dims=FWD_CUDNN.limits.head_dims, gqa=True, causal_unaligned=False,
                  needs_gpu=True, capabilities=((9, 0),), single_token=False,
                  deterministic=False, available=FWD_CUDNN.limits.available),
))

# the pair's forward: attn_fwd_gluon as it is (its kernel, space, hash), for train only, at
# the head dims this pair was measured at (64 and 128)
PAIR_SPEC = register_template(replace(
    FWD_GLUON, name=PAIR_NAME, serves=("train",), backward=SPEC.name, torch_bound=True,
    limits=replace(FWD_GLUON.limits, head_dims=(64, 128))))

__all__ = ["PAIR_NAME", "PAIR_SPEC", "SPEC", "launch", "sdpa_cudnn_bwd"]
