"""Odd head dims (issue 31, item 1): flashtune against torch SDPA's flash (FA2) and cuDNN
backends at the head dims real models use, forward and training step, one run, bf16.

    python benchmarks/bench_headdims.py [--cases sd40,sd80,phi2,d224,d59,d111] [--rounds 5]
        [--db URL] [--tune | --tune-only] [--tune-ops] [--trials 8]
        [--out benchmarks/results/headdims_h100.json] [--dry-run]

Cases (issue 31's targets; ``benchmarks/plans/headdims.toml`` holds the same shapes):

* ``sd40``: Stable Diffusion 1.x self-attention, B8 H8 N4096 D40;
* ``sd80``: Stable Diffusion 1.x, B8 H8 N1024 D80;
* ``phi2``: Phi-2-like, B4 H32 N2048 D80, causal;
* ``d224``: B2 H8 N4096 D224, causal;
* ``d59``, ``d111``: B4 H16 N2048, causal (only SDPA's flash backend serves them);
* references on request (``--cases``), not in the plan: ``d64`` and ``d112``, the widths
  D59 and D111 are padded to on a GPU (their kernels without the copies).

For a head dim that is not a multiple of 8 the row also records ``copies``: the GPU time of
padding q (``tma.pad_head_dim``, against ``F.pad``) and of cutting an output back
(``tma.unpad_head_dim``, against ``copy_`` of the slice), timed the same way.

Each case runs two modes: ``fwd`` (no gradients) and ``train`` (forward + backward: the
gradients of q, k, v). Contenders:

* ``flashtune``: flashtune's own kernels, ``attn_fwd`` and ``attn_bwd`` launched with the
  configs the lookup chain serves (``--db``'s tuned ones, else the template defaults;
  the row records which); the training step through ``training.PairFn``, the autograd
  function ``flashtune.attention`` runs them with (which pads a head dim that is not a
  multiple of 8 once for both kernels);
* ``flashtune_routed``: ``flashtune.attention`` as a user calls it (autograd for
  ``train``): whatever the router picks (an SDPA backend untuned on sm_90 where cuDNN
  serves the shape; ``--tune-ops`` stores the op's measured choice);
* ``sdpa_flash``, ``sdpa_cudnn`` (``--baselines``; ``sdpa_efficient`` too on request):
  ``F.scaled_dot_product_attention`` under ``sdpa_kernel(backend)``, torch's own padding of
  odd head dims included; a backend that refuses the shape is reported, not timed.

Each timed contender also records ``host_ms``, the host time of one call (launches
enqueued back to back): a row whose host time reaches its timed median is host-bound, and
the table says so. Every contender is first checked against a float32 reference on a slice
(batch 0, K/V head 0 and its query heads): the output, and for ``train`` the three gradients, within the
tuner's tolerance (relative Frobenius error), else it is reported with its error and not
timed. Timing: ``flashtune.autotune.timing.bench`` (cold L2), the contenders in rotation
for ``--rounds`` rounds, the median of the round medians. TFLOP/s as ANCHORS.md counts them:
forward ``4 B H N^2 D`` (halved causal), training step 3.5x that. Ratios: flashtune over
cuDNN where cuDNN serves the shape (target >= 1.0x), else over SDPA flash (target >= 1.3x).

``--tune`` first tunes ``attn_fwd`` and ``attn_bwd`` for the selected cases into ``--db``
(``flashtune tune --template ... --plan``, ``--trials`` each; with ``--tune-ops`` also
``tune --op fwd`` and ``--op train``), then benchmarks with that database; ``--tune-only``
stops after tuning (a device command is 10 minutes at most: tune in one, bench in the
next). ``--dry-run`` prints the cases, their FLOPs, the configs flashtune would run (for an
H100 without a database) and the tuning commands, and checks the plan file against the
cases; it needs no GPU. Writes JSON (rewritten after every case); prints a table last.
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

PLAN = ROOT / "benchmarks" / "plans" / "headdims.toml"
MODES = ("fwd", "train")
TRAIN_FACTOR = 3.5  # ANCHORS.md: a training step counts 3.5x the forward's FLOPs
CUDNN_TARGET = 1.0  # flashtune / cuDNN where cuDNN serves the shape
FLASH_TARGET = 1.3  # flashtune / SDPA flash where only flash serves it


@dataclass(frozen=True)
class Case:
    name: str
    label: str
    batch: int
    heads: int
    seqlen: int
    head_dim: int
    causal: bool
    kv_heads: int | None = None

    def problem(self, dtype: str = "bf16") -> Any:
        from flashtune.core.problem import AttentionProblem

        return AttentionProblem(self.batch, self.heads, self.kv_heads or self.heads,
                                self.seqlen, self.seqlen, self.head_dim, self.causal, dtype)


CASES: dict[str, Case] = {c.name: c for c in (
    Case("sd40", "SD 1.x B8 H8 N4096 D40", 8, 8, 4096, 40, False),
    Case("sd80", "SD 1.x B8 H8 N1024 D80", 8, 8, 1024, 80, False),
    Case("phi2", "Phi-2-like B4 H32 N2048 D80 causal", 4, 32, 2048, 80, True),
    Case("d224", "B2 H8 N4096 D224 causal", 2, 8, 4096, 224, True),
    Case("d59", "B4 H16 N2048 D59 causal", 4, 16, 2048, 59, True),
    Case("d111", "B4 H16 N2048 D111 causal", 4, 16, 2048, 111, True),
)}
# references, not in the plan or the default selection: the aligned head dims the padded
# D59 and D111 run at (what their kernels alone can reach, the copies aside)
REFERENCE_CASES: dict[str, Case] = {c.name: c for c in (
    Case("d64", "B4 H16 N2048 D64 causal (D59's padded width)", 4, 16, 2048, 64, True),
    Case("d112", "B4 H16 N2048 D112 causal (D111's padded width)", 4, 16, 2048, 112, True),
)}
BASELINES = ("sdpa_flash", "sdpa_cudnn", "sdpa_efficient")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=",".join(CASES),
                    help=f"comma-separated, of {', '.join(CASES)} (and the references "
                         f"{', '.join(REFERENCE_CASES)})")
    ap.add_argument("--modes", default=",".join(MODES), help="fwd, train or both")
    ap.add_argument("--baselines", default="sdpa_flash,sdpa_cudnn",
                    help=f"of {', '.join(BASELINES)}")
    ap.add_argument("--no-routed", action="store_true",
                    help="leave out flashtune.attention as routed")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--db", default=None, metavar="URL",
                    help="tuning database: the configs flashtune's kernels run (and the "
                         "router's) come from it; --tune writes into it")
    ap.add_argument("--tune", action="store_true",
                    help="tune attn_fwd and attn_bwd for the cases first (needs --db)")
    ap.add_argument("--tune-only", action="store_true", help="tune, then stop")
    ap.add_argument("--tune-ops", action="store_true",
                    help="with --tune: also tune --op fwd and --op train (the router's choice)")
    ap.add_argument("--trials", type=int, default=8, help="trials per shape and template")
    ap.add_argument("--bwd-sweep", default=None, metavar="JSON",
                    help="a JSON list of attn_bwd configs (partial: over the default) timed "
                         "alone (backward only, after checking the gradients) for every "
                         "case, next to the default; recorded as the row's bwd_sweep")
    ap.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    ap.add_argument("--out", default="benchmarks/results/headdims_h100.json")
    ap.add_argument("--dry-run", action="store_true",
                    help="print the cases, configs and tuning commands; no GPU needed")
    args = ap.parse_args(argv)
    unknown = [c for c in args.cases.split(",") if c not in CASES and c not in REFERENCE_CASES]
    if unknown:
        ap.error(f"unknown case(s) {unknown}; known: {', '.join([*CASES, *REFERENCE_CASES])}")
    bad = [m for m in args.modes.split(",") if m not in MODES]
    if bad:
        ap.error(f"unknown mode(s) {bad}; known: {', '.join(MODES)}")
    bad = [b for b in args.baselines.split(",") if b and b not in BASELINES]
    if bad:
        ap.error(f"unknown baseline(s) {bad}; known: {', '.join(BASELINES)}")
    if (args.tune or args.tune_only) and not args.db:
        ap.error("--tune needs --db URL (the database the tuned configs go to)")
    return args


def selected(args: argparse.Namespace) -> list[Case]:
    return [CASES.get(c) or REFERENCE_CASES[c] for c in args.cases.split(",")]


def plan_text(cases: list[Case], dtype: str = "bf16") -> str:
    """A tuning plan (``flashtune tune --plan``) of ``cases``."""
    out = []
    for c in cases:
        out.append(f"[[shape]]  # {c.name}\nbatch = {c.batch}\nheads = {c.heads}\n"
                   f"kv_heads = {c.kv_heads or c.heads}\nseqlen = {c.seqlen}\n"
                   f"head_dim = {c.head_dim}\ncausal = {str(c.causal).lower()}\n"
                   f"dtype = \"{dtype}\"\n")
    return "\n".join(out)


def tune_commands(args: argparse.Namespace, plan: str | Path) -> list[list[str]]:
    """The ``flashtune tune`` command lines ``--tune`` runs, in order."""
    base = [sys.executable, "-m", "flashtune", "--db", str(args.db), "tune", "--plan",
            str(plan), "--trials", str(args.trials), "--no-progress"]
    cmds = [[*base, "--template", "attn_fwd"], [*base, "--template", "attn_bwd"]]
    if args.tune_ops:
        cmds += [[*base, "--op", "fwd"], [*base, "--op", "train"]]
    return cmds


def db_folder(url: str) -> Path | None:
    """The folder of a SQLite database URL (``sqlite:///relative.db`` from the repository
    root), to create before tuning; None for other databases."""
    if not url.startswith("sqlite:///") or url == "sqlite:///:memory:":
        return None
    path = Path(url.removeprefix("sqlite:///"))
    return (path if path.is_absolute() else ROOT / path).parent


def run_tuning(args: argparse.Namespace, cases: list[Case]) -> list[dict[str, Any]]:
    """Tune the cases into ``--db``: the shipped plan when every case is selected, else a
    plan of the selected ones."""
    folder = db_folder(args.db)
    if folder is not None:
        folder.mkdir(parents=True, exist_ok=True)
    if [c.name for c in cases] == list(CASES) and args.dtype == "bf16":
        plan: Path = PLAN
    else:
        handle = tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False)
        handle.write(plan_text(cases, args.dtype))
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


# -- one case ---------------------------------------------------------------------------------

def _rel(got: Any, ref: Any) -> float:
    got = got.float()
    if not bool(got.isfinite().all()):
        return float("nan")
    return ((got - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _first_line(exc: BaseException) -> str:
    lines = [t for t in str(exc).splitlines() if t.strip()]
    return f"{type(exc).__name__}: {lines[0].strip()[:200] if lines else ''}"


def contenders(case: Case, mode: str, tensors: dict[str, Any], fcfg: Mapping[str, int],
               bcfg: Mapping[str, int], baselines: list[str], routed: bool
               ) -> dict[str, Callable[[], Any]]:
    """``name -> fn()``: ``fwd`` returns the output, ``train`` the gradients (dq, dk, dv)."""
    import torch
    import torch.nn.functional as F

    import flashtune
    from flashtune.kernel_templates import get_template
    from flashtune.kernel_templates.training import pair_fn

    fwd, bwd = get_template("attn_fwd"), get_template("attn_bwd")
    q, k, v, do = tensors["q"], tensors["k"], tensors["v"], tensors["do"]
    leaves = tensors["leaves"]
    causal, gqa = case.causal, q.shape[1] != k.shape[1]
    fns: dict[str, Callable[[], Any]] = {}
    if mode == "fwd":
        fns["flashtune"] = lambda: fwd.launcher(q, k, v, fcfg, causal=causal)
    else:
        def own_step() -> Any:  # the autograd function flashtune.attention's pairs run
            out, _ = pair_fn(*leaves, causal, None, fwd.launcher, fcfg, bwd.launcher, bcfg)
            return torch.autograd.grad(out, leaves, do)
        fns["flashtune"] = own_step
    if routed:
        if mode == "fwd":
            def routed_fwd() -> Any:
                with torch.no_grad():
                    return flashtune.attention(q, k, v, causal=causal)
            fns["flashtune_routed"] = routed_fwd
        else:
            def routed_step() -> Any:
                out = flashtune.attention(*leaves, causal=causal)
                return torch.autograd.grad(out, leaves, do)
            fns["flashtune_routed"] = routed_step
    if q.is_cuda:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backends = {"sdpa_flash": SDPBackend.FLASH_ATTENTION,
                    "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
                    "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION}
        for name in baselines:
            be = backends[name]
            if mode == "fwd":
                def sdpa_fwd(be: Any = be) -> Any:
                    with sdpa_kernel(be), torch.no_grad():
                        return F.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                              enable_gqa=gqa)
                fns[name] = sdpa_fwd
            else:
                def sdpa_step(be: Any = be) -> Any:
                    with sdpa_kernel(be):
                        out = F.scaled_dot_product_attention(*leaves, is_causal=causal,
                                                             enable_gqa=gqa)
                    return torch.autograd.grad(out, leaves, do)
                fns[name] = sdpa_step
    return fns


def make_tensors(case: Case, dtype: Any, device: str) -> dict[str, Any]:
    import torch

    g = torch.Generator(device=device).manual_seed(case.head_dim)

    def mk(h: int) -> Any:
        return torch.randn(case.batch, h, case.seqlen, case.head_dim, device=device,
                           generator=g).to(dtype)
    hkv = case.kv_heads or case.heads
    q, k, v, do = mk(case.heads), mk(hkv), mk(hkv), mk(case.heads)
    leaves = tuple(t.detach().requires_grad_(True) for t in (q, k, v))
    return {"q": q, "k": k, "v": v, "do": do, "leaves": leaves}


def references(case: Case, tensors: dict[str, Any], modes: list[str]) -> dict[str, Any]:
    """fp32 output and gradients on batch 0, K/V head 0 and its query heads."""
    import torch

    from flashtune.kernel_templates.attn_bwd.reference import attn_bwd_reference
    from flashtune.kernel_templates.attn_fwd.reference import attn_fwd_reference

    group = case.heads // (case.kv_heads or case.heads)
    q, k, v, do = (tensors[n] for n in ("q", "k", "v", "do"))
    sq, skv = (slice(0, 1), slice(0, group)), (slice(0, 1), slice(0, 1))
    refs: dict[str, Any] = {"slices": (sq, skv, skv)}
    refs["fwd"], _ = attn_fwd_reference(q[sq], k[skv], v[skv], causal=case.causal,
                                        dtype=torch.float32)
    if "train" in modes:
        refs["train"] = attn_bwd_reference(q[sq], k[skv], v[skv], do[sq], causal=case.causal,
                                           dtype=torch.float32)
    return refs


def check(mode: str, got: Any, refs: dict[str, Any]) -> dict[str, float]:
    """The relative errors of a contender's result against the references."""
    sq, sk, sv = refs["slices"]
    if mode == "fwd":
        return {"out": _rel(got[sq], refs["fwd"])}
    return {name: _rel(g[s], r) for name, g, s, r in
            zip(("dq", "dk", "dv"), got, (sq, sk, sv), refs["train"])}


