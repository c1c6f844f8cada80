"""The checks of :func:`~flashtune.runtime.kvcache.attention_with_kvcache`'s cache options
and of the values inside its tables.

Two kinds, by what they cost:

* Metadata (types, dtypes, shapes, strides, devices): :func:`check_cache_options` and the
  ``_check_*`` helpers. Free (no device sync), always on, before any launch.
* Values inside ``cache_seqlens``, ``block_table``, ``cache_batch_idx`` and
  ``cache_leftpad``: :func:`check_kvcache_tables`. They copy those tensors to the host, which
  on CUDA synchronises with the device, so they run only when asked (``check_tables=True``),
  by default on CPU tensors (the interpreter, where a copy costs nothing), and never while a
  CUDA graph is being captured (a copy is illegal then). The kernel does not rely on them:
  it clamps every value it reads so that bad ones give wrong rows and never an
  out-of-bounds access (see ``kernel_templates/attn_decode/kernel.py``).
"""

from __future__ import annotations

from typing import Any

import torch

from flashtune.core.errors import InputError, InputTypeError
from flashtune.runtime.checks import SUPPORTED_DTYPES

__all__ = ["check_cache_options", "check_kvcache_tables", "check_float", "check_int32"]


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def check_float(name: str, t: Any, dims: str) -> None:
    """A 4-D, non-empty fp16/bf16 tensor with a contiguous last dim."""
    if not isinstance(t, torch.Tensor):
        raise InputTypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 4:
        raise InputError(f"{name} must have 4 dimensions {dims}, got shape {_shape(t)}")
    if t.dtype not in SUPPORTED_DTYPES:
        raise InputTypeError(f"{name} must be float16 or bfloat16, got {t.dtype}")
    if t.numel() == 0:
        raise InputError(f"{name} is empty (shape {_shape(t)}); every dimension must be >= 1")
    if t.stride(-1) != 1 and t.shape[-1] != 1:
        raise InputError(f"{name} must be contiguous in its last dimension (stride 1), got "
                         f"strides {tuple(t.stride())}; call .contiguous() first")


def check_int32(name: str, t: Any, shape: tuple[int | None, ...], dims: str) -> None:
    """An int32 tensor of ``shape`` (None: any size)."""
    if not isinstance(t, torch.Tensor):
        raise InputTypeError(f"{name} must be an int32 torch.Tensor {dims}, got "
                             f"{type(t).__name__}")
    if t.dtype != torch.int32:
        raise InputTypeError(f"{name} must have dtype torch.int32, got {t.dtype}; "
                             f"convert it with .to(torch.int32)")
    if t.dim() != len(shape) or any(want is not None and got != want
                                    for got, want in zip(t.shape, shape)):
        want_text = ", ".join("any" if w is None else str(w) for w in shape)
        want_text += "," if len(shape) == 1 else ""
        raise InputError(f"{name} must have shape {dims} = ({want_text}), got {_shape(t)}")


def check_per_sequence(name: str, t: Any, batch: int) -> None:
    """An int32 ``(batch,)`` the kernel reads at offset ``b`` (so stride 1)."""
    check_int32(name, t, (batch,), "(batch,)")
    if batch > 1 and t.stride(0) != 1:
        raise InputError(f"{name} must be contiguous (stride 1), got stride {t.stride(0)} "
                         f"(an expanded, sliced or column view?); call .contiguous() first")


def _same_device(q: torch.Tensor, named: list[tuple[str, Any]]) -> None:
    for name, t in named:
        if t is not None and t.device != q.device:
            raise InputError(f"{name} is on {t.device} but q is on {q.device}; every tensor "
                             f"must be on one device")


