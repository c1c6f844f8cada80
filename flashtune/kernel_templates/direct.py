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

    __slots__ = ("grid", "tail", "_late", "_run", "_function", "_packed", "_raw")

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
        self._raw = RawLaunch.of(compiled.run, n_varying, self.tail, self._late)

    def __call__(self, stream: int, *varying: Any) -> None:
        g0, g1, g2 = self.grid
        if self._raw is not None:
            self._raw(g0, g1, g2, stream, self._function, self._packed, varying, ())
            return
        self._run(g0, g1, g2, stream, self._function, self._packed, None, None, None,
                  *varying, *self.tail)

    def with_late(self, stream: int, varying: Sequence[Any], late: Sequence[Any]) -> None:
        """A launch whose ``late`` arguments (as named at build time, in that order) change
        per call too."""
        g0, g1, g2 = self.grid
        if self._raw is not None:
            self._raw(g0, g1, g2, stream, self._function, self._packed, varying, late)
            return
        tail = list(self.tail)
        for i, value in zip(self._late, late):
            tail[i] = value
        self._run(g0, g1, g2, stream, self._function, self._packed, None, None, None,
                  *varying, *tail)


class RawLaunch:
    """Triton's compiled C launcher called with the argument list Triton's Python layer
    would build for it, that list's fixed part built once.

    Triton 3.6's CUDA launcher (``CompiledKernel.run``, a ``CudaLauncher``) is a Python
    object whose call allocates the scratch buffers a kernel may need and, for a kernel with
    host tensor descriptors, goes through a closure (``wrap_handle_tensordesc``) that walks
    every argument to expand each descriptor into the C launcher's arguments; for attn_fwd's
    40 arguments that walk was most of a planned call's host time on an H200 (``driver.py``'s
    ``inner``: 11 of the plan's 20 us under cProfile). Here only the arguments that change
    per call (the leading ones and the late ones) are expanded per call, with Triton's own
    ``make_tensordesc_arg``; the others were expanded when the plan was built. :meth:`of`
    answers None (the caller keeps ``CompiledKernel.run``) unless the launcher is that
    object as this code knows it and the kernel needs no scratch memory.
    """

    __slots__ = ("_launch", "_coop", "_pdl", "_varying", "_parts", "_late_meta",
                 "_late_order", "_expand", "_maps")

    def __init__(self, launch: Callable[..., Any], coop: bool, pdl: bool,
                 varying: tuple[Any, ...], parts: tuple[tuple[Any, ...], ...],
                 late_meta: tuple[Any, ...], late_order: tuple[int, ...],
                 expand: Callable[[Any, Any], list[Any]]) -> None:
        self._launch, self._coop, self._pdl = launch, coop, pdl
        self._varying = varying  # per leading argument: _PLAIN, or its descriptor metadata
        # the fixed arguments as the C launcher takes them, split where a late one goes:
        # parts[0], late[0], parts[1], ... (late in position order)
        self._parts = parts
        self._late_meta = late_meta
        self._late_order = late_order  # the caller's late values, reordered by position
        self._expand = expand
        # descriptors already encoded, by slot, base address, shape and strides (see
        # _encoded); at most _MAPS of them, then the cache starts again
        self._maps: dict[tuple[Any, ...], list[Any]] = {}

    @classmethod
    def of(cls, run: Any, n_varying: int, tail: Sequence[Any],
           late: Sequence[int]) -> RawLaunch | None:
        """The raw launch of ``run`` (a compiled kernel's ``run``) for a kernel called with
        ``n_varying`` leading arguments that change per call, then ``tail``, whose positions
        ``late`` (in the order the caller passes their values) change too; or None."""
        try:
            from triton.backends.nvidia import driver
        except ImportError:  # pragma: no cover - a Triton without the CUDA backend
            return None
        if type(run) is not getattr(driver, "CudaLauncher", None) \
                or getattr(driver, "_BASE_ARGS_FORMAT_LEN", None) != 13:
            return None
        try:
            if run.global_scratch_size or run.profile_scratch_size:
                return None  # allocated per launch by the launcher
            launch, coop, pdl = (run.launch, bool(run.launch_cooperative_grid),
                                 bool(run.launch_pdl))
        except AttributeError:
            return None
        indices: Any = ()
        meta: Sequence[Any] = ()
        code = getattr(launch, "__code__", None)
        if code is not None:  # wrap_handle_tensordesc's closure over the C launcher
            cells = dict(zip(code.co_freevars,
                             (c.cell_contents for c in launch.__closure__ or ())))
            if not {"launcher", "tensordesc_indices", "tensordesc_meta"} <= cells.keys():
                return None
            launch, indices, meta = (cells["launcher"], cells["tensordesc_indices"],
                                     cells["tensordesc_meta"])
        expand = getattr(driver, "make_tensordesc_arg", None)
        if expand is None or getattr(launch, "__code__", None) is not None:
            return None
        return cls.build(launch, coop, pdl, n_varying, tail, late, indices, meta, expand)

    @classmethod
    def build(cls, launch: Callable[..., Any], coop: bool, pdl: bool, n_varying: int,
              tail: Sequence[Any], late: Sequence[int], indices: Any, meta: Sequence[Any],
              expand: Callable[[Any, Any], list[Any]]) -> RawLaunch | None:
        """:meth:`of` past Triton's objects: ``indices`` the positions of the kernel's
        tensor descriptors among all its arguments, ``meta`` their metadata in that order
        (empty: none, as ``wrap_handle_tensordesc`` reads it), ``expand`` Triton's
        ``make_tensordesc_arg``."""
        order = sorted(indices)
        if meta and len(meta) != len(order):
            return None

        def desc(i: int) -> Any:
            if i not in indices:
                return _PLAIN
            return meta[order.index(i)] if meta else None

        by_position = sorted(range(len(late)), key=lambda n: late[n])
        late_sorted = [late[n] for n in by_position]
        if any(desc(n_varying + j) is _PLAIN for j in late_sorted):
            return None  # only descriptors come late (the Gluon forward's output)
        parts: list[tuple[Any, ...]] = []
        chunk: list[Any] = []
        for j, value in enumerate(tail):
            d = desc(n_varying + j)
            if j in late_sorted:
                parts.append(tuple(chunk))
                chunk = []
            elif d is _PLAIN:
                chunk.append(value)
            else:
                chunk.extend(expand(value, d))
        parts.append(tuple(chunk))
        return cls(launch, coop, pdl, tuple(desc(i) for i in range(n_varying)), tuple(parts),
                   tuple(desc(n_varying + j) for j in late_sorted), tuple(by_position),
                   expand)

    def __call__(self, g0: int, g1: int, g2: int, stream: int, function: Any, packed: Any,
                 varying: Sequence[Any], late: Sequence[Any]) -> None:
        args = [g0, g1, g2, stream, function, self._coop, self._pdl, None, None, packed,
                None, None, None]
        encoded = self._encoded
        for slot, (value, d) in enumerate(zip(varying, self._varying)):
            if d is _PLAIN:
                args.append(value)
            else:
                args.extend(encoded(slot, value, d))
        parts = self._parts
        args.extend(parts[0])
        for n, (i, d) in enumerate(zip(self._late_order, self._late_meta)):
            args.extend(encoded(-1 - n, late[i], d))
            args.extend(parts[n + 1])
        self._launch(*args)

    def _encoded(self, slot: int, desc: Any, meta: Any) -> list[Any]:
        """Descriptor ``desc`` as the C launcher takes it (Triton's ``make_tensordesc_arg``).
        A device descriptor (``meta`` set: a CUDA tensor map encoded on the host, about a
        microsecond and a half a descriptor in Python and the driver) is kept by what it
        encodes: the slot, the base address, shape and strides (its element type, block
        and swizzle are the slot's metadata), so a call whose tensors sit where an earlier
        call's did (the caching allocator hands a layer's buffers out again) reuses the
        map, which the launcher copies into the kernel's parameters by value. Triton's
        host decomposition (``meta`` None) holds the tensor itself: built per call."""
        if meta is None:
            return self._expand(desc, meta)
        key = (slot, desc.base.data_ptr(), *desc.shape, *desc.strides)
        found = self._maps.get(key)
        if found is None:
            found = self._expand(desc, meta)
            if len(self._maps) >= _MAPS:
                self._maps.clear()
            self._maps[key] = found
        return found


_PLAIN = object()  # RawLaunch: an argument that is no tensor descriptor
_MAPS = 64  # RawLaunch: encoded descriptors kept per launch