def run_case(case: Case, args: argparse.Namespace, device: Any, dispatchers: dict[str, Any],
             bench: Callable[[Callable[[], Any]], Any], torch_device: str = "cuda"
             ) -> dict[str, Any]:
    """One case's row: its configs, and per mode every contender's errors and timings."""
    import torch

    from flashtune.autotune.timing import tflops
    from flashtune.core.case import TOLERANCE

    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    modes = args.modes.split(",")
    p = case.problem(args.dtype)
    fchoice = dispatchers["attn_fwd"].choose(p, device)
    bchoice = dispatchers["attn_bwd"].choose(p, device)
    row: dict[str, Any] = {
        "case": case.name, "label": case.label, "problem": p.key(),
        "flops": {"fwd": p.flops(), "train": p.flops() * TRAIN_FACTOR},
        "attn_fwd": {"config": fchoice.config, "source": fchoice.source},
        "attn_bwd": {"config": bchoice.config, "source": bchoice.source}}
    tensors = make_tensors(case, dtype, torch_device)
    if case.head_dim % 8 and tensors["q"].is_cuda:
        row["copies"] = copy_costs(tensors["q"], bench)
    refs = references(case, tensors, modes)
    tol = TOLERANCE[args.dtype]
    baselines = [b for b in args.baselines.split(",") if b]
    if args.bwd_sweep and "train" in refs:
        row["bwd_sweep"] = bwd_sweep(case, tensors, refs, fchoice.config, bchoice.config,
                                     json.loads(args.bwd_sweep), bench, tol, p, device)
    for mode in modes:
        fns = contenders(case, mode, tensors, fchoice.config, bchoice.config, baselines,
                         routed=not args.no_routed)
        res: dict[str, Any] = {}
        runnable = {}
        for name, fn in fns.items():
            try:
                errs = check(mode, fn(), refs)
            except Exception as exc:  # noqa: BLE001 - a contender that cannot run is data
                res[name] = {"error": _first_line(exc)}
                continue
            if not max(errs.values()) < tol:  # NaN too
                res[name] = {"error": f"wrong result: relative error {errs} (tolerance "
                                      f"{tol}); not timed", "rel_err_vs_fp32": errs}
                continue
            res[name] = {"rel_err_vs_fp32": errs}
            runnable[name] = fn
        if "flashtune_routed" in runnable:  # what the router ran (with grad: the train route)
            from flashtune.runtime.ops import lookup_config

            inputs = tensors["leaves"] if mode == "train" else (
                tensors["q"], tensors["k"], tensors["v"])
            choice = lookup_config(*inputs, causal=case.causal)
            res["flashtune_routed"]["route"] = {"template": choice.template,
                                                "config": choice.config,
                                                "source": choice.source}
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
            if tensors["q"].is_cuda:
                res[name]["host_ms"] = host_ms(runnable[name])
        res["ratios"] = ratios(res)
        row[mode] = res
        fns.clear()
        runnable.clear()
    return row


