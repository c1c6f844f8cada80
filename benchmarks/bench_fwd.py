"""Forward benchmark on the standard grid: flashtune vs SDPA flash (FA2) and cuDNN, one run.

    python benchmarks/bench_fwd.py [--head-dims 64,128] [--out benchmarks/results/fwd.json]

Every implementation is checked against an fp32 reference before it is timed. Prints a
markdown table last; writes the full figures as JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import flashtune  # noqa: E402
from flashtune.autotune.grids import standard_grid  # noqa: E402
from flashtune.autotune.timing import bench, tflops  # noqa: E402
from flashtune.core.device import cuda_device  # noqa: E402
from flashtune.kernel_templates import get_template  # noqa: E402
from flashtune.kernel_templates.attn_fwd.reference import attn_fwd_reference  # noqa: E402

SDPA_BACKENDS = {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
                 "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION}


def sdpa_fn(backend, q, k, v, causal):
    def run():
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return run


def check(name, out, ref, dtype):
    rel = ((out.float() - ref).norm() / ref.norm()).item()
    limit = 2e-2 if dtype == torch.bfloat16 else 5e-3
    if not rel < limit:
        raise SystemExit(f"{name}: relative error {rel:.2e} >= {limit}; refusing to time it")
    return rel


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--head-dims", default="64,128")
    ap.add_argument("--seqlens", default="512,1024,2048,4096,8192,16384")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    ap.add_argument("--baselines", default="sdpa_flash,sdpa_cudnn")
    ap.add_argument("--out", default="benchmarks/results/fwd_default.json")
    args = ap.parse_args()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    spec = get_template("attn_fwd")
    dev = cuda_device()
    grid = standard_grid(tuple(int(x) for x in args.head_dims.split(",")),
                         seqlens=tuple(int(x) for x in args.seqlens.split(",")), dtype=args.dtype)
    rows = []
    t0 = time.time()
    for p in grid:
        torch.manual_seed(0)
        q = torch.randn(p.batch, p.heads_q, p.seqlen_q, p.head_dim, device="cuda", dtype=dtype)
        k = torch.randn(p.batch, p.heads_kv, p.seqlen_k, p.head_dim, device="cuda", dtype=dtype)
        v = torch.randn_like(k)
        # fp32 reference on (batch 0, heads 0-1) keeps the N x N scores within memory
        ref_idx = (slice(0, 1), slice(0, 2))
        ref, _ = attn_fwd_reference(q[ref_idx], k[ref_idx], v[ref_idx], causal=p.causal,
                                    dtype=torch.float32)
        cfg = spec.default_config(p, dev)
        fns = {"flashtune_default": lambda: spec.launcher(q, k, v, cfg, causal=p.causal)}
        for name in args.baselines.split(","):
            fns[name] = sdpa_fn(SDPA_BACKENDS[name], q, k, v, p.causal)
        row = {"problem": p.key(), "config": cfg, "flops": p.flops()}
        for name, fn in fns.items():
            try:
                row[f"{name}_relerr"] = check(name, fn()[ref_idx], ref, dtype)
                t = bench(fn)
                row[name] = {"median_ms": t.median_ms, "p20_ms": t.p20_ms, "p80_ms": t.p80_ms,
                             "tflops": tflops(p.flops(), t.median_ms)}
            except RuntimeError as exc:  # a backend that does not support the shape
                row[name] = {"error": str(exc).splitlines()[0][:200]}
        rows.append(row)
        del q, k, v, ref
        torch.cuda.empty_cache()
    result = {
        "benchmark": "attn_fwd standard grid", "dtype": args.dtype,
        "device": dev.to_dict(), "torch": torch.__version__, "triton": triton.__version__,
        "flashtune": flashtune.__version__, "source_hash": spec.source_hash,
        "host": platform.node(), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "wall_s": time.time() - t0, "rows": rows,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print_table(rows, list(fns))


def print_table(rows, names):
    def tf(row, name):
        r = row.get(name, {})
        return r.get("tflops")
    head = "| D | N | causal | config | " + " | ".join(names) + " | vs FA2 | vs cuDNN |"
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    ratios_fa2, ratios_cudnn = [], []
    for row in rows:
        p = row["problem"]
        ours = tf(row, names[0])
        cells = [f"{tf(row, n):.0f}" if tf(row, n) else "n/a" for n in names]
        fa2, cud = tf(row, "sdpa_flash"), tf(row, "sdpa_cudnn")
        r1 = ours / fa2 if ours and fa2 else None
        r2 = ours / cud if ours and cud else None
        if r1:
            ratios_fa2.append(r1)
        if r2:
            ratios_cudnn.append(r2)
        c = row["config"]
        cfg = f"{c['BLOCK_M']},{c['BLOCK_N']},{c['num_warps']},{c['num_stages']}"
        print(f"| {p['head_dim']} | {p['seqlen_q']} | {'yes' if p['causal'] else 'no'} | {cfg} | "
              + " | ".join(cells) + f" | {r1 or 0:.2f} | {r2 or 0:.2f} |")
    gm = lambda xs: (2 ** (sum(__import__('math').log2(x) for x in xs) / len(xs))) if xs else 0  # noqa
    print(f"geomean ratio vs FA2 {gm(ratios_fa2):.3f}, vs cuDNN {gm(ratios_cudnn):.3f}")


if __name__ == "__main__":
    main()