def check_cache_options(q: torch.Tensor, k_cache: torch.Tensor, k: Any, v: Any,
                        rotary_cos: Any, rotary_sin: Any, rotary_interleaved: Any,
                        cache_batch_idx: Any, cache_leftpad: Any, block_table: Any,
                        capacity: int) -> None:
    """FlashAttention-2's rules for ``k``/``v``, ``rotary_cos``/``rotary_sin``,
    ``cache_batch_idx`` and ``cache_leftpad`` (q and the caches already checked); metadata
    only. ``capacity``: the keys a sequence can hold (max_seqlen, or max_pages x
    page_size)."""
    batch, _, _, head_dim = q.shape
    heads_kv = k_cache.shape[1]
    if (k is None) != (v is None):
        raise InputError("k and v go together: pass both new keys and new values, or neither")
    if k is not None:
        dims = "(batch, heads_kv, seqlen_new, head_dim)"
        check_float("k", k, dims)
        check_float("v", v, dims)
        if not (k.dtype == v.dtype == q.dtype):
            raise InputTypeError(f"k and v must have q's dtype {q.dtype}, got k {k.dtype}, "
                                 f"v {v.dtype}")
        if k.shape != v.shape:
            raise InputError(f"k and v must have the same shape {dims}, got k {_shape(k)} "
                             f"and v {_shape(v)}")
        if (k.shape[0], k.shape[1], k.shape[3]) != (batch, heads_kv, head_dim):
            raise InputError(f"k must have shape {dims} = ({batch}, {heads_kv}, any, "
                             f"{head_dim}) (q's batch and head_dim, the cache's heads), got "
                             f"{_shape(k)}")
        if k.shape[2] > capacity:
            raise InputError(f"k has seqlen_new {k.shape[2]} keys, more than the cache holds "
                             f"({capacity}); the new keys must fit in the cache")
    if (rotary_cos is None) != (rotary_sin is None):
        raise InputError("rotary_cos and rotary_sin go together: pass both or neither")
    if not isinstance(rotary_interleaved, bool):
        raise InputTypeError(f"rotary_interleaved must be a bool, got "
                             f"{type(rotary_interleaved).__name__}")
    if rotary_cos is not None:
        if k is None:
            raise InputError("rotary_cos/rotary_sin need the new keys k and v (as in "
                             "FlashAttention-2: the rotary embedding is applied to q and k)")
        for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
            if not isinstance(t, torch.Tensor):
                raise InputTypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dtype not in (q.dtype, torch.float32):
                raise InputTypeError(f"{name} must have q's dtype {q.dtype} or float32, got "
                                     f"{t.dtype}")
            if t.dim() != 2 or t.shape[1] < 1:
                raise InputError(f"{name} must have shape (seqlen_ro, rotary_dim / 2), got "
                                 f"{_shape(t)}")
            if not t.is_contiguous():
                raise InputError(f"{name} must be contiguous, got strides {tuple(t.stride())}"
                                 f"; call .contiguous() first")
        if rotary_cos.shape != rotary_sin.shape or rotary_cos.dtype != rotary_sin.dtype:
            raise InputError(f"rotary_cos and rotary_sin must have one shape and dtype, got "
                             f"{_shape(rotary_cos)} {rotary_cos.dtype} and "
                             f"{_shape(rotary_sin)} {rotary_sin.dtype}")
        rotary_dim = 2 * rotary_cos.shape[1]
        if rotary_dim > head_dim:
            raise InputError(f"rotary_cos's rotary_dim ({rotary_dim} = 2 x "
                             f"{rotary_cos.shape[1]}) exceeds head_dim {head_dim}")
        if rotary_cos.shape[0] < capacity:
            raise InputError(f"rotary_cos/rotary_sin have {rotary_cos.shape[0]} positions "
                             f"(seqlen_ro), fewer than the cache holds ({capacity}); as in "
                             f"FlashAttention-2 they must cover every position of the cache")
    if cache_batch_idx is not None:
        if block_table is not None:
            raise InputError("cache_batch_idx is not supported with block_table (as in "
                             "FlashAttention-2): index the pages in block_table instead")
        check_per_sequence("cache_batch_idx", cache_batch_idx, batch)
    if cache_leftpad is not None:
        if block_table is not None:
            raise InputError("cache_leftpad is not supported with block_table (as in "
                             "FlashAttention-2)")
        check_per_sequence("cache_leftpad", cache_leftpad, batch)
    _same_device(q, [("k", k), ("v", v), ("rotary_cos", rotary_cos),
                     ("rotary_sin", rotary_sin), ("cache_batch_idx", cache_batch_idx),
                     ("cache_leftpad", cache_leftpad)])