def host_ms(fn: Callable[[], Any], calls: int = 5) -> float:
    """Host time of one call of ``fn`` in milliseconds (``calls`` enqueued back to back after
    a synchronisation, the GPU left to catch up after): where it is above the GPU time the
    call is host-bound, and ``timing.bench`` (``do_bench`` once a median reaches 1 ms,
    launch gaps included) times it as such."""
    import torch

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - t0
    torch.cuda.synchronize()
    return elapsed * 1e3 / calls


def bwd_sweep(case: Case, tensors: dict[str, Any], refs: dict[str, Any],
              fcfg: Mapping[str, int], default: Mapping[str, int],
              configs: list[dict[str, int]], bench: Callable[[Callable[[], Any]], Any],
              tol: float, problem: Any, device: Any) -> list[dict[str, Any]]:
    """attn_bwd alone (the launcher on the forward's output) with the default and each of
    ``configs`` (over the default): gradients checked, then timed; backward TFLOP/s
    (2.5x the forward's FLOPs, ANCHORS.md). Configs the predicate refuses are reported."""
    from flashtune.autotune.timing import tflops
    from flashtune.kernel_templates import get_template

    fwd, bwd = get_template("attn_fwd"), get_template("attn_bwd")
    q, k, v, do = (tensors[n] for n in ("q", "k", "v", "do"))
    out, lse = fwd.launcher(q, k, v, fcfg, causal=case.causal, return_lse=True)
    rows = []
    for cfg in [dict(default), *({**default, **c} for c in configs)]:
        entry: dict[str, Any] = {"config": cfg, "default": cfg == dict(default)}
        reason = bwd.space.check(cfg, problem, device)
        if reason is not None:
            entry["error"] = f"refused: {reason}"
            rows.append(entry)
            continue

        def fn(cfg: Mapping[str, int] = cfg) -> Any:
            return bwd.launcher(q, k, v, out, lse, do, cfg, causal=case.causal)
        try:
            errs = check("train", fn(), refs)
            if not max(errs.values()) < tol:
                entry["error"] = f"wrong result: {errs}"
            else:
                ms = bench(fn).median_ms
                entry.update(rel_err_vs_fp32=errs, median_ms=ms,
                             tflops=tflops(problem.flops(backward=True), ms))
        except Exception as exc:  # noqa: BLE001 - a config that cannot run is data
            entry["error"] = _first_line(exc)
        rows.append(entry)
        print(f"{case.name} bwd sweep: {json.dumps(entry, default=str)}", flush=True)
    return rows


