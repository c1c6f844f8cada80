"""attn_decode's ``SPLIT_D`` knob on one GPU: a head dim of 96 as one padded 128-wide tile
against two tiles of 64 + 32, config by config.

    OUT=DIR [TIMING=cold] python benchmarks/probe_decode_split_d.py
                               (writes DIR/decode_split_d.json, or decode_split_d_cold.json)

Per decode shape (Phi-3's 32:32 heads of 96, bf16, B 1-16 over 4096 and 12000 keys, every
length full, causal), the same configs both ways: ``NTRIPLES`` seeded (BLOCK_N, num_warps,
num_stages) triples (num_stages >= 2) at the default rule's split count for their BLOCK_N,
half and twice it, plus the default config and the shipped table's. Each is checked against
the fp32 reference, then timed by CUDA-graph replays of the cache launcher (how a static
cache's step runs; ``bench_decode.py --graph``'s method). Replayed back to back, a step
finds the K/V of the step before in the L2 where they fit (50 MB at B1 over 4096 keys; the
H200's L2 is 60 MB), which no layer of a real model does; ``TIMING=cold`` zeroes a 256 MB
buffer before each step inside the graph and subtracts a graph of the zeroing alone (the
tuner's cold L2, without its host). The three fastest of each way, the
default and the table's config (both ways) are then re-timed in three interleaved rounds
with SDPA's cuDNN and FLASH steps (medians of the rounds). Candidates are compiled first in
a pool of 16 processes sharing ``TRITON_CACHE_DIR``.
"""
import functools
import json
import os
import random
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

HQ, HKV, D = 32, 32, 96
SHAPES = [(1, 4096), (2, 4096), (4, 4096), (8, 4096), (16, 4096), (1, 12000), (4, 12000),
          (16, 12000)]
NTRIPLES = int(os.environ.get("NTRIPLES", "10"))
COLD = os.environ.get("TIMING", "warm") == "cold"


def _key(c):
    return json.dumps(c, sort_keys=True)


def _warm(b, n, cfg):
    import torch

    from flashtune.kernel_templates.attn_decode.launcher import kernel_args, partial_shapes
    from flashtune.kernel_templates.shaped import Shaped
    q = Shaped(torch.bfloat16, (b, HQ, 1, D))
    k = Shaped(torch.bfloat16, (b, HKV, n, D))
    op = lp = None
    if cfg["NUM_SPLITS"] > 1:
        os_, ls_ = partial_shapes(q, cfg["NUM_SPLITS"])
        op, lp = Shaped(torch.float32, os_), Shaped(torch.float32, ls_)
    try:
        for kern, args, kw, grid in kernel_args(q, k, k, Shaped(torch.bfloat16, q.shape), None,
                                               Shaped(torch.int32, (b,)), None, op, lp, cfg,
                                               seqlen_k=n, causal=True, scale=D ** -0.5,
                                               upcast_dot=False):
            kern.warmup(*args, grid=grid, **kw)
    except Exception as exc:
        return str(exc)[:200]
    return None


