"""Helpers for the Hopper bulk tensor-copy engine (TMA) that several launchers share: whether
tensors can be addressed by it, and the host descriptors they pass. Part of the source hash
of every template whose launcher uses them."""

from __future__ import annotations

from typing import Any

from triton.tools.tensor_descriptor import TensorDescriptor

__all__ = ["desc", "tma_ok"]


def tma_ok(*tensors: Any) -> bool:
    """Whether the bulk tensor-copy engine can address these tensors: 16-byte aligned base
    addresses and 16-byte multiples for every stride but the last (which is 1)."""
    for t in tensors:
        size = t.element_size()
        if t.data_ptr() % 16 or t.stride(-1) != 1 \
                or any((s * size) % 16 for s in t.stride()[:-1]):
            return False
    return True


def desc(t: Any, rows: int, cols: int) -> TensorDescriptor:
    """A 4-D TMA descriptor over ``t`` ``(B, H, N, D)`` loading ``(1, 1, rows, cols)`` boxes."""
    return TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, rows, cols])
