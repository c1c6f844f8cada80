"""``attention_with_kvcache``: decoding attention over a contiguous or paged KV cache.

flash-attention's ``flash_attn_with_kvcache`` in flashtune's ``(batch, heads, seqlen,
head_dim)`` layout: a few new queries per sequence attend to their sequence's keys in a cache
that is either contiguous ``(batch_cache, heads_kv, max_seqlen, head_dim)`` or paged
``(num_pages, heads_kv, page_size, head_dim)`` with a block table, as in vLLM. With FA2's
options: new keys/values ``k``/``v`` appended in place at ``cache_seqlens[b]`` (paged or
not) and attended to; rotary embedding (``rotary_cos``/``rotary_sin``, GPT-J interleaved or
GPT-NeoX halves, ``rotary_dim <= head_dim``) of q and the new keys at each sequence's
positions; ``cache_batch_idx`` (which cache row each sequence uses); ``cache_leftpad``
(where each sequence's keys start). Its score modifications too, with FlashAttention-2's
meanings, per sequence (query ``i`` of sequence ``b`` sits at key position ``pos = i + L_b -
seqlen_q``, ``L_b = cache_seqlens[b] + seqlen_new``): a local ``window`` ``(left, right)``
(keys ``[pos - left, pos + right]``, -1 unbounded; causal is the right bound 0), a logit
``softcap`` and ``alibi_slopes`` (``-slope * |pos - j|``). A window's splits cover only the
keys some query sees, so a sliding window over a long cache costs O(window).

One launch (two with split-KV's combine) does the append, the rotary and the attention:
the splits walk the cached keys as the attention alone does (each rotating its own q tile),
and one more program per KV head (the only one with a single split) reads the new keys from
``k``/``v``, rotates them once, writes them and its new values into the cache and attends
to them; a decode step needs no separate cache write, rotary kernel or copy (see
``kernel_templates/attn_decode/kernel.py``).

Checks, and which ones cost a device sync:

* Everything that metadata shows (types, dtypes, shapes, strides, devices, head counts, page
  size, ``k``/``v`` against q and the cache, ``rotary_cos`` covering the cache's capacity,
  ``rotary_dim <= head_dim``, ``cache_batch_idx``/``cache_leftpad`` not with
  ``block_table``) is checked on every call that does not replay a plan, with no device
  sync, before any launch.
* The values inside ``cache_seqlens``, ``block_table``, ``cache_batch_idx`` and
  ``cache_leftpad`` (lengths in ``[0, capacity - seqlen_new]``, the appended keys counted,
  against ``k_cache``'s max_seqlen or ``block_table``'s ``max_pages x page_size``; used page
  ids in ``[0, num_pages)``; cache rows in ``[0, batch_cache)``; left pads in ``[0,
  cache_seqlens[b]]``) need the data: they are checked with ``check_tables=True``, which
  copies the tables to the host and so synchronises with the device, and by default on CPU
  tensors (the Triton interpreter), never during CUDA-graph capture.
* Without those checks (the default on CUDA, and under graph capture) the call stays
  memory-safe: the kernel clamps what it reads (lengths to ``[0, capacity]``, appended keys
  past the capacity dropped, page ids into ``[0, num_pages)`` for reads and not written
  through when out of range, a cache row out of range making the sequence empty, left pads
  to ``[0, L_b]``, cos/sin rows past their end unread). Bad values give wrong rows, never a
  read or write outside the tensors.

Configs: an explicit ``config`` (checked against the ``attn_decode`` space), else the one
the ``attn_decode`` :class:`~flashtune.runtime.lookup.Dispatcher` serves (tuned exact ->
bucket -> nearest -> template default, as for ``attn_fwd``) for the problem, whose key is an
:class:`~flashtune.core.problem.AttentionProblem` with ``seqlen_k`` the cache's
capacity (metadata: no device sync, and one key for every step of a decoding loop) and the
score modifications. The cache options are not part of the problem: the append and the
rotary add O(seqlen_new) rows of work per KV head and a q-tile rotation per program to a
walk over the whole cache, which does not move the best split count or tile, so a decode
step with them runs the config tuned for the attention alone.

Hot path on CUDA: after the first call of a call signature (shapes, strides, dtypes, device,
16-byte alignment, paged or not, causal, scale, return_lse, window, softcap, the ALiBi
slopes' metadata, the cache options' metadata), a call checks nothing again and
replays an :class:`~flashtune.kernel_templates.attn_decode.plan.AttnDecodePlan` (the compiled
split and combine kernels with their fixed arguments): a dict read, the allocations and the
launches.

:func:`decode_route` is how :func:`flashtune.attention` decides whether a short-query call
on dense K/V runs this template instead of ``attn_fwd``.

Under ``torch.compile`` the call is one custom op, ``flashtune::attention_with_kvcache``,
that declares it writes ``k_cache`` and ``v_cache`` (no graph break; reads of the caches
after it see the appended keys).
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
from flashtune.core.problem import MAX_HEAD_DIM, AttentionProblem
from flashtune.core.space import Config, config_from_text, config_text
from flashtune.kernel_templates import direct, get_template
from flashtune.kernel_templates.attn_decode.launcher import attn_decode_kvcache
from flashtune.kernel_templates.attn_decode.plan import AttnDecodePlan
from flashtune.kernel_templates.direct import current_device as _current_device
from flashtune.kernel_templates.direct import current_stream as _current_stream
from flashtune.runtime.checks import check_grid, check_score_mods
from flashtune.runtime.kvcache_checks import (
    check_cache_options,
    check_float,
    check_int32,
    check_kvcache_tables,
    check_per_sequence,
)
from flashtune.runtime.lookup import ConfigChoice, Dispatcher, remember

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
                 fwd: Dispatcher) -> ConfigChoice | None:
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
    return DISPATCH.choose(problem, device)


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


def check_kvcache_inputs(q: Any, k_cache: Any, v_cache: Any, cache_seqlens: Any,
                         block_table: Any, scale: Any, *, cache_batch_idx: Any = None
                         ) -> None:
    """Raise a clear ``InputError``/``InputTypeError``/``DeviceError`` for bad arguments;
    metadata only (no device sync). With ``cache_batch_idx`` a contiguous cache's batch
    may differ from q's (the cache options themselves: :func:`check_cache_options`)."""
    paged = block_table is not None
    cache_dims = ("(num_pages, heads_kv, page_size, head_dim)" if paged
                  else "(batch, heads_kv, max_seqlen, head_dim)")
    check_float("q", q, "(batch, heads_q, seqlen_q, head_dim)")
    check_float("k_cache", k_cache, cache_dims)
    check_float("v_cache", v_cache, cache_dims)
    if not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise InputTypeError(f"q, k_cache and v_cache must share one dtype, got q {q.dtype}, "
                             f"k_cache {k_cache.dtype}, v_cache {v_cache.dtype}")
    if k_cache.shape != v_cache.shape:
        raise InputError(f"k_cache and v_cache must have the same shape {cache_dims}, got "
                         f"k_cache {tuple(k_cache.shape)} and v_cache "
                         f"{tuple(v_cache.shape)}")
    batch, heads_q, _, head_dim = q.shape
    if k_cache.shape[3] != head_dim:
        raise InputError(f"head_dim mismatch: q has {head_dim}, k_cache/v_cache have "
                         f"{k_cache.shape[3]}")
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise InputError(f"head_dim {head_dim} is not supported; supported: 1 to "
                         f"{MAX_HEAD_DIM} (FlashAttention-2's range)")
    if heads_q % k_cache.shape[1]:
        raise InputError(f"q's heads ({heads_q}) must be a multiple of the cache's heads "
                         f"({k_cache.shape[1]}) for GQA/MQA")
    if not paged and cache_batch_idx is None and k_cache.shape[0] != batch:
        raise InputError(f"batch mismatch: q has batch {batch}, k_cache/v_cache have "
                         f"{k_cache.shape[0]} (a contiguous cache is (batch, heads_kv, "
                         f"max_seqlen, head_dim); pass block_table for a paged one, or "
                         f"cache_batch_idx to pick cache rows)")
    # the kernel reads cache_seqlens[b] at offset b: it takes no stride
    check_per_sequence("cache_seqlens", cache_seqlens, batch)
    if paged:
        check_int32("block_table", block_table, (batch, None), "(batch, max_pages)")
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


