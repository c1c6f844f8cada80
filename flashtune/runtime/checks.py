"""Input checks for the public ops: every error names the argument and what was expected.

All checks read tensor metadata only (no device sync, no launch).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from flashtune.core.device import interpreting
from flashtune.core.errors import DeviceError, InputError, InputTypeError
from flashtune.core.problem import MAX_HEAD_DIM
from flashtune.kernel_templates.attn_decode.space import block_m, rows

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
# CUDA's limit on a launch grid's axes 1 and 2 (axis 0 takes 2**31 - 1)
MAX_GRID_YZ = 65535
# the device types whose launches have that limit (the Triton interpreter has none)
GRID_LIMITED_DEVICES = frozenset({"cuda"})


def _plainly_fine(q: Any, k: Any, v: Any, scale: Any) -> bool:
    """The common case, cheaply: plain CUDA tensors of one device and dtype, shapes and
    strides as required. False means "look closer", not "bad"."""
    if not (type(q) is type(k) is type(v) is torch.Tensor):
        return False
    if not (q.is_cuda and k.is_cuda and v.is_cuda
            and q.get_device() == k.get_device() == v.get_device()):
        return False
    dt = q.dtype
    if not (dt is k.dtype is v.dtype) or dt not in SUPPORTED_DTYPES:
        return False
    qs, ks = q.shape, k.shape
    if len(qs) != 4 or ks != v.shape or len(ks) != 4 or qs[0] != ks[0] or qs[3] != ks[3]:
        return False
    if qs[3] > MAX_HEAD_DIM or min(qs) < 1 or min(ks) < 1 or qs[1] % ks[1]:
        return False
    if q.stride(3) != 1 or k.stride(3) != 1 or v.stride(3) != 1:
        return False
    return scale is None or (type(scale) is float and math.isfinite(scale))


def autocast_inputs(q: Any, k: Any, v: Any) -> tuple[Any, Any, Any]:
    """``q, k, v`` as an autocast op of lower precision runs them (torch's SDPA is one):
    under autocast on their device, a float32 tensor in autocast's dtype (a rotary
    embedding in float32 hands attention float32 queries and keys); else as they are, for
    the price of ``q``'s dtype read.

    Arguments:
        q, k, v: the call's tensors (anything else is handed back for the checks).
    Returns:
        ``(q, k, v)``, cast or not.
    """
    if not isinstance(q, torch.Tensor) or q.dtype is not torch.float32 \
            or not torch.is_autocast_enabled(q.device.type):
        return q, k, v
    dtype = torch.get_autocast_dtype(q.device.type)
    cast = [t.to(dtype) if isinstance(t, torch.Tensor) and t.dtype is torch.float32 else t
            for t in (q, k, v)]
    return cast[0], cast[1], cast[2]


def check_attention_inputs(q: Any, k: Any, v: Any, scale: Any) -> None:
    """Raise a clear ``InputError``/``InputTypeError``/``DeviceError`` for bad inputs."""
    if _plainly_fine(q, k, v, scale):
        return
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise InputTypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise InputError(f"{name} must have 4 dimensions (batch, heads, seqlen, head_dim), "
                             f"got shape {tuple(t.shape)}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise InputTypeError(f"{name} must be float16 or bfloat16, got {t.dtype}")
        if t.numel() == 0:
            raise InputError(f"{name} is empty (shape {tuple(t.shape)}); every dimension must "
                             f"be >= 1")
        if t.stride(-1) != 1 and t.shape[-1] != 1:
            raise InputError(f"{name} must be contiguous in its last dimension (stride 1), got "
                             f"strides {tuple(t.stride())}; call .contiguous() first")
    if not (q.dtype == k.dtype == v.dtype):
        raise InputTypeError(f"q, k and v must share one dtype, got q {q.dtype}, k {k.dtype}, "
                             f"v {v.dtype}")
    if not (q.device == k.device == v.device):
        raise InputError(f"q, k and v must be on one device, got q {q.device}, k {k.device}, "
                         f"v {v.device}")
    if k.shape != v.shape:
        raise InputError(f"k and v must have the same shape (batch, heads_kv, seqlen_k, "
                         f"head_dim), got k {tuple(k.shape)} and v {tuple(v.shape)}")
    if q.shape[0] != k.shape[0]:
        raise InputError(f"batch mismatch: q has batch {q.shape[0]}, k/v have {k.shape[0]}")
    if q.shape[3] != k.shape[3]:
        raise InputError(f"head_dim mismatch: q has {q.shape[3]}, k/v have {k.shape[3]}")
    if q.shape[1] % k.shape[1]:
        raise InputError(f"q's heads ({q.shape[1]}) must be a multiple of k/v's heads "
                         f"({k.shape[1]}) for GQA/MQA")
    if q.shape[3] > MAX_HEAD_DIM:
        raise InputError(f"head_dim {q.shape[3]} is not supported: flashtune serves head dims "
                         f"1 to {MAX_HEAD_DIM} (FlashAttention-2's range)")
    if scale is not None:
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
            raise InputError(f"scale must be a finite float or None, got {scale!r}")
    if q.device.type == "cpu":
        if not interpreting():
            raise DeviceError("q, k and v are CPU tensors: flashtune runs on CPU only under the "
                              "Triton interpreter; set TRITON_INTERPRET=1 before importing "
                              "flashtune, or move the tensors to a CUDA device")
    elif q.device.type != "cuda":
        raise DeviceError(f"q, k and v are on {q.device}; flashtune needs CUDA tensors (or CPU "
                          f"tensors under TRITON_INTERPRET=1)")


def grid_problem(q: torch.Tensor, k: torch.Tensor, *, decode: bool = False) -> str | None:
    """Why the launch grid of a call would pass CUDA's :data:`MAX_GRID_YZ` on its axis 1
    or 2, or None when it fits (always None on devices without the limit, see
    :data:`GRID_LIMITED_DEVICES`). Metadata only.

    Axis 1 is ``batch * heads_q`` for attn_fwd and for attn_bwd's preprocess and dQ kernels
    (its dK/dV kernel's ``batch * heads_kv * splits`` and its reduction's
    ``batch * heads_kv`` are no larger), ``batch * heads_kv`` for attn_decode's split
    kernel, whose axis 2 counts the row tiles of a GQA group's ``group * seqlen_q`` query
    rows (its combine kernel and attn_bwd's fused kernel use axis 0 only).

    Arguments:
        q: ``(batch, heads_q, seqlen_q, head_dim)``.
        k: the keys ``(batch, heads_kv, ...)`` or the cache ``(..., heads_kv, ...)``.
        decode: the call runs attn_decode (else attn_fwd, and attn_bwd for its gradients).
    Returns:
        One sentence naming the sizes and what to do, or None.
    """
    if q.device.type not in GRID_LIMITED_DEVICES:
        return None
    batch, heads_q, seqlen_q = (int(n) for n in q.shape[:3])
    heads_kv = int(k.shape[1])
    heads, name = (heads_kv, "heads_kv") if decode else (heads_q, "heads_q")
    if batch * heads > MAX_GRID_YZ:
        fix = (f"split the batch into calls of at most {MAX_GRID_YZ // heads} sequences"
               if heads <= MAX_GRID_YZ else
               f"split the heads into calls of at most {MAX_GRID_YZ} {name}")
        return (f"batch x {name} = {batch} x {heads} = {batch * heads} programs on the "
                f"launch grid's axis 1, more than CUDA's limit of {MAX_GRID_YZ}; {fix}")
    if decode:
        group = heads_q // heads_kv
        bm = block_m(group, seqlen_q)
        tiles = -(-rows(group, seqlen_q) // bm)
        if tiles > MAX_GRID_YZ:
            return (f"seqlen_q x the GQA group = {seqlen_q} x {group} query rows per KV head "
                    f"make {tiles} row tiles on the launch grid's axis 2, more than CUDA's "
                    f"limit of {MAX_GRID_YZ}; pass at most {MAX_GRID_YZ * bm // group} "
                    f"queries per call")
    return None


def check_grid(q: torch.Tensor, k: torch.Tensor, *, decode: bool = False) -> None:
    """Raise ``InputError`` before any launch when the kernels' launch grid would pass
    CUDA's limit (:func:`grid_problem`); ``k`` is the keys or the cache. Metadata only."""
    reason = grid_problem(q, k, decode=decode)
    if reason is not None:
        raise InputError(reason)


def check_score_mods(q: torch.Tensor, *, causal: bool, window: Any, softcap: Any,
                     alibi_slopes: Any, batch: int | None = None
                     ) -> tuple[tuple[int, int], float | None, torch.Tensor | None]:
    """The score modifications checked and normalised: ``((left, right), softcap,
    slopes)``, ``right`` 0 when ``causal``, ``softcap`` None when off (None or 0.0, as
    FlashAttention-2's default), slopes float32 and contiguous. Raises InputError /
    InputTypeError naming the argument. ``batch`` is a packed batch's (q then
    ``(total, heads, head_dim)``). Shared by :func:`flashtune.attention`,
    :func:`flashtune.attention_varlen` and :func:`flashtune.attention_with_kvcache`."""
    left, right = -1, -1
    if window is not None:
        if not isinstance(window, (tuple, list)) or len(window) != 2 or any(
                isinstance(w, bool) or not isinstance(w, int) for w in window):
            raise InputTypeError(f"window must be a pair of ints (left, right), -1 for "
                                 f"unbounded, got {window!r}")
        left, right = int(window[0]), int(window[1])
        if left < -1 or right < -1:
            raise InputError(f"window {tuple(window)}: each bound must be >= 0, or -1 for "
                             f"unbounded on that side")
    if causal:
        right = 0
    cap: float | None = None
    if softcap is not None:
        if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) \
                or not math.isfinite(softcap) or softcap < 0:
            raise InputError(f"softcap must be a positive finite number (or None / 0.0 for "
                             f"none), got {softcap!r}")
        cap = float(softcap) or None
    slopes = None
    if alibi_slopes is not None:
        if not isinstance(alibi_slopes, torch.Tensor):
            raise InputTypeError(f"alibi_slopes must be a torch.Tensor, got "
                                 f"{type(alibi_slopes).__name__}")
        if alibi_slopes.dtype != torch.float32:
            raise InputTypeError(f"alibi_slopes must be float32, got {alibi_slopes.dtype}")
        heads = q.shape[-2] if batch is not None else q.shape[1]
        b = batch if batch is not None else q.shape[0]
        if tuple(alibi_slopes.shape) not in ((heads,), (b, heads)):
            raise InputError(f"alibi_slopes must have shape ({heads},) or ({b}, {heads}) "
                             f"(heads_q, or batch x heads_q), got {tuple(alibi_slopes.shape)}")
        if alibi_slopes.device != q.device:
            raise InputError(f"alibi_slopes is on {alibi_slopes.device}, q on {q.device}; "
                             f"they must share a device")
        slopes = alibi_slopes.contiguous()
    return (left, right), cap, slopes
