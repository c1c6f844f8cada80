"""The backward of a packed training batch: attn_bwd (the Triton varlen backward the runtime
runs today) against attn_bwd_gluon's VARLEN kernel and FlexAttention's backward with a
document causal block mask; SDPA flash and cuDNN on the dense causal problem of the same
token count (B1, N = tokens) as anchors. One run, side by side.

    python benchmarks/bench_packed_bwd.py [--tokens 16384] [--heads 32] [--kv-heads 8]
        [--head-dim 128] [--no-causal] [--window W] [--seed 0] [--rounds 5]
        [--configs '[{"BLOCK_M": 64, "BLOCK_N": 128, "NUM_STAGES": 2, "NUM_CONSUMERS": 2}]']
        [--out benchmarks/results/packed_bwd_h200.json]

The batch: documents of random lengths 128-4096 (``--seed``, as bench_mods.py's ``packed``
case draws them) packed into ``--tokens`` tokens, bf16, causal inside each document; with
``--window W`` each query sees only the ``W`` keys before it (FlashAttention-2's
``window_size = (W, 0)``, each document's own positions; Flex's mask likewise).
Out and LSE ``(Hq, total)`` come from attn_fwd's varlen forward (the runtime's config), so
every backward reads the same inputs.

Contenders, backward alone (``*_bwd``) and the training step (``*_step``: attn_fwd's varlen
forward saving the LSE, then the backward; Flex's and SDPA's forward + backward through
autograd):

* ``tl``: attn_bwd with the config the runtime's lookup chain gives the packed problem
  (``tl_default`` too, its template default, where that differs);
* ``gluon``: attn_bwd_gluon with its default config for the problem (``gluon_routed``: the
  lookup chain's config where it differs; ``gluon_cfgN``: each of ``--configs``); sm_90 only;
* ``flex``: ``flex_attention`` compiled, a document causal block mask, ``enable_gqa``;
* ``sdpa_flash_dense``, ``sdpa_cudnn_dense``: the dense causal problem ``(1, H, tokens,
  D)``, GQA through ``enable_gqa``.

Every contender is checked before it is timed: the packed ones' gradients (and Flex's
output) on the first two documents, KV head 0 and its query heads, against fp32 autograd
through plain attention; the dense anchors' output and dQ of the first 1024 rows (causal:
they see only those keys) likewise. A wrong or failing contender is reported, not timed.
Timing: ``flashtune.autotune.timing.bench`` (CUDA events, L2 flushed before every run), the
contenders in rotation for ``--rounds`` rounds, median of the round medians.

FLOPs (ANCHORS.md): forward ``4 Hq D`` per visible (query, key) pair (``n (n + 1) / 2`` per
causal document; the dense anchors ``N^2 / 2``), backward 2.5x, the step 3.5x. Ratios are of
TFLOP/s: to Flex's (the same work) and to cuDNN's dense causal backward / step.

Without a CUDA GPU it prints "needs a CUDA GPU" and exits 0.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TOL = 2e-2  # relative Frobenius error, bf16 (the tuner's tolerance)
DT = torch.bfloat16


def document_lengths(tokens: int, seed: int, lo: int = 128, hi: int = 4096) -> list[int]:
    """Random lengths in ``[lo, hi]`` summing to ``tokens`` (the last one cut to fit, or
    merged into the one before when the cut leaves nothing)."""
    gen = torch.Generator().manual_seed(seed)
    lens: list[int] = []
    while sum(lens) < tokens:
        lens.append(int(torch.randint(lo, hi + 1, (1,), generator=gen)))
    lens[-1] -= sum(lens) - tokens
    if lens[-1] < 1:
        lens.pop()
        lens[-1] += tokens - sum(lens)
    return lens


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    got = got.float()
    if not torch.isfinite(got).all():
        return float("nan")
    return ((got - ref).norm() / ref.norm()).item()


def _reference(q, k, v, do, causal, window=(-1, -1)):
    """fp32 ``(out, (dq, dk, dv))`` of plain (or windowed) attention on ``(1, H, N, D)``
    tensors."""
    from flashtune.kernel_templates.attn_fwd.reference import attn_fwd_reference

    leaves = [t.detach().float().requires_grad_(True) for t in (q, k, v)]
    with torch.enable_grad():
        out, _ = attn_fwd_reference(*leaves, causal=causal, dtype=torch.float32,
                                    window=window)
        grads = torch.autograd.grad(out, leaves, do.float())
    return out.detach(), grads


class Packed:
    """The batch, its forward, the fp32 references of its first two documents."""

    def __init__(self, args: argparse.Namespace) -> None:
        from flashtune.core.device import cuda_device
        from flashtune.core.problem import AttentionProblem
        from flashtune.kernel_templates import get_template
        from flashtune.runtime.lookup import Dispatcher

        self.lens = document_lengths(args.tokens, args.seed)
        self.hq, self.hkv, self.d, self.causal = args.heads, args.kv_heads, args.head_dim, \
            args.causal
        self.left = args.window
        if self.left >= 0 and not self.causal:
            raise SystemExit("--window is a causal sliding window: drop --no-causal")
        # the launchers' keywords (none without a window: the calls as they were)
        self.mods = {"window": (self.left, 0)} if self.left >= 0 else {}
        t, self.group = args.tokens, args.heads // args.kv_heads
        self.cu = torch.tensor([0, *torch.tensor(self.lens).cumsum(0).tolist()],
                               dtype=torch.int32, device="cuda")
        self.longest = max(self.lens)
        g = torch.Generator(device="cuda").manual_seed(args.seed + 1)
        self.q = torch.randn(t, self.hq, self.d, device="cuda", dtype=DT, generator=g)
        self.k = torch.randn(t, self.hkv, self.d, device="cuda", dtype=DT, generator=g)
        self.v = torch.randn(t, self.hkv, self.d, device="cuda", dtype=DT, generator=g)
        self.do = torch.randn(t, self.hq, self.d, device="cuda", dtype=DT, generator=g)
        self.problem = AttentionProblem.from_lengths(
            self.lens, None, heads_q=self.hq, heads_kv=self.hkv, head_dim=self.d,
            causal=self.causal, dtype="bf16", window_left=self.left)
        device = cuda_device()
        self.fwd_spec = get_template("attn_fwd")
        self.fwd_choice = Dispatcher(self.fwd_spec).choose(self.problem, device)
        self.out, self.lse = self.forward()
        pairs = sum(_visible(n, self.causal, self.left) for n in self.lens)
        self.fwd_flops = 4.0 * self.hq * self.d * pairs
        self.refs = []
        for i in range(2):
            s = slice(int(self.cu[i]), int(self.cu[i + 1]))
            seq = [x[s].transpose(0, 1)[None] for x in (self.q, self.k, self.v, self.do)]
            seq = [seq[0][:, :self.group], seq[1][:, :1], seq[2][:, :1], seq[3][:, :self.group]]
            self.refs.append((s, *_reference(*seq, self.causal,
                                             self.mods.get("window", (-1, -1)))))

    def forward(self) -> tuple[torch.Tensor, torch.Tensor]:
        """attn_fwd's varlen forward saving the LSE ``(Hq, total)``."""
        return self.fwd_spec.launcher(self.q, self.k, self.v, self.fwd_choice.config,
                                      causal=self.causal, return_lse=True,
                                      cu_seqlens_q=self.cu, cu_seqlens_k=self.cu,
                                      max_seqlen_q=self.longest, max_seqlen_k=self.longest,
                                      **self.mods)

    def error(self, grads=None, out=None) -> float:
        """The worst relative error of packed ``grads`` and ``out`` (either may be None) on
        the checked documents and heads."""
        errs = []
        for s, ref_out, ref_grads in self.refs:
            if out is not None:
                errs.append(_rel(out[s].transpose(0, 1)[None][:, :self.group], ref_out))
            for got, want, heads in zip(grads or (), ref_grads, (self.group, 1, 1)):
                errs.append(_rel(got[s].transpose(0, 1)[None][:, :heads], want))
        return max(errs)