def attention_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    *,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    rotary_cos: torch.Tensor | None = None,
    rotary_sin: torch.Tensor | None = None,
    rotary_interleaved: bool = True,
    cache_batch_idx: torch.Tensor | None = None,
    cache_leftpad: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    causal: bool = True,
    scale: float | None = None,
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    return_lse: bool = False,
    config: Mapping[str, int] | None = None,
    check_tables: bool | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of a few new queries per sequence over that sequence's KV cache, after
    appending the new keys/values to it in place (FlashAttention-2's
    ``flash_attn_with_kvcache``, in flashtune's ``(batch, heads, seqlen, head_dim)`` layout).

    Inference only: no gradients flow to q/k_cache/v_cache (the output has no
    ``grad_fn``, even for tensors that require grad); use :func:`flashtune.attention` to
    train.

    Sequence ``b`` attends to its keys ``[cache_leftpad[b], L_b)`` with ``L_b =
    cache_seqlens[b] + seqlen_new`` (``seqlen_new`` 0 without ``k``/``v``).

    Arguments:
        q: ``(batch, heads_q, seqlen_q, head_dim)``, the new queries (meant for
            ``seqlen_q <= 16``: decoding, speculative verification; longer runs too).
        k_cache, v_cache: without ``block_table``, ``(batch_cache, heads_kv, max_seqlen,
            head_dim)`` (``batch_cache == batch`` unless ``cache_batch_idx`` is given); with
            it, ``(num_pages, heads_kv, page_size, head_dim)``. Any strides with a
            contiguous last dim, so ``(batch, max_seqlen, heads_kv, head_dim)`` storage
            viewed with ``.transpose(1, 2)`` runs without a copy. ``heads_q`` a multiple of
            ``heads_kv`` (GQA/MQA without copying K/V). Updated in place when ``k``/``v``
            are given.
            q and the caches: float16 or bfloat16, one dtype, one CUDA device (or CPU under
            ``TRITON_INTERPRET=1``); head_dim 1 to 256.
        cache_seqlens: int32 ``(batch,)``, contiguous (not an expanded, sliced or column
            view): the keys already in sequence ``b``'s cache, ``[0, cache_seqlens[b])``.
            0 is allowed (without new keys the rows return zeros).
        k, v: ``(batch, heads_kv, seqlen_new, head_dim)``, q's dtype, last dim contiguous:
            new keys and values, written into the cache at positions ``cache_seqlens[b] ..
            cache_seqlens[b] + seqlen_new - 1`` of sequence ``b`` (through ``block_table``
            when paged; into row ``cache_batch_idx[b]`` when given) and attended to. The
            cache must hold them: ``cache_seqlens[b] + seqlen_new <= capacity`` (see
            ``check_tables``). ``cache_seqlens`` is not advanced: the caller adds
            ``seqlen_new`` for the next step.
        rotary_cos, rotary_sin: ``(seqlen_ro, rotary_dim / 2)``, contiguous, q's dtype or
            float32, ``seqlen_ro`` at least the cache's capacity, ``rotary_dim <=
            head_dim`` (even); need ``k``/``v``. The first ``rotary_dim`` dims of the new
            keys are rotated at their positions ``cache_seqlens[b] + t`` before they are
            written; those of q at ``cache_seqlens[b] + i`` when the call is causal or
            local (a window bound below the capacity), else every query at
            ``cache_seqlens[b]`` (FlashAttention-2's rule). fp32 math, rounded to the
            input dtype.
        rotary_interleaved: True: GPT-J style, dims ``(2t, 2t + 1)`` turn together; False:
            GPT-NeoX style, dims ``(t, t + rotary_dim / 2)``.
        cache_batch_idx: int32 ``(batch,)``, contiguous: sequence ``b`` uses row
            ``cache_batch_idx[b]`` of a contiguous cache (not with ``block_table``). With
            ``k``/``v``, duplicate rows get the new keys of any one of their sequences.
        cache_leftpad: int32 ``(batch,)``, contiguous: sequence ``b``'s keys start at
            ``cache_leftpad[b] <= cache_seqlens[b]``; keys before it are not attended to.
            Positions (rotary, causal, window, ALiBi) stay those of the cache's slots (not
            with ``block_table``).
        block_table: int32 ``(batch, max_pages)``: key ``j`` of sequence ``b`` is slot
            ``j % page_size`` of page ``block_table[b, j // page_size]``. Entries past a
            sequence's last page (``L_b`` counted) are never read. Any page size, any
            strides.
        causal: bottom-right aligned against each sequence's own length: query ``i`` sees
            key ``j`` iff ``j <= i + L_b - seqlen_q``. Rows that see no key return zeros
            (and LSE ``-inf``). Irrelevant for ``seqlen_q == 1`` (but for q's rotary).
        scale: softmax scale; default ``1 / sqrt(head_dim)``.
        window: FlashAttention-2's ``window_size``: ``(left, right)``, query ``i`` of
            sequence ``b`` (at key position ``pos = i + L_b - seqlen_q``) sees keys ``[pos -
            left, pos + right]``; -1 leaves a side unbounded; with ``causal`` the right
            bound is 0. Keys before the window are never read (a sliding window over a long
            cache costs O(window)). None or ``(-1, -1)``: none.
        softcap: FlashAttention-2's ``softcap``: scores become ``softcap * tanh(s /
            softcap)`` before the mask (Gemma-2); None or 0.0: none.
        alibi_slopes: float32 ``(heads_q,)`` or ``(batch, heads_q)`` on q's device: scores
            get ``-slope * |pos - j|`` (FlashAttention-2's ``alibi_slopes``).
        return_lse: also return the float32 log-sum-exp ``(batch, heads_q, seqlen_q)`` (of
            the modified scores).
        config: explicit ``attn_decode`` config (``BLOCK_N``, ``NUM_SPLITS``,
            ``num_warps``, ``num_stages``); default: the tuned one for this device and
            problem (see the module docstring; the cache options are not part of the
            problem), else the template default.
        check_tables: check the *values* of ``cache_seqlens``, ``block_table``,
            ``cache_batch_idx`` and ``cache_leftpad`` (lengths in ``[0, capacity -
            seqlen_new]``, used page ids in ``[0, num_pages)``, cache rows in ``[0,
            batch_cache)``, left pads in ``[0, cache_seqlens[b]]``). This copies them to
            the host and synchronises with the device. None (default): on CPU tensors (the
            interpreter) only; True: always, except during CUDA-graph capture (skipped
            there); False: never. Unchecked bad values give wrong rows, never an
            out-of-bounds access (the kernel clamps them, see the module docstring).
    Returns:
        ``out`` of ``q``'s shape and dtype (contiguous), or ``(out, lse)``.
    Raises:
        InputError / InputTypeError (``ValueError`` / ``TypeError``) for bad arguments (and
        on CUDA for ``batch x heads_kv`` over 65535, the launch grid's limit: split the
        batch), ConfigError (``ValueError``) for a config outside the space or unfit for the
        problem, DeviceError for CPU tensors without the interpreter. All before any launch
        (so before the cache is written).
    """
    if torch.compiler.is_compiling():
        return _compiled(q, k_cache, v_cache, cache_seqlens, k, v, rotary_cos, rotary_sin,
                         rotary_interleaved, cache_batch_idx, cache_leftpad, block_table,
                         causal, scale, window, softcap, alibi_slopes, return_lse, config,
                         check_tables)
    key = None
    if config is None and _DIRECT and (check_tables is None or check_tables is False) \
            and type(q) is _Tensor \
            and type(k_cache) is _Tensor and type(v_cache) is _Tensor and q.is_cuda \
            and type(cache_seqlens) is _Tensor \
            and (block_table is None or type(block_table) is _Tensor):
        mods = _mods_key(window, softcap, alibi_slopes)
        opts = _options_key(k, v, rotary_cos, rotary_sin, rotary_interleaved, cache_batch_idx,
                            cache_leftpad)
        if mods is not None and opts is not None:
            key = _plan_key(q, k_cache, v_cache, cache_seqlens, block_table, causal, scale,
                            return_lse) + mods + opts
            plan = _PLANS.get(key)
            if plan is not None and _current_device() == plan.device_index \
                    and not direct.hooks_installed():
                return plan(q, k_cache, v_cache, cache_seqlens, block_table,
                            _current_stream(plan.device_index),
                            None if alibi_slopes is None else alibi_slopes.contiguous(),
                            k, v, rotary_cos, rotary_sin, cache_batch_idx, cache_leftpad)
    check_kvcache_inputs(q, k_cache, v_cache, cache_seqlens, block_table, scale,
                         cache_batch_idx=cache_batch_idx)
    batch, heads_q, seqlen_q, head_dim = q.shape
    capacity = (block_table.shape[1] * k_cache.shape[2] if block_table is not None
                else k_cache.shape[2])
    check_cache_options(q, k_cache, k, v, rotary_cos, rotary_sin, rotary_interleaved,
                        cache_batch_idx, cache_leftpad, block_table, capacity)
    (left, right), cap, slopes = check_score_mods(q, causal=causal, window=window,
                                                  softcap=softcap, alibi_slopes=alibi_slopes)
    if _check_values(check_tables, q):
        check_kvcache_tables(k_cache, cache_seqlens, block_table,
                             seqlen_new=0 if k is None else int(k.shape[2]),
                             cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad)
    problem = AttentionProblem(int(batch), int(heads_q), int(k_cache.shape[1]), int(seqlen_q),
                               int(capacity), int(head_dim), bool(causal),
                               "fp16" if q.dtype == torch.float16 else "bf16", left,
                               -1 if causal else right, cap or 0.0, slopes is not None)
    device = _device(q.device.type, q.device.index)
    if config is None:
        cfg = DISPATCH.choose(problem, device).config
    else:
        cfg = _explicit_config(config, problem, device)
    options = dict(k_new=k, v_new=v, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
                   rotary_interleaved=rotary_interleaved, cache_batch_idx=cache_batch_idx,
                   cache_leftpad=cache_leftpad)
    if key is not None and _current_device() == q.get_device() \
            and not direct.hooks_installed():
        plan = _new_plan(q, k_cache, v_cache, cache_seqlens, block_table, cfg, causal, scale,
                         return_lse, key, (left, right), cap, slopes, options)
        if plan is not None:
            return plan(q, k_cache, v_cache, cache_seqlens, block_table,
                        _current_stream(plan.device_index), slopes, k, v, rotary_cos,
                        rotary_sin, cache_batch_idx, cache_leftpad)
    return attn_decode_kvcache(q, k_cache, v_cache, cache_seqlens, cfg,
                               block_table=block_table, causal=causal, scale=scale,
                               return_lse=return_lse, window=(left, right), softcap=cap,
                               alibi_slopes=slopes, k=k, v=v, rotary_cos=rotary_cos,
                               rotary_sin=rotary_sin, rotary_interleaved=rotary_interleaved,
                               cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad)


def _check_values(check_tables: Any, q: torch.Tensor) -> bool:
    """Whether this call checks the tables' values (a device sync on CUDA): as asked, by
    default on CPU tensors only, never while a CUDA graph is being captured."""
    if check_tables is not None and not isinstance(check_tables, bool):
        raise InputTypeError(f"check_tables must be True, False or None, got "
                             f"{check_tables!r}")
    want = q.device.type == "cpu" if check_tables is None else check_tables
    return want and not (q.is_cuda and torch.cuda.is_current_stream_capturing())


# the options' part of the plan key of a call without any
_NO_OPTIONS = (None, None, None, None, None, None, None, True)


def _options_key(k: Any, v: Any, rotary_cos: Any, rotary_sin: Any, rotary_interleaved: Any,
                 cache_batch_idx: Any, cache_leftpad: Any) -> tuple[Any, ...] | None:
    """The cache options' part of the plan key: each tensor's metadata and their 16-byte
    alignment (their values are read per call); None for arguments of types the key does
    not hold (the checks then name what is wrong)."""
    if type(rotary_interleaved) is not bool:
        return None
    if k is None and v is None and rotary_cos is None and rotary_sin is None \
            and cache_batch_idx is None and cache_leftpad is None:
        return _NO_OPTIONS
    parts: list[Any] = []
    ptrs = 0
    for t in (k, v, rotary_cos, rotary_sin, cache_batch_idx, cache_leftpad):
        if t is None:
            parts.append(None)
            continue
        if type(t) is not _Tensor:
            return None
        parts.append((t.shape, t.stride(), t.dtype, t.get_device()))
        ptrs |= t.data_ptr()
    parts.append(rotary_interleaved if rotary_cos is not None else None)
    parts.append(ptrs & 15 == 0)
    return tuple(parts)


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
              softcap: float | None, alibi_slopes: torch.Tensor | None,
              options: Mapping[str, Any]) -> AttnDecodePlan | None:
    """Build and keep (under ``key``) the launch plan of this call signature; None if
    Triton's internals moved (then every call goes through the launcher)."""
    global _DIRECT
    try:
        plan = AttnDecodePlan(q, k, v, cfg, seqlens=seqlens, block_table=block_table,
                              causal=causal, scale=scale, return_lse=return_lse,
                              window=window, softcap=softcap, alibi_slopes=alibi_slopes,
                              **options)
    except Exception as exc:  # noqa: BLE001 - Triton internals moved: launch the normal way
        _DIRECT = False
        log.warning("flashtune: direct decode launches disabled (%s: %s); calls go through "
                    "Triton's launcher", type(exc).__name__, exc)
        return None
    return remember(_PLANS, key, plan)




# -- torch.compile: the call as one opaque op that writes the caches ---------------------------


def _compiled(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              cache_seqlens: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
              rotary_cos: torch.Tensor | None, rotary_sin: torch.Tensor | None,
              rotary_interleaved: bool, cache_batch_idx: torch.Tensor | None,
              cache_leftpad: torch.Tensor | None, block_table: torch.Tensor | None,
              causal: bool, scale: float | None, window: tuple[int, int] | None,
              softcap: float | None, alibi_slopes: torch.Tensor | None, return_lse: bool,
              config: Mapping[str, int] | None, check_tables: bool | None
              ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """:func:`attention_with_kvcache` while ``torch.compile`` traces: the custom op
    ``flashtune::attention_with_kvcache`` (it declares that it writes ``k_cache`` and
    ``v_cache``, so the compiler orders reads of the caches after it; no graph break)."""
    left, right = window if window is not None else (-1, -1)
    out, lse = torch.ops.flashtune.attention_with_kvcache(
        q, k_cache, v_cache, cache_seqlens, k, v, rotary_cos, rotary_sin, rotary_interleaved,
        cache_batch_idx, cache_leftpad, block_table, causal, scale, left, right,
        softcap or 0.0, alibi_slopes, return_lse,
        None if config is None else config_text(config),
        check_tables)
    return (out, lse) if return_lse else out


@torch.library.custom_op("flashtune::attention_with_kvcache", mutates_args=("k_cache", "v_cache"))
def _kvcache_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                cache_seqlens: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                rotary_cos: torch.Tensor | None, rotary_sin: torch.Tensor | None,
                rotary_interleaved: bool, cache_batch_idx: torch.Tensor | None,
                cache_leftpad: torch.Tensor | None, block_table: torch.Tensor | None,
                causal: bool, scale: float | None, window_left: int, window_right: int,
                softcap: float, alibi_slopes: torch.Tensor | None, return_lse: bool,
                config_str: str | None, check_tables: bool | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    window = None if (window_left, window_right) == (-1, -1) else (window_left, window_right)
    got = attention_with_kvcache(
        q, k_cache, v_cache, cache_seqlens, k=k, v=v, rotary_cos=rotary_cos,
        rotary_sin=rotary_sin, rotary_interleaved=rotary_interleaved,
        cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad, block_table=block_table,
        causal=causal, scale=scale, window=window, softcap=softcap or None,
        alibi_slopes=alibi_slopes, return_lse=return_lse,
        config=None if config_str is None else config_from_text(config_str),
        check_tables=check_tables)
    if isinstance(got, tuple):
        return got
    return got, _no_lse(q)


@_kvcache_op.register_fake
def _kvcache_fake(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  cache_seqlens: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                  rotary_cos: torch.Tensor | None, rotary_sin: torch.Tensor | None,
                  rotary_interleaved: bool, cache_batch_idx: torch.Tensor | None,
                  cache_leftpad: torch.Tensor | None, block_table: torch.Tensor | None,
                  causal: bool, scale: float | None, window_left: int, window_right: int,
                  softcap: float, alibi_slopes: torch.Tensor | None, return_lse: bool,
                  config_str: str | None, check_tables: bool | None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if return_lse:
        return out, q.new_empty(q.shape[:3], dtype=torch.float32)
    return out, _no_lse(q)


def _no_lse(q: torch.Tensor) -> torch.Tensor:
    """The op's second output when no LSE was asked for: an empty float32 tensor."""
    return q.new_empty((0,), dtype=torch.float32)