def _first(bad: torch.Tensor) -> int | None:
    idx = torch.nonzero(bad).flatten()
    return int(idx[0]) if idx.numel() else None


def check_kvcache_tables(k_cache: torch.Tensor, cache_seqlens: torch.Tensor,
                         block_table: torch.Tensor | None, *, seqlen_new: int = 0,
                         cache_batch_idx: torch.Tensor | None = None,
                         cache_leftpad: torch.Tensor | None = None) -> None:
    """Check the *values* of the tables: lengths in ``[0, capacity - seqlen_new]`` (the
    appended keys counted), the page ids a sequence uses in ``[0, num_pages)``, cache rows in
    ``[0, k_cache.shape[0])``, left pads in ``[0, cache_seqlens[b]]``. Copies them to the
    host (a device sync on CUDA). Raises InputError naming the argument."""
    lens = cache_seqlens.detach().to("cpu", torch.int64)
    page_size, num_pages = 1, 0
    if block_table is not None:
        page_size, num_pages = k_cache.shape[2], k_cache.shape[0]
        capacity = block_table.shape[1] * page_size
        what = (f"block_table's capacity ({block_table.shape[1]} pages x page_size "
                f"{page_size}); give block_table more columns")
    else:
        capacity = k_cache.shape[2]
        what = f"k_cache's max_seqlen ({capacity})"
    b = _first(lens < 0)
    if b is not None:
        raise InputError(f"cache_seqlens[{b}] = {int(lens[b])} is negative; lengths must be "
                         f">= 0")
    total = lens + seqlen_new
    b = _first(total > capacity)
    if b is not None:
        sums = (f" + seqlen_new = {int(lens[b])} + {seqlen_new} = {int(total[b])}"
                if seqlen_new else f" = {int(lens[b])}")
        raise InputError(f"cache_seqlens[{b}]{sums} exceeds {what}")
    if cache_batch_idx is not None:
        rows = cache_batch_idx.detach().to("cpu", torch.int64)
        b = _first((rows < 0) | (rows >= k_cache.shape[0]))
        if b is not None:
            raise InputError(f"cache_batch_idx[{b}] = {int(rows[b])} is not a row of the "
                             f"cache: it must be in [0, {k_cache.shape[0]}) (k_cache's batch)")
    if cache_leftpad is not None:
        pads = cache_leftpad.detach().to("cpu", torch.int64)
        b = _first((pads < 0) | (pads > lens))
        if b is not None:
            raise InputError(f"cache_leftpad[{b}] = {int(pads[b])} must be in [0, "
                             f"cache_seqlens[{b}] = {int(lens[b])}]: the cache of sequence "
                             f"{b} starts at cache_leftpad[{b}] and ends at its length")
    if block_table is not None:
        table = block_table.detach().to("cpu", torch.int64)
        pages_used = -(-total // page_size)
        used = torch.arange(table.shape[1])[None, :] < pages_used[:, None]
        wrong = used & ((table < 0) | (table >= num_pages))
        if wrong.any():
            b, j = (int(x) for x in torch.nonzero(wrong)[0])
            raise InputError(f"block_table[{b}, {j}] = {int(table[b, j])} is not a page of the "
                             f"cache: page ids must be in [0, {num_pages}) (k_cache has "
                             f"{num_pages} pages); sequence {b} of length "
                             f"{int(total[b])} uses its first {int(pages_used[b])} entries")
