"""FlashAttention-2's public API over flashtune: code written for FlashAttention-2 switches by
changing its import.

    from flashtune.flash_attn_interface import flash_attn_func   # was: from flash_attn import ...

The seven functions keep FlashAttention-2's names, positional order, defaults, layouts and
return values, as of commit ``0251105a2fb19d2957484b7f023cd8c115286ced`` of
Dao-AILab/flash-attention (``flash_attn/flash_attn_interface.py``, version 2.8.4):
``(batch, seqlen, heads, head_dim)`` tensors, packed ``(total, heads, head_dim)`` ones with
int32 cumulative lengths, ``qkv`` ``(batch, seqlen, 3, heads, head_dim)`` and ``kv``
``(batch, seqlen, 2, heads_kv, head_dim)``. They run :func:`flashtune.attention`,
:func:`flashtune.attention_varlen` and :func:`flashtune.attention_with_kvcache` (which take
``(batch, heads, seqlen, head_dim)``) on transposed *views*: the interface copies no input
unless its last dimension is strided (copied, as FlashAttention-2 does; the ops pad a head dim
that is not a multiple of 8 on a GPU, as FlashAttention-2 pads it), and a packed
``qkv``/``kv`` is split by ``unbind`` views, its gradient assembled by autograd into one tensor of the packed layout
(one write of the gradient, no copy of the inputs).

Where flashtune differs, and why:

* ``out`` is a transposed view of flashtune's ``(batch, heads, seqlen, head_dim)`` output.
  flashtune's kernels write it in q's layout, so for contiguous ``(batch, seqlen, heads,
  head_dim)`` inputs it is contiguous, as FlashAttention-2's; a route through an SDPA backend
  or a padded head dim may give another layout (then ``.reshape`` works where
  ``.view(batch, seqlen, -1)`` does not: call ``.contiguous()`` first).
* ``return_attn_probs=True`` returns ``(out, softmax_lse, None)``: the LSE in
  FlashAttention-2's layout (float32 ``(batch, heads, seqlen_q)``, packed ``(heads,
  total_q)``); the third slot, FlashAttention-2's ``S_dmask`` (the probabilities with the
  dropout pattern in their sign bits, "for testing only"), is ``None``: flashtune never forms
  the probability matrix. The LSE of a row that sees no key is ``-inf`` (FlashAttention-2
  writes ``+inf``); it is differentiable here (FlashAttention-2 ignores its gradient).
* ``deterministic``: the forward is always deterministic. With ``deterministic=True`` the
  gradients of the dense functions come from flashtune's own pair (``attn_fwd`` with
  ``attn_bwd``), whose backward uses no atomics (every dQ, dK and dV element is summed in a
  fixed order by one program; a GQA group's dK/dV split across programs is reduced in slice
  order), so all three are bitwise reproducible. With ``False`` (FlashAttention-2's default)
  a plain call takes flashtune's routed training step, which on an H100 without a tuned
  choice is torch's cuDNN attention, whose backward PyTorch documents as non-deterministic.
  The varlen functions take the same rule: ``True`` runs attn_fwd with attn_bwd, ``False``
  the routed pair (on sm_90 the Gluon backward's varlen kernel, whose dQ adds by atomics).
  Calls with ``window_size``/``softcap``/``alibi_slopes`` always run attn_fwd with attn_bwd.
* ``dropout_p`` is forwarded to :func:`flashtune.attention` / :func:`flashtune.attention_varlen`
  (:func:`_dropout` is the one place that decides): FlashAttention-2's semantics (applied
  whenever it is > 0; the LSE is of every score), but flashtune's own mask: a Philox
  stream of its own seeded from torch's generator per call (reproducible under
  ``torch.manual_seed``, not bit-equal to FlashAttention-2's), the rate quantised to 1/256
  as FlashAttention-2's 8-bit threshold quantises it, the kept values scaled by the exact
  inverse of the keep probability (FlashAttention-2 divides by ``1 - dropout_p``).
  ``return_attn_probs`` still returns no ``S_dmask`` (``kernel_templates.dropout.
  dropout_mask`` materialises the keep mask of a seed). The paged varlen call (forward
  only, through the KV-cache op) has no dropout: ``dropout_p > 0`` raises there.
* ``flash_attn_with_kvcache``: ``k``/``v`` (the in-place append), ``rotary_cos``/
  ``rotary_sin``/``rotary_interleaved``, ``cache_batch_idx`` and ``cache_leftpad`` are
  forwarded to :func:`flashtune.attention_with_kvcache` when it takes them; until then a call
  that uses one raises an error naming it. ``num_splits`` is accepted and ignored: flashtune's
  tuned decode config picks the split count.
* ``flash_attn_varlen_func(..., block_table=...)`` (packed queries over a paged cache, forward
  only as in FlashAttention-2) pads the queries to ``(batch, max_seqlen_q)`` (each sequence
  right-aligned, so causal, window and ALiBi positions stay bottom-right aligned) and runs
  :func:`flashtune.attention_with_kvcache`: one copy of q and of the output.
* Errors: bad arguments raise :class:`FlashAttnInputError` / :class:`FlashAttnInputTypeError`
  naming FlashAttention-2's argument; they are flashtune's ``InputError`` /
  ``InputTypeError`` (``ValueError`` / ``TypeError``) *and* ``RuntimeError``, which
  FlashAttention-2's checks raise, so code catching either keeps working. As in
  FlashAttention-2, a paged call checks ``max(cache_seqlens) (+ seqlen_new)`` against what
  ``block_table`` addresses (one device-to-host copy; skipped during CUDA-graph capture).
* Any negative ``window_size`` bound means unbounded, and ``softcap <= 0`` none, as in
  FlashAttention-2; head dims and dtypes are flashtune's (:func:`flashtune.attention`).
"""

