"""Host side of the Gluon forward: the launch planned from a config (warps and the register
split, TMA descriptors, the grid; :func:`kernel_args`), :func:`attn_fwd_gluon` to run it on a
Hopper GPU (the registered launcher), and :func:`compile_sm90` to compile the same kernel for
sm_90 without one (:func:`ptxas_stats` reads the result; ``python -m
flashtune.kernel_templates.attn_fwd_gluon`` prints both).

Layout: Q, K, V are read through 2-D TMA descriptors (:func:`layout`): contiguous
``(B, H, N, D)`` as ``(B * H * N, D)``, and ``(B, N, H, D)`` storage seen as ``(B, H, N, D)``
(what a transformers model hands over: ``x.view(B, N, H, D).transpose(1, 2)``) as
``(B * N, H * D)``, a head ``D`` columns from the last (the constexprs ``Q_BSHD`` and
``KV_BSHD``), so neither is copied; O is written in q's layout (``empty_like``). A tile
that runs past a sequence's end reads the next rows of the view (another head's or
batch's): keys are masked (``>= Nk``), query rows are never stored (``TMA_STORE``: such a
tile stores its rows from registers, the others go through Q's shared buffer by one TMA
copy over O's view). D is 64, 128 or 256 (the wgmma N of ``P V``), fp16 or bf16. The grid
has a CTA per tile (query block x head), or with ``PERSISTENT`` a CTA per SM looping over the tiles, with
``LPT`` (causal) in sections of heads whose K and V fit in L2 (:func:`lpt_section`), each
section's tiles longest first.
Other layouts, and bases or row strides not 16-byte aligned (the tensor-copy engine's
rule), are copied to contiguous first.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any

import torch
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from flashtune.core.errors import ConfigError, DeviceError, InputError, InputTypeError
from flashtune.core.mods import causal_window_left, softcap_value
from flashtune.kernel_templates.attn_fwd_gluon.kernel import gluon_attn_fwd_kernel

LOG2E = 1.4426950408889634
HEAD_DIMS = (64, 128, 256)  # the wgmma N of P V; 256 fits 2 stages of 64-key tiles

# ROWS query rows per consumer, BLOCK_N keys per K/V tile, NUM_STAGES K/V buffers,
# NUM_CONSUMERS consumer warpgroups (1-3), PINGPONG (two consumers take turns to issue),
# PERSISTENT (a CTA per SM looping over the tiles instead of a CTA per tile)
DEFAULT_CONFIG: dict[str, int] = {"ROWS": 64, "BLOCK_N": 128, "NUM_STAGES": 2,
                                  "NUM_CONSUMERS": 2, "PINGPONG": 0, "PERSISTENT": 0}
# knobs a config may leave out, and their value then (what configs stored before them ran):
# LPT, a persistent causal launch's tiles longest first across the heads of a section;
# TMA_STORE, a whole tile's O stored from shared memory by one TMA copy (FA3's epilogue);
# Q_BUFFERS, Q buffers per consumer (2: a persistent CTA loads the next tile's Q while this
# tile's epilogue still holds its buffer, which TMA_STORE writes O through)
# SPLIT_KV, a K buffer released once its S is done and a V buffer once its P V is (FA3's
# separate K and V pipelines), where both wait for the P V;
# CTAS_PER_SM, CTAs an SM runs side by side: 2 compiles a one-consumer CTA to half the
# register file, so one CTA's prologue and epilogue overlap the other's main loop
OPTIONAL_CONFIG: dict[str, int] = {"LPT": 0, "TMA_STORE": 0, "Q_BUFFERS": 1, "SPLIT_KV": 0,
                                   "CTAS_PER_SM": 1}
# bytes of L2 a section's K and V may take (FA3's tile scheduler budgets 40 of the 50 MB)
L2_BUDGET = 40 << 20
# the SMs a persistent launch plans for when it has shapes only (warmup): an H100 SXM's
PLANNING_SMS = 132


def _layout(block: list[int], dtype: Any) -> Any:
    return gl.NVMMASharedLayout.get_default_for(block, dtype)


def launch_meta(config: Mapping[str, int]) -> dict[str, int]:
    """Warps and register split: the consumers take 4 warps each, the producer 1 warp (a
    warpgroup's registers); ``maxnreg`` so ``CTAS_PER_SM`` CTAs fit the 64K-register file:
    24 / 240 with two consumers (FA3's split), 24 / 160 with three; one consumer at two
    CTAs an SM launches at 128 a thread and takes 24 / 232 by ``setmaxnreg``."""
    consumers = config["NUM_CONSUMERS"]
    groups = consumers + 1  # warpgroups: consumers + the producer's
    per_sm = config.get("CTAS_PER_SM", OPTIONAL_CONFIG["CTAS_PER_SM"])
    maxnreg = (65536 // (groups * 128 * per_sm)) // 8 * 8
    producer = 24
    consumer = min(240, ((maxnreg * groups - producer) // consumers) // 8 * 8)
    return {"num_warps": 4, "maxnreg": maxnreg, "PRODUCER_REGS": producer,
            "CONSUMER_REGS": consumer}


@functools.cache
def _sm_count(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def persistent_ctas(t: Any, tiles: int, per_sm: int = 1) -> int:
    """CTAs of a persistent launch of ``tiles`` tiles for tensor ``t``'s GPU: ``per_sm``
    per SM (``CTAS_PER_SM``: what the register file and shared memory hold), fewer when
    there are fewer tiles; :data:`PLANNING_SMS` SMs for a shape-only stand-in."""
    device = getattr(t, "device", None)
    if device is not None and getattr(device, "type", None) == "cuda":
        sms = _sm_count(device.index if device.index is not None
                        else torch.cuda.current_device())
    else:
        sms = PLANNING_SMS
    return max(1, min(tiles, sms * per_sm))


def lpt_section(batch_heads: int, group: int, seqlen_k: int, head_dim: int, m_blocks: int,
                ctas: int, itemsize: int = 2) -> int:
    """Heads (batch x heads_q) a section of the ``LPT`` order holds, whole GQA groups.

    In a section's order a head's next (shorter) tile comes a section's heads later. Up to
    ``ctas`` heads the two run side by side and share K and V in L2 as they stream them;
    beyond, the K and V of a section's heads must stay in :data:`L2_BUDGET` between them. So
    every head, where that many fit either way; else the most that do, rounded to a multiple
    of ``ctas / gcd(ctas, m_blocks)`` where one fits: a section is then whole rounds of the
    CTAs striding over it, and no CTA takes two of its longest tiles (a section cut across a
    round left one CTA 14% over the mean, each round cut again)."""
    per_kv_head = 2 * seqlen_k * head_dim * itemsize
    fit = max(1, L2_BUDGET // max(1, per_kv_head)) * group
    allowed = max(fit, ctas // group * group)
    if allowed >= batch_heads:
        return batch_heads
    per_round = ctas // math.gcd(ctas, m_blocks)
    step = per_round * group // math.gcd(per_round, group)
    if step <= allowed:
        return allowed // step * step
    return max(group, allowed // group * group)


def layout(t: Any) -> str | None:
    """How the kernel reads a ``(B, H, N, D)`` tensor (or a shape-only stand-in) through a
    2-D TMA view: ``"bhsd"`` (contiguous: ``(B * H * N, D)``), ``"bshd"`` (``(B, N, H, D)``
    storage seen as ``(B, H, N, D)``, as ``x.view(B, N, H, D).transpose(1, 2)`` gives:
    ``(B * N, H * D)``), or None (another layout, or a base not 16-byte aligned: the
    launcher copies it to contiguous)."""
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


def kernel_args(q: Any, k: Any, v: Any, out: Any, lse: Any, config: Mapping[str, int], *,
                causal: bool, scale: float, window_left: int = -1, softcap: float = 0.0
                ) -> tuple[tuple[Any, ...], dict[str, Any], tuple[int, int]]:
    """``(args, kwargs, grid)`` of ``gluon_attn_fwd_kernel`` for tensors in a
    :func:`layout`, K and V in one, ``out`` in q's (or shape-only stand-ins: a descriptor
    reads its base's address and dtype only), and a full ``config``; ``scale`` >= 0;
    ``window_left`` >= 0: a sliding window (causal only: the key blocks before the
    window are neither loaded nor computed); ``softcap`` > 0: the scores capped,
    ``softcap * tanh(scale * q.k / softcap)`` (the kernel's ``SOFTCAP``, a constexpr: one
    compile per cap, as a model has one; the scale stays an argument)."""
    batch, heads_q, seqlen_q, head_dim = q.shape
    heads_kv, seqlen_k = k.shape[1], k.shape[2]
    gdt = gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16
    rows, bn = config["ROWS"], config["BLOCK_N"]
    q_how, kv_how = layout(q), layout(k)
    assert q_how and kv_how and layout(v) == kv_how and layout(out) == q_how, "see layout"
    q_desc = TensorDescriptor(q, *_desc_shape(q, q_how), [rows, head_dim],
                              _layout([rows, head_dim], gdt))
    kv_shape, kv_strides = _desc_shape(k, kv_how)
    k_desc = TensorDescriptor(k, kv_shape, kv_strides, [bn, head_dim],
                              _layout([bn, head_dim], gdt))
    v_desc = TensorDescriptor(v, kv_shape, kv_strides, [bn, head_dim],
                              _layout([bn, head_dim], gdt))
    meta = launch_meta(config)
    m_blocks = -(-seqlen_q // (config["NUM_CONSUMERS"] * rows))
    ctas = persistent_ctas(q, m_blocks * batch * heads_q,
                           config.get("CTAS_PER_SM", OPTIONAL_CONFIG["CTAS_PER_SM"])) \
        if config["PERSISTENT"] else 0
    lpt = bool(config.get("LPT", OPTIONAL_CONFIG["LPT"]))
    group = heads_q // heads_kv
    section = lpt_section(batch * heads_q, group, seqlen_k, head_dim, m_blocks, ctas) \
        if lpt else 1
    # the scores' factor into the log2 domain; with a softcap, into the tanh (the kernel
    # multiplies the tanh by SOFTCAP, the cap times log2 e)
    qk_scale = scale / softcap if softcap else scale * LOG2E
    args = (q_desc, k_desc, v_desc, out, lse, seqlen_q, seqlen_k, heads_q, group,
            batch * heads_q, qk_scale, max(window_left, 0), section)
    tma_store = bool(config.get("TMA_STORE", OPTIONAL_CONFIG["TMA_STORE"]))
    q_buffers = int(config.get("Q_BUFFERS", OPTIONAL_CONFIG["Q_BUFFERS"]))
    kwargs = dict(
        HEAD_D=head_dim, ROWS=rows, BLOCK_N=bn, NUM_STAGES=config["NUM_STAGES"],
        NUM_CONSUMERS=config["NUM_CONSUMERS"], CAUSAL=bool(causal),
        PINGPONG=bool(config["PINGPONG"]), PERSISTENT=bool(config["PERSISTENT"]),
        Q_BSHD=q_how == "bshd", KV_BSHD=kv_how == "bshd",
        PRODUCER_REGS=meta["PRODUCER_REGS"], CONSUMER_REGS=meta["CONSUMER_REGS"],
        WINDOW=window_left >= 0, LPT=lpt, num_warps=meta["num_warps"],
        maxnreg=meta["maxnreg"])
    if q_buffers != 1:  # (1 is the kernel's default: a launch of 1 keys the cache as before)
        kwargs["Q_BUFFERS"] = q_buffers
    if config.get("SPLIT_KV", OPTIONAL_CONFIG["SPLIT_KV"]):
        kwargs["SPLIT_KV"] = True
    if softcap:
        kwargs["SOFTCAP"] = softcap * LOG2E
    if tma_store:  # O's view is Q's (out is in q's layout): Q's block, Q's shared buffer
        kwargs.update(TMA_STORE=True, o_desc=TensorDescriptor(
            out, *_desc_shape(out, q_how), [rows, head_dim], _layout([rows, head_dim], gdt)))
    if config["PERSISTENT"]:
        return args, kwargs, (ctas, 1)
    return args, kwargs, (m_blocks, batch * heads_q)


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           config: Mapping[str, int]) -> None:
    """What the kernel cannot serve, refused by name."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise InputError(f"q, k, v must be 4-D (batch, heads, seqlen, head_dim), got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise InputError(f"k and v must be (batch, heads_kv, seqlen_k, head_dim) with q's "
                         f"batch and head_dim; got q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}")
    if q.dtype not in (torch.float16, torch.bfloat16) or k.dtype != q.dtype \
            or v.dtype != q.dtype:
        raise InputTypeError(f"the Gluon forward takes fp16 or bf16 q, k, v of one dtype; got "
                             f"{q.dtype}, {k.dtype}, {v.dtype}")
    if q.shape[3] not in HEAD_DIMS:
        raise InputError(f"head_dim must be one of {list(HEAD_DIMS)} for the Gluon forward, got "
                         f"{q.shape[3]} (attn_fwd serves the others)")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise InputError(f"heads_q ({q.shape[1]}) must be a multiple of heads_kv "
                         f"({k.shape[1]})")
    rows = max(q.shape[0] * q.shape[1] * q.shape[2], k.shape[0] * k.shape[1] * k.shape[2])
    if rows >= 2**31:
        raise InputError(f"batch x heads x seqlen must stay below 2**31 rows (TMA "
                         f"coordinates are 32-bit), got {rows}")
    missing = sorted(set(DEFAULT_CONFIG) - set(config))
    unknown = sorted(set(config) - set(DEFAULT_CONFIG) - set(OPTIONAL_CONFIG))
    if missing or unknown:
        raise ConfigError(f"config needs exactly the keys {sorted(DEFAULT_CONFIG)} (optional: "
                          f"{sorted(OPTIONAL_CONFIG)}); missing {missing}, unknown {unknown}")
    if config["NUM_CONSUMERS"] not in (1, 2, 3) or (config["PINGPONG"]
                                                   and config["NUM_CONSUMERS"] != 2):
        raise ConfigError(f"NUM_CONSUMERS must be 1, 2 or 3 and PINGPONG needs 2; got "
                          f"{dict(config)}")
    if config["PERSISTENT"] not in (0, 1):
        raise ConfigError(f"PERSISTENT must be 0 or 1; got {dict(config)}")
    if config.get("LPT", 0) not in (0, 1) or (config.get("LPT", 0) and not config["PERSISTENT"]):
        raise ConfigError(f"LPT must be 0 or 1, and 1 orders a PERSISTENT launch's tiles; got "
                          f"{dict(config)}")
    if config.get("TMA_STORE", 0) not in (0, 1):
        raise ConfigError(f"TMA_STORE must be 0 or 1; got {dict(config)}")
    if config.get("Q_BUFFERS", 1) not in (1, 2) or (config.get("Q_BUFFERS", 1) == 2
                                                     and not config["PERSISTENT"]):
        raise ConfigError(f"Q_BUFFERS must be 1 or 2, and 2 alternates a PERSISTENT CTA's "
                          f"tiles between two Q buffers per consumer; got {dict(config)}")
    if config.get("SPLIT_KV", 0) not in (0, 1):
        raise ConfigError(f"SPLIT_KV must be 0 or 1; got {dict(config)}")
    if config.get("CTAS_PER_SM", 1) not in (1, 2) or (config.get("CTAS_PER_SM", 1) == 2
                                                       and config["NUM_CONSUMERS"] != 1):
        raise ConfigError(f"CTAS_PER_SM must be 1 or 2, and 2 halves the registers of a "
                          f"one-consumer CTA (NUM_CONSUMERS 1); got {dict(config)}")
    if q.device.type != "cuda" or k.device != q.device or v.device != q.device:
        raise DeviceError(f"the Gluon forward runs on one CUDA GPU (sm_90) and has no "
                          f"interpreter mode; got q, k, v on {q.device}, {k.device}, {v.device}")
    if torch.cuda.get_device_capability(q.device) != (9, 0):
        raise DeviceError(f"the Gluon forward runs on sm_90 (Hopper) only; {q.device} is "
                          f"sm_{''.join(map(str, torch.cuda.get_device_capability(q.device)))}")


def _tma_ready(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v in a :func:`layout` the kernel reads, K and V in the same one: each as it is
    where it can be, else contiguous with a 16-byte aligned base (a copy)."""
    def ready(t: torch.Tensor) -> torch.Tensor:
        if layout(t) is not None:
            return t
        t = t.contiguous()
        return t if t.data_ptr() % 16 == 0 else t.clone()

    q, k, v = ready(q), ready(k), ready(v)
    if layout(k) != layout(v):  # one descriptor shape for both
        k, v = ready(k.contiguous()), ready(v.contiguous())
    return q, k, v


def attn_fwd_gluon(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    config: Mapping[str, int],
    *,
    causal: bool = False,
    scale: float | None = None,
    return_lse: bool = False,
    window: tuple[int, int] = (-1, -1),
    softcap: float | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Flash-attention forward with the Gluon kernel and an explicit config (a Hopper GPU).

    Arguments:
        q: ``(batch, heads_q, seqlen_q, head_dim)``, fp16 or bf16, ``head_dim`` 64, 128 or 256,
            on a CUDA device of compute capability 9.0.
        k, v: ``(batch, heads_kv, seqlen_k, head_dim)``, same dtype and device as ``q``;
            ``heads_q`` a multiple of ``heads_kv`` (GQA/MQA, never expanded). Inputs that
            are not contiguous, or not 16-byte aligned, are copied (see the module doc).
        config: ``{"ROWS", "BLOCK_N", "NUM_STAGES", "NUM_CONSUMERS", "PINGPONG",
            "PERSISTENT"}`` and optionally ``"LPT"``, ``"TMA_STORE"`` and ``"SPLIT_KV"``
            (0 when left out), ``"Q_BUFFERS"`` and ``"CTAS_PER_SM"`` (1 when left out),
            from the template's space.
        causal: bottom-right aligned mask, as ``attn_fwd``: query ``i`` sees key ``j`` iff
            ``j <= i + seqlen_k - seqlen_q``.
        scale: softmax scale, default ``1 / sqrt(head_dim)``. A negative scale runs as
            ``-scale`` on ``-k`` (a copy of ``k``): the kernel's running maximum assumes
            ``scale >= 0``.
        return_lse: also return the log-sum-exp.
        window: FlashAttention-2's ``window_size``; this kernel serves a left bound with
            ``causal`` (a causal sliding window: query ``i`` sees keys ``[pos - left,
            pos]``), or none (``(-1, -1)``); other windows are an InputError (attn_fwd
            serves them).
        softcap: FlashAttention-2's ``softcap``: the scaled scores ``s`` become ``softcap *
            tanh(s / softcap)`` (Gemma 2), the tanh the hardware's approximation (FA3's);
            None or 0: off. One compile per distinct cap.
    Returns:
        ``out`` shaped like ``q`` in its dtype, or ``(out, lse)`` with ``lse`` float32
        ``(batch, heads_q, seqlen_q)``, natural log, ``-inf`` for rows that see no key
        (``out`` 0 there): ``attn_fwd``'s convention.
    Raises:
        InputError, InputTypeError, DeviceError for inputs it cannot serve (head_dim other
        than 64, 128 or 256, other dtypes, CPU tensors); ConfigError for a config outside its
        knobs.
    """
    left = causal_window_left(window, causal, "the Gluon forward", "attn_fwd")
    cap = softcap_value(softcap)
    _check(q, k, v, config)
    batch, heads_q, seqlen_q, head_dim = q.shape
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    if scale < 0:
        k, scale = -k, -scale
    q, k, v = _tma_ready(q, k, v)
    out = torch.empty_like(q)  # q's layout: a (B, N, H, D) caller gets its storage back
    lse = torch.empty((batch, heads_q, seqlen_q), device=q.device, dtype=torch.float32)
    if q.numel() == 0 or k.shape[2] == 0:  # nothing to launch: no query, or no key to see
        out.zero_()
        lse.fill_(-math.inf)
    else:
        args, kwargs, grid = kernel_args(q, k, v, out, lse, config, causal=causal,
                                         scale=scale, window_left=left, softcap=cap)
        gluon_attn_fwd_kernel[grid](*args, **kwargs)
    return (out, lse) if return_lse else out


def gluon_attn_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                   scale: float | None = None, config: Mapping[str, int] | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`attn_fwd_gluon` with ``config`` over :data:`DEFAULT_CONFIG`, returning
    ``(out, lse)`` (what ``benchmarks/explore_fwd_gluon.py`` calls)."""
    cfg = dict(DEFAULT_CONFIG, **(config or {}))
    out, lse = attn_fwd_gluon(q, k, v, cfg, causal=causal, scale=scale, return_lse=True)
    return out, lse


def compile_sm90(config: dict[str, int], head_dim: int = 128, causal: bool = False,
                 dtype: str = "bf16", layout: str = "bhsd", window: bool = False,
                 softcap: float = 0.0) -> Any:
    """Compile the kernel of ``config`` (over :data:`DEFAULT_CONFIG`) for sm_90 on the CPU,
    no GPU needed, planned as :func:`gluon_attn_fwd` launches it for inputs in ``layout``
    (``"bhsd"`` or ``"bshd"``, q, k and v alike; ``window``: with a causal sliding
    window; ``softcap`` > 0: with the scores capped); returns the compiled kernel
    (``.asm["ptx"]``, ``.metadata.shared``, ``.metadata.num_warps``). Needs a process
    without ``TRITON_INTERPRET``."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    cfg = dict(DEFAULT_CONFIG, **config)
    gdt = gl.bfloat16 if dtype == "bf16" else gl.float16
    rows, bn = cfg["ROWS"], cfg["BLOCK_N"]
    qd = f"tensordesc<{dtype}[{rows}, {head_dim}],{_layout([rows, head_dim], gdt)!r}>"
    kd = f"tensordesc<{dtype}[{bn}, {head_dim}],{_layout([bn, head_dim], gdt)!r}>"
    meta = launch_meta(cfg)
    const: dict[str, Any] = {
        "HEAD_D": head_dim, "ROWS": rows, "BLOCK_N": bn, "NUM_STAGES": cfg["NUM_STAGES"],
        "NUM_CONSUMERS": cfg["NUM_CONSUMERS"], "CAUSAL": bool(causal),
        "PINGPONG": bool(cfg["PINGPONG"]), "PERSISTENT": bool(cfg["PERSISTENT"]),
        "Q_BSHD": layout == "bshd", "KV_BSHD": layout == "bshd",
        "PRODUCER_REGS": meta["PRODUCER_REGS"], "CONSUMER_REGS": meta["CONSUMER_REGS"],
        "WINDOW": bool(window), "LPT": bool(cfg.get("LPT", OPTIONAL_CONFIG["LPT"])),
        "TMA_STORE": bool(cfg.get("TMA_STORE", OPTIONAL_CONFIG["TMA_STORE"])),
        "Q_BUFFERS": int(cfg.get("Q_BUFFERS", OPTIONAL_CONFIG["Q_BUFFERS"])),
        "SPLIT_KV": bool(cfg.get("SPLIT_KV", OPTIONAL_CONFIG["SPLIT_KV"])),
        "SOFTCAP": softcap * LOG2E}
    if not const["TMA_STORE"]:  # no O descriptor: the launch passes None (a constexpr)
        const["o_desc"] = None
    kern = gluon_attn_fwd_kernel
    names = kern.arg_names
    types = {"q_desc": qd, "k_desc": kd, "v_desc": kd, "o_ptr": f"*{dtype}",
             "lse_ptr": "*fp32", "qk_scale": "fp32", "o_desc": qd}
    sig = {n: "constexpr" if n in const else types.get(n, "i32") for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in ("o_ptr", "lse_ptr")}
    src = GluonASTSource(fn=kern, signature=sig, attrs=attrs,
                         constexprs={(names.index(k),): v for k, v in const.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": meta["num_warps"], "maxnreg": meta["maxnreg"]})


def ptxas_stats(ptx: str) -> dict[str, Any]:
    """ptxas' registers and spill-store bytes for sm_90a, the PTX's ``setmaxnreg`` values and
    its wgmma wait depths (``wgmma.wait_group N``: N > 0 is a wgmma left in flight)."""
    import re
    import subprocess
    import tempfile
    from pathlib import Path

    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "k.ptx"
        src.write_text(ptx)
        r = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name=sm_90a", str(src), "-o",
                            str(src) + ".o"], capture_output=True, text=True, check=True)
    log = r.stderr + r.stdout
    return {"registers": [int(x) for x in re.findall(r"Used (\d+) registers", log)],
            "spill_store_bytes": [int(x) for x in re.findall(r"(\d+) bytes spill stores", log)],
            "setmaxnreg": sorted(set(re.findall(r"setmaxnreg\.(\w+)\.sync\.aligned\.u32\s+(\d+)",
                                                ptx))),
            "wgmma_wait_depths": sorted({int(x) for x in re.findall(
                r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", ptx)})}
