"""Helpers for the Hopper bulk tensor-copy engine (TMA) that several launchers share: whether
tensors can be addressed by it, the host descriptors they pass, and the padding of a head
dim whose rows cannot be 16-byte aligned. Part of the source hash of every template whose
launcher uses them."""

from __future__ import annotations

from typing import Any

from triton.tools.tensor_descriptor import TensorDescriptor

__all__ = ["ALIGNED_HEAD_DIM", "desc", "pad_head_dim", "padded_head_dim", "pads_head_dim",
           "tma_head_dim", "tma_ok"]

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


def pad_head_dim(t: Any, width: int) -> Any:
    """``t`` with zero columns appended to its last dimension up to ``width`` (a copy)."""
    import torch.nn.functional as F

    return F.pad(t, (0, width - t.shape[-1]))
