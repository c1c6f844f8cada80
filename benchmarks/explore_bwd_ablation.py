"""Where the Gluon backward's main kernel spends its time: the kernel timed with parts of its
work switched off, at two sequence lengths, so each variant splits into a time per step and
a fixed time per CTA (issue 24: at D128 the grid launch pays about 9 us a CTA besides its
steps, cuDNN 4.6 us).

    python benchmarks/explore_bwd_ablation.py [--head-dims 128] [--seqlens 512,4096]
        [--causal no|yes|both] [--configs '[{}, {"PERSISTENT": 1}]'] [--rounds 5]
        [--out benchmarks/results/bwd_ablation_h200.json]

A variant is ``attn_bwd_gluon/kernel.py``'s text with some of :data:`PATCHES` applied,
written to a throwaway module (the library's kernel is not changed); each patch must match
its text exactly once, so a kernel edit that moves it fails loudly. The patches keep every
instruction stream but skip a part's effect or its wait (the last two change the step's
branch on its mask):

* ``no_epilogue``: dK and dV stored under a mask false at run time (the stores' traffic);
* ``no_atomics``: the dQ writer's atomics under such a mask (the writer still reads each
  partial from shared memory and hands the buffer back);
* ``no_dq_mma``: no ``dS K`` wgmma (a zero partial goes to the writer);
* ``no_ds_wait``: a consumer does not wait for the other's ``dS^T`` rows before its
  ``dS K`` (the two consumers' lockstep);
* ``mask_always``: the mask applied at every step, with no branch on whether the step
  needs it (the same gradients);
* ``mask_never``: no mask and no branch (wrong on the masked steps: the branch's and the
  mask's cost together).

(The mask's two patch the kernels that branch on it: D128, and D64 without a causal mask;
causal D64 walks run the diagonal in a loop of its own.) ``--variants`` names the ones to
time; ``timeline`` (named only) records each CTA's start and end (``%globaltimer``), SM
and steps, a grid launch's: its busy share, idle tail and gaps between CTAs
(:func:`timeline_stats`). ``--kernel NAME=PATH`` times another kernel file with the same
parameters beside them, its gradients checked against the launcher's first (a candidate
change, or ``--before PATH`` another revision's).

Shapes are the standard grid's (16384 tokens, 2048 / D heads, bf16), so every length
launches the same number of CTAs; a variant's time at two lengths gives its time per step
(one ``BLOCK_M`` query block) and per CTA (launch, loads, ramp, drain, epilogue) by a line
through the two. The base variant's dQ, dK and dV are checked against the library
launcher's first (they must be the same kernel); the patched ones are wrong by design. The
variants are compiled in a process pool, then timed interleaved, ``--rounds`` rounds of
CUDA-event timing, the median kept. SDPA cuDNN's and flash's backward kernels are profiled
on the same inputs as anchors. Without a CUDA GPU it prints "needs a CUDA GPU" and exits 0.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import statistics
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))  # gluon_tile_cost's fit_line
KERNEL = ROOT / "flashtune" / "kernel_templates" / "attn_bwd_gluon" / "kernel.py"
TOKENS, HIDDEN = 16384, 2048
DT = torch.bfloat16
OFF = "1073741824"  # a mask's bound no length reaches, unknown to the compiler

# ``timeline``'s helpers: a consumer warpgroup's clock (``%globaltimer``, ns) and SM, and
# consumer 0's record of its CTA (a grid launch's tile): start, end, SM, steps, into the
# int64 rows of the buffer passed as ``cu_q_ptr`` (unused by the dense kernel otherwise)
TIMELINE_HELPERS = '''@gluon.jit
def _timeline_now():
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    z = gl.zeros([128], gl.int32, layout)
    return gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [z], dtype=gl.int64,
                                     is_pure=False, pack=1)


@gluon.jit
def _timeline_store(buf_ptr, t0, total, cid):
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    i = gl.arange(0, 128, layout=layout)
    t1 = _timeline_now()
    sm = gl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r,r", [i], dtype=gl.int32,
                                   is_pure=False, pack=1)
    row = (gl.program_id(1) * gl.num_programs(0) + gl.program_id(0)).to(gl.int64) * 4
    vals = gl.where(i == 0, t0, gl.where(i == 1, t1, gl.where(i == 2, sm.to(gl.int64),
                                                                 total.to(gl.int64))))
    gl.store(buf_ptr + row + i, vals, mask=(i < 4) & (cid == 0))


'''

PATCHES: dict[str, list[tuple[str, str]]] = {
    "no_epilogue": [("    ok = gl.expand_dims(rows < seqlen_k, 1)\n    gl.store(dk_ptr",
                     f"    ok = gl.expand_dims(rows < seqlen_k - {OFF}, 1)\n    gl.store(dk_ptr")],
    "no_atomics": [("offs, part,\n                                  sem=\"relaxed\")",
                    f"offs, part,\n                                  mask=offs < seqlen_q - {OFF}, "
                    "sem=\"relaxed\")")],
    "no_dq_mma": [("    dq = warpgroup_mma(ds_b.permute((1, 0)), k_cols, dq_zero, "
                   "use_acc=False,\n                       is_async=True)\n",
                   "    dq = dq_zero\n")],
    "no_ds_wait": [("    mbarrier.wait(ds_ready.index((step0 + t) % 2), "
                    "((step0 + t) // 2) & 1)\n", "")],
    "timeline": [
        ("@gluon.jit\ndef _seq(cu_ptr, b):", TIMELINE_HELPERS + "@gluon.jit\ndef _seq(cu_ptr, b):"),
        ("    k0 = n_block * BLOCK_N + cid * ROWS_N\n",
         "    k0 = n_block * BLOCK_N + cid * ROWS_N\n    tl_t0 = _timeline_now()\n"),
        ("    return total\n\n\n@gluon.jit\ndef _masked_steps(",
         "    _timeline_store(cu_q_ptr, tl_t0, total, cid)\n"
         "    return total\n\n\n@gluon.jit\ndef _masked_steps(")],
    "mask_always": [("        if need_mask:\n", "        if True:\n")],
    "mask_never": [("        if need_mask:\n", "        if False:\n")],
}
VARIANTS: dict[str, tuple[str, ...]] = {
    "base": (),
    "no_epilogue": ("no_epilogue",),
    "no_atomics": ("no_atomics",),
    "no_dq": ("no_dq_mma", "no_atomics"),
    "no_ds_wait": ("no_ds_wait",),
    "mask_always": ("mask_always",),
    "mask_never": ("mask_never",),
    "no_epilogue_atomics": ("no_epilogue", "no_atomics"),
    "timeline": ("timeline",),
}
OPTIONAL_VARIANTS = ("timeline",)  # not timed unless named in --variants


def variant_source(kernel: Path, patches: dict[str, list[tuple[str, str]]],
                   names: tuple[str, ...]) -> str:
    """``kernel``'s text with the patches ``names`` applied: each ``(old, new)`` must match
    exactly once (every match with a third element, the count it must have)."""
    text = kernel.read_text()
    for name in names:
        for old, new, *count in patches[name]:
            want = count[0] if count else 1
            if text.count(old) != want:
                raise SystemExit(f"patch {name} matches {text.count(old)} times, not {want}: "
                                 "update it")
            text = text.replace(old, new)
    return text


def write_modules(where: Path, prefix: str = "bwd_ablation", kernel: Path = KERNEL,
                  patches: dict[str, list[tuple[str, str]]] | None = None,
                  variants: dict[str, tuple[str, ...]] | None = None,
                  kernels: dict[str, Path] | None = None) -> None:
    """Each variant's kernel text as module ``{prefix}_{variant}`` in ``where``, and each
    of ``kernels`` (other kernel files with the same parameters: another revision's, a
    candidate change) as it is, as module ``{prefix}_{name}``."""
    patches = PATCHES if patches is None else patches
    for name, names in (VARIANTS if variants is None else variants).items():
        (where / f"{prefix}_{name}.py").write_text(variant_source(kernel, patches, names))
    for name, path in (kernels or {}).items():
        (where / f"{prefix}_{name}.py").write_text(path.read_text())


def _kernel(where: str, name: str, prefix: str = "bwd_ablation",
            attr: str = "gluon_attn_bwd_kernel") -> Any:
    import importlib

    if where not in sys.path:
        sys.path.insert(0, where)
    return getattr(importlib.import_module(f"{prefix}_{name}"), attr)


def _plan(q: Any, k: Any, out: Any, lse: Any, dq: Any, dk: Any, scratch: dict[str, Any],
          config: dict[str, int], causal: bool) -> dict[str, Any]:
    from flashtune.kernel_templates.attn_bwd_gluon.launcher import plan

    return plan(q, k, k, out, lse, out, dq, dk, dk, scratch, config, causal=causal,
                scale=1.0 / math.sqrt(q.shape[3]))


def _compile(where: str, name: str, shape: tuple[int, int, int, int], causal: bool,
             config: dict[str, int]) -> str | None:
    """Worker: compile variant ``name``'s main kernel for ``shape`` (shape-only stand-ins)."""
    try:
        from flashtune.kernel_templates.attn_bwd_gluon.launcher import scratch_shapes
        from flashtune.kernel_templates.shaped import Shaped

        q = Shaped(DT, shape)
        scratch = {n: Shaped(torch.float32, s) for n, s in scratch_shapes(shape, config).items()}
        _, args, kwargs, grid = _plan(q, q, q, Shaped(torch.float32, shape[:3]), q, q, scratch,
                                      config, causal)["main"]
        if name == "timeline":
            kwargs = {**kwargs, "cu_q_ptr": Shaped(torch.int64, (4,))}
        _kernel(where, name).warmup(*args, grid=grid, **kwargs)
        return None
    except Exception as exc:  # noqa: BLE001 - reported, the variant skipped
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]


