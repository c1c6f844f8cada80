"""Two CTAs an SM for the Gluon forward at short N (issue 23): does a one-consumer CTA,
compiled to take half the register file (``CTAS_PER_SM`` 2), beat the two-consumer tile
where the fixed cost of a tile dominates?

    python benchmarks/occupancy_probe.py [--head-dims 64,128] [--seqlens 512,1024,2048]
        [--rounds 3] [--out benchmarks/results/occupancy_probe_h100.json]

A two-consumer CTA (128 query rows, FA3's tile) takes the whole register file (64K: 24
registers a producer thread, 240 a consumer's), so an SM runs one and nothing hides its
prologue (Q and the first K/V blocks in flight) and epilogue. A one-consumer CTA (64 rows)
launched with ``maxnreg`` 128 takes half of it (2 warpgroups x 128 threads x 128), and
``setmaxnreg`` still gives its consumer 232 registers once the producer has dropped to 24;
where its shared memory also fits twice (D128 with 64-key tiles, 2 stages: 82 KB), an SM runs
two, and one's prologue and epilogue overlap the other's main loop (``occ2`` below; ``occ1``
the same config at the whole register file, one a SM, as the control). The H100 run
(``results/occupancy_probe_h100.json``) predates the knob: it patched ``launch_meta`` to the
registers ``CTAS_PER_SM`` 2 now gives (maxnreg 128, consumer 232, producer 24).

Shapes: square, 16384 query tokens (B = 16384 / N), heads x head_dim = 2048 (the standard
grid's geometry), causal and not. Contenders: Gluon configs (the two-consumer tiles the H100
table and the template default use, and one-consumer tiles at one and two CTAs an SM) and
SDPA flash and cuDNN; each checked against float32 (batch 0, heads 0-3) before it is timed.
Timing: ``flashtune.autotune.timing.bench``, contenders in rotation for ``--rounds``
rounds, median of the round medians. The JSON holds every time and each ratio to cuDNN.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_fwd import SDPA_BACKENDS, check, sdpa_fn

from flashtune.autotune.timing import bench
from flashtune.core.device import cuda_device
from flashtune.kernel_templates import get_template
from flashtune.kernel_templates.attn_fwd.reference import attn_fwd_reference

TWO = {"ROWS": 64, "NUM_CONSUMERS": 2, "PINGPONG": 0, "PERSISTENT": 0, "TMA_STORE": 1}
ONE = {"ROWS": 64, "NUM_CONSUMERS": 1, "PINGPONG": 0, "PERSISTENT": 0, "TMA_STORE": 1}
CONFIGS = {
    128: {
        "g2_128_s3": dict(TWO, BLOCK_N=128, NUM_STAGES=3),
        "g2_64_s3": dict(TWO, BLOCK_N=64, NUM_STAGES=3),
        "g2_128_s2_ps_qb2_kv1": dict(TWO, BLOCK_N=128, NUM_STAGES=2, PERSISTENT=1,
                                     Q_BUFFERS=2, SPLIT_KV=1),
        "g1_64_s2_occ1": dict(ONE, BLOCK_N=64, NUM_STAGES=2),
        "g1_64_s2_occ2": dict(ONE, BLOCK_N=64, NUM_STAGES=2, CTAS_PER_SM=2),
        "g1_64_s2_kv1_occ2": dict(ONE, BLOCK_N=64, NUM_STAGES=2, SPLIT_KV=1, CTAS_PER_SM=2),
        "g1_64_s2_notma_occ2": dict(ONE, BLOCK_N=64, NUM_STAGES=2, TMA_STORE=0, CTAS_PER_SM=2),
    },
    64: {
        "g2_128_s3": dict(TWO, BLOCK_N=128, NUM_STAGES=3),
        "g2_128_s2_ps_qb2_kv1": dict(TWO, BLOCK_N=128, NUM_STAGES=2, PERSISTENT=1,
                                     Q_BUFFERS=2, SPLIT_KV=1),
        "g1_128_s3_occ1": dict(ONE, BLOCK_N=128, NUM_STAGES=3),
        "g1_128_s2_occ2": dict(ONE, BLOCK_N=128, NUM_STAGES=2, CTAS_PER_SM=2),
        "g1_128_s3_occ2": dict(ONE, BLOCK_N=128, NUM_STAGES=3, CTAS_PER_SM=2),
        "g1_64_s4_occ2": dict(ONE, BLOCK_N=64, NUM_STAGES=4, CTAS_PER_SM=2),
    },
}


def run(d: int, n: int, causal: bool, rounds: int) -> dict:
    spec = get_template("attn_fwd_gluon")
    heads, batch = 2048 // d, 16384 // n
    torch.manual_seed(0)
    q, k, v = (torch.randn(batch, heads, n, d, device="cuda", dtype=torch.bfloat16)
               for _ in range(3))
    sl = (slice(0, 1), slice(0, 4))
    ref, _ = attn_fwd_reference(q[sl], k[sl], v[sl], causal=causal, dtype=torch.float32)
    fns = {}
    for name, cfg in CONFIGS[d].items():
        c = dict(cfg, LPT=1) if causal and cfg.get("PERSISTENT") else dict(cfg)
        fns[name] = lambda c=c: spec.launcher(q, k, v, c, causal=causal)
    fns.update({n_: sdpa_fn(b, q, k, v, causal) for n_, b in SDPA_BACKENDS.items()
                if n_ != "sdpa_efficient"})
    errors = {}
    for name, fn in list(fns.items()):
        try:
            check(name, fn()[sl], ref, torch.bfloat16)
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - wrong or failing: not timed
            errors[name] = f"{type(exc).__name__}: {exc}"[:300]
            del fns[name]
    samples: dict[str, list[float]] = {x: [] for x in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            samples[name].append(bench(fn).median_ms)
    ms = {x: sorted(s)[len(s) // 2] for x, s in samples.items()}
    cudnn = ms.get("sdpa_cudnn")
    return {"head_dim": d, "seqlen": n, "batch": batch, "heads": heads, "causal": causal,
            "ms": ms, "samples_ms": samples, "errors": errors,
            "vs_cudnn": {x: cudnn / t for x, t in ms.items()} if cudnn else {}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--head-dims", default="64,128")
    ap.add_argument("--seqlens", default="512,1024,2048")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/occupancy_probe.json")
    args = ap.parse_args()
    dev = cuda_device()
    doc = {"benchmark": "occupancy_probe", "device": dev.name, "torch": torch.__version__,
           "date": time.strftime("%Y-%m-%d %H:%M:%S"),
           "source_hash": get_template("attn_fwd_gluon").source_hash,
           "configs": {str(d): c for d, c in CONFIGS.items()}, "rounds": args.rounds,
           "rows": []}
    t0 = time.time()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for d in (int(x) for x in args.head_dims.split(",")):
        for causal in (True, False):
            for n in (int(x) for x in args.seqlens.split(",")):
                row = run(d, n, causal, args.rounds)
                doc["rows"].append(row)
                doc["wall_s"] = time.time() - t0
                out.write_text(json.dumps(doc, indent=1))
                print(f"D{d} N{n} {'causal' if causal else 'full'}: " + ", ".join(
                    f"{x} {r:.3f}" for x, r in sorted(row["vs_cudnn"].items(),
                                                        key=lambda kv: -kv[1]))
                      + (f"  errors: {row['errors']}" if row["errors"] else ""), flush=True)
    print(f"wrote {out} in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
