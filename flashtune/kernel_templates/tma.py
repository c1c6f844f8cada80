"""Helpers for the Hopper bulk tensor-copy engine (TMA) that several launchers share: whether
tensors can be addressed by it, the host descriptors they pass, and the padding of a head
dim whose rows cannot be 16-byte aligned (one copy launch each way: pad, cut back). Part of
the source hash of every template whose launcher uses them."""

from __future__ import annotations

import os
from typing import Any

import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

__all__ = ["ALIGNED_HEAD_DIM", "copy_cols_launch", "desc", "pad_head_dim", "padded_head_dim",
           "pads_head_dim", "tma_head_dim", "tma_ok", "unpad_head_dim"]

# the head-dim multiple whose rows are 16-byte multiples at 2 bytes (fp16, bf16)
ALIGNED_HEAD_DIM = 8


def tma_ok(*tensors: Any) -> bool:
    """Whether the bulk tensor-copy engine can address these tensors: 16-byte aligned base
    addresses, 16-byte multiples for every stride but the last (which is 1), and a last
    dimension (the head dim) of a 16-byte multiple, as FlashAttention-3 requires of its TMA
    path: ``head_dim % 8 == 0`` at 2 bytes. Where any of it fails the launchers use plain,
    masked loads (``USE_TMA`` off), never a copy, but for a head dim of rows that cannot be
    aligned on a GPU (:func:`pads_head_dim`); :func:`tma_head_dim` is the same rule for a
    problem's head dim, which the validity predicates apply to ``USE_TMA``."""
    for t in tensors:
        size = t.element_size()
        if t.data_ptr() % 16 or t.stride(-1) != 1 or (t.shape[-1] * size) % 16 \
                or any((s * size) % 16 for s in t.stride()[:-1]):
            return False
    return True


def tma_head_dim(head_dim: int, elem_size: int = 2) -> bool:
    """Whether rows of ``head_dim`` elements of ``elem_size`` bytes are a 16-byte multiple
    (:func:`tma_ok`'s rule for the last dimension; contiguous inputs then have aligned
    strides too): ``head_dim % 8 == 0`` for fp16/bf16."""
    return (head_dim * elem_size) % 16 == 0


def desc(t: Any, rows: int, cols: int) -> TensorDescriptor:
    """A 4-D TMA descriptor over ``t`` ``(B, H, N, D)`` loading ``(1, 1, rows, cols)`` boxes."""
    return TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, rows, cols])


def pads_head_dim(t: Any) -> bool:
    """Whether the forward and backward launchers run a call on ``t`` (q) padded: a CUDA
    tensor whose head dim is not a multiple of :data:`ALIGNED_HEAD_DIM`. Its rows can never
    be 16-byte aligned, so every load of it is a scalar one (measured on the H100 at D59 and
    D111: 0.8x and 0.5x SDPA flash, which pads the same way); padded with zero columns to
    the next multiple (a copy of the inputs and of the output, as torch's SDPA does) the
    kernel reads aligned rows, through TMA where the config asks. The scores, and so the
    output's first ``head_dim`` columns and the LSE, are unchanged by zero columns (the
    launchers keep ``1 / sqrt(head_dim)`` of the true head dim as the default scale). Under
    the interpreter the kernels' masked loads serve it as it is."""
    return bool(t.is_cuda) and t.shape[-1] % ALIGNED_HEAD_DIM != 0


