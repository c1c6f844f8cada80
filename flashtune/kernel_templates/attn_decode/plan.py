"""A launch plan for one attn_decode call signature: what the runtime replays after a
shape's first call (the decode counterpart of
:class:`~flashtune.kernel_templates.attn_fwd.plan.AttnFwdPlan`).

Built from one real call (q, K/V or caches, optional ``cache_seqlens`` and ``block_table``,
config, causal, scale, return_lse, the score modifications, the cache options: new K/V,
rotary cos/sin, cache batch indices and left pads); later calls whose tensors have
the same shapes, strides, dtypes, device and 16-byte alignment and the same modifications
and options (the caller's key) allocate the output and the LSE (the split partials are the
plan's own for calls on the build's stream and thread:
:class:`~flashtune.kernel_templates.direct.Scratch`) and launch the compiled split (and
combine) kernels directly; ALiBi slopes and the options'
tensors are passed per call, like the other tensors. Arguments come
from :func:`~flashtune.kernel_templates.attn_decode.launcher.kernel_args`, the function the
launcher and the precompiler use, so the plan runs exactly the kernels the launcher would.

Not part of the template's source hash: it changes how the kernels are launched, not which
code is generated.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from flashtune.kernel_templates.attn_decode.full import full_lengths
from flashtune.kernel_templates.attn_decode.launcher import (
    COMBINE_VARYING,
    SPLIT_VARYING,
    kernel_args,
    partial_count,
    partial_shapes,
)
from flashtune.kernel_templates.direct import DirectLaunch, Scratch, capturing

__all__ = ["AttnDecodeDensePlan", "AttnDecodePlan"]

_CONTIGUOUS = torch.contiguous_format


class AttnDecodePlan:
    """Replays ``attn_decode_kvcache`` (``seqlens`` given) or ``attn_decode`` (dense K/V,
    ``seqlens`` None) for CUDA tensors like the ones it was built from; call it as
    ``plan(q, k, v, seqlens, block_table, stream[, alibi_slopes, k_new, v_new, rotary_cos,
    rotary_sin, cache_batch_idx, cache_leftpad])`` with the same kinds of arguments (None
    where the build call had None; ``alibi_slopes`` contiguous, like the build call's).

    Building compiles the kernels if Triton's cache lacks them; do it with the tensors'
    device current (``device_index``), and call the plan only while that device is current.
    """

    __slots__ = ("device_index", "_split", "_combine", "_lse_shape", "_part_shapes",
                 "_device", "_return_lse", "_scratch")

    def __init__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 config: Mapping[str, int], *, seqlens: torch.Tensor | None,
                 block_table: torch.Tensor | None, causal: bool, scale: float | None,
                 return_lse: bool, window: tuple[int, int] = (-1, -1),
                 softcap: float | None = None,
                 alibi_slopes: torch.Tensor | None = None,
                 **cache_options: Any) -> None:
        if q.device.type != "cuda":
            raise ValueError("launch plans are for CUDA tensors")
        batch, heads_q, seqlen_q, head_dim = q.shape
        if scale is None:
            scale = 1.0 / math.sqrt(head_dim)
        self.device_index = q.get_device()
        self._device, self._return_lse = q.device, bool(return_lse)
        self._lse_shape = (batch, heads_q, seqlen_q)
        splits = config["NUM_SPLITS"]
        parts = partial_count(splits, cache_options.get("k_new") is not None,
                              batch * k.shape[1])
        self._part_shapes = partial_shapes(q, parts) if splits > 1 else None
        self._scratch = None
        out, lse, o_part, lse_part = self._buffers(q, -1)
        if o_part is not None:  # the split kernel writes them, the combine reads them
            self._scratch = Scratch(self.device_index, (o_part, lse_part))
        seqlen_k = (block_table.shape[1] * k.shape[2] if block_table is not None
                    else k.shape[2])
        launches = kernel_args(q, k, v, out, lse, seqlens, block_table, o_part, lse_part,
                               config, seqlen_k=seqlen_k, causal=causal, scale=scale,
                               upcast_dot=False, window=window, softcap=softcap,
                               alibi_slopes=alibi_slopes, **cache_options)
        with torch.cuda.device(self.device_index):
            kernel, args, kwargs, grid = launches[0]
            self._split = DirectLaunch(kernel, args, kwargs, grid, SPLIT_VARYING)
            self._combine = None
            if len(launches) > 1:
                kernel, args, kwargs, grid = launches[1]
                self._combine = DirectLaunch(kernel, args, kwargs, grid, COMBINE_VARYING)

    def _buffers(self, q: torch.Tensor, stream: int) -> tuple[Any, Any, Any, Any]:
        dev = self._device
        out = torch.empty_like(q, memory_format=_CONTIGUOUS)  # q's shape and dtype
        lse = (torch.empty(self._lse_shape, dtype=torch.float32, device=dev)
               if self._return_lse else None)
        if self._part_shapes is None:
            return out, lse, None, None
        kept = self._scratch.get(stream) if self._scratch is not None else None
        if kept is not None:
            return out, lse, kept[0], kept[1]
        o_shape, l_shape = self._part_shapes
        return (out, lse, torch.empty(o_shape, dtype=torch.float32, device=dev),
                torch.empty(l_shape, dtype=torch.float32, device=dev))

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 seqlens: torch.Tensor | None, block_table: torch.Tensor | None,
                 stream: int, alibi_slopes: torch.Tensor | None = None,
                 k_new: torch.Tensor | None = None, v_new: torch.Tensor | None = None,
                 rotary_cos: torch.Tensor | None = None,
                 rotary_sin: torch.Tensor | None = None,
                 cache_batch_idx: torch.Tensor | None = None,
                 cache_leftpad: torch.Tensor | None = None,
                 ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        out, lse, o_part, lse_part = self._buffers(q, stream)
        lse_arg = out if lse is None else lse
        if self._combine is None:
            self._split(stream, q, k, v, out, lse_arg, q if seqlens is None else seqlens,
                        q if block_table is None else block_table, out, out, alibi_slopes,
                        k_new, v_new, rotary_cos, rotary_sin, cache_batch_idx, cache_leftpad)
        else:
            self._split(stream, q, k, v, out, lse_arg, q if seqlens is None else seqlens,
                        q if block_table is None else block_table, o_part, lse_part,
                        alibi_slopes, k_new, v_new, rotary_cos, rotary_sin, cache_batch_idx,
                        cache_leftpad)
            self._combine(stream, o_part, lse_part, out, lse_arg)
        return (out, lse) if lse is not None else out


class AttnDecodeDensePlan(AttnDecodePlan):
    """:class:`AttnDecodePlan` of ``attn_decode(q, k, v, ...)`` on dense K/V, called like the
    forward's plan: ``plan(q, k, v, stream)``. :func:`flashtune.attention` keeps these for
    the short-query calls it routes to attn_decode. It runs the cache variant of the split
    kernel with every length full (:mod:`~flashtune.kernel_templates.attn_decode.full`): the
    kernel the tuner times and the KV-cache path runs."""

    __slots__ = ("_lens",)

    def __init__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 config: Mapping[str, int], *, causal: bool, scale: float | None,
                 return_lse: bool) -> None:
        lens = full_lengths(q.shape[0], k.shape[2], q.device)
        # one made under capture lives in the graph's pool: fetched again per call then
        self._lens = None if capturing() else lens
        super().__init__(q, k, v, config, seqlens=lens, block_table=None, causal=causal,
                         scale=scale, return_lse=return_lse)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,  # type: ignore[override]
                 stream: int) -> Any:
        lens = self._lens
        if lens is None:
            lens = full_lengths(q.shape[0], k.shape[2], q.device)
        return AttnDecodePlan.__call__(self, q, k, v, lens, None, stream)
