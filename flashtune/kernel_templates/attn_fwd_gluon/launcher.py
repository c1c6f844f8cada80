"""Host side of the Gluon forward: the launch planned from a config (warps and the register
split, TMA descriptors, the grid), :func:`gluon_attn_fwd` to run it on a Hopper GPU, and
:func:`compile_sm90` to compile the same kernel for sm_90 without one (:func:`ptxas_stats`
reads the result; ``python -m flashtune.kernel_templates.attn_fwd_gluon`` prints both).

Layout: Q, K, V, O contiguous ``(B, H, N, D)``, read through 2-D descriptors over
``(B * H * N, D)``. A tile that runs past a head's end reads the next head's rows: keys are
masked (``>= Nk``), query rows are never stored. D is 64 or 128 (the wgmma N of ``P V``),
fp16 or bf16.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from flashtune.kernel_templates.attn_fwd_gluon.kernel import gluon_attn_fwd_kernel

LOG2E = 1.4426950408889634


# ROWS query rows per consumer, BLOCK_N keys per K/V tile, NUM_STAGES K/V buffers,
# NUM_CONSUMERS consumer warpgroups (1 or 2), PINGPONG (two consumers take turns to issue)
DEFAULT_CONFIG: dict[str, int] = {"ROWS": 64, "BLOCK_N": 128, "NUM_STAGES": 2,
                                  "NUM_CONSUMERS": 2, "PINGPONG": 0}


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
    """Attention forward with the Gluon kernel and an explicit config (a Hopper GPU only).

    Arguments:
        q: ``(batch, heads_q, seqlen_q, head_dim)``, fp16 or bf16, ``head_dim`` 64 or 128.
        k, v: ``(batch, heads_kv, seqlen_k, head_dim)``, same dtype and device as ``q``;
            ``heads_q`` a multiple of ``heads_kv`` (GQA/MQA). Inputs that are not
            contiguous are copied.
        causal: bottom-right aligned mask, as ``attn_fwd``: query ``i`` sees key ``j`` iff
            ``j <= i + seqlen_k - seqlen_q``.
        scale: softmax scale, default ``1 / sqrt(head_dim)``.
        config: knobs over :data:`DEFAULT_CONFIG`.
    Returns:
        ``(out, lse)`` as ``attn_fwd(..., return_lse=True)``: ``out`` shaped like ``q``;
        ``lse`` float32 ``(batch, heads_q, seqlen_q)``, natural log, ``-inf`` for rows that
        see no key.
    """
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
        PINGPONG=bool(cfg["PINGPONG"]), PRODUCER_REGS=meta["PRODUCER_REGS"],
        CONSUMER_REGS=meta["CONSUMER_REGS"], num_warps=meta["num_warps"], maxnreg=meta["maxnreg"])
    return out, lse


def compile_sm90(config: dict[str, int], head_dim: int = 128, causal: bool = False,
                 dtype: str = "bf16") -> Any:
    """Compile the kernel of ``config`` (over :data:`DEFAULT_CONFIG`) for sm_90 on the CPU,
    no GPU needed, planned as :func:`gluon_attn_fwd` launches it; returns the compiled kernel
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
