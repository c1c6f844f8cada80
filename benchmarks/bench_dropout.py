"""Attention dropout (issue 31, item 2): flashtune against torch SDPA's flash (FA2) and cuDNN
backends with the same ``dropout_p``, forward and training step, one run, bf16.

    python benchmarks/bench_dropout.py [--cases bert,d128c] [--dropout 0.1] [--rounds 5]
        [--db URL] [--tune | --tune-only] [--tune-ops] [--trials 10]
        [--out benchmarks/results/dropout_h100.json] [--dry-run]
        [--sweep-bwd '[{}, {"num_stages": 2}, ...]'] [--variant '{"DROPOUT_BITS": 1}']

Cases (``benchmarks/plans/dropout.toml`` holds the same shapes, dropout 0.1):

* ``bert``: BERT-base attention, B32 H12 N512 D64, not causal (issue 31's target: the
  training step >= 1.1x the best SDPA backend with the same dropout; measured there cuDNN
  160, flash 129 TFLOP/s);
* ``d128c``: B4 H16 N2048 D128, causal.

Each case runs two modes: ``fwd`` (no gradients) and ``train`` (forward + backward: the
gradients of q, k, v). Contenders, every one with dropout ``--dropout``:

* ``flashtune``: flashtune's kernels, ``attn_fwd`` and ``attn_bwd`` launched with the
  configs the lookup chain serves for the problem with its dropout (``--db``'s tuned ones,
  else the template defaults; the row records which), one fixed seed tensor;
* ``flashtune_routed``: ``flashtune.attention(..., dropout_p=)`` as a user calls it
  (autograd for ``train``; a seed drawn from torch's generator each call);
* ``flashtune_nodrop``: flashtune's kernels without dropout (same configs): the price of
  the mask;
* ``sdpa_flash``, ``sdpa_cudnn`` (``--baselines``): ``F.scaled_dot_product_attention(...,
  dropout_p=)`` under ``sdpa_kernel(backend)``.

Numerics first. flashtune's kernels are checked against the float32 reference given the
mask their seed draws (``kernel_templates.dropout.dropout_mask``) on a slice (batch 0, K/V
head 0 and its query heads): the output, and for ``train`` the three gradients, within the
tuner's tolerance; the routed call likewise (its seed rebuilt from ``torch.manual_seed``).
SDPA's masks are torch's own and cannot be rebuilt: each backend's kept fraction is
measured instead (q = 0 makes every probability 1/Nk and v = 1 makes each output row
``kept / (Nk (1 - p))``: the mean times ``1 - p`` is the kept fraction) and reported beside
flashtune's (``keep_probability``: 0.1 keeps 230/256 = 0.898). A contender that fails its
check is reported with the error and not timed.

Timing: ``flashtune.autotune.timing.bench`` (cold L2), the contenders in rotation for
``--rounds`` rounds, the median of the round medians. TFLOP/s as ANCHORS.md counts them:
forward ``4 B H N^2 D`` (halved causal), training step 3.5x that (dropout adds no FLOPs).
Ratios: flashtune over the faster SDPA backend (target >= 1.1x for the training step).

``--tune`` first tunes ``attn_fwd`` and ``attn_bwd`` for the cases' problems with their
dropout into ``--db`` (``flashtune tune --template ... --plan``, ``--trials`` each; with
``--tune-ops`` also ``tune --op fwd`` and ``--op train``), then benchmarks with that
database; ``--tune-only`` stops after tuning (a device command is 10 minutes at most: tune
in one, bench in the next). ``--dry-run`` prints the cases, the configs flashtune would run
on an H100 without a database and the tuning commands, and checks the plan file; no GPU.
Writes JSON (rewritten after every case); prints a table last.

``--variant JSON`` (an object of ``attn_bwd`` config overrides) adds the contender
``flashtune_variant`` to the training step: flashtune's kernels as ``flashtune`` runs them,
the backward with the served config and the overrides (e.g. ``{"DROPOUT_BITS": 1}``: the dQ
kernel reads the dK/dV kernel's mask as bits), checked the same way, timed in the same
rotation; its ratios beside flashtune's, and ``variant_over_default``.

``--sweep-bwd JSON`` (a list of ``attn_bwd`` config overrides, ``{}`` the served config)
times the kernels alone instead, per case: the forward (served config) with and without
dropout, the backward of each override with dropout (each checked against fp32 with its
mask first) and the first one without, SDPA flash and cuDNN forward alone and backward
alone (``autograd.grad`` of a kept graph), in rotation; TFLOP/s counted 2.5x the forward's
FLOPs for a backward. Its rows hold ``sweep`` instead of the modes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PLAN = ROOT / "benchmarks" / "plans" / "dropout.toml"
MODES = ("fwd", "train")
TRAIN_FACTOR = 3.5  # ANCHORS.md: a training step counts 3.5x the forward's FLOPs
TARGET = 1.1  # flashtune / the best SDPA backend, training step (issue 31)
BASELINES = ("sdpa_flash", "sdpa_cudnn")


@dataclass(frozen=True)
class Case:
    name: str
    label: str
    batch: int
    heads: int
    seqlen: int
    head_dim: int
    causal: bool

    def problem(self, dropout: float, dtype: str = "bf16") -> Any:
        from flashtune.core.problem import AttentionProblem

        return AttentionProblem(self.batch, self.heads, self.heads, self.seqlen, self.seqlen,
                                self.head_dim, self.causal, dtype, dropout=dropout)


CASES: dict[str, Case] = {c.name: c for c in (
    Case("bert", "BERT-base B32 H12 N512 D64", 32, 12, 512, 64, False),
    Case("d128c", "B4 H16 N2048 D128 causal", 4, 16, 2048, 128, True),
)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=",".join(CASES),
                    help=f"comma-separated, of {', '.join(CASES)}")
    ap.add_argument("--modes", default=",".join(MODES), help="fwd, train or both")
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--baselines", default=",".join(BASELINES),
                    help=f"of {', '.join(BASELINES)}")
    ap.add_argument("--no-routed", action="store_true",
                    help="leave out flashtune.attention as routed")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--db", default=None, metavar="URL",
                    help="tuning database the configs come from; --tune writes into it")
    ap.add_argument("--tune", action="store_true", help="tune the cases first (needs --db)")
    ap.add_argument("--tune-only", action="store_true", help="tune, then stop")
    ap.add_argument("--tune-ops", action="store_true",
                    help="with --tune: also tune --op fwd and --op train")
    ap.add_argument("--trials", type=int, default=10, help="trials per shape and template")
    ap.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    ap.add_argument("--out", default="benchmarks/results/dropout_h100.json")
    ap.add_argument("--dry-run", action="store_true",
                    help="print the cases, configs and tuning commands; no GPU needed")
    ap.add_argument("--sweep-bwd", default=None, metavar="JSON",
                    help="time the kernels alone: these attn_bwd config overrides (a JSON list)")
    ap.add_argument("--variant", default=None, metavar="JSON",
                    help="train mode: also time flashtune with these attn_bwd config "
                         "overrides (a JSON object), as flashtune_variant")
    args = ap.parse_args(argv)
    unknown = [c for c in args.cases.split(",") if c not in CASES]
    if unknown:
        ap.error(f"unknown case(s) {unknown}; known: {', '.join(CASES)}")
    if any(m not in MODES for m in args.modes.split(",")):
        ap.error(f"--modes takes {', '.join(MODES)}")
    if any(b and b not in BASELINES for b in args.baselines.split(",")):
        ap.error(f"--baselines takes {', '.join(BASELINES)}")
    if not 0 < args.dropout < 1:
        ap.error("--dropout must be in (0, 1)")
    if (args.tune or args.tune_only) and not args.db:
        ap.error("--tune needs --db URL (the database the tuned configs go to)")
    if args.sweep_bwd is not None:
        try:
            sweep = json.loads(args.sweep_bwd)
        except ValueError:
            sweep = None
        if not (isinstance(sweep, list) and sweep and all(isinstance(o, dict) for o in sweep)):
            ap.error("--sweep-bwd takes a non-empty JSON list of config overrides")
        args.sweep_bwd = sweep
    if args.variant is not None:
        try:
            variant = json.loads(args.variant)
        except ValueError:
            variant = None
        if not (isinstance(variant, dict) and variant
                and all(isinstance(v, int) for v in variant.values())):
            ap.error("--variant takes a non-empty JSON object of integer config overrides")
        args.variant = variant
    return args


def selected(args: argparse.Namespace) -> list[Case]:
    return [CASES[c] for c in args.cases.split(",")]


# -- tuning -----------------------------------------------------------------------------------

def plan_text(cases: list[Case], dropout: float, dtype: str = "bf16") -> str:
    """A tuning plan (``flashtune tune --plan``) of ``cases`` with ``dropout``."""
    return "\n".join(
        f"[[shape]]  # {c.name}\nbatch = {c.batch}\nheads = {c.heads}\nseqlen = {c.seqlen}\n"
        f"head_dim = {c.head_dim}\ncausal = {str(c.causal).lower()}\ndtype = \"{dtype}\"\n"
        f"dropout = {dropout}\n" for c in cases)


def tune_commands(args: argparse.Namespace, plan: str | Path) -> list[list[str]]:
    """The ``flashtune tune`` command lines ``--tune`` runs, in order."""
    base = [sys.executable, "-m", "flashtune", "--db", str(args.db), "tune", "--plan",
            str(plan), "--trials", str(args.trials), "--no-progress"]
    cmds = [[*base, "--template", "attn_fwd"], [*base, "--template", "attn_bwd"]]
    if args.tune_ops:
        cmds += [[*base, "--op", "fwd"], [*base, "--op", "train"]]
    return cmds


def run_tuning(args: argparse.Namespace, cases: list[Case]) -> list[dict[str, Any]]:
    """Tune the cases into ``--db``: the shipped plan when it describes them, else a plan of
    the selected ones."""
    if args.db.startswith("sqlite:///") and args.db != "sqlite:///:memory:":
        path = Path(args.db.removeprefix("sqlite:///"))
        (path if path.is_absolute() else ROOT / path).parent.mkdir(parents=True,
                                                                   exist_ok=True)
    if [c.name for c in cases] == list(CASES) and args.dtype == "bf16" \
            and args.dropout == 0.1:
        plan: Path = PLAN
    else:
        handle = tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False)
        handle.write(plan_text(cases, args.dropout, args.dtype))
        handle.close()
        plan = Path(handle.name)
    log = []
    for cmd in tune_commands(args, plan):
        t0 = time.time()
        print("$", " ".join(cmd[1:]), flush=True)
        proc = subprocess.run(cmd, cwd=ROOT, check=False)
        log.append({"command": cmd[1:], "returncode": proc.returncode,
                    "wall_s": time.time() - t0})
        if proc.returncode:
            raise SystemExit(f"tuning failed ({proc.returncode}): {' '.join(cmd[1:])}")
    return log


def check_plan(path: Path = PLAN) -> None:
    """Raise ValueError unless ``path`` lists exactly the cases' problems at dropout 0.1."""
    from flashtune.autotune.plans import load_plan

    want = [c.problem(0.1) for c in CASES.values()]
    plan = load_plan(path)
    if plan != want:
        raise ValueError(f"{path} lists {[p.describe() for p in plan]}, the cases are "
                         f"{[p.describe() for p in want]}")


