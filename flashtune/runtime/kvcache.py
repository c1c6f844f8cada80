"""``attention_with_kvcache``: decoding attention over a contiguous or paged KV cache.

Like flash-attention's ``flash_attn_with_kvcache`` (without the in-place cache append):
a few new queries per sequence attend to the first ``cache_seqlens[b]`` keys of their
sequence's cache, which is either contiguous ``(batch, heads_kv, max_seqlen, head_dim)`` or
paged ``(num_pages, heads_kv, page_size, head_dim)`` with a block table, as in vLLM. Its
score modifications too, with FlashAttention-2's meanings, per sequence (query ``i`` of
sequence ``b`` sits at key position ``pos = i + cache_seqlens[b] - seqlen_q``): a local
``window`` ``(left, right)`` (keys ``[pos - left, pos + right]``, -1 unbounded; causal is
the right bound 0), a logit ``softcap`` and ``alibi_slopes`` (``-slope * |pos - j|``). A
window's splits cover only the keys some query sees, so a sliding window over a long cache
costs O(window).

Checks: everything that metadata shows (types, dtypes, shapes, strides, devices, head
counts, page size) is checked on every call, with no device sync. Values inside
``cache_seqlens`` and ``block_table`` (negative lengths, lengths past the cache's capacity,
page ids outside ``[0, num_pages)``) need the data: they are checked only with
``check_tables=True``, which copies the tables to the host and so synchronises with the
device, and always on CPU tensors (the Triton interpreter). Otherwise they are the caller's
responsibility, as in flash-attention and vLLM: a bad page id reads the wrong memory.

Configs: an explicit ``config`` (checked against the ``attn_decode`` space), else the one
the ``attn_decode`` :class:`~flashtune.runtime.lookup.Dispatcher` serves (tuned exact ->
bucket -> nearest -> template default, as for ``attn_fwd``) for the problem, whose key is an
:class:`~flashtune.core.problem.AttentionProblem` with ``seqlen_k`` the cache's
capacity (metadata: no device sync, and one key for every step of a decoding loop) and the
score modifications.

Hot path on CUDA: after the first call of a call signature (shapes, strides, dtypes, device,
16-byte alignment, paged or not, causal, scale, return_lse, window, softcap, the ALiBi
slopes' metadata), a call checks nothing again and
replays an :class:`~flashtune.kernel_templates.attn_decode.plan.AttnDecodePlan` (the compiled
split and combine kernels with their fixed arguments): a dict read, the allocations and the
launches.

:func:`decode_route` is how :func:`flashtune.attention` decides whether a short-query call
on dense K/V runs this template instead of ``attn_fwd``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from functools import cache
from typing import Any

import torch

from flashtune.core.device import DeviceFingerprint, current_device, interpreting
from flashtune.core.errors import ConfigError, DeviceError, InputError, InputTypeError
from flashtune.core.problem import SUPPORTED_HEAD_DIMS, AttentionProblem
from flashtune.core.space import Config
from flashtune.kernel_templates import direct, get_template
from flashtune.kernel_templates.attn_decode.launcher import attn_decode_kvcache
from flashtune.kernel_templates.attn_decode.plan import AttnDecodePlan
from flashtune.kernel_templates.direct import current_device as _current_device
from flashtune.kernel_templates.direct import current_stream as _current_stream
from flashtune.runtime.checks import SUPPORTED_DTYPES, check_grid, check_score_mods
from flashtune.runtime.lookup import ConfigChoice, Dispatcher

log = logging.getLogger(__name__)

__all__ = ["DECODE_MAX_QUERIES", "DECODE_MIN_KEYS", "attention_with_kvcache", "decode_route"]

_SPEC = get_template("attn_decode")
DISPATCH = Dispatcher(_SPEC)
# the plan key (see _plan_key) -> the launch plan of a CUDA call signature
_PLANS: dict[tuple[Any, ...], AttnDecodePlan] = {}
_DIRECT = direct.supported()
_Tensor = torch.Tensor

# flashtune.attention considers attn_decode for at most this many queries (the template's
# design point: a GQA group's rows x Nq fit one tile)
DECODE_MAX_QUERIES = 16
# ... and, without tuned timings of both templates for the problem, routes to it from this
# many keys on. H100, GQA 32:8, D 128, bf16, both templates' defaults, CUDA-graph timed
# (benchmarks/results/decode_route_h100.json): attn_decode was faster at every measured
# point, Nq 1/4/16 x Nk 64..4096 x B 1/16 (1.07x at B 1, Nq 16, Nk 128; 1.3-6.4x at Nq 1);
# below 64 keys nothing was measured, so attn_fwd keeps those
DECODE_MIN_KEYS = 64


@cache
def _device(device_type: str, index: int | None) -> DeviceFingerprint:
    return current_device(torch.device(device_type, index) if index is not None
                          else torch.device(device_type))


def decode_route(problem: AttentionProblem, device: DeviceFingerprint,
                 fwd: Dispatcher, *, warn: bool = True) -> ConfigChoice | None:
    """The attn_decode config :func:`flashtune.attention` runs ``problem`` (dense K/V) with,
    or None to run it with attn_fwd (``fwd``'s dispatcher).

    Only problems with at most :data:`DECODE_MAX_QUERIES` queries are candidates (score
    modifications included: attn_decode serves them as attn_fwd does). When both
    templates have a config tuned for exactly this problem on this device, the faster
    measured one wins; otherwise (the heuristic, untuned) attn_decode runs problems with at
    least :data:`DECODE_MIN_KEYS` keys, where splitting the keys over programs and reading
    K/V once per GQA group pays.

    Arguments:
        problem: the call's problem (dense K/V: ``seqlen_k`` is the keys' length).
        device: the device it runs on.
        fwd: attn_fwd's dispatcher (for its tuned timing of the same problem).
        warn: warn when attn_decode's template default is the answer (False: the caller
            may serve the call otherwise and warns itself when it does not).
    Returns:
        attn_decode's :class:`~flashtune.runtime.lookup.ConfigChoice`, or None for attn_fwd.
    """
    if problem.seqlen_q > DECODE_MAX_QUERIES:
        return None
    dec_exact = DISPATCH.exact(problem, device)
    fwd_exact = fwd.exact(problem, device)
    if dec_exact is not None and fwd_exact is not None:
        if fwd_exact.median_ms <= dec_exact.median_ms:
            return None
    elif dec_exact is None and problem.seqlen_k < DECODE_MIN_KEYS:
        return None
    return DISPATCH.choose(problem, device) if warn else DISPATCH.peek(problem, device)


def reset() -> None:
    """Drop the launch plans (``flashtune.reload_configs`` calls this, and reloads
    :data:`DISPATCH`, which holds the memoised configs)."""
    _PLANS.clear()


def _explicit_config(config: Mapping[str, Any], problem: AttentionProblem,
                     device: DeviceFingerprint) -> Config:
    cfg = _SPEC.space.validate(config)
    reason = _SPEC.space.check(cfg, problem, device)
    if reason is not None:
        raise ConfigError(f"config {cfg} cannot run {problem.describe()} on {device.name}: "
                          f"{reason}")
    return cfg


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def _check_float(name: str, t: Any, dims: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise InputTypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 4:
        raise InputError(f"{name} must have 4 dimensions {dims}, got shape {_shape(t)}")
    if t.dtype not in SUPPORTED_DTYPES:
        raise InputTypeError(f"{name} must be float16 or bfloat16, got {t.dtype}")
    if t.numel() == 0:
        raise InputError(f"{name} is empty (shape {_shape(t)}); every dimension must be >= 1")
    if t.stride(-1) != 1 and t.shape[-1] != 1:
        raise InputError(f"{name} must be contiguous in its last dimension (stride 1), got "
                         f"strides {tuple(t.stride())}; call .contiguous() first")


def _check_int32(name: str, t: Any, shape: tuple[int | None, ...], dims: str) -> None:
    """An int32 tensor of ``shape`` (None: any size)."""
    if not isinstance(t, torch.Tensor):
        raise InputTypeError(f"{name} must be an int32 torch.Tensor {dims}, got "
                             f"{type(t).__name__}")
    if t.dtype != torch.int32:
        raise InputTypeError(f"{name} must have dtype torch.int32, got {t.dtype}; "
                             f"convert it with .to(torch.int32)")
    if t.dim() != len(shape) or any(want is not None and got != want
                                    for got, want in zip(t.shape, shape)):
        want_text = ", ".join("any" if w is None else str(w) for w in shape)
        want_text += "," if len(shape) == 1 else ""
        raise InputError(f"{name} must have shape {dims} = ({want_text}), got {_shape(t)}")


def check_kvcache_inputs(q: Any, k_cache: Any, v_cache: Any, cache_seqlens: Any,
                         block_table: Any, scale: Any) -> None:
    """Raise a clear ``InputError``/``InputTypeError``/``DeviceError`` for bad arguments;
    metadata only (no device sync)."""
    paged = block_table is not None
    cache_dims = ("(num_pages, heads_kv, page_size, head_dim)" if paged
                  else "(batch, heads_kv, max_seqlen, head_dim)")
    _check_float("q", q, "(batch, heads_q, seqlen_q, head_dim)")
    _check_float("k_cache", k_cache, cache_dims)
    _check_float("v_cache", v_cache, cache_dims)
    if not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise InputTypeError(f"q, k_cache and v_cache must share one dtype, got q {q.dtype}, "
                             f"k_cache {k_cache.dtype}, v_cache {v_cache.dtype}")
    if k_cache.shape != v_cache.shape:
        raise InputError(f"k_cache and v_cache must have the same shape {cache_dims}, got "
                         f"k_cache {_shape(k_cache)} and v_cache {_shape(v_cache)}")
    batch, heads_q, _, head_dim = q.shape
    if k_cache.shape[3] != head_dim:
        raise InputError(f"head_dim mismatch: q has {head_dim}, k_cache/v_cache have "
                         f"{k_cache.shape[3]}")
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise InputError(f"head_dim {head_dim} is not supported; supported: "
                         f"{list(SUPPORTED_HEAD_DIMS)}")
    if heads_q % k_cache.shape[1]:
        raise InputError(f"q's heads ({heads_q}) must be a multiple of the cache's heads "
                         f"({k_cache.shape[1]}) for GQA/MQA")
    if not paged and k_cache.shape[0] != batch:
        raise InputError(f"batch mismatch: q has batch {batch}, k_cache/v_cache have "
                         f"{k_cache.shape[0]} (a contiguous cache is (batch, heads_kv, "
                         f"max_seqlen, head_dim); pass block_table for a paged one)")
    _check_int32("cache_seqlens", cache_seqlens, (batch,), "(batch,)")
    if batch > 1 and cache_seqlens.stride(0) != 1:
        # the kernel reads cache_seqlens[b] at offset b: it takes no stride
        raise InputError(f"cache_seqlens must be contiguous (stride 1), got stride "
                         f"{cache_seqlens.stride(0)} (an expanded, sliced or column view?); "
                         f"call .contiguous() first")
    if paged:
        _check_int32("block_table", block_table, (batch, None), "(batch, max_pages)")
        if block_table.shape[1] < 1:
            raise InputError("block_table has no columns; it must be (batch, max_pages) "
                             "with max_pages >= 1")
    tensors = [("q", q), ("k_cache", k_cache), ("v_cache", v_cache),
               ("cache_seqlens", cache_seqlens)]
    if paged:
        tensors.append(("block_table", block_table))
    for name, t in tensors[1:]:
        if t.device != q.device:
            raise InputError(f"{name} is on {t.device} but q is on {q.device}; every tensor "
                             f"must be on one device")
    if scale is not None:
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) \
                or not math.isfinite(scale):
            raise InputError(f"scale must be a finite float or None, got {scale!r}")
    if q.device.type == "cpu":
        if not interpreting():
            raise DeviceError("the tensors are on the CPU: flashtune runs on CPU only under "
                              "the Triton interpreter; set TRITON_INTERPRET=1 before importing "
                              "flashtune, or move the tensors to a CUDA device")
    elif q.device.type != "cuda":
        raise DeviceError(f"the tensors are on {q.device}; flashtune needs CUDA tensors (or "
                          f"CPU tensors under TRITON_INTERPRET=1)")
    check_grid(q, k_cache, decode=True)


def check_kvcache_tables(k_cache: torch.Tensor, cache_seqlens: torch.Tensor,
                         block_table: torch.Tensor | None) -> None:
    """Check the *values* of ``cache_seqlens`` and ``block_table``: copies them to the host
    (a device sync on CUDA)."""
    lens = cache_seqlens.detach().to("cpu", torch.int64)
    page_size, num_pages = 1, 0
    if block_table is not None:
        page_size, num_pages = k_cache.shape[2], k_cache.shape[0]
        capacity = block_table.shape[1] * page_size
        what = f"block_table's capacity ({block_table.shape[1]} pages x page_size {page_size})"
    else:
        capacity = k_cache.shape[2]
        what = f"k_cache's max_seqlen ({capacity})"
    bad = torch.nonzero(lens < 0).flatten()
    if bad.numel():
        b = int(bad[0])
        raise InputError(f"cache_seqlens[{b}] = {int(lens[b])} is negative; lengths must be "
                         f">= 0")
    bad = torch.nonzero(lens > capacity).flatten()
    if bad.numel():
        b = int(bad[0])
        raise InputError(f"cache_seqlens[{b}] = {int(lens[b])} exceeds {what}")
    if block_table is not None:
        table = block_table.detach().to("cpu", torch.int64)
        used = torch.arange(table.shape[1])[None, :] < (-(-lens // page_size))[:, None]
        wrong = used & ((table < 0) | (table >= num_pages))
        if wrong.any():
            b, j = (int(x) for x in torch.nonzero(wrong)[0])
            raise InputError(f"block_table[{b}, {j}] = {int(table[b, j])} is not a page of the "
                             f"cache: page ids must be in [0, {num_pages}) (k_cache has "
                             f"{num_pages} pages); sequence {b} of length {int(lens[b])} "
                             f"uses its first {-(-int(lens[b]) // page_size)} entries")


def attention_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    *,
    block_table: torch.Tensor | None = None,
    causal: bool = True,
    scale: float | None = None,
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    return_lse: bool = False,
    config: Mapping[str, int] | None = None,
    check_tables: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of a few new queries per sequence over that sequence's KV cache.

    Inference only: no gradients flow to q/k_cache/v_cache (the output has no
    ``grad_fn``, even for tensors that require grad); use :func:`flashtune.attention` to
    train.

    Arguments:
        q: ``(batch, heads_q, seqlen_q, head_dim)``, the new queries (meant for
            ``seqlen_q <= 16``: decoding, speculative verification; longer runs too).
        k_cache, v_cache: without ``block_table``, ``(batch, heads_kv, max_seqlen,
            head_dim)``; with it, ``(num_pages, heads_kv, page_size, head_dim)``. Any strides
            with a contiguous last dim, so ``(batch, max_seqlen, heads_kv, head_dim)``
            storage viewed with ``.transpose(1, 2)`` runs without a copy. ``heads_q`` a
            multiple of ``heads_kv`` (GQA/MQA without copying K/V).
            q and the caches: float16 or bfloat16, one dtype, one CUDA device (or CPU under
            ``TRITON_INTERPRET=1``); head_dim in 16, 32, 64, 96, 128, 192, 256.
        cache_seqlens: int32 ``(batch,)``, contiguous (not an expanded, sliced or column
            view): sequence ``b`` attends to its keys
            ``[0, cache_seqlens[b])`` (the new tokens' keys included, if already written).
            0 is allowed (the rows return zeros).
        block_table: int32 ``(batch, max_pages)``: key ``j`` of sequence ``b`` is slot
            ``j % page_size`` of page ``block_table[b, j // page_size]``. Entries past a
            sequence's last page are never read. Any page size, any strides.
        causal: bottom-right aligned against each sequence's own length: query ``i`` sees
            key ``j`` iff ``j <= i + cache_seqlens[b] - seqlen_q``. Rows that see no key
            return zeros (and LSE ``-inf``). Irrelevant for ``seqlen_q == 1``.
        scale: softmax scale; default ``1 / sqrt(head_dim)``.
        window: FlashAttention-2's ``window_size``: ``(left, right)``, query ``i`` of
            sequence ``b`` (at key position ``pos = i + cache_seqlens[b] - seqlen_q``)
            sees keys ``[pos - left, pos + right]``; -1 leaves a side unbounded; with
            ``causal`` the right bound is 0. Keys before the window are never read (a
            sliding window over a long cache costs O(window)). None or ``(-1, -1)``: none.
        softcap: FlashAttention-2's ``softcap``: scores become ``softcap * tanh(s /
            softcap)`` before the mask (Gemma-2); None or 0.0: none.
        alibi_slopes: float32 ``(heads_q,)`` or ``(batch, heads_q)`` on q's device: scores
            get ``-slope * |pos - j|`` (FlashAttention-2's ``alibi_slopes``).
        return_lse: also return the float32 log-sum-exp ``(batch, heads_q, seqlen_q)`` (of
            the modified scores).
        config: explicit ``attn_decode`` config (``BLOCK_N``, ``NUM_SPLITS``,
            ``num_warps``, ``num_stages``); default: the tuned one for this device and
            problem (see the module docstring), else the template default.
        check_tables: also check the *values* of ``cache_seqlens`` and ``block_table``
            (lengths in ``[0, capacity]``, used page ids in ``[0, num_pages)``). This copies
            them to the host and synchronises with the device; without it (the default on
            CUDA) bad values are the caller's responsibility, as in flash-attention and vLLM.
            On CPU (the interpreter) the values are always checked.
    Returns:
        ``out`` of ``q``'s shape and dtype (contiguous), or ``(out, lse)``.
    Raises:
        InputError / InputTypeError (``ValueError`` / ``TypeError``) for bad arguments (and
        on CUDA for ``batch x heads_kv`` over 65535, the launch grid's limit: split the
        batch), ConfigError (``ValueError``) for a config outside the space or unfit for the
        problem, DeviceError for CPU tensors without the interpreter. All before any launch.
    """
    key = None
    if config is None and _DIRECT and not check_tables and type(q) is _Tensor \
            and type(k_cache) is _Tensor and type(v_cache) is _Tensor and q.is_cuda \
            and type(cache_seqlens) is _Tensor \
            and (block_table is None or type(block_table) is _Tensor):
        mods = _mods_key(window, softcap, alibi_slopes)
        if mods is not None:
            key = _plan_key(q, k_cache, v_cache, cache_seqlens, block_table, causal, scale,
                            return_lse) + mods
            plan = _PLANS.get(key)
            if plan is not None and _current_device() == plan.device_index \
                    and not direct.hooks_installed():
                return plan(q, k_cache, v_cache, cache_seqlens, block_table,
                            _current_stream(plan.device_index),
                            None if alibi_slopes is None else alibi_slopes.contiguous())
    check_kvcache_inputs(q, k_cache, v_cache, cache_seqlens, block_table, scale)
    (left, right), cap, slopes = check_score_mods(q, causal=causal, window=window,
                                                  softcap=softcap, alibi_slopes=alibi_slopes)
    if check_tables or q.device.type == "cpu":
        check_kvcache_tables(k_cache, cache_seqlens, block_table)
    batch, heads_q, seqlen_q, head_dim = q.shape
    capacity = (block_table.shape[1] * k_cache.shape[2] if block_table is not None
                else k_cache.shape[2])
    problem = AttentionProblem(int(batch), int(heads_q), int(k_cache.shape[1]), int(seqlen_q),
                               int(capacity), int(head_dim), bool(causal),
                               "fp16" if q.dtype == torch.float16 else "bf16", left,
                               -1 if causal else right, cap or 0.0, slopes is not None)
    device = _device(q.device.type, q.device.index)
    if config is None:
        cfg = DISPATCH.choose(problem, device).config
    else:
        cfg = _explicit_config(config, problem, device)
    if key is not None and _current_device() == q.get_device() \
            and not direct.hooks_installed():
        plan = _new_plan(q, k_cache, v_cache, cache_seqlens, block_table, cfg, causal, scale,
                         return_lse, key, (left, right), cap, slopes)
        if plan is not None:
            return plan(q, k_cache, v_cache, cache_seqlens, block_table,
                        _current_stream(plan.device_index), slopes)
    return attn_decode_kvcache(q, k_cache, v_cache, cache_seqlens, cfg,
                               block_table=block_table, causal=causal, scale=scale,
                               return_lse=return_lse, window=(left, right), softcap=cap,
                               alibi_slopes=slopes)


