"""``flashtune.scaled_dot_product_attention``: torch's SDPA signature and semantics, served by
flashtune where it can and by torch where it cannot.

Semantics are torch's, not flashtune's: ``is_causal`` is aligned top-left (query ``i`` sees
keys ``j <= i``, whatever the lengths), and ``enable_gqa`` must be set for
``Hq != Hkv``; ``dropout_p`` is applied whenever it is > 0, as torch does (flashtune's own
mask, drawn from torch's generator: see :func:`flashtune.attention`). A call flashtune does
not serve (an unsupported dtype or head_dim, a mask it does not recognise, a ``dropout_p``
outside ``[0, 1)``, ...) runs ``torch.nn.functional.scaled_dot_product_attention``
with the same arguments; the first fallback of each reason is logged once at DEBUG level on
the ``flashtune`` logger, so ``logging.getLogger("flashtune").setLevel("DEBUG")`` shows why
a model does not run on flashtune, and every fallback is counted by reason
(:func:`fallback_counts`; ``flashtune bench --model`` prints them). :func:`describe_route`
says where one call would go without running it.

How top-left causal maps to flashtune's bottom-right kernel: with ``Lq <= Lk`` no query
sees a key past ``Lq - 1``, so the call runs on the first ``Lq`` keys, where both alignments
agree. ``Lq > Lk`` with ``is_causal`` (rows past ``Lk`` see every key) falls back.

Boolean masks (``is_causal`` False, with or without dropout) flashtune serves, as
:mod:`flashtune.runtime.sdpa_masks` recognises them, the same for every head:

* a causal or local-window pattern, broadcast over batch and heads: the mask equals
  :func:`~flashtune.kernel_templates.attn_fwd.reference.visible` ``(Lq, Lk, window=(left,
  right))``, bottom-right aligned as flashtune's ``causal`` and ``window`` are (a top-left
  ``tril`` with ``Lq != Lk`` is such a pattern only where it equals one, else it falls
  back), runs as :func:`flashtune.attention` with ``causal``/``window``; an all-True mask
  as plain attention;
* key padding, ``(B, 1, 1, Lk)`` or ``(B, 1, Lq, Lk)`` with equal rows, keeping one
  contiguous run of keys per batch element (left or right padding), runs as a packed batch
  through :func:`~flashtune.runtime.scored.varlen`.

A mask under which some query sees no key (an all-False batch element, say) goes to torch,
which decides what such rows give; so do float (additive) masks, masks that differ between
heads, any other pattern, and masks under ``torch.compile`` or CUDA graph capture. A mask is
recognised by reading it on the device once per mask object (memoised on its identity and
version counter): the layers of a model passing one mask tensor pay that read once, and a
call without a mask pays nothing for any of this.
"""

from __future__ import annotations

import logging
import math
import threading
from collections import Counter
from typing import Any

import torch

from flashtune.core.device import interpreting
from flashtune.core.problem import MAX_HEAD_DIM, AttentionProblem, dtype_name
from flashtune.runtime.checks import MAX_GRID_YZ, SUPPORTED_DTYPES, autocast_inputs, grid_problem
from flashtune.runtime.ops import attention, lookup_config
from flashtune.runtime.scored import lookup_varlen
from flashtune.runtime.sdpa_masks import KeyPadding, Window, mask_verdict

log = logging.getLogger(__name__)

__all__ = ["describe_route", "fallback_counts", "fallback_reason", "reset_fallback_counts",
           "scaled_dot_product_attention"]

_LOGGED: set[str] = set()
_COUNTS: Counter[str] = Counter()  # fallbacks by reason, since the last reset
_LOCK = threading.Lock()


def fallback_counts() -> dict[str, int]:
    """How many calls of :func:`scaled_dot_product_attention` went to torch, by reason.

    Returns:
        ``{reason: calls}`` (the reason as :func:`fallback_reason` words it) since the
        process started or the last :func:`reset_fallback_counts`; a copy, the caller's to
        change. Calls flashtune serves are not counted (their path pays nothing for this).
    """
    with _LOCK:
        return dict(_COUNTS)


