"""Score modifications and packed batches (issue 29): flashtune against FlexAttention with the
same mask / score_mod, and SDPA given the materialised mask, one run; SDPA flash and cuDNN
on the plain causal problem of the same shape as anchors.

    python benchmarks/bench_mods.py [--cases swa,gemma2,packed] [--rounds 5]
        [--out benchmarks/results/mods_h100.json]

Cases (bf16):

* ``swa``: sliding window 4096 (``window=(4095, 0)``, causal), B1 Hq32 Hkv8 N16384 D128,
  forward;
* ``gemma2``: softcap 50 with window 4096, B1 Hq16 Hkv8 N16384 D256, causal, forward
  (SDPA cannot apply a softcap: it is timed with the mask alone, a lower bound of its cost);
* ``swa_train``: Mistral-7B-like sliding window 4096, B2 Hq32 Hkv8 N8192 D128, causal,
  forward + backward through autograd; beside flashtune's routed step, its two training
  pairs that serve a window with their default configs, as ``TrainStep`` runs them
  (``pair_gluon``: the Gluon forward and backward; ``pair_gluon_attn_bwd``: the Gluon
  forward with attn_bwd), and the anchors' dense causal steps;
* ``packed``: documents of random lengths 128-4096 (seed 0) packed into 16384 tokens,
  Hq32 Hkv8 D128, causal inside each document, forward + backward
  (``flashtune.attention_varlen`` against FlexAttention with a document block mask;
  with ``--njt`` also torch SDPA over nested jagged tensors, the varlen entry torch has,
  under each of its cuDNN, flash and efficient backends, K/V heads expanded to the query
  heads since that path takes no GQA: ``sdpa_njt_*``).

Every contender is checked against a float32 reference (first KV head's group of query
heads; per document for ``packed``) before it is timed; one that fails or raises is
reported with its error and not timed. Timing: ``flashtune.autotune.timing.bench`` (cold
L2), the contenders in rotation for ``--rounds`` rounds, median of the round medians.
Prints a table last; writes JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import flashtune  # noqa: E402
from flashtune.autotune.timing import bench, tflops  # noqa: E402
from flashtune.core.device import cuda_device  # noqa: E402
from flashtune.core.problem import AttentionProblem, visible_pairs  # noqa: E402
from flashtune.kernel_templates.attn_fwd.reference import attn_fwd_reference  # noqa: E402

DT = torch.bfloat16
TOL = 2e-2  # relative Frobenius error, bf16 (the tuner's tolerance)


def _rel(got, ref):
    got = got.float()
    if not torch.isfinite(got).all():
        return float("nan")
    return ((got - ref).norm() / ref.norm()).item()


def _flex(score_mod=None, mask_mod=None, n=None, train=False):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    block = create_block_mask(mask_mod, None, None, n, n, device="cuda") if mask_mod else None
    fn = torch.compile(flex_attention, dynamic=False)

    def run(q, k, v):
        return fn(q, k, v, score_mod=score_mod, block_mask=block, enable_gqa=True)
    return run


def _step(fwd, q, k, v, do):
    """A forward + backward step of ``fwd`` (grads of q, k, v)."""
    def run():
        out = fwd(q, k, v)
        return (out.detach(), *torch.autograd.grad(out, (q, k, v), do))
    return run


def _pair_steps(problem, q, k, v, do, left, softcap):
    """The training pairs that serve a causal window (and a softcap), each with its
    default config as ``TrainStep`` runs it (``(out, dq, dk, dv)``): the Gluon forward with
    the Gluon backward, and with attn_bwd."""
    from flashtune.kernel_templates import implementations

    dev = cuda_device()
    pairs = {s.name: s for s in implementations("train")}
    mods = {"window": (left, 0), "softcap": softcap}
    steps = {}
    for label, name in (("pair_gluon", "attn_fwd_gluon_bwd_gluon"),
                        ("pair_gluon_attn_bwd", "attn_fwd_gluon")):
        spec = pairs[name]
        if spec.refuse(problem, dev, return_lse=True) is None:
            config = spec.default_config(problem, dev)
            steps[label] = (lambda s, c: lambda: s.launcher(q, k, v, do, c, causal=True,
                                                              **mods))(spec, config)
    return steps


def _no_grad(fwd, q, k, v):
    with torch.no_grad():
        return fwd(q, k, v)


def case_window(name, b, hq, hkv, n, d, left, softcap, rounds, train=False):
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, hq, n, d, device="cuda", dtype=DT, generator=g)
    k = torch.randn(b, hkv, n, d, device="cuda", dtype=DT, generator=g)
    v = torch.randn(b, hkv, n, d, device="cuda", dtype=DT, generator=g)
    problem = AttentionProblem(b, hq, hkv, n, n, d, True, "bf16", left, -1, softcap or 0.0)
    flops = problem.flops() + (problem.flops(backward=True) if train else 0)
    group = hq // hkv
    do = torch.randn(b, hq, n, d, device="cuda", dtype=DT, generator=g) if train else None
    leaves = [t[:1, :s].float().requires_grad_(train)
              for t, s in ((q, group), (k, 1), (v, 1))]
    with torch.set_grad_enabled(train):
        ref, _ = attn_fwd_reference(*leaves, causal=True, dtype=torch.float32,
                                    window=(left, 0), softcap=softcap)
    refs = (ref.detach(), *torch.autograd.grad(ref, leaves, do[:1, :group].float())) \
        if train else (ref,)
    if train:
        q, k, v = (t.requires_grad_(True) for t in (q, k, v))

    def mask_mod(b_, h, qi, ki):
        return (ki <= qi) & (qi - ki <= left)

    def score_mod(s, b_, h, qi, ki):
        return softcap * torch.tanh(s / softcap)

    dense = visible(n, left).to("cuda")

    def sdpa_masked(q_, k_, v_):  # SDPA's masked kernel (memory-efficient) takes no GQA
        k_full, v_full = (t.repeat_interleave(group, 1) for t in (k_, v_))
        return F.scaled_dot_product_attention(q_, k_full, v_full, attn_mask=dense)

    forwards = {
        "flashtune": lambda q_, k_, v_: flashtune.attention(q_, k_, v_, causal=True,
                                                            window=(left, 0), softcap=softcap),
        "flex": _flex(score_mod if softcap else None, mask_mod, n),
        "sdpa_masked": sdpa_masked,
    }
    forwards.update({f"sdpa_{be}_causal": (lambda be_: lambda q_, k_, v_: _sdpa_plain(
        be_, q_, k_, v_))(backend) for be, backend in (("flash", SDPBackend.FLASH_ATTENTION),
                                                     ("cudnn", SDPBackend.CUDNN_ATTENTION))})
    if train:
        fns = {c: _step(f, q, k, v, do) for c, f in forwards.items()}
        fns.update(_pair_steps(problem, q, k, v, do, left, softcap))
    else:
        fns = {c: (lambda f: lambda: f(q, k, v))(f) for c, f in forwards.items()}
    checks = {"sdpa_masked": softcap is None}  # SDPA has no softcap: not comparable
    row = {"case": name, "problem": problem.key(), "label": problem.describe(),
           "flops": flops, "dense_causal_flops": _dense_flops(b, hq, hkv, n, d, train),
           "train": train, "errors": {}, "ms": {}}
    runnable = {}
    for cname, fn in fns.items():
        try:
            out = fn()
            if cname.endswith("_causal"):
                runnable[cname] = fn  # the plain problem's anchors: checked elsewhere
                continue
            got = out if train else (out,)  # (out, dq, dk, dv) of a step
            errs = [_rel(t[:1, :s], r) for t, s, r in zip(got, (group, group, 1, 1), refs)]
            err = float("nan") if any(e != e for e in errs) else max(errs)
            row["errors"][cname] = err
            if checks.get(cname, True) and not err < TOL:
                row["ms"][cname] = f"wrong result: relative error {err:.2e}"
                continue
            runnable[cname] = fn
        except Exception as exc:  # noqa: BLE001 - a contender that cannot run is data
            row["ms"][cname] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    _time(runnable, row, rounds)
    row["tflops"] = {c: tflops(flops, ms) for c, ms in row["ms"].items()
                     if isinstance(ms, float) and not c.endswith("_causal")}
    row["tflops"].update({c: tflops(row["dense_causal_flops"], ms)
                          for c, ms in row["ms"].items()
                          if isinstance(ms, float) and c.endswith("_causal")})
    return row


def _dense_flops(b, hq, hkv, n, d, train):
    """The dense causal problem's FLOPs (the anchors'), with the backward's for a step."""
    plain = AttentionProblem(b, hq, hkv, n, n, d, True, "bf16")
    return plain.flops() + (plain.flops(backward=True) if train else 0)


