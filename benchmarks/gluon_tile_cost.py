"""Where the Gluon forward loses to cuDNN at short sequences (issue 23): a tile's fixed cost
against its cost per key, one run, SDPA flash and cuDNN beside.

    python benchmarks/gluon_tile_cost.py [--head-dims 64,128,256] [--nq 512]
        [--nks 128,256,512,1024,2048,4096] [--configs 'K=V,...;...'] [--rounds 3]
        [--causal] [--out benchmarks/results/gluon_tile_cost_h100.json]

At a fixed query length ``--nq`` (non-causal, bf16, 16384 query tokens: B = 16384 / Nq, heads
x head_dim = 2048, the standard grid's geometry), the number of output tiles is fixed and a
kernel's time grows with the key length: ``t(Nk) = fixed + per_key * Nk``. A least-squares
line over ``--nks`` splits each contender's time into

* ``fixed``: what does not grow with the keys: launch, Q load, the first block's wait, the
  epilogue (O normalised and stored, LSE), the tail of the last wave;
* ``per_key``: the main loop's cost per key (its throughput, TFLOP/s at the slope).

The standard grid's N512 shape (Nk = Nq = 512) sits on this line.

``--causal``: square causal shapes instead, ``Nq = Nk = N`` for each N of ``--nks`` at the
same 16384 tokens (B = 16384 / N). The tiles are as many at every N, and a causal tile of
query block ``m`` walks ``m + 1`` key blocks, so the time is again a line in N: the
intercept is the tiles' fixed cost, the slope the main loop's (its TFLOP/s from the causal
FLOP count); ``--nq`` names the N whose ratio to cuDNN the table prints. Square, so SDPA's
top-left causal mask is flashtune's bottom-right one. If the Gluon forward's
slope matches cuDNN's and its intercept does not, what is left to win is in prologue and
epilogue (overlap the epilogue with the next tile's first blocks, FA3's persistent
scheduler); if its slope is worse, in the main loop.

Contenders: the Gluon forward with the config the shipped tables give the N512 shape of each
head dim (``Dispatcher`` of ``attn_fwd_gluon``: exact, nearest or default, named in the
JSON), that config with ``PERSISTENT`` flipped, where it is the default the config tuned for
the causal shape (D256: Gemma-2's), each persistent one's overlapped twin (two Q buffers, K
and V released apart, the TMA store: :func:`overlapped_twin`), the template default, and
any ``--configs``; ``attn_fwd`` with its
own table's config; SDPA flash and cuDNN. Every contender is checked against the float32
reference (batch 0, heads 0-3) at every shape before it is timed; one that fails or raises is
reported with its error and not timed. Timing: ``flashtune.autotune.timing.bench`` (CUDA
events, L2 flushed), the contenders in rotation for ``--rounds`` rounds, median of the round
medians. JSON written after every head dim; the table printed last.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_fwd import SDPA_BACKENDS, check, sdpa_fn
from explore_fwd_gluon import name_of, parse_configs

from flashtune.autotune.precompile import precompile
from flashtune.autotune.timing import bench
from flashtune.core.device import cuda_device
from flashtune.core.problem import AttentionProblem
from flashtune.kernel_templates import get_template
from flashtune.kernel_templates.attn_fwd.reference import attn_fwd_reference
from flashtune.runtime.lookup import Dispatcher

TOKENS = 16384
HIDDEN = 2048


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares ``(intercept, slope)`` of ``ys`` over ``xs`` (at least two points)."""
    if len(xs) != len(ys) or len(xs) < 2:
        raise ValueError(f"a line needs two points or more, got {len(xs)} x and {len(ys)} y")
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        raise ValueError("the x values are all equal: no slope")
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return my - slope * mx, slope


def split_cost(nks: list[int], ms: list[float], flops_per_key: float) -> dict[str, float]:
    """A contender's times over the sweep (key lengths, or N with ``--causal``) as
    ``fixed_us`` (the intercept), ``per_1k_keys_us`` (the slope), ``slope_tflops`` (the main
    loop's throughput: ``flops_per_key``, the FLOPs of one more key or unit of N, over the
    slope) and ``fixed_keys`` (the intercept in keys' worth of main loop)."""
    intercept, slope = fit_line([float(n) for n in nks], ms)
    return {"fixed_us": intercept * 1e3, "per_1k_keys_us": slope * 1e6,
            "slope_tflops": flops_per_key / (slope * 1e-3) / 1e12 if slope > 0 else 0.0,
            "fixed_keys": intercept / slope if slope > 0 else float("inf")}


