"""A Hopper flash-attention forward in Gluon, FlashAttention-3's structure (experiment).

Issue 7's remaining gap to cuDNN is what Triton's ``tl`` cannot say on Hopper in 3.6 (see
``benchmarks/README.md``): wgmma left in flight while the softmax runs, and producer/consumer
warp specialization with explicit barriers. Gluon (``triton.experimental.gluon``) says both.
This kernel is FA3's forward (Shah et al. 2024, Algorithm 1 and 2) written in Gluon:

* a **producer** partition (1 warp, 24 registers) issues the TMA loads: each consumer's Q
  tile once, then K and V tiles into a ring of ``NUM_STAGES`` buffers; ``k_ready`` /
  ``v_ready`` mbarriers say a buffer is full, ``kv_empty`` (one arrival per consumer) that
  every consumer is done with it;
* ``NUM_CONSUMERS`` **consumer** warpgroups (4 warps each), each owning ``ROWS`` query rows of
  the CTA's ``NUM_CONSUMERS * ROWS``; the warp scheduler runs one's softmax while the other's
  wgmmas use the tensor cores (inter-warpgroup overlap, without FA3's explicit ping-pong
  barriers);
* inside a consumer, **intra-warpgroup overlap** (FA3 Algorithm 2): ``S_j = Q K_j^T`` and
  ``O += P_{j-1} V_{j-1}`` are issued back to back as async wgmma, the wait lets only the
  first complete, and the softmax of ``S_j`` runs while ``P_{j-1} V_{j-1}`` is still on the
  tensor cores; ``O`` is rescaled after that second wait;
* exp2 with the softmax scale folded in; masking (causal diagonal, ragged key end) only on
  the blocks that need it; causal query tiles launched longest first; ``lse`` in natural log
  as ``attn_fwd`` stores it.

Layout: Q, K, V, O contiguous ``(B, H, N, D)``, read through 2-D descriptors over
``(B * H * N, D)``. A tile that runs past a head's end reads the next head's rows: keys are
masked (``>= Nk``), query rows are never stored. D is 64 or 128 (the wgmma N of ``P V``), fp16
or bf16. Not registered as a template: its numerics cannot be checked under the CPU
interpreter, so it is checked on the GPU (``explore_fwd_gluon.py``) before anything else.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

LOG2E = 1.4426950408889634


@gluon.jit
def _producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready,
              kv_empty, q_row, kv_row, n_blocks,
              ROWS: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
              NUM_CONSUMERS: gl.constexpr):
    for c in gl.static_range(NUM_CONSUMERS):
        mbarrier.expect(q_bar.index(c), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [q_row + c * ROWS, 0], q_bar.index(c),
                                        q_smem.index(c))
    for j in range(n_blocks):
        st = j % NUM_STAGES
        ph = (j // NUM_STAGES) & 1
        # a fresh mbarrier counts as phase 1 complete: the first NUM_STAGES waits pass
        mbarrier.wait(kv_empty.index(st), ph ^ 1)
        mbarrier.expect(k_ready.index(st), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [kv_row + j * BLOCK_N, 0], k_ready.index(st),
                                        k_smem.index(st))
        mbarrier.expect(v_ready.index(st), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [kv_row + j * BLOCK_N, 0], v_ready.index(st),
                                        v_smem.index(st))


@gluon.jit
def _softmax_block(qk, j, m_i, l_i, q_start, seqlen_q, seqlen_k, qk_scale,
                   s_layout: gl.constexpr, ROWS: gl.constexpr, BLOCK_N: gl.constexpr,
                   CAUSAL: gl.constexpr):
    """One block's online-softmax step on the raw scores ``qk`` (fp32, ``s_layout``):
    returns ``(p, alpha, m_i, l_i)`` with ``p`` unnormalised in the log2 domain."""
    start_n = j * BLOCK_N
    need_mask = start_n + BLOCK_N > seqlen_k
    if CAUSAL:
        need_mask = need_mask | (start_n + BLOCK_N - 1 > q_start + (seqlen_k - seqlen_q))
    if need_mask:
        cols = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        ok = gl.expand_dims(cols < seqlen_k, 0)
        if CAUSAL:
            rows = q_start + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))
            ok = ok & (gl.expand_dims(cols, 0)
                       <= gl.expand_dims(rows + (seqlen_k - seqlen_q), 1))
        qk = gl.where(ok, qk, -float("inf"))
    m_new = gl.maximum(m_i, gl.max(qk, axis=1) * qk_scale)
    # rows that have seen no key yet keep m = -inf: subtract 0 there instead (no NaN)
    m_safe = gl.where(m_new == -float("inf"), 0.0, m_new)
    p = gl.exp2(qk * qk_scale - gl.expand_dims(m_safe, 1))
    alpha = gl.exp2(m_i - m_safe)
    l_i = l_i * alpha + gl.sum(p, axis=1)
    return p, alpha, m_new, l_i


@gluon.jit
def _my_turn(turn, cid, step, PINGPONG: gl.constexpr):
    """FA3's ping-pong: two consumers take turns to issue their wgmmas, so one's softmax
    runs while the other's matrix products use the tensor cores. Consumer 0 goes first
    (a fresh barrier counts as phase 1 complete); each issue ends with ``_their_turn``.
    Every consumer takes ``n_total + 1`` steps (prologue, one per later block, the last
    ``P V``; a consumer that sees fewer causal blocks steps through the rest), so the two
    stay in lockstep and neither runs a phase ahead."""
    if PINGPONG:
        mbarrier.wait(turn.index(cid), (step & 1) ^ (1 - cid))


@gluon.jit
def _their_turn(turn, cid, PINGPONG: gl.constexpr):
    if PINGPONG:
        mbarrier.arrive(turn.index(1 - cid), count=1)


@gluon.jit
def _consumer(cid, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty, turn, o_ptr,
              lse_ptr, bh, m_block, seqlen_q, seqlen_k, n_total, qk_scale,
              HEAD_D: gl.constexpr, ROWS: gl.constexpr, BLOCK_N: gl.constexpr,
              NUM_STAGES: gl.constexpr, NUM_CONSUMERS: gl.constexpr, CAUSAL: gl.constexpr,
              PINGPONG: gl.constexpr):
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

    q_start = m_block * (NUM_CONSUMERS * ROWS) + cid * ROWS
    n_mine = n_total
    if CAUSAL:  # the keys this consumer's last row sees
        n_mine = gl.minimum(n_total, gl.cdiv(q_start + ROWS + (seqlen_k - seqlen_q), BLOCK_N))
    n_mine = gl.maximum(n_mine, 1)  # rows that see no key still run block 0, fully masked

    m_i = gl.full([ROWS], -float("inf"), gl.float32, row_s)
    l_i = gl.full([ROWS], 0.0, gl.float32, row_s)
    acc = gl.zeros([ROWS, HEAD_D], gl.float32, o_layout)
    s_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)

    mbarrier.wait(q_bar.index(cid), 0)
    q = q_smem.index(cid)

    # block 0: S_0, its softmax
    _my_turn(turn, cid, 0, PINGPONG)
    mbarrier.wait(k_ready.index(0), 0)
    qk = warpgroup_mma(q, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False,
                       is_async=True)
    _their_turn(turn, cid, PINGPONG)
    qk = warpgroup_mma_wait(num_outstanding=0, deps=(qk, ))
    p, alpha, m_i, l_i = _softmax_block(qk, 0, m_i, l_i, q_start, seqlen_q, seqlen_k,
                                        qk_scale, s_layout, ROWS, BLOCK_N, CAUSAL)
    for j in range(1, n_mine):
        st = j % NUM_STAGES
        ph = (j // NUM_STAGES) & 1
        prev = (j - 1) % NUM_STAGES
        prev_ph = ((j - 1) // NUM_STAGES) & 1
        # issue S_j = Q K_j^T, then O += P_{j-1} V_{j-1}; wait only for the first
        _my_turn(turn, cid, j, PINGPONG)
        mbarrier.wait(k_ready.index(st), ph)
        qk = warpgroup_mma(q, k_smem.index(st).permute((1, 0)), s_zero, use_acc=False,
                           is_async=True)
        mbarrier.wait(v_ready.index(prev), prev_ph)
        p16 = gl.convert_layout(p.to(dtype), p_layout)
        acc = warpgroup_mma(p16, v_smem.index(prev), acc, is_async=True)
        _their_turn(turn, cid, PINGPONG)
        qk = warpgroup_mma_wait(num_outstanding=1, deps=(qk, ))
        # the softmax of S_j runs while P_{j-1} V_{j-1} is on the tensor cores
        p, alpha, m_i, l_i = _softmax_block(qk, j, m_i, l_i, q_start, seqlen_q, seqlen_k,
                                            qk_scale, s_layout, ROWS, BLOCK_N, CAUSAL)
        acc, p16 = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p16))
        mbarrier.arrive(kv_empty.index(prev), count=1)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
    # the last block's P V
    last = (n_mine - 1) % NUM_STAGES
    _my_turn(turn, cid, n_mine, PINGPONG)
    mbarrier.wait(v_ready.index(last), ((n_mine - 1) // NUM_STAGES) & 1)
    p16 = gl.convert_layout(p.to(dtype), p_layout)
    acc = warpgroup_mma(p16, v_smem.index(last), acc, is_async=True)
    _their_turn(turn, cid, PINGPONG)
    acc, p16 = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p16))
    mbarrier.arrive(kv_empty.index(last), count=1)
    # blocks the producer loads for the other consumers: keep the barrier phases in step
    for j in range(n_mine, n_total):
        st = j % NUM_STAGES
        ph = (j // NUM_STAGES) & 1
        _my_turn(turn, cid, j + 1, PINGPONG)  # the other consumer's steps alternate still
        _their_turn(turn, cid, PINGPONG)
        mbarrier.wait(k_ready.index(st), ph)
        mbarrier.wait(v_ready.index(st), ph)
        mbarrier.arrive(kv_empty.index(st), count=1)

    # epilogue: O / l, lse = (m + log2 l) ln 2; rows that saw no key: O = 0, lse = -inf
    l_o = gl.convert_layout(l_i, row_o)
    out = acc / gl.expand_dims(gl.where(l_o == 0.0, 1.0, l_o), 1)
    rows_o = q_start + gl.arange(0, ROWS, layout=row_o)
    cols_o = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, o_layout))
    offs = gl.expand_dims((bh * seqlen_q + rows_o).to(gl.int64) * HEAD_D, 1) \
        + gl.expand_dims(cols_o, 0)
    gl.store(o_ptr + offs, out.to(dtype), mask=gl.expand_dims(rows_o < seqlen_q, 1))
    lse = gl.where(l_i == 0.0, -float("inf"), (m_i + gl.log2(l_i)) * 0.6931471805599453)
    rows_s = q_start + gl.arange(0, ROWS, layout=row_s)
    gl.store(lse_ptr + bh.to(gl.int64) * seqlen_q + rows_s, lse, mask=rows_s < seqlen_q)


@gluon.jit
def gluon_attn_fwd_kernel(q_desc, k_desc, v_desc, o_ptr, lse_ptr, seqlen_q, seqlen_k, heads_q,
                          group, qk_scale,
                          HEAD_D: gl.constexpr, ROWS: gl.constexpr, BLOCK_N: gl.constexpr,
                          NUM_STAGES: gl.constexpr, NUM_CONSUMERS: gl.constexpr,
                          CAUSAL: gl.constexpr, PINGPONG: gl.constexpr,
                          PRODUCER_REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr):
    m_block = gl.program_id(0)
    if CAUSAL:  # the longest rows (most key blocks) first, so the short ones fill the tail
        m_block = gl.num_programs(0) - 1 - m_block
    bh = gl.program_id(1)
    b = bh // heads_q
    h = bh % heads_q
    heads_kv = heads_q // group
    q_row = bh * seqlen_q + m_block * (NUM_CONSUMERS * ROWS)
    kv_row = (b * heads_kv + h // group) * seqlen_k
    n_total = gl.cdiv(seqlen_k, BLOCK_N)
    if CAUSAL:  # the keys the CTA's last row sees
        n_total = gl.minimum(n_total, gl.cdiv((m_block + 1) * (NUM_CONSUMERS * ROWS)
                                              + (seqlen_k - seqlen_q), BLOCK_N))
    n_total = gl.maximum(n_total, 1)

    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [NUM_CONSUMERS, ROWS, HEAD_D], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, HEAD_D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, HEAD_D], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [NUM_CONSUMERS, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(turn.index(0), count=1)
    mbarrier.init(turn.index(1), count=1)
    for c in gl.static_range(NUM_CONSUMERS):
        mbarrier.init(q_bar.index(c), count=1)
    for s in gl.static_range(NUM_STAGES):
        mbarrier.init(k_ready.index(s), count=1)
        mbarrier.init(v_ready.index(s), count=1)
        mbarrier.init(kv_empty.index(s), count=NUM_CONSUMERS)

    gl.static_assert(NUM_CONSUMERS == 1 or NUM_CONSUMERS == 2)
    gl.static_assert(not PINGPONG or NUM_CONSUMERS == 2)
    if NUM_CONSUMERS == 1:
        gl.warp_specialize([
            (_consumer, (0, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty, turn,
                         o_ptr, lse_ptr, bh, m_block, seqlen_q, seqlen_k, n_total, qk_scale,
                         HEAD_D, ROWS, BLOCK_N, NUM_STAGES, NUM_CONSUMERS, CAUSAL, PINGPONG)),
            (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready,
                         v_ready, kv_empty, q_row, kv_row, n_total, ROWS, BLOCK_N, NUM_STAGES,
                         NUM_CONSUMERS)),
        ], [1], [PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (_consumer, (0, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty, turn,
                         o_ptr, lse_ptr, bh, m_block, seqlen_q, seqlen_k, n_total, qk_scale,
                         HEAD_D, ROWS, BLOCK_N, NUM_STAGES, NUM_CONSUMERS, CAUSAL, PINGPONG)),
            (_consumer, (1, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty, turn,
                         o_ptr, lse_ptr, bh, m_block, seqlen_q, seqlen_k, n_total, qk_scale,
                         HEAD_D, ROWS, BLOCK_N, NUM_STAGES, NUM_CONSUMERS, CAUSAL, PINGPONG)),
            (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready,
                         v_ready, kv_empty, q_row, kv_row, n_total, ROWS, BLOCK_N, NUM_STAGES,
                         NUM_CONSUMERS)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


DEFAULT_CONFIG = {"ROWS": 64, "BLOCK_N": 128, "NUM_STAGES": 2, "NUM_CONSUMERS": 2,
                  "PINGPONG": 0}


def _layout(block: list[int], dtype: Any) -> Any:
    return gl.NVMMASharedLayout.get_default_for(block, dtype)


def launch_meta(config: dict[str, int]) -> dict[str, int]:
    """Warps and register split: the consumers take 4 warps each, the producer 1 warp (a
    warpgroup's registers); ``maxnreg`` so the whole CTA fits the 64K-register file."""
    consumers = config["NUM_CONSUMERS"]
    groups = consumers + 1  # warpgroups: consumers + the producer's
    maxnreg = (65536 // (groups * 128)) // 8 * 8
    producer = 24
    consumer = min(240, ((maxnreg * groups - producer) // consumers) // 8 * 8)
    return {"num_warps": 4, "maxnreg": maxnreg, "PRODUCER_REGS": producer,
            "CONSUMER_REGS": consumer}


def gluon_attn_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                   scale: float | None = None, config: dict[str, int] | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` for ``(B, H, N, D)`` inputs, as ``attn_fwd(..., return_lse=True)``."""
    cfg = dict(DEFAULT_CONFIG, **(config or {}))
    batch, heads_q, seqlen_q, head_dim = q.shape
    heads_kv, seqlen_k = k.shape[1], k.shape[2]
    if head_dim not in (64, 128):
        raise ValueError(f"head_dim must be 64 or 128 for the Gluon forward, got {head_dim}")
    if heads_q % heads_kv:
        raise ValueError(f"heads_q ({heads_q}) must be a multiple of heads_kv ({heads_kv})")
    q, k, v = (t.contiguous() for t in (q, k, v))
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    out = torch.empty_like(q)
    lse = torch.empty((batch, heads_q, seqlen_q), device=q.device, dtype=torch.float32)
    gdt = gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16
    rows, bn = cfg["ROWS"], cfg["BLOCK_N"]
    q_desc = TensorDescriptor(q.view(-1, head_dim), [batch * heads_q * seqlen_q, head_dim],
                              [head_dim, 1], [rows, head_dim], _layout([rows, head_dim], gdt))
    kv_shape = [batch * heads_kv * seqlen_k, head_dim]
    k_desc = TensorDescriptor(k.view(-1, head_dim), kv_shape, [head_dim, 1], [bn, head_dim],
                              _layout([bn, head_dim], gdt))
    v_desc = TensorDescriptor(v.view(-1, head_dim), kv_shape, [head_dim, 1], [bn, head_dim],
                              _layout([bn, head_dim], gdt))
    meta = launch_meta(cfg)
    grid = (-(-seqlen_q // (cfg["NUM_CONSUMERS"] * rows)), batch * heads_q)
    gluon_attn_fwd_kernel[grid](
        q_desc, k_desc, v_desc, out, lse, seqlen_q, seqlen_k, heads_q, heads_q // heads_kv,
        scale * LOG2E, HEAD_D=head_dim, ROWS=rows, BLOCK_N=bn, NUM_STAGES=cfg["NUM_STAGES"],
        NUM_CONSUMERS=cfg["NUM_CONSUMERS"], CAUSAL=bool(causal),
        PINGPONG=bool(cfg["PINGPONG"]), PRODUCER_REGS=meta["PRODUCER_REGS"], CONSUMER_REGS=meta["CONSUMER_REGS"],
        num_warps=meta["num_warps"], maxnreg=meta["maxnreg"])
    return out, lse


def compile_sm90(config: dict[str, int], head_dim: int = 128, causal: bool = False,
                 dtype: str = "bf16") -> Any:
    """Compile for Hopper on the CPU (no GPU needed): the compiled kernel (``.asm``,
    ``.metadata.shared``). Run without ``TRITON_INTERPRET``."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    cfg = dict(DEFAULT_CONFIG, **config)
    gdt = gl.bfloat16 if dtype == "bf16" else gl.float16
    rows, bn = cfg["ROWS"], cfg["BLOCK_N"]
    qd = f"tensordesc<{dtype}[{rows}, {head_dim}],{_layout([rows, head_dim], gdt)!r}>"
    kd = f"tensordesc<{dtype}[{bn}, {head_dim}],{_layout([bn, head_dim], gdt)!r}>"
    meta = launch_meta(cfg)
    const = {"HEAD_D": head_dim, "ROWS": rows, "BLOCK_N": bn, "NUM_STAGES": cfg["NUM_STAGES"],
             "NUM_CONSUMERS": cfg["NUM_CONSUMERS"], "CAUSAL": bool(causal),
             "PINGPONG": bool(cfg["PINGPONG"]),
             "PRODUCER_REGS": meta["PRODUCER_REGS"], "CONSUMER_REGS": meta["CONSUMER_REGS"]}
    kern = gluon_attn_fwd_kernel
    names = kern.arg_names
    types = {"q_desc": qd, "k_desc": kd, "v_desc": kd, "o_ptr": f"*{dtype}",
             "lse_ptr": "*fp32", "qk_scale": "fp32"}
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


if __name__ == "__main__":
    import json
    import os
    import sys

    if os.environ.get("TRITON_INTERPRET"):
        sys.exit("unset TRITON_INTERPRET: this compiles for sm_90")
    for case in json.loads(sys.argv[1]) if len(sys.argv) > 1 else [{}]:
        d = case.pop("head_dim", 128)
        causal = case.pop("causal", False)
        c = compile_sm90(case, d, causal)
        print(json.dumps({"config": dict(DEFAULT_CONFIG, **case), "head_dim": d,
                          "causal": causal, "shared": c.metadata.shared,
                          "warps": c.metadata.num_warps, **ptxas_stats(c.asm["ptx"])}))