from __future__ import annotations

import functools
import inspect
import math
import numbers
import operator
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ParamSpec, TypeVar

import torch

from flashtune.core.errors import InputError, InputTypeError
from flashtune.runtime.checks import SUPPORTED_DTYPES
from flashtune.runtime.kvcache import attention_with_kvcache
from flashtune.runtime.ops import attention, attention_varlen

__all__ = [
    "FA2_COMMIT",
    "FlashAttnInputError",
    "FlashAttnInputTypeError",
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
]

# the FlashAttention-2 commit whose flash_attn_interface.py these functions follow
FA2_COMMIT = "0251105a2fb19d2957484b7f023cd8c115286ced"

_P = ParamSpec("_P")
_R = TypeVar("_R")
_Window = Sequence[int] | torch.Tensor


class FlashAttnInputError(InputError, RuntimeError):
    """A bad argument to a FlashAttention-2 function: flashtune's ``InputError`` (a
    ``ValueError``) that is also the ``RuntimeError`` FlashAttention-2's checks raise."""


class FlashAttnInputTypeError(InputTypeError, RuntimeError):
    """An argument of the wrong type or dtype: flashtune's ``InputTypeError`` (a
    ``TypeError``) that is also the ``RuntimeError`` FlashAttention-2's checks raise."""


def _fa2_errors(rename: Mapping[str, str] | None = None
                ) -> Callable[[Callable[_P, _R]], Callable[_P, _R]]:
    """Re-raise flashtune's input errors from inside the ops as FlashAttention-2's kind
    (also ``RuntimeError``), argument names in ``rename`` rewritten to this function's."""
    pattern = re.compile(r"\b(" + "|".join(map(re.escape, rename)) + r")\b") if rename else None

    def wrap(fn: Callable[_P, _R]) -> Callable[_P, _R]:
        @functools.wraps(fn)
        def call(*args: _P.args, **kwargs: _P.kwargs) -> _R:
            try:
                return fn(*args, **kwargs)
            except (InputError, InputTypeError) as exc:
                if isinstance(exc, RuntimeError) and pattern is None:
                    raise
                message = str(exc)
                if pattern is not None and rename is not None:
                    message = pattern.sub(lambda m: rename[m.group(1)], message)
                kind = (FlashAttnInputTypeError if isinstance(exc, InputTypeError)
                        else FlashAttnInputError)
                raise kind(message).with_traceback(exc.__traceback__) from None
        return call
    return wrap


# -- argument checks (FlashAttention-2's names) ------------------------------------------------


