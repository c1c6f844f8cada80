"""Where a training step's time goes, kernel by kernel: flashtune's Gluon pair (the Gluon
forward saving the LSE, then the Gluon backward's preprocess, main and dQ-convert
launches) against SDPA's cuDNN and flash steps through autograd, on the same inputs, in
one run (issue 24: the own pair trails cuDNN by 8-22% at N 512-1k and by 1-5% from 4k).

    python benchmarks/train_breakdown.py [--seqlens 512,1024,4096] [--head-dims 64,128]
        [--causal both|yes|no] [--group 1] [--steps 20] [--bwd-configs '[{"PERSISTENT": 1}]']
        [--bwd-source lookup|default] [--lpt-budget-mib 40]
        [--out benchmarks/results/train_breakdown_h200.json]

Shapes: the standard grid's (batch x seqlen = 16384 tokens, heads = 2048 / D, bf16);
``--group G``: GQA, ``heads / G`` KV heads (SDPA with ``enable_gqa``).
The Gluon kernels run with the configs the runtime's lookup gives (the shipped tables', a
tuned entry, or the template default; the source is printed; ``--bwd-source default``: the
backward's template default, as an untuned shape gets it); ``--bwd-configs`` adds a
contender per entry: the backward's config updated with it. ``--lpt-budget-mib``: the L2
bytes an ``LPT`` section of the backward may fill, for the whole run, grouped and one-head
walks alike (80 sizes the sections as before they counted the dQ accumulator; 40 the
one-head walks' as before 2026-11-30).

Every contender is checked first: its output and dQ, dK, dV against fp32 autograd on the
first batch row and head (relative Frobenius error under 2e-2, the tuner's tolerance); a
failing one is reported and not timed. Then ``--steps`` steps of each under
``torch.profiler`` (after two warm-up steps): each CUDA kernel's device time per step,
summed by kernel name, and the step's total; TFLOP/s counts the step as 3.5x the forward's
FLOPs (ANCHORS.md). Profiled kernel times carry no launch gaps: they are what the GPU spent,
not a step's wall time.

Without a CUDA GPU it prints "needs a CUDA GPU" and exits 0.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TOL = 2e-2
DT = torch.bfloat16
TOKENS, HIDDEN = 16384, 2048


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    got = got.float()
    if not torch.isfinite(got).all():
        return float("nan")
    return ((got - ref).norm() / ref.norm()).item()


class Shape:
    def __init__(self, n: int, d: int, causal: bool, group: int = 1) -> None:
        from flashtune.core.problem import AttentionProblem

        self.b, self.h, self.n, self.d, self.causal = TOKENS // n, HIDDEN // d, n, d, causal
        self.hkv = self.h // group
        g = torch.Generator(device="cuda").manual_seed(n * d + causal)
        q_shape, kv_shape = (self.b, self.h, n, d), (self.b, self.hkv, n, d)
        self.q, self.k, self.v, self.do = (
            torch.randn(shape, device="cuda", dtype=DT, generator=g)
            for shape in (q_shape, kv_shape, kv_shape, q_shape))
        self.problem = AttentionProblem(self.b, self.h, self.hkv, n, n, d, causal, "bf16")
        self.flops = 3.5 * 4.0 * self.b * self.h * n * n * d / (2 if causal else 1)
        from flashtune.kernel_templates.attn_fwd.reference import attn_fwd_reference

        # the first KV head and its query heads of the first batch row
        leaves = [t[:1, :heads].detach().float().requires_grad_(True)
                  for t, heads in ((self.q, group), (self.k, 1), (self.v, 1))]
        with torch.enable_grad():
            out, _ = attn_fwd_reference(*leaves, causal=causal, dtype=torch.float32)
            grads = torch.autograd.grad(out, leaves, self.do[:1, :group].float())
        self.group = group
        self.ref = (out.detach(), *grads)

    @property
    def name(self) -> str:
        heads = f"H{self.h}" if self.hkv == self.h else f"H{self.h}/{self.hkv}"
        return f"B{self.b} {heads} N{self.n} D{self.d}{' causal' if self.causal else ''}"

    def error(self, out: torch.Tensor, dq: torch.Tensor, dk: torch.Tensor,
              dv: torch.Tensor) -> float:
        heads = (self.group, self.group, 1, 1)
        return max(_rel(t[:1, :n], r) for t, n, r in zip((out, dq, dk, dv), heads, self.ref))


def _gluon_step(sh: Shape, fcfg: dict[str, int], bcfg: dict[str, int]):
    from flashtune.kernel_templates import get_template

    fwd, bwd = get_template("attn_fwd_gluon"), get_template("attn_bwd_gluon")

    def step() -> tuple[torch.Tensor, ...]:
        out, lse = fwd.launcher(sh.q, sh.k, sh.v, fcfg, causal=sh.causal, return_lse=True)
        dq, dk, dv = bwd.launcher(sh.q, sh.k, sh.v, out, lse, sh.do, bcfg, causal=sh.causal)
        return out, dq, dk, dv
    return step


def _sdpa_step(sh: Shape, backend: Any):
    from torch.nn.attention import sdpa_kernel

    leaves = [t.detach().requires_grad_(True) for t in (sh.q, sh.k, sh.v)]

    def step() -> tuple[torch.Tensor, ...]:
        with sdpa_kernel(backend):
            out = torch.nn.functional.scaled_dot_product_attention(
                *leaves, is_causal=sh.causal, enable_gqa=sh.hkv != sh.h)
        dq, dk, dv = torch.autograd.grad(out, leaves, sh.do)
        return out, dq, dk, dv
    return step


def _profile(step, steps: int) -> dict[str, float]:
    """Device ms per step of each kernel name (and ``"total"``)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    per: dict[str, float] = {}
    for ev in prof.key_averages():
        us = getattr(ev, "self_device_time_total", None)
        if us is None:
            us = ev.self_cuda_time_total
        if us > 0:
            per[ev.key] = per.get(ev.key, 0.0) + us / 1e3 / steps
    per = dict(sorted(per.items(), key=lambda kv: -kv[1]))
    per["total"] = sum(per.values())
    return per