def copy_costs(q: Any, bench: Callable[[Callable[[], Any]], Any]) -> dict[str, float]:
    """Milliseconds of the padded path's copies of one tensor like ``q``: the pad to the next
    multiple of 8 (``tma.pad_head_dim`` and ``F.pad``) and the cut back (``unpad_head_dim``
    and ``copy_`` of the slice), each checked to give the same tensor first."""
    import torch
    import torch.nn.functional as F

    from flashtune.kernel_templates.tma import pad_head_dim, padded_head_dim, unpad_head_dim

    d = q.shape[-1]
    width = padded_head_dim(d)
    wide = F.pad(q, (0, width - d))
    narrow = torch.empty_like(q)
    if not (torch.equal(pad_head_dim(q, width), wide)
            and torch.equal(unpad_head_dim(wide, d, narrow), q)):
        raise RuntimeError("tma.pad_head_dim / unpad_head_dim disagree with F.pad")
    fns = {"pad_triton": lambda: pad_head_dim(q, width),
           "pad_torch": lambda: F.pad(q, (0, width - d)),
           "unpad_triton": lambda: unpad_head_dim(wide, d, narrow),
           "unpad_torch": lambda: narrow.copy_(wide[..., :d])}
    return {name: bench(fn).median_ms for name, fn in fns.items()}


