"""Backward pass on the standard grid: flashtune attn_bwd (the config the dispatcher picks:
tuned if the database or shipped configs have one, else the template default) against torch
SDPA's flash (FA2) and cuDNN backward, same run, bf16.

    python benchmarks/bench_bwd.py [--out benchmarks/results/bwd.json] [--dtype bf16]

Only the backward is timed: the forward runs once per shape, then
* flashtune: ``attn_bwd(q, k, v, out, lse, dout, config)`` (preprocess, dK/dV, dQ);
* SDPA: ``torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)`` under
  ``sdpa_kernel(backend)``.
TFLOP/s use ANCHORS.md's count: backward = 2.5x forward (``4 B H N^2 D``, halved causal).
Before timing, flashtune's gradients are checked against SDPA flash's (bf16) and an fp32
reference on a slice (batch 0, 2 heads).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from flashtune.autotune.devices import current_device  # noqa: E402
from flashtune.autotune.grids import standard_grid  # noqa: E402
from flashtune.autotune.timing import bench, tflops  # noqa: E402
from flashtune.kernel_templates import get_template  # noqa: E402
from flashtune.kernel_templates.attn_bwd.reference import attn_bwd_reference  # noqa: E402
from flashtune.runtime import ops  # noqa: E402

FWD, BWD = get_template("attn_fwd"), get_template("attn_bwd")
BACKENDS = {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION}


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dtype", choices=["fp16", "bf16"], default="bf16")
    ap.add_argument("--out", default="benchmarks/results/bwd.json")
    ap.add_argument("--limit", type=int, default=0, help="only the first N shapes")
    args = ap.parse_args()
    dt = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    dev = current_device(torch.device("cuda"))
    problems = standard_grid(dtype=args.dtype)
    if args.limit:
        problems = problems[:args.limit]
    rows = []
    for p in problems:
        g = torch.Generator(device="cuda").manual_seed(0)
        mk = lambda h, n: torch.randn(p.batch, h, n, p.head_dim, device="cuda", dtype=dt,  # noqa: E731
                                      generator=g)
        q, k, v, do = mk(p.heads_q, p.seqlen_q), mk(p.heads_kv, p.seqlen_k), \
            mk(p.heads_kv, p.seqlen_k), mk(p.heads_q, p.seqlen_q)
        fcfg = ops._DISPATCH.choose(p, dev).config
        choice = ops._DISPATCH_BWD.choose(p, dev)
        out, lse = FWD.launcher(q, k, v, fcfg, causal=p.causal, return_lse=True)
        ours = BWD.launcher(q, k, v, out, lse, do, choice.config, causal=p.causal)
        # correctness: fp32 reference on a slice, and SDPA flash's bf16 gradients
        sl = (slice(0, 1), slice(0, 2))
        ref = attn_bwd_reference(q[sl], k[sl], v[sl], do[sl], causal=p.causal,
                                 dtype=torch.float32)
        errs = {n: rel(a[sl], r) for n, a, r in zip(("dq", "dk", "dv"), ours, ref)}
        qs, ks, vs = (t.detach().requires_grad_(True) for t in (q, k, v))
        with sdpa_kernel(BACKENDS["sdpa_flash"]):
            o = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=p.causal)
        flash_grads = torch.autograd.grad(o, (qs, ks, vs), do)
        flash_errs = {n: rel(a[sl], r) for n, a, r in zip(("dq", "dk", "dv"), flash_grads, ref)}
        ok = all(errs[n] <= 3 * flash_errs[n] + 2e-3 for n in errs)
        fl = p.flops(backward=True)
        timings = {"flashtune": bench(lambda: BWD.launcher(q, k, v, out, lse, do, choice.config,
                                                           causal=p.causal)).median_ms}
        for name, backend in BACKENDS.items():
            with sdpa_kernel(backend):
                o = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs,
                                                                     is_causal=p.causal)
                timings[name] = bench(lambda o=o: torch.autograd.grad(
                    o, (qs, ks, vs), do, retain_graph=True)).median_ms
            del o
        row = {"problem": p.key(), "config": choice.config, "config_source": choice.source,
               "ms": timings, "tflops": {n: tflops(fl, ms) for n, ms in timings.items()},
               "rel_err_vs_fp32": errs, "sdpa_flash_rel_err_vs_fp32": flash_errs,
               "correct": ok}
        row["vs_flash"] = timings["sdpa_flash"] / timings["flashtune"]
        row["vs_cudnn"] = timings["sdpa_cudnn"] / timings["flashtune"]
        rows.append(row)
        print(f"{p.describe():55s} {row['tflops']['flashtune']:6.1f} TFLOP/s  "
              f"x{row['vs_flash']:.2f} flash  x{row['vs_cudnn']:.2f} cudnn  ok={ok}", flush=True)
        del q, k, v, do, out, lse, ours, qs, ks, vs, flash_grads
        torch.cuda.empty_cache()
    geo = lambda xs: math.exp(sum(math.log(x) for x in xs) / len(xs))  # noqa: E731
    summary = {"geomean_vs_flash": geo([r["vs_flash"] for r in rows]),
               "geomean_vs_cudnn": geo([r["vs_cudnn"] for r in rows]),
               "all_correct": all(r["correct"] for r in rows)}
    result = {"benchmark": "attention backward, standard grid", "device": torch.cuda.get_device_name(),
              "torch": torch.__version__, "triton": triton.__version__, "dtype": args.dtype,
              "template_hash": BWD.source_hash, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
              "summary": summary, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print("| shape | config source | flashtune TFLOP/s | sdpa_flash | sdpa_cudnn | vs flash | vs cudnn |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        pk, t = r["problem"], r["tflops"]
        print(f"| N{pk['seqlen_q']} D{pk['head_dim']}{' causal' if pk['causal'] else ''} | "
              f"{r['config_source']} | {t['flashtune']:.0f} | {t['sdpa_flash']:.0f} | "
              f"{t['sdpa_cudnn']:.0f} | {r['vs_flash']:.2f} | {r['vs_cudnn']:.2f} |")
    print(f"geomean: x{summary['geomean_vs_flash']:.2f} vs flash, "
          f"x{summary['geomean_vs_cudnn']:.2f} vs cudnn, all correct: {summary['all_correct']}")


if __name__ == "__main__":
    main()
