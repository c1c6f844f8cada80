"""The Gluon FA3-style forward (``flashtune.kernel_templates.attn_fwd_gluon``) on the GPU:
numerics first, then speed.

    python benchmarks/explore_fwd_gluon.py [--check-only] [--head-dims 64,128] \
        [--seqlens 512,...,16384] [--configs 'ROWS=64,BLOCK_N=128,NUM_STAGES=2,NUM_CONSUMERS=2;...'] \
        [--out benchmarks/results/explore_fwd_gluon_h100.json]

1. **Numerics.** Every config on odd cases (ragged Nq = Nk = 200 and 333, causal with
   Nq < Nk and Nq > Nk where rows see no key, GQA 8:2 and MQA, fp16 and bf16, D 64 and
   128) against the float32 reference: relative error of ``out`` (2e-2 bf16, 5e-3 fp16 as
   ``bench_fwd.check``), ``lse`` within 1e-2 absolute (``-inf`` where the reference has it),
   no NaN. A config that fails anything is not timed. Each config is checked in its own
   process under ``--check-timeout``: a barrier mistake hangs rather than errs.
2. **Speed** on the standard grid (ANCHORS.md, bf16): the passing configs, attn_fwd's
   default config, SDPA flash (FA2) and SDPA cuDNN, each checked on the shape first, then
   timed in ``--rounds`` interleaved rounds (``flashtune.autotune.timing.bench``: CUDA
   events, L2 flushed; median of the rounds' medians). TFLOP/s from ``4 B H N^2 D`` (half
   causal). JSON written after every shape; the table printed last.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_fwd import SDPA_BACKENDS, check, sdpa_fn

from flashtune.autotune.grids import standard_grid
from flashtune.autotune.precompile import precompile
from flashtune.autotune.timing import bench, tflops
from flashtune.core.device import cuda_device
from flashtune.kernel_templates import get_template
from flashtune.kernel_templates.attn_fwd.reference import attn_fwd_reference
from flashtune.kernel_templates.attn_fwd_gluon.launcher import (
    DEFAULT_CONFIG,
    OPTIONAL_CONFIG,
    gluon_attn_fwd,
)

# (PERSISTENT=1 gives each its persistent twin, "_ps")
CONFIGS = ("ROWS=64,BLOCK_N=128,NUM_STAGES=2,NUM_CONSUMERS=2;"
           "ROWS=64,BLOCK_N=128,NUM_STAGES=2,NUM_CONSUMERS=2,PINGPONG=1;"
           "ROWS=64,BLOCK_N=64,NUM_STAGES=3,NUM_CONSUMERS=2;"
           "ROWS=64,BLOCK_N=128,NUM_STAGES=2,NUM_CONSUMERS=1;"
           "ROWS=128,BLOCK_N=64,NUM_STAGES=2,NUM_CONSUMERS=2")
# (B, Hq, Hkv, Nq, Nk, causal): odd lengths, key-less rows, GQA / MQA
CASES = [(2, 4, 4, 200, 200, False), (2, 4, 4, 333, 333, True), (1, 8, 2, 256, 512, True),
         (1, 4, 1, 384, 130, True), (1, 4, 4, 128, 1000, False), (3, 2, 2, 64, 64, True)]


def parse_configs(text: str) -> list[dict[str, int]]:
    """``'K=V,...;K=V,...'`` over the launcher's default config; two configs of one name
    (:func:`name_of`) are an error, since results are kept by name."""
    out = []
    for part in filter(None, text.split(";")):
        out.append(dict(DEFAULT_CONFIG, **{k: int(v) for k, v in
                                           (kv.split("=") for kv in part.split(","))}))
    names = [name_of(c) for c in out]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise SystemExit(f"--configs: {', '.join(twice)} named twice; the configs must differ")
    return out


# the knobs the name spells out at its start; any other set knob is appended (LPT=1: _lpt1)
NAMED = ("ROWS", "NUM_CONSUMERS", "BLOCK_N", "NUM_STAGES", "PINGPONG", "PERSISTENT")


def name_of(cfg: dict[str, int]) -> str:
    """``gluon_64x2_128_s3`` (+ ``_pp`` ping-pong, ``_ps`` persistent, ``_lpt1``, any other
    knob away from its default: ``_q_buffers2``...)."""
    unset = {**OPTIONAL_CONFIG, **DEFAULT_CONFIG}
    rest = "".join(f"_{k.lower()}{v}" for k, v in sorted(cfg.items())
                   if k not in NAMED and v != unset.get(k, 0))
    return ("gluon_{ROWS}x{NUM_CONSUMERS}_{BLOCK_N}_s{NUM_STAGES}".format(**cfg)
            + ("_pp" if cfg.get("PINGPONG") else "") + ("_ps" if cfg.get("PERSISTENT") else "")
            + rest)


def check_case(cfg, case, d, dtype) -> dict:
    b, hq, hkv, nq, nk, causal = case
    g = torch.Generator(device="cuda").manual_seed(nq * 7 + nk)
    q = torch.randn(b, hq, nq, d, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(b, hkv, nk, d, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(b, hkv, nk, d, device="cuda", dtype=dtype, generator=g)
    ref_o, ref_l = attn_fwd_reference(q, k, v, causal=causal, dtype=torch.float32)
    out, lse = gluon_attn_fwd(q, k, v, causal=causal, config=cfg)
    torch.cuda.synchronize()
    rel = ((out.float() - ref_o).norm() / ref_o.norm().clamp_min(1e-6)).item()
    finite = torch.isfinite(ref_l)
    lse_ok = bool(torch.equal(torch.isfinite(lse), finite)) and (
        not finite.any() or (lse[finite] - ref_l[finite]).abs().max().item() < 1e-2)
    limit = 2e-2 if dtype == torch.bfloat16 else 5e-3
    nan = bool(torch.isnan(out).any())
    return {"case": list(case), "head_dim": d, "dtype": str(dtype), "rel_err": rel,
            "lse_ok": lse_ok, "nan": nan, "ok": rel < limit and lse_ok and not nan}


def check_config(cfg, head_dims) -> list[dict]:
    rows = []
    for d in head_dims:
        for dtype in (torch.bfloat16, torch.float16):
            for case in CASES:
                try:
                    rows.append(check_case(cfg, case, d, dtype))
                except Exception as exc:  # noqa: BLE001 - a failing config is data
                    rows.append({"case": list(case), "head_dim": d, "dtype": str(dtype),
                                 "ok": False, "error": f"{type(exc).__name__}: {exc}"[:300]})
    return rows


def numerics(configs, head_dims, timeout_s: float) -> dict[str, list[dict]]:
    """Each config checked in its own process: a barrier mistake hangs a kernel, and a hung
    kernel must cost ``timeout_s``, not the whole run."""
    import subprocess

    results = {}
    for cfg in configs:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--check-config", json.dumps(cfg),
               "--head-dims", ",".join(map(str, head_dims))]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s,
                                  check=False)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("[")]
            rows = json.loads(lines[-1]) if lines else [
                {"ok": False, "error": f"exit {proc.returncode}: {proc.stderr[-300:]}"}]
        except subprocess.TimeoutExpired:
            rows = [{"ok": False, "error": f"hung: no result in {timeout_s:.0f} s"}]
        results[name_of(cfg)] = rows
        bad = [r for r in rows if not r["ok"]]
        print(f"{name_of(cfg)}: {len(rows) - len(bad)}/{len(rows)} numerics cases pass"
              + (f"; first failure {bad[0]}" if bad else ""), flush=True)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--head-dims", default="64,128")
    ap.add_argument("--seqlens", default="512,1024,2048,4096,8192,16384")
    ap.add_argument("--configs", default=CONFIGS)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--check-only", action="store_true")
    ap.add_argument("--check-timeout", type=float, default=120.0)
    ap.add_argument("--skip-odd-cases", action="store_true",
                    help="skip step 1 (the GPU tests of the same run checked these configs "
                         "on odd cases); each shape's check before timing still runs")
    ap.add_argument("--check-config", help=argparse.SUPPRESS)  # the per-config subprocess
    ap.add_argument("--out", default="benchmarks/results/explore_fwd_gluon.json")
    args = ap.parse_args()
    head_dims = tuple(int(x) for x in args.head_dims.split(","))
    if args.check_config:
        print(json.dumps(check_config(json.loads(args.check_config), head_dims)), flush=True)
        return
    configs = parse_configs(args.configs)
    dev = cuda_device()
    t0 = time.time()
    checks = {} if args.skip_odd_cases else numerics(configs, head_dims, args.check_timeout)
    passing = [c for c in configs if all(r["ok"] for r in checks.get(name_of(c), []))]
    doc = {"device": dev.name, "torch": torch.__version__, "configs": configs,
           "numerics": checks, "rows": []}
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(doc, indent=1))
    if args.check_only:
        return
    spec = get_template("attn_fwd")
    gluon = get_template("attn_fwd_gluon")
    grid = standard_grid(head_dims, seqlens=tuple(int(x) for x in args.seqlens.split(",")))
    # every kernel compiled in a process pool first, once per head dim and mask (the grid's
    # lengths and batch x heads are multiples of 16: one specialization), cache hits below
    firsts = {(p.head_dim, p.causal): p for p in reversed(grid)}
    for p in firsts.values():
        precompile(gluon, p, passing, workers=None)
        precompile(spec, p, [spec.default_config(p, dev)], workers=2)
    print(f"precompiled at {time.time() - t0:.0f} s", flush=True)
    for p in grid:
        torch.manual_seed(0)
        q, k, v = (torch.randn(p.batch, p.heads_q, p.seqlen_q, p.head_dim, device="cuda",
                               dtype=torch.bfloat16) for _ in range(3))
        sl = (slice(0, 1), slice(0, 4))  # check batch 0, heads 0-3 against fp32 (N 16k fits)
        ref, _ = attn_fwd_reference(q[sl], k[sl], v[sl], causal=p.causal, dtype=torch.float32)
        default = spec.default_config(p, dev)
        fns = implementations(p, q, k, v, passing, spec, default)
        row = {"problem": p.key(), "flops": p.flops(), "default_config": default,
               "results": {}}
        for name, fn in list(fns.items()):
            try:
                check(name, fn()[sl], ref, torch.bfloat16)
            except (Exception, SystemExit) as exc:  # noqa: BLE001 - wrong or failing: not timed
                row["results"][name] = {"error": f"{type(exc).__name__}: {exc}"[:200]}
                del fns[name]
        samples = {n: [] for n in fns}
        for _ in range(args.rounds):
            for name, fn in fns.items():
                samples[name].append(bench(fn).median_ms)
        for name, ms in samples.items():
            med = sorted(ms)[len(ms) // 2]
            row["results"][name] = {"median_ms": med, "tflops": tflops(p.flops(), med),
                                    "rounds_ms": ms}
        doc["rows"].append(row)
        doc["wall_s"] = time.time() - t0
        out_path.write_text(json.dumps(doc, indent=1))
        del q, k, v, fns
        torch.cuda.empty_cache()
        print(f"{p.describe()} done at {time.time() - t0:.0f} s", flush=True)
    print_table(doc["rows"], [name_of(c) for c in passing])


def implementations(p, q, k, v, passing, spec, default) -> dict:
    """The callables timed on one shape: each passing Gluon config, attn_fwd's default, SDPA
    flash and cuDNN."""
    fns = {name_of(c): (lambda c=c: gluon_attn_fwd(q, k, v, causal=p.causal, config=c)[0])
           for c in passing}
    fns["attn_fwd_default"] = lambda: spec.launcher(q, k, v, default, causal=p.causal)
    for name in ("sdpa_flash", "sdpa_cudnn"):
        fns[name] = sdpa_fn(SDPA_BACKENDS[name], q, k, v, p.causal)
    return fns


def print_table(rows, gluon_names) -> None:
    def tf(row, name):
        r = row["results"].get(name, {})
        return r.get("tflops")

    def best_of(row, names):
        return max(((tf(row, n), n) for n in names if tf(row, n)), default=(None, None))

    persistent = [n for n in gluon_names if "ps" in n.split("_")]  # LPT's too ("_ps_lpt1")
    gridded = [n for n in gluon_names if "ps" not in n.split("_")]
    print("| shape | best gluon | TFLOP/s | attn_fwd default | SDPA flash | cuDNN "
          "| vs FA2 | vs cuDNN | vs attn_fwd | persistent / grid-launched (best each) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    ratios = {"fa2": [], "cudnn": [], "ours": [], "persistent": []}
    for row in rows:
        best = best_of(row, gluon_names)
        fa2, cud, ours = (tf(row, n) for n in ("sdpa_flash", "sdpa_cudnn", "attn_fwd_default"))
        key = row["problem"]
        shape = (f"D{key['head_dim']} N{key['seqlen_q']}"
                 f"{' causal' if key['causal'] else ''}")
        cells = [f"{x:.0f}" if x else "-" for x in (best[0], ours, fa2, cud)]
        rs = []
        for label, base in (("fa2", fa2), ("cudnn", cud), ("ours", ours)):
            if best[0] and base:
                ratios[label].append(best[0] / base)
                rs.append(f"{best[0] / base:.2f}x")
            else:
                rs.append("-")
        ps, gr = best_of(row, persistent)[0], best_of(row, gridded)[0]
        if ps and gr:
            ratios["persistent"].append(ps / gr)
        rs.append(f"{ps / gr:.2f}x" if ps and gr else "-")
        print(f"| {shape} | {best[1] or '-'} | {cells[0]} | {cells[1]} | {cells[2]} | "
              f"{cells[3]} | " + " | ".join(rs) + " |")
    for label, xs in ratios.items():
        if xs:
            g = math.exp(sum(math.log(x) for x in xs) / len(xs))
            what = ("best persistent vs best grid-launched gluon" if label == "persistent"
                    else f"best gluon vs {label}")
            print(f"geomean {what}: {g:.3f}x over {len(xs)} shapes (min {min(xs):.2f}x, "
                  f"max {max(xs):.2f}x)")


if __name__ == "__main__":
    main()