def _short(name: str) -> str:
    return name if len(name) <= 60 else name[:57] + "..."


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqlens", default="512,1024,4096")
    ap.add_argument("--head-dims", default="64,128")
    ap.add_argument("--causal", choices=("both", "yes", "no"), default="both")
    ap.add_argument("--group", type=int, default=1, help="query heads per KV head")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--bwd-configs", default="", help="JSON list of backward config updates")
    ap.add_argument("--out", default="")
    ap.add_argument("--bwd-source", choices=("lookup", "default"), default="lookup",
                    help="the backward's config: the runtime's lookup chain (shipped tables, "
                         "tuned entries) or the template default (untuned)")
    ap.add_argument("--jobs", type=int, default=8,
                    help="processes compiling the Gluon kernels first (1: on first launch)")
    ap.add_argument("--lpt-budget-mib", type=int, default=0,
                    help="the backward's LPT section budget in MiB (0: the launcher's)")
    args = ap.parse_args(argv)
    if args.lpt_budget_mib:  # read by the launcher at each launch's planning
        from flashtune.kernel_templates.attn_bwd_gluon import launcher

        launcher.L2_BUDGET = launcher.L2_BUDGET_ONE_HEAD = args.lpt_budget_mib << 20
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 0
    from torch.nn.attention import SDPBackend

    from flashtune.core.device import cuda_device

    device = cuda_device()
    gluon_ok = torch.cuda.get_device_capability() == (9, 0)
    variants = json.loads(args.bwd_configs) if args.bwd_configs else []
    causals = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    if gluon_ok and args.jobs > 1:
        _precompile(args, variants, causals, device)
    rows = []
    for d in map(int, args.head_dims.split(",")):
        for n in map(int, args.seqlens.split(",")):
            for causal in causals:
                sh = Shape(n, d, causal, args.group)
                steps: dict[str, Any] = {
                    "cudnn": (_sdpa_step(sh, SDPBackend.CUDNN_ATTENTION), {}),
                    "flash": (_sdpa_step(sh, SDPBackend.FLASH_ATTENTION), {})}
                if gluon_ok:
                    meta = _gluon_configs(sh.problem, device, args.bwd_source)
                    fcfg, bcfg = meta["fwd_config"], meta["bwd_config"]
                    steps["gluon"] = (_gluon_step(sh, fcfg, bcfg), meta)
                    for i, upd in enumerate(variants):
                        cfg = {**bcfg, **upd}
                        steps[f"gluon_v{i}"] = (_gluon_step(sh, fcfg, cfg),
                                                {**meta, "bwd_config": cfg})
                row: dict[str, Any] = {"shape": sh.name, "batch": sh.b, "heads": sh.h,
                                       "heads_kv": sh.hkv,
                                       "seqlen": n, "head_dim": d, "causal": causal,
                                       "contenders": {}}
                for name, (step, meta) in steps.items():
                    entry: dict[str, Any] = dict(meta)
                    try:
                        entry["error"] = sh.error(*step())
                    except Exception as exc:  # noqa: BLE001 - reported, not timed
                        entry["failed"] = f"{type(exc).__name__}: {exc}"[:300]
                    if "failed" not in entry and not entry["error"] < TOL:
                        entry["failed"] = f"error {entry['error']:.3g} over {TOL}"
                    if "failed" not in entry:
                        per = _profile(step, args.steps)
                        entry["kernels_ms"] = per
                        entry["tflops"] = sh.flops / per["total"] / 1e9
                    row["contenders"][name] = entry
                    torch.cuda.empty_cache()
                rows.append(row)
                _print_row(row)
    _print_summary(rows)
    if args.out:
        doc = {"benchmark": "train_breakdown", "device": torch.cuda.get_device_name(),
               "torch": torch.__version__, "python": platform.python_version(),
               "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
               "steps": args.steps, "bwd_configs": variants,
               "lpt_budget_mib": args.lpt_budget_mib or None, "rows": rows}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(doc, indent=1))
        print(f"wrote {args.out}")
    return 0


