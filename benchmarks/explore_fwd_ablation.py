"""Where the Gluon forward spends a short causal tile's time: its kernel timed with parts of
its work switched off (issues 23 and 24: the causal forward at N 512-1k runs 0.83-0.89x
cuDNN's on an H200, the rest of the grid 0.98-1.00x).

    python benchmarks/explore_fwd_ablation.py [--head-dims 64,128] [--seqlens 512,1024,4096]
        [--causal yes|no|both] [--rounds 5] [--out benchmarks/results/fwd_ablation_h200.json]

As ``explore_bwd_ablation.py`` does for the backward: a variant is
``attn_fwd_gluon/kernel.py``'s text with some of :data:`PATCHES` applied, in a throwaway
module (the library's kernel is unchanged), each patch matching its text as often as it
says:

* ``no_o_store``: O is not written (the TMA store dropped; the register stores under a
  mask false at run time);
* ``no_lse_store``: the LSE under such a mask;
* ``no_mask``: no block takes the masked branch (the causal diagonal and the keys' end
  unmasked: wrong numbers, the masking's cost).

Shapes are the standard grid's (16384 tokens, 2048 / D heads, bf16); each runs the config
the runtime's lookup gives it (the training step's forward). The base variant's output is
checked against the library launcher's first (the same kernel).

``--variant NAME=[PATH]|JSON`` (repeatable) adds a contender beside the patched ones: the
kernel file ``PATH`` (same parameters; a candidate change; empty: the library's kernel)
launched with the lookup's config updated by ``JSON`` (an object of knobs, or one per head
dim: ``{"64": {...}, "128": {...}}``), e.g. a config's persistent twin. Its O and LSE are
checked against the library launcher's (lookup config) before it is timed; a variant that
does not compile or fails the check is reported and left out of that shape's timing. Variants are compiled in a
process pool, then timed interleaved, ``--rounds`` rounds of CUDA-event timing, the median
kept; SDPA cuDNN's and flash's forward kernels are profiled on the same inputs as anchors.
Without a CUDA GPU it prints "needs a CUDA GPU" and exits 0.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from explore_bwd_ablation import (  # noqa: E402
    OFF,
    _kernel,
    add_run_args,
    compile_all,
    time_variants,
    write_doc,
    write_modules,
)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
KERNEL = ROOT / "flashtune" / "kernel_templates" / "attn_fwd_gluon" / "kernel.py"
TOKENS, HIDDEN = 16384, 2048
DT = torch.bfloat16
PREFIX, ATTR = "fwd_ablation", "gluon_attn_fwd_kernel"

PATCHES: dict[str, list[tuple[Any, ...]]] = {
    "no_o_store": [
        ("            tma.async_copy_shared_to_global(o_desc, [o_row, o_col], q)\n", ""),
        ("gl.store(o_ptr + offs, out.to(dtype), mask=gl.expand_dims(rows_o < seqlen_q, 1))",
         f"gl.store(o_ptr + offs, out.to(dtype), mask=gl.expand_dims(rows_o < seqlen_q - {OFF}, "
         "1))", 2)],
    "no_lse_store": [("lse, mask=rows_s < seqlen_q)",
                      f"lse, mask=rows_s < seqlen_q - {OFF})")],
    "no_mask": [("    if need_mask:\n        cols = start_n",
                 "    if need_mask & (seqlen_k < 0):\n        cols = start_n")],
}
VARIANTS: dict[str, tuple[str, ...]] = {
    "base": (),
    "no_o_store": ("no_o_store",),
    "no_lse_store": ("no_lse_store",),
    "no_epilogue": ("no_o_store", "no_lse_store"),
    "no_mask": ("no_mask",),
}


def _args(q: Any, out: Any, lse: Any, config: dict[str, int], causal: bool) -> Any:
    from flashtune.kernel_templates.attn_fwd_gluon.launcher import kernel_args

    return kernel_args(q, q, q, out, lse, config, causal=causal,
                       scale=1.0 / math.sqrt(q.shape[3]))


def parse_variant(text: str) -> tuple[str, str, dict[str, Any]]:
    """``NAME=[PATH]|JSON`` -> ``(name, path or "", updates)`` (``ValueError`` naming the
    part that is wrong)."""
    name, sep, rest = text.partition("=")
    path, bar, updates = rest.partition("|")
    if not sep or not bar or not name.isidentifier():
        raise ValueError(f"--variant {text!r}: expected NAME=[PATH]|JSON")
    found = json.loads(updates or "{}")
    if not isinstance(found, dict):
        raise ValueError(f"--variant {name}: JSON must be an object")
    return name, path, found


def variant_config(config: dict[str, int], updates: dict[str, Any],
                   head_dim: int) -> dict[str, int]:
    """The lookup's ``config`` with a variant's ``updates`` (or its head dim's, when keyed
    by head dim) applied."""
    if updates and all(k.isdigit() for k in updates):
        updates = updates.get(str(head_dim), {})
    return {**config, **{k: int(v) for k, v in updates.items()}}


def _compile(where: str, name: str, shape: tuple[int, int, int, int], causal: bool,
             config: dict[str, int]) -> str | None:
    """Worker: compile variant ``name`` for ``shape`` (shape-only stand-ins)."""
    try:
        from flashtune.kernel_templates.shaped import Shaped

        q = Shaped(DT, shape)
        args, kwargs, grid = _args(q, q, Shaped(torch.float32, shape[:3]), config, causal)
        _kernel(where, name, PREFIX, ATTR).warmup(*args, grid=grid, **kwargs)
        return None
    except Exception as exc:  # noqa: BLE001 - reported, the variant skipped
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]


def _anchors(q: Any, k: Any, v: Any, causal: bool) -> dict[str, float]:
    """Device ms of SDPA cuDNN's and flash's forward kernels (the largest of each call)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.profiler import ProfilerActivity, profile

    found: dict[str, float] = {}
    for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION),
                          ("flash", SDPBackend.FLASH_ATTENTION)):
        def call() -> None:
            with sdpa_kernel(backend), torch.no_grad():
                torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

        for _ in range(3):
            call()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                call()
            torch.cuda.synchronize()
        times = [ev.self_device_time_total / 1e3 / 20 for ev in prof.key_averages()
                 if ev.self_device_time_total > 0]
        found[name] = max(times) if times else float("nan")
    return found


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_run_args(ap, "64,128", "512,1024,4096", "yes")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help="the patched variants to time, comma-separated (base first)")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=[PATH]|JSON",
                    help="another kernel file and/or config updates, timed beside them")
    args = ap.parse_args(argv)
    extra = [parse_variant(v) for v in args.variant]
    patched = {n: VARIANTS[n] for n in args.variants.split(",")}
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 0
    from flashtune.autotune.precompile import share_cache_dir
    from flashtune.core.device import cuda_device
    from flashtune.core.problem import AttentionProblem
    from flashtune.kernel_templates import get_template
    from flashtune.runtime.lookup import Dispatcher

    device = cuda_device()
    fwd = get_template("attn_fwd_gluon")
    causals = {"no": (False,), "yes": (True,), "both": (False, True)}[args.causal]
    share_cache_dir()  # set before the pool starts: its workers compile into it
    where = tempfile.mkdtemp(prefix=PREFIX + "_")
    write_modules(Path(where), PREFIX, KERNEL, PATCHES, patched,
                  {n: Path(path) if path else KERNEL for n, path, _ in extra})
    cases = []
    for d in map(int, args.head_dims.split(",")):
        for causal in causals:
            for n in map(int, args.seqlens.split(",")):
                p = AttentionProblem(TOKENS // n, HIDDEN // d, HIDDEN // d, n, n, d, causal,
                                     "bf16")
                cases.append((p, dict(Dispatcher(fwd).choose(p, device).config)))
    jobs = [(where, name, (p.batch, p.heads_q, p.seqlen_q, p.head_dim), p.causal, cfg)
            for p, cfg in cases for name in patched]
    jobs += [(where, name, (p.batch, p.heads_q, p.seqlen_q, p.head_dim), p.causal,
              variant_config(cfg, updates, p.head_dim))
             for p, cfg in cases for name, _, updates in extra]
    failed = dict(zip(((j[1], j[2], j[3]) for j in jobs), compile_all(_compile, jobs, args.jobs)))
    rows = []
    for p, config in cases:
        g = torch.Generator(device="cuda").manual_seed(p.seqlen_q * p.head_dim + p.causal)
        q, k, v = (torch.randn(p.batch, p.heads_q, p.seqlen_q, p.head_dim, device="cuda",
                               dtype=DT, generator=g) for _ in range(3))
        ref, ref_lse = fwd.launcher(q, k, v, config, causal=p.causal, return_lse=True)
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:3], device="cuda", dtype=torch.float32)
        from flashtune.kernel_templates.attn_fwd_gluon.launcher import kernel_args

        a, kw, grid = kernel_args(q, k, v, out, lse, config, causal=p.causal,
                                  scale=1.0 / math.sqrt(p.head_dim))
        mains = {name: (_kernel(where, name, PREFIX, ATTR), a, kw, grid) for name in patched}
        base = mains["base"]
        base[0][base[3]](*base[1], **base[2])
        same = ((out.float() - ref.float()).abs().max().item() < 1e-2)
        shape = (p.batch, p.heads_q, p.seqlen_q, p.head_dim)
        checks: dict[str, Any] = {}
        for name, _, updates in extra:
            vcfg = variant_config(config, updates, p.head_dim)
            if failed[(name, shape, p.causal)]:
                checks[name] = {"config": vcfg, "error": "does not compile"}
                continue
            v_out, v_lse = torch.full_like(q, float("nan")), torch.full_like(lse, float("nan"))
            va, vkw, vgrid = kernel_args(q, k, v, v_out, v_lse, vcfg, causal=p.causal,
                                         scale=1.0 / math.sqrt(p.head_dim))
            launch = (_kernel(where, name, PREFIX, ATTR), va, vkw, vgrid)
            launch[0][vgrid](*va, **vkw)
            torch.cuda.synchronize()
            same_inf = torch.isinf(ref_lse) & (v_lse == ref_lse)  # rows that see no key
            err = max((v_out.float() - ref.float()).abs().max().item(),
                      torch.where(same_inf, 0.0, v_lse - ref_lse).abs().max().item())
            checks[name] = {"config": vcfg, "grid": list(vgrid), "max_error": err}
            if err < 1e-2:
                mains[name] = launch
            else:
                print(f"   {name}: max error {err:.3g} against the launcher: not timed")
        times = time_variants(mains, args.rounds, args.reps)
        anchors = _anchors(q, k, v, p.causal)
        row = {"shape": f"B{p.batch} H{p.heads_q} N{p.seqlen_q} D{p.head_dim}"
                        f"{' causal' if p.causal else ''}",
               "batch": p.batch, "heads": p.heads_q, "seqlen": p.seqlen_q,
               "head_dim": p.head_dim, "causal": p.causal, "config": config,
               "grid": list(grid), "base_matches_launcher": same, "variants": checks,
               "anchors_ms": anchors,
               "variants_ms": {n: statistics.median(t) for n, t in times.items()},
               "rounds_ms": times}
        rows.append(row)
        print(f"== {row['shape']} {config} grid {grid} base==launcher {same}; cuDNN "
              f"{anchors['cudnn'] * 1e3:.1f} us, flash {anchors['flash'] * 1e3:.1f} us",
              flush=True)
        for n, ms in row["variants_ms"].items():
            print(f"   {n:14s} {ms * 1e3:8.1f} us  {ms / row['variants_ms']['base']:.3f}x base  "
                  f"{anchors['cudnn'] / ms:.3f}x cuDNN")
        del q, k, v, out, lse, ref, ref_lse
        torch.cuda.empty_cache()
    write_doc(args.out, "fwd_ablation", args, PATCHES,
              {**patched, **{n: {"kernel": path or "library", "updates": u}
                             for n, path, u in extra}}, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