def padded_head_dim(head_dim: int) -> int:
    """``head_dim`` rounded up to a multiple of :data:`ALIGNED_HEAD_DIM`."""
    return -(-head_dim // ALIGNED_HEAD_DIM) * ALIGNED_HEAD_DIM


# rows of a pad/unpad program: ~8K elements per program at the widest (256-column) tiles
_PAD_ELEMS = 8192


@triton.jit
def _copy_cols_kernel(src, dst, size1, rows,
                      src_s0, src_s1, src_s2, dst_s0, dst_s1, dst_s2,
                      LOAD_COLS: tl.constexpr, STORE_COLS: tl.constexpr,
                      BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """``dst[i, j, r, c] = src[i, j, r, c]`` for ``c < LOAD_COLS``, 0 for ``LOAD_COLS <= c <
    STORE_COLS``: columns ``[0, STORE_COLS)`` of ``BLOCK_R`` rows of one ``(i, j)`` written
    in full (padding: no fill first; unpadding: the extra columns of ``src`` never read past
    ``LOAD_COLS``). Program ``(r, i * size1 + j)``."""
    pid_r = tl.program_id(0)
    pid_ij = tl.program_id(1)
    i = (pid_ij // size1).to(tl.int64)
    j = (pid_ij % size1).to(tl.int64)
    r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.arange(0, BLOCK_C)
    in_rows = (r < rows)[:, None]
    r64 = r.to(tl.int64)[:, None]
    x = tl.load(src + i * src_s0 + j * src_s1 + r64 * src_s2 + c[None, :],
                mask=in_rows & (c < LOAD_COLS)[None, :], other=0.0)
    tl.store(dst + i * dst_s0 + j * dst_s1 + r64 * dst_s2 + c[None, :], x,
             mask=in_rows & (c < STORE_COLS)[None, :])


def _as4(t: Any) -> Any:
    """A 4-D view ``(i, j, rows, cols)`` of a 3-D or 4-D tensor, the longest axis as rows: a
    packed ``(total, heads, D)`` tensor as ``(1, heads, total, D)``."""
    return t.unsqueeze(0).transpose(1, 2) if t.dim() == 3 else t


def copy_cols_launch(src: Any, dst: Any, load_cols: int, store_cols: int
                     ) -> tuple[Any, tuple[Any, ...], dict[str, Any], tuple[int, int]] | None:
    """``(kernel, args, kwargs, grid)`` of the copy :func:`pad_head_dim` (``load_cols`` the
    head dim, ``store_cols`` the padded width) or :func:`unpad_head_dim` (the other way
    round) launches from ``src`` to ``dst`` (3-D or 4-D, alike but for the last dim, which
    is contiguous in both); ``args`` starts with the two tensors (4-D views), the rest
    depends on shapes and strides only. None for an empty tensor."""
    s4, d4 = _as4(src), _as4(dst)
    size0, size1, rows = s4.shape[:3]
    if min(size0, size1, rows) == 0:
        return None
    block_c = max(16, triton.next_power_of_2(max(load_cols, store_cols)))
    block_r = max(1, min(_PAD_ELEMS // block_c, triton.next_power_of_2(rows)))
    grid = (triton.cdiv(rows, block_r), size0 * size1)
    args = (s4, d4, size1, rows, *s4.stride()[:3], *d4.stride()[:3])
    kwargs = dict(LOAD_COLS=load_cols, STORE_COLS=store_cols, BLOCK_R=block_r,
                  BLOCK_C=block_c, num_warps=4)
    return _copy_cols_kernel, args, kwargs, grid


def _copy_cols(src: Any, dst: Any, load_cols: int, store_cols: int) -> None:
    launch = copy_cols_launch(src, dst, load_cols, store_cols)
    if launch is not None:
        kernel, args, kwargs, grid = launch
        kernel[grid](*args, **kwargs)


def _triton_copies(t: Any) -> bool:
    # CUDA tensors, or CPU tensors under the interpreter (the tests); plain torch otherwise
    return bool(t.is_cuda) or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def pad_head_dim(t: Any, width: int) -> Any:
    """``t`` (3-D or 4-D, last dim contiguous) with zero columns appended to its last
    dimension up to ``width``: a new contiguous tensor, written by one launch that reads
    ``t`` once and writes every column once (``F.pad`` fills the whole tensor first, then
    copies into a strided view: measured the larger part of a padded call's time on the
    H100)."""
    import torch

    head_dim = t.shape[-1]
    if not _triton_copies(t) or t.stride(-1) != 1:
        return torch.nn.functional.pad(t, (0, width - head_dim))
    out = torch.empty((*t.shape[:-1], width), dtype=t.dtype, device=t.device)
    _copy_cols(t, out, head_dim, width)
    return out


def unpad_head_dim(wide: Any, head_dim: int, out: Any = None) -> Any:
    """The first ``head_dim`` columns of ``wide`` (what :func:`pad_head_dim` widened) copied
    into ``out`` (any strides with a contiguous last dim; None: a new contiguous tensor),
    one launch. Returns ``out``."""
    import torch

    if out is None:
        out = torch.empty((*wide.shape[:-1], head_dim), dtype=wide.dtype, device=wide.device)
    if not _triton_copies(wide) or wide.stride(-1) != 1 or out.stride(-1) != 1 \
            or out.dtype != wide.dtype:
        return out.copy_(wide[..., :head_dim])
    # the loads are the whole padded row (aligned, vectorised), the stores the first columns
    _copy_cols(wide, out, wide.shape[-1], head_dim)
    return out
