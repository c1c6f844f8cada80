"""Helpers for the Hopper bulk tensor-copy engine (TMA) that several launchers share: whether
tensors can be addressed by it, and the host descriptors they pass. Part of the source hash
of every template whose launcher uses them."""

from __future__ import annotations

from typing import Any

from triton.tools.tensor_descriptor import TensorDescriptor

__all__ = ["desc", "tma_head_dim", "tma_ok"]


def tma_ok(*tensors: Any) -> bool:
    """Whether the bulk tensor-copy engine can address these tensors: 16-byte aligned base
    addresses, 16-byte multiples for every stride but the last (which is 1), and a last
    dimension (the head dim) of a 16-byte multiple, as FlashAttention-3 requires of its TMA
    path: ``head_dim % 8 == 0`` at 2 bytes. Where any of it fails the launchers use plain,
    masked loads (``USE_TMA`` off), never a padded copy; :func:`tma_head_dim` is the same
    rule for a problem's head dim, which the validity predicates apply to ``USE_TMA``."""
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
