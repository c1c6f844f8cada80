"""attn_bwd launcher: takes an explicit config, allocates dQ/dK/dV and launches the kernels
(see kernel.py: preprocess, dK/dV and dQ, or preprocess and one fused launch). Inputs are
trusted (checked by the caller, as for attn_fwd).

:func:`kernel_args` is the one place that maps tensors and a config to the kernels'
arguments; the launcher and the precompiler (:mod:`flashtune.autotune.precompile`, which
passes shape-only stand-ins) both use it, so a precompiled kernel is the one the launch
looks up.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import triton

from flashtune.kernel_templates.attn_bwd.kernel import (
    attn_bwd_dkdv,
    attn_bwd_dq,
    attn_bwd_fused,
    attn_bwd_kv_reduce,
    attn_bwd_preprocess,
)
from flashtune.kernel_templates.attn_bwd.space import DEFAULTS
from flashtune.kernel_templates.attn_fwd.space import block_d
from flashtune.kernel_templates.tma import desc, tma_ok

PREPROCESS_BLOCK_M = 64
REDUCE_BLOCK_N = 64

# (kernel, positional args, keyword args, grid) of one launch
Launch = tuple[Any, tuple[Any, ...], dict[str, Any], tuple[int, int]]


def _upcast_dot(q: Any) -> bool:
    # The Triton interpreter stores bf16 as raw uint16 and its tl.dot reads them as integers;
    # under the interpreter the dots run in fp32 instead (same rounding of inputs, fp32 math).
    return q.device.type == "cpu" and q.dtype == torch.bfloat16


def _s3(t: Any) -> tuple[int, int, int]:
    return t.stride(0), t.stride(1), t.stride(2)


def kv_splits(config: Mapping[str, int], group: int) -> int:
    """How many slices the dK/dV kernel cuts each GQA group's query heads into: the config's
    ``KV_SPLITS`` where it divides the group, else their largest common divisor (1 without
    GQA)."""
    return math.gcd(int(config.get("KV_SPLITS", DEFAULTS["KV_SPLITS"])), group)


def partial_shape(k: Any, splits: int) -> tuple[int, int, int]:
    """Shape of each fp32 partial dK/dV buffer for ``splits`` > 1:
    ``(batch * heads_kv * splits, seqlen_k, head_dim)``."""
    batch, heads_kv, seqlen_k, head_dim = k.shape
    return batch * heads_kv * splits, seqlen_k, head_dim


def kernel_args(q: Any, k: Any, v: Any, out: Any, lse: Any, dout: Any, delta: Any,
                dq: Any, dk: Any, dv: Any, config: Mapping[str, int], *, causal: bool,
                scale: float, upcast_dot: bool, dlse: Any = None, part_k: Any = None,
                part_v: Any = None) -> dict[str, Launch]:
    """The launches in order: ``{"preprocess", "dkdv", ["kv_reduce",] "dq"}``, or with
    ``ONE_LAUNCH`` ``{"preprocess", "fused", ["kv_reduce"]}`` -> ``(kernel, args, kwargs,
    grid)``.

    ``lse`` and ``delta`` must be contiguous ``(batch, heads_q, seqlen_q)`` float32; every
    other tensor needs a contiguous last dim (any other strides). ``dlse`` None: no LSE
    gradient (the preprocess kernel is compiled without it). ``part_k``/``part_v``: contiguous
    fp32 buffers of :func:`partial_shape`, needed when :func:`kv_splits` > 1.
    """
    batch, heads_q, seqlen_q, head_dim = q.shape
    heads_kv, seqlen_k = k.shape[1], k.shape[2]
    bd = block_d(head_dim)
    warps, stages = config["num_warps"], config["num_stages"]
    group = heads_q // heads_kv
    dl_strides = (0, 0, 0) if dlse is None else _s3(dlse)
    split = bool(config.get("SPLIT_LOOPS", DEFAULTS["SPLIT_LOOPS"]))
    # the tensor-copy engine where the config asks for it and every streamed tensor allows it
    use_tma = bool(config.get("USE_TMA", 0)) and tma_ok(q, k, v, dout)
    pre: Launch = (
        attn_bwd_preprocess,
        (out, dout, delta if dlse is None else dlse, delta, *_s3(out), *_s3(dout), *dl_strides,
         heads_q, seqlen_q),
        dict(HEAD_DIM=head_dim, BLOCK_D=bd, BLOCK_M=PREPROCESS_BLOCK_M,
             HAS_DLSE=dlse is not None),
        (triton.cdiv(seqlen_q, PREPROCESS_BLOCK_M), batch * heads_q))
    bm1, bn1 = config["BLOCK_M1"], config["BLOCK_N1"]
    bm2, bn2 = config["BLOCK_M2"], config["BLOCK_N2"]
    splits = kv_splits(config, group)
    if splits > 1 and (part_k is None or part_v is None):
        raise ValueError(f"KV_SPLITS {splits} needs part_k and part_v buffers")
    reverse_dq = bool(config.get("REVERSE_DQ", DEFAULTS["REVERSE_DQ"]))
    desc_qdo = (desc(q, bm1, bd), desc(dout, bm1, bd)) if use_tma else (None, None)
    desc_kv = (desc(k, bn2, bd), desc(v, bn2, bd)) if use_tma else (None, None)
    parts_k, parts_v = (part_k, part_v) if splits > 1 else (dk, dv)
    launches: dict[str, Launch] = {"preprocess": pre}
    if config.get("ONE_LAUNCH", DEFAULTS["ONE_LAUNCH"]):
        n1_tiles, n2_tiles = triton.cdiv(seqlen_k, bn1), triton.cdiv(seqlen_q, bm2)
        n1_programs = n1_tiles * batch * heads_kv * splits
        launches["fused"] = (
            attn_bwd_fused,
            (q, k, v, dout, lse, delta, dq, dk, dv, parts_k, parts_v, *desc_qdo, *desc_kv,
             *_s3(q), *_s3(k), *_s3(v), *_s3(dout), *_s3(dq), *_s3(dk), *_s3(dv),
             heads_q, heads_kv, group, seqlen_q, seqlen_k, float(scale), n1_tiles,
             n1_programs, n2_tiles),
            dict(HEAD_DIM=head_dim, BLOCK_D=bd, BLOCK_M1=bm1, BLOCK_N1=bn1, BLOCK_M2=bm2,
                 BLOCK_N2=bn2, IS_CAUSAL=bool(causal), UPCAST_DOT=upcast_dot,
                 SPLIT_LOOPS=split, KV_SPLITS=splits, USE_TMA=use_tma, REVERSE_DQ=reverse_dq,
                 num_warps=warps, num_stages=stages),
            (n1_programs + n2_tiles * batch * heads_q, 1))
        if splits > 1:
            launches["kv_reduce"] = _kv_reduce(part_k, part_v, dk, dv, heads_kv, seqlen_k,
                                               batch, head_dim, splits)
        return launches
    launches["dkdv"] = (
        attn_bwd_dkdv,
        (q, k, v, dout, lse, delta, dk, dv, parts_k, parts_v, *desc_qdo,
         *_s3(q), *_s3(k), *_s3(v), *_s3(dout), *_s3(dk), *_s3(dv),
         heads_q, heads_kv, group, seqlen_q, seqlen_k, float(scale)),
        dict(HEAD_DIM=head_dim, BLOCK_D=bd, BLOCK_M1=bm1, BLOCK_N1=bn1,
             IS_CAUSAL=bool(causal), UPCAST_DOT=upcast_dot, SPLIT_LOOPS=split,
             KV_SPLITS=splits, USE_TMA=use_tma, num_warps=warps, num_stages=stages),
        (triton.cdiv(seqlen_k, bn1), batch * heads_kv * splits))
    if splits > 1:
        launches["kv_reduce"] = _kv_reduce(part_k, part_v, dk, dv, heads_kv, seqlen_k, batch,
                                           head_dim, splits)
    launches["dq"] = (
        attn_bwd_dq,
        (q, k, v, dout, lse, delta, dq, *desc_kv,
         *_s3(q), *_s3(k), *_s3(v), *_s3(dout), *_s3(dq),
         heads_q, group, seqlen_q, seqlen_k, float(scale)),
        dict(HEAD_DIM=head_dim, BLOCK_D=bd, BLOCK_M2=bm2, BLOCK_N2=bn2,
             IS_CAUSAL=bool(causal), UPCAST_DOT=upcast_dot, SPLIT_LOOPS=split,
             USE_TMA=use_tma, REVERSE_DQ=reverse_dq, num_warps=warps, num_stages=stages),
        (triton.cdiv(seqlen_q, bm2), batch * heads_q))
    return launches


def _kv_reduce(part_k: Any, part_v: Any, dk: Any, dv: Any, heads_kv: int, seqlen_k: int,
               batch: int, head_dim: int, splits: int) -> Launch:
    """The launch that adds up the ``splits`` fp32 partial dK/dV sums in order."""
    return (attn_bwd_kv_reduce,
            (part_k, part_v, dk, dv, *_s3(dk), *_s3(dv), heads_kv, seqlen_k),
            dict(HEAD_DIM=head_dim, BLOCK_D=block_d(head_dim), BLOCK_N=REDUCE_BLOCK_N,
                 KV_SPLITS=splits, num_warps=4),
            (triton.cdiv(seqlen_k, REDUCE_BLOCK_N), batch * heads_kv))


def attn_bwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dout: torch.Tensor,
    config: Mapping[str, int],
    *,
    causal: bool = False,
    scale: float | None = None,
    dlse: torch.Tensor | None = None,
    dq: torch.Tensor | None = None,
    dk: torch.Tensor | None = None,
    dv: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of flash-attention forward with an explicit config.

    Arguments:
        q: ``(batch, heads_q, seqlen_q, head_dim)``, fp16 or bf16, last dim contiguous.
        k, v: ``(batch, heads_kv, seqlen_k, head_dim)``, same dtype and device as ``q``;
            ``heads_q`` must be a multiple of ``heads_kv`` (GQA/MQA, never expanded).
        out: the forward's output, like ``q`` (last dim contiguous).
        lse: the forward's float32 log-sum-exp ``(batch, heads_q, seqlen_q)``, natural log,
            ``-inf`` for rows that see no key (``attn_fwd(..., return_lse=True)``).
        dout: the gradient of ``out``, like ``q`` (last dim contiguous).
        config: ``{"BLOCK_M1", "BLOCK_N1", "BLOCK_M2", "BLOCK_N2", "num_warps",
            "num_stages"}`` from the template's space: the dK/dV kernel's query step and key
            tile, the dQ kernel's query tile and key step; optionally ``SPLIT_LOOPS`` (0/1:
            unmasked blocks in loops of their own, see kernel.py) and ``KV_SPLITS`` (1, 2,
            4, 8: dK/dV programs per key tile, each over a slice of the GQA group, summed
            in order afterwards; :func:`kv_splits`), ``USE_TMA`` (0/1: Q/dO and K/V
            tiles through tensor descriptors; plain loads where a tensor is not 16-byte
            aligned, see ``attn_fwd.launcher.tma_ok``), ``ONE_LAUNCH`` (0/1: the dK/dV and
            dQ programs in one launch) and ``REVERSE_DQ`` (0/1: dQ query tiles last-first);
            the last two only reorder programs (the same bits).
        causal: bottom-right aligned mask: query ``i`` sees key ``j`` iff
            ``j <= i + seqlen_k - seqlen_q``.
        scale: softmax scale, default ``1 / sqrt(head_dim)``.
        dlse: optional gradient of ``lse`` ``(batch, heads_q, seqlen_q)`` (when the LSE output
            was used): since ``d lse_i / d s_ij = p_ij`` it enters as
            ``dS = P * (dP - (delta - dlse))``.
        dq, dk, dv: optional preallocated outputs shaped like ``q``, ``k``, ``v`` in their
            dtype (last dim contiguous); written in full.
    Returns:
        ``(dq, dk, dv)`` in the input dtype, shaped like ``q``, ``k``, ``v``; dK/dV summed
        over the query heads of each GQA group in a fixed order (deterministic: the same
        inputs and config give the same bits).
    """
    batch, heads_q, seqlen_q, head_dim = q.shape
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    delta = torch.empty((batch, heads_q, seqlen_q), device=q.device, dtype=torch.float32)
    lse = lse.contiguous()
    if dlse is not None and dlse.dtype != torch.float32:
        dlse = dlse.to(torch.float32)
    if dq is None:
        dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    if dk is None:
        dk = torch.empty_like(k, memory_format=torch.contiguous_format)
    if dv is None:
        dv = torch.empty_like(v, memory_format=torch.contiguous_format)
    part_k = part_v = None
    splits = kv_splits(config, heads_q // k.shape[1])
    if splits > 1:
        shape = partial_shape(k, splits)
        part_k = torch.empty(shape, device=q.device, dtype=torch.float32)
        part_v = torch.empty(shape, device=q.device, dtype=torch.float32)
    launches = kernel_args(q, k, v, out, lse, dout, delta, dq, dk, dv, config, causal=causal,
                           scale=scale, upcast_dot=_upcast_dot(q), dlse=dlse, part_k=part_k,
                           part_v=part_v)
    for kernel, args, kwargs, grid in launches.values():
        kernel[grid](*args, **kwargs)
    return dq, dk, dv