def reset_fallback_counts() -> None:
    """Start :func:`fallback_counts` from zero."""
    with _LOCK:
        _COUNTS.clear()


_Tensor = torch.Tensor
_DTYPES = frozenset(SUPPORTED_DTYPES)


def _served(query: Any, key: Any, value: Any, attn_mask: Any, dropout_p: float,
            is_causal: bool, scale: Any, enable_gqa: bool) -> bool:
    """True only where :func:`_reason`'s checks all pass, for CUDA tensors on one device, in
    a few metadata reads (the checks one by one cost about 10 us a call in Python); False
    leaves the verdict and its reason to them."""
    if attn_mask is not None or dropout_p or type(query) is not _Tensor \
            or type(key) is not _Tensor or type(value) is not _Tensor:
        return False
    qs, ks = query.shape, key.shape
    if len(qs) != 4 or len(ks) != 4 or value.shape != ks:
        return False
    b, hq, lq, e = qs
    bk, hkv, lk, ek = ks
    dev = query.get_device()
    return (b == bk and e == ek and b > 0 and hq > 0 and lq > 0 and hkv > 0 and lk > 0
            and e <= MAX_HEAD_DIM and query.dtype in _DTYPES and key.dtype == query.dtype
            and value.dtype == query.dtype and dev >= 0 and query.is_cuda
            and key.get_device() == dev and value.get_device() == dev and key.is_cuda
            and value.is_cuda and (hq == hkv or (enable_gqa and hq % hkv == 0))
            and query.stride(-1) == 1 and key.stride(-1) == 1 and value.stride(-1) == 1
            and (scale is None or (type(scale) is float and math.isfinite(scale)))
            and not (is_causal and lq > lk) and b * hq <= MAX_GRID_YZ)


