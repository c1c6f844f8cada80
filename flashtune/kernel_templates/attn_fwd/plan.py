"""A launch plan for one attn_fwd call signature: what the runtime replays after a shape's
first call.

:class:`AttnFwdPlan` is built from one real call (tensors, config, causal, scale,
return_lse) and launches the same compiled kernel for later calls whose tensors have the same
shapes, strides, dtypes, device and 16-byte alignment (the caller's key), allocating the
output per call and nothing else (the host TMA descriptors keep the build call's shapes and
strides: a call passes their base tensors). The output lies in q's layout, as the Gluon
forward's plan writes it: transformers hands q as a ``(B, N, H, D)`` projection viewed per
head and transposes the output back, which is then a view where a contiguous output cost a
copy (a Phi-3 prefill at 8192 tokens: 0.12 ms a layer, the kernel's 0.92). Arguments come from
:func:`~flashtune.kernel_templates.attn_fwd.launcher.kernel_args`, the function the launcher
and the precompiler use, so the plan runs exactly the kernel ``attn_fwd`` would.

A head dim the launcher runs padded (``tma.pads_head_dim``: not a multiple of 8, on a GPU)
is planned padded too: per call one copy launch per input pads it
(``tma.pad_head_dim``'s kernel), the attention kernel runs on the padded tensors as the
launcher would run it, and one copy launch cuts the output back, all through
:class:`~flashtune.kernel_templates.direct.DirectLaunch` (no Triton binding per call).

Not part of the template's source hash: it changes how a kernel is launched, not which code
is generated.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from flashtune.kernel_templates.attn_fwd.kernel import attn_fwd_kernel
from flashtune.kernel_templates.attn_fwd.launcher import kernel_args, tma_ok
from flashtune.kernel_templates.direct import DirectLaunch
from flashtune.kernel_templates.tma import (
    copy_cols_launch,
    pad_head_dim,
    padded_head_dim,
    pads_head_dim,
)

__all__ = ["AttnFwdPlan"]

_VARYING = 9  # Q, K, V, Out, Lse, desc_q, desc_k, desc_v, desc_o
# SPLIT_D's second tile's descriptors (after every other argument): they change per call too
_LATE = ("desc_q1", "desc_k1", "desc_v1", "desc_o1")
_CONTIGUOUS = torch.contiguous_format


class AttnFwdPlan:
    """Replays ``attn_fwd(q, k, v, config, causal=, scale=, return_lse=, window=,
    softcap=)`` for CUDA tensors like the ones it was built from (a window and a softcap
    are scalars bound at build, as the config is); call it as ``plan(q, k, v, stream)``.

    Building compiles the kernel if Triton's cache lacks it; do it with the tensors' device
    current (``device_index``), and call the plan only while that device is current.
    """

    __slots__ = ("device_index", "_launch", "_lse_shape", "_dtype", "_device",
                 "_tma", "_late", "_return_lse", "_pads", "_unpad", "_narrow_shape")

    def __init__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 config: Mapping[str, int], *, causal: bool, scale: float | None,
                 return_lse: bool, window: tuple[int, int] = (-1, -1),
                 softcap: float | None = None) -> None:
        if q.device.type != "cuda":
            raise ValueError("launch plans are for CUDA tensors")
        batch, heads_q, seqlen_q, head_dim = q.shape
        if scale is None:
            scale = 1.0 / math.sqrt(head_dim)
        self.device_index = q.get_device()
        self._pads: tuple[tuple[DirectLaunch, tuple[int, ...]], ...] | None = None
        self._unpad: DirectLaunch | None = None
        self._narrow_shape = q.shape
        if pads_head_dim(q):  # as the launcher runs it: padded, the true head dim's scale
            width = padded_head_dim(head_dim)
            wide = tuple(pad_head_dim(t, width) for t in (q, k, v))
            with torch.cuda.device(self.device_index):
                self._pads = tuple((_direct(copy_cols_launch(t, w, head_dim, width)),
                                    tuple(w.shape)) for t, w in zip((q, k, v), wide))
            q, k, v = wide
            head_dim = width
        self._device, self._dtype, self._return_lse = q.device, q.dtype, bool(return_lse)
        self._lse_shape = (batch, heads_q, seqlen_q)
        out = torch.empty_like(q)  # q's layout (contiguous where q is padded: a new tensor)
        lse = (torch.empty(self._lse_shape, dtype=torch.float32, device=q.device)
               if return_lse else None)
        use_tma = bool(config.get("USE_TMA", 0)) and tma_ok(q, k, v, out)
        args, kwargs, grid = kernel_args(q, k, v, out, lse, config, causal=causal, scale=scale,
                                         use_tma=use_tma, upcast_dot=False, window=window,
                                         softcap=softcap)
        self._tma = use_tma
        # two head-dim tiles by TMA: the second tile's descriptors are bound per call too
        self._late = use_tma and bool(kwargs["BLOCK_D1"])
        with torch.cuda.device(self.device_index):
            self._launch = DirectLaunch(attn_fwd_kernel, args, kwargs, grid, _VARYING,
                                        late=_LATE if self._late else ())
            if self._pads is not None:
                narrow = torch.empty(self._narrow_shape, dtype=q.dtype, device=q.device)
                self._unpad = _direct(copy_cols_launch(out, narrow, head_dim,
                                                       self._narrow_shape[-1]))

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 stream: int) -> Any:
        if self._pads is None:
            return self._run(q, k, v, stream)
        wide = []
        for t, (pad, shape) in zip((q, k, v), self._pads):
            w = torch.empty(shape, dtype=self._dtype, device=self._device)
            pad(stream, t, w)
            wide.append(w)
        got = self._run(wide[0], wide[1], wide[2], stream)
        out_wide, lse = got if isinstance(got, tuple) else (got, None)
        # of _narrow_shape, contiguous: the unpad launch was built for that layout
        out = torch.empty_like(q, memory_format=_CONTIGUOUS)
        unpad = self._unpad
        if unpad is None:  # pragma: no cover - set with _pads
            raise RuntimeError("a padded plan without its unpad launch")
        unpad(stream, out_wide, out)
        return (out, lse) if lse is not None else out

    def _run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, stream: int) -> Any:
        # q's dtype, shape and layout (the build call's: the plan's key holds q's strides;
        # where q is padded, a contiguous copy); empty_like parses fewer arguments than
        # torch.empty, a microsecond less a call
        out = torch.empty_like(q)
        lse = (torch.empty(self._lse_shape, dtype=torch.float32, device=self._device)
               if self._return_lse else None)
        if self._late:  # the descriptors' bases: their geometry is the build call's
            self._launch.with_late(stream, (q, k, v, out, out if lse is None else lse,
                                            q, k, v, out), (q, k, v, out))
        elif self._tma:
            self._launch(stream, q, k, v, out, out if lse is None else lse, q, k, v, out)
        else:
            self._launch(stream, q, k, v, out, out if lse is None else lse,
                         None, None, None, None)
        return (out, lse) if lse is not None else out


def _direct(launch: Any) -> DirectLaunch:
    """A :class:`DirectLaunch` of a copy launch (``tma.copy_cols_launch``: its two leading
    tensors vary per call)."""
    if launch is None:
        raise ValueError("launch plans are for non-empty tensors")
    kernel, args, kwargs, grid = launch
    return DirectLaunch(kernel, args, kwargs, grid, 2)
