"""attn_bwd's two main kernels timed one at a time over a grid of tiles x warps x stages:
which settings each kernel wants, and whether they want different warps or stages (which one
shared ``num_warps``/``num_stages`` cannot give them).

    python benchmarks/explore_bwd_kernels.py [--shapes 64:2048:0,128:8192:1] [--workers 16]
        [--knobs '{"USE_TMA": 1}'] [--ab path/to/other_kernel.py]
        [--out benchmarks/results/explore_bwd.json]

Per shape (standard grid: batch x N = 16384, hidden 2048; bf16): every config of the grid
is compiled first in a process pool (``JITFunction.warmup``), then the dK/dV kernel and the
dQ kernel are timed alone (``do_bench`` median), and the whole backward at the template
default. ``--knobs JSON``: these knob values in every config of the grid. ``--ab FILE`` also
times the default config with the kernels of another ``kernel.py`` with the same signatures (A/B of two kernel versions, same run).
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DKDV_GRID = dict(BLOCK_M1=(16, 32, 64), BLOCK_N1=(64, 128), num_warps=(4, 8),
                 num_stages=(1, 2, 3, 4))
DQ_GRID = dict(BLOCK_M2=(64, 128), BLOCK_N2=(16, 32, 64), num_warps=(4, 8),
               num_stages=(1, 2, 3, 4))
QUICK = (dict(BLOCK_M1=(32, 64), BLOCK_N1=(128,), num_warps=(4, 8), num_stages=(2, 3)),
         dict(BLOCK_M2=(128,), BLOCK_N2=(32, 64), num_warps=(4, 8), num_stages=(2, 3)))
FILLER = {"BLOCK_M1": 16, "BLOCK_N1": 64, "BLOCK_M2": 64, "BLOCK_N2": 16}
SEPARATE = {"ONE_LAUNCH": 0}  # the kernels are timed one at a time


def grid(params: dict) -> list[dict]:
    return [dict(zip(params, vals)) for vals in itertools.product(*params.values())]


def problem(spec: str):
    from flashtune.core.problem import AttentionProblem

    d, n, causal = (int(x) for x in spec.split(":"))
    heads = 2048 // d
    return AttentionProblem(16384 // n, heads, heads, n, n, d, bool(causal), "bf16")


def _compile(shape: str, which: str, cfg: dict) -> str | None:
    try:
        from flashtune.kernel_templates.attn_bwd.warmup import attn_bwd_warmup_args

        launches = attn_bwd_warmup_args(problem(shape), {**FILLER, **cfg, **SEPARATE})
        kern, args, kwargs, g = launches[1 if which == "dkdv" else 2]
        kern.warmup(*args, grid=g, **kwargs)
        return None
    except Exception as exc:  # noqa: BLE001 - reported
        return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200]}"


def load_kernels(path: str):
    mod_spec = importlib.util.spec_from_file_location("ab_kernel", path)
    mod = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(mod)
    return mod


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="64:2048:0,64:8192:1,128:2048:1,128:8192:0",
                    help="D:N:causal,...")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--ab", default=None, help="another kernel.py to time at the default")
    ap.add_argument("--quick", action="store_true", help="a 2x8-config grid around the default")
    ap.add_argument("--full", default=None, metavar="JSON",
                    help='instead of the grid: whole backwards of these configs per head dim, '
                         '{"64": [config, ...], ...}, timed in interleaved rounds')
    ap.add_argument("--knobs", type=json.loads, default={}, metavar="JSON",
                    help="knob values in every config of the grid, e.g. {\"USE_TMA\": 1}")
    ap.add_argument("--out", default="benchmarks/results/explore_bwd.json")
    args = ap.parse_args()
    if args.full:
        return compare_full(args)
    grids = {w: {**g, **{k: (v,) for k, v in args.knobs.items()}} for w, g in
             (("dkdv", QUICK[0] if args.quick else DKDV_GRID),
              ("dq", QUICK[1] if args.quick else DQ_GRID))}
    os.environ.setdefault("TRITON_CACHE_DIR", "/tmp/flashtune-explore-cache")
    import torch

    from flashtune.autotune.timing import bench, tflops
    from flashtune.core.device import cuda_device
    from flashtune.kernel_templates import get_template
    from flashtune.kernel_templates.attn_bwd.launcher import kernel_args

    spec, fwd = get_template("attn_bwd"), get_template("attn_fwd")
    dev = cuda_device()
    shapes = args.shapes.split(",")
    jobs = [(s, w, c) for s in shapes for w, params in grids.items() for c in grid(params)]
    t = time.time()
    with ProcessPoolExecutor(args.workers, mp_context=get_context("spawn")) as pool:
        errors = list(pool.map(_compile, *zip(*jobs)))
    print(f"compiled {len(jobs)} kernels in {time.time() - t:.0f} s, "
          f"{sum(e is not None for e in errors)} failed", flush=True)
    failed = {(s, w, json.dumps(c)): e for (s, w, c), e in zip(jobs, errors) if e}
    ab = load_kernels(args.ab) if args.ab else None
    results = []
    for shape in shapes:
        p = problem(shape)
        g = torch.Generator(device="cuda").manual_seed(0)
        mk = lambda h, n: torch.randn(p.batch, h, n, p.head_dim, device="cuda",  # noqa: E731
                                      generator=g, dtype=torch.bfloat16)
        q, k, v, do = mk(p.heads_q, p.seqlen_q), mk(p.heads_kv, p.seqlen_k), \
            mk(p.heads_kv, p.seqlen_k), mk(p.heads_q, p.seqlen_q)
        out, lse = fwd.launcher(q, k, v, fwd.default_config(p, dev), causal=p.causal,
                                return_lse=True)
        delta = torch.empty_like(lse)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        scale = p.head_dim ** -0.5

        def launch(cfg, which, kernels=None):
            kern, a, kw, gr = kernel_args(q, k, v, out, lse, do, delta, dq, dk, dv, cfg,
                                          causal=p.causal, scale=scale,
                                          upcast_dot=False)[which]
            if kernels is not None and which != "preprocess":  # the same delta for both
                kern = getattr(kernels, kern.fn.__name__)
            return lambda: kern[gr](*a, **kw)

        default = {**spec.default_config(p, dev), **SEPARATE}
        launch(default, "preprocess")()
        row = {"problem": p.key(), "default": default, "dkdv": [], "dq": []}
        for which, params in grids.items():
            for cfg in grid(params):
                err = failed.get((shape, which, json.dumps(cfg)))
                entry = {"config": cfg}
                full_cfg = {**FILLER, **cfg, **SEPARATE}
                if err or spec.space.check(full_cfg, p, dev):
                    entry["skipped"] = err or spec.space.check(full_cfg, p, dev)
                else:
                    try:
                        entry["ms"] = bench(launch(full_cfg, which)).median_ms
                    except Exception as exc:  # noqa: BLE001 - failures are data
                        entry["error"] = str(exc).splitlines()[0][:200]
                row[which].append(entry)
        full = lambda kernels=None: [launch(default, w, kernels)() for w in  # noqa: E731
                                     ("preprocess", "dkdv", "dq")]
        row["default_ms"] = bench(full).median_ms
        row["default_parts_ms"] = {w: bench(launch(default, w)).median_ms
                                   for w in ("dkdv", "dq")}
        if ab is not None:
            row["ab_default_ms"] = bench(lambda: full(ab)).median_ms
            row["ab_default_ms_again"] = bench(lambda: full(ab)).median_ms
            row["default_ms_again"] = bench(full).median_ms
        fl = p.flops(backward=True)
        best = {w: min((e for e in row[w] if "ms" in e), key=lambda e: e["ms"])
                for w in ("dkdv", "dq")}
        # best with one shared (warps, stages): the sum of the two kernels' bests per pair
        pairs = {}
        for w in ("dkdv", "dq"):
            for e in row[w]:
                if "ms" in e:
                    key = (e["config"]["num_warps"], e["config"]["num_stages"])
                    pairs.setdefault(key, {}).setdefault(w, []).append(e["ms"])
        shared = min(min(v["dkdv"]) + min(v["dq"]) for v in pairs.values()
                     if "dkdv" in v and "dq" in v)
        row["best"] = best
        row["best_separate_ms"] = best["dkdv"]["ms"] + best["dq"]["ms"]
        row["best_shared_ms"] = shared
        results.append(row)
        msg = (f"{p.describe()}: default {row['default_ms']:.3f} ms "
               f"({tflops(fl, row['default_ms']):.0f} TFLOP/s; dkdv "
               f"{row['default_parts_ms']['dkdv']:.3f} dq {row['default_parts_ms']['dq']:.3f})"
               f" | best dkdv {best['dkdv']['ms']:.3f} {best['dkdv']['config']}"
               f" | best dq {best['dq']['ms']:.3f} {best['dq']['config']}"
               f" | separate {row['best_separate_ms']:.3f} shared {shared:.3f}")
        if ab is not None:
            msg += (f" | A/B default: this {row['default_ms']:.3f}/{row['default_ms_again']:.3f}"
                    f" other {row['ab_default_ms']:.3f}/{row['ab_default_ms_again']:.3f}")
        print(msg, flush=True)
        torch.cuda.empty_cache()
    overall = best_overall(results, args.knobs)
    if overall:
        print(f"best one config over the shapes (sum of the two kernels' times, geomean vs the "
              f"default's parts {overall['vs_default_parts']:.3f}): "
              f"{json.dumps(overall['config'])}", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"device": dev.to_dict(), "knobs": args.knobs,
                                          "best_overall": overall, "rows": results}, indent=1))


def best_overall(rows: list[dict], knobs: dict) -> dict | None:
    """The one whole config (a dK/dV entry and a dQ entry of the same warps and stages) whose
    summed kernel times are the lowest over every shape, as the geomean of the ratio to the
    default's two kernels: what a head-dim default would be, for shapes of one head dim."""
    import math

    def table(row: dict, which: str) -> dict:
        return {json.dumps(e["config"], sort_keys=True): e["ms"] for e in row[which] if "ms" in e}
    tables = [(table(r, "dkdv"), table(r, "dq"), sum(r["default_parts_ms"].values()))
              for r in rows]
    if not tables:
        return None
    best = None
    for a in tables[0][0]:
        for b in tables[0][1]:
            ca, cb = json.loads(a), json.loads(b)
            if (ca["num_warps"], ca["num_stages"]) != (cb["num_warps"], cb["num_stages"]):
                continue
            if not all(a in ta and b in tb for ta, tb, _ in tables):
                continue
            score = math.exp(sum(math.log((ta[a] + tb[b]) / base) for ta, tb, base in tables)
                             / len(tables))
            if best is None or score < best[0]:
                best = (score, {**ca, **cb, **knobs})
    return None if best is None else {"config": best[1], "vs_default_parts": best[0]}