def fallback_reason(query: Any, key: Any, value: Any, attn_mask: Any = None,
                    dropout_p: float = 0.0, is_causal: bool = False, scale: Any = None,
                    enable_gqa: bool = False) -> str | None:
    """Why :func:`scaled_dot_product_attention` would hand these arguments to torch.

    Arguments:
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa: the
            arguments of :func:`scaled_dot_product_attention`, of any type (nothing is
            assumed about them).
    Returns:
        One line saying why torch's SDPA runs the call (e.g. ``"dropout_p > 0"``), or None
        when flashtune serves it. Reads metadata only (no device sync, no launch), except
        for an ``attn_mask`` not seen before, which is read once to recognise it (the
        module doc).
    """
    if _served(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
        return None  # the common case, every call of a model's attention: a few reads
    return _reason(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


def _reason(query: Any, key: Any, value: Any, attn_mask: Any, dropout_p: float,
            is_causal: bool, scale: Any, enable_gqa: bool) -> str | None:
    """:func:`fallback_reason`'s checks, one by one (the first that fails names it)."""
    found = _decide(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    return found if isinstance(found, str) else None


def _decide(query: Any, key: Any, value: Any, attn_mask: Any, dropout_p: float,
            is_causal: bool, scale: Any, enable_gqa: bool) -> str | Window | KeyPadding | None:
    """:func:`_reason`'s checks; where they pass, None for a call without a mask, else the
    pattern flashtune serves the mask as."""
    if dropout_p and not (type(dropout_p) in (int, float) and 0 <= dropout_p < 1):
        return "a dropout_p that is not a number in [0, 1)"
    if not all(type(t) is torch.Tensor for t in (query, key, value)):
        return "an input is not a plain torch.Tensor"
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        return "inputs are not 4-D (batch, heads, seqlen, head_dim)"
    if not (query.dtype == key.dtype == value.dtype) or query.dtype not in SUPPORTED_DTYPES:
        return f"dtype {query.dtype} (flashtune runs float16/bfloat16)"
    if not (query.device == key.device == value.device):
        return "inputs on several devices"
    if query.device.type != "cuda" and not (query.device.type == "cpu" and interpreting()):
        return f"device {query.device} (flashtune runs CUDA, or CPU under TRITON_INTERPRET=1)"
    (b, hq, lq, e), (bk, hkv, lk, ek) = query.shape, key.shape
    if tuple(value.shape) != (bk, hkv, lk, ek) or b != bk or e != ek:
        return "shapes other than q (B, Hq, Lq, E), k and v (B, Hkv, Lk, E) (broadcast or Ev != E)"
    if min(b, hq, lq, e, hkv, lk) == 0:
        return "an empty input"
    if hq != hkv and not enable_gqa:
        return "Hq != Hkv without enable_gqa (torch raises)"
    if hq % hkv:
        return "Hq is not a multiple of Hkv"
    if e > MAX_HEAD_DIM:
        return f"head_dim {e} (flashtune serves 1 to {MAX_HEAD_DIM})"
    if query.stride(-1) != 1 or key.stride(-1) != 1 or value.stride(-1) != 1:
        return "a last dimension that is not contiguous"
    if scale is not None and not (isinstance(scale, (int, float)) and math.isfinite(scale)):
        return "a scale that is not a finite number"
    if is_causal and lq > lk:
        return "is_causal with more queries than keys (top-left rows past Lk see every key)"
    if grid_problem(query, key) is not None:
        return "B x Hq over CUDA's launch grid limit"
    if attn_mask is None:
        return None
    return _mask_route(query, key, attn_mask, is_causal)


def _mask_route(query: torch.Tensor, key: torch.Tensor, mask: Any,
                is_causal: bool) -> str | Window | KeyPadding:
    """The pattern flashtune serves ``mask`` as, or why torch runs the call (the module
    doc); reads the device only for a mask not seen before."""
    if type(mask) is not torch.Tensor:
        return "an attn_mask that is not a plain torch.Tensor"
    if is_causal:
        return "attn_mask with is_causal (torch raises)"
    if mask.dtype != torch.bool:
        kind = "a float (additive) attn_mask" if mask.dtype.is_floating_point \
            else f"an attn_mask of dtype {mask.dtype}"
        return f"{kind} (flashtune serves boolean window and key-padding masks)"
    if mask.device != query.device:
        return "an attn_mask on another device than the inputs"
    if torch.compiler.is_compiling():
        return "an attn_mask under torch.compile (recognising it reads the device)"
    if mask.is_cuda and torch.cuda.is_current_stream_capturing():
        return "an attn_mask during CUDA graph capture (replays may change its values)"
    b, hq, lq, _ = query.shape
    return mask_verdict(mask, b, hq, lq, key.shape[2])


def scaled_dot_product_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                 attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                                 is_causal: bool = False, scale: float | None = None,
                                 enable_gqa: bool = False) -> torch.Tensor:
    """Drop-in for ``torch.nn.functional.scaled_dot_product_attention``.

    Arguments, shapes and semantics are torch's. flashtune runs fp16/bf16 CUDA tensors (CPU
    under the interpreter; under autocast float32 ones in its dtype, as torch does) with a
    supported head_dim, with or without dropout, through
    :func:`flashtune.attention` (tuned config lookup included), with no ``attn_mask`` or
    one of the boolean patterns the module doc lists (a causal or local window, key
    padding); anything else goes to torch, see :func:`fallback_reason`.

    Arguments:
        query: ``(B, Hq, Lq, E)``.
        key, value: ``(B, Hkv, Lk, E)``.
        attn_mask: torch's mask: a boolean causal/window or key-padding pattern runs on
            flashtune (recognised once per mask object, see the module doc), any other
            mask sends the call to torch.
        dropout_p: attention dropout probability, applied whenever it is > 0 (torch's
            convention: pass 0.0 in evaluation); flashtune's kernels draw their own mask
            (:func:`flashtune.attention`), so the dropped entries are not torch's.
        is_causal: top-left aligned causal mask (torch's convention).
        scale: softmax scale; default ``1 / sqrt(E)``.
        enable_gqa: allow ``Hq`` a multiple of ``Hkv`` (else they must be equal).
    Returns:
        The attention output ``(B, Hq, Lq, E)``, in ``query``'s dtype.
    Raises:
        Whatever torch's SDPA raises for the calls it runs (the first fallback of each
        reason is logged at DEBUG level); flashtune's own checks pass for the calls it
        runs, so it raises nothing of its own.
    """
    query, key, value = autocast_inputs(query, key, value)
    found = None if _served(query, key, value, attn_mask, dropout_p, is_causal, scale,
                            enable_gqa) \
        else _decide(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if isinstance(found, str):
        with _LOCK:
            _COUNTS[found] += 1
            if found not in _LOGGED:
                _LOGGED.add(found)
                log.debug("flashtune SDPA: falling back to torch: %s", found)
        return torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
            scale=scale, enable_gqa=enable_gqa)
    drop = float(dropout_p) if dropout_p else 0.0
    if found is not None:  # a mask flashtune serves as a pattern
        return found.run(query, key, value, None if scale is None else float(scale), drop)
    key, value = _top_left(query, key, value, is_causal)
    return attention(query, key, value, causal=bool(is_causal),
                     scale=None if scale is None else float(scale), dropout_p=drop)


def _top_left(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              is_causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values torch's top-left causal call sees (see the module doc)."""
    if is_causal and query.shape[2] < key.shape[2]:
        lq = query.shape[2]
        return key[:, :, :lq], value[:, :, :lq]
    return key, value


def describe_route(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                   is_causal: bool = False, scale: float | None = None,
                   enable_gqa: bool = False) -> str:
    """Where :func:`scaled_dot_product_attention` would send these arguments, without
    running anything (an ``attn_mask`` not seen before is read once to recognise it).

    Arguments:
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa: as for
            :func:`scaled_dot_product_attention`.
    Returns:
        One line: ``"torch SDPA: <reason>"`` for a fallback, else the implementation
        flashtune routes the call to and the source of its choice, as
        :func:`flashtune.lookup_config` answers (e.g. ``"sdpa_cudnn (default)"``,
        ``"attn_fwd_gluon (exact)"``); for a mask served as a pattern, the pattern
        follows (e.g. ``"attn_fwd (default); attn_mask as causal, window (8, 0)"``,
        ``"attn_fwd (default); attn_mask as key padding, packed batch"``).
    Raises:
        What :func:`flashtune.lookup_config` raises for a call it would refuse.
    """
    query, key, value = autocast_inputs(query, key, value)
    found = None if _served(query, key, value, attn_mask, dropout_p, is_causal, scale,
                            enable_gqa) \
        else _decide(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if isinstance(found, str):
        return f"torch SDPA: {found}"
    drop = float(dropout_p) if dropout_p else 0.0
    if isinstance(found, Window):
        choice = lookup_config(query, key, value, causal=found.right == 0,
                               window=(found.left, found.right), dropout_p=drop)
        return f"{choice.template} ({choice.source}); attn_mask as {found.describe()}"
    if isinstance(found, KeyPadding):
        (b, hq, lq, e), hkv = query.shape, key.shape[1]
        problem = AttentionProblem(b, hq, hkv, lq, max(found.lengths), e, False,
                                   dtype_name(query.dtype), tokens_q=b * lq,
                                   tokens_k=sum(found.lengths), dropout=drop)
        choice = lookup_varlen(problem, query, key, value)
        return f"{choice.template} ({choice.source}); attn_mask as {found.describe()}"
    key, value = _top_left(query, key, value, is_causal)
    choice = lookup_config(query, key, value, causal=bool(is_causal), dropout_p=drop)
    return f"{choice.template} ({choice.source})"