def _check(name: str, t: Any, ndim: int, dims: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise FlashAttnInputTypeError(f"{name} must be a torch.Tensor {dims}, got "
                                      f"{type(t).__name__}")
    if t.dim() != ndim:
        raise FlashAttnInputError(f"{name} must have {ndim} dimensions {dims}, got shape "
                                  f"{tuple(t.shape)}")
    if t.dtype not in SUPPORTED_DTYPES:
        raise FlashAttnInputTypeError(f"{name} must be float16 or bfloat16, got {t.dtype}")


def _contiguous_last(t: torch.Tensor) -> torch.Tensor:
    """FlashAttention-2's ``maybe_contiguous``: a copy only when the last dim is strided."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _check_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kdims: str,
              qname: str = "q") -> None:
    """k and v against each other and against q (last three dims ``seqlen, heads, D``)."""
    if k.shape != v.shape:
        raise FlashAttnInputError(f"k and v must have the same shape {kdims}, got k "
                                  f"{tuple(k.shape)} and v {tuple(v.shape)}")
    if q.shape[-1] != k.shape[-1]:
        raise FlashAttnInputError(f"headdim mismatch: {qname} has {q.shape[-1]}, k/v have "
                                  f"{k.shape[-1]}")
    if q.shape[-2] % k.shape[-2]:
        raise FlashAttnInputError(f"nheads ({q.shape[-2]}) must be a multiple of nheads_k "
                                  f"({k.shape[-2]}) for MQA/GQA")


def _scale(softmax_scale: Any) -> float | None:
    if softmax_scale is None:
        return None
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real) \
            or not math.isfinite(softmax_scale):
        raise FlashAttnInputError(f"softmax_scale must be a finite float or None (1 / "
                                  f"sqrt(headdim)), got {softmax_scale!r}")
    return float(softmax_scale)


def _window(window_size: Any, causal: bool) -> tuple[int, int] | None:
    """``(left, right)``, or None for no window; any negative bound is unbounded (-1), as in
    FlashAttention-2, whose tests pass a tensor of two ints."""
    try:
        left, right = window_size
        left, right = operator.index(left), operator.index(right)
    except (TypeError, ValueError):
        raise FlashAttnInputTypeError(f"window_size must be a pair of ints (left, right), "
                                      f"-1 for unbounded, got {window_size!r}") from None
    left, right = max(left, -1), max(right, -1)
    if left == -1 and (right == -1 or causal):
        return None
    return (left, right)


def _softcap(softcap: Any) -> float | None:
    if softcap is None:
        return None
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real) \
            or not math.isfinite(softcap):
        raise FlashAttnInputError(f"softcap must be a finite float (0.0: none), got "
                                  f"{softcap!r}")
    cap = float(softcap)
    return cap if cap > 0 else None


def _positive_int(name: str, n: Any) -> int:
    try:
        value = operator.index(n)
    except TypeError:
        raise FlashAttnInputTypeError(f"{name} must be an int, got {type(n).__name__}") from None
    if value < 1:
        raise FlashAttnInputError(f"{name} must be >= 1, got {value}")
    return value


@functools.cache
def _parameters(fn: Callable[..., Any]) -> frozenset[str]:
    return frozenset(inspect.signature(fn).parameters)


@torch.compiler.assume_constant_result  # type: ignore[untyped-decorator]  # a signature
def accepts(fn: Callable[..., Any], name: str) -> bool:
    """Whether flashtune's op ``fn`` takes the keyword ``name`` (the features other work adds
    to the ops: ``dropout_p``, the KV-cache call's ``k``, ``rotary_cos``...)."""
    return name in _parameters(fn)


def _dropout(fn: Callable[..., Any], dropout_p: Any) -> dict[str, Any]:
    """The one place dropout enters: ``{}`` for none, ``{"dropout_p": p}`` for an op that
    takes it, else an error naming ``dropout_p``."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real) \
            or not 0.0 <= float(dropout_p) < 1.0:
        raise FlashAttnInputError(f"dropout_p must be a float in [0, 1), got {dropout_p!r}")
    if dropout_p == 0:
        return {}
    if accepts(fn, "dropout_p"):
        return {"dropout_p": float(dropout_p)}
    raise FlashAttnInputError(
        f"dropout_p={dropout_p!r}: this call runs flashtune's KV-cache op, which applies no "
        f"attention dropout; pass dropout_p=0.0 (as in evaluation)")


def _wants_grad(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _own_pair(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
              scale: float | None, return_lse: bool) -> Any:
    """A plain call with gradients on flashtune's own pair (attn_fwd, attn_bwd: no atomics),
    whatever the router would choose for it."""
    from flashtune.runtime.ops import attention

    return attention(q, k, v, causal=causal, scale=scale, return_lse=return_lse,
                     impl="attn_fwd")


# -- the three routes --------------------------------------------------------------------------


def _dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: Any,
           softmax_scale: Any, causal: bool, window_size: Any, softcap: Any,
           alibi_slopes: torch.Tensor | None, deterministic: bool, return_lse: bool,
           ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(out, lse or None)`` of ``(batch, seqlen, heads, head_dim)`` tensors, out in that
    layout (a view)."""
    _check_kv(q, k, v, "(batch_size, seqlen_k, nheads_k, headdim)")
    if q.shape[0] != k.shape[0]:
        raise FlashAttnInputError(f"batch mismatch: q has batch_size {q.shape[0]}, k/v have "
                                  f"{k.shape[0]}")
    causal = bool(causal)
    scale, window, cap = _scale(softmax_scale), _window(window_size, causal), _softcap(softcap)
    drop = _dropout(attention, dropout_p)
    qt, kt, vt = (_contiguous_last(t).transpose(1, 2) for t in (q, k, v))
    result: Any
    if deterministic and not drop and window is None and cap is None and alibi_slopes is None \
            and _wants_grad(qt, kt, vt) and not torch.compiler.is_compiling():
        result = _own_pair(qt, kt, vt, causal, scale, return_lse)
    else:
        result = attention(qt, kt, vt, causal=causal, scale=scale, window=window, softcap=cap,
                           alibi_slopes=alibi_slopes, return_lse=return_lse, **drop)
    if return_lse:
        out, lse = result
        return out.transpose(1, 2), lse
    return result.transpose(1, 2), None


def _varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: Any,
            cu_seqlens_k: Any, max_seqlen_q: Any, max_seqlen_k: Any, dropout_p: Any,
            softmax_scale: Any, causal: bool, window_size: Any, softcap: Any,
            alibi_slopes: torch.Tensor | None, return_lse: bool,
            block_table: torch.Tensor | None = None, deterministic: bool = False,
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(out, lse or None)`` of packed ``(total, heads, head_dim)`` tensors;
    ``deterministic`` gradients from attn_fwd with attn_bwd (no atomics)."""
    causal = bool(causal)
    scale, window, cap = _scale(softmax_scale), _window(window_size, causal), _softcap(softcap)
    max_q = _positive_int("max_seqlen_q", max_seqlen_q)
    max_k = _positive_int("max_seqlen_k", max_seqlen_k)
    if block_table is not None:
        _dropout(attention_with_kvcache, dropout_p)
        return _varlen_paged(q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, block_table, scale,
                             causal, window, cap, alibi_slopes, return_lse)
    _check_kv(q, k, v, "(total_k, nheads_k, headdim)")
    drop = _dropout(attention_varlen, dropout_p)
    q, k, v = (_contiguous_last(t) for t in (q, k, v))
    own = {"impl": "attn_fwd"} if deterministic and _wants_grad(q, k, v) else {}
    result = attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, max_k,
                              causal=causal, scale=scale, window=window, softcap=cap,
                              alibi_slopes=alibi_slopes, return_lse=return_lse, **drop, **own)
    if return_lse:
        out, lse = result
        return out, lse
    return result, None


def _int32(name: str, t: Any, ndim: int, dims: str) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.int32:
        got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
        raise FlashAttnInputTypeError(f"{name} must be an int32 torch.Tensor {dims}, got {got}")
    if t.dim() != ndim:
        raise FlashAttnInputError(f"{name} must have {ndim} dimension(s) {dims}, got shape "
                                  f"{tuple(t.shape)}")


def _capturing(t: torch.Tensor) -> bool:
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def _check_capacity(lens: torch.Tensor, seqlen_new: int, block_table: torch.Tensor,
                    page_size: int) -> None:
    """FlashAttention-2's paged-cache check (``mha_fwd_kvcache``): the longest sequence, new
    keys included, fits the pages ``block_table`` holds. One device-to-host copy, skipped
    during CUDA-graph capture."""
    if lens.numel() == 0 or _capturing(lens):
        return
    longest = int(lens.max()) + seqlen_new
    capacity = block_table.shape[1] * page_size
    if longest > capacity:
        what = "max(cache_seqlens)" + (" + seqlen_new" if seqlen_new else "")
        raise FlashAttnInputError(
            f"paged KV cache: {what} = {longest} exceeds the capacity block_table addresses "
            f"({block_table.shape[1]} blocks per sequence x page_block_size {page_size} = "
            f"{capacity}); give block_table more columns")


def _varlen_paged(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  cu_seqlens_q: Any, cu_seqlens_k: Any, max_q: int, block_table: Any,
                  scale: float | None, causal: bool, window: tuple[int, int] | None,
                  cap: float | None, alibi_slopes: torch.Tensor | None, return_lse: bool,
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Packed queries over a paged cache: right-aligned in a ``(batch, max_seqlen_q)`` grid,
    run by :func:`flashtune.attention_with_kvcache`, packed back."""
    cache_dims = "(num_blocks, page_block_size, nheads_k, headdim)"
    _check("k", k_cache, 4, cache_dims)
    _check("v", v_cache, 4, cache_dims)
    _check_kv(q, k_cache, v_cache, cache_dims)
    _int32("block_table", block_table, 2, "(batch_size, max_num_blocks_per_seq)")
    batch = block_table.shape[0]
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        _int32(name, cu, 1, "(batch_size + 1,)")
        if cu.numel() != batch + 1:
            raise FlashAttnInputError(f"{name} has {cu.numel()} entries; block_table has "
                                      f"{batch} rows, so it must have {batch + 1}")
    lens_k = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).contiguous()
    if not _capturing(q):
        cq = [int(x) for x in cu_seqlens_q.tolist()]
        ck = [int(x) for x in cu_seqlens_k.tolist()]
        for name, cu in (("cu_seqlens_q", cq), ("cu_seqlens_k", ck)):
            if cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])):
                raise FlashAttnInputError(f"{name} must start at 0 and not decrease, got "
                                          f"{cu}")
        if cq[-1] != q.shape[0]:
            raise FlashAttnInputError(f"cu_seqlens_q[-1] = {cq[-1]} must equal the number of "
                                      f"query tokens, {q.shape[0]}")
        longest = max(b - a for a, b in zip(cq, cq[1:]))
        if longest > max_q:
            raise FlashAttnInputError(f"max_seqlen_q = {max_q}, but a sequence has {longest} "
                                      f"queries")
        _check_capacity(lens_k, 0, block_table, k_cache.shape[1])
    heads, head_dim = q.shape[1], q.shape[2]
    starts = cu_seqlens_q.to(torch.int64)
    token = torch.arange(q.shape[0], device=q.device)
    seq = torch.searchsorted(starts[1:].contiguous(), token, right=True)
    # sequence b's query i sits at row max_q - len_q[b] + i: bottom-right aligned, as its keys
    row = token - starts[seq] + max_q - (starts[1:] - starts[:-1])[seq]
    q_grid = q.new_zeros(batch, max_q, heads, head_dim)
    q_grid[seq, row] = q.detach()
    result: Any = attention_with_kvcache(
        q_grid.transpose(1, 2), k_cache.transpose(1, 2), v_cache.transpose(1, 2), lens_k,
        block_table=block_table, causal=causal, scale=scale, window=window, softcap=cap,
        alibi_slopes=alibi_slopes, return_lse=return_lse)
    out_grid, lse_grid = result if return_lse else (result, None)
    out = out_grid.transpose(1, 2)[seq, row]
    lse = None if lse_grid is None else lse_grid[seq, :, row].transpose(0, 1).contiguous()
    return out, lse