def main():
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from triton.testing import do_bench_cudagraph

    from flashtune.autotune.timing import bench_graph
    from flashtune.core.device import cuda_device
    from flashtune.core.problem import AttentionProblem
    from flashtune.kernel_templates import get_template
    from flashtune.kernel_templates.attn_decode.launcher import attn_decode_kvcache
    from flashtune.kernel_templates.attn_decode.reference import attn_decode_reference
    from flashtune.kernel_templates.attn_decode.space import PARAMS, check, default_splits
    from flashtune.runtime import kvcache

    spec = get_template("attn_decode")
    dev = cuda_device()
    rng = random.Random(0)
    triples = [(bn, w, s) for bn in PARAMS["BLOCK_N"] for w in PARAMS["num_warps"]
               for s in PARAMS["num_stages"] if s >= 2]
    triples = rng.sample(triples, min(NTRIPLES, len(triples)))
    plan = {}
    for b, n in SHAPES:
        p = AttentionProblem(b, HQ, HKV, 1, n, D, True, "bf16")
        base = []
        for bn, w, s in triples:
            rule = default_splits(p, dev.sm_count, bn)
            for splits in sorted({max(1, rule // 2), rule, rule * 2}):
                if splits in PARAMS["NUM_SPLITS"]:
                    base.append({"BLOCK_N": bn, "NUM_SPLITS": splits, "num_warps": w,
                                 "num_stages": s})
        dflt = {k: v for k, v in spec.default_config(p, dev).items() if k != "SPLIT_D"}
        choice = kvcache.DISPATCH.choose(p, dev)
        table = {k: v for k, v in choice.config.items() if k != "SPLIT_D"}
        cfgs = []
        for c in [dflt, table] + base:
            for split in (0, 1):
                cc = dict(c, SPLIT_D=split)
                if cc not in cfgs and check(cc, p, dev) is None:
                    cfgs.append(cc)
        plan[(b, n)] = (dflt, table, choice.source, cfgs)
    t0 = time.time()
    jobs = [(b, n, c) for (b, n), v in plan.items() for c in v[3]]
    with ProcessPoolExecutor(16, mp_context=get_context("spawn")) as pool:
        errs = list(pool.map(_warm, *zip(*jobs), chunksize=2))
    print(f"precompiled {len(jobs)} configs in {time.time() - t0:.0f} s, "
          f"{sum(e is not None for e in errs)} errors", flush=True)

    def graph_ms(fn):
        torch.cuda.synchronize()
        if COLD:
            return bench_graph(fn, reps=10, cold=True)
        return float(do_bench_cudagraph(fn, rep=30))

    out_rows = []
    for (b, n), (dflt, table, source, cfgs) in plan.items():
        torch.manual_seed(0)
        q = torch.randn(b, HQ, 1, D, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(b, HKV, n, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        lens = torch.full((b,), n, dtype=torch.int32, device="cuda")
        ref, _ = attn_decode_reference(q, k, v, dtype=torch.float32, causal=True)
        nbytes = 2 * b * HKV * n * D * 2

        def sdpa(backend):
            def run():
                with sdpa_kernel(backend):
                    return torch.nn.functional.scaled_dot_product_attention(q, k, v)
            return run
        baselines = {"sdpa_cudnn": sdpa(SDPBackend.CUDNN_ATTENTION),
                     "sdpa_flash": sdpa(SDPBackend.FLASH_ATTENTION)}
        base_err = {name: ((fn().float() - ref).norm() / ref.norm()).item()
                    for name, fn in baselines.items()}
        rows = []
        for c in cfgs:
            kv = functools.partial(attn_decode_kvcache, q, k, v, lens, c)
            try:
                rel = ((kv().float() - ref).norm() / ref.norm()).item()
                if not rel < 2e-2:
                    rows.append({"config": c, "error": f"relerr {rel:.3g}"})
                    continue
                rows.append({"config": c, "relerr": rel, "graph_ms": graph_ms(kv)})
            except Exception as exc:
                rows.append({"config": c, "error": str(exc).splitlines()[0][:200]})
        good = [r for r in rows if "graph_ms" in r]
        pick = []
        for split in (0, 1):
            way = sorted((r for r in good if r["config"]["SPLIT_D"] == split),
                         key=lambda r: r["graph_ms"])
            pick += [r["config"] for r in way[:3]]
        for c in (dflt, table):
            for split in (0, 1):
                cc = dict(c, SPLIT_D=split)
                if cc not in pick and any(r["config"] == cc for r in good):
                    pick.append(cc)
        rounds = {_key(c): [] for c in pick}
        rounds.update({name: [] for name in baselines})
        for _ in range(3):
            for c in pick:
                rounds[_key(c)].append(
                    graph_ms(functools.partial(attn_decode_kvcache, q, k, v, lens, c)))
            for name, fn in baselines.items():
                rounds[name].append(graph_ms(fn))
        med = {kk: sorted(x)[1] for kk, x in rounds.items()}
        best = {split: min((c for c in pick if c["SPLIT_D"] == split),
                           key=lambda c: med[_key(c)]) for split in (0, 1)}
        cu = med["sdpa_cudnn"]

        def ms(c):
            return med.get(_key(c), float("nan"))
        row = {"shape": {"batch": b, "heads_q": HQ, "heads_kv": HKV, "seqlen_k": n,
                         "head_dim": D}, "bytes": nbytes, "default": dflt, "table": table,
               "table_source": source, "baseline_relerr": base_err, "configs": rows,
               "confirm_ms": med,
               "best": {str(s): {"config": best[s], "ms": ms(best[s]),
                                 "tbps": nbytes / ms(best[s]) / 1e9} for s in (0, 1)},
               "ratios": {
                   "best_split_over_best_one_tile": ms(best[0]) / ms(best[1]),
                   "best_split_vs_cudnn": cu / ms(best[1]),
                   "best_one_tile_vs_cudnn": cu / ms(best[0]),
                   "default_split_over_default": (ms(dict(dflt, SPLIT_D=0))
                                                  / ms(dict(dflt, SPLIT_D=1))),
                   "table_split_over_table": (ms(dict(table, SPLIT_D=0))
                                              / ms(dict(table, SPLIT_D=1))),
                   "table_vs_cudnn": cu / ms(dict(table, SPLIT_D=0)),
                   "flash_vs_cudnn": cu / med["sdpa_flash"]}}
        out_rows.append(row)
        r = row["ratios"]
        print(f"B{b} N{n}: cudnn {cu * 1e3:.1f}us ({nbytes / cu / 1e9:.2f} TB/s) | best one "
              f"tile {r['best_one_tile_vs_cudnn']:.3f}x cudnn, best split "
              f"{r['best_split_vs_cudnn']:.3f}x cudnn ({r['best_split_over_best_one_tile']:.3f}x"
              f" one tile) | default split/one {r['default_split_over_default']:.3f} | table "
              f"{r['table_vs_cudnn']:.3f}x cudnn, split/one {r['table_split_over_table']:.3f} "
              f"| best split {best[1]}", flush=True)
        del k, v
        torch.cuda.empty_cache()
    outdir = os.environ.get("OUT", ".")
    name = "decode_split_d_cold.json" if COLD else "decode_split_d.json"
    with open(os.path.join(outdir, name), "w") as f:
        json.dump({"benchmark": "probe_decode_split_d", "device": torch.cuda.get_device_name(),
                   "torch": torch.__version__, "source_hash": spec.source_hash,
                   "method": ("CUDA-graph replays of a 256 MB zeroing and the step, minus "
                              "replays of the zeroing (10 a graph, median of 5)" if COLD else
                              "CUDA-graph replays (do_bench_cudagraph rep 30)")
                   + ", medians of 3 interleaved rounds", "rows": out_rows}, f, indent=1)


if __name__ == "__main__":
    main()
