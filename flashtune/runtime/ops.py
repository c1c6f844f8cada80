"""Public ops: ``flashtune.attention``."""

from __future__ import annotations

from functools import lru_cache
from typing import Any, Mapping

import torch

from flashtune.autotune.devices import DeviceFingerprint, current_device
from flashtune.autotune.problems import AttentionProblem
from flashtune.autotune.spaces import Config
from flashtune.errors import ConfigError
from flashtune.kernel_templates import get_template
from flashtune.runtime.checks import check_attention_inputs

_FWD = get_template("attn_fwd")


@lru_cache(maxsize=None)
def _device(device_type: str, index: int | None) -> DeviceFingerprint:
    return current_device(torch.device(device_type, index) if index is not None
                          else torch.device(device_type))


@lru_cache(maxsize=4096)
def _default_for(problem: AttentionProblem, device: DeviceFingerprint) -> Config:
    return _FWD.default_config(problem, device)


def _explicit_config(config: Mapping[str, Any], problem: AttentionProblem,
                     device: DeviceFingerprint) -> Config:
    cfg = _FWD.space.validate(config)
    reason = _FWD.space.check(cfg, problem, device)
    if reason is not None:
        raise ConfigError(f"config {cfg} cannot run {problem.describe()} on {device.name}: {reason}")
    return cfg


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    return_lse: bool = False,
    config: Mapping[str, int] | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Exact attention ``softmax(q k^T * scale) v`` with a flash-attention Triton kernel.

    Arguments:
        q: ``(batch, heads_q, seqlen_q, head_dim)``.
        k: ``(batch, heads_kv, seqlen_k, head_dim)``; ``heads_q`` a multiple of ``heads_kv``
            (GQA/MQA without copying K/V).
        v: same shape as ``k``.
            All three: float16 or bfloat16, one dtype, one CUDA device (or CPU under
            ``TRITON_INTERPRET=1``), any strides with a contiguous last dimension, so
            ``(batch, seqlen, heads, head_dim)`` storage viewed with ``.transpose(1, 2)``
            runs without a copy. head_dim in 16, 32, 64, 96, 128, 192, 256.
        causal: bottom-right aligned causal mask (flash-attention's convention): query ``i``
            sees key ``j`` iff ``j <= i + seqlen_k - seqlen_q``. Rows that see no key return
            zeros (and LSE ``-inf``).
        scale: softmax scale; default ``1 / sqrt(head_dim)``.
        return_lse: also return the float32 log-sum-exp ``(batch, heads_q, seqlen_q)``.
        config: explicit kernel config (keys of the ``attn_fwd`` space); default: the
            template's default for this problem and device.
    Returns:
        ``out`` of ``q``'s shape and dtype (contiguous), or ``(out, lse)``.
    Raises:
        InputError / InputTypeError (``ValueError`` / ``TypeError``) for bad tensors,
        ConfigError (``ValueError``) for a config outside the space, DeviceError for CPU
        tensors without the interpreter. All before any launch.
    """
    check_attention_inputs(q, k, v, scale)
    problem = AttentionProblem.from_tensors(q, k, causal=causal)
    device = _device(q.device.type, q.device.index)
    if config is None:
        cfg = _default_for(problem, device)
    else:
        cfg = _explicit_config(config, problem, device)
    return _FWD.launcher(q, k, v, cfg, causal=causal, scale=scale, return_lse=return_lse)
