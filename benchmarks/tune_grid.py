"""Tune the standard grid on this GPU and compare, in one run, against the baselines.

    python benchmarks/tune_grid.py --db sqlite:////tmp/ft.db --trials 40 \
        [--exhaustive 4] [--single] [--triton-autotune] --out benchmarks/results/tune_grid.json

Per shape: tuned config vs the template default vs SDPA flash (FA2) vs SDPA cuDNN, all timed
here after the tuning (same process, same inputs), plus trials and tuning wall time.
``--exhaustive K``: for the first K shapes also run the full grid sampler, and report how many
Optuna trials and seconds it took to come within 2% of the exhaustive optimum.
``--single``: the best single hard-coded config over the grid (among all tuned winners).
``--merge A.json,B.json``: tune nothing; merge earlier runs' rows (the grid split over two
commands) and find the best single config among all their winners, re-timed in this run.
``--triton-autotune``: Triton's own @triton.autotune over the tutorial's 36 configs.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_fwd import SDPA_BACKENDS, check, sdpa_fn  # noqa: E402

import flashtune  # noqa: E402
from flashtune.autotune.grids import standard_grid  # noqa: E402
from flashtune.autotune.jobs import tune  # noqa: E402
from flashtune.autotune.options import TuneOptions  # noqa: E402
from flashtune.autotune.timing import bench, tflops  # noqa: E402
from flashtune.core.device import cuda_device  # noqa: E402
from flashtune.kernel_templates import get_template  # noqa: E402
from flashtune.kernel_templates.attn_fwd.reference import attn_fwd_reference  # noqa: E402
from flashtune.kernel_templates.attn_fwd.space import block_d  # noqa: E402

SPEC = get_template("attn_fwd")
TUTORIAL_36 = [dict(BLOCK_M=bm, BLOCK_N=bn, num_stages=s, num_warps=w)
               for bm in (64, 128) for bn in (32, 64, 128) for s in (2, 3, 4) for w in (4, 8)]


def geomean(xs):
    xs = [x for x in xs if x]
    return 2 ** (sum(math.log2(x) for x in xs) / len(xs)) if xs else None


def inputs(p, dtype):
    torch.manual_seed(0)
    q = torch.randn(p.batch, p.heads_q, p.seqlen_q, p.head_dim, device="cuda", dtype=dtype)
    k = torch.randn(p.batch, p.heads_kv, p.seqlen_k, p.head_dim, device="cuda", dtype=dtype)
    return q, k, torch.randn_like(k)


def triton_autotuned(q, k, v, causal):
    """The kernel under @triton.autotune with the tutorial's config list (keyed on shape)."""
    global _AUTOTUNED
    if "_AUTOTUNED" not in globals():
        kern = SPEC.kernel
        cfgs = [triton.Config({"BLOCK_M": c["BLOCK_M"], "BLOCK_N": c["BLOCK_N"]},
                              num_warps=c["num_warps"], num_stages=c["num_stages"])
                for c in TUTORIAL_36]
        _AUTOTUNED = triton.autotune(cfgs, key=["N_Q", "N_K", "H_Q", "HEAD_DIM", "IS_CAUSAL"])(kern)
    b, hq, nq, d = q.shape
    out = torch.empty_like(q)
    grid = lambda meta: (triton.cdiv(nq, meta["BLOCK_M"]), b * hq)  # noqa: E731
    _AUTOTUNED[grid](q, k, v, out, out, None, None, None, None, q.stride(0), q.stride(1), q.stride(2),
                     k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
                     out.stride(0), out.stride(1), out.stride(2), 0, 0,
                     hq, hq // k.shape[1], nq, k.shape[2], 1.0 / math.sqrt(d),
                     HEAD_DIM=d, BLOCK_D=block_d(d), IS_CAUSAL=causal, STORE_LSE=False,
                     UPCAST_DOT=False, NEG_SCALE=False, USE_TMA=False, REVERSE_M=False)
    return out


