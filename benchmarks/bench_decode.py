"""Decode benchmark: flashtune attn_decode (contiguous and paged caches) vs SDPA flash (FA2)
and cuDNN, measured side by side in one run.

    python benchmarks/bench_decode.py [--batches 1,4,16,64] [--seqlens 1024,...,131072]
        [--page-size 64] [--window LEFT] [--softcap CAP] [--db URL] [--graph [--cold]]
        [--out benchmarks/results/decode.json]

Grid: Nq = 1, Hq 32, Hkv 8, D 128, bf16 (ANCHORS.md's decode setting), every sequence at
the full length Nk; shapes whose K+V exceed --max-kv-gb are skipped. Effective bandwidth
is ANCHORS.md's: bytes = K and V read once = ``2 B Hkv Nk D elem_size``, in TB/s.

Per shape, first the contiguous cache ``(B, Hkv, Nk, D)`` (contiguous tensors): flashtune's
launcher with the template default (and, with --db, the config the lookup chain serves from
that store) and SDPA with ``enable_gqa=True`` under each backend (falling back to K/V
expanded to Hq heads if a backend refuses GQA; the JSON says which call ran). Then a paged
cache ``(num_pages, Hkv, page_size, D)`` of the same size with a shuffled block table (the
contiguous cache is freed first, so one cache is held at a time). ``--window LEFT``: a
causal sliding window (the bytes and SDPA's keys are the last LEFT + 1). ``--softcap CAP``:
Gemma 2's logit softcap for flashtune; SDPA has none, so its backends are timed on the same
keys without it and checked against the reference without it (a bandwidth anchor, not the
same result). Every
implementation is checked against an fp32 reference (batch 0) before it is timed. Prints a
markdown table last; writes the full figures as JSON.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,4,16,64")
    ap.add_argument("--seqlens", default="1024,4096,16384,65536,131072")
    ap.add_argument("--heads-q", type=int, default=32)
    ap.add_argument("--heads-kv", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--window", type=int, default=None, metavar="LEFT",
                    help="a causal sliding window (FlashAttention-2's window_size (LEFT, 0)): "
                         "flashtune reads the cache's last LEFT + 1 keys; SDPA, which has no "
                         "window, is given those keys (the same result); bytes count them")
    ap.add_argument("--softcap", type=float, default=0.0, metavar="CAP",
                    help="Gemma 2's logit softcap for flashtune (SDPA, which has none, is "
                         "timed on the same keys without it)")
    ap.add_argument("--max-kv-gb", type=float, default=40.0,
                    help="skip shapes whose K+V take more than this many GB")
    ap.add_argument("--baselines", default="sdpa_flash,sdpa_cudnn")
    ap.add_argument("--db", default=None, metavar="URL",
                    help="also time the config the lookup chain serves from this store")
    ap.add_argument("--graph", action="store_true",
                    help="time CUDA-graph replays (no launch overhead) instead of launches")
    ap.add_argument("--cold", action="store_true",
                    help="with --graph: a 256 MB zeroing before each replayed step, "
                         "subtracted (timing.bench_graph(cold=True)): K/V read from memory, "
                         "as in a model's step, where back-to-back replays find what fits "
                         "in the L2")
    ap.add_argument("--out", default="benchmarks/results/decode.json")
    return ap.parse_args(argv)


def kv_bytes(b, hkv, nk, d, elem=2):
    return 2 * b * hkv * nk * d * elem


def check(name, out, ref, bf16):
    rel = ((out.float() - ref).norm() / ref.norm()).item()
    limit = 2e-2 if bf16 else 5e-3
    if not rel < limit:
        raise SystemExit(f"{name}: relative error {rel:.2e} >= {limit}; refusing to time it")
    return rel


def main() -> None:
    args = parse_args()
    import torch
    import triton
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import flashtune
    from flashtune.autotune.timing import bench
    from flashtune.core.device import cuda_device
    from flashtune.core.problem import AttentionProblem
    from flashtune.kernel_templates import get_template
    from flashtune.kernel_templates.attn_decode import attn_decode_kvcache
    from flashtune.kernel_templates.attn_decode.reference import attn_decode_reference

    backends = {"sdpa_flash": SDPBackend.FLASH_ATTENTION,
                "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
                "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION}
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    spec = get_template("attn_decode")
    dev = cuda_device()
    hq, hkv, d, ps = args.heads_q, args.heads_kv, args.head_dim, args.page_size
    window = (-1, -1) if args.window is None else (args.window, -1)
    softcap = float(args.softcap) or None
    dispatcher = None
    if args.db:
        from flashtune.runtime.lookup import Dispatcher

        dispatcher = Dispatcher(spec)
        dispatcher.reload(db_url=args.db)

    def timed(fn):
        torch.cuda.synchronize()  # do_bench_cudagraph runs fn on a side stream
        if args.graph and args.cold:
            from flashtune.autotune.timing import bench_graph

            return {"median_ms": bench_graph(fn, reps=10, rounds=7, cold=True)}
        if args.graph:
            from triton.testing import do_bench_cudagraph

            return {"median_ms": float(do_bench_cudagraph(fn, rep=100))}
        t = bench(fn)
        return {"median_ms": t.median_ms, "p20_ms": t.p20_ms, "p80_ms": t.p80_ms}

    def sdpa_fn(backend, q, k, v):
        """SDPA with enable_gqa; if the backend refuses, with K/V expanded to Hq heads."""
        def gqa():
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        try:
            gqa()
            return gqa, "enable_gqa=True"
        except RuntimeError:
            pass
        ke, ve = (t.repeat_interleave(hq // hkv, dim=1) for t in (k, v))

        def expanded():
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(q, ke, ve)
        return expanded, "K/V expanded with repeat_interleave (bytes counted for Hkv)"

    def run_impl(row, name, fn, ref, call=None):
        try:
            rel = check(name, fn()[:1], ref, dtype == torch.bfloat16)
            row[name] = {**timed(fn), "relerr": rel}
            row[name]["tbps"] = row["bytes"] / (row[name]["median_ms"] * 1e-3) / 1e12
            if call:
                row[name]["call"] = call
        except RuntimeError as exc:  # a backend that does not support the shape, or OOM
            row[name] = {"error": str(exc).splitlines()[0][:200]}

    def contiguous_phase(row, p, q, lens):
        """flashtune (default, tuned) and SDPA on a contiguous (B, Hkv, Nk, D) cache."""
        k = torch.randn(p.batch, hkv, p.seqlen_k, d, device="cuda", dtype=dtype)
        v = torch.randn_like(k)
        ref, _ = attn_decode_reference(q[:1], k[:1], v[:1], dtype=torch.float32, causal=True,
                                       window=window, softcap=softcap)
        configs = {"flashtune": row["config"]}
        if dispatcher is not None:
            choice = dispatcher.choose(p, dev)
            row["tuned_config"] = {"config": choice.config, "source": choice.source}
            if choice.source != "default":
                configs["flashtune_tuned"] = choice.config
        for name, c in configs.items():
            run_impl(row, name, functools.partial(attn_decode_kvcache, q, k, v, lens, c,
                                                  window=window, softcap=softcap), ref)
        if window[0] >= 0:  # SDPA has no window: the keys the window sees, as a cache
            k, v = (t[:, :, -(window[0] + 1):] for t in (k, v))
        if softcap:  # SDPA has no softcap: checked against the plain reference
            ref, _ = attn_decode_reference(q[:1], k[:1], v[:1], dtype=torch.float32,
                                           causal=True)
        for name in args.baselines.split(","):
            try:
                fn, call = sdpa_fn(backends[name], q, k, v)
            except RuntimeError as exc:
                row[name] = {"error": str(exc).splitlines()[0][:200]}
                continue
            run_impl(row, name, fn, ref, call)

    def paged_phase(row, p, q, lens):
        """flashtune on a paged cache of the same size: shuffled pages of ps slots."""
        num_pages = p.batch * -(-p.seqlen_k // ps)
        table = torch.randperm(num_pages, device="cuda").to(torch.int32).view(p.batch, -1)
        kp = torch.randn(num_pages, hkv, ps, d, device="cuda", dtype=dtype)
        vp = torch.randn_like(kp)
        ref, _ = attn_decode_reference(q[:1], kp, vp, cache_seqlens=lens[:1],
                                       block_table=table[:1], dtype=torch.float32,
                                       causal=True, window=window, softcap=softcap)
        fn = functools.partial(attn_decode_kvcache, q, kp, vp, lens, row["config"],
                               block_table=table, window=window, softcap=softcap)
        run_impl(row, "flashtune_paged", fn, ref, f"page_size {ps}, shuffled block table")

    rows, names = [], []
    t0 = time.time()
    for b in (int(x) for x in args.batches.split(",")):
        for nk in (int(x) for x in args.seqlens.split(",")):
            elem = torch.finfo(dtype).bits // 8
            held = kv_bytes(b, hkv, nk, d, elem)  # the cache, whatever a window reads of it
            if held > args.max_kv_gb * 1e9:
                print(f"skip B={b} Nk={nk}: K+V {held / 1e9:.1f} GB > {args.max_kv_gb} GB",
                      file=sys.stderr)
                continue
            nbytes = kv_bytes(b, hkv, nk if window[0] < 0 else min(nk, window[0] + 1), d, elem)
            p = AttentionProblem(b, hq, hkv, 1, nk, d, True, args.dtype, *window,
                                 softcap=float(args.softcap))
            row = {"problem": p.key(), "bytes": nbytes, "config": spec.default_config(p, dev)}
            torch.manual_seed(0)
            q = torch.randn(b, hq, 1, d, device="cuda", dtype=dtype)
            lens = torch.full((b,), nk, dtype=torch.int32, device="cuda")
            for phase in (contiguous_phase, paged_phase):  # one cache held at a time
                phase(row, p, q, lens)
                torch.cuda.empty_cache()
            names = list(dict.fromkeys(names + [n for n in row if n.startswith(
                ("flashtune", "sdpa"))]))
            rows.append(row)
            print(f"B={b} Nk={nk}: " + ", ".join(
                f"{n} {row[n].get('tbps', 0):.2f}" for n in names if n in row),
                file=sys.stderr, flush=True)
    result = {
        "benchmark": "attn_decode grid (Nq=1)", "dtype": args.dtype, "page_size": ps,
        "heads_q": hq, "heads_kv": hkv, "head_dim": d, "graph": args.graph,
        "cold_l2": bool(args.graph and args.cold),
        "window": args.window, "softcap": args.softcap,
        "bytes_formula": "2 * B * Hkv * Nk * D * elem_size (ANCHORS.md)",
        "device": dev.to_dict(), "torch": torch.__version__, "triton": triton.__version__,
        "flashtune": flashtune.__version__, "source_hash": spec.source_hash,
        "host": platform.node(), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "wall_s": time.time() - t0, "rows": rows,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print_table(rows, names)


def print_table(rows, names):
    def tb(row, name):
        return row.get(name, {}).get("tbps")

    ours = [n for n in ("flashtune", "flashtune_tuned", "flashtune_paged") if n in names]
    bases = [n for n in ("sdpa_flash", "sdpa_cudnn", "sdpa_efficient") if n in names]
    pairs = [(o, bname) for o in ours for bname in bases]
    short = {"flashtune": "ft", "flashtune_tuned": "tuned", "flashtune_paged": "paged",
             "sdpa_flash": "FA2", "sdpa_cudnn": "cuDNN", "sdpa_efficient": "eff"}
    head = ("| B | Nk | config (BN,splits,w,s) | " + " | ".join(f"{n} TB/s" for n in names)
            + " | " + " | ".join(f"{short[o]}/{short[bn]}" for o, bn in pairs) + " |")
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    ratios = {pair: [] for pair in pairs}
    for row in rows:
        p, c = row["problem"], row["config"]
        cells = [f"{tb(row, n):.2f}" if tb(row, n) else "n/a" for n in names]
        rcells = []
        for pair in pairs:
            a, bb = tb(row, pair[0]), tb(row, pair[1])
            r = a / bb if a and bb else None
            if r:
                ratios[pair].append(r)
            rcells.append(f"{r:.2f}" if r else "n/a")
        cfg = f"{c['BLOCK_N']},{c['NUM_SPLITS']},{c['num_warps']},{c['num_stages']}"
        print(f"| {p['batch']} | {p['seqlen_k']} | {cfg} | " + " | ".join(cells + rcells) + " |")

    def gm(xs):
        return 2 ** (sum(math.log2(x) for x in xs) / len(xs)) if xs else 0.0

    print("geomean bandwidth ratios: " + ", ".join(
        f"{short[o]}/{short[bn]} {gm(ratios[(o, bn)]):.3f}" for o, bn in pairs))


if __name__ == "__main__":
    main()