def compare_full(args: argparse.Namespace, rounds: int = 3) -> None:
    """Whole backwards (preprocess, dK/dV, dQ) of the given configs, interleaved rounds."""
    import statistics

    import torch

    from flashtune.autotune.precompile import precompile
    from flashtune.autotune.timing import bench, tflops
    from flashtune.core.device import cuda_device
    from flashtune.kernel_templates import get_template

    spec, fwd = get_template("attn_bwd"), get_template("attn_fwd")
    dev = cuda_device()
    by_d = {int(d): cfgs for d, cfgs in json.loads(args.full).items()}
    rows = []
    for shape in args.shapes.split(","):
        p = problem(shape)
        cfgs = [spec.space.validate(c) for c in by_d[p.head_dim]]
        precompile(spec, p, cfgs, workers=args.workers)
        g = torch.Generator(device="cuda").manual_seed(0)
        mk = lambda h, n: torch.randn(p.batch, h, n, p.head_dim, device="cuda",  # noqa: E731
                                      generator=g, dtype=torch.bfloat16)
        q, k, v, do = mk(p.heads_q, p.seqlen_q), mk(p.heads_kv, p.seqlen_k), \
            mk(p.heads_kv, p.seqlen_k), mk(p.heads_q, p.seqlen_q)
        out, lse = fwd.launcher(q, k, v, fwd.default_config(p, dev), causal=p.causal,
                                return_lse=True)
        fns = [lambda c=c: spec.launcher(q, k, v, out, lse, do, c, causal=p.causal)
               for c in cfgs]
        samples: list[list[float]] = [[] for _ in cfgs]
        for _ in range(rounds):
            for i, fn in enumerate(fns):
                samples[i].append(bench(fn).median_ms)
        fl = p.flops(backward=True)
        for c, ms in zip(cfgs, samples):
            med = statistics.median(ms)
            rows.append({"problem": p.key(), "config": c, "ms": ms, "median_ms": med,
                         "tflops": tflops(fl, med)})
            print(f"{p.describe():50s} {json.dumps(c):130s} {med:.3f} ms "
                  f"{tflops(fl, med):.0f} TFLOP/s (rounds {', '.join(f'{x:.3f}' for x in ms)})",
                  flush=True)
        fns.clear()
        torch.cuda.empty_cache()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"device": dev.to_dict(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
