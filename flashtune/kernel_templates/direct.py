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
alignment of every pointer (the runtime's plan key holds all of these). A tensor descriptor
among the arguments that change per call keeps the shape and strides of the build call's
(the plan key fixes them too), so a call passes only its base tensor: the descriptor's
expansion into the launcher's arguments is built once (Triton's host decomposition) or kept
per base address (a device descriptor's encoded tensor map), with no descriptor object and
no validation per call.

This uses Triton internals that are stable in 3.x (``CompiledKernel.run``, ``function``,
``packed_metadata``, ``JITFunction.arg_names``/``params``); :func:`supported` says whether this
Triton has them, and the runtime falls back to ``kernel[grid]`` when not, or when a launch hook
(e.g. the Proton profiler) is installed.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from triton import knobs

__all__ = ["DirectLaunch", "HostDesc", "Scratch", "current_device", "current_stream",
           "hooks_installed", "supported"]


def _torch_current_stream(index: int) -> int:
    return int(torch.cuda.current_stream(index).cuda_stream)


# what Triton's own launch path calls (CUDA builds of torch; CPU builds build no plans)
current_device: Callable[[], int] = getattr(torch._C, "_cuda_getDevice",
                                            torch.cuda.current_device)
current_stream: Callable[[int], int] = getattr(torch._C, "_cuda_getCurrentRawStream",
                                               _torch_current_stream)
capturing: Callable[[], bool] = torch.cuda.is_current_stream_capturing


class Scratch:
    """Buffers a plan's own launches write and read within one call and nobody reads after
    it (a discarded LSE, split-KV partials), kept from the build call and handed out again
    to the calls made on the same stream from the same thread: those run in launch order,
    so one call's kernels are done with the buffers before the next call's touch them.
    Any other call (another stream, or another thread, whose launches may interleave) gets
    None and allocates its own, and so does every call under CUDA-graph capture (a graph
    must not hold buffers that the plan frees, nor share them with eager calls it may run
    beside) and a plan built under capture or whose buffers would hold more than ``limit``
    bytes. Freed with the plan, on the build stream, where all their uses were ordered.

    Arguments:
        device_index: the CUDA device whose current stream the build call runs on.
        buffers: the build call's buffers.
        limit: the most bytes kept.
    """

    __slots__ = ("buffers", "_stream", "_thread")

    def __init__(self, device_index: int, buffers: tuple[torch.Tensor, ...],
                 limit: int = 8 << 20) -> None:
        kept = (sum(t.numel() * t.element_size() for t in buffers) <= limit
                and not capturing())
        self.buffers = buffers if kept else None
        self._stream = current_stream(device_index) if kept else -1
        self._thread = threading.get_ident()

    def get(self, stream: int) -> tuple[torch.Tensor, ...] | None:
        """The kept buffers for a call on ``stream`` from this thread, else None."""
        if stream == self._stream and threading.get_ident() == self._thread \
                and not capturing():
            return self.buffers
        return None


class HostDesc:
    """What Triton's CUDA launcher reads from a host ``TensorDescriptor``: the base tensor,
    its shape and strides (lists) and the padding mode (validated when the plan was built:
    block shape, alignment)."""

    __slots__ = ("base", "shape", "strides", "padding")

    def __init__(self, base: Any, shape: list[int], strides: list[int],
                 padding: str = "zero") -> None:
        self.base, self.shape, self.strides, self.padding = base, shape, strides, padding


def _geometry(value: Any) -> tuple[list[int], list[int], str] | None:
    """A tensor descriptor's (shape, strides, padding) -- Triton's or Gluon's
    ``TensorDescriptor``, or a :class:`HostDesc` --; None for any other argument."""
    if isinstance(value, torch.Tensor) or not all(
            hasattr(value, a) for a in ("base", "shape", "strides", "padding")):
        return None
    return ([int(x) for x in value.shape], [int(x) for x in value.strides],
            str(value.padding))


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
        n_varying: how many leading positional arguments change per call (tensors, tensor
            descriptors); the rest are fixed.
        late: names of arguments past the leading ones that change per call too (a
            keyword tensor or descriptor); pass them to :meth:`with_late`.
    A call passes the changing arguments in the build call's order, each tensor descriptor
    as its base tensor alone: the descriptor keeps the build call's shape, strides and
    padding. The kernel is compiled now if Triton's cache does not have it (in the current
    CUDA device's context: build under ``torch.cuda.device(...)`` of the tensors' device).
    """

    __slots__ = ("grid", "tail", "_late", "_run", "_function", "_packed", "_raw", "_descs",
                 "_late_descs")

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
        # per changing argument: the build call's descriptor geometry, or None (no descriptor)
        self._descs = tuple(_geometry(a) for a in full[:n_varying])
        self._late_descs = tuple(_geometry(self.tail[i]) for i in self._late)
        g = tuple(grid) + (1, 1)
        self.grid = (int(g[0]), int(g[1]), int(g[2]))
        self._run = compiled.run
        self._function = compiled.function
        self._packed = compiled.packed_metadata
        self._raw = RawLaunch.of(compiled.run, full[:n_varying], self.tail, self._late)

    def __call__(self, stream: int, *varying: Any) -> None:
        g0, g1, g2 = self.grid
        if self._raw is not None:
            self._raw(g0, g1, g2, stream, self._function, self._packed, varying, ())
            return
        if any(self._descs):
            varying = tuple(_described(varying, self._descs))
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
        for i, value in zip(self._late, _described(late, self._late_descs)):
            tail[i] = value
        self._run(g0, g1, g2, stream, self._function, self._packed, None, None, None,
                  *_described(varying, self._descs), *tail)


def _described(values: Sequence[Any],
               descs: Sequence[tuple[list[int], list[int], str] | None]) -> list[Any]:
    """``values`` as Triton's launcher takes them: each base tensor of a descriptor slot
    wrapped in a :class:`HostDesc` of the slot's geometry."""
    return [v if d is None else HostDesc(v, *d) for v, d in zip(values, descs)]