def _mods_key(window: Any, softcap: Any, alibi_slopes: Any) -> tuple[Any, ...] | None:
    """The score modifications' part of the plan key: the arguments as given, and the ALiBi
    slopes' metadata (their values are read per call); None for arguments of types the key
    does not hold (the checks then name what is wrong)."""
    if window is not None and not (type(window) is tuple and len(window) == 2
                                   and type(window[0]) is int and type(window[1]) is int):
        return None
    if softcap is not None and type(softcap) is not float and type(softcap) is not int:
        return None
    if alibi_slopes is None:
        return (window, softcap, None)
    if type(alibi_slopes) is not _Tensor:
        return None
    return (window, softcap, alibi_slopes.shape, alibi_slopes.stride(), alibi_slopes.dtype,
            alibi_slopes.get_device(), alibi_slopes.data_ptr() & 15 == 0)


def _plan_key(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqlens: torch.Tensor,
              block_table: torch.Tensor | None, causal: bool, scale: Any,
              return_lse: bool) -> tuple[Any, ...]:
    """Everything the input checks, the config choice and Triton's specialisation read
    (the score modifications' part: :func:`_mods_key`)."""
    ptrs = q.data_ptr() | k.data_ptr() | v.data_ptr() | seqlens.data_ptr()
    if block_table is None:
        bt: Any = None
    else:
        bt = (block_table.shape, block_table.stride(), block_table.dtype,
              block_table.get_device())
        ptrs |= block_table.data_ptr()
    return (q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(),
            q.dtype, k.dtype, v.dtype, q.get_device(), k.get_device(), v.get_device(),
            seqlens.shape, seqlens.stride(), seqlens.dtype, seqlens.get_device(), bt,
            causal, scale, return_lse, ptrs & 15 == 0)


def _new_plan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqlens: Any,
              block_table: Any, cfg: Config, causal: bool, scale: float | None,
              return_lse: bool, key: tuple[Any, ...], window: tuple[int, int],
              softcap: float | None, alibi_slopes: torch.Tensor | None
              ) -> AttnDecodePlan | None:
    """Build and keep (under ``key``) the launch plan of this call signature; None if
    Triton's internals moved (then every call goes through the launcher)."""
    global _DIRECT
    try:
        plan = AttnDecodePlan(q, k, v, cfg, seqlens=seqlens, block_table=block_table,
                              causal=causal, scale=scale, return_lse=return_lse,
                              window=window, softcap=softcap, alibi_slopes=alibi_slopes)
    except Exception as exc:  # noqa: BLE001 - Triton internals moved: launch the normal way
        _DIRECT = False
        log.warning("flashtune: direct decode launches disabled (%s: %s); calls go through "
                    "Triton's launcher", type(exc).__name__, exc)
        return None
    _PLANS[key] = plan
    return plan


