"""Shape-only stand-ins for tensors: what ``JITFunction.warmup`` needs to compile a kernel for
a config (dtype, shape, strides, an aligned address) without allocating anything, so a
process pool can compile candidates before the GPU times them."""

from __future__ import annotations

from typing import Any

__all__ = ["Shaped"]


class Shaped:
    """A shape-only stand-in for a contiguous tensor (what ``JITFunction.warmup`` needs):
    dtype, shape, strides, a 16-byte aligned address."""

    def __init__(self, dtype: Any, shape: tuple[int, ...]) -> None:
        self.dtype, self.shape = dtype, tuple(shape)
        strides, acc = [], 1
        for size in reversed(self.shape):
            strides.append(acc)
            acc *= size
        self._strides = tuple(reversed(strides))

    def stride(self, dim: int | None = None) -> Any:
        return self._strides if dim is None else self._strides[dim]

    def element_size(self) -> int:
        return int(self.dtype.itemsize)

    @staticmethod
    def data_ptr() -> int:
        return 0