# -- one case ---------------------------------------------------------------------------------

def _rel(got: Any, ref: Any) -> float:
    got = got.float()
    if not bool(got.isfinite().all()):
        return float("nan")
    return ((got - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _first_line(exc: BaseException) -> str:
    lines = [t for t in str(exc).splitlines() if t.strip()]
    return f"{type(exc).__name__}: {lines[0].strip()[:200] if lines else ''}"


def make_tensors(case: Case, dtype: Any, device: str) -> dict[str, Any]:
    import torch

    g = torch.Generator(device=device).manual_seed(case.head_dim)
    shape = (case.batch, case.heads, case.seqlen, case.head_dim)
    q, k, v, do = (torch.randn(shape, device=device, generator=g).to(dtype)
                   for _ in range(4))
    leaves = tuple(t.detach().requires_grad_(True) for t in (q, k, v))
    seed = torch.tensor([0x5EED_0001], dtype=torch.int64, device=device)
    return {"q": q, "k": k, "v": v, "do": do, "leaves": leaves, "seed": seed}


def contenders(case: Case, mode: str, t: Mapping[str, Any], fcfg: Mapping[str, int],
               bcfg: Mapping[str, int], p: float, baselines: list[str], routed: bool,
               variant: Mapping[str, int] | None = None) -> dict[str, Callable[[], Any]]:
    """``name -> fn()``: ``fwd`` returns the output, ``train`` the gradients (dq, dk, dv);
    ``variant``: ``train``'s ``flashtune_variant``, the backward's config overridden."""
    import torch
    import torch.nn.functional as F

    import flashtune
    from flashtune.kernel_templates import get_template

    fwd, bwd = get_template("attn_fwd"), get_template("attn_bwd")
    q, k, v, do, leaves, seed = (t[n] for n in ("q", "k", "v", "do", "leaves", "seed"))
    causal = case.causal
    fns: dict[str, Callable[[], Any]] = {}
    for name, drop in (("flashtune", {"dropout_p": p, "seed": seed}),
                       ("flashtune_nodrop", {})):
        if mode == "fwd":
            fns[name] = lambda drop=drop: fwd.launcher(q, k, v, fcfg, causal=causal, **drop)
        else:
            def own_step(drop: Mapping[str, Any] = drop) -> Any:
                out, lse = fwd.launcher(q, k, v, fcfg, causal=causal, return_lse=True, **drop)
                return bwd.launcher(q, k, v, out, lse, do, bcfg, causal=causal, **drop)
            fns[name] = own_step
    if variant and mode == "train":
        vcfg = {**bcfg, **variant}

        def variant_step() -> Any:
            drop = {"dropout_p": p, "seed": seed}
            out, lse = fwd.launcher(q, k, v, fcfg, causal=causal, return_lse=True, **drop)
            return bwd.launcher(q, k, v, out, lse, do, vcfg, causal=causal, **drop)
        fns["flashtune_variant"] = variant_step
    if routed:
        if mode == "fwd":
            def routed_fwd() -> Any:
                with torch.no_grad():
                    return flashtune.attention(q, k, v, causal=causal, dropout_p=p)
            fns["flashtune_routed"] = routed_fwd
        else:
            def routed_step() -> Any:
                out = flashtune.attention(*leaves, causal=causal, dropout_p=p)
                return torch.autograd.grad(out, leaves, do)
            fns["flashtune_routed"] = routed_step
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = {"sdpa_flash": SDPBackend.FLASH_ATTENTION,
                "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION}
    for name in baselines if q.is_cuda else []:
        be = backends[name]
        if mode == "fwd":
            def sdpa_fwd(be: Any = be) -> Any:
                with sdpa_kernel(be), torch.no_grad():
                    return F.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                          dropout_p=p)
            fns[name] = sdpa_fwd
        else:
            def sdpa_step(be: Any = be) -> Any:
                with sdpa_kernel(be):
                    out = F.scaled_dot_product_attention(*leaves, is_causal=causal,
                                                         dropout_p=p)
                return torch.autograd.grad(out, leaves, do)
            fns[name] = sdpa_step
    return fns


def references(case: Case, t: Mapping[str, Any], seed: Any, p: float,
               modes: list[str]) -> dict[str, Any]:
    """fp32 output and gradients on batch 0, head 0, given the mask ``seed`` draws."""
    import torch

    from flashtune.kernel_templates.attn_fwd.reference import attn_fwd_reference
    from flashtune.kernel_templates.dropout import dropout_mask

    s = (slice(0, 1), slice(0, 1))
    mask = dropout_mask(seed, case.batch, case.heads, case.seqlen, case.seqlen, p,
                        batches=1, heads=1)
    leaves = [t[n][s].float().requires_grad_(True) for n in ("q", "k", "v")]
    with torch.enable_grad():
        out, _ = attn_fwd_reference(*leaves, causal=case.causal, dtype=torch.float32,
                                    dropout_mask=mask, dropout_p=p)
        grads = torch.autograd.grad(out, leaves, t["do"][s].float()) if "train" in modes \
            else None
    return {"slice": s, "fwd": out.detach(), "train": grads}


def check(mode: str, got: Any, refs: Mapping[str, Any]) -> dict[str, float]:
    """The relative errors of a result against the references."""
    s = refs["slice"]
    if mode == "fwd":
        return {"out": _rel(got[s], refs["fwd"])}
    return {n: _rel(g[s], r) for n, g, r in zip(("dq", "dk", "dv"), got, refs["train"])}


def kept_fraction(run: Callable[[Any, Any, Any], Any], case: Case, dtype: Any, p: float,
                  scale: float, device: str = "cuda") -> float:
    """``run(q, k, v)``'s kept fraction: with q = 0 every probability is 1 / Nk, with v = 1
    an output row is ``kept / (Nk keep)`` (not causal: every row sees Nk keys), so the mean
    output divided by ``scale`` (the implementation's 1 / keep) is the kept fraction."""
    import torch

    n = min(case.seqlen, 1024)
    q = torch.zeros(4, case.heads, n, case.head_dim, device=device, dtype=dtype)
    v = torch.ones_like(q)
    with torch.no_grad():
        return run(q, q, v).float().mean().item() / scale


def fractions(case: Case, dtype: Any, p: float, baselines: list[str],
              device: str = "cuda") -> dict[str, Any]:
    """The kept fraction of each contender's dropout (see the module doc)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import flashtune
    from flashtune.kernel_templates.dropout import keep_probability

    keep = keep_probability(p)
    out = {"flashtune": {"expected": keep, "measured": kept_fraction(
        lambda q, k, v: flashtune.attention(q, k, v, dropout_p=p), case, dtype, p,
        1 / keep, device)}}
    backends = {"sdpa_flash": SDPBackend.FLASH_ATTENTION,
                "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION}
    for name in baselines if device == "cuda" else []:
        def run(q: Any, k: Any, v: Any, be: Any = backends[name]) -> Any:
            with sdpa_kernel(be):
                return F.scaled_dot_product_attention(q, k, v, dropout_p=p)
        try:
            out[name] = {"expected": 1 - p,
                         "measured": kept_fraction(run, case, dtype, p, 1 / (1 - p), device)}
        except Exception as exc:  # noqa: BLE001 - a backend that refuses is data
            out[name] = {"error": _first_line(exc)}
    return out


def run_case(case: Case, args: argparse.Namespace, device: Any,
             dispatchers: Mapping[str, Any], bench: Callable[[Callable[[], Any]], Any],
             torch_device: str = "cuda") -> dict[str, Any]:
    """One case's row: configs, kept fractions, and per mode every contender's errors and
    timings (``torch_device`` "cpu" under the Triton interpreter, for the tests: no SDPA
    backend there)."""
    import torch

    from flashtune.autotune.timing import tflops
    from flashtune.core.case import TOLERANCE
    from flashtune.kernel_templates.dropout import draw_seed

    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    modes, p = args.modes.split(","), args.dropout
    prob = case.problem(p, args.dtype)
    fchoice = dispatchers["attn_fwd"].choose(prob, device)
    bchoice = dispatchers["attn_bwd"].choose(prob, device)
    baselines = [b for b in args.baselines.split(",") if b]
    row: dict[str, Any] = {
        "case": case.name, "label": case.label, "problem": prob.key(),
        "flops": {"fwd": prob.flops(), "train": prob.flops() * TRAIN_FACTOR},
        "attn_fwd": {"config": fchoice.config, "source": fchoice.source},
        "attn_bwd": {"config": bchoice.config, "source": bchoice.source,
                     **({"variant": {**bchoice.config, **args.variant}}
                        if getattr(args, "variant", None) else {})},
        "kept_fraction": fractions(case, dtype, p, baselines, torch_device)}
    t = make_tensors(case, dtype, torch_device)
    refs = {"fixed": references(case, t, t["seed"], p, modes)}
    torch.manual_seed(1234)  # the routed call's seed, rebuilt: the next draw after this
    refs["routed"] = references(case, t, draw_seed(torch_device), p, modes)
    tol = TOLERANCE[args.dtype]
    for mode in modes:
        fns = contenders(case, mode, t, fchoice.config, bchoice.config, p, baselines,
                         routed=not args.no_routed, variant=getattr(args, "variant", None))
        res: dict[str, Any] = {}
        runnable = {}
        for name, fn in fns.items():
            try:
                if name == "flashtune_routed":
                    torch.manual_seed(1234)
                got = fn()
            except Exception as exc:  # noqa: BLE001 - a contender that cannot run is data
                res[name] = {"error": _first_line(exc)}
                continue
            if name.startswith("sdpa"):  # torch's own mask: its fraction is checked above
                fine = all(bool(g.isfinite().all()) for g in
                           ((got,) if mode == "fwd" else got))
                res[name] = {} if fine else {"error": "NaN or inf; not timed"}
                if fine:
                    runnable[name] = fn
                continue
            if name == "flashtune_nodrop":
                res[name], runnable[name] = {}, fn
                continue
            errs = check(mode, got, refs["routed" if name == "flashtune_routed" else "fixed"])
            if not max(errs.values()) < tol:  # NaN too
                res[name] = {"error": f"wrong result: relative error {errs} (tolerance "
                                      f"{tol}); not timed", "rel_err_vs_fp32": errs}
                continue
            res[name] = {"rel_err_vs_fp32": errs}
            runnable[name] = fn
        rounds: dict[str, list[float]] = {n: [] for n in runnable}
        for _ in range(max(1, args.rounds)):
            for name, fn in runnable.items():
                try:
                    rounds[name].append(bench(fn).median_ms)
                except Exception as exc:  # noqa: BLE001
                    res[name] = {"error": _first_line(exc)}
        for name, ms in rounds.items():
            if "error" in res[name] or not ms:
                continue
            med = statistics.median(ms)
            res[name].update(median_ms=med, round_medians_ms=ms,
                             tflops=tflops(row["flops"][mode], med))
        res["ratios"] = ratios(res, mode)
        row[mode] = res
    return row


def sweep_key(override: Mapping[str, int]) -> str:
    """``bwd_`` and the override's knobs (``default`` for none), the sweep's names."""
    return "bwd_" + ("_".join(f"{k}{v}" for k, v in override.items()) or "default")


def sweep_case(case: Case, args: argparse.Namespace, device: Any,
               dispatchers: Mapping[str, Any], bench: Callable[[Callable[[], Any]], Any],
               torch_device: str = "cuda") -> dict[str, Any]:
    """``--sweep-bwd``: one case's kernels alone (see the module doc)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from flashtune.autotune.timing import tflops
    from flashtune.core.case import TOLERANCE
    from flashtune.kernel_templates import get_template

    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    p, causal = args.dropout, case.causal
    prob = case.problem(p, args.dtype)
    fcfg = dispatchers["attn_fwd"].choose(prob, device).config
    bcfg = dispatchers["attn_bwd"].choose(prob, device).config
    fwd, bwd = get_template("attn_fwd"), get_template("attn_bwd")
    t = make_tensors(case, dtype, torch_device)
    q, k, v, do, leaves, seed = (t[n] for n in ("q", "k", "v", "do", "leaves", "seed"))
    refs = references(case, t, seed, p, ["fwd", "train"])
    drop = {"dropout_p": p, "seed": seed}
    out, lse = fwd.launcher(q, k, v, fcfg, causal=causal, return_lse=True, **drop)
    out0, lse0 = fwd.launcher(q, k, v, fcfg, causal=causal, return_lse=True)
    fns: dict[str, Callable[[], Any]] = {
        "fwd_drop": lambda: fwd.launcher(q, k, v, fcfg, causal=causal, **drop),
        "fwd_nodrop": lambda: fwd.launcher(q, k, v, fcfg, causal=causal)}
    res: dict[str, Any] = {"fwd_drop": {"config": fcfg, "rel_err_vs_fp32": check(
        "fwd", out, refs)}, "fwd_nodrop": {"config": fcfg}}
    tol = TOLERANCE[args.dtype]
    for i, override in enumerate(args.sweep_bwd):
        cfg, name = {**bcfg, **override}, sweep_key(override)

        def fn(cfg: Mapping[str, int] = cfg) -> Any:
            return bwd.launcher(q, k, v, out, lse, do, cfg, causal=causal, **drop)
        try:
            errs = check("train", fn(), refs)
        except Exception as exc:  # noqa: BLE001 - a config that cannot run is data
            res[name] = {"config": cfg, "error": _first_line(exc)}
            continue
        res[name] = {"config": cfg, "rel_err_vs_fp32": errs}
        if not max(errs.values()) < tol:
            res[name]["error"] = f"wrong result (tolerance {tol}); not timed"
            continue
        fns[name] = fn
        if i == 0:
            res[name + "_nodrop"] = {"config": cfg}
            fns[name + "_nodrop"] = (lambda cfg=cfg: bwd.launcher(q, k, v, out0, lse0, do, cfg,
                                                                  causal=causal))
    backends = {"sdpa_flash": SDPBackend.FLASH_ATTENTION,
                "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION}
    for name in [b for b in args.baselines.split(",") if b] if q.is_cuda else []:
        be = backends[name]
        try:
            with sdpa_kernel(be):
                kept = F.scaled_dot_product_attention(*leaves, is_causal=causal, dropout_p=p)
        except Exception as exc:  # noqa: BLE001 - a backend that refuses is data
            res[name + "_fwd"] = {"error": _first_line(exc)}
            continue

        def sdpa_fwd(be: Any = be) -> Any:
            with sdpa_kernel(be), torch.no_grad():
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, dropout_p=p)
        fns[name + "_fwd"] = sdpa_fwd
        fns[name + "_bwd"] = (lambda kept=kept: torch.autograd.grad(kept, leaves, do,
                                                                   retain_graph=True))
        res[name + "_fwd"], res[name + "_bwd"] = {}, {}
    rounds: dict[str, list[float]] = {n: [] for n in fns}
    for _ in range(max(1, args.rounds)):
        for name, fn in fns.items():
            rounds[name].append(bench(fn).median_ms)
    for name, ms in rounds.items():
        med = statistics.median(ms)
        flops = prob.flops() * (1.0 if "fwd" in name else 2.5)
        res[name].update(median_ms=med, round_medians_ms=ms, tflops=tflops(flops, med))
    return {"case": case.name, "label": case.label, "problem": prob.key(), "sweep": res}


def ratios(res: Mapping[str, Any], mode: str) -> dict[str, Any]:
    """flashtune's (and the routed call's) speed over each SDPA backend and the faster one;
    the target (training step: >= 1.1x the faster), and dropout's price (no dropout over
    dropout, flashtune's kernels)."""
    def ms(name: str) -> float | None:
        value = res.get(name, {}).get("median_ms")
        return value if isinstance(value, float) else None

    out: dict[str, Any] = {}
    timed = [b for b in BASELINES if ms(b) is not None]
    best = min(timed, key=lambda b: ms(b) or math.inf) if timed else None
    for ours in ("flashtune", "flashtune_routed", "flashtune_variant"):
        if ms(ours) is None:
            continue
        for base in timed:
            out[f"{ours}_vs_{base}"] = (ms(base) or 0) / (ms(ours) or 1)
        if best is not None:
            out[f"{ours}_vs_best_sdpa"] = (ms(best) or 0) / (ms(ours) or 1)
    if ms("flashtune") is not None and ms("flashtune_variant") is not None:
        out["variant_over_default"] = (ms("flashtune") or 0) / (ms("flashtune_variant") or 1)
    if ms("flashtune") is not None and ms("flashtune_nodrop") is not None:
        out["dropout_cost"] = (ms("flashtune") or 0) / (ms("flashtune_nodrop") or 1)
    if mode == "train" and best is not None and "flashtune_vs_best_sdpa" in out:
        got = out["flashtune_vs_best_sdpa"]
        out["target"] = {"against": best, "ratio": got, "wanted": TARGET, "met": got >= TARGET}
    return out


# -- the run ----------------------------------------------------------------------------------

def dispatchers_for(db: str | None) -> dict[str, Any]:
    from flashtune.kernel_templates import get_template
    from flashtune.runtime.lookup import Dispatcher

    out = {}
    for name in ("attn_fwd", "attn_bwd"):
        d = Dispatcher(get_template(name))
        d.reload(db_url=db)
        out[name] = d
    return out


def dry_run(args: argparse.Namespace) -> dict[str, Any]:
    """What a run would do, without a GPU: the cases, H100 default configs, tuning
    commands."""
    from flashtune.kernel_templates import get_template
    from flashtune.kernel_templates.dropout import keep_probability
    from flashtune.kernel_templates.sm90 import H100

    check_plan()
    fwd, bwd = get_template("attn_fwd"), get_template("attn_bwd")
    rows = []
    for c in selected(args):
        p = c.problem(args.dropout, args.dtype)
        rows.append({"case": c.name, "label": c.label, "problem": p.key(),
                     "fwd_tflop": p.flops() / 1e12,
                     "train_tflop": p.flops() * TRAIN_FACTOR / 1e12,
                     "attn_fwd_default_h100": fwd.default_config(p, H100),
                     "attn_bwd_default_h100": bwd.default_config(p, H100)})
    return {"cases": rows, "modes": args.modes.split(","), "dropout": args.dropout,
            "flashtune_keep_probability": keep_probability(args.dropout),
            "tune_commands": [" ".join(c[1:]) for c in tune_commands(args, PLAN)]
            if args.db else []}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.dry_run:
        print(json.dumps(dry_run(args), indent=1))
        return
    cases = selected(args)
    tuning = run_tuning(args, cases) if args.tune or args.tune_only else []
    if args.tune_only:
        return
    if args.db:  # the router reads the same database
        os.environ["FLASHTUNE_DB"] = args.db
    import torch
    import triton

    from flashtune.autotune.timing import bench
    from flashtune.core.device import cuda_device

    if not torch.cuda.is_available():
        raise SystemExit("bench_dropout needs a CUDA GPU (--dry-run does not)")
    dev = cuda_device()
    dispatchers = dispatchers_for(args.db)
    rows: list[dict[str, Any]] = []
    t0 = time.time()
    for case in cases:
        t = time.time()
        if args.sweep_bwd is not None:
            rows.append(sweep_case(case, args, dev, dispatchers, bench))
        else:
            rows.append(run_case(case, args, dev, dispatchers, bench))
        print(f"{case.name}: {time.time() - t:.0f} s", flush=True)
        torch.cuda.empty_cache()
        result = {"benchmark": "attention dropout (issue 31): forward and training step",
                  "dtype": args.dtype, "dropout": args.dropout, "device": dev.to_dict(),
                  "torch": torch.__version__, "triton": triton.__version__,
                  "cudnn": torch.backends.cudnn.version(), "host": platform.node(),
                  "date": time.strftime("%Y-%m-%d %H:%M:%S"), "db": args.db,
                  "rounds": args.rounds, "tuning": tuning, "wall_s": time.time() - t0,
                  "rows": rows}
        path = Path(args.out)  # rewritten after every case: a cut-off run keeps what it did
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1, default=str))
    print(render_sweep(rows) if args.sweep_bwd is not None else render_table(rows, args))


