"""attn_decode launchers: take an explicit, already-validated config, allocate and launch.

Input checking lives in :mod:`flashtune.runtime.kvcache`; this layer trusts its arguments so
the tuner and the dispatcher pay for checks once. :func:`attn_decode` is the dense entry
point (K/V of one length, any strides), :func:`attn_decode_kvcache` the cache one
(contiguous ``(B, Hkv, Nmax, D)`` with per-sequence lengths, or paged with a block table).

The score modifications follow FlashAttention-2's ``flash_attn_with_kvcache``: ``window``,
``softcap`` and ``alibi_slopes`` mean what they mean there (and in attn_fwd's launcher). A
modification left at its default passes ``None`` for its pointer and False for its flag, so
a plain call compiles to the kernel it compiled to before they existed. So do the cache
options (:func:`attn_decode_kvcache`'s ``k``/``v`` append, rotary, ``cache_batch_idx``,
``cache_leftpad``): one launch of the split kernel (and the combine) does the append, the
rotary and the attention.

Values inside the tables (lengths, page ids, batch indices, left pads) are not checked here:
the kernel clamps them so that bad ones give wrong rows and never an out-of-bounds access
(see kernel.py).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import triton

from flashtune.kernel_templates.attn_decode.kernel import (
    attn_decode_combine_kernel,
    attn_decode_split_kernel,
)
from flashtune.kernel_templates.attn_decode.space import block_d, block_m, d_tiles, rows


def _upcast_dot(q: torch.Tensor) -> bool:
    # The Triton interpreter stores bf16 as raw uint16 and its tl.dot reads them as integers;
    # under the interpreter the dots run in fp32 instead (same rounding of inputs, fp32 math).
    return q.device.type == "cpu" and q.dtype == torch.bfloat16


# the leading positional arguments of each kernel that change per call (tensors)
# Q, K, V, Out, Lse, Seqlens, BlockTable, OPart, LsePart, Alibi,
# KNew, VNew, Cos, Sin, BatchIdx, LeftPad
SPLIT_VARYING = 16
COMBINE_VARYING = 4  # OPart, LsePart, Out, Lse


def rotary_q_per_position(causal: bool, window: tuple[int, int], capacity: int) -> bool:
    """FlashAttention-2's rule for q's rotary positions: query ``i`` at ``cache_seqlens[b] +
    i`` when the call is causal or local, else every query at ``cache_seqlens[b]``. Local
    means a window bound in ``[0, capacity)`` (FA2 drops bounds >= the cache's seqlen)."""
    left, right = (int(w) for w in window)
    return bool(causal) or 0 <= left < capacity or 0 <= right < capacity


# CUDA's limit on a launch grid's second dimension
MAX_GRID_Y = 65535


def new_key_rows(splits: int, has_new: bool, batch_heads: int) -> int:
    """Grid rows of the new keys' own programs (kernel.py's ``NEW_ROWS``): with appended
    keys and ``splits`` > 1, one program per KV head of each sequence, ``splits`` to a row
    after the ``batch_heads`` rows of the splits; 0 (the last split walks the new keys) with
    one split, or where the rows would pass :data:`MAX_GRID_Y`."""
    if not has_new or splits == 1:
        return 0
    extra = -(-batch_heads // splits)
    return extra if batch_heads + extra <= MAX_GRID_Y else 0


def partial_count(splits: int, has_new: bool, batch_heads: int) -> int:
    """How many partial results a row gets: one per split, and one more from the new keys'
    own program where :func:`new_key_rows` gives them rows. 1 means no partials: the split
    kernel writes the output."""
    return splits + 1 if new_key_rows(splits, has_new, batch_heads) else splits


def partial_shapes(q: Any, parts: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shapes of the fp32 partial outputs and partial LSEs of ``parts`` > 1 partial results
    (:func:`partial_count`)."""
    batch, heads_q, seqlen_q, head_dim = q.shape
    return (batch, heads_q, seqlen_q, parts, head_dim), (batch, heads_q, seqlen_q, parts)


def kernel_args(q: Any, k: Any, v: Any, out: Any, lse: Any, seqlens: Any, block_table: Any,
                o_part: Any, lse_part: Any, config: Mapping[str, int], *, seqlen_k: int,
                causal: bool, scale: float, upcast_dot: bool,
                window: tuple[int, int] = (-1, -1), softcap: float | None = None,
                alibi_slopes: Any = None, k_new: Any = None, v_new: Any = None,
                rotary_cos: Any = None, rotary_sin: Any = None,
                rotary_interleaved: bool = True, cache_batch_idx: Any = None,
                cache_leftpad: Any = None,
                ) -> list[tuple[Any, tuple[Any, ...], dict[str, Any], tuple[int, ...]]]:
    """``(kernel, args, kwargs, grid)`` of the split kernel, then (``NUM_SPLITS`` > 1) the
    combine kernel, for these tensors: what :func:`_launch`, the launch plan and the
    precompiler all launch. ``lse``/``seqlens``/``block_table``/``alibi_slopes`` and the
    cache options may be None; ``o_part``/``lse_part`` are ignored (None allowed) with one
    split. Only ``.shape``, ``.stride()`` and ``.dtype`` of the tensors are read. The
    modifications as in :func:`attn_decode`, the cache options as in
    :func:`attn_decode_kvcache` (``k_new``/``v_new`` its ``k``/``v``)."""
    batch, heads_q, seqlen_q, head_dim = q.shape
    heads_kv = k.shape[1]
    group = heads_q // heads_kv
    bd, bm, bn = block_d(head_dim), block_m(group, seqlen_q), config["BLOCK_N"]
    bd0, bd1 = d_tiles(head_dim, config.get("SPLIT_D", 0))
    splits = config["NUM_SPLITS"]
    if splits == 1:
        o_part = lse_part = out
    extra_rows = new_key_rows(splits, k_new is not None, batch * heads_kv)
    parts = splits + 1 if extra_rows else splits
    paged = block_table is not None
    page_size = k.shape[2] if paged else 1
    bt_strides = (block_table.stride(0), block_table.stride(1)) if paged else (0, 0)
    grid = (splits, batch * heads_kv + extra_rows, triton.cdiv(rows(group, seqlen_q), bm))
    left, right = (int(w) for w in window)
    if causal:
        right = 0  # FA2: causal is a window's right bound 0; a left bound stays
    has_window = left >= 0 or (right >= 0 and not causal)
    cap = float(softcap) if softcap else 0.0
    has_alibi = alibi_slopes is not None
    stride_ab = alibi_slopes.stride(0) if has_alibi and len(alibi_slopes.shape) == 2 else 0
    has_new = k_new is not None
    rot_dim = 2 * rotary_cos.shape[1] if rotary_cos is not None else 0
    new_strides: tuple[Any, ...] = (None,) * 6
    if has_new:
        new_strides = (k_new.stride(0), k_new.stride(1), k_new.stride(2),
                       v_new.stride(0), v_new.stride(1), v_new.stride(2))
    args = (q, k, v, out, out if lse is None else lse,
            q if seqlens is None else seqlens, q if block_table is None else block_table,
            o_part, lse_part, alibi_slopes,
            k_new, v_new, rotary_cos, rotary_sin, cache_batch_idx, cache_leftpad,
            q.stride(0), q.stride(1), q.stride(2),
            k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2),
            out.stride(0), out.stride(1), out.stride(2),
            bt_strides[0], bt_strides[1],
            heads_q, heads_kv, seqlen_q, seqlen_k, page_size, float(scale),
            stride_ab, left, right, cap,
            k.shape[0] if paged else None, *new_strides,
            k_new.shape[2] if has_new else None,
            rotary_cos.shape[0] if rot_dim else None,
            k.shape[0] if cache_batch_idx is not None else None,
            batch * heads_kv if extra_rows else None)
    kwargs = dict(HEAD_DIM=head_dim, BLOCK_D=bd0, GROUP=group, BLOCK_M=bm, BLOCK_N=bn,
                  NUM_SPLITS=splits, IS_CAUSAL=bool(causal), HAS_SEQLENS=seqlens is not None,
                  PAGED=paged, PAGE_ALIGNED=paged and page_size % bn == 0,
                  STORE_LSE=lse is not None, UPCAST_DOT=upcast_dot,
                  HAS_WINDOW=has_window, HAS_SOFTCAP=cap > 0, HAS_ALIBI=has_alibi,
                  HAS_NEW=has_new, ROT_DIM=rot_dim,
                  ROT_INTERLEAVED=bool(rotary_interleaved) and rot_dim > 0,
                  ROT_Q_PER_POS=rot_dim > 0 and rotary_q_per_position(causal, window,
                                                                       seqlen_k),
                  HAS_BATCH_IDX=cache_batch_idx is not None,
                  HAS_LEFTPAD=cache_leftpad is not None, NEW_ROWS=extra_rows > 0,
                  BLOCK_D1=bd1, num_warps=config["num_warps"], num_stages=config["num_stages"])
    launches: list[tuple[Any, tuple[Any, ...], dict[str, Any], tuple[int, ...]]] = [
        (attn_decode_split_kernel, args, kwargs, grid)]
    if splits > 1:
        launches.append((
            attn_decode_combine_kernel,
            (o_part, lse_part, out, out if lse is None else lse,
             out.stride(0), out.stride(1), out.stride(2), heads_q, seqlen_q),
            dict(HEAD_DIM=head_dim, BLOCK_D=bd, NUM_SPLITS=parts,
                 BLOCK_S=triton.next_power_of_2(parts), STORE_LSE=lse is not None,
                 num_warps=4 if bd >= 128 else 2),
            (batch * heads_q * seqlen_q,)))
    return launches


def _launch(q: Any, k: Any, v: Any, config: Mapping[str, int], *, seqlens: Any,
            block_table: Any, seqlen_k: int, causal: bool, scale: float | None,
            return_lse: bool, out: Any, window: tuple[int, int], softcap: float | None,
            alibi_slopes: Any, **cache_options: Any
            ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    batch, heads_q, seqlen_q, head_dim = q.shape
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = (torch.empty((batch, heads_q, seqlen_q), device=q.device, dtype=torch.float32)
           if return_lse else None)
    o_part = lse_part = None
    if config["NUM_SPLITS"] > 1:
        o_shape, l_shape = partial_shapes(
            q, partial_count(config["NUM_SPLITS"], cache_options.get("k_new") is not None,
                             batch * k.shape[1]))
        o_part = torch.empty(o_shape, device=q.device, dtype=torch.float32)
        lse_part = torch.empty(l_shape, device=q.device, dtype=torch.float32)
    for kernel, args, kwargs, grid in kernel_args(
            q, k, v, out, lse, seqlens, block_table, o_part, lse_part, config,
            seqlen_k=seqlen_k, causal=causal, scale=scale, upcast_dot=_upcast_dot(q),
            window=window, softcap=softcap, alibi_slopes=alibi_slopes, **cache_options):
        kernel[grid](*args, **kwargs)
    return (out, lse) if lse is not None else out


def attn_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    config: Mapping[str, int],
    *,
    causal: bool = False,
    scale: float | None = None,
    return_lse: bool = False,
    out: torch.Tensor | None = None,
    window: tuple[int, int] = (-1, -1),
    softcap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Split-KV attention of a few queries over dense K/V, with an explicit config.

    Arguments:
        q: ``(batch, heads_q, seqlen_q, head_dim)``, fp16 or bf16, last dim contiguous;
            meant for ``seqlen_q <= 16`` (any length runs).
        k, v: ``(batch, heads_kv, seqlen_k, head_dim)``, same dtype and device as ``q``, any
            strides with a contiguous last dim; ``heads_q`` a multiple of ``heads_kv``.
        config: ``{"BLOCK_N", "NUM_SPLITS", "num_warps", "num_stages"}`` and optionally
            ``SPLIT_D`` (0/1: a head dim that is not a power of two as two tiles) from the
            ``attn_decode`` space.
        causal: bottom-right aligned: query ``i`` sees key ``j`` iff
            ``j <= i + seqlen_k - seqlen_q``. With a ``window``, causal is its right bound 0.
        scale: softmax scale, default ``1 / sqrt(head_dim)``.
        return_lse: also return the float32 log-sum-exp ``(batch, heads_q, seqlen_q)`` of
            the modified scores (natural log; ``-inf`` for rows that see no key).
        out: optional preallocated output like ``q`` (last dim contiguous).
        window: ``(left, right)``: query ``i``, at key position ``pos = i + seqlen_k -
            seqlen_q``, sees keys ``pos - left <= j <= pos + right``; -1 leaves a side
            unbounded. The splits cut only the keys some query sees (from ``seqlen_k -
            seqlen_q - left`` on), so a window costs O(window), not O(seqlen_k).
        softcap: scores become ``softcap * tanh(scale * q.k / softcap)``; None or 0: off.
        alibi_slopes: float32 ``(heads_q,)`` or ``(batch, heads_q)``, contiguous: scores
            minus ``slope * |pos - j|``.
    Returns:
        ``out`` ``(batch, heads_q, seqlen_q, head_dim)`` in the input dtype, or ``(out, lse)``.
    """
    return _launch(q, k, v, config, seqlens=None, block_table=None, seqlen_k=k.shape[2],
                   causal=causal, scale=scale, return_lse=return_lse, out=out, window=window,
                   softcap=softcap, alibi_slopes=alibi_slopes)


def attn_decode_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    config: Mapping[str, int],
    *,
    block_table: torch.Tensor | None = None,
    causal: bool = True,
    scale: float | None = None,
    return_lse: bool = False,
    out: torch.Tensor | None = None,
    window: tuple[int, int] = (-1, -1),
    softcap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    rotary_cos: torch.Tensor | None = None,
    rotary_sin: torch.Tensor | None = None,
    rotary_interleaved: bool = True,
    cache_batch_idx: torch.Tensor | None = None,
    cache_leftpad: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Split-KV attention of a few queries over a KV cache, with an explicit config; with
    ``k``/``v``, appends them to the cache in place (in the same launch).

    Arguments:
        q: ``(batch, heads_q, seqlen_q, head_dim)``.
        k_cache, v_cache: contiguous cache ``(batch, heads_kv, max_seqlen, head_dim)``, or,
            with ``block_table``, paged ``(num_pages, heads_kv, page_size, head_dim)``; any
            strides with a contiguous last dim.
        cache_seqlens: int32 ``(batch,)``: sequence ``b`` attends to keys
            ``[0, cache_seqlens[b])`` of its cache.
        block_table: int32 ``(batch, max_pages)``: key ``j`` of sequence ``b`` is slot
            ``j % page_size`` of page ``block_table[b, j // page_size]``.
        causal: bottom-right aligned against each sequence's own length: query ``i`` sees
            key ``j`` iff ``j <= i + cache_seqlens[b] - seqlen_q``.
        window, softcap, alibi_slopes: as in :func:`attn_decode`, per sequence: query
            ``i`` of sequence ``b`` sits at key position ``i + L_b - seqlen_q`` (``L_b``
            below).
        k, v: ``(batch, heads_kv, seqlen_new, head_dim)``, the cache's dtype, last dim
            contiguous: written into the cache at ``cache_seqlens[b] ..
            cache_seqlens[b] + seqlen_new - 1`` (paged: through ``block_table``) and
            attended to: sequence ``b`` has ``L_b = cache_seqlens[b] + seqlen_new`` keys
            (``L_b = cache_seqlens[b]`` without them).
        rotary_cos, rotary_sin: ``(seqlen_ro, rotary_dim / 2)``, contiguous, q's dtype or
            float32 (needs ``k``): the new keys are rotated at their positions
            ``cache_seqlens[b] + t``, the queries at ``cache_seqlens[b] + i`` when causal or
            local (:func:`rotary_q_per_position`), else all at ``cache_seqlens[b]``.
        rotary_interleaved: GPT-J pairs ``(2t, 2t + 1)`` (True) or GPT-NeoX halves ``(t, t
            + rotary_dim / 2)`` (False).
        cache_batch_idx: int32 ``(batch,)``: sequence ``b`` uses cache row
            ``cache_batch_idx[b]`` (contiguous caches; their batch may differ from q's).
        cache_leftpad: int32 ``(batch,)``: sequence ``b``'s keys start at
            ``cache_leftpad[b]`` (keys before it are not attended; positions stay absolute).
        Other arguments as in :func:`attn_decode`. The tables' values are not checked: the
        kernel clamps lengths to the capacity and page ids into the cache (see kernel.py),
        so bad ones give wrong rows, never an out-of-bounds access.
    """
    capacity = (block_table.shape[1] * k_cache.shape[2] if block_table is not None
                else k_cache.shape[2])
    return _launch(q, k_cache, v_cache, config, seqlens=cache_seqlens,
                   block_table=block_table, seqlen_k=capacity, causal=causal, scale=scale,
                   return_lse=return_lse, out=out, window=window, softcap=softcap,
                   alibi_slopes=alibi_slopes, k_new=k, v_new=v, rotary_cos=rotary_cos,
                   rotary_sin=rotary_sin, rotary_interleaved=rotary_interleaved,
                   cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad)
