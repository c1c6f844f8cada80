"""Backward pass on the standard grid: flashtune attn_bwd with its template default (and, with
``--db``, the config the lookup chain serves from that database when it holds a tuned one)
against torch SDPA's flash (FA2) and cuDNN backward, one run, bf16 by default.

    python benchmarks/bench_bwd.py [--head-dims 64,128] [--seqlens 512,...] [--db URL]
        [--variant '{"USE_TMA": 1}' [--variant ...]] [--rounds 3]
        [--out benchmarks/results/bwd.json]

``--variant`` (repeatable): also time the template default with these entries changed (a
knob's effect, measured in the same run as the default and SDPA); the first is reported as
``flashtune_variant``, the next ones as ``flashtune_variant2``, ``flashtune_variant3``, ...
``--rounds R``: time every implementation of a shape R times in rotation and report the
median of the R medians (knobs worth a few % need the interleaving).
``--gluon``: also time attn_bwd_gluon (the Gluon warp-specialized backward, sm_90) with its
default config (``--gluon-config JSON``: entries over it), as ``flashtune_gluon``;
``--gluon-variant JSON`` (repeatable): also its config with these entries changed, as
``flashtune_gluon2``, ``flashtune_gluon3``, ... (its knobs compared in one run).
``--shape B,HQ,HKV,NQ,NK,D,causal`` (repeatable; causal ``c`` or ``n``): these shapes
instead of the standard grid (issue 24's: ``4,32,8,8192,8192,64,c``, ``32,16,16,512,512,64,n``).

Only the backward is timed: the forward runs once per shape and implementation, then
* flashtune: ``attn_bwd(q, k, v, out, lse, dout, config)`` (preprocess, dK/dV, dQ);
* SDPA: ``torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)`` under
  ``sdpa_kernel(backend)``.
TFLOP/s use ANCHORS.md's count: backward = 2.5x forward (``4 B H N^2 D``, halved causal).
Before timing, every implementation's gradients are checked against an fp32 autograd
reference on a slice (batch 0, kv head 0 and its q heads): relative error under the
tuner's tolerance, else the implementation is reported with its error and not timed.
Prints a markdown table last; writes the full figures as JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

IMPLS = ("flashtune", "flashtune_tuned", "flashtune_variant", "sdpa_flash", "sdpa_cudnn")
GLUON = "flashtune_gluon"


def gluon_variant_name(i: int) -> str:
    """The row key of the ``i``-th (0-based) ``--gluon-variant``."""
    return f"{GLUON}{i + 2}"


def variant_name(i: int) -> str:
    """The row key of the ``i``-th (0-based) ``--variant``."""
    return "flashtune_variant" if i == 0 else f"flashtune_variant{i + 1}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head-dims", default="64,128")
    ap.add_argument("--seqlens", default="512,1024,2048,4096,8192,16384")
    ap.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    ap.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    ap.add_argument("--baselines", default="sdpa_flash,sdpa_cudnn")
    ap.add_argument("--db", default=None, metavar="URL",
                    help="also time the config the lookup chain serves from this database "
                         "(when it is a tuned one, not the template default)")
    ap.add_argument("--out", default="benchmarks/results/bwd.json")
    ap.add_argument("--limit", type=int, default=0, help="only the first N shapes")
    ap.add_argument("--variant", type=json.loads, action="append", default=[], metavar="JSON",
                    help="config entries that override the default for another flashtune row "
                         "(repeatable)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="time the implementations of a shape this many times in rotation")
    ap.add_argument("--gluon", action="store_true",
                    help="also time attn_bwd_gluon (sm_90) with its default config")
    ap.add_argument("--gluon-config", type=json.loads, default={}, metavar="JSON",
                    help="entries over attn_bwd_gluon's default config (with --gluon)")
    ap.add_argument("--gluon-variant", type=json.loads, action="append", default=[],
                    metavar="JSON", help="another attn_bwd_gluon row: entries over its config "
                                         "(with --gluon; repeatable)")
    ap.add_argument("--shape", action="append", default=[], metavar="B,HQ,HKV,NQ,NK,D,c|n",
                    help="time these shapes instead of the standard grid (repeatable)")
    return ap.parse_args(argv)


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import torch
    import triton
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from flashtune.autotune.grids import standard_grid
    from flashtune.autotune.timing import bench, tflops
    from flashtune.core.case import TOLERANCE
    from flashtune.core.device import cuda_device
    from flashtune.kernel_templates import get_template
    from flashtune.kernel_templates.attn_bwd.reference import attn_bwd_reference

    backends = {"sdpa_flash": SDPBackend.FLASH_ATTENTION,
                "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION}
    fwd, spec = get_template("attn_fwd"), get_template("attn_bwd")
    dt = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    tol = TOLERANCE[args.dtype]
    dev = cuda_device()
    dispatcher = None
    if args.db:
        from flashtune.runtime.lookup import Dispatcher

        dispatcher = Dispatcher(spec)
        dispatcher.reload(db_url=args.db)
    causal = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    problems = standard_grid(tuple(int(x) for x in args.head_dims.split(",")), causal=causal,
                             seqlens=tuple(int(x) for x in args.seqlens.split(",")),
                             dtype=args.dtype)
    if args.shape:
        from flashtune.core.problem import AttentionProblem

        problems = []
        for text in args.shape:
            *dims, c = text.split(",")
            b, hq, hkv, nq, nk, d = (int(x) for x in dims)
            problems.append(AttentionProblem(b, hq, hkv, nq, nk, d, c == "c", args.dtype))
    if args.limit:
        problems = problems[:args.limit]
    gluon = get_template("attn_bwd_gluon") if args.gluon else None
    rows = []
    t0 = time.time()
    for p in problems:
        g = torch.Generator(device="cuda").manual_seed(0)

        def mk(h: int, n: int) -> torch.Tensor:
            return torch.randn(p.batch, h, n, p.head_dim, device="cuda", dtype=dt, generator=g)
        q, k, v, do = mk(p.heads_q, p.seqlen_q), mk(p.heads_kv, p.seqlen_k), \
            mk(p.heads_kv, p.seqlen_k), mk(p.heads_q, p.seqlen_q)
        group = p.heads_q // p.heads_kv
        sq, skv = (slice(0, 1), slice(0, group)), (slice(0, 1), slice(0, 1))
        ref = attn_bwd_reference(q[sq], k[skv], v[skv], do[sq], causal=p.causal,
                                 dtype=torch.float32)
        out, lse = fwd.launcher(q, k, v, fwd.default_config(p, dev), causal=p.causal,
                                return_lse=True)
        fl = p.flops(backward=True)
        row: dict = {"problem": p.key(), "flops": fl,
                     "config": spec.default_config(p, dev)}
        fns = {"flashtune": lambda c=row["config"]: spec.launcher(q, k, v, out, lse, do, c,
                                                                causal=p.causal)}
        for i, variant in enumerate(args.variant):
            name = variant_name(i)
            row[name.replace("flashtune_", "")] = c = spec.space.validate(
                {**row["config"], **variant})
            fns[name] = lambda c=c: spec.launcher(q, k, v, out, lse, do, c, causal=p.causal)
        if gluon is not None:
            reason = gluon.refuse(p, dev)
            if reason is not None:
                row[GLUON] = {"error": f"refused: {reason}"}
            else:
                row["gluon"] = c = gluon.space.validate(
                    {**gluon.default_config(p, dev), **args.gluon_config})
                fns[GLUON] = lambda c=c: gluon.launcher(q, k, v, out, lse, do, c,
                                                        causal=p.causal)
                for i, variant in enumerate(args.gluon_variant):
                    name = gluon_variant_name(i)
                    row[name.removeprefix("flashtune_")] = cv = gluon.space.validate(
                        {**c, **variant})
                    fns[name] = lambda cv=cv: gluon.launcher(q, k, v, out, lse, do, cv,
                                                             causal=p.causal)
        if dispatcher is not None:
            choice = dispatcher.choose(p, dev)
            row["tuned"] = {"config": choice.config, "source": choice.source}
            if choice.source != "default":
                fns["flashtune_tuned"] = lambda c=choice.config: spec.launcher(
                    q, k, v, out, lse, do, c, causal=p.causal)
        leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
        for name in args.baselines.split(","):
            try:
                with sdpa_kernel(backends[name]):
                    o = torch.nn.functional.scaled_dot_product_attention(
                        *leaves, is_causal=p.causal, enable_gqa=group > 1)
            except RuntimeError as exc:  # a backend that does not support the shape
                row[name] = {"error": str(exc).splitlines()[0][:200]}
                continue
            fns[name] = lambda o=o: torch.autograd.grad(o, leaves, do, retain_graph=True)
        checked = {}
        for name, fn in fns.items():
            try:
                got = fn()
                errs = {n: rel(a[s], r) for n, a, s, r in
                        zip(("dq", "dk", "dv"), got, (sq, skv, skv), ref)}
                del got
            except RuntimeError as exc:
                row[name] = {"error": str(exc).splitlines()[0][:200]}
                continue
            if not max(errs.values()) < tol:  # also catches NaN
                row[name] = {"error": f"relative error {errs} >= {tol}; not timed",
                             "rel_err_vs_fp32": errs}
                continue
            checked[name] = errs
        times: dict[str, list] = {name: [] for name in checked}
        for _ in range(max(1, args.rounds)):
            for name in checked:
                try:
                    times[name].append(bench(fns[name]))
                except RuntimeError as exc:
                    row[name] = {"error": str(exc).splitlines()[0][:200]}
        for name, ts in times.items():
            if "error" in row.get(name, {}):
                continue
            t = sorted(ts, key=lambda t: t.median_ms)[len(ts) // 2]
            row[name] = {"median_ms": t.median_ms, "p20_ms": t.p20_ms, "p80_ms": t.p80_ms,
                         "tflops": tflops(fl, t.median_ms), "rel_err_vs_fp32": checked[name],
                         "round_medians_ms": [x.median_ms for x in ts]}
        rows.append(row)
        print(f"{p.describe():55s} " + "  ".join(
            f"{n} {row[n]['tflops']:.0f}" for n in _impls(rows) if "tflops" in row.get(n, {})),
            flush=True)
        fns.clear()  # the closures hold this shape's tensors
        torch.cuda.empty_cache()
        summary = summarize(rows)
        result = {"benchmark": "attn_bwd standard grid (backward only)", "dtype": args.dtype,
                  "device": dev.to_dict(), "torch": torch.__version__,
                  "triton": triton.__version__, "source_hash": spec.source_hash, "db": args.db,
                  "host": platform.node(), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                  "wall_s": time.time() - t0, "summary": summary, "rows": rows}
        path = Path(args.out)  # rewritten after every shape: a cut-off run keeps what it did
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1))
    print_table(rows, summarize(rows))


def _impls(rows: list[dict]) -> list[str]:
    """IMPLS plus the extra variants any row has, in order."""
    extra = sorted({n for r in rows for n in r if n.startswith("flashtune_variant")} - set(IMPLS),
                   key=lambda n: int(n.removeprefix("flashtune_variant")))
    gluon = sorted({n for r in rows for n in r if n.startswith(GLUON)},
                   key=lambda n: int(n.removeprefix(GLUON) or 1))
    return [*IMPLS[:3], *extra, *gluon, *IMPLS[3:]]


def _tf(row: dict, name: str) -> float | None:
    return row.get(name, {}).get("tflops")


def _best(row: dict) -> float | None:
    """flashtune's figure for a shape: the tuned config when there is one, else the default."""
    return _tf(row, "flashtune_tuned") or _tf(row, "flashtune")