def trials_to_within(db_url, p, best_ms, factor):
    """From the Optuna run's recorded trials: trials and seconds until within ``factor``."""
    from flashtune.db import TrialState, open_store

    with open_store(db_url, read_only=True) as store:
        dev = [d for d in store.list_devices() if d.name == cuda_device().name][0]
        tpl = [t for t in store.list_templates() if t.source_hash == SPEC.source_hash][0]
        prob = [x for x in store.list_problems("attn_fwd") if x.key == p.key()][0]
        trials = sorted(store.list_trials(device_id=dev.id, template_id=tpl.id,
                                          problem_id=prob.id), key=lambda t: t.number)
    t_start = trials[0].started_at
    for i, t in enumerate(trials, 1):
        if t.state == TrialState.COMPLETE and t.median_ms <= best_ms * factor:
            return {"optuna_trials_to_2pct": i,
                    "optuna_seconds_to_2pct": (t.finished_at - t_start).total_seconds()}
    return {"optuna_trials_to_2pct": None, "optuna_seconds_to_2pct": None}


def best_single(prior_rows, dev, dtype):
    """The one config a user would hard-code: best geomean over the grid among the winners.

    Every winner and every shape's own winner are timed here, in this process, so the
    tuned/single ratio compares like with like.
    """
    from flashtune.core.problem import AttentionProblem

    problems = [AttentionProblem.from_key(r["problem"]) for r in prior_rows]
    winners = [json.loads(w) for w in sorted({json.dumps(r["tuned_config"], sort_keys=True)
                                              for r in prior_rows})]
    table = {}  # (winner index, shape index) -> TFLOP/s
    for j, p in enumerate(problems):
        q, k, v = inputs(p, dtype)
        for i, cfg in enumerate(winners):
            if not p.causal:  # reversing the tile order is a no-op without a causal mask
                cfg = {**cfg, "REVERSE_M": 0}
            if SPEC.space.check(cfg, p, dev) is None:
                table[i, j] = tflops(p.flops(), bench(
                    lambda: SPEC.launcher(q, k, v, cfg, causal=p.causal)).median_ms)
        del q, k, v
        torch.cuda.empty_cache()
    usable = [i for i in range(len(winners)) if all((i, j) in table for j in range(len(problems)))]
    best = max(usable, key=lambda i: geomean([table[i, j] for j in range(len(problems))]))
    rows = []
    for j, (p, r) in enumerate(zip(problems, prior_rows)):
        own = winners.index(json.loads(json.dumps(r["tuned_config"], sort_keys=True)))
        rows.append({"problem": p.key(), "tuned": table[own, j], "best_single": table[best, j]})
    return winners[best], rows


