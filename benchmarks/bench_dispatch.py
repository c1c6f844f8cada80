"""Host-side cost of one ``flashtune.attention`` call vs launching the same kernel directly.

    python benchmarks/bench_dispatch.py [--out benchmarks/results/dispatch_h100.json]

Small shapes, so the GPU finishes each kernel faster than the CPU issues the next: the wall
time per call of a long loop of calls is then the host cost. Per shape, interleaved rounds
of 2000 calls each of:

* ``raw``: ``attn_fwd_kernel[grid](*args, **kwargs)`` with the arguments built beforehand
  (Triton's own launch path, nothing of flashtune's);
* ``launcher``: the template's launcher with the same config (allocates the output, builds
  the arguments and TMA descriptors, launches);
* ``attention``: ``flashtune.attention(q, k, v)`` after a first call (input checks, the
  per-call config lookup, then the launcher);
* ``sdpa_flash`` / ``sdpa_cudnn``: torch's SDPA backends, for scale.

The dispatch overhead is ``attention - raw``, wall and CPU time per call (target: <= 5 us);
``attention`` runs the shape's launch plan (the compiled kernel with its arguments bound
once, see :mod:`flashtune.kernel_templates.direct`), so it can be below ``raw``, which pays
Triton's per-call argument binding. ``launcher`` is what a call without a plan costs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_fwd import SDPA_BACKENDS, sdpa_fn  # noqa: E402

import flashtune  # noqa: E402
from flashtune.kernel_templates import get_template  # noqa: E402
from flashtune.kernel_templates.attn_fwd.launcher import kernel_args, tma_ok  # noqa: E402

SPEC = get_template("attn_fwd")
SHAPES = [(1, 8, 128, 64, False), (1, 8, 128, 128, True), (4, 32, 256, 128, True)]


def per_call_us(fn, calls: int) -> tuple[float, float]:
    """(wall us, this thread's CPU us) per call of a loop of ``calls`` calls."""
    torch.cuda.synchronize()
    t, c = time.perf_counter(), time.thread_time()
    for _ in range(calls):
        fn()
    elapsed, cpu = time.perf_counter() - t, time.thread_time() - c
    torch.cuda.synchronize()
    return elapsed / calls * 1e6, cpu / calls * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default="benchmarks/results/dispatch.json")
    args = ap.parse_args()
    rows = []
    for b, h, n, d, causal in SHAPES:
        q = torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16)
        k, v = torch.randn_like(q), torch.randn_like(q)
        choice = flashtune.lookup_config(q, k, v, causal=causal)
        cfg = choice.config
        out = torch.empty_like(q)
        a, kw, grid = kernel_args(q, k, v, out, None, cfg, causal=causal, scale=d ** -0.5,
                                  use_tma=bool(cfg["USE_TMA"]) and tma_ok(q, k, v, out),
                                  upcast_dot=False)
        fns = {
            "raw": lambda: SPEC.kernel[grid](*a, **kw),
            "launcher": lambda: SPEC.launcher(q, k, v, cfg, causal=causal),
            "attention": lambda: flashtune.attention(q, k, v, causal=causal),
            "sdpa_flash": sdpa_fn(SDPA_BACKENDS["sdpa_flash"], q, k, v, causal),
            "sdpa_cudnn": sdpa_fn(SDPA_BACKENDS["sdpa_cudnn"], q, k, v, causal),
        }
        for fn in fns.values():  # compile, resolve, warm the caches
            for _ in range(20):
                fn()
        torch.testing.assert_close(fns["attention"](), fns["launcher"](), rtol=0, atol=0)
        samples = {name: [] for name in fns}
        cpu = {name: [] for name in fns}
        for _ in range(args.rounds):
            for name, fn in fns.items():
                wall_us, cpu_us = per_call_us(fn, args.calls)
                samples[name].append(wall_us)
                cpu[name].append(cpu_us)
        med = {name: statistics.median(xs) for name, xs in samples.items()}
        med_cpu = {name: statistics.median(xs) for name, xs in cpu.items()}
        rows.append({"shape": {"batch": b, "heads": h, "seqlen": n, "head_dim": d,
                               "causal": causal},
                     "config": cfg, "config_source": choice.source, "us_per_call": med,
                     "cpu_us_per_call": med_cpu, "samples": samples, "cpu_samples": cpu,
                     # the measure: over launching the same kernel directly
                     "dispatch_overhead_us": med["attention"] - med["raw"],
                     "dispatch_overhead_cpu_us": med_cpu["attention"] - med_cpu["raw"],
                     "over_launcher_us": med["attention"] - med["launcher"]})
    result = {"benchmark": "flashtune.attention host cost per call",
              "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "triton": triton.__version__, "calls": args.calls, "rounds": args.rounds,
              "date": time.strftime("%Y-%m-%d %H:%M:%S"), "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print("| shape | source | raw us | launcher us | attention us | attention - raw us "
          "(CPU us) | sdpa_flash us | sdpa_cudnn us |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        s, m = r["shape"], r["us_per_call"]
        print(f"| B{s['batch']} H{s['heads']} N{s['seqlen']} D{s['head_dim']}"
              f"{' causal' if s['causal'] else ''} | {r['config_source']} | {m['raw']:.1f} | "
              f"{m['launcher']:.1f} | {m['attention']:.1f} | {r['dispatch_overhead_us']:+.1f} "
              f"({r['dispatch_overhead_cpu_us']:+.1f}) | {m['sdpa_flash']:.1f} | "
              f"{m['sdpa_cudnn']:.1f} |")

if __name__ == "__main__":
    main()