def render_sweep(rows: list[dict[str, Any]]) -> str:
    """``--sweep-bwd``'s table: TFLOP/s, and each over the faster SDPA backend's."""
    lines = ["| case | kernel | TFLOP/s | vs best SDPA (same pass) |", "|---|---|---|---|"]
    for r in rows:
        res = r["sweep"]
        best = {d: max((res.get(f"{b}_{d}", {}).get("tflops", 0.0) for b in BASELINES),
                       default=0.0) for d in ("fwd", "bwd")}
        for name, got in res.items():
            tf = got.get("tflops")
            if tf is None:
                lines.append(f"| {r['case']} | {name} | {got.get('error', '-')} | - |")
                continue
            b = best["fwd" if "fwd" in name else "bwd"]
            lines.append(f"| {r['case']} | {name} | {tf:.0f} | "
                         + (f"{tf / b:.2f}x |" if b else "- |"))
    return "\n".join(lines)


def render_table(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    names = ["flashtune", *([] if args.no_routed else ["flashtune_routed"]),
             *(["flashtune_variant"] if getattr(args, "variant", None) else []),
             "flashtune_nodrop", *[b for b in args.baselines.split(",") if b]]
    lines = [f"TFLOP/s, {args.dtype}, dropout {args.dropout}, median of {args.rounds} rounds "
             f"(training step counted {TRAIN_FACTOR}x the forward); target: training step "
             f">= {TARGET}x the faster SDPA backend",
             "| case | mode | " + " | ".join(names) + " | vs best SDPA | dropout cost | "
             "configs |", "|---|---|" + "---|" * (len(names) + 3)]
    for r in rows:
        for mode in MODES:
            if mode not in r:
                continue
            res = r[mode]
            cells = [f"{res[n]['tflops']:.0f}" if "tflops" in res.get(n, {})
                     else ("refused" if "error" in res.get(n, {}) else "-") for n in names]
            ra = res["ratios"]
            best = f"{ra['flashtune_vs_best_sdpa']:.2f}x" if "flashtune_vs_best_sdpa" in ra \
                else "-"
            if "target" in ra:
                best += " (met)" if ra["target"]["met"] else " (missed)"
            cost = f"{ra['dropout_cost']:.2f}x" if "dropout_cost" in ra else "-"
            src = f"{r['attn_fwd']['source']}/{r['attn_bwd']['source']}"
            lines.append(f"| {r['label']} | {mode} | " + " | ".join(cells)
                         + f" | {best} | {cost} | {src} |")
    for r in rows:
        fr = ", ".join(f"{n} {v['measured']:.4f} (expected {v['expected']:.4f})"
                       if "measured" in v else f"{n}: {v['error']}"
                       for n, v in r["kept_fraction"].items())
        lines.append(f"kept fraction, {r['case']}: {fr}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
