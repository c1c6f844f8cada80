"""Host side of the Gluon backward: the three launches planned from a config
(:func:`plan`: scratch sizes, TMA descriptors, grids, the register split), :func:`attn_bwd_gluon`
to run them on a Hopper GPU (the registered launcher), and :func:`compile_sm90` to compile
the main kernel for sm_90 without one (``attn_fwd_gluon.launcher.ptxas_stats`` reads it).

Launches, in order on the current stream:

1. ``preprocess`` (grid ``(cdiv(Nq_pad, 64), B * Hq)``): ``delta`` and ``lse * log2 e`` into
   float32 ``(B * Hq, Nq_pad)`` scratch rows, the dQ accumulator zeroed;
2. ``main`` (grid ``(cdiv(Nk, BLOCK_N), B * Hkv)``, or with ``PERSISTENT`` one CTA an SM
   walking those tiles): dK and dV written, dS K added to the accumulator with fp32
   atomics;
3. ``convert`` (grid ``(cdiv(Nq, 64), B * Hq)``): ``dQ = scale * accumulator``.

``Nq_pad`` is ``Nq`` rounded up to ``BLOCK_M``: a query tile never reads another head's LSE
or writes another head's accumulator rows, so neither needs a mask. The accumulator is
float32 ``(B * Hq * Nq_pad, D)`` (``4 * B * Hq * Nq_pad * D`` bytes, freed on return).

Layouts: Q, K, V, dO are read through 2-D TMA descriptors (``attn_fwd_gluon``'s
``layout``): contiguous ``(B, H, N, D)`` or ``(B, N, H, D)`` storage seen as ``(B, H, N,
D)``; others are copied. dO is read in q's layout (copied to it when it differs); O is read
with plain loads (any strides, last dim contiguous). dQ, dK, dV are returned in the layouts
of q, k, v (``empty_like``).

The atomics make dQ's last bits depend on the order the CTAs add (not deterministic; dK, dV
are: one CTA sums each element in a fixed order). Callers that need bitwise reproducible
gradients run ``attn_bwd`` (``Limits.deterministic`` is False here).

Packed sequences (``cu_seqlens_q``/``cu_seqlens_k``, ``flash_attn_varlen_func``'s layout,
the kernels' ``VARLEN``): ``(total, H, D)`` tensors read through ``(total, H * D)`` TMA views
(any token stride TMA takes, heads ``D`` apart: :func:`packed_layout`), ``B`` the number of
sequences, ``Nq``/``Nk`` the longest ones (the grids), the scratch padded per sequence as
above (``(B * Hq, Nq_pad)`` rows), the LSE the forward's varlen ``(Hq, total_q)``; dQ, dK, dV
come back contiguous ``(total, H, D)``. Dense calls pass None for the ``cu_seqlens``
pointers and ``VARLEN`` False: their kernels are the code they were.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from flashtune.core.device import sm_count
from flashtune.core.errors import ConfigError, DeviceError, InputError, InputTypeError
from flashtune.core.mods import causal_window_left, softcap_value
from flashtune.core.packing import check_cu_seqlens
from flashtune.kernel_templates.attn_bwd_gluon.kernel import (
    SPLIT_D_MIN_D,
    gluon_attn_bwd_convert_dq,
    gluon_attn_bwd_kernel,
    gluon_attn_bwd_preprocess,
)

LOG2E = 1.4426950408889634
# the wgmma N of dK, dV and dQ; their accumulators fit 240 registers (at 256 each consumer
# holds half the head dim's: split_d)
HEAD_DIMS = (64, 128, 256)
PRE_BLOCK = 64  # rows per program of the preprocess and the dQ conversion
# BLOCK_M query rows per step, BLOCK_N keys per CTA (split between the consumers),
# NUM_STAGES Q/dO buffers, NUM_CONSUMERS consumer warpgroups
DEFAULT_CONFIG: dict[str, int] = {"BLOCK_M": 64, "BLOCK_N": 128, "NUM_STAGES": 2,
                                  "NUM_CONSUMERS": 2}
# knobs a config may leave out, and their value then: LPT 1 walks the CTAs longest first in
# sections of heads (kernel._tile), 0 a head's key blocks side by side; PERSISTENT 1 runs
# the same tiles in the same order on at most one CTA an SM (dense batches only); DQ_TMA 1
# adds dQ's partials with TMA bulk reduce-adds (FA3's writer), 0 with vector atomics;
# TMA_STORE 1 stores a whole block of dK and dV through the consumer's K and V rows in shared
# memory by TMA (FA3's epilogue), 0 from registers; EXPAND_GQA 1 runs a GQA problem as MHA, a
# CTA per query head reading its group's K and V (the kernel's KV_GROUP), then sums dK and
# dV over the group (FlashAttention-2's GQA backward), 0 walks a group's query heads in one
# CTA
OPTIONAL_CONFIG: dict[str, int] = {"LPT": 0, "PERSISTENT": 0, "DQ_TMA": 0, "TMA_STORE": 0,
                                   "EXPAND_GQA": 0}
# bytes of L2 a section's Q, dO and fp32 dQ accumulator may take where a CTA walks a GQA
# group's query heads (FA3's backward tile scheduler, SingleTileBwdLPTScheduler, budgets 40
# of the 50 MB for the three), and where it walks one query head (MHA, EXPAND_GQA). On an
# H200 (lpt_sections_b{16,8}_d128c_h200.json, lpt_b{16,40}_*_h200.json: the main kernel
# against cuDNN's backward, each budget a run) 16 MiB sections ran the one-head walks
# faster than 40: D128 MHA causal N 1k-8k 0.95-0.98x cuDNN's kernel where 40 MiB gave
# 0.88-0.90x (8 MiB 0.92-0.94x, the 2-D order 0.92-0.96x), D64 causal with the persistent
# default N 512-2k 1.02-1.09x against 1.01-1.07x, 4:1 D128 per query head N 4k / 8k 0.99x /
# 0.99x against 0.99x / 0.98x; the grouped walk (4:1 D128 N 1k / 2k) ran 3-5% slower with
# 16 MiB
L2_BUDGET = 40 << 20
L2_BUDGET_ONE_HEAD = 16 << 20
# the SMs a persistent launch plans for when it has shapes only (warmup): an H100 SXM's
PLANNING_SMS = 132

# (kernel, positional args, keyword args, grid) of one launch
Launch = tuple[Any, tuple[Any, ...], dict[str, Any], tuple[int, int]]


def split_d(head_dim: int) -> bool:
    """Whether the kernel's consumers split ``head_dim`` rather than the keys (the kernel's
    ``_split_d``: D256, FA3's hdim 256 split): dK and dV of the whole key block, half the
    head dim each, and the step's query rows halved for the scores."""
    return head_dim >= SPLIT_D_MIN_D.value