def summarize(rows: list[dict]) -> dict:
    def geo(xs: list[float]) -> float | None:
        return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None

    out: dict = {}
    for impl, label in (("flashtune", "default"), ("best", "best")):
        for base in ("sdpa_flash", "sdpa_cudnn"):
            ratios = [(_best(r) if impl == "best" else _tf(r, impl)) / _tf(r, base)
                      for r in rows if _tf(r, base) and (_best(r) if impl == "best"
                                                         else _tf(r, impl))]
            out[f"{label}_vs_{base}_geomean"] = geo(ratios)
    for impl in [n for n in _impls(rows) if n.startswith(("flashtune_variant", GLUON))]:
        for base in ("flashtune", "sdpa_flash", "sdpa_cudnn"):
            ratios = [_tf(r, impl) / _tf(r, base) for r in rows if _tf(r, impl) and _tf(r, base)]
            out[f"{impl.removeprefix('flashtune_')}_vs_{base}_geomean"] = geo(ratios)
    out["all_checked"] = all("error" not in r.get("flashtune", {"error": 1}) for r in rows)
    return out


def print_table(rows: list[dict], summary: dict) -> None:
    impls = _impls(rows)
    heads = ["flashtune default", "tuned",
             *(n.removeprefix("flashtune_") for n in impls[2:-2]), "sdpa_flash", "sdpa_cudnn"]
    print("| D | N | causal | " + " | ".join(heads) + " | vs flash | vs cudnn |")
    print("|---|---|---|" + "---|" * (len(heads) + 2))
    for r in rows:
        p = r["problem"]
        cells = [f"{_tf(r, n):.0f}" if _tf(r, n) else "-" for n in impls]
        best, fa2, cud = _best(r), _tf(r, "sdpa_flash"), _tf(r, "sdpa_cudnn")
        print(f"| {p['head_dim']} | {p['seqlen_q']} | {'yes' if p['causal'] else 'no'} | "
              + " | ".join(cells)
              + f" | {best / fa2 if best and fa2 else 0:.2f} | {best / cud if best and cud else 0:.2f} |")
    fmt = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
    print(f"geomean: default {fmt(summary['default_vs_sdpa_flash_geomean'])}x flash, "
          f"{fmt(summary['default_vs_sdpa_cudnn_geomean'])}x cudnn; best (tuned where there is "
          f"one) {fmt(summary['best_vs_sdpa_flash_geomean'])}x flash, "
          f"{fmt(summary['best_vs_sdpa_cudnn_geomean'])}x cudnn; "
          f"all checked: {summary['all_checked']}")
    for impl in [n.removeprefix("flashtune_") for n in impls
                 if n.startswith(("flashtune_var", GLUON))]:
        if summary.get(f"{impl}_vs_flashtune_geomean"):
            print(f"{impl}: {fmt(summary[f'{impl}_vs_flashtune_geomean'])}x default, "
                  f"{fmt(summary[f'{impl}_vs_sdpa_flash_geomean'])}x flash, "
                  f"{fmt(summary[f'{impl}_vs_sdpa_cudnn_geomean'])}x cudnn")


if __name__ == "__main__":
    main()