def _anchors(q: Any, k: Any, v: Any, do: Any, causal: bool) -> dict[str, float]:
    """Device ms of SDPA cuDNN's and flash's backward kernels (the largest of each step
    whose name says backward)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.profiler import ProfilerActivity, profile

    found: dict[str, float] = {}
    for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION),
                          ("flash", SDPBackend.FLASH_ATTENTION)):
        leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]

        def step() -> None:
            with sdpa_kernel(backend):
                o = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=causal)
            torch.autograd.grad(o, leaves, do)

        for _ in range(2):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                step()
            torch.cuda.synchronize()
        times = {ev.key: ev.self_device_time_total / 1e3 / 10 for ev in prof.key_averages()
                 if ev.self_device_time_total > 0}
        bwd = {n: t for n, t in times.items() if "bprop" in n or "bwd" in n}
        found[name] = max(bwd.values()) if bwd else float("nan")
    return found


def timeline_stats(records: list[list[int]]) -> dict[str, Any]:
    """What a launch's CTA records say (``[start ns, end ns, SM, steps]`` each, the
    ``timeline`` variant's): its span, the SMs' busy share of it, the mean idle time of an SM
    before its first CTA and after its last (the tail), the mean gap between two CTAs of an
    SM, and a line through the CTAs' durations over their steps (fixed and per step, us;
    None where every CTA walks as many steps)."""
    if not records or any(r[1] < r[0] for r in records):
        raise ValueError("timeline: a CTA's record is missing or ends before it starts")
    t0, t1 = min(r[0] for r in records), max(r[1] for r in records)
    per_sm: dict[int, list[list[int]]] = {}
    for r in records:
        per_sm.setdefault(r[2], []).append(r)
    busy = sum(r[1] - r[0] for r in records)
    gaps, n_gaps = 0, 0
    for rs in per_sm.values():
        rs.sort()
        gaps += sum(max(b[0] - a[1], 0) for a, b in zip(rs, rs[1:]))
        n_gaps += len(rs) - 1
    from gluon_tile_cost import fit_line

    steps = [r[3] for r in records]
    durations = [(r[1] - r[0]) / 1e3 for r in records]
    try:
        fixed, per_step = fit_line(steps, durations)
    except ValueError:  # one CTA, or every CTA as many steps: no slope
        fixed = per_step = None
    n_sm = len(per_sm)
    return {"ctas": len(records), "sms": n_sm, "span_us": (t1 - t0) / 1e3,
            "busy_share": busy / (n_sm * (t1 - t0)),
            "head_us": sum(min(r[0] for r in rs) - t0 for rs in per_sm.values()) / n_sm / 1e3,
            "tail_us": sum(t1 - max(r[1] for r in rs) for rs in per_sm.values()) / n_sm / 1e3,
            "gap_us": gaps / max(n_gaps, 1) / 1e3,
            "cta_us_mean": sum(durations) / len(durations),
            "fixed_us": fixed, "per_step_us": per_step}


def _run_backward(launches: dict[str, Any], main: tuple[Any, Any, Any, Any]) -> None:
    """The planned backward (preprocess, ``main`` in place of the planned main kernel, dQ
    convert) once, into the plan's gradients."""
    for part in ("preprocess", "main", "convert"):
        kernel, args, kwargs, grid = main if part == "main" else launches[part]
        kernel[grid](*args, **kwargs)