def problem(d: int, nq: int, nk: int, causal: bool = False) -> AttentionProblem:
    heads = HIDDEN // d
    return AttentionProblem(max(1, TOKENS // nq), heads, heads, nq, nk, d, causal, "bf16")


def point(d: int, nq: int, x: int, causal: bool) -> AttentionProblem:
    """The sweep's shape at ``x``: ``Nk = x`` at the fixed ``nq``, or with ``causal`` the
    square causal shape ``Nq = Nk = x`` at the same tokens."""
    return problem(d, x, x, True) if causal else problem(d, nq, x)


def flops_per_x(d: int, nq: int, xs: list[int], causal: bool) -> float:
    """FLOPs the sweep adds per unit of ``x`` (linear in ``x`` both ways: ``4 B H Nq D`` per
    key at a fixed Nq; ``2 T H D`` per unit of N for square causal shapes of T tokens)."""
    lo, hi = min(xs), max(xs)
    return (point(d, nq, hi, causal).flops() - point(d, nq, lo, causal).flops()) / (hi - lo)


def overlapped_twin(gluon, config: dict[str, int], anchor: AttentionProblem, dev
                    ) -> dict[str, int] | None:
    """``config`` (persistent) with its epilogue overlapped: ``Q_BUFFERS`` 2, ``SPLIT_KV``
    1 and ``TMA_STORE`` 1, its stages lowered until the space accepts it (the second Q
    buffer takes a K/V stage's shared memory at D128); None when no stage count fits."""
    for stages in range(config["NUM_STAGES"], 1, -1):
        twin = {**config, "Q_BUFFERS": 2, "SPLIT_KV": 1, "TMA_STORE": 1, "NUM_STAGES": stages}
        if gluon.space.check(gluon.space.validate(twin), anchor, dev) is None:
            return twin
    return None


def contenders(d: int, nq: int, extra: list[dict[str, int]], dev, causal: bool = False
               ) -> tuple[dict, dict]:
    """``name -> (template, config)`` of the flashtune contenders at head dim ``d``, and how
    each table config was found."""
    gluon, fwd = get_template("attn_fwd_gluon"), get_template("attn_fwd")
    anchor = problem(d, nq, nq, causal)
    out, found = {}, {}
    if gluon.refuse(anchor, dev) is None:
        dispatch = Dispatcher(gluon)
        choice = dispatch.choose(anchor, dev)
        flipped = dict(choice.config, PERSISTENT=1 - choice.config.get("PERSISTENT", 0))
        if not flipped["PERSISTENT"]:  # a grid launch: one tile a CTA, no order, one Q set
            flipped.update(LPT=0, Q_BUFFERS=1)
        configs = [choice.config, flipped]
        found[name_of(choice.config)] = f"{choice.source} ({choice.origin})"
        if choice.source == "default" and not causal:  # the causal shape's entry, if tuned
            other = dispatch.choose(replace(anchor, causal=True), dev)
            if other.source != "default":
                configs.append(other.config)
                found.setdefault(name_of(other.config),
                                 f"the causal shape's {other.source} ({other.origin})")
        configs += [twin for cfg in configs if cfg.get("PERSISTENT")
                    for twin in [overlapped_twin(gluon, cfg, anchor, dev)] if twin]
        configs.append(gluon.default_config(anchor, dev))
        for cfg in [*configs, *extra]:
            out.setdefault(name_of(cfg), (gluon, dict(cfg)))
    choice = Dispatcher(fwd).choose(anchor, dev)
    out["attn_fwd"] = (fwd, dict(choice.config))
    found["attn_fwd"] = f"{choice.source} ({choice.origin})"
    return out, found


def run_head_dim(d: int, nq: int, nks: list[int], extra, rounds: int, dev,
                 causal: bool = False) -> dict:
    kernels, found = contenders(d, nq, extra, dev, causal)
    # every kernel compiled in a process pool first (the key lengths are multiples of 16:
    # one specialization), cache hits below
    by_spec: dict = {}
    for spec, cfg in kernels.values():
        by_spec.setdefault(spec.name, (spec, []))[1].append(cfg)
    for spec, cfgs in by_spec.values():
        precompile(spec, problem(d, nq, nq, causal), cfgs, workers=max(2, len(cfgs)))
    times: dict[str, list[float | None]] = {n: [] for n in [*kernels, *SDPA_BACKENDS]}
    errors: dict[str, str] = {}
    for nk in nks:
        p = point(d, nq, nk, causal)
        torch.manual_seed(0)
        q = torch.randn(p.batch, p.heads_q, p.seqlen_q, d, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(p.batch, p.heads_kv, nk, d, device="cuda", dtype=torch.bfloat16)
                for _ in range(2))
        sl = (slice(0, 1), slice(0, 4))
        ref, _ = attn_fwd_reference(q[sl], k[sl], v[sl], causal=causal, dtype=torch.float32)
        fns = {n: (lambda s=s, c=c: s.launcher(q, k, v, c, causal=causal))
               for n, (s, c) in kernels.items()}
        for n, (s, c) in kernels.items():
            reason = s.space.check(s.space.validate(c), p, dev)
            if reason is not None:  # e.g. a flipped knob the space refuses here
                errors[f"{n} Nk={nk}"] = f"refused by the space: {reason}"
                del fns[n]
        fns.update({n: sdpa_fn(b, q, k, v, causal) for n, b in SDPA_BACKENDS.items()})
        for name, fn in list(fns.items()):
            try:
                check(name, fn()[sl], ref, torch.bfloat16)
            except (Exception, SystemExit) as exc:  # noqa: BLE001 - wrong or failing: not timed
                errors[f"{name} Nk={nk}"] = f"{type(exc).__name__}: {exc}"[:200]
                del fns[name]
        samples: dict[str, list[float]] = {n: [] for n in fns}
        for _ in range(rounds):
            for name, fn in fns.items():
                samples[name].append(bench(fn).median_ms)
        for name in times:
            ms = sorted(samples.get(name, []))
            times[name].append(ms[len(ms) // 2] if ms else None)
        print(f"D{d} Nk {nk}: " + ", ".join(f"{n} {t[-1]:.4f}" for n, t in times.items()
                                             if t[-1] is not None), flush=True)
    per_x = flops_per_x(d, nq, nks, causal)
    fits = {n: split_cost([nk for nk, t in zip(nks, ts) if t is not None],
                          [t for t in ts if t is not None], per_x)
            for n, ts in times.items() if sum(t is not None for t in ts) >= 2}
    return {"head_dim": d, "seqlen_q": nq, "causal": causal,
            "batch": [point(d, nq, x, causal).batch for x in nks], "heads": HIDDEN // d,
            "seqlen_k": nks,
            "configs": {n: c for n, (_, c) in kernels.items()}, "found": found,
            "median_ms": times, "fit": fits, "errors": errors}


def table(doc: dict) -> str:
    lines = ["head_dim  contender                 fixed us  us/1k keys  slope TFLOP/s  "
             "fixed in keys  at Nk=Nq vs cuDNN"]
    for row in doc["rows"]:
        cud = row["median_ms"].get("sdpa_cudnn") or []
        at = row["seqlen_k"].index(row["seqlen_q"]) if row["seqlen_q"] in row["seqlen_k"] \
            else None
        for name, f in row["fit"].items():
            ms = row["median_ms"][name]
            ratio = (f"{cud[at] / ms[at]:.3f}x" if at is not None and cud and cud[at]
                     and ms[at] else "-")
            lines.append(f"D{row['head_dim']:<8} {name:<25} {f['fixed_us']:8.1f} "
                         f"{f['per_1k_keys_us']:11.1f} {f['slope_tflops']:14.1f} "
                         f"{f['fixed_keys']:14.0f}  {ratio}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--head-dims", default="64,128,256")
    ap.add_argument("--nq", type=int, default=512)
    ap.add_argument("--nks", default=None,
                    help="key lengths (default 128-4096), or with --causal the N of the "
                         "square shapes (default 512-8192)")
    ap.add_argument("--configs", default="", help="more Gluon configs, 'K=V,...;K=V,...'")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--causal", action="store_true",
                    help="square causal shapes, N = each of --nks, at the same tokens")
    ap.add_argument("--out", default="benchmarks/results/gluon_tile_cost.json")
    args = ap.parse_args()
    default_nks = "512,1024,2048,4096,8192" if args.causal else "128,256,512,1024,2048,4096"
    nks = sorted({int(x) for x in (args.nks or default_nks).split(",")})
    if len(nks) < 2:
        raise SystemExit("--nks: two key lengths or more (a line needs two points)")
    extra = parse_configs(args.configs) if args.configs else []
    dev = cuda_device()
    t0 = time.time()
    doc = {"benchmark": "gluon_tile_cost", "device": dev.name, "torch": torch.__version__,
           "source_hash": get_template("attn_fwd_gluon").source_hash,
           "rounds": args.rounds, "rows": []}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for d in (int(x) for x in args.head_dims.split(",")):
        doc["rows"].append(run_head_dim(d, args.nq, nks, extra, args.rounds, dev, args.causal))
        doc["wall_s"] = time.time() - t0
        out.write_text(json.dumps(doc, indent=1))
    print(table(doc))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
