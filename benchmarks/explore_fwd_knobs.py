"""Which Hopper knobs of attn_fwd pay: a sweep of tiles x warps x stages x knobs per shape.

    python benchmarks/explore_fwd_knobs.py [--shapes d128n4096,d128n8192c,...] \
        [--out benchmarks/results/explore_fwd_knobs_h100.json]

Per shape, in one process and one run: every candidate config is precompiled (the tuner's
process pool), checked against the fp32 reference and timed by the tuner's own runner
(``LocalRunner``: failures are data), then the fastest config of each knob setting is
re-timed interleaved with the template default, SDPA flash (FA2) and SDPA cuDNN.
``REVERSE_M`` is tried on each causal shape's three fastest configs. The per-config
timings are kept in the JSON (a recording the strategy tests can replay).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import time
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_fwd import SDPA_BACKENDS, check, sdpa_fn  # noqa: E402

import flashtune  # noqa: E402
from flashtune.autotune.grids import STANDARD_HIDDEN, STANDARD_TOKENS  # noqa: E402
from flashtune.autotune.precompile import precompile  # noqa: E402
from flashtune.autotune.runners import LocalRunner  # noqa: E402
from flashtune.autotune.timing import bench, tflops  # noqa: E402
from flashtune.core.device import cuda_device  # noqa: E402
from flashtune.core.problem import AttentionProblem  # noqa: E402
from flashtune.db.jsonutil import canonical_json  # noqa: E402
from flashtune.kernel_templates import get_template  # noqa: E402

SPEC = get_template("attn_fwd")
DEFAULT_SHAPES = "d128n1024,d128n4096,d128n16384,d128n2048c,d128n8192c,d64n2048,d64n8192,d64n4096c"


def parse_shape(text: str, dtype: str) -> AttentionProblem:
    causal = text.endswith("c")
    d, n = text.rstrip("c")[1:].split("n")
    d, n = int(d), int(n)
    heads = STANDARD_HIDDEN // d
    return AttentionProblem(STANDARD_TOKENS // n, heads, heads, n, n, d, causal, dtype)


def candidates(p: AttentionProblem, dev, knobs: dict) -> list[dict]:
    out = []
    for bm, bn, w, s in itertools.product((64, 128, 256), (32, 64, 128), (4, 8), (2, 3, 4)):
        cfg = SPEC.space.validate({"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": w,
                                   "num_stages": s, **knobs})
        if SPEC.space.check(cfg, p, dev) is None:
            out.append(cfg)
    return out


def geomean(xs):
    xs = [x for x in xs if x]
    return 2 ** (sum(math.log2(x) for x in xs) / len(xs)) if xs else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shapes", default=DEFAULT_SHAPES)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--out", default="benchmarks/results/explore_fwd_knobs.json")
    args = ap.parse_args()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    dev = cuda_device()
    problems = [parse_shape(s, args.dtype) for s in args.shapes.split(",")]
    t0 = time.time()
    rows = []
    for p in problems:
        t_shape = time.time()
        cands = candidates(p, dev, {}) + candidates(p, dev, {"USE_TMA": 1})
        t = time.time()
        errors = precompile(SPEC, p, cands, workers=args.workers)
        compile_s = time.time() - t
        runner = LocalRunner(SPEC, p, dev, seed=0)
        trials = []
        for cfg in cands:
            res = runner.evaluate(cfg)
            trials.append({"config": cfg, **res.to_dict(),
                           "precompile_error": errors.get(canonical_json(cfg))})
        ok = sorted((t for t in trials if t["state"] == "COMPLETE"), key=lambda t: t["median_ms"])
        if p.causal:  # the three fastest, reversed
            for t_ in ok[:3]:
                cfg = {**t_["config"], "REVERSE_M": 1}
                res = runner.evaluate(cfg)
                trials.append({"config": cfg, **res.to_dict(), "precompile_error": None})
            ok = sorted((t for t in trials if t["state"] == "COMPLETE"),
                        key=lambda t: t["median_ms"])

        def best(pred):
            return next((t["config"] for t in ok if pred(t["config"])), None)
        picks = {
            "default": SPEC.default_config(p, dev),
            "best_plain": best(lambda c: not c["USE_TMA"] and not c["REVERSE_M"]),
            "best_tma": best(lambda c: c["USE_TMA"] and not c["REVERSE_M"]),
            "best_any": ok[0]["config"] if ok else None,
        }
        inputs = runner.case.inputs
        q, k, v = inputs["q"], inputs["k"], inputs["v"]
        ref_idx = inputs["ref_slice"]
        fns = {name: (lambda c=c: SPEC.launcher(q, k, v, c, causal=p.causal))
               for name, c in picks.items() if c is not None}
        for name in ("sdpa_flash", "sdpa_cudnn"):
            fns[name] = sdpa_fn(SDPA_BACKENDS[name], q, k, v, p.causal)
        final = {}
        for name, fn in fns.items():
            try:
                check(name, fn()[ref_idx], inputs["ref"], dtype)
            except (RuntimeError, SystemExit) as exc:
                final[name] = {"error": str(exc).splitlines()[0][:200]}
        samples: dict[str, list[float]] = {n: [] for n in fns if n not in final}
        for _ in range(3):  # interleaved rounds
            for name in samples:
                samples[name].append(bench(fns[name]).median_ms)
        for name, ms in samples.items():
            med = sorted(ms)[1]
            final[name] = {"median_ms": med, "tflops": tflops(p.flops(), med)}
        states = {}
        for t_ in trials:
            states[t_["state"]] = states.get(t_["state"], 0) + 1
        rows.append({"problem": p.key(), "flops": p.flops(), "picks": picks, "final": final,
                     "states": states, "precompile_s": compile_s,
                     "shape_wall_s": time.time() - t_shape, "trials": trials})
        del runner, q, k, v, fns
        torch.cuda.empty_cache()
        print(f"{p.describe()}: {len(cands)} configs, precompile {compile_s:.0f} s, "
              f"shape {time.time() - t_shape:.0f} s, states {states}", flush=True)
        write(args, dev, rows, t0)
    print_table(rows)


def write(args, dev, rows, t0) -> None:
    result = {"benchmark": "attn_fwd knob sweep", "dtype": args.dtype, "device": dev.to_dict(),
              "torch": torch.__version__, "triton": triton.__version__,
              "flashtune": flashtune.__version__, "source_hash": SPEC.source_hash,
              "date": time.strftime("%Y-%m-%d %H:%M:%S"), "wall_s": time.time() - t0,
              "rows": rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))


def fmt(c) -> str:
    if not c:
        return "-"
    s = f"{c['BLOCK_M']},{c['BLOCK_N']},{c['num_warps']},{c['num_stages']}"
    return s + ("T" if c.get("USE_TMA") else "") + ("R" if c.get("REVERSE_M") else "")


def print_table(rows) -> None:
    names = ["default", "best_plain", "best_tma", "best_any", "sdpa_flash", "sdpa_cudnn"]
    print("| shape | best config | " + " | ".join(names) + " | any/FA2 | any/cuDNN | tma/plain |")
    print("|" + "---|" * (len(names) + 5))
    r = {k: [] for k in ("fa2", "cudnn", "tma")}
    for row in rows:
        p, f = row["problem"], row["final"]
        tf = {n: f.get(n, {}).get("tflops") for n in names}
        a = tf["best_any"]
        x = (a / tf["sdpa_flash"] if a and tf["sdpa_flash"] else None,
             a / tf["sdpa_cudnn"] if a and tf["sdpa_cudnn"] else None,
             tf["best_tma"] / tf["best_plain"] if tf["best_tma"] and tf["best_plain"] else None)
        for key, val in zip(r, x):
            r[key].append(val)
        shape = f"D{p['head_dim']} N{p['seqlen_q']}{' causal' if p['causal'] else ''}"
        print(f"| {shape} | {fmt(row['picks']['best_any'])} | "
              + " | ".join(f"{tf[n]:.0f}" if tf[n] else "-" for n in names) + " | "
              + " | ".join(f"{v:.2f}" if v else "-" for v in x) + " |")
    print("geomean: best/FA2 {:.3f}  best/cuDNN {:.3f}  TMA/plain {:.3f}".format(
        *(geomean(r[k]) or 0 for k in ("fa2", "cudnn", "tma"))))


if __name__ == "__main__":
    main()