# the one shape of the split-D kernel (the kernel's ``_split_d_kernel``): 64 x 64 tiles, two
# consumers, two Q/dO buffers, a grid launch, dQ added by the consumers
SPLIT_D_CONFIG: dict[str, int] = {"BLOCK_M": 64, "BLOCK_N": 64, "NUM_STAGES": 2,
                                  "NUM_CONSUMERS": 2, "PERSISTENT": 0, "DQ_TMA": 0}


def split_d_reason(config: Mapping[str, int], head_dim: int) -> str | None:
    """Why ``config`` cannot run at ``head_dim`` where the consumers split it (None if it
    can, or if they do not): the split-D kernel takes :data:`SPLIT_D_CONFIG` only (the
    other knobs, ``LPT``, ``TMA_STORE`` and ``EXPAND_GQA``, freely)."""
    if not split_d(head_dim):
        return None
    off = {k: int(config.get(k, OPTIONAL_CONFIG.get(k, 0))) for k in SPLIT_D_CONFIG}
    if off != SPLIT_D_CONFIG:
        return (f"head_dim {head_dim}: the consumers split the head dim, which takes "
                f"{SPLIT_D_CONFIG} only; got {off}")
    return None


def launch_meta(config: Mapping[str, int]) -> dict[str, int]:
    """Warps and register split: consumers of 4 warps each, a 1-warp producer; ``maxnreg``
    so the CTA fits the 64K-register file (24 / 240 with one or two consumers)."""
    consumers = config["NUM_CONSUMERS"]
    groups = consumers + 1
    maxnreg = min(256, (65536 // (groups * 128)) // 8 * 8)
    producer = 24
    consumer = min(240, ((maxnreg * groups - producer) // consumers) // 8 * 8)
    return {"num_warps": 4, "maxnreg": maxnreg, "PRODUCER_REGS": producer,
            "CONSUMER_REGS": consumer}


def lpt_section(batch_heads_kv: int, group: int, seqlen_q: int, head_dim: int,
                itemsize: int = 2) -> int:
    """KV heads a section of the ``LPT`` order holds: the most whose Q and dO and the fp32
    dQ accumulator's rows the atomics add to (``group`` query heads each) fit
    :data:`L2_BUDGET` (a CTA walks a group, ``group`` > 1) or :data:`L2_BUDGET_ONE_HEAD`
    (one query head: MHA, and ``EXPAND_GQA``, whose launch passes 1), a power of two that
    divides ``batch_heads_kv`` (so every section is whole and the kernel maps a CTA to its
    tile with shifts); 1 when not even one head fits. (Until 2026-11-29 the sections counted
    Q and dO alone, twice as many heads at 2-byte inputs; FA3's backward scheduler counts
    the accumulator too. Until 2026-11-30 one-head walks had the group's budget.)"""
    per_head = group * seqlen_q * head_dim * (2 * itemsize + 4)
    budget = L2_BUDGET if group > 1 else L2_BUDGET_ONE_HEAD
    fit = max(1, budget // max(1, per_head))
    return min(1 << (fit.bit_length() - 1), batch_heads_kv & -batch_heads_kv)


def persistent_ctas(t: Any, tiles: int) -> int:
    """``PERSISTENT``'s CTAs for ``tiles`` tiles on tensor ``t``'s GPU: one an SM (the
    register file and shared memory hold one), fewer when there are fewer tiles;
    :data:`PLANNING_SMS` SMs for a shape-only stand-in. (Not attn_fwd_gluon's helper: its
    files would enter this kernel's source hash.)"""
    device = getattr(t, "device", None)
    if device is None or getattr(device, "type", None) != "cuda":
        return max(1, min(tiles, PLANNING_SMS))
    index = device.index if device.index is not None else torch.cuda.current_device()
    return max(1, min(tiles, sm_count(index)))


def padded_seqlen(seqlen_q: int, config: Mapping[str, int]) -> int:
    """``Nq_pad``: the query length rounded up to the config's ``BLOCK_M``."""
    bm = config["BLOCK_M"]
    return -(-seqlen_q // bm) * bm


def scratch_shapes(q_shape: tuple[int, ...], config: Mapping[str, int]
                   ) -> dict[str, tuple[int, ...]]:
    """The float32 scratch a call allocates for ``q`` of ``(B, Hq, Nq, D)``: ``lse2`` and
    ``delta`` rows ``(B * Hq, Nq_pad)``, the dQ accumulator ``(B * Hq * Nq_pad, D)``."""
    batch, heads_q, seqlen_q, head_dim = q_shape
    pad = padded_seqlen(seqlen_q, config)
    return {"lse2": (batch * heads_q, pad), "delta": (batch * heads_q, pad),
            "dq_acc": (batch * heads_q * pad, head_dim)}


def layout(t: Any) -> str | None:
    """How the kernel reads a ``(B, H, N, D)`` tensor (or a shape-only stand-in) through a
    2-D TMA view: ``"bhsd"`` (contiguous), ``"bshd"`` (``(B, N, H, D)`` storage seen as
    ``(B, H, N, D)``), or None (another layout, or a base not 16-byte aligned: copied).
    ``attn_fwd_gluon.launcher.layout``'s rule, kept here so the forward's files stay out of
    this kernel's source hash."""
    if t.data_ptr() % 16:
        return None
    batch, heads, seqlen, dim = t.shape
    want = {"bhsd": (heads * seqlen * dim, seqlen * dim, dim, 1),
            "bshd": (seqlen * heads * dim, dim, heads * dim, 1)}
    got = tuple(int(x) for x in t.stride())
    for name, strides in want.items():  # a dimension of size 1 may have any stride
        if all(n == 1 or g == w for n, g, w in zip(t.shape, got, strides)):
            return name
    return None


def _desc_shape(t: Any, how: str) -> tuple[list[int], list[int]]:
    batch, heads, seqlen, dim = t.shape
    if how == "bshd":
        return [batch * seqlen, heads * dim], [heads * dim, 1]
    return [batch * heads * seqlen, dim], [dim, 1]


def _smem_layout(block: list[int], dtype: Any) -> Any:
    return gl.NVMMASharedLayout.get_default_for(block, dtype)


def _gl_dtype(dtype: Any) -> Any:
    return gl.bfloat16 if dtype == torch.bfloat16 else gl.float16


def _strides3(t: Any) -> tuple[int, int, int]:
    return int(t.stride(0)), int(t.stride(1)), int(t.stride(2))


def packed_layout(t: Any) -> bool:
    """Whether the kernel reads a packed ``(total, H, D)`` tensor (or a shape-only stand-in)
    in place through a ``(total, H * D)`` TMA view: heads ``D`` apart, last dim contiguous,
    a token stride (a slice of a packed qkv too) and a base TMA can address (16-byte
    multiples); else it is copied."""
    total, heads, dim = t.shape
    s_n, s_h, s_d = (int(x) for x in t.stride())
    return (t.data_ptr() % 16 == 0 and s_d == 1 and (heads == 1 or s_h == dim)
            and (s_n * t.element_size()) % 16 == 0 and (total == 1 or s_n >= heads * dim))


def _packed_desc_shape(t: Any) -> tuple[list[int], list[int]]:
    total, heads, dim = t.shape
    return [total, heads * dim], [int(t.stride(0)) if total > 1 else heads * dim, 1]


def _bhn(t: Any) -> tuple[int, int, int]:
    """A packed ``(total, H, D)`` tensor's ``(batch, head, token)`` strides as the kernels
    take them: no batch stride (rows counted from the sequence's start)."""
    return 0, int(t.stride(1)), int(t.stride(0))


def plan(q: Any, k: Any, v: Any, out: Any, lse: Any, dout: Any, dq: Any, dk: Any, dv: Any,
         scratch: Mapping[str, Any], config: Mapping[str, int], *, causal: bool,
         scale: float, dlse: Any = None, cu_seqlens_q: Any = None, cu_seqlens_k: Any = None,
         max_seqlen_q: int | None = None, max_seqlen_k: int | None = None,
         window_left: int = -1, softcap: float = 0.0) -> dict[str, Launch]:
    """``{"preprocess", "main", "convert"} -> (kernel, args, kwargs, grid)`` for tensors
    (or shape-only stand-ins) with q and dout in one :func:`layout`, k and v in one, dk and
    dv in k's; ``scratch`` the buffers of :func:`scratch_shapes`; ``lse`` contiguous
    float32 ``(B, Hq, Nq)``; ``dlse`` optional, any strides. With ``EXPAND_GQA`` on a GQA
    problem, dk and dv are a query head's each (``(B, Hq, Nk, D)``, :func:`expanded`), the
    group's sums left to the caller. With ``cu_seqlens_q`` the packed plan
    (:func:`plan_packed`). ``window_left`` >= 0 (causal): a sliding window; ``softcap`` >
    0: the forward's capped scores (:func:`score_options`)."""
    if cu_seqlens_q is not None:
        assert cu_seqlens_k is not None and max_seqlen_q is not None \
            and max_seqlen_k is not None, "a packed plan needs both cu_seqlens and max_seqlen"
        return plan_packed(q, k, v, out, lse, dout, dq, dk, dv, scratch, config,
                           causal=causal, scale=scale, dlse=dlse, cu_seqlens_q=cu_seqlens_q,
                           cu_seqlens_k=cu_seqlens_k, max_seqlen_q=int(max_seqlen_q),
                           max_seqlen_k=int(max_seqlen_k), window_left=window_left,
                           softcap=softcap)
    batch, heads_q, seqlen_q, head_dim = q.shape
    heads_kv, seqlen_k = k.shape[1], k.shape[2]
    bm, bn = config["BLOCK_M"], config["BLOCK_N"]
    gdt = _gl_dtype(q.dtype)
    q_how, kv_how = layout(q), layout(k)
    assert q_how and kv_how and layout(dout) == q_how and layout(v) == kv_how, "see layout"
    q_shape, q_strides = _desc_shape(q, q_how)
    kv_shape, kv_strides = _desc_shape(k, kv_how)
    q_desc = TensorDescriptor(q, q_shape, q_strides, [bm, head_dim],
                              _smem_layout([bm, head_dim], gdt))
    do_desc = TensorDescriptor(dout, q_shape, q_strides, [bm, head_dim],
                               _smem_layout([bm, head_dim], gdt))
    k_desc = TensorDescriptor(k, kv_shape, kv_strides, [bn, head_dim],
                              _smem_layout([bn, head_dim], gdt))
    v_desc = TensorDescriptor(v, kv_shape, kv_strides, [bn, head_dim],
                              _smem_layout([bn, head_dim], gdt))
    pad = padded_seqlen(seqlen_q, config)
    lse2, delta, dq_acc = scratch["lse2"], scratch["delta"], scratch["dq_acc"]
    dl_strides = _strides3(dlse) if dlse is not None else (0, 0, 0)
    pre: Launch = (
        gluon_attn_bwd_preprocess,
        (out, dout, lse, lse if dlse is None else dlse, lse2, delta, dq_acc,
         *_strides3(out), *_strides3(dout), *dl_strides, heads_q, seqlen_q, pad),
        dict(cu_q_ptr=None, HEAD_D=head_dim, BLOCK=PRE_BLOCK, HAS_DLSE=dlse is not None,
             VARLEN=False, num_warps=4),
        (-(-pad // PRE_BLOCK), batch * heads_q))
    lpt = bool(config.get("LPT", OPTIONAL_CONFIG["LPT"]))
    kv_group = 1
    if expanded(heads_q, heads_kv, config):  # a CTA per query head, as MHA
        assert dk.shape[1] == dv.shape[1] == heads_q, "EXPAND_GQA: dk and dv per query head"
        kv_group, heads_kv = heads_q // heads_kv, heads_q
    n_blocks, bh_kv = -(-seqlen_k // bn), batch * heads_kv
    section = lpt_section(bh_kv, heads_q // heads_kv, seqlen_q, head_dim) if lpt else 1
    section_log2 = section.bit_length() - 1
    if config.get("TMA_STORE", OPTIONAL_CONFIG["TMA_STORE"]):
        assert layout(dk) == layout(dv) == kv_how, "TMA_STORE: dk and dv in k's layout"
    options = _main_options(config, head_dim, causal, q_how == "bshd", kv_how == "bshd",
                            dq_acc=dq_acc, dkv=(dk, dv), dkv_view=lambda t: _desc_shape(t, kv_how))
    if kv_group > 1:  # (1: no constant passed, the kernel as it was)
        options.update(KV_GROUP=kv_group)
    qk_scale, mods = score_options(scale, window_left, softcap)
    options.update(mods)
    grid = (n_blocks * bh_kv, 1) if lpt else (n_blocks, bh_kv)
    if config.get("PERSISTENT", OPTIONAL_CONFIG["PERSISTENT"]):
        options.update(n_tiles=n_blocks * bh_kv, PERSISTENT=True)
        grid = (persistent_ctas(q, n_blocks * bh_kv), 1)
    main: Launch = (
        gluon_attn_bwd_kernel,
        (q_desc, k_desc, v_desc, do_desc, lse2, delta, dq_acc, dk, dv, *_strides3(dk),
         seqlen_q, seqlen_k, pad, heads_q, heads_kv, qk_scale, float(scale), section_log2),
        options, grid)
    conv: Launch = (
        gluon_attn_bwd_convert_dq,
        (dq_acc, dq, *_strides3(dq), heads_q, seqlen_q, pad, float(scale)),
        dict(cu_q_ptr=None, HEAD_D=head_dim, BLOCK=PRE_BLOCK, VARLEN=False, num_warps=4),
        (-(-seqlen_q // PRE_BLOCK), batch * heads_q))
    return {"preprocess": pre, "main": main, "convert": conv}


def score_options(scale: float, window_left: int, softcap: float
                  ) -> tuple[float, dict[str, Any]]:
    """The main kernel's ``qk_scale`` and its score modifications' keywords: ``scale * log2
    e`` and none for plain scores (the kernel as it was); a window ``window_left`` >= 0
    (``WINDOW``); a cap ``softcap`` > 0 (``SOFTCAP`` its value times log2 e, one compile a
    cap, and ``qk_scale`` ``scale / cap``: the tanh's argument, as the Gluon forward's)."""
    mods: dict[str, Any] = {}
    qk_scale = float(scale) * LOG2E
    if window_left >= 0:
        mods.update(window_left=int(window_left), WINDOW=True)
    if softcap > 0:
        mods.update(SOFTCAP=float(softcap) * LOG2E)
        qk_scale = float(scale) / float(softcap)
    return qk_scale, mods


def expanded(heads_q: int, heads_kv: int, config: Mapping[str, int]) -> bool:
    """Whether ``config`` runs a problem of ``heads_q`` query heads over ``heads_kv`` as MHA
    (``EXPAND_GQA`` on a GQA problem): a CTA per query head, reading its group's K and V
    (the kernel's ``KV_GROUP``), dK and dV per query head, summed over the group after."""
    return heads_q > heads_kv and bool(config.get("EXPAND_GQA", OPTIONAL_CONFIG["EXPAND_GQA"]))


def _main_options(config: Mapping[str, int], head_dim: int, causal: bool, q_bshd: bool,
                  kv_bshd: bool, cu_seqlens_q: Any = None, cu_seqlens_k: Any = None,
                  dq_acc: Any = None, dkv: tuple[Any, Any] = (None, None),
                  dkv_view: Any = None) -> dict[str, Any]:
    """The main kernel's keyword arguments: the constexprs, the launch options, the
    ``cu_seqlens`` (None, dense: ``VARLEN`` off), with ``DQ_TMA`` the accumulator's
    descriptor (:func:`dq_desc`), with ``TMA_STORE`` dK's and dV's (``dkv``, seen as
    ``dkv_view`` gives: K's 2-D view, a consumer's rows a block)."""
    meta = launch_meta(config)
    extra: dict[str, Any] = {}
    if config.get("DQ_TMA", OPTIONAL_CONFIG["DQ_TMA"]):
        extra = dict(dq_desc=dq_desc(dq_acc, config, head_dim), DQ_TMA=True)
    if config.get("TMA_STORE", OPTIONAL_CONFIG["TMA_STORE"]):
        block = _dkv_block(config, head_dim)
        dk_desc, dv_desc = (TensorDescriptor(t, *dkv_view(t), block,
                                             _smem_layout(block, _gl_dtype(t.dtype)))
                            for t in dkv)
        extra |= dict(dk_desc=dk_desc, dv_desc=dv_desc, TMA_STORE=True)
    return extra | dict(cu_q_ptr=cu_seqlens_q, cu_k_ptr=cu_seqlens_k, HEAD_D=head_dim,
                        BLOCK_M=config["BLOCK_M"], BLOCK_N=config["BLOCK_N"],
                        NUM_STAGES=config["NUM_STAGES"], NUM_CONSUMERS=config["NUM_CONSUMERS"],
                        CAUSAL=bool(causal), Q_BSHD=q_bshd, KV_BSHD=kv_bshd,
                        PRODUCER_REGS=meta["PRODUCER_REGS"],
                        CONSUMER_REGS=meta["CONSUMER_REGS"],
                        LPT=bool(config.get("LPT", OPTIONAL_CONFIG["LPT"])),
                        VARLEN=cu_seqlens_q is not None, num_warps=meta["num_warps"],
                        maxnreg=meta["maxnreg"])


def _dkv_block(config: Mapping[str, int], head_dim: int) -> list[int]:
    """``TMA_STORE``'s block of dK and dV, a consumer's: its keys' rows, or with the
    consumers splitting the head dim (:func:`split_d`) every key's row, its half."""
    if split_d(head_dim):
        return [config["BLOCK_N"], head_dim // config["NUM_CONSUMERS"]]
    return [config["BLOCK_N"] // config["NUM_CONSUMERS"], head_dim]


def dq_desc(dq_acc: Any, config: Mapping[str, int], head_dim: int) -> Any:
    """The fp32 accumulator ``(rows, D)`` as ``DQ_TMA``'s reduce-adds see it: a block of one
    consumer's slice, ``BLOCK_M x D / NUM_CONSUMERS``, in TMA's 128-byte swizzle (Triton
    splits a 256-byte row into two messages)."""
    block = [config["BLOCK_M"], head_dim // config["NUM_CONSUMERS"]]
    return TensorDescriptor(dq_acc, list(dq_acc.shape), [head_dim, 1], block,
                            _smem_layout(block, gl.float32))


def plan_packed(q: Any, k: Any, v: Any, out: Any, lse: Any, dout: Any, dq: Any, dk: Any,
                dv: Any, scratch: Mapping[str, Any], config: Mapping[str, int], *,
                causal: bool, scale: float, cu_seqlens_q: Any, cu_seqlens_k: Any,
                max_seqlen_q: int, max_seqlen_k: int, dlse: Any = None, window_left: int = -1,
                softcap: float = 0.0) -> dict[str, Launch]:
    """:func:`plan` for packed sequences (the kernels' ``VARLEN``): q, dout, out, dq
    ``(total_q, Hq, D)``, k, v, dk, dv ``(total_k, Hkv, D)`` with q, dout, k, v in
    :func:`packed_layout` and dk, dv of one set of strides; ``cu_seqlens_q/k`` ``(B + 1,)``
    int32; ``max_seqlen_q/k`` the longest sequences (the grids, the scratch's padding:
    ``scratch`` is :func:`scratch_shapes` of ``(B, Hq, max_seqlen_q, D)``); ``lse``
    contiguous float32 ``(Hq, total_q)``; ``dlse`` optional, ``(Hq, total_q)``, any
    strides; ``window_left`` and ``softcap`` as :func:`plan`'s (each sequence's own
    positions)."""
    if config.get("PERSISTENT", OPTIONAL_CONFIG["PERSISTENT"]):
        raise ConfigError("PERSISTENT serves dense batches only: a packed batch's key blocks "
                          "past a document's end walk nothing, the grid launch skips them")
    total_q, heads_q, head_dim = q.shape
    heads_kv = k.shape[1]
    batch = cu_seqlens_q.shape[0] - 1
    bm, bn = config["BLOCK_M"], config["BLOCK_N"]
    gdt = _gl_dtype(q.dtype)
    assert all(packed_layout(t) for t in (q, dout, k, v)), "see packed_layout"
    assert tuple(dk.stride()) == tuple(dv.stride()), "dk and dv share the kernel's strides"
    if config.get("TMA_STORE", OPTIONAL_CONFIG["TMA_STORE"]):
        assert packed_layout(dk) and packed_layout(dv), "TMA_STORE: see packed_layout"
    q_block, kv_block = [bm, head_dim], [bn, head_dim]
    q_desc, do_desc = (TensorDescriptor(t, *_packed_desc_shape(t), q_block,
                                        _smem_layout(q_block, gdt)) for t in (q, dout))
    k_desc, v_desc = (TensorDescriptor(t, *_packed_desc_shape(t), kv_block,
                                       _smem_layout(kv_block, gdt)) for t in (k, v))
    pad = padded_seqlen(max_seqlen_q, config)
    lse2, delta, dq_acc = scratch["lse2"], scratch["delta"], scratch["dq_acc"]
    dl_strides = (0, int(dlse.stride(0)), int(dlse.stride(1))) if dlse is not None \
        else (0, 0, 0)
    # the LSE's row length is total_q (its (Hq, total_q) layout), passed as seqlen_q
    pre: Launch = (
        gluon_attn_bwd_preprocess,
        (out, dout, lse, lse if dlse is None else dlse, lse2, delta, dq_acc,
         *_bhn(out), *_bhn(dout), *dl_strides, heads_q, total_q, pad),
        dict(cu_q_ptr=cu_seqlens_q, HEAD_D=head_dim, BLOCK=PRE_BLOCK,
             HAS_DLSE=dlse is not None, VARLEN=True, num_warps=4),
        (-(-pad // PRE_BLOCK), batch * heads_q))
    lpt = bool(config.get("LPT", OPTIONAL_CONFIG["LPT"]))
    n_blocks, bh_kv = -(-max_seqlen_k // bn), batch * heads_kv
    section = lpt_section(bh_kv, heads_q // heads_kv, max_seqlen_q, head_dim) if lpt else 1
    qk_scale, mods = score_options(scale, window_left, softcap)
    main: Launch = (
        gluon_attn_bwd_kernel,
        (q_desc, k_desc, v_desc, do_desc, lse2, delta, dq_acc, dk, dv, *_bhn(dk),
         max_seqlen_q, max_seqlen_k, pad, heads_q, heads_kv, qk_scale, float(scale),
         section.bit_length() - 1),
        _main_options(config, head_dim, causal, True, True, cu_seqlens_q, cu_seqlens_k,
                      dq_acc=dq_acc, dkv=(dk, dv), dkv_view=_packed_desc_shape) | mods,
        (n_blocks * bh_kv, 1) if lpt else (n_blocks, bh_kv))
    conv: Launch = (
        gluon_attn_bwd_convert_dq,
        (dq_acc, dq, *_bhn(dq), heads_q, max_seqlen_q, pad, float(scale)),
        dict(cu_q_ptr=cu_seqlens_q, HEAD_D=head_dim, BLOCK=PRE_BLOCK, VARLEN=True,
             num_warps=4),
        (-(-max_seqlen_q // PRE_BLOCK), batch * heads_q))
    return {"preprocess": pre, "main": main, "convert": conv}


def check_config(config: Mapping[str, int], head_dim: int | None = None) -> None:
    """ConfigError unless ``config`` has exactly the knobs, with values the kernel takes (at
    ``head_dim``, where given: where the consumers split it, :func:`split_d_reason`)."""
    missing = sorted(set(DEFAULT_CONFIG) - set(config))
    unknown = sorted(set(config) - set(DEFAULT_CONFIG) - set(OPTIONAL_CONFIG))
    if missing or unknown:
        raise ConfigError(f"config needs exactly the keys {sorted(DEFAULT_CONFIG)} (optional: "
                          f"{sorted(OPTIONAL_CONFIG)}); missing {missing}, unknown {unknown}")
    for knob in OPTIONAL_CONFIG:
        if config.get(knob, 0) not in (0, 1):
            raise ConfigError(f"{knob} must be 0 or 1, got {config[knob]!r}")
    if head_dim is not None and split_d(head_dim):
        _check_split_d(config, head_dim)
        return
    bm, bn, nc, st = (config[n] for n in ("BLOCK_M", "BLOCK_N", "NUM_CONSUMERS", "NUM_STAGES"))
    if bm not in (64, 128) or bn not in (64, 128) or nc not in (1, 2) or st < 2 \
            or bn // nc < 64:
        raise ConfigError(f"BLOCK_M and BLOCK_N must be 64 or 128, NUM_CONSUMERS 1 or 2 with "
                          f"BLOCK_N / NUM_CONSUMERS >= 64 keys each (a wgmma's rows), "
                          f"NUM_STAGES >= 2; got {dict(config)}")


def _check_split_d(config: Mapping[str, int], head_dim: int) -> None:
    """ConfigError where the consumers split ``head_dim`` and ``config`` is not the split-D
    kernel's (:func:`split_d_reason`)."""
    reason = split_d_reason(config, head_dim)
    if reason is not None:
        raise ConfigError(reason)


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
           dout: torch.Tensor) -> None:
    """What the kernel cannot serve, refused by name."""
    if any(t.dim() != 4 for t in (q, k, v, out, dout)):
        raise InputError("q, k, v, out, dout must be 4-D (batch, heads, seqlen, head_dim)")
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3] \
            or out.shape != q.shape or dout.shape != q.shape:
        raise InputError(f"k and v must be (batch, heads_kv, seqlen_k, head_dim) with q's "
                         f"batch and head_dim, out and dout shaped like q; got q "
                         f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, out "
                         f"{tuple(out.shape)}, dout {tuple(dout.shape)}")
    _check_dtypes_and_heads(q, k, v, out, dout, q.shape[3])
    rows = max(q.shape[0] * q.shape[1] * (q.shape[2] + 128), k.shape[0] * k.shape[1]
               * k.shape[2])
    if rows >= 2**31:
        raise InputError(f"batch x heads x seqlen must stay below 2**31 rows (TMA "
                         f"coordinates are 32-bit), got {rows}")
    _check_device(q, k, v, out, dout)


def _check_dtypes_and_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            out: torch.Tensor, dout: torch.Tensor, head_dim: int) -> None:
    """The rules of both layouts (heads on dim 1 of either): one fp16/bf16 dtype, a head
    dim the kernel's wgmma takes, whole GQA groups."""
    if q.dtype not in (torch.float16, torch.bfloat16) \
            or any(t.dtype != q.dtype for t in (k, v, out, dout)):
        raise InputTypeError(f"the Gluon backward takes fp16 or bf16 q, k, v, out, dout of "
                             f"one dtype; got {q.dtype}, {k.dtype}, {v.dtype}, {out.dtype}, "
                             f"{dout.dtype}")
    if head_dim not in HEAD_DIMS:
        raise InputError(f"head_dim must be one of {list(HEAD_DIMS)} for the Gluon backward, "
                         f"got {head_dim} (attn_bwd serves the others)")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise InputError(f"heads_q ({q.shape[1]}) must be a multiple of heads_kv "
                         f"({k.shape[1]})")


def _check_device(q: torch.Tensor, *others: torch.Tensor) -> None:
    if q.device.type != "cuda" or any(t.device != q.device for t in others):
        raise DeviceError(f"the Gluon backward runs on one CUDA GPU (sm_90) and has no "
                          f"interpreter mode; got q on {q.device}")
    if torch.cuda.get_device_capability(q.device) != (9, 0):
        raise DeviceError(f"the Gluon backward runs on sm_90 (Hopper) only; {q.device} is "
                          f"sm_{''.join(map(str, torch.cuda.get_device_capability(q.device)))}")


def _check_packed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                  lse: torch.Tensor, dout: torch.Tensor, dlse: torch.Tensor | None,
                  cu_seqlens_q: Any, cu_seqlens_k: Any, max_seqlen_q: Any,
                  max_seqlen_k: Any) -> None:
    """:func:`_check` for packed sequences: the tensors' shapes and dtypes, the
    ``cu_seqlens``' metadata (their values are trusted, as attn_bwd trusts them: the
    runtime checks them once per call, ``runtime.scored``), the lengths; the device last."""
    if any(t.dim() != 3 for t in (q, k, v, out, dout)):
        raise InputError("packed q, k, v, out, dout must be 3-D (total_tokens, heads, "
                         "head_dim)")
    if k.shape != v.shape or q.shape[2] != k.shape[2] or out.shape != q.shape \
            or dout.shape != q.shape:
        raise InputError(f"packed k and v must be (total_k, heads_kv, head_dim) with q's "
                         f"head_dim, out and dout shaped like q; got q {tuple(q.shape)}, k "
                         f"{tuple(k.shape)}, v {tuple(v.shape)}, out {tuple(out.shape)}, dout "
                         f"{tuple(dout.shape)}")
    _check_dtypes_and_heads(q, k, v, out, dout, q.shape[2])
    if cu_seqlens_k is None:
        raise InputError("cu_seqlens_k is required with cu_seqlens_q (packed sequences)")
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        check_cu_seqlens(name, cu, q.device)
    if cu_seqlens_k.numel() != cu_seqlens_q.numel():
        raise InputError(f"cu_seqlens_k has {cu_seqlens_k.numel()} entries and cu_seqlens_q "
                         f"{cu_seqlens_q.numel()}: both must be batch + 1")
    for name, m, total in (("max_seqlen_q", max_seqlen_q, q.shape[0]),
                           ("max_seqlen_k", max_seqlen_k, k.shape[0])):
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 0):
            raise InputError(f"{name} must be a non-negative int (the longest sequence) or "
                             f"None, got {m!r}")
        if m is not None and m > total:
            raise InputError(f"{name} ({m}) exceeds the {total} packed tokens")
    want = (q.shape[1], q.shape[0])
    if tuple(lse.shape) != want or (dlse is not None and tuple(dlse.shape) != want):
        raise InputError(f"packed lse (and dlse) must be (heads_q, total_q) = {want} "
                         f"(attn_fwd's varlen LSE); got lse {tuple(lse.shape)}"
                         + ("" if dlse is None else f", dlse {tuple(dlse.shape)}"))
    elems = max(q.shape[0] * q.shape[1], k.shape[0] * k.shape[1]) * q.shape[2]
    if elems >= 2**31:  # dK/dV's row offsets and the TMA coordinates are 32-bit
        raise InputError(f"packed tokens x heads x head_dim must stay below 2**31, got "
                         f"{elems}")
    _check_device(q, k, v, out, dout)


def _max_len(cu: torch.Tensor) -> int:
    return int((cu[1:] - cu[:-1]).max().item())


def _ready_packed(t: torch.Tensor) -> torch.Tensor:
    """``t`` where the TMA engine reads it as it is (:func:`packed_layout`), else a
    contiguous 16-byte aligned copy."""
    if packed_layout(t):
        return t
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def _ready(t: torch.Tensor) -> torch.Tensor:
    """``t`` where the TMA engine reads it as it is, else a contiguous 16-byte aligned copy."""
    if layout(t) is not None:
        return t
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def attn_bwd_gluon(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dout: torch.Tensor,
    config: Mapping[str, int],
    *,
    causal: bool = False,
    scale: float | None = None,
    dlse: torch.Tensor | None = None,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    window: tuple[int, int] = (-1, -1),
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of flash attention with the Gluon warp-specialized kernel (a Hopper GPU).

    Arguments:
        q: ``(batch, heads_q, seqlen_q, head_dim)``, fp16 or bf16, ``head_dim`` 64, 128 or 256,
            on a CUDA device of compute capability 9.0 (packed ``(total_q, heads_q,
            head_dim)`` with ``cu_seqlens_q``).
        k, v: ``(batch, heads_kv, seqlen_k, head_dim)`` (packed ``(total_k, heads_kv,
            head_dim)``), q's dtype and device; ``heads_q`` a multiple of ``heads_kv``
            (GQA/MQA: a CTA walks the group's query heads).
        out: the forward's output, shaped like ``q`` (last dim contiguous).
        lse: the forward's float32 log-sum-exp ``(batch, heads_q, seqlen_q)`` (packed:
            ``(heads_q, total_q)``), natural log, ``-inf`` for rows that see no key
            (``attn_fwd``/``attn_fwd_gluon`` with ``return_lse=True``).
        dout: the gradient of ``out``, shaped like ``q``.
        config: ``{"BLOCK_M", "BLOCK_N", "NUM_STAGES", "NUM_CONSUMERS"}`` from the
            template's space.
        causal: bottom-right aligned mask: query ``i`` sees key ``j`` iff
            ``j <= i + seqlen_k - seqlen_q`` (packed: each sequence's own lengths).
        scale: softmax scale, default ``1 / sqrt(head_dim)``.
        dlse: optional gradient of ``lse``, shaped like it (any strides): ``dS = P (dP -
            (delta - dlse))``.
        cu_seqlens_q, cu_seqlens_k: int32 ``(batch + 1,)`` on ``q``'s device, cumulative
            sequence lengths of packed ``q`` and ``k``/``v`` (``flash_attn_varlen_func``'s,
            as :func:`attn_bwd` takes them): sequence ``b`` is tokens ``[cu[b], cu[b +
            1])``; their values are not checked here.
        max_seqlen_q, max_seqlen_k: the longest sequences (the grids and the scratch's
            padding); read from the ``cu_seqlens`` (a device sync) when None.
        window: FlashAttention-2's ``window_size``, as the forward's was: a left bound with
            ``causal`` (query ``i`` sees keys ``[pos - left, pos]``), or none (``(-1,
            -1)``); other windows are an InputError (attn_bwd serves them).
        softcap: FlashAttention-2's ``softcap``, as the forward's was (the scores ``softcap
            * tanh(s / softcap)``, the tanh the hardware's approximation, as the Gluon
            forward's); None or 0: off. One compile per distinct cap.
    Returns:
        ``(dq, dk, dv)`` in the input dtype, in the layouts of ``q``, ``k``, ``v`` (packed:
        contiguous ``(total, heads, head_dim)``). dK and dV are summed over each GQA group
        in a fixed order (``EXPAND_GQA``: each query head's rounded to the input dtype, then
        summed in fp32, as FlashAttention-2's GQA backward does); dQ by fp32 atomics (its
        last bits may differ between runs).
    Raises:
        InputError, InputTypeError, DeviceError for inputs it cannot serve; ConfigError for
        a config outside its knobs.
    """
    check_config(config, q.shape[-1] if q.dim() in (3, 4) else None)
    left = causal_window_left(window, causal, "the Gluon backward", "attn_bwd")
    cap = softcap_value(softcap)
    if cu_seqlens_q is not None or cu_seqlens_k is not None:
        if cu_seqlens_q is None:
            raise InputError("cu_seqlens_q is required with cu_seqlens_k (packed sequences)")
        return _attn_bwd_packed(q, k, v, out, lse, dout, config, causal=causal, scale=scale,
                                dlse=dlse, cu_seqlens_q=cu_seqlens_q,
                                cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                                max_seqlen_k=max_seqlen_k, window_left=left, softcap=cap)
    _check(q, k, v, out, dout)
    head_dim = q.shape[3]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    q, k, v = _ready(q), _ready(k), _ready(v)
    if layout(k) != layout(v):  # one descriptor shape for both
        k, v = _ready(k.contiguous()), _ready(v.contiguous())
    if layout(dout) != layout(q):  # dO through q's descriptor shape
        dout = torch.empty_like(q).copy_(dout)
    if out.stride(-1) != 1:
        out = out.contiguous()
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if q.numel() == 0 or k.shape[2] == 0:
        dq.zero_(), dk.zero_(), dv.zero_()
        return dq, dk, dv
    scratch = {name: torch.empty(shape, device=q.device, dtype=torch.float32)
               for name, shape in scratch_shapes(tuple(q.shape), config).items()}
    lse = lse.contiguous()
    if dlse is not None and dlse.dtype != torch.float32:
        dlse = dlse.to(torch.float32)
    heads_kv, group = k.shape[1], q.shape[1] // k.shape[1]
    dk_run, dv_run = dk, dv
    if expanded(q.shape[1], heads_kv, config):  # each query head's dK and dV, in k's layout
        dk_run, dv_run = (_per_query_head(t, q.shape[1]) for t in (k, v))
    for kernel, args, kwargs, grid in plan(q, k, v, out, lse, dout, dq, dk_run, dv_run,
                                           scratch, config, causal=causal, scale=scale,
                                           dlse=dlse, window_left=left,
                                           softcap=cap).values():
        kernel[grid](*args, **kwargs)
    if dk_run is not dk:  # each group's sum (fp32 accumulation, one rounding)
        torch.sum(dk_run.unflatten(1, (heads_kv, group)), dim=2, out=dk)
        torch.sum(dv_run.unflatten(1, (heads_kv, group)), dim=2, out=dv)
    return dq, dk, dv


def _per_query_head(t: torch.Tensor, heads_q: int) -> torch.Tensor:
    """An empty ``(B, heads_q, N, D)`` buffer in ``t``'s :func:`layout` (``EXPAND_GQA``'s
    dK or dV of each query head)."""
    batch, _, seqlen, dim = t.shape
    if layout(t) == "bshd":
        return torch.empty(batch, seqlen, heads_q, dim, device=t.device,
                           dtype=t.dtype).transpose(1, 2)
    return torch.empty(batch, heads_q, seqlen, dim, device=t.device, dtype=t.dtype)


def _attn_bwd_packed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                     lse: torch.Tensor, dout: torch.Tensor, config: Mapping[str, int], *,
                     causal: bool, scale: float | None, dlse: torch.Tensor | None,
                     cu_seqlens_q: torch.Tensor, cu_seqlens_k: Any, max_seqlen_q: int | None,
                     max_seqlen_k: int | None, window_left: int = -1,
                     softcap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`attn_bwd_gluon` for packed sequences (its arguments, checked here)."""
    _check_packed(q, k, v, out, lse, dout, dlse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                  max_seqlen_k)
    heads_q, head_dim = q.shape[1], q.shape[2]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    q, k, v, dout = (_ready_packed(t) for t in (q, k, v, dout))
    if out.stride(-1) != 1:
        out = out.contiguous()
    dq = torch.empty(q.shape, device=q.device, dtype=q.dtype)
    dk = torch.empty(k.shape, device=k.device, dtype=k.dtype)
    dv = torch.empty(v.shape, device=v.device, dtype=v.dtype)
    batch = cu_seqlens_q.numel() - 1
    if max_seqlen_q is None:
        max_seqlen_q = _max_len(cu_seqlens_q)
    if max_seqlen_k is None:
        max_seqlen_k = _max_len(cu_seqlens_k)
    if q.shape[0] == 0 or k.shape[0] == 0 or max_seqlen_q == 0 or max_seqlen_k == 0:
        dq.zero_(), dk.zero_(), dv.zero_()  # no query sees a key
        return dq, dk, dv
    scratch = {name: torch.empty(shape, device=q.device, dtype=torch.float32)
               for name, shape in scratch_shapes((batch, heads_q, max_seqlen_q, head_dim),
                                                 config).items()}
    lse = lse.contiguous()
    if dlse is not None and dlse.dtype != torch.float32:
        dlse = dlse.to(torch.float32)
    for kernel, args, kwargs, grid in plan_packed(
            q, k, v, out, lse, dout, dq, dk, dv, scratch, config, causal=causal, scale=scale,
            dlse=dlse, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
            max_seqlen_q=int(max_seqlen_q), max_seqlen_k=int(max_seqlen_k),
            window_left=window_left, softcap=softcap).values():
        kernel[grid](*args, **kwargs)
    return dq, dk, dv


def compile_sm90(config: Mapping[str, int], head_dim: int = 128, causal: bool = False,
                 dtype: str = "bf16", layout: str = "bhsd", varlen: bool = False,
                 kv_group: int = 1, window: bool = False, softcap: float = 0.0) -> Any:
    """Compile the main kernel of ``config`` for sm_90 on the CPU (no GPU needed), planned as
    :func:`attn_bwd_gluon` launches it for inputs in ``layout`` (q, k, v alike; ``varlen``:
    packed sequences, ``layout`` ignored; ``kv_group``: ``EXPAND_GQA``'s query heads a
    KV head, 1 otherwise; ``window``: with a causal sliding window, ``softcap`` > 0: the
    scores capped); returns the compiled kernel (``.asm["ptx"]``,
    ``.metadata.shared``). Needs a process without ``TRITON_INTERPRET``."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    check_config(config, head_dim)
    gdt = gl.bfloat16 if dtype == "bf16" else gl.float16
    bm, bn, nc = config["BLOCK_M"], config["BLOCK_N"], config["NUM_CONSUMERS"]
    qd = f"tensordesc<{dtype}[{bm}, {head_dim}],{_smem_layout([bm, head_dim], gdt)!r}>"
    kd = f"tensordesc<{dtype}[{bn}, {head_dim}],{_smem_layout([bn, head_dim], gdt)!r}>"
    meta = launch_meta(config)
    const: dict[str, Any] = {
        "HEAD_D": head_dim, "BLOCK_M": bm, "BLOCK_N": bn, "NUM_STAGES": config["NUM_STAGES"],
        "NUM_CONSUMERS": nc, "CAUSAL": bool(causal), "Q_BSHD": varlen or layout == "bshd",
        "KV_BSHD": varlen or layout == "bshd", "PRODUCER_REGS": meta["PRODUCER_REGS"],
        "CONSUMER_REGS": meta["CONSUMER_REGS"],
        "LPT": bool(config.get("LPT", OPTIONAL_CONFIG["LPT"])), "VARLEN": varlen,
        "PERSISTENT": bool(config.get("PERSISTENT", OPTIONAL_CONFIG["PERSISTENT"])),
        "KV_GROUP": kv_group}
    const.update(WINDOW=bool(window), SOFTCAP=float(softcap) * LOG2E)
    if not window:  # None: no parameter (the kernel without a window)
        const.update(window_left=None)
    if not varlen:  # None: no parameter (the dense kernel's)
        const.update(cu_q_ptr=None, cu_k_ptr=None)
    if not const["PERSISTENT"]:  # the grid launch's kernel: no tile count
        const.update(n_tiles=None)
    const["DQ_TMA"] = bool(config.get("DQ_TMA", OPTIONAL_CONFIG["DQ_TMA"]))
    if not const["DQ_TMA"]:  # the writer's atomics: no descriptor
        const.update(dq_desc=None)
    const["TMA_STORE"] = bool(config.get("TMA_STORE", OPTIONAL_CONFIG["TMA_STORE"]))
    if not const["TMA_STORE"]:  # the stores from registers: no descriptors
        const.update(dk_desc=None, dv_desc=None)
    dq_block = [bm, head_dim // nc]
    dqd = f"tensordesc<fp32[{dq_block[0]}, {dq_block[1]}],{_smem_layout(dq_block, gl.float32)!r}>"
    dkv_block = _dkv_block(config, head_dim)
    dkvd = (f"tensordesc<{dtype}[{dkv_block[0]}, {dkv_block[1]}],"
            f"{_smem_layout(dkv_block, gdt)!r}>")
    kern = gluon_attn_bwd_kernel
    names = kern.arg_names
    types = {"q_desc": qd, "k_desc": kd, "v_desc": kd, "do_desc": qd, "lse2_ptr": "*fp32",
             "delta_ptr": "*fp32", "dq_acc_ptr": "*fp32", "dk_ptr": f"*{dtype}",
             "dv_ptr": f"*{dtype}", "qk_scale": "fp32", "sm_scale": "fp32",
             "cu_q_ptr": "*i32", "cu_k_ptr": "*i32", "dq_desc": dqd, "dk_desc": dkvd,
             "dv_desc": dkvd}
    sig = {n: "constexpr" if n in const else types.get(n, "i32") for n in names}
    aligned = ("lse2_ptr", "delta_ptr", "dq_acc_ptr", "dk_ptr", "dv_ptr") \
        + (("cu_q_ptr", "cu_k_ptr") if varlen else ())
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    src = GluonASTSource(fn=kern, signature=sig, attrs=attrs,
                         constexprs={(names.index(k),): v for k, v in const.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": meta["num_warps"], "maxnreg": meta["maxnreg"]})
