"""A launch plan for one call signature of the Gluon forward: what the runtime replays after
a shape's first call, as :class:`~flashtune.kernel_templates.attn_fwd.plan.AttnFwdPlan` does
for ``attn_fwd``.

:func:`~flashtune.kernel_templates.attn_fwd_gluon.launcher.attn_fwd_gluon` checks the
inputs, asks the device's capability, builds three or four validated TMA descriptors, plans
the persistent grid and binds some 25 arguments through ``JITFunction.run`` on every call:
about 150 us of host time on an H200 (``bench --dispatch``, a decode-like call routed to
this kernel), seven times an SDPA call's. Between two calls of one signature (the runtime's
plan key: shapes, strides, dtypes, device, 16-byte alignment) only the tensors' addresses
change, so :class:`AttnFwdGluonPlan` does all of that once, from the first call, through
``kernel_args`` (the function the launcher and the precompiler use, so the plan runs exactly
the kernel the launcher would), and a later call allocates ``out`` (and ``lse`` where it
returns it: the kernel always writes one, and a call that does not want it writes the
plan's, :class:`~flashtune.kernel_templates.direct.Scratch`) and hands them, with the
tensors its descriptors read (their geometry is the first call's, which the plan key
fixes), to the compiled kernel.

It plans only what the launcher runs without a copy or a rewrite: q, k, v in a TMA-readable
layout (K and V in the same one), a non-negative scale, at least one query and one key, and
no window or the causal sliding window the kernel serves, with or without a softcap (a
score-modified call's plan: :mod:`flashtune.runtime.scored`). Anything else raises
(ValueError, or the launcher's own error for inputs it refuses) and the runtime keeps
calling the launcher.

Not part of the template's source hash: it changes how the kernel is launched, not which
code is generated.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from flashtune.core.mods import causal_window_left, softcap_value
from flashtune.kernel_templates.attn_fwd_gluon.kernel import gluon_attn_fwd_kernel
from flashtune.kernel_templates.attn_fwd_gluon.launcher import (
    _check,
    kernel_args,
    layout,
)
from flashtune.kernel_templates.direct import DirectLaunch, Scratch

__all__ = ["AttnFwdGluonPlan"]

_VARYING = 5  # q_desc, k_desc, v_desc, o_ptr, lse_ptr; o_desc (TMA_STORE) comes later


class AttnFwdGluonPlan:
    """Replays ``attn_fwd_gluon(q, k, v, config, causal=, scale=, return_lse=, window=,
    softcap=)`` for CUDA tensors like the ones it was built from; call it as ``plan(q, k, v,
    stream)``.

    Building compiles the kernel if Triton's cache lacks it; do it with the tensors' device
    current (``device_index``), and call the plan only while that device is current.

    Raises:
        What the launcher raises for inputs it refuses (InputError, InputTypeError,
        ConfigError, DeviceError), and ValueError ("no plan") for a call the launcher
        would copy or rewrite first (see the module doc).
    """

    __slots__ = ("device_index", "_launch", "_lse_shape", "_device", "_return_lse",
                 "_o_desc", "_scratch")

    def __init__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 config: Mapping[str, int], *, causal: bool, scale: float | None,
                 return_lse: bool, window: tuple[int, int] = (-1, -1),
                 softcap: float | None = None) -> None:
        left = causal_window_left(window, causal, "the Gluon forward", "attn_fwd")
        cap = softcap_value(softcap)
        _check(q, k, v, config)
        q_how, kv_how = layout(q), layout(k)
        if q_how is None or kv_how is None or layout(v) != kv_how:
            raise ValueError("the launcher copies these inputs: no plan")
        batch, heads_q, seqlen_q, head_dim = q.shape
        if q.numel() == 0 or k.shape[2] == 0:
            raise ValueError("nothing to launch: no plan")
        scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
        if scale < 0:
            raise ValueError("a negative scale runs on -k (a copy): no plan")
        self.device_index = q.get_device()
        self._device, self._return_lse = q.device, bool(return_lse)
        self._lse_shape = (batch, heads_q, seqlen_q)
        out = torch.empty_like(q)
        lse = torch.empty(self._lse_shape, device=q.device, dtype=torch.float32)
        if layout(out) != q_how:
            raise ValueError("out would not be in q's layout: no plan")
        args, kwargs, grid = kernel_args(q, k, v, out, lse, config, causal=causal,
                                         scale=scale, window_left=left, softcap=cap)
        self._o_desc = "o_desc" in kwargs
        # the kernel always writes the LSE: a call that does not return it writes the kept one
        self._scratch = None if return_lse else Scratch(self.device_index, (lse,))
        with torch.cuda.device(self.device_index):
            self._launch = DirectLaunch(gluon_attn_fwd_kernel, args, kwargs, grid, _VARYING,
                                        late=("o_desc",) if self._o_desc else ())

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 stream: int) -> Any:
        out = torch.empty_like(q)  # q's strides: the plan key holds them
        kept = self._scratch.get(stream) if self._scratch is not None else None
        lse = kept[0] if kept is not None else torch.empty(
            self._lse_shape, device=self._device, dtype=torch.float32)
        varying = (q, k, v, out, lse)  # the descriptors' bases: the build call's geometry
        if self._o_desc:
            self._launch.with_late(stream, varying, (out,))
        else:
            self._launch(stream, *varying)
        return (out, lse) if self._return_lse else out
