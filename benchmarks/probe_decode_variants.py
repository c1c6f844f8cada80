"""attn_decode's two compiled variants, and the headroom of its space, on one GPU.

    NSAMPLE=46 OUT=DIR python benchmarks/probe_decode_variants.py   (writes DIR/decode_variants.json)

The split kernel compiles one way for dense K/V (``attn_decode``: the keys' count a launch
argument) and another for a KV cache (``attn_decode_kvcache``: lengths read per sequence).
Per GQA decode shape (32:8 D128 bf16, B 1-64 over 4k-16k keys, every length full), a seeded
sample of the space (num_stages >= 2, split counts within 4x of the default rule's) plus the
default and the shipped table's config, each timed three ways: the cache variant with a cold
L2 (the tuner's method: ``flashtune.autotune.timing.bench``), the cache variant by CUDA-graph
replays (``bench_decode.py --graph``'s), the dense variant with a cold L2; and the split
kernel alone by replays (what the combine costs). cuDNN's step beside, both ways. The top
three of each method, the default and the table's config are then re-timed in three
interleaved rounds with cuDNN (``confirm``, medians). Every config is checked against the
fp32 reference before it is timed. Candidates are compiled first in a pool of 16 processes
sharing ``TRITON_CACHE_DIR``.
"""
import functools
import itertools
import json
import os
import random
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

HQ, HKV, D = 32, 8, 128
SHAPES = [(1, 4096), (1, 16384), (2, 8192), (4, 4096), (4, 16384), (16, 4096),
          (16, 16384), (64, 4096)]
NSAMPLE = int(os.environ.get("NSAMPLE", "40"))


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
        for sl in (None, Shaped(torch.int32, (b,))):
            for kern, args, kw, grid in kernel_args(q, k, k, Shaped(torch.bfloat16, q.shape), None,
                                                   sl, None, op, lp, cfg, seqlen_k=n,
                                                   causal=True, scale=D ** -0.5,
                                                   upcast_dot=False):
                kern.warmup(*args, grid=grid, **kw)
    except Exception as exc:
        return str(exc)[:200]
    return None