def ratios(res: Mapping[str, Any]) -> dict[str, Any]:
    """flashtune's (and the routed call's) speed over each SDPA backend, and the target: over
    cuDNN where it ran, else over SDPA flash."""
    def ms(name: str) -> float | None:
        value = res.get(name, {}).get("median_ms")
        return value if isinstance(value, float) else None

    out: dict[str, Any] = {}
    for ours in ("flashtune", "flashtune_routed"):
        if ms(ours) is None:
            continue
        for base in BASELINES:
            if ms(base) is not None:
                out[f"{ours}_vs_{base}"] = ms(base) / ms(ours)
    base = "sdpa_cudnn" if ms("sdpa_cudnn") is not None else \
        "sdpa_flash" if ms("sdpa_flash") is not None else None
    if base is not None and ms("flashtune") is not None:
        target = CUDNN_TARGET if base == "sdpa_cudnn" else FLASH_TARGET
        got = out["flashtune_vs_" + base]
        out["target"] = {"against": base, "ratio": got, "wanted": target, "met": got >= target}
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


def check_plan(cases: list[Case], path: Path = PLAN) -> None:
    """Raise ValueError unless ``path`` lists exactly ``cases``' problems, in order."""
    from flashtune.autotune.plans import load_plan

    plan = load_plan(path)
    want = [c.problem() for c in cases]
    if plan != want:
        raise ValueError(f"{path} lists {[p.describe() for p in plan]}, the cases are "
                         f"{[p.describe() for p in want]}")