def _gluon_configs(problem: Any, device: Any, bwd_source: str) -> dict[str, Any]:
    """The Gluon pair's configs for ``problem`` and where each came from: the forward's and
    the backward's from the runtime's lookup chain, or (``bwd_source`` ``default``) the
    backward's template default, as an untuned shape gets it."""
    from flashtune.kernel_templates import get_template
    from flashtune.runtime.lookup import Dispatcher

    fwd = Dispatcher(get_template("attn_fwd_gluon")).choose(problem, device)
    bwd = get_template("attn_bwd_gluon")
    if bwd_source == "default":
        bcfg, bsource = dict(bwd.default_config(problem, device)), \
            "template default (--bwd-source)"
    else:
        choice = Dispatcher(bwd).choose(problem, device)
        bcfg, bsource = dict(choice.config), choice.source
    return {"fwd_config": dict(fwd.config), "fwd_source": fwd.source,
            "bwd_config": bcfg, "bwd_source": bsource}


def _precompile(args: argparse.Namespace, variants: list[dict[str, int]],
                causals: tuple[bool, ...], device: Any) -> None:
    """Compile every Gluon kernel the run will launch in a process pool first (a shared
    ``TRITON_CACHE_DIR``), once per head dim, mask and config (the kernels specialize on
    those, not on the lengths, all multiples of 16 here), so the run's launches find them
    compiled."""
    from concurrent.futures import ThreadPoolExecutor

    from flashtune.autotune.precompile import precompile
    from flashtune.core.problem import AttentionProblem
    from flashtune.kernel_templates import get_template

    fwd, bwd = get_template("attn_fwd_gluon"), get_template("attn_bwd_gluon")
    batches: dict[tuple[str, int, bool, str], tuple[Any, Any, dict[str, int]]] = {}
    for d in map(int, args.head_dims.split(",")):
        for n in map(int, args.seqlens.split(",")):
            for causal in causals:
                h = HIDDEN // d
                problem = AttentionProblem(TOKENS // n, h, h // args.group, n, n, d, causal,
                                           "bf16")
                chosen = _gluon_configs(problem, device, args.bwd_source)
                base = chosen["bwd_config"]
                todo = [(fwd, chosen["fwd_config"]), (bwd, base),
                        *((bwd, {**base, **upd}) for upd in variants)]
                for spec, config in todo:
                    key = (spec.name, d, causal, json.dumps(config, sort_keys=True))
                    batches.setdefault(key, (spec, problem, config))
    def one(batch: tuple[Any, Any, dict[str, int]]) -> tuple[Any, dict[str, str | None]]:
        return batch, precompile(batch[0], batch[1], [batch[2]], workers=args.jobs)

    first, *rest = batches.values()
    with ThreadPoolExecutor(max(1, args.jobs)) as threads:  # the first starts the pool
        done = [one(first), *threads.map(one, rest)]
        for (spec, _, config), errors in done:
            for error in filter(None, errors.values()):
                print(f"precompile {spec.name} {config}: {error}")
    print(f"precompiled {len(batches)} kernels' launches", flush=True)


def _print_row(row: dict[str, Any]) -> None:
    print(f"\n== {row['shape']}", flush=True)
    for name, e in row["contenders"].items():
        if "failed" in e:
            print(f"  {name}: FAILED {e['failed']}")
            continue
        per = e["kernels_ms"]
        print(f"  {name}: {per['total']:.3f} ms/step, {e['tflops']:.0f} TFLOP/s, "
              f"err {e['error']:.1e}" + (f"  bwd {e['bwd_config']} ({e['bwd_source']})"
                                          if "bwd_config" in e else ""))
        for k, ms in per.items():
            if k != "total" and ms >= 0.01 * per["total"]:
                print(f"      {ms:8.4f} ms {100 * ms / per['total']:5.1f}%  {_short(k)}")


def _print_summary(rows: list[dict[str, Any]]) -> None:
    names = [n for n in rows[0]["contenders"] if n != "cudnn"] if rows else []
    print("\nTFLOP/s per step, ratio to cuDNN's step (same run)")
    print("| shape | cudnn | " + " | ".join(names) + " |")
    print("|---|---|" + "---|" * len(names))
    for row in rows:
        c = row["contenders"]
        base = c["cudnn"].get("tflops")
        cells = []
        for n in names:
            t = c[n].get("tflops")
            cells.append("failed" if t is None else
                         f"{t:.0f} ({t / base:.2f}x)" if base else f"{t:.0f}")
        print(f"| {row['shape']} | {base and round(base)} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    raise SystemExit(main())