class RawLaunch:
    """Triton's compiled C launcher called with the argument list Triton's Python layer
    would build for it, that list's fixed part built once.

    Triton 3.6's CUDA launcher (``CompiledKernel.run``, a ``CudaLauncher``) is a Python
    object whose call allocates the scratch buffers a kernel may need and, for a kernel with
    host tensor descriptors, goes through a closure (``wrap_handle_tensordesc``) that walks
    every argument to expand each descriptor into the C launcher's arguments; for attn_fwd's
    40 arguments that walk was most of a planned call's host time on an H200 (``driver.py``'s
    ``inner``: 11 of the plan's 20 us under cProfile). Here the fixed arguments are expanded
    once, and so is every changing descriptor past its base tensor: Triton's host
    decomposition (no metadata) is the base followed by shape and strides that the plan
    fixes, and a device descriptor (a CUDA tensor map, encoded on the host) is encoded by
    Triton's own ``make_tensordesc_arg`` once per slot and base address (see
    :class:`_DeviceDesc`). :meth:`of` answers None (the caller keeps
    ``CompiledKernel.run``) unless the launcher is that object as this code knows it and
    the kernel needs no scratch memory.
    """

    __slots__ = ("_launch", "_coop", "_pdl", "_varying", "_parts", "_late_kinds",
                 "_late_order")

    def __init__(self, launch: Callable[..., Any], coop: bool, pdl: bool,
                 varying: tuple[Any, ...], parts: tuple[tuple[Any, ...], ...],
                 late_kinds: tuple[Any, ...], late_order: tuple[int, ...]) -> None:
        self._launch, self._coop, self._pdl = launch, coop, pdl
        # per leading argument: _PLAIN; a host descriptor's fixed expansion past its base
        # (a tuple); or a _DeviceDesc
        self._varying = varying
        # the fixed arguments as the C launcher takes them, split where a late one goes:
        # parts[0], late[0], parts[1], ... (late in position order)
        self._parts = parts
        self._late_kinds = late_kinds  # the late descriptors' kinds, in position order
        self._late_order = late_order  # the caller's late values, reordered by position

    @classmethod
    def of(cls, run: Any, lead: Sequence[Any], tail: Sequence[Any],
           late: Sequence[int]) -> RawLaunch | None:
        """The raw launch of ``run`` (a compiled kernel's ``run``) for a kernel built with
        the leading arguments ``lead`` (they change per call) and then ``tail``, whose
        positions ``late`` (in the order the caller passes their values) change too; or
        None."""
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
        return cls.build(launch, coop, pdl, lead, tail, late, indices, meta, expand)

    @classmethod
    def build(cls, launch: Callable[..., Any], coop: bool, pdl: bool, lead: Sequence[Any],
              tail: Sequence[Any], late: Sequence[int], indices: Any, meta: Sequence[Any],
              expand: Callable[[Any, Any], list[Any]]) -> RawLaunch | None:
        """:meth:`of` past Triton's objects: ``indices`` the positions of the kernel's
        tensor descriptors among all its arguments, ``meta`` their metadata in that order
        (empty: none, as ``wrap_handle_tensordesc`` reads it), ``expand`` Triton's
        ``make_tensordesc_arg``."""
        order = sorted(indices)
        if meta and len(meta) != len(order):
            return None
        n_varying = len(lead)

        def kind(i: int, value: Any) -> Any:
            """How argument ``i`` (built as ``value``) changes per call."""
            if i not in indices:
                return _PLAIN
            geometry = _geometry(value)
            if geometry is None:
                return None
            d = meta[order.index(i)] if meta else None
            if d is not None:
                return _DeviceDesc(d, geometry, expand)
            expanded = expand(HostDesc(_BASE, *geometry), None)
            if not expanded or expanded[0] is not _BASE or _BASE in expanded[1:]:
                return None  # a decomposition not as this code knows it
            return tuple(expanded[1:])

        varying = tuple(kind(i, value) for i, value in enumerate(lead))
        by_position = sorted(range(len(late)), key=lambda n: late[n])
        late_sorted = [late[n] for n in by_position]
        late_kinds = tuple(kind(n_varying + j, tail[j]) for j in late_sorted)
        if None in varying or any(k is _PLAIN or k is None for k in late_kinds):
            return None  # only descriptors come late (the Gluon forward's output)
        parts: list[tuple[Any, ...]] = []
        chunk: list[Any] = []
        for j, value in enumerate(tail):
            if j in late_sorted:
                parts.append(tuple(chunk))
                chunk = []
            elif n_varying + j not in indices:
                chunk.append(value)
            else:
                chunk.extend(expand(value, meta[order.index(n_varying + j)] if meta
                                    else None))
        parts.append(tuple(chunk))
        return cls(launch, coop, pdl, varying, tuple(parts), late_kinds, tuple(by_position))

    def __call__(self, g0: int, g1: int, g2: int, stream: int, function: Any, packed: Any,
                 varying: Sequence[Any], late: Sequence[Any]) -> None:
        """Launch with ``varying`` (the leading arguments, a descriptor's base tensor in
        its slot) and ``late`` (the late descriptors' base tensors)."""
        args = [g0, g1, g2, stream, function, self._coop, self._pdl, None, None, packed,
                None, None, None]
        for value, k in zip(varying, self._varying):
            if k is _PLAIN:
                args.append(value)
            elif k.__class__ is tuple:
                args.append(value)
                args.extend(k)
            else:
                args.extend(k.encoded(value))
        parts = self._parts
        args.extend(parts[0])
        for n, (i, k) in enumerate(zip(self._late_order, self._late_kinds)):
            if k.__class__ is tuple:
                args.append(late[i])
                args.extend(k)
            else:
                args.extend(k.encoded(late[i]))
            args.extend(parts[n + 1])
        self._launch(*args)