def time_launch(launch: tuple[Any, Any, Any, Any], reps: int) -> float:
    kernel, args, kwargs, grid = launch
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        kernel[grid](*args, **kwargs)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def add_run_args(ap: argparse.ArgumentParser, head_dims: str, seqlens: str,
                 causal: str) -> None:
    """The options both ablation scripts take (the shapes' defaults given): head dims,
    lengths, masks, rounds, launches a round, compile processes, the JSON's path."""
    ap.add_argument("--head-dims", default=head_dims)
    ap.add_argument("--seqlens", default=seqlens)
    ap.add_argument("--causal", choices=("no", "yes", "both"), default=causal)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--jobs", type=int, default=16)
    ap.add_argument("--out", default="")


def compile_all(compile_one: Any, jobs: list[tuple[Any, ...]], workers: int) -> list[bool]:
    """``compile_one(*job)`` for every job in a spawned process pool (a module-level
    function; it returns an error or None); each error printed; which jobs failed."""
    with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
        errors = list(pool.map(compile_one, *zip(*jobs)))
    for job, error in zip(jobs, errors):
        if error:
            print(f"compile {job[1:]}: {error}")
    return [bool(e) for e in errors]


def time_variants(mains: dict[str, Any], rounds: int, reps: int) -> dict[str, list[float]]:
    """Each launch's ms per call, ``rounds`` rounds of ``reps`` calls, interleaved (one
    warm-up of each first)."""
    times: dict[str, list[float]] = {name: [] for name in mains}
    for launch in mains.values():
        time_launch(launch, 3)
    for _ in range(rounds):
        for name, launch in mains.items():
            times[name].append(time_launch(launch, reps))
    return times