# -- FlashAttention-2's functions ----------------------------------------------------------------
# Returns are typed Any, as FlashAttention-2's (untyped) are: a union of its two return
# shapes would fail type checks of code that passes them against FlashAttention-2.


@_fa2_errors()
def flash_attn_qkvpacked_func(
    qkv: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: _Window = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> Any:
    """Attention of q, k and v stacked into one tensor (FlashAttention-2's function).

    The gradient of ``qkv`` is one tensor of its packed layout (q, k and v are ``unbind``
    views of it; nothing is concatenated by hand).

    Arguments:
        qkv: ``(batch_size, seqlen, 3, nheads, headdim)``, float16 or bfloat16.
        dropout_p: attention dropout probability in ``[0, 1)`` (0.0 in evaluation):
            FlashAttention-2's semantics, flashtune's own mask (see the module doc).
        softmax_scale: scale of ``QK^T`` before the softmax; default ``1 / sqrt(headdim)``.
        causal: causal mask (bottom-right aligned).
        window_size: ``(left, right)`` sliding window, -1 (any negative) unbounded: query
            ``i`` sees keys ``[i - left, i + right]``.
        softcap: anything > 0 caps the scores at ``softcap * tanh(s / softcap)``.
        alibi_slopes: float32 ``(nheads,)`` or ``(batch_size, nheads)``: a bias of
            ``-slope * |i - j|``.
        deterministic: gradients bitwise reproducible (flashtune's own backward; see the
            module doc). The forward is always deterministic.
        return_attn_probs: also return the LSE, and ``None`` for FlashAttention-2's
            ``S_dmask``.
    Returns:
        ``out`` ``(batch_size, seqlen, nheads, headdim)`` (a view, see the module doc), or
        ``(out, softmax_lse, None)`` with ``softmax_lse`` float32 ``(batch_size, nheads,
        seqlen)``.
    Raises:
        FlashAttnInputError / FlashAttnInputTypeError naming the argument.
    """
    _check("qkv", qkv, 5, "(batch_size, seqlen, 3, nheads, headdim)")
    if qkv.shape[2] != 3:
        raise FlashAttnInputError(f"qkv must be (batch_size, seqlen, 3, nheads, headdim), got "
                                  f"shape {tuple(qkv.shape)}")
    q, k, v = _contiguous_last(qkv).unbind(2)
    out, lse = _dense(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                      alibi_slopes, deterministic, bool(return_attn_probs))
    return (out, lse, None) if return_attn_probs else out


@_fa2_errors()
def flash_attn_kvpacked_func(
    q: torch.Tensor,
    kv: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: _Window = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> Any:
    """Attention with k and v stacked into one tensor (FlashAttention-2's function);
    MQA/GQA when ``kv`` has fewer heads than ``q``.

    Arguments:
        q: ``(batch_size, seqlen_q, nheads, headdim)``.
        kv: ``(batch_size, seqlen_k, 2, nheads_k, headdim)``, ``nheads`` a multiple of
            ``nheads_k``; its gradient is one tensor of this layout.
        dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
            return_attn_probs: as :func:`flash_attn_func`.
    Returns:
        ``out`` ``(batch_size, seqlen_q, nheads, headdim)``, or ``(out, softmax_lse, None)``.
    Raises:
        FlashAttnInputError / FlashAttnInputTypeError naming the argument.
    """
    _check("q", q, 4, "(batch_size, seqlen_q, nheads, headdim)")
    _check("kv", kv, 5, "(batch_size, seqlen_k, 2, nheads_k, headdim)")
    if kv.shape[2] != 2:
        raise FlashAttnInputError(f"kv must be (batch_size, seqlen_k, 2, nheads_k, headdim), "
                                  f"got shape {tuple(kv.shape)}")
    k, v = _contiguous_last(kv).unbind(2)
    out, lse = _dense(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                      alibi_slopes, deterministic, bool(return_attn_probs))
    return (out, lse, None) if return_attn_probs else out


@_fa2_errors()
def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: _Window = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> Any:
    """Exact attention, FlashAttention-2's ``flash_attn_func`` run by
    :func:`flashtune.attention` on transposed views.

    MQA/GQA when k and v have fewer heads than q (head ``h`` of q uses head ``h //
    (nheads // nheads_k)`` of k/v). ``causal`` is aligned to the bottom right: query ``i``
    sees key ``j`` iff ``j <= i + seqlen_k - seqlen_q``; a row that sees no key gives 0.

    Arguments:
        q: ``(batch_size, seqlen_q, nheads, headdim)``, float16 or bfloat16.
        k: ``(batch_size, seqlen_k, nheads_k, headdim)``, ``nheads`` a multiple of
            ``nheads_k``.
        v: as ``k``.
        dropout_p: attention dropout probability in ``[0, 1)`` (0.0 in evaluation):
            FlashAttention-2's semantics, flashtune's own mask (see the module doc).
        softmax_scale: scale of ``QK^T`` before the softmax; default ``1 / sqrt(headdim)``.
        causal: causal mask, bottom-right aligned.
        window_size: ``(left, right)``: query ``i`` sees keys ``[i + seqlen_k - seqlen_q -
            left, i + seqlen_k - seqlen_q + right]``; -1 (any negative) unbounded.
        softcap: anything > 0 caps the scores at ``softcap * tanh(s / softcap)``.
        alibi_slopes: float32 ``(nheads,)`` or ``(batch_size, nheads)``: a bias of
            ``-slope * |i + seqlen_k - seqlen_q - j|``.
        deterministic: gradients bitwise reproducible (flashtune's own backward, no
            atomics; see the module doc). The forward is always deterministic.
        return_attn_probs: also return the LSE, and ``None`` where FlashAttention-2 returns
            ``S_dmask``.
    Returns:
        ``out`` ``(batch_size, seqlen_q, nheads, headdim)`` (a transposed view of a
        contiguous ``(batch, nheads, seqlen_q, headdim)`` tensor), or ``(out, softmax_lse,
        None)`` with ``softmax_lse`` float32 ``(batch_size, nheads, seqlen_q)``.
    Raises:
        FlashAttnInputError / FlashAttnInputTypeError (also ``RuntimeError``) naming the
        argument, before any launch.
    """
    _check("q", q, 4, "(batch_size, seqlen_q, nheads, headdim)")
    _check("k", k, 4, "(batch_size, seqlen_k, nheads_k, headdim)")
    _check("v", v, 4, "(batch_size, seqlen_k, nheads_k, headdim)")
    out, lse = _dense(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                      alibi_slopes, deterministic, bool(return_attn_probs))
    return (out, lse, None) if return_attn_probs else out


@_fa2_errors(rename={"cu_seqlens_q": "cu_seqlens", "cu_seqlens_k": "cu_seqlens",
                     "max_seqlen_q": "max_seqlen", "max_seqlen_k": "max_seqlen"})
def flash_attn_varlen_qkvpacked_func(
    qkv: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: _Window = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> Any:
    """Attention over a packed batch, q, k and v stacked (FlashAttention-2's function).

    Arguments:
        qkv: ``(total, 3, nheads, headdim)``, ``total`` the tokens of the batch; its
            gradient is one tensor of this layout.
        cu_seqlens: int32 ``(batch_size + 1,)``, the cumulative sequence lengths.
        max_seqlen: the longest sequence's length.
        dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
            return_attn_probs: as :func:`flash_attn_func`, per sequence (``deterministic``:
            attn_fwd with attn_bwd, no atomics; see the module doc).
    Returns:
        ``out`` ``(total, nheads, headdim)``, or ``(out, softmax_lse, None)`` with
        ``softmax_lse`` float32 ``(nheads, total)``.
    Raises:
        FlashAttnInputError / FlashAttnInputTypeError naming the argument.
    """
    _check("qkv", qkv, 4, "(total, 3, nheads, headdim)")
    if qkv.shape[1] != 3:
        raise FlashAttnInputError(f"qkv must be (total, 3, nheads, headdim), got shape "
                                  f"{tuple(qkv.shape)}")
    q, k, v = _contiguous_last(qkv).unbind(1)
    out, lse = _varlen(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p,
                       softmax_scale, causal, window_size, softcap, alibi_slopes,
                       bool(return_attn_probs), deterministic=bool(deterministic))
    return (out, lse, None) if return_attn_probs else out


@_fa2_errors()
def flash_attn_varlen_kvpacked_func(
    q: torch.Tensor,
    kv: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: _Window = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> Any:
    """Attention over a packed batch, k and v stacked (FlashAttention-2's function).

    Arguments:
        q: ``(total_q, nheads, headdim)``.
        kv: ``(total_k, 2, nheads_k, headdim)``; its gradient is one tensor of this layout.
        cu_seqlens_q, cu_seqlens_k: int32 ``(batch_size + 1,)`` cumulative lengths.
        max_seqlen_q, max_seqlen_k: the longest sequences' lengths.
        dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
            return_attn_probs: as :func:`flash_attn_varlen_func`.
    Returns:
        ``out`` ``(total_q, nheads, headdim)``, or ``(out, softmax_lse, None)`` with
        ``softmax_lse`` float32 ``(nheads, total_q)``.
    Raises:
        FlashAttnInputError / FlashAttnInputTypeError naming the argument.
    """
    _check("q", q, 3, "(total_q, nheads, headdim)")
    _check("kv", kv, 4, "(total_k, 2, nheads_k, headdim)")
    if kv.shape[1] != 2:
        raise FlashAttnInputError(f"kv must be (total_k, 2, nheads_k, headdim), got shape "
                                  f"{tuple(kv.shape)}")
    k, v = _contiguous_last(kv).unbind(1)
    out, lse = _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                       dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                       bool(return_attn_probs), deterministic=bool(deterministic))
    return (out, lse, None) if return_attn_probs else out


@_fa2_errors()
def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: _Window = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: torch.Tensor | None = None,
) -> Any:
    """Attention over a packed batch of sequences of different lengths (FlashAttention-2's
    function), run by :func:`flashtune.attention_varlen`: no token attends across sequences;
    causal, window and ALiBi are bottom-right aligned per sequence.

    Arguments:
        q: ``(total_q, nheads, headdim)``, the batch's queries one sequence after another.
        k: ``(total_k, nheads_k, headdim)``; with ``block_table``, the paged key cache
            ``(num_blocks, page_block_size, nheads_k, headdim)``.
        v: as ``k``.
        cu_seqlens_q, cu_seqlens_k: int32 ``(batch_size + 1,)`` cumulative lengths (with
            ``block_table``, sequence ``b`` has ``cu_seqlens_k[b + 1] - cu_seqlens_k[b]``
            keys in its pages).
        max_seqlen_q, max_seqlen_k: the longest sequences' lengths.
        dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
            return_attn_probs: as :func:`flash_attn_func`, per sequence.
        deterministic: gradients bitwise reproducible (attn_fwd with attn_bwd; see the
            module doc).
        block_table: int32 ``(batch_size, max_num_blocks_per_seq)`` for a paged cache:
            forward only (the output has no gradient), run by
            :func:`flashtune.attention_with_kvcache` on the queries padded to ``(batch_size,
            max_seqlen_q)``.
    Returns:
        ``out`` ``(total_q, nheads, headdim)``, or ``(out, softmax_lse, None)`` with
        ``softmax_lse`` float32 ``(nheads, total_q)``.
    Raises:
        FlashAttnInputError / FlashAttnInputTypeError naming the argument (the lengths are
        read on the host to check them, except during CUDA-graph capture).
    """
    _check("q", q, 3, "(total_q, nheads, headdim)")
    if block_table is None:
        _check("k", k, 3, "(total_k, nheads_k, headdim)")
        _check("v", v, 3, "(total_k, nheads_k, headdim)")
    out, lse = _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                       dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                       bool(return_attn_probs), block_table, bool(deterministic))
    return (out, lse, None) if return_attn_probs else out


@_fa2_errors()
def flash_attn_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    rotary_cos: torch.Tensor | None = None,
    rotary_sin: torch.Tensor | None = None,
    cache_seqlens: int | torch.Tensor | None = None,
    cache_batch_idx: torch.Tensor | None = None,
    cache_leftpad: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: _Window = (-1, -1),
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    alibi_slopes: torch.Tensor | None = None,
    num_splits: int = 0,
    return_softmax_lse: bool = False,
) -> Any:
    """Decoding attention over a KV cache (FlashAttention-2's function), run by
    :func:`flashtune.attention_with_kvcache` on transposed views; inference only.

    Causal and window are bottom-right aligned against each sequence's own length.

    Arguments:
        q: ``(batch_size, seqlen, nheads, headdim)``.
        k_cache: ``(batch_size_cache, seqlen_cache, nheads_k, headdim)``, or with
            ``block_table`` ``(num_blocks, page_block_size, nheads_k, headdim)``; last dim
            contiguous (it is never copied).
        v_cache: as ``k_cache``.
        k, v: ``(batch_size, seqlen_new, nheads_k, headdim)``: new keys/values written into
            the cache in place at ``cache_seqlens`` and attended to. Forwarded to
            :func:`flashtune.attention_with_kvcache` when it takes them, else an error naming
            them.
        rotary_cos, rotary_sin: ``(seqlen_ro, rotary_dim / 2)``: rotary embedding of q and
            the new keys at their positions (forwarded likewise, with
            ``rotary_interleaved``).
        cache_seqlens: int or int32 ``(batch_size,)``: the cache's lengths before the new
            keys; None: the whole cache (not with ``k``/``v``).
        cache_batch_idx: int32 ``(batch_size,)``: the cache rows of the batch (forwarded
            likewise).
        cache_leftpad: int32 ``(batch_size,)``: where each cache starts (forwarded
            likewise).
        block_table: int32 ``(batch_size, max_num_blocks_per_seq)`` for a paged cache.
        softmax_scale, causal, window_size, softcap, alibi_slopes: as
            :func:`flash_attn_func` (``causal`` defaults to False, as FlashAttention-2's).
        rotary_interleaved: GPT-J style rotary pairs (True) or GPT-NeoX halves (False).
        num_splits: accepted (an int >= 0) and ignored: the tuned decode config picks the
            split count.
        return_softmax_lse: also return the LSE.
    Returns:
        ``out`` ``(batch_size, seqlen, nheads, headdim)``, or ``(out, softmax_lse)`` with
        ``softmax_lse`` float32 ``(batch_size, nheads, seqlen)``.
    Raises:
        FlashAttnInputError / FlashAttnInputTypeError naming the argument; with
        ``block_table``, when ``max(cache_seqlens) (+ seqlen_new)`` passes what it addresses
        (as FlashAttention-2: one device-to-host copy, skipped during graph capture).
    """
    paged = block_table is not None
    cache_dims = ("(num_blocks, page_block_size, nheads_k, headdim)" if paged
                  else "(batch_size_cache, seqlen_cache, nheads_k, headdim)")
    _check("q", q, 4, "(batch_size, seqlen, nheads, headdim)")
    _check("k_cache", k_cache, 4, cache_dims)
    _check("v_cache", v_cache, 4, cache_dims)
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise FlashAttnInputError(f"{name} must have a contiguous last dimension (it is "
                                      f"updated in place, never copied)")
    if k_cache.shape != v_cache.shape:
        raise FlashAttnInputError(f"k_cache and v_cache must have the same shape {cache_dims}, "
                                  f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    _check_kv(q, k_cache, v_cache, cache_dims)
    batch = q.shape[0]
    if not paged and cache_batch_idx is None and k_cache.shape[0] != batch:
        raise FlashAttnInputError(f"batch mismatch: q has batch_size {batch}, k_cache has "
                                  f"{k_cache.shape[0]} (pass cache_batch_idx to pick rows)")
    if (k is None) != (v is None):
        raise FlashAttnInputError("k and v must be given together (the new keys and values)")
    seqlen_new = 0
    if k is not None and v is not None:
        _check("k", k, 4, "(batch_size, seqlen_new, nheads_k, headdim)")
        _check("v", v, 4, "(batch_size, seqlen_new, nheads_k, headdim)")
        if k.shape != v.shape or k.shape[0] != batch or k.shape[2:] != k_cache.shape[2:]:
            raise FlashAttnInputError(
                f"k and v must be (batch_size, seqlen_new, nheads_k, headdim) = ({batch}, "
                f"seqlen_new, {k_cache.shape[2]}, {k_cache.shape[3]}), got k {tuple(k.shape)} "
                f"and v {tuple(v.shape)}")
        seqlen_new = k.shape[1]
    if (rotary_cos is None) != (rotary_sin is None):
        raise FlashAttnInputError("rotary_cos and rotary_sin must be given together")
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 0:
        raise FlashAttnInputError(f"num_splits must be an int >= 0 (0: automatic), got "
                                  f"{num_splits!r}")
    causal = bool(causal)
    scale, window, cap = _scale(softmax_scale), _window(window_size, causal), _softcap(softcap)
    page_size = k_cache.shape[1]
    if paged:
        _int32("block_table", block_table, 2, "(batch_size, max_num_blocks_per_seq)")
    capacity = block_table.shape[1] * page_size if block_table is not None else page_size
    if cache_seqlens is None:
        if k is not None:
            raise FlashAttnInputError("cache_seqlens is required with k and v (where the new "
                                      "keys go)")
        lens = torch.full((batch,), capacity, dtype=torch.int32, device=k_cache.device)
    elif isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        lens = torch.full((batch,), cache_seqlens, dtype=torch.int32, device=k_cache.device)
    else:
        _int32("cache_seqlens", cache_seqlens, 1, "(batch_size,)")
        assert isinstance(cache_seqlens, torch.Tensor)
        lens = cache_seqlens.contiguous()
    if block_table is not None:
        _check_capacity(lens, seqlen_new, block_table, page_size)
    extras: dict[str, Any] = {}
    if k is not None and v is not None:
        extras.update(k=_contiguous_last(k).transpose(1, 2),
                      v=_contiguous_last(v).transpose(1, 2))
    if rotary_cos is not None:
        extras.update(rotary_cos=rotary_cos, rotary_sin=rotary_sin,
                      rotary_interleaved=bool(rotary_interleaved))
    if cache_batch_idx is not None:
        extras["cache_batch_idx"] = cache_batch_idx
    if cache_leftpad is not None:
        extras["cache_leftpad"] = cache_leftpad
    missing = [name for name in extras if not accepts(attention_with_kvcache, name)]
    if missing:
        raise FlashAttnInputError(
            f"flash_attn_with_kvcache({', '.join(f'{n}=...' for n in missing)}): "
            f"flashtune.attention_with_kvcache does not take {', '.join(missing)} yet "
            f"(issue 31, item 4); leave {'them' if len(missing) > 1 else 'it'} None")
    result: Any = attention_with_kvcache(
        _contiguous_last(q).transpose(1, 2), k_cache.transpose(1, 2), v_cache.transpose(1, 2),
        lens, block_table=block_table, causal=causal, scale=scale, window=window, softcap=cap,
        alibi_slopes=alibi_slopes, return_lse=bool(return_softmax_lse), **extras)
    if return_softmax_lse:
        out, lse = result
        return out.transpose(1, 2), lse
    return result.transpose(1, 2)