class _DeviceDesc:
    """A changing device descriptor of a :class:`RawLaunch`: its metadata (element type,
    block, swizzle) and the plan's fixed geometry. Encoding one (``make_tensordesc_arg``: a
    CUDA tensor map built in Python and the driver, about a microsecond and a half) depends
    on nothing else than the base address then, so the encoded arguments are kept by base
    address (at most ``_MAPS``, then the cache starts again): a call whose tensors sit where
    an earlier call's did (the caching allocator hands a layer's buffers out again) reuses
    the map, which the launcher copies into the kernel's parameters by value."""

    __slots__ = ("_meta", "_geometry", "_expand", "_maps")

    def __init__(self, meta: Any, geometry: tuple[list[int], list[int], str],
                 expand: Callable[[Any, Any], list[Any]]) -> None:
        self._meta, self._geometry, self._expand = meta, geometry, expand
        self._maps: dict[int, list[Any]] = {}

    def encoded(self, base: Any) -> list[Any]:
        ptr = base.data_ptr()
        found = self._maps.get(ptr)
        if found is None:
            found = self._expand(HostDesc(base, *self._geometry), self._meta)
            if len(self._maps) >= _MAPS:
                self._maps.clear()
            self._maps[ptr] = found
        return found


_PLAIN = object()  # RawLaunch: an argument that is no tensor descriptor
_BASE = object()  # RawLaunch.build: the stand-in base of a host descriptor's expansion
_MAPS = 64  # _DeviceDesc: encoded descriptors kept per slot