def main():
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from triton.testing import do_bench_cudagraph

    from flashtune.autotune.timing import bench
    from flashtune.core.device import cuda_device
    from flashtune.core.problem import AttentionProblem
    from flashtune.kernel_templates import get_template
    from flashtune.kernel_templates.attn_decode.launcher import (
        attn_decode,
        attn_decode_kvcache,
        kernel_args,
        partial_shapes,
    )
    from flashtune.kernel_templates.attn_decode.reference import attn_decode_reference
    from flashtune.kernel_templates.attn_decode.space import PARAMS, check, default_splits
    from flashtune.runtime import kvcache

    spec = get_template("attn_decode")
    dev = cuda_device()
    rng = random.Random(0)
    plan = {}
    for b, n in SHAPES:
        p = AttentionProblem(b, HQ, HKV, 1, n, D, True, "bf16")
        allc = [dict(zip(PARAMS, vals)) for vals in itertools.product(*PARAMS.values())]
        ok = [c for c in allc if check(c, p, dev) is None and c["num_stages"] >= 2]
        ds = {bn: default_splits(p, dev.sm_count, bn) for bn in PARAMS["BLOCK_N"]}
        ok = [c for c in ok if ds[c["BLOCK_N"]] / 4 <= c["NUM_SPLITS"] <= ds[c["BLOCK_N"]] * 4]
        sample = rng.sample(ok, min(NSAMPLE, len(ok)))
        dflt = spec.default_config(p, dev)
        table = kvcache.DISPATCH.choose(p, dev)
        cfgs = [dflt, dict(table.config)] + sample
        uniq = []
        for c in cfgs:
            if c not in uniq:
                uniq.append(c)
        plan[(b, n)] = (p, dflt, dict(table.config), table.source, uniq)
    t0 = time.time()
    jobs = [(b, n, c) for (b, n), v in plan.items() for c in v[4]]
    with ProcessPoolExecutor(16, mp_context=get_context("spawn")) as pool:
        errs = list(pool.map(_warm, *zip(*jobs), chunksize=2))
    print(f"precompiled {len(jobs)} x2 in {time.time() - t0:.0f} s, "
          f"{sum(e is not None for e in errs)} errors", flush=True)

    def graph_ms(fn):
        torch.cuda.synchronize()
        return float(do_bench_cudagraph(fn, rep=30))

    out_rows = []
    for (b, n), (_p, dflt, tab, src, cfgs) in plan.items():
        torch.manual_seed(0)
        q = torch.randn(b, HQ, 1, D, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(b, HKV, n, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        lens = torch.full((b,), n, dtype=torch.int32, device="cuda")
        ref, _ = attn_decode_reference(q[:1], k[:1], v[:1], dtype=torch.float32, causal=True)
        nbytes = 2 * b * HKV * n * D * 2

        def cud():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        cudnn = {"cold": bench(cud, rep_ms=30).median_ms, "graph": graph_ms(cud)}
        rows = []
        for c in cfgs:
            kv = functools.partial(attn_decode_kvcache, q, k, v, lens, c)
            de = functools.partial(attn_decode, q, k, v, c, causal=True)
            try:
                o = kv()[:1].float()
                rel = ((o - ref).norm() / ref.norm()).item()
                if not rel < 2e-2:
                    rows.append({"config": c, "error": f"relerr {rel:.3g}"})
                    continue
                r = {"config": c, "relerr": rel,
                     "kv_cold": bench(kv, rep_ms=30).median_ms,
                     "dense_cold": bench(de, rep_ms=30).median_ms,
                     "kv_graph": graph_ms(kv)}
                if c["NUM_SPLITS"] > 1:  # the split kernel alone, graph
                    ops, lps = partial_shapes(q, c["NUM_SPLITS"])
                    opart = torch.empty(ops, device="cuda", dtype=torch.float32)
                    lpart = torch.empty(lps, device="cuda", dtype=torch.float32)
                    o_ = torch.empty_like(q)
                    kern, args, kw, grid = kernel_args(q, k, v, o_, None, lens, None, opart,
                                                       lpart, c, seqlen_k=n, causal=True,
                                                       scale=D ** -0.5, upcast_dot=False)[0]
                    r["split_only_graph"] = graph_ms(lambda: kern[grid](*args, **kw))
                rows.append(r)
            except Exception as exc:
                rows.append({"config": c, "error": str(exc).splitlines()[0][:200]})
        good = [r for r in rows if "kv_cold" in r]
        # confirm: top 3 of each method, default, table, cuDNN: 3 interleaved rounds
        pick = []
        for key in ("kv_cold", "kv_graph", "dense_cold"):
            for r in sorted(good, key=lambda r: r[key])[:3]:
                if r not in pick:
                    pick.append(r)
        for c in (dflt, tab):
            r = next((r for r in good if r["config"] == c), None)
            if r is not None and r not in pick:
                pick.append(r)
        conf = {json.dumps(r["config"], sort_keys=True): {"cold": [], "graph": []} for r in pick}
        conf["cudnn"] = {"cold": [], "graph": []}
        for _ in range(3):
            for r in pick:
                kv = functools.partial(attn_decode_kvcache, q, k, v, lens, r["config"])
                e = conf[json.dumps(r["config"], sort_keys=True)]
                e["cold"].append(bench(kv, rep_ms=30).median_ms)
                e["graph"].append(graph_ms(kv))
            conf["cudnn"]["cold"].append(bench(cud, rep_ms=30).median_ms)
            conf["cudnn"]["graph"].append(graph_ms(cud))
        med = {kk: {m: sorted(x)[1] for m, x in vv.items()} for kk, vv in conf.items()}
        row = {"shape": [b, HQ, HKV, n, D], "bytes": nbytes, "default": dflt, "table": tab,
               "table_source": src, "cudnn": cudnn, "configs": rows, "confirm": med}
        out_rows.append(row)
        cu = med["cudnn"]
        best_c = min((kk for kk in med if kk != "cudnn"), key=lambda kk: med[kk]["cold"])
        best_g = min((kk for kk in med if kk != "cudnn"), key=lambda kk: med[kk]["graph"])
        dk, tk = json.dumps(dflt, sort_keys=True), json.dumps(tab, sort_keys=True)
        def rat(kk, m):
            return cu[m] / med[kk][m] if kk in med else float("nan")
        dense_best = min(good, key=lambda r: r["dense_cold"])["config"]
        print(f"B{b} N{n}: cudnn cold {cu['cold']*1e3:.1f}us graph {cu['graph']*1e3:.1f}us | "
              f"vs cudnn (cold/graph): default {rat(dk,'cold'):.3f}/{rat(dk,'graph'):.3f} "
              f"table {rat(tk,'cold'):.3f}/{rat(tk,'graph'):.3f} "
              f"best-cold {rat(best_c,'cold'):.3f}/{rat(best_c,'graph'):.3f} {best_c} "
              f"best-graph {rat(best_g,'cold'):.3f}/{rat(best_g,'graph'):.3f} {best_g} "
              f"dense-best {dense_best}", flush=True)
        del k, v
        torch.cuda.empty_cache()
    outdir = os.environ.get("OUT", ".")
    with open(os.path.join(outdir, "decode_variants.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "source_hash": spec.source_hash, "rows": out_rows}, f, indent=1)


if __name__ == "__main__":
    main()