def dry_run(args: argparse.Namespace) -> dict[str, Any]:
    """What a run would do, without a GPU: the cases, FLOPs, H100 default configs and the
    tuning commands."""
    from flashtune.kernel_templates import get_template
    from flashtune.kernel_templates.sm90 import H100

    cases = selected(args)
    check_plan(list(CASES.values()))
    fwd, bwd = get_template("attn_fwd"), get_template("attn_bwd")
    rows = []
    for c in cases:
        p = c.problem(args.dtype)
        rows.append({"case": c.name, "label": c.label, "problem": p.key(),
                     "fwd_tflop": p.flops() / 1e12,
                     "train_tflop": p.flops() * TRAIN_FACTOR / 1e12,
                     "attn_fwd_default_h100": fwd.default_config(p, H100),
                     "attn_bwd_default_h100": bwd.default_config(p, H100)})
    plan = PLAN if [c.name for c in cases] == list(CASES) else "<a plan of the cases>"
    return {"cases": rows, "modes": args.modes.split(","),
            "contenders": ["flashtune", *([] if args.no_routed else ["flashtune_routed"]),
                           *[b for b in args.baselines.split(",") if b]],
            "tune_commands": [" ".join(c[1:]) for c in tune_commands(args, plan)]
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
    if args.db:  # the router reads the same database (read when it is first used)
        os.environ["FLASHTUNE_DB"] = args.db
    import torch
    import triton

    from flashtune.autotune.timing import bench
    from flashtune.core.device import cuda_device

    if not torch.cuda.is_available():
        raise SystemExit("bench_headdims needs a CUDA GPU (--dry-run does not)")
    dev = cuda_device()
    dispatchers = dispatchers_for(args.db)
    rows: list[dict[str, Any]] = []
    t0 = time.time()
    for case in cases:
        t = time.time()
        rows.append(run_case(case, args, dev, dispatchers, bench))
        print(f"{case.name}: {time.time() - t:.0f} s", flush=True)
        torch.cuda.empty_cache()
        result = {"benchmark": "odd head dims (issue 31): forward and training step",
                  "dtype": args.dtype, "device": dev.to_dict(), "torch": torch.__version__,
                  "triton": triton.__version__, "cudnn": torch.backends.cudnn.version(),
                  "host": platform.node(), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                  "db": args.db, "rounds": args.rounds, "tuning": tuning,
                  "wall_s": time.time() - t0, "summary": summarize(rows), "rows": rows}
        path = Path(args.out)  # rewritten after every case: a cut-off run keeps what it did
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1, default=str))
    print(render_table(rows, args))


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per mode: the geometric mean of flashtune's target ratios and how many shapes met
    their target."""
    out: dict[str, Any] = {}
    for mode in MODES:
        targets = [r[mode]["ratios"]["target"] for r in rows
                   if "target" in r.get(mode, {}).get("ratios", {})]
        if not targets:
            continue
        out[mode] = {
            "met": sum(t["met"] for t in targets), "shapes": len(targets),
            "geomean_vs_target_baseline": math.exp(
                sum(math.log(t["ratio"]) for t in targets) / len(targets))}
    return out


def render_table(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    names = ["flashtune", *([] if args.no_routed else ["flashtune_routed"]),
             *[b for b in args.baselines.split(",") if b]]
    lines = [f"TFLOP/s, {args.dtype}, median of {args.rounds} rounds (training step counted "
             f"{TRAIN_FACTOR}x the forward); target: >= {CUDNN_TARGET}x cuDNN where it serves "
             f"the shape, else >= {FLASH_TARGET}x SDPA flash",
             "| case | mode | " + " | ".join(names) + " | target | configs |",
             "|---|---|" + "---|" * (len(names) + 2)]
    for r in rows:
        for mode in MODES:
            if mode not in r:
                continue
            res = r[mode]
            cells = []
            for n in names:
                e = res.get(n, {})
                cells.append(f"{e['tflops']:.0f}" if "tflops" in e
                             else ("refused" if "error" in e else "-"))
            t = res["ratios"].get("target")
            tcell = (f"{t['ratio']:.2f}x {t['against'].removeprefix('sdpa_')} "
                     f"({'met' if t['met'] else 'missed'})") if t else "-"
            src = f"{r['attn_fwd']['source']}/{r['attn_bwd']['source']}"
            lines.append(f"| {r['label']} | {mode} | " + " | ".join(cells)
                         + f" | {tcell} | {src} |")
    for r in rows:
        for mode in MODES:
            bound = [f"{n} {e['host_ms']:.3f} ms host / {e['median_ms']:.3f} ms timed"
                     for n, e in r.get(mode, {}).items()
                     if isinstance(e, dict) and e.get("host_ms", 0) >= e.get("median_ms", 1e9)]
            if bound:
                lines.append(f"{r['case']} {mode} host-bound: " + "; ".join(bound))
        for e in r.get("bwd_sweep", []):
            keys = ("BLOCK_M1", "BLOCK_N1", "BLOCK_M2", "BLOCK_N2", "num_warps", "num_stages")
            tiles = "/".join(str(e["config"].get(n)) for n in keys)
            got = f"{e['tflops']:.0f} TFLOP/s" if "tflops" in e else e.get("error", "")[:80]
            lines.append(f"{r['case']} attn_bwd {tiles}{' (default)' if e['default'] else ''}"
                         f": {got}")
        if "copies" in r:
            lines.append(f"{r['case']} copies of q, ms: " + ", ".join(
                f"{n} {ms:.4f}" for n, ms in r["copies"].items()))
    summary = summarize(rows)
    for mode, s in summary.items():
        lines.append(f"{mode}: {s['met']} of {s['shapes']} shapes meet the target; geomean "
                     f"{s['geomean_vs_target_baseline']:.2f}x the target's baseline")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