def final_interleaved(rows, single_cfg, dtype, rounds=3):
    """Every contender of every shape re-timed here, interleaved (tuned, default, best single,
    SDPA flash, SDPA cuDNN, then again, ``rounds`` times; the median of the rounds), so clock
    drift hits them alike and one config is one measurement even when it has two names."""
    from flashtune.core.problem import AttentionProblem

    for r in rows:
        p = AttentionProblem.from_key(r["problem"])
        q, k, v = inputs(p, dtype)
        ref, _ = attn_fwd_reference(q[:1, :2], k[:1, :2], v[:1, :2], causal=p.causal,
                                    dtype=torch.float32)
        configs = {"tuned": r["tuned_config"], "default": r["default_config"]}
        if single_cfg is not None:
            configs["best_single"] = single_cfg if p.causal else {**single_cfg, "REVERSE_M": 0}
        fns, alias, first = {}, {}, {}  # alias: name -> the name whose timing it shares
        for name, cfg in configs.items():
            alias[name] = first.setdefault(json.dumps(cfg, sort_keys=True), name)
            if alias[name] == name:
                fns[name] = (lambda c=cfg: SPEC.launcher(q, k, v, c, causal=p.causal))
        for name in ("sdpa_flash", "sdpa_cudnn"):
            fns[name], alias[name] = sdpa_fn(SDPA_BACKENDS[name], q, k, v, p.causal), name
        for name, fn in fns.items():
            check(name, fn()[:1, :2], ref, dtype)
        samples = {name: [] for name in fns}
        for _ in range(rounds):
            for name, fn in fns.items():
                samples[name].append(bench(fn).median_ms)
        ms = {name: sorted(xs)[len(xs) // 2] for name, xs in samples.items()}
        r["final"] = {name: tflops(p.flops(), ms[alias[name]])
                      for name in [*configs, "sdpa_flash", "sdpa_cudnn"]}
        del q, k, v, ref
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--db", required=True)
    ap.add_argument("--head-dims", default="64,128")
    ap.add_argument("--seqlens", default="512,1024,2048,4096,8192,16384")
    ap.add_argument("--trials", type=int, default=40)
    ap.add_argument("--sampler", default="tpe")
    ap.add_argument("--exhaustive", type=int, default=0)
    ap.add_argument("--single-from", default=None,
                    help="results JSON of an earlier run: find the best single hard-coded config "
                         "among its winners, re-timing every winner on every shape here")
    ap.add_argument("--single", action="store_true",
                    help="also find the best single config among this run's winners")
    ap.add_argument("--merge", default=None,
                    help="comma-separated results JSONs of earlier runs: tune nothing, merge "
                         "their rows (same device and source) and find the best single config "
                         "among all their winners, re-timed here")
    ap.add_argument("--triton-autotune", action="store_true")
    ap.add_argument("--out", default="benchmarks/results/tune_grid.json")
    args = ap.parse_args()
    dtype = torch.bfloat16
    grid = standard_grid(tuple(int(x) for x in args.head_dims.split(",")),
                         seqlens=tuple(int(x) for x in args.seqlens.split(",")))
    dev = cuda_device()
    rows = []
    opts = TuneOptions(trials=args.trials, sampler=args.sampler, seed=0, workers=16)
    t_all = time.time()
    if args.merge:
        grid = []
        for path in args.merge.split(","):
            prior = json.loads(Path(path).read_text())
            if prior["source_hash"] != SPEC.source_hash:
                raise SystemExit(f"{path} was tuned for source {prior['source_hash']}, "
                                 f"this is {SPEC.source_hash}")
            rows += prior["rows"]
    for p in grid:
        t0 = time.time()
        [res] = tune([p], opts, db_url=args.db, progress=False)
        tune_wall = time.time() - t0
        row = {"problem": p.key(), "tuned_config": res.best_config, "default_config":
               res.default_config, "trials": res.trials, "states": res.states,
               "tune_wall_s": tune_wall, "flops": p.flops()}
        q, k, v = inputs(p, dtype)
        ref, _ = attn_fwd_reference(q[:1, :2], k[:1, :2], v[:1, :2], causal=p.causal,
                                    dtype=torch.float32)
        fns = {"tuned": lambda: SPEC.launcher(q, k, v, res.best_config, causal=p.causal),
               "default": lambda: SPEC.launcher(q, k, v, res.default_config, causal=p.causal),
               "sdpa_flash": sdpa_fn(SDPA_BACKENDS["sdpa_flash"], q, k, v, p.causal),
               "sdpa_cudnn": sdpa_fn(SDPA_BACKENDS["sdpa_cudnn"], q, k, v, p.causal)}
        if args.triton_autotune:
            fns["triton_autotune_36"] = lambda: triton_autotuned(q, k, v, p.causal)
        for name, fn in fns.items():
            check(name, fn()[:1, :2], ref, dtype)
            row[name] = tflops(p.flops(), bench(fn).median_ms)
        if len(rows) < args.exhaustive:
            t1 = time.time()
            ex_db = args.db + "_exhaustive" if args.db.startswith("sqlite") else args.db
            [ex] = tune([p], TuneOptions(trials=10_000, sampler="grid", seed=0, workers=16),
                        db_url=ex_db, progress=False)
            row["exhaustive"] = {"best_config": ex.best_config, "trials": ex.trials,
                                 "wall_s": time.time() - t1,
                                 "tflops": tflops(p.flops(), bench(lambda: SPEC.launcher(
                                     q, k, v, ex.best_config, causal=p.causal)).median_ms)}
        rows.append(row)
        print(json.dumps({k2: row.get(k2) for k2 in (
            "problem", "tuned_config", "tuned", "default", "sdpa_flash", "sdpa_cudnn",
            "triton_autotune_36", "trials", "tune_wall_s", "exhaustive")}), flush=True)
        # partial results survive a run cut off at its time limit
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"partial": True, "rows": rows}, indent=1))
        del q, k, v, ref
        torch.cuda.empty_cache()
    single_cfg = None
    if args.single_from or args.single or args.merge:  # the winners, re-timed on every shape
        prior = json.loads(Path(args.single_from).read_text())["rows"] if args.single_from \
            else rows
        single_cfg, single_rows = best_single(prior, dev, dtype)
        result_single = {"config": single_cfg, "rows": single_rows,
                         "tuned_vs_best_single": geomean([r["tuned"] / r["best_single"]
                                                          for r in single_rows])}
    else:
        result_single = None
    if args.merge:  # the final table: every contender re-timed interleaved in this run
        final_interleaved(rows, single_cfg, dtype)
        for r in rows:
            r["tune_run"] = {n: r[n] for n in ("tuned", "default", "sdpa_flash", "sdpa_cudnn")}
            r.update({n: r["final"][n] for n in ("tuned", "default", "sdpa_flash", "sdpa_cudnn")})
        if result_single is not None:
            result_single["tuned_vs_best_single_interleaved"] = geomean(
                [r["final"]["tuned"] / r["final"]["best_single"] for r in rows])
    summary = {
        "tuned_vs_default": geomean([r["tuned"] / r["default"] for r in rows]) if rows else None,
        "tuned_vs_fa2": geomean([r["tuned"] / r["sdpa_flash"] for r in rows]) if rows else None,
        "tuned_vs_cudnn": geomean([r["tuned"] / r["sdpa_cudnn"] for r in rows]) if rows else None,
        "min_tuned_vs_cudnn": min(r["tuned"] / r["sdpa_cudnn"] for r in rows) if rows else None,
        "best_single": result_single,
        "tuned_vs_triton_autotune": geomean([r["tuned"] / r["triton_autotune_36"] for r in rows
                                             if "triton_autotune_36" in r]),
        "wall_s": time.time() - t_all,
    }
    result = {"benchmark": "attn_fwd tuned standard grid", "dtype": "bf16",
              "device": dev.to_dict(), "torch": torch.__version__, "triton": triton.__version__,
              "flashtune": flashtune.__version__, "source_hash": SPEC.source_hash,
              "options": vars(args), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
              "summary": summary, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print("| D | N | causal | tuned cfg | tuned | default | FA2 | cuDNN | x default | x FA2 | "
          "x cuDNN | trials | tune s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        p, c = r["problem"], r["tuned_config"]
        print(f"| {p['head_dim']} | {p['seqlen_q']} | {'y' if p['causal'] else 'n'} | "
              f"{c['BLOCK_M']},{c['BLOCK_N']},{c['num_warps']},{c['num_stages']}"
              f"{'T' if c.get('USE_TMA') else ''}{'R' if c.get('REVERSE_M') else ''} | "
              f"{r['tuned']:.0f} | {r['default']:.0f} | {r['sdpa_flash']:.0f} | "
              f"{r['sdpa_cudnn']:.0f} | {r['tuned'] / r['default']:.2f} | "
              f"{r['tuned'] / r['sdpa_flash']:.2f} | {r['tuned'] / r['sdpa_cudnn']:.2f} | "
              f"{r['trials']} | {r['tune_wall_s']:.0f} |")
        if "exhaustive" in r:
            print(f"|   exhaustive: {r['exhaustive']}")
    if result_single:
        print("best single config:", result_single["config"], "tuned/single geomean",
              f"{result_single['tuned_vs_best_single']:.3f}")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
