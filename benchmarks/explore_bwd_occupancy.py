"""attn_bwd on shapes that give its kernels few programs: small batch, GQA/MQA, one sequence.

The dK/dV kernel runs ``cdiv(Nk, BLOCK_N1) * B * Hkv`` programs and the dQ kernel
``cdiv(Nq, BLOCK_M2) * B * Hq``; the standard grid (B x H >= 512) fills the GPU with any tile,
but a GQA model's backward on one sequence may not: B1 Hkv8 Nk2048 with BLOCK_N1 128 is 128
programs on 132 SMs, each walking 4 query heads. This sweeps the two owned-tile sizes
(BLOCK_N1, BLOCK_M2) around the head-dim default, everything else as the default, on such
shapes, with SDPA flash and cuDNN in the same run; every config's gradients are checked
against fp32 autograd first.

    python benchmarks/explore_bwd_occupancy.py [--out benchmarks/results/explore_bwd_occupancy_h100.json]

Prints a table per shape (TFLOP/s, programs of each kernel) and writes JSON after every shape.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import platform
import time
from pathlib import Path

from bench_bwd import rel  # this folder is on sys.path when the script runs

SHAPES = [  # (batch, Hq, Hkv, N, D, causal)
    (2, 8, 2, 1000, 64, False),
    (1, 16, 1, 4096, 64, False),
    (1, 32, 8, 2048, 128, True),
    (1, 32, 8, 8192, 128, True),
    (4, 32, 8, 1024, 128, True),
    (1, 64, 8, 4096, 128, True),
    (1, 32, 8, 4096, 128, False),
]
TILES = (32, 64, 128)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/explore_bwd_occupancy_h100.json")
    ap.add_argument("--sweep", choices=("tiles", "kv_splits"), default="tiles",
                    help="tiles: BLOCK_N1 x BLOCK_M2; kv_splits: BLOCK_N1 x KV_SPLITS (1-8)")
    ap.add_argument("--shapes", help="B,Hq,Hkv,N,D,causal(0/1) separated by ';' "
                                     "(default: the list in this file)")
    args = ap.parse_args()
    shapes = SHAPES if not args.shapes else [
        tuple(int(x) for x in s.split(",")[:5]) + (s.split(",")[5] == "1",)
        for s in args.shapes.split(";")]
    import torch
    import triton
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from flashtune.autotune.timing import bench, tflops
    from flashtune.core.case import TOLERANCE
    from flashtune.core.device import cuda_device
    from flashtune.core.problem import AttentionProblem
    from flashtune.kernel_templates import get_template
    from flashtune.kernel_templates.attn_bwd.reference import attn_bwd_reference
    from flashtune.kernel_templates.attn_bwd.space import check

    fwd, spec = get_template("attn_fwd"), get_template("attn_bwd")
    dev = cuda_device()
    tol = TOLERANCE["bf16"]
    rows, t0 = [], time.time()
    for b, hq, hkv, n, d, causal in shapes:
        p = AttentionProblem(b, hq, hkv, n, n, d, causal, "bf16")
        g = torch.Generator(device="cuda").manual_seed(0)

        def mk(h: int) -> torch.Tensor:
            return torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=g)
        q, k, v, do = mk(hq), mk(hkv), mk(hkv), mk(hq)
        group = hq // hkv
        sq, skv = (slice(0, 1), slice(0, group)), (slice(0, 1), slice(0, 1))
        ref = attn_bwd_reference(q[sq], k[skv], v[skv], do[sq], causal=causal,
                                 dtype=torch.float32)
        out, lse = fwd.launcher(q, k, v, fwd.default_config(p, dev), causal=causal,
                                return_lse=True)
        default = spec.default_config(p, dev)
        row: dict = {"problem": p.key(), "default": default, "configs": []}
        fl = p.flops(backward=True)

        def measure(fn):
            got = fn()
            errs = {nm: rel(a[s], r) for nm, a, s, r in
                    zip(("dq", "dk", "dv"), got, (sq, skv, skv), ref)}
            if not max(errs.values()) < tol:
                return {"error": f"relative error {errs}"}
            t = bench(fn)
            return {"median_ms": t.median_ms, "tflops": tflops(fl, t.median_ms), "errs": errs}

        if args.sweep == "tiles":
            grid = [{"BLOCK_N1": bn1, "BLOCK_M2": bm2} for bn1, bm2 in itertools.product(TILES, TILES)]
        else:
            grid = [{"BLOCK_N1": bn1, "KV_SPLITS": s} for bn1, s in itertools.product(TILES, (1, 2, 4, 8))
                    if math.gcd(s, group) == s]
        for knobs in grid:
            cfg = {**default, **knobs}
            bn1, bm2 = cfg["BLOCK_N1"], cfg["BLOCK_M2"]
            why = check(cfg, p, dev)
            entry = {"config": cfg,
                     "dkdv_programs": -(-n // bn1) * b * hkv * math.gcd(cfg.get("KV_SPLITS", 1), group),
                     "dq_programs": -(-n // bm2) * b * hq}
            if why is not None:
                entry["pruned"] = why
            else:
                try:
                    entry.update(measure(lambda c=cfg: spec.launcher(q, k, v, out, lse, do, c,
                                                                     causal=causal)))
                except Exception as exc:  # noqa: BLE001 - recorded
                    entry["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            row["configs"].append(entry)
        leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
        for name, backend in (("sdpa_flash", SDPBackend.FLASH_ATTENTION),
                              ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION)):
            try:
                with sdpa_kernel(backend):
                    o = torch.nn.functional.scaled_dot_product_attention(
                        *leaves, is_causal=causal, enable_gqa=group > 1)
                row[name] = measure(lambda o=o: torch.autograd.grad(o, leaves, do,
                                                                   retain_graph=True))
            except RuntimeError as exc:
                row[name] = {"error": str(exc).splitlines()[0][:200]}
        rows.append(row)
        ok = [c for c in row["configs"] if "tflops" in c]
        dflt = next((c for c in ok if c["config"] == default), None)
        best = max(ok, key=lambda c: c["tflops"]) if ok else None
        print(f"{p.describe()}: default {dflt and round(dflt['tflops'])} TF "
              f"(dkdv {dflt and dflt['dkdv_programs']} / dq {dflt and dflt['dq_programs']} "
              f"programs); best {best and round(best['tflops'])} TF at BN1 "
              f"{best and best['config']['BLOCK_N1']} BM2 {best and best['config']['BLOCK_M2']}"
              f" S {best and best['config'].get('KV_SPLITS', 1)}"
              f" (dkdv {best and best['dkdv_programs']} / dq {best and best['dq_programs']});"
              f" FA2 {round(row['sdpa_flash'].get('tflops', 0))}"
              f" cuDNN {round(row['sdpa_cudnn'].get('tflops', 0))}", flush=True)
        for c in ok:
            print(f"    BN1 {c['config']['BLOCK_N1']:3d} BM2 {c['config']['BLOCK_M2']:3d} "
                  f"S {c['config'].get('KV_SPLITS', 1)} "
                  f"{c['tflops']:6.1f} TF  dkdv {c['dkdv_programs']:5d} dq {c['dq_programs']:5d}")
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(
            {"benchmark": "attn_bwd owned tiles on low-parallelism shapes", "dtype": "bf16",
             "device": dev.to_dict(), "torch": torch.__version__, "triton": triton.__version__,
             "source_hash": spec.source_hash, "host": platform.node(),
             "date": time.strftime("%Y-%m-%d %H:%M:%S"), "wall_s": time.time() - t0,
             "rows": rows}, indent=1))
        del q, k, v, do, out, lse, leaves
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