def write_doc(out: str, benchmark: str, args: argparse.Namespace, patches: Any,
              variants: Any, rows: list[dict[str, Any]]) -> None:
    """The run's JSON at ``out`` (nothing when empty)."""
    if not out:
        return
    doc = {"benchmark": benchmark, "device": torch.cuda.get_device_name(),
           "torch": torch.__version__, "python": platform.python_version(),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
           "rounds": args.rounds, "reps": args.reps, "patches": patches,
           "variants": variants, "rows": rows}
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(doc, indent=1))
    print(f"wrote {out}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default='[{}]',
                    help="JSON list of updates to the template default (LPT 0, DQ_TMA 0, "
                         "PERSISTENT 0 first)")
    ap.add_argument("--variants",
                    default=",".join(n for n in VARIANTS if n not in OPTIONAL_VARIANTS),
                    help="the variants to time, comma-separated (base first)")
    ap.add_argument("--kernel", action="append", default=[], metavar="NAME=PATH",
                    help="another kernel.py (same parameters: another revision's, a candidate "
                         "change), checked against the library launcher's gradients and timed "
                         "as variant NAME beside the others (repeatable)")
    ap.add_argument("--before", default="",
                    help="another revision's kernel.py: --kernel before=PATH")
    add_run_args(ap, "128", "512,4096", "no")
    args = ap.parse_args(argv)
    variants = {n: VARIANTS[n] for n in args.variants.split(",")}
    if "base" not in variants:
        raise SystemExit("--variants: base is the library kernel, checked and timed first")
    kernels = dict(spec.split("=", 1) for spec in args.kernel)
    if args.before:
        kernels["before"] = args.before
    if set(kernels) & set(VARIANTS) or not all(kernels.values()):
        raise SystemExit("--kernel NAME=PATH: a name no variant has, and a path")
    names = [*variants, *kernels]
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 0
    from flashtune.core.device import cuda_device
    from flashtune.core.problem import AttentionProblem
    from flashtune.kernel_templates import get_template
    from flashtune.kernel_templates.attn_bwd_gluon.launcher import scratch_shapes
    from flashtune.runtime.lookup import Dispatcher

    device = cuda_device()
    fwd, bwd = get_template("attn_fwd_gluon"), get_template("attn_bwd_gluon")
    updates = json.loads(args.configs)
    causals = {"no": (False,), "yes": (True,), "both": (False, True)}[args.causal]
    from flashtune.autotune.precompile import share_cache_dir

    share_cache_dir()  # set before the pool starts: its workers compile into it
    where = tempfile.mkdtemp(prefix="bwd_ablation_")
    write_modules(Path(where), variants=variants,
                  kernels={n: Path(path) for n, path in kernels.items()})
    cases = []
    for d in map(int, args.head_dims.split(",")):
        for causal in causals:
            for n in map(int, args.seqlens.split(",")):
                problem = AttentionProblem(TOKENS // n, HIDDEN // d, HIDDEN // d, n, n, d, causal,
                                           "bf16")
                base = {**dict(Dispatcher(bwd).choose(problem, device).config),
                        "LPT": 0, "DQ_TMA": 0, "PERSISTENT": 0}
                for upd in updates:
                    cases.append((problem, {**base, **upd}))
    # once per variant, head dim, mask and config: the kernel does not specialize on the
    # lengths here (all multiples of 16); the pool and this process share TRITON_CACHE_DIR
    unique = {(name, p.head_dim, p.causal, json.dumps(cfg, sort_keys=True)):
              (where, name, (p.batch, p.heads_q, p.seqlen_q, p.head_dim), p.causal, cfg)
              for p, cfg in cases for name in names}
    jobs = list(unique.values())
    failed = compile_all(_compile, jobs, args.jobs)
    broken = {(j[1], j[2][3], j[3], json.dumps(j[4], sort_keys=True))
              for j, bad in zip(jobs, failed) if bad}
    rows = []
    for problem, config in cases:
        p = problem
        g = torch.Generator(device="cuda").manual_seed(p.seqlen_q * p.head_dim + p.causal)
        q, k, v, do = (torch.randn(p.batch, p.heads_q, p.seqlen_q, p.head_dim, device="cuda",
                                   dtype=DT, generator=g) for _ in range(4))
        fcfg = dict(Dispatcher(fwd).choose(p, device).config)
        out, lse = fwd.launcher(q, k, v, fcfg, causal=p.causal, return_lse=True)
        ref = bwd.launcher(q, k, v, out, lse, do, config, causal=p.causal)
        dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
        scratch = {n: torch.empty(s, device="cuda", dtype=torch.float32)
                   for n, s in scratch_shapes(tuple(q.shape), config).items()}
        from flashtune.kernel_templates.attn_bwd_gluon.launcher import plan

        launches = plan(q, k, v, out, lse, do, dq, dk, dv, scratch, config, causal=p.causal,
                        scale=1.0 / math.sqrt(p.head_dim))
        key = json.dumps(config, sort_keys=True)
        mains = {name: (_kernel(where, name), *launches["main"][1:]) for name in names
                 if (name, p.head_dim, p.causal, key) not in broken}
        main_grid = launches["main"][3]
        record = None
        if "timeline" in mains:  # its CTAs' records go to a buffer passed as cu_q_ptr
            record = torch.zeros(main_grid[0] * main_grid[1] * 4, device="cuda",
                                 dtype=torch.int64)
            kernel, a, kw, g = mains["timeline"]
            mains["timeline"] = (kernel, a, {**kw, "cu_q_ptr": record}, g)
        # the base variant is the library kernel: same gradients as its launcher
        _run_backward(launches, mains["base"])
        same = all(torch.equal(x, y) or (x - y).abs().max().item() < 1e-2
                   for x, y in zip((dk, dv), ref[1:]))
        dq_err = ((dq.float() - ref[0].float()).norm() / ref[0].float().norm()).item()
        # each other kernel file: its gradients against the launcher's (a candidate change
        # must compute the same; the patched variants are wrong by design)
        kernels_match = {}
        for name in kernels:
            if name not in mains:
                continue
            dq.zero_(), dk.zero_(), dv.zero_()
            _run_backward(launches, mains[name])
            kernels_match[name] = {
                "dk_dv_max_abs": max((x.float() - y.float()).abs().max().item()
                                     for x, y in zip((dk, dv), ref[1:])),
                "dq_rel_err": ((dq.float() - ref[0].float()).norm()
                               / ref[0].float().norm()).item()}
        times = time_variants(mains, args.rounds, args.reps)
        timeline = None
        if record is not None:  # one launch more, alone: its CTAs' records
            time_launch(mains["timeline"], 1)
            timeline = timeline_stats(record.view(-1, 4).tolist())
        anchors = _anchors(q, k, v, do, p.causal)
        row = {"shape": f"B{p.batch} H{p.heads_q} N{p.seqlen_q} D{p.head_dim}"
                        f"{' causal' if p.causal else ''}",
               "batch": p.batch, "heads": p.heads_q, "seqlen": p.seqlen_q,
               "head_dim": p.head_dim, "causal": p.causal, "config": config,
               "ctas": main_grid[0] * main_grid[1], "base_matches_launcher": same,
               "kernels_match": kernels_match,
               "base_dq_rel_err": dq_err, "anchors_ms": anchors,
               "variants_ms": {n: statistics.median(t) for n, t in times.items()},
               "rounds_ms": times, "timeline": timeline}
        rows.append(row)
        print(f"== {row['shape']} {config} ctas {row['ctas']} base==launcher {same} "
              f"(dq {dq_err:.1e}); cuDNN bwd {anchors['cudnn']:.3f} ms, flash "
              f"{anchors['flash']:.3f} ms", flush=True)
        for name, err in kernels_match.items():
            print(f"   {name}: dK, dV max |diff| {err['dk_dv_max_abs']:.2e}, dQ rel "
                  f"{err['dq_rel_err']:.2e} against the launcher")
        for n, ms in row["variants_ms"].items():
            print(f"   {n:22s} {ms:.4f} ms  {ms / row['variants_ms']['base']:.3f}x base  "
                  f"{anchors['cudnn'] / ms:.3f}x cuDNN")
        if timeline is not None:
            print("   timeline " + ", ".join(
                f"{n} {v:.3f}" if isinstance(v, float) else f"{n} {v}"
                for n, v in timeline.items()))
        del q, k, v, do, out, lse, ref, dq, dk, dv, scratch
        torch.cuda.empty_cache()
    _print_split(rows)
    write_doc(args.out, "bwd_ablation", args, PATCHES,
              {**variants, **kernels}, rows)
    return 0