def _packed_contenders(pk: Packed, args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """``name -> {"bwd": fn, "config": ..., "source": ...}`` of the flashtune backwards."""
    from flashtune.core.device import cuda_device
    from flashtune.kernel_templates import get_template
    from flashtune.runtime.lookup import Dispatcher

    device = cuda_device()
    varlen = dict(cu_seqlens_q=pk.cu, cu_seqlens_k=pk.cu, max_seqlen_q=pk.longest,
                  max_seqlen_k=pk.longest)
    found: dict[str, dict[str, Any]] = {}

    def add(name: str, spec: Any, config: dict[str, int], source: str) -> None:
        if any(c["config"] == config and c["spec"] is spec for c in found.values()):
            return

        def bwd() -> Any:
            return spec.launcher(pk.q, pk.k, pk.v, pk.out, pk.lse, pk.do, config,
                                 causal=pk.causal, **varlen, **pk.mods)
        found[name] = {"bwd": bwd, "config": dict(config), "source": source, "spec": spec}

    tl = get_template("attn_bwd")
    routed = Dispatcher(tl).choose(pk.problem, device)
    add("tl", tl, dict(routed.config), f"lookup: {routed.source}")
    add("tl_default", tl, dict(tl.default_config(pk.problem, device)), "template default")
    gluon = get_template("attn_bwd_gluon")
    if torch.cuda.get_device_capability() != (9, 0):
        print("attn_bwd_gluon runs on sm_90 only: not timed here", flush=True)
        return found
    add("gluon", gluon, dict(gluon.default_config(pk.problem, device)), "template default")
    try:
        routed = Dispatcher(gluon).choose(pk.problem, device)
        add("gluon_routed", gluon, dict(routed.config), f"lookup: {routed.source}")
    except Exception as exc:  # noqa: BLE001  (a lookup that cannot serve a packed problem)
        print(f"gluon lookup: {type(exc).__name__}: {exc}", flush=True)
    for i, config in enumerate(json.loads(args.configs) if args.configs else []):
        add(f"gluon_cfg{i}", gluon, dict(config), "--configs")
    return found


def _flex(pk: Packed):
    """FlexAttention compiled with a document (causal) block mask over ``(1, H, total, D)``
    views of the packed tensors."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    doc = torch.repeat_interleave(torch.arange(len(pk.lens), device="cuda"),
                                  torch.tensor(pk.lens, device="cuda"))
    causal, left = pk.causal, pk.left

    def doc_mask(b, h, qi, ki):
        same = doc[qi] == doc[ki]
        if left >= 0:
            return same & (ki <= qi) & (qi - ki <= left)
        return same & (ki <= qi) if causal else same

    n = len(doc)
    block = create_block_mask(doc_mask, None, None, n, n, device="cuda")
    fn = torch.compile(flex_attention, dynamic=False)

    def run(q, k, v):
        out = fn(*(t.transpose(0, 1)[None] for t in (q, k, v)), block_mask=block,
                 enable_gqa=True)
        return out[0].transpose(0, 1)
    return run


def _dense(backend, q, k, v):
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    with sdpa_kernel(backend):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def _autograd_pair(fwd, q, k, v, do):
    """``(step, bwd)``: forward + backward through autograd, and the backward alone (the
    graph of one forward kept)."""
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]

    def step():
        return torch.autograd.grad(fwd(*leaves), leaves, do)
    out = fwd(*leaves)

    def bwd():
        return torch.autograd.grad(out, leaves, do, retain_graph=True)
    return step, bwd, out, leaves


def build(pk: Packed, args: argparse.Namespace, row: dict[str, Any]) -> dict[str, Any]:
    """The checked contenders to time, ``name -> fn``; errors and refusals into ``row``."""
    from torch.nn.attention import SDPBackend

    fns: dict[str, Any] = {}
    err = pk.error(out=pk.out)  # the forward every flashtune backward reads
    row["errors"]["tl_fwd"] = err
    if not err < TOL:
        raise SystemExit(f"attn_fwd's varlen forward is wrong: relative error {err:.2e}")
    for name, c in _packed_contenders(pk, args).items():
        row["configs"][name] = {"config": c["config"], "source": c["source"]}
        try:
            err = pk.error(c["bwd"]())
        except Exception as exc:  # noqa: BLE001
            row["errors"][name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            continue
        row["errors"][name] = err
        if not err < TOL:
            row["errors"][name] = f"wrong result: relative error {err:.2e}"
            continue
        fns[f"{name}_bwd"] = c["bwd"]

        def step(bwd=c["bwd"]):
            pk.forward()
            return bwd()
        fns[f"{name}_step"] = step
    fns["tl_fwd"] = pk.forward
    try:
        flex = _flex(pk)
        step, bwd, out, _ = _autograd_pair(flex, pk.q, pk.k, pk.v, pk.do)
        err = max(pk.error(bwd(), out.detach()), pk.error(step()))
        row["errors"]["flex"] = err
        if err < TOL:
            fns["flex_bwd"], fns["flex_step"] = bwd, step
            fns["flex_fwd"] = lambda: flex(pk.q, pk.k, pk.v)
            fns["flex_fwd"]()  # compiled here (no grad: a graph of its own), not while timed
        else:
            row["errors"]["flex"] = f"wrong result: relative error {err:.2e}"
    except Exception as exc:  # noqa: BLE001
        row["errors"]["flex"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    # the dense causal anchors: (1, H, tokens, D), checked on the first 1024 rows
    qd, kd, vd, dod = (t.transpose(0, 1)[None].contiguous()
                       for t in (pk.q, pk.k, pk.v, pk.do))
    rows = 1024
    ref_out, ref_grads = _reference(qd[:, :pk.group, :rows], kd[:, :1, :rows],
                                    vd[:, :1, :rows], dod[:, :pk.group, :rows], True)
    expanded = [t.repeat_interleave(pk.group, dim=1) for t in (kd, vd)]
    for name, backend in (("sdpa_flash_dense", SDPBackend.FLASH_ATTENTION),
                          ("sdpa_cudnn_dense", SDPBackend.CUDNN_ATTENTION)):
        try:
            try:
                step, bwd, out, _ = _autograd_pair(
                    lambda a, b, c, be=backend: _dense(be, a, b, c), qd, kd, vd, dod)
            except RuntimeError:  # a backend without GQA: K/V heads expanded
                row["notes"].append(f"{name}: K/V heads expanded (no GQA in the backend)")
                step, bwd, out, _ = _autograd_pair(
                    lambda a, b, c, be=backend: _dense(be, a, b, c), qd, *expanded, dod)
            dq = bwd()[0]
            err = max(_rel(out.detach()[:, :pk.group, :rows], ref_out),
                      _rel(dq[:, :pk.group, :rows], ref_grads[0]))
            row["errors"][name] = err
            if not err < TOL:
                row["errors"][name] = f"wrong result: relative error {err:.2e}"
                continue
            fns[f"{name}_bwd"], fns[f"{name}_step"] = bwd, step
        except Exception as exc:  # noqa: BLE001
            row["errors"][name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    return fns


def _visible(n: int, causal: bool, left: int) -> int:
    """The (query, key) pairs a document of ``n`` tokens computes: all, the causal
    triangle, or within a window of ``left`` keys before each query."""
    if not causal:
        return n * n
    if left < 0 or left >= n - 1:
        return n * (n + 1) // 2
    w = left + 1  # keys a query sees once the window is full
    return w * (w + 1) // 2 + (n - w) * w


def flops_of(name: str, pk: Packed, dense_fwd: float) -> float:
    fwd = dense_fwd if name.startswith("sdpa_") else pk.fwd_flops
    if name.endswith("_bwd"):
        return 2.5 * fwd
    return 3.5 * fwd if name.endswith("_step") else fwd


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--window", type=int, default=-1,
                    help="a causal sliding window of this many keys before each query "
                         "(-1: none)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--configs", default=None,
                    help="JSON list of attn_bwd_gluon configs to time beside its default")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 0
    import triton

    from flashtune.autotune.timing import bench, tflops
    from flashtune.core.problem import AttentionProblem

    t0 = time.time()
    pk = Packed(args)
    row: dict[str, Any] = {
        "torch": torch.__version__, "triton": triton.__version__,
        "device": torch.cuda.get_device_name(), "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "args": {k: v for k, v in vars(args).items() if k != "out"},
        "lengths": pk.lens, "documents": len(pk.lens),
        "fwd_config": {"config": dict(pk.fwd_choice.config), "source": pk.fwd_choice.source},
        "configs": {}, "errors": {}, "notes": []}
    dense_fwd = AttentionProblem(1, args.heads, args.kv_heads, args.tokens, args.tokens,
                                 args.head_dim, True, "bf16").flops()
    row["flops"] = {"fwd": pk.fwd_flops, "dense_causal_fwd": dense_fwd}
    print(f"{len(pk.lens)} documents, {args.tokens} tokens, Hq{args.heads} Hkv{args.kv_heads} "
          f"D{args.head_dim}{' causal' if args.causal else ''}"
          f"{f' window {args.window}' if args.window >= 0 else ''}: {pk.lens}", flush=True)
    fns = build(pk, args, row)
    print(f"built and checked in {time.time() - t0:.0f} s", flush=True)
    per: dict[str, list[float]] = {c: [] for c in fns}
    for _ in range(args.rounds):
        for c, fn in fns.items():
            if c in row["errors"] and isinstance(row["errors"][c], str):
                continue
            try:
                per[c].append(bench(fn).median_ms)
            except Exception as exc:  # noqa: BLE001  (reported, the others still timed)
                row["errors"][c] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    ms = {c: statistics.median(v) for c, v in per.items() if v}
    tf = {c: tflops(flops_of(c, pk, dense_fwd), m) for c, m in ms.items()}
    row.update(rounds_ms=per, ms=ms, tflops=tf)

    def ratio(a: str, b: str) -> float | None:
        return tf[a] / tf[b] if a in tf and b in tf else None
    row["vs_flex"] = {c: ratio(c, "flex" + c[c.rindex("_"):]) for c in tf
                      if not c.startswith(("flex", "sdpa"))}
    row["vs_cudnn_dense"] = {c: ratio(c, "sdpa_cudnn_dense" + c[c.rindex("_"):]) for c in tf
                             if not c.endswith("_fwd")}
    print(f"\nerrors: {json.dumps(row['errors'])}")
    print(f"configs: {json.dumps(row['configs'])}\n")
    print("| contender | ms | TFLOP/s | / flex | / cuDNN dense |")
    print("|---|---|---|---|---|")
    for c in sorted(ms, key=lambda c: (c.rsplit("_", 1)[1], c)):
        vf, vc = row["vs_flex"].get(c), row["vs_cudnn_dense"].get(c)
        print(f"| {c} | {ms[c]:.3f} | {tf[c]:.0f} | {'' if vf is None else f'{vf:.2f}x'} | "
              f"{'' if vc is None else f'{vc:.2f}x'} |")
    print(f"\ntotal {time.time() - t0:.0f} s")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(row, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
