"""A decode step over a fixed-size KV cache whose lengths live on the device: what a CUDA
graph of a generation step needs (transformers' ``StaticCache``, ``generate`` with
``cache_implementation="static"``, which compiles the step with ``mode="reduce-overhead"``).

A padded batch's attention elsewhere reads its lengths back to the host (the unpadding
of :mod:`flashtune.integrations.transformers`, one sync per forward), and a cache sliced
to its current length changes shape every step: neither can be captured in a graph.
Here the keys of sequence ``b`` are given by a boolean padding mask ``(B, Lk)`` over the
whole cache (True: a real token; left padding, the tokens, then the cache's empty slots),
turned into ``cache_leftpad`` and ``cache_seqlens`` by device ops of fixed shape, and the
split-KV kernel of :func:`~flashtune.runtime.kvcache.attention_with_kvcache` runs over
the cache as it is (no copy, no sync). The mask must be one run of real tokens per row,
as generation makes it: holes are not seen (eager callers that cannot promise it check
with :func:`one_run`, a sync).

Under ``torch.compile`` the step is the custom op ``flashtune::attention_static_cache``
(opaque to the compiler, so the graph has no break; its fake returns q's shape).
"""

from __future__ import annotations

import torch

from flashtune.runtime.kvcache import attention_with_kvcache

__all__ = ["attention_static_cache", "mask_lengths", "one_run"]


def mask_lengths(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cache_seqlens, cache_leftpad)``, int32 ``(B,)``, of a padding mask ``(B, Lk)``
    that holds one run of real tokens per row: the end of the run (last True + 1) and its
    start (first True; a row with none gets an empty run at 0). Device ops of fixed shape:
    nothing is read back."""
    keep = mask.bool()
    n = keep.shape[1]
    pos = torch.arange(n, device=keep.device, dtype=torch.int32)
    ends = torch.where(keep, pos + 1, 0).amax(-1).to(torch.int32)
    starts = torch.where(keep, pos, n).amin(-1).to(torch.int32)
    return ends.contiguous(), torch.minimum(starts, ends).contiguous()


def one_run(mask: torch.Tensor) -> bool:
    """Whether every row of the padding mask ``(B, Lk)`` is one run of True (or none): the
    case :func:`mask_lengths` describes exactly. Reads one bool back (a sync)."""
    ends, starts = mask_lengths(mask)
    return bool((mask.bool().sum(-1, dtype=torch.int32) == ends - starts).all())


def attention_static_cache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           mask: torch.Tensor, *, causal: bool = True,
                           scale: float | None = None,
                           window: tuple[int, int] | None = None,
                           softcap: float | None = None) -> torch.Tensor:
    """Attention of the last ``Lq`` positions of each sequence over its cache.

    Arguments:
        q: ``(B, Hq, Lq, D)``, the step's queries (meant for ``Lq <= 16``), at positions
            ``L_b - Lq .. L_b - 1`` of sequence ``b`` (``L_b``: the end of its run).
        k_cache, v_cache: ``(B, Hkv, Lk, D)``, the whole cache, the step's keys already
            written; any strides with a contiguous last dim.
        mask: bool ``(B, Lk)``, True on sequence ``b``'s real tokens: one run per row.
        causal, scale, window, softcap: as :func:`flashtune.attention_with_kvcache`
            (causal bottom-right aligned at each sequence's end).
    Returns:
        ``out`` ``(B, Hq, Lq, D)``, contiguous.
    Raises:
        InputError / InputTypeError as :func:`flashtune.attention_with_kvcache`.
    """
    if torch.compiler.is_compiling():
        left, right = window if window is not None else (-1, -1)
        out: torch.Tensor = torch.ops.flashtune.attention_static_cache(
            q, k_cache, v_cache, mask, causal, scale, left, right, softcap or 0.0)
        return out
    return _eager(q, k_cache, v_cache, mask, causal, scale, window, softcap)


def _eager(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           mask: torch.Tensor, causal: bool, scale: float | None,
           window: tuple[int, int] | None, softcap: float | None) -> torch.Tensor:
    seqlens, leftpad = mask_lengths(mask)
    out = attention_with_kvcache(q, k_cache, v_cache, seqlens, causal=causal, scale=scale,
                                 window=window, softcap=softcap, cache_leftpad=leftpad)
    assert isinstance(out, torch.Tensor)
    return out


@torch.library.custom_op("flashtune::attention_static_cache", mutates_args=())
def _static_cache_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     mask: torch.Tensor, causal: bool, scale: float | None,
                     window_left: int, window_right: int, softcap: float) -> torch.Tensor:
    window = None if (window_left, window_right) == (-1, -1) else (window_left, window_right)
    return _eager(q, k_cache, v_cache, mask, causal, scale, window, softcap or None)


@_static_cache_op.register_fake
def _static_cache_fake(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       mask: torch.Tensor, causal: bool, scale: float | None,
                       window_left: int, window_right: int, softcap: float) -> torch.Tensor:
    return torch.empty_like(q, memory_format=torch.contiguous_format)
