"""Launching an already-compiled Triton kernel without Triton's per-call binding.

``kernel[grid](*args, **kwargs)`` binds every argument, specialises each one (pointer
alignment, integers equal to 1 or divisible by 16, tensor-descriptor block types), hashes the
result and looks the compiled kernel up in a cache on every call; for a 35-argument kernel that
is most of the host cost of a launch. Between two calls of one attention shape only the tensor
addresses change, so :class:`DirectLaunch` does that work once: it compiles (or finds) the
kernel for the first call's arguments through ``JITFunction.warmup`` -- the same cache and the
same specialisation as ``kernel[grid]`` -- and later calls hand the compiled kernel's launcher
the new tensors plus the arguments fixed at build time, as ``JITFunction.run`` itself does at
its end.

The caller must only reuse a :class:`DirectLaunch` for arguments that Triton would specialise
identically: same shapes, strides, dtypes, constexprs and scalar values, and the same 16-byte
alignment of every pointer (the runtime's plan key holds all of these). Host tensor
descriptors are passed as :class:`HostDesc`, which carries what the launcher reads from
Triton's ``TensorDescriptor`` without its per-object validation (done once, at build time).

This uses Triton internals that are stable in 3.x (``CompiledKernel.run``, ``function``,
``packed_metadata``, ``JITFunction.arg_names``/``params``); :func:`supported` says whether this
Triton has them, and the runtime falls back to ``kernel[grid]`` when not, or when a launch hook
(e.g. the Proton profiler) is installed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from triton import knobs

__all__ = ["DirectLaunch", "HostDesc", "current_device", "current_stream", "hooks_installed",
           "supported"]


def _torch_current_stream(index: int) -> int:
    return int(torch.cuda.current_stream(index).cuda_stream)


# what Triton's own launch path calls (CUDA builds of torch; CPU builds build no plans)
current_device: Callable[[], int] = getattr(torch._C, "_cuda_getDevice",
                                            torch.cuda.current_device)
current_stream: Callable[[int], int] = getattr(torch._C, "_cuda_getCurrentRawStream",
                                               _torch_current_stream)


class HostDesc:
    """What Triton's CUDA launcher reads from a host ``TensorDescriptor``: the base tensor,
    its shape and strides (lists) and the padding mode. Validated once when the plan is built
    (block shape, alignment), so building one per call is a few attribute stores."""

    __slots__ = ("base", "shape", "strides", "padding")

    def __init__(self, base: Any, shape: list[int], strides: list[int]) -> None:
        self.base, self.shape, self.strides, self.padding = base, shape, strides, "zero"


def supported() -> bool:
    """Whether this Triton exposes what :class:`DirectLaunch` uses."""
    try:
        from triton.compiler.compiler import CompiledKernel
        from triton.runtime.jit import JITFunction
    except ImportError:  # pragma: no cover - triton always has these in 3.x
        return False
    return (hasattr(CompiledKernel, "run") and hasattr(CompiledKernel, "_init_handles")
            and hasattr(JITFunction, "warmup"))


def _hook_active(hook: Any) -> bool:
    # Triton 3.6 keeps launch hooks in a HookChain (always present, active when it has
    # calls); older 3.x releases used None or a callable.
    return hook is not None and bool(getattr(hook, "calls", True))


def hooks_installed() -> bool:
    """A launch hook (profiler) wants ``JITFunction.run``'s launch metadata: launch the
    normal way then."""
    rt = knobs.runtime
    return _hook_active(rt.launch_enter_hook) or _hook_active(rt.launch_exit_hook)


class DirectLaunch:
    """One compiled kernel with its grid and the arguments that do not change per call.

    Arguments:
        jit_fn: the ``@triton.jit`` function.
        args, kwargs, grid: one real call's arguments, as for ``jit_fn[grid](*args,
            **kwargs)``; ``kwargs`` holds constexprs and launch options (``num_warps``...).
        n_varying: how many leading positional arguments change per call (tensors, host
            descriptors); the rest are fixed.
        late: names of arguments past the leading ones that change per call too (a
            keyword tensor or descriptor); pass them to :meth:`with_late`.
    The kernel is compiled now if Triton's cache does not have it (in the current CUDA
    device's context: build under ``torch.cuda.device(...)`` of the tensors' device).
    """

    __slots__ = ("grid", "tail", "_late", "_run", "_function", "_packed")

    def __init__(self, jit_fn: Any, args: Sequence[Any], kwargs: Mapping[str, Any],
                 grid: Sequence[int], n_varying: int, late: Sequence[str] = ()) -> None:
        compiled = jit_fn.warmup(*args, grid=tuple(grid), **kwargs)
        if hasattr(compiled, "result"):  # asynchronous compile mode
            compiled = compiled.result()
        compiled._init_handles()
        names = list(jit_fn.arg_names)
        bound = dict(zip(names, args))
        for param in jit_fn.params:
            if param.name not in bound:
                if param.name in kwargs:
                    bound[param.name] = kwargs[param.name]
                elif param.has_default:
                    bound[param.name] = param.default
                else:
                    raise TypeError(f"missing kernel argument {param.name!r}")
        full = [bound[n] for n in names]
        self.tail = tuple(full[n_varying:])
        self._late = tuple(names.index(n) - n_varying for n in late)
        if any(i < 0 for i in self._late):
            raise ValueError(f"late arguments {list(late)} must come after the "
                             f"{n_varying} leading ones")
        g = tuple(grid) + (1, 1)
        self.grid = (int(g[0]), int(g[1]), int(g[2]))
        self._run = compiled.run
        self._function = compiled.function
        self._packed = compiled.packed_metadata

    def __call__(self, stream: int, *varying: Any) -> None:
        g0, g1, g2 = self.grid
        self._run(g0, g1, g2, stream, self._function, self._packed, None, None, None,
                  *varying, *self.tail)

    def with_late(self, stream: int, varying: Sequence[Any], late: Sequence[Any]) -> None:
        """A launch whose ``late`` arguments (as named at build time, in that order) change
        per call too."""
        tail = list(self.tail)
        for i, value in zip(self._late, late):
            tail[i] = value
        g0, g1, g2 = self.grid
        self._run(g0, g1, g2, stream, self._function, self._packed, None, None, None,
                  *varying, *tail)