def _print_split(rows: list[dict[str, Any]]) -> None:
    """Per step and per CTA (us) of each variant, from the shortest and longest length of
    each head dim, mask and config (the same CTA count: the standard grid's)."""
    from collections import defaultdict

    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        groups[json.dumps([r["head_dim"], r["causal"], r["config"]], sort_keys=True)].append(r)
    print("\nper step / per CTA besides its steps (us), a line through the two lengths")
    for rs in groups.values():
        rs = sorted(rs, key=lambda r: r["seqlen"])
        lo, hi = rs[0], rs[-1]
        if lo is hi or lo["ctas"] != hi["ctas"] or lo["causal"]:
            continue
        waves = lo["ctas"] / 132
        bm = lo["config"]["BLOCK_M"]
        s_lo, s_hi = lo["seqlen"] // bm, hi["seqlen"] // bm
        print(f"-- D{lo['head_dim']} {lo['config']} ({waves:.1f} waves of 132)")
        for name in lo["variants_ms"]:
            if name not in hi["variants_ms"]:
                continue
            t_lo = lo["variants_ms"][name] * 1e3 / waves
            t_hi = hi["variants_ms"][name] * 1e3 / waves
            step = (t_hi - t_lo) / (s_hi - s_lo)
            print(f"   {name:22s} {step:6.3f} us a step, {t_lo - s_lo * step:6.2f} us a CTA")
        for name in ("cudnn",):
            t_lo = lo["anchors_ms"][name] * 1e3 / waves
            t_hi = hi["anchors_ms"][name] * 1e3 / waves
            step = (t_hi - t_lo) / (s_hi - s_lo)
            print(f"   {'(cuDNN, same waves)':22s} {step:6.3f} us a step, "
                  f"{t_lo - s_lo * step:6.2f} us a CTA")


if __name__ == "__main__":
    sys.exit(main())