def visible(n, left):
    i = torch.arange(n)
    return (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] <= left)


def _sdpa_plain(backend, q, k, v):
    with sdpa_kernel(backend):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def case_packed(rounds, hq=32, hkv=8, d=128, total=16384, njt=False):
    gen = torch.Generator().manual_seed(0)
    lens = []
    while sum(lens) < total:
        lens.append(int(torch.randint(128, 4097, (1,), generator=gen)))
    lens[-1] -= sum(lens) - total
    if lens[-1] < 1:
        lens.pop()
        lens[-1] += total - sum(lens)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32,
                      device="cuda")
    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(total, hq, d, device="cuda", dtype=DT, generator=g, requires_grad=True)
    k = torch.randn(total, hkv, d, device="cuda", dtype=DT, generator=g, requires_grad=True)
    v = torch.randn(total, hkv, d, device="cuda", dtype=DT, generator=g, requires_grad=True)
    do = torch.randn(total, hq, d, device="cuda", dtype=DT, generator=g)
    longest = max(lens)
    pairs = sum(visible_pairs(n, n, -1, 0) for n in lens)
    flops = 4.0 * hq * pairs * d * 3.5  # forward + backward (2.5x), ANCHORS.md

    def ours(q_, k_, v_):
        return flashtune.attention_varlen(q_, k_, v_, cu, cu, longest, longest, causal=True)

    doc = torch.repeat_interleave(torch.arange(len(lens), device="cuda"),
                                  torch.tensor(lens, device="cuda"))

    def doc_mask(b_, h, qi, ki):
        return (doc[qi] == doc[ki]) & (ki <= qi)

    flex = _flex(None, doc_mask, total)

    def theirs(q_, k_, v_):  # (total, H, D) -> (1, H, total, D) views
        out = flex(*(t.transpose(0, 1)[None] for t in (q_, k_, v_)))
        return out[0].transpose(0, 1)

    offsets = cu.long()

    def njt_sdpa(backend):
        """SDPA over nested jagged tensors (torch's varlen entry: ``(B, j, H, D)`` viewed as
        ``(B, H, j, D)``, offsets from ``cu``), K/V heads expanded to the query heads (its
        jagged path takes no GQA), under one backend."""
        def run(q_, k_, v_):
            k_, v_ = (t.repeat_interleave(hq // hkv, 1) for t in (k_, v_))
            nq, nk, nv = (torch.nested.nested_tensor_from_jagged(t, offsets).transpose(1, 2)
                          for t in (q_, k_, v_))
            with sdpa_kernel(backend):
                out = F.scaled_dot_product_attention(nq, nk, nv, is_causal=True)
            return out.transpose(1, 2).values()
        return run

    row = {"case": "packed", "label": f"{len(lens)} documents, {total} tokens, Hq{hq} "
           f"Hkv{hkv} D{d} causal, fwd+bwd", "lengths": lens, "flops": flops,
           "errors": {}, "ms": {}}
    # check: the first two documents, head group 0, against fp32 autograd
    refs = []
    for i in range(2):
        s = slice(int(cu[i]), int(cu[i + 1]))
        leaves = [t.detach()[s].transpose(0, 1)[None].float().requires_grad_(True)
                  for t in (q, k, v)]
        leaves = [leaves[0][:, :hq // hkv], leaves[1][:, :1], leaves[2][:, :1]]
        leaves = [t.detach().requires_grad_(True) for t in leaves]
        out, _ = attn_fwd_reference(*leaves, causal=True, dtype=torch.float32)
        dref = do[s].transpose(0, 1)[None][:, :hq // hkv].float()
        refs.append((s, out.detach(), torch.autograd.grad(out, leaves, dref)))
    runnable = {}
    contenders = [("flashtune", ours), ("flex", theirs)]
    if njt:
        contenders += [(f"sdpa_njt_{name}", njt_sdpa(backend)) for name, backend in
                       (("cudnn", SDPBackend.CUDNN_ATTENTION),
                        ("flash", SDPBackend.FLASH_ATTENTION),
                        ("efficient", SDPBackend.EFFICIENT_ATTENTION))]
    for cname, fwd in contenders:
        try:
            out = fwd(q, k, v)
            grads = torch.autograd.grad(out, (q, k, v), do)
            errs = []
            for s, ref_out, ref_grads in refs:
                errs.append(_rel(out.detach()[s].transpose(0, 1)[None][:, :hq // hkv],
                                 ref_out))
                for got, want, heads in zip(grads, ref_grads, (hq // hkv, 1, 1)):
                    errs.append(_rel(got[s].transpose(0, 1)[None][:, :heads], want))
            err = max(errs)
            row["errors"][cname] = err
            if not err < TOL:
                row["ms"][cname] = f"wrong result: relative error {err:.2e}"
                continue
            runnable[cname] = _step(fwd, q, k, v, do)
            runnable[cname + "_fwd"] = (lambda f: lambda: _no_grad(f, q, k, v))(fwd)
        except Exception as exc:  # noqa: BLE001
            row["ms"][cname] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    # anchors: the dense causal step of the same token count in one row (B1 N16384)
    qd, kd, vd = (t.detach().transpose(0, 1)[None].contiguous().requires_grad_(True)
                  for t in (q, k, v))
    dod = do.transpose(0, 1)[None].contiguous()
    for aname, backend in (("sdpa_flash_causal", SDPBackend.FLASH_ATTENTION),
                           ("sdpa_cudnn_causal", SDPBackend.CUDNN_ATTENTION)):
        runnable[aname] = _step(lambda a, b, c, be=backend: _sdpa_plain(be, a, b, c),
                                qd, kd, vd, dod)
    row["dense_causal_flops"] = AttentionProblem(1, hq, hkv, total, total, d, True,
                                                 "bf16").flops() * 3.5
    _time(runnable, row, rounds)
    row["tflops"] = {c: tflops(row["dense_causal_flops"] if c.endswith("_causal")
                               else flops / 3.5 if c.endswith("_fwd") else flops, ms)
                     for c, ms in row["ms"].items() if isinstance(ms, float)}
    return row


def _time(fns, row, rounds):
    per = {c: [] for c in fns}
    for _ in range(rounds):
        for c, fn in fns.items():
            per[c].append(bench(fn).median_ms)
    for c, ms in per.items():
        row["ms"][c] = statistics.median(ms)
    row["rounds"] = {c: ms for c, ms in per.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--cases", default="swa,gemma2,packed")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--njt", action="store_true",
                    help="packed: also SDPA over nested jagged tensors under its cuDNN, "
                         "flash and efficient backends (K/V heads expanded)")
    ap.add_argument("--out", default="benchmarks/results/mods_h100.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_mods needs a CUDA GPU")
    dev = cuda_device()
    rows = []
    for name in args.cases.split(","):
        t0 = time.time()
        if name == "swa":
            rows.append(case_window("swa", 1, 32, 8, 16384, 128, 4095, None, args.rounds))
        elif name == "gemma2":
            rows.append(case_window("gemma2", 1, 16, 8, 16384, 256, 4095, 50.0, args.rounds))
        elif name == "swa_train":
            rows.append(case_window("swa_train", 2, 32, 8, 8192, 128, 4095, None, args.rounds,
                                    train=True))
        elif name == "packed":
            rows.append(case_packed(args.rounds, njt=args.njt))
        else:
            raise SystemExit(f"unknown case {name!r}")
        print(f"{name}: {time.time() - t0:.0f} s", flush=True)
    from flashtune.runtime import scored

    # what ran: the routes flashtune memoised for these calls (implementation and configs)
    routes = [{"key": [str(x) for x in key], "template": spec.name, "config": fcfg,
               "bwd_template": None if bwd is None else bwd.name, "bwd_config": bcfg}
              for key, (spec, fcfg, bwd, bcfg) in scored._ROUTES.items()]
    out = {"device": dev.name, "torch": torch.__version__,
           "triton": __import__("triton").__version__, "host": platform.node(),
           "date": time.strftime("%Y-%m-%d %H:%M:%S"), "rows": rows, "routes": routes}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2, default=str))
    print(f"\n{dev.name}, bf16, median of {args.rounds} rounds; TFLOP/s of the visible pairs "
          f"(anchors: the dense causal problem's)")
    print("| case | flashtune | flex | sdpa masked | SDPA flash causal | cuDNN causal | "
          "flashtune / flex | flashtune / sdpa masked (time) |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        ms, tf = row["ms"], row.get("tflops", {})

        def cell(c):
            return f"{tf[c]:.0f}" if c in tf else str(ms.get(c, "-"))[:40]

        def ratio(a, b):
            return (f"{ms[b] / ms[a]:.2f}x" if isinstance(ms.get(a), float)
                    and isinstance(ms.get(b), float) else "-")
        print(f"| {row['label']} | {cell('flashtune')} | {cell('flex')} | "
              f"{cell('sdpa_masked')} | {cell('sdpa_flash_causal')} | "
              f"{cell('sdpa_cudnn_causal')} | {ratio('flashtune', 'flex')} | "
              f"{ratio('flashtune', 'sdpa_masked')} | {cell('flashtune_fwd')} / "
              f"{cell('flex_fwd')} |")
        if row.get("train") and "pair_gluon" in ms:  # the pairs, default configs
            print(f"  training pairs (default configs): Gluon forward + Gluon backward "
                  f"{cell('pair_gluon')}, Gluon forward + attn_bwd "
                  f"{cell('pair_gluon_attn_bwd')} ({ratio('pair_gluon', 'pair_gluon_attn_bwd')}"
                  f"); flashtune / cuDNN causal {ratio('flashtune', 'sdpa_cudnn_causal')} "
                  f"(time, the dense problem's)")
        njt = [c for c in ms if c.startswith("sdpa_njt_")]
        if njt:
            steps = [ms[c] for c in njt if isinstance(ms[c], float) and not c.endswith("_fwd")]
            best = (f" (flashtune / best step: {min(steps) / ms['flashtune']:.2f}x)"
                    if steps and isinstance(ms.get("flashtune"), float) else "")
            print("  SDPA over nested tensors (step / forward): "
                  + "; ".join(f"{c[9:]} {cell(c)}" for c in njt) + best)


if __name__ == "__main__":
    main()
