"""Forward and backward benchmark: flashtune (the config the dispatcher serves, and the
template default) against torch's attention backends, on any list of problems, in one run.

This is what ``flashtune bench`` runs (the CLI adds the standard grid, the table, JSON and
the plot). Per problem:

* every implementation is run once and checked against an fp32 reference on a slice (batch
  0, the first K/V head's group of query heads; the output, or for the backward dQ, dK and
  dV, the baselines' through autograd); one over the tuner's tolerance
  (:data:`~flashtune.core.case.TOLERANCE`) or that raises is reported with its error
  and never timed; for the forward without score modifications, what a later call of the
  routed choice replays on a GPU (the runtime's launch plan, built on copies of the
  inputs) is checked too (``planned_rel_err_vs_fp32``), and ``flashtune`` is not timed
  where it fails;
* the checked ones are timed ``rounds`` times in rotation (on a GPU
  :func:`~flashtune.autotune.timing.bench`, cold L2 before every call; on CPU tensors the
  host wall time) and the median of the per-round medians is kept.

Implementations: ``flashtune`` (for the forward, what :func:`flashtune.attention` runs: the
op's stored choice of implementation and config, else attn_fwd's tuned config, else its
default; for the backward, the dispatcher's config; its implementation and source are
recorded), ``flashtune_default`` (the template default), for the forward ``impl_<name>``
for each of flashtune's own implementations of the op that can serve the shape (its own
tuned config: ``attn_fwd``, ``attn_fwd_gluon``...), and the baselines of
:data:`BASELINES`: SDPA's ``flash`` (FlashAttention-2), ``cudnn`` and
``efficient`` backends, and FlexAttention (``torch.compile``-d on a GPU). A baseline that
does not support a problem or device is reported with its error, as data.

The matmul ceiling is measured in the same run on a GPU (a bf16 ``torch.matmul`` of
8192 x 8192 x 8192, best of 5) so that each shape can report the fraction of it reached.
"""

from __future__ import annotations

import math
import platform
import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from flashtune.core.problem import AttentionProblem
from flashtune.core.spec import join_pair

__all__ = ["BASELINES", "BENCH_OPS", "IMPLS", "bench_attention", "matmul_ceiling_tflops",
           "summarize", "tflops_of"]

BASELINES = ("sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "flex")
IMPLS = ("flashtune", "flashtune_default", *BASELINES)
BENCH_OPS = ("fwd", "bwd")  # the ops bench knows inputs, references and baselines for
# round medians of one contender further apart than this (slowest / fastest - 1) make its
# ratios on that shape uncertain by as much: summarize counts them (on an H100 the same
# cuDNN kernel's rounds spread 17% on a shape where SDPA flash's spread 1%:
# benchmarks/results/route_grid_h100.json, B2 N8192 D64)
SPREAD_NOTE = 0.05
CEILING_N = 8192


def _sdpa(backend_name: str, q: Any, k: Any, v: Any, causal: bool) -> Callable[[], Any]:
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
               "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION}[backend_name]
    gqa = q.shape[1] != k.shape[1]
    if causal and q.shape[2] not in (k.shape[2], 1):
        raise ValueError("SDPA's is_causal is top-left aligned; flashtune's is bottom-right "
                         "(Nq != Nk): not comparable")
    # one query row (a decoding step) sees every key bottom-right aligned: SDPA unmasked
    causal = causal and q.shape[2] == k.shape[2]

    def run() -> Any:
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=causal, enable_gqa=gqa)
    return run


def _flex(q: Any, k: Any, v: Any, causal: bool,
          mods: Mapping[str, Any] | None = None) -> Callable[[], Any]:
    """FlexAttention with flashtune's conventions: the causal mask and a window bottom-right
    aligned (a block mask: Flex skips the blocks no query sees), a softcap and ALiBi as a
    score_mod on the scaled scores (softcap first, then the bias), as the fp32 reference."""
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    mods = mods or {}
    nq, nk = q.shape[2], k.shape[2]
    offset = nk - nq  # bottom-right, as flashtune: query i sits at key position i + offset
    left, right = mods.get("window", (-1, -1))
    if causal:
        right = 0
    block_mask = None
    if left >= 0 or right >= 0:
        def mask(b: Any, h: Any, qi: Any, ki: Any) -> Any:
            pos = qi + offset
            seen = ki >= 0
            if left >= 0:
                seen = seen & (pos - ki <= left)
            if right >= 0:
                seen = seen & (ki - pos <= right)
            return seen
        block_mask = create_block_mask(mask, None, None, nq, nk, device=str(q.device))
    softcap, slopes = mods.get("softcap"), mods.get("alibi_slopes")
    score_mod = None
    if softcap or slopes is not None:
        def score_mod(s: Any, b: Any, h: Any, qi: Any, ki: Any) -> Any:
            if softcap:
                s = softcap * torch.tanh(s / softcap)
            if slopes is not None:
                s = s - slopes[h] * (qi + offset - ki).abs()
            return s
    if q.is_cuda:
        # one compiled graph per shape; without a reset dynamo stops recompiling after its
        # recompile limit (8 shapes) and the rest of the grid would run flex eagerly
        torch._dynamo.reset()
        fn = torch.compile(flex_attention, dynamic=False)
    else:
        fn = flex_attention
    gqa = q.shape[1] != k.shape[1]
    return lambda: fn(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=gqa)


def matmul_ceiling_tflops(rounds: int = 5) -> float | None:
    """bf16 ``torch.matmul`` TFLOP/s of an ``8192^3`` product on the current GPU (best of
    ``rounds`` timings); None without a GPU."""
    import torch

    if not torch.cuda.is_available():
        return None
    from flashtune.autotune.timing import bench, tflops

    a = torch.randn(CEILING_N, CEILING_N, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(CEILING_N, CEILING_N, device="cuda", dtype=torch.bfloat16)
    best = min(bench(lambda: a @ b).median_ms for _ in range(rounds))
    return tflops(2.0 * CEILING_N ** 3, best)


def _wall_ms(fn: Callable[[], Any], reps: int = 2) -> float:
    """Median host wall time of ``fn`` (CPU tensors, the interpreter: no events to time)."""
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def _first_line(exc: BaseException) -> str:
    return (f"{type(exc).__name__}: " + (str(exc).strip().splitlines() or [""])[0])[:200]


def bench_attention(problems: Sequence[AttentionProblem], *, template: str = "attn_fwd",
                    baselines: Iterable[str] = BASELINES, rounds: int = 1,
                    db_url: str | None = None, device: Any = None, ceiling: bool = True,
                    on_row: Callable[[dict[str, Any]], None] | None = None,
                    train: bool = False) -> dict[str, Any]:
    """Benchmark ``template`` (``attn_fwd`` or ``attn_bwd``) on ``problems``; returns the run
    as a JSON-ready dict (``rows`` one per problem, ``summary`` the geomean ratios,
    ``ceiling_tflops``).

    Arguments:
        template: ``attn_fwd`` (the output) or ``attn_bwd`` (dQ, dK, dV from the forward's
            output and LSE; the baselines' backward through autograd; FLOPs 2.5x the
            forward's).
        train: the training step instead (``template`` must be attn_fwd): the forward and
            its backward as :func:`flashtune.attention` runs a call with gradients (the
            ``train`` op's choice, else attn_fwd with attn_bwd's tuned config), the
            baselines' forward and backward through autograd, each step checked on its
            output and dQ, dK, dV; FLOPs 3.5x the forward's.
        problems: the shapes (any dtype/GQA/causal; tensors live on the GPU, or on the CPU
            under the Triton interpreter, where timings mean nothing).
        baselines: names from :data:`BASELINES`; unknown names raise ``ValueError``.
        rounds: timings per implementation, in rotation; the median of the medians is kept.
        db_url: the tuning database the dispatcher reads (None: the default one).
        device: a :class:`~flashtune.core.device.DeviceFingerprint` (default: the
            current GPU, or the interpreter's without one).
        ceiling: measure the bf16 matmul ceiling first (GPU only).
        on_row: called with each finished row (progress, partial saves).
    """
    import torch
    import triton

    from flashtune.core.device import current_device, interpreter_device
    from flashtune.kernel_templates import get_template
    from flashtune.runtime.lookup import Dispatcher

    baselines = list(baselines)
    unknown = [b for b in baselines if b not in BASELINES]
    if unknown:
        raise ValueError(f"unknown baselines {unknown}; known: {list(BASELINES)}")
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    if device is None:  # the interpreter under TRITON_INTERPRET=1 or without a GPU
        device = current_device() if torch.cuda.is_available() else interpreter_device()
    torch_device = "cpu" if device.is_interpreter else "cuda"
    spec = get_template(template)
    if spec.op not in BENCH_OPS:
        raise ValueError(f"cannot benchmark template {template!r} (op {spec.op!r}); choose "
                         f"one of op {' or '.join(BENCH_OPS)}")
    dispatcher = Dispatcher(spec)
    if train:
        from flashtune.kernel_templates.registry import train_step

        if spec.op != "fwd":
            raise ValueError(f"the training step is a forward's; got template {template!r}")
        spec = train_step(spec)
    dispatcher.reload(db_url=db_url)
    t0 = time.time()
    result: dict[str, Any] = {
        "benchmark": "train" if train else template, "device": device.to_dict(), "torch": torch.__version__,
        "triton": triton.__version__, "source_hash": spec.source_hash, "db": db_url,
        "host": platform.node(), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "rounds": rounds, "baselines": baselines,
        "ceiling_tflops": matmul_ceiling_tflops() if ceiling and torch_device == "cuda" else None,
        "rows": []}
    served = _Served(dispatcher, db_url)
    for p in problems:
        row = _bench_problem(p, spec, served.choice(p, spec, device), device, torch_device,
                             baselines, rounds, served)
        result["rows"].append(row)
        result["wall_s"] = time.time() - t0
        result["summary"] = summarize(result["rows"], result["ceiling_tflops"])
        if on_row is not None:
            on_row(row)
        if torch_device == "cuda":
            torch.cuda.empty_cache()
    result.setdefault("summary", summarize([], result["ceiling_tflops"]))
    result.setdefault("wall_s", time.time() - t0)
    return result


class _Served:
    """What bench reads of the tuned state, loaded once per run from its own database (not
    the process's routers): the op choices, and each own implementation's tuned configs."""

    def __init__(self, dispatcher: Any, db_url: str | None) -> None:
        from flashtune.core.spec import USER_OPS
        from flashtune.kernel_templates import get_template, implementations
        from flashtune.runtime.choices import OpRouter
        from flashtune.runtime.lookup import Dispatcher

        self.dispatcher = dispatcher
        self.routers = {op: OpRouter(op, {s.name: s for s in implementations(op)})
                        for op in USER_OPS}
        self.own = [Dispatcher(s) for s in implementations("fwd") if s.kind != "extern"]
        self.backward = Dispatcher(get_template("attn_bwd"))
        self.trains = {s.name: s for s in implementations("train")}
        # each own pair's backward template (attn_bwd, attn_bwd_gluon), its tuned configs
        self.backwards = {self.backward.spec.name: self.backward}
        for step in self.trains.values():
            pair = getattr(step.launcher, "bwd", None)
            if pair is not None and pair.name not in self.backwards:
                self.backwards[pair.name] = Dispatcher(pair)
        for router in self.routers.values():
            router.reload(db_url=db_url)
        for own in [*self.own, *self.backwards.values()]:
            own.reload(db_url=db_url)

    def choice(self, p: AttentionProblem, spec: Any, device: Any) -> Any:
        """What a call of ``p`` runs with: for the forward the router's answer (its op
        choice, else the dispatcher's config), for the backward the dispatcher's config,
        for the training step the train op's choice; with nothing tuned, the default the
        runtime takes on the device's compute capability (an SDPA backend, as
        ``routing._train_default``), else attn_fwd's config (and attn_bwd's, joined)."""
        from flashtune.runtime.routing import _route_ops, _train_default

        if spec.op == "train":
            chosen = self.routers["train"].choose(p, device) \
                or _train_default(p, device, False)
            if chosen is not None:
                return chosen
            fwd, bwd = self.dispatcher.choose(p, device), self.backward.choose(p, device)
            return replace(fwd, config=join_pair(fwd.config, bwd.config), tflops=None,
                           median_ms=None)
        if spec.op == "fwd":
            for op in _route_ops(p):
                chosen = self.routers[op].choose(p, device)
                if chosen is not None:
                    return chosen
        return self.dispatcher.choose(p, device)

    def own_implementations(self, p: AttentionProblem, device: Any,
                            train: bool = False) -> dict[str, tuple[Any, dict[str, int]]]:
        """``impl_<name>``: each of flashtune's own forward implementations that can serve
        ``p`` on ``device``, with its own tuned config (else its default); with ``train``
        each of its own training pairs (a forward with attn_bwd, the Gluon forward with the
        Gluon backward, ...): the forward's tuned config (of the forward implementation
        whose kernel it runs) joined with its backward template's."""
        if not train:
            return {f"impl_{d.spec.name}": (d.spec, dict(d.choose(p, device).config))
                    for d in self.own if d.spec.refuse(p, device) is None}
        pairs = {}
        for name, step in self.trains.items():
            fwd, bwd = (getattr(step.launcher, side, None) for side in ("fwd", "bwd"))
            if fwd is None or bwd is None or step.refuse(p, device) is not None:
                continue  # an extern's step, or a pair that cannot serve p here
            # the forward implementation whose kernel the pair runs (the Gluon pair's
            # forward is attn_fwd_gluon's, registered under the pair's name)
            runs = next((d for d in self.own if d.spec.launcher is fwd.launcher), None)
            fcfg = runs.choose(p, device).config if runs else fwd.default_config(p, device)
            pairs[f"impl_{name}"] = (step, join_pair(fcfg, self.backwards[bwd.name]
                                                     .choose(p, device).config))
        return pairs


def _inputs(p: AttentionProblem, torch_device: str, names: Sequence[str]) -> list[Any]:
    import torch

    g = torch.Generator(device=torch_device).manual_seed(0)
    dt = torch.bfloat16 if p.dtype == "bf16" else torch.float16
    out = []
    for name in names:
        h, n = (p.heads_q, p.seqlen_q) if name in ("q", "do") else (p.heads_kv, p.seqlen_k)
        out.append(torch.randn(p.batch, h, n, p.head_dim, device=torch_device,
                               generator=g).to(dt))
    return out


def _baseline(name: str, q: Any, k: Any, v: Any, causal: bool,
              mods: Mapping[str, Any] | None = None) -> Callable[[], Any]:
    """A baseline's forward; ``mods`` (a window, softcap, ALiBi: launcher keywords) only
    FlexAttention takes (SDPA's backends have no softcap, and a window or ALiBi only as a
    materialised mask, which ``benchmarks/bench_mods.py`` times)."""
    if name == "flex":
        return _flex(q, k, v, causal, mods)
    if mods:
        raise ValueError(f"{name} serves no {' or '.join(sorted(mods))} (Flex does; "
                         f"benchmarks/bench_mods.py times SDPA given the mask)")
    return _sdpa(name, q, k, v, causal)


def _forward_fns(p: AttentionProblem, spec: Any,
                 configs: Mapping[str, tuple[Any, Mapping[str, int]]],
                 baselines: Sequence[str], device: Any, torch_device: str,
                 row: dict[str, Any]) -> tuple[
                     dict[str, Callable[[], Any]], Callable[[Any], float]]:
    """The forward's implementations, and the error of one's output vs fp32 (on a slice:
    batch 0, the first K/V head's query heads)."""
    import torch

    from flashtune.core.case import mods_options, relative_error
    from flashtune.kernel_templates.attn_fwd.reference import attn_fwd_reference

    q, k, v = _inputs(p, torch_device, ("q", "k", "v"))
    group = p.heads_q // p.heads_kv
    sq, skv = (slice(0, 1), slice(0, group)), (slice(0, 1), slice(0, 1))
    # the problem's window, softcap and ALiBi slopes (seeded), for every launch and the
    # reference alike; empty for a plain problem
    mods = mods_options(p, torch_device, torch.Generator(device=torch_device).manual_seed(1))
    ref_mods = dict(mods)
    if "alibi_slopes" in ref_mods:
        ref_mods["alibi_slopes"] = ref_mods["alibi_slopes"][:group]
    ref, _ = attn_fwd_reference(q[sq], k[skv], v[skv], causal=p.causal, dtype=torch.float32,
                                **ref_mods)

    def launch(impl: Any, config: Mapping[str, int]) -> Callable[[], Any]:
        return lambda: impl.launcher(q, k, v, config, causal=p.causal, **mods)
    fns = {name: launch(*c) for name, c in configs.items()}
    for name in baselines:
        try:
            fns[name] = _baseline(name, q, k, v, p.causal, mods)
        except Exception as exc:  # noqa: BLE001 - an unsupported baseline is data
            row[name] = {"error": _first_line(exc)}
    if not mods:
        row["planned_rel_err_vs_fp32"] = _planned_error(
            *configs["flashtune"], q, k, v, p.causal,
            lambda out: relative_error(out[sq], ref))
    return fns, lambda out: relative_error(out[sq], ref)


def _planned_error(impl: Any, config: Mapping[str, int], q: Any, k: Any, v: Any, causal: bool,
                   error: Callable[[Any], float]) -> float | str | None:
    """The error of what the runtime replays for the routed choice (its launch plan, built
    as a shape's first call builds it but on other tensors of the inputs' shapes and
    strides and other values, then run on the inputs, as a later call runs it): a float;
    the first line of what building or running it raised; None where the runtime plans no
    such call (it runs the launcher, checked beside it, or torch's op)."""
    from flashtune.runtime.routing import replay_plan

    first = [t.new_empty_strided(t.shape, t.stride()).normal_() for t in (q, k, v)]
    try:
        replay = replay_plan(impl, config, *first, causal=causal)
    except Exception as exc:  # noqa: BLE001 - no plan: the runtime runs the launcher
        return f"not planned: {_first_line(exc)}"
    if replay is None:
        return None
    try:
        return error(replay(q, k, v))
    except Exception as exc:  # noqa: BLE001
        return _first_line(exc)


def _backward_fns(p: AttentionProblem, spec: Any,
                  configs: Mapping[str, tuple[Any, Mapping[str, int]]],
                  baselines: Sequence[str], device: Any, torch_device: str,
                  row: dict[str, Any]) -> tuple[
                      dict[str, Callable[[], Any]], Callable[[Any], float]]:
    """The backward's implementations (dQ, dK, dV given dO; flashtune's from the forward's
    saved output and LSE, the baselines' through autograd), and the largest relative error
    of the three gradients vs fp32 autograd on a slice."""
    import torch

    from flashtune.core.case import relative_error
    from flashtune.kernel_templates import get_template
    from flashtune.kernel_templates.attn_bwd.reference import attn_bwd_reference

    q, k, v, do = _inputs(p, torch_device, ("q", "k", "v", "do"))
    sq, skv = (slice(0, 1), slice(0, p.heads_q // p.heads_kv)), (slice(0, 1), slice(0, 1))
    ref = attn_bwd_reference(q[sq], k[skv], v[skv], do[sq], causal=p.causal,
                             dtype=torch.float32)
    fwd = get_template("attn_fwd")
    out, lse = fwd.launcher(q, k, v, fwd.default_config(p, device), causal=p.causal,
                            return_lse=True)

    def launch(impl: Any, config: Mapping[str, int]) -> Callable[[], Any]:
        return lambda: impl.launcher(q, k, v, out, lse, do, config, causal=p.causal)
    fns = {name: launch(*c) for name, c in configs.items()}
    ql, kl, vl = (t.detach().requires_grad_(True) for t in (q, k, v))

    def grads(o: Any) -> Callable[[], Any]:
        return lambda: torch.autograd.grad(o, (ql, kl, vl), do, retain_graph=True)
    for name in baselines:
        try:
            fns[name] = grads(_baseline(name, ql, kl, vl, p.causal)())
        except Exception as exc:  # noqa: BLE001 - an unsupported baseline is data
            row[name] = {"error": _first_line(exc)}

    def error(grads: Any) -> float:
        return max(relative_error(g[s], r) for g, s, r in zip(grads, (sq, skv, skv), ref))
    return fns, error


def _train_fns(p: AttentionProblem, spec: Any,
               configs: Mapping[str, tuple[Any, Mapping[str, int]]],
               baselines: Sequence[str], device: Any, torch_device: str,
               row: dict[str, Any]) -> tuple[
                   dict[str, Callable[[], Any]], Callable[[Any], float]]:
    """The training step's implementations (flashtune's through its
    :class:`~flashtune.kernel_templates.training.TrainStep`, the baselines' forward and
    ``torch.autograd.grad``): each returns ``(out, dq, dk, dv)``; the error is the largest
    of the four vs fp32 autograd on a slice."""
    import torch

    from flashtune.core.case import relative_error
    from flashtune.kernel_templates.attn_bwd.reference import attn_bwd_reference
    from flashtune.kernel_templates.attn_fwd.reference import attn_fwd_reference

    q, k, v, do = _inputs(p, torch_device, ("q", "k", "v", "do"))
    sq, skv = (slice(0, 1), slice(0, p.heads_q // p.heads_kv)), (slice(0, 1), slice(0, 1))
    ref_out, _ = attn_fwd_reference(q[sq], k[skv], v[skv], causal=p.causal,
                                    dtype=torch.float32)
    refs = (ref_out, *attn_bwd_reference(q[sq], k[skv], v[skv], do[sq], causal=p.causal,
                                         dtype=torch.float32))
    ql, kl, vl = (t.detach().requires_grad_(True) for t in (q, k, v))

    def launch(impl: Any, config: Mapping[str, int]) -> Callable[[], Any]:
        return lambda: impl.launcher(ql, kl, vl, do, config, causal=p.causal)
    fns = {name: launch(*c) for name, c in configs.items()}

    def step(forward: Callable[[], Any]) -> Callable[[], Any]:
        def run() -> Any:
            with torch.enable_grad():
                out = forward()
                return (out.detach(), *torch.autograd.grad(out, (ql, kl, vl), do))
        return run
    for name in baselines:
        try:
            fns[name] = step(_baseline(name, ql, kl, vl, p.causal))
        except Exception as exc:  # noqa: BLE001 - an unsupported baseline is data
            row[name] = {"error": _first_line(exc)}

    def error(got: Any) -> float:
        return max(relative_error(g[s], r)
                   for g, s, r in zip(got, (sq, sq, skv, skv), refs, strict=True))
    return fns, error


def _not_benched(p: AttentionProblem, op: str) -> str | None:
    """Why ``bench`` does not time ``p`` in mode ``op`` (None: it does): the forward takes
    a window, softcap and ALiBi; dropout, packed batches and score modifications in the
    backward or the training step have benchmarks of their own."""
    if p.dropout:
        return "bench does not time dropout (benchmarks/bench_dropout.py does)"
    if p.packed:
        return "bench does not time packed batches (benchmarks/bench_mods.py --cases packed does)"
    if p.has_mods and op != "fwd":
        return (f"bench times {' and '.join(p.mods())} in the forward only "
                f"(benchmarks/bench_mods.py times the training step with them)")
    return None


def _bench_problem(p: AttentionProblem, spec: Any, choice: Any, device: Any, torch_device: str,
                   baselines: Sequence[str], rounds: int,
                   served: _Served | None = None) -> dict[str, Any]:
    """One problem's row: every implementation checked against fp32, then timed."""
    from flashtune.autotune.timing import bench, tflops
    from flashtune.core.case import TOLERANCE
    from flashtune.kernel_templates import get_template

    default = spec.default_config(p, device)
    row: dict[str, Any] = {"problem": p.key(), "label": p.describe(),
                           "flops": p.flops() + p.flops(backward=True) if spec.op == "train"
                           else p.flops(backward=spec.op == "bwd"),
                           "implementation": choice.template,
                           "config": choice.config, "source": choice.source,
                           "default_config": default,
                           # what the tuner recorded for this very problem (exact entries
                           # only: a bucket's or a neighbour's figure is another shape's)
                           "recorded_tflops": choice.tflops if choice.source == "exact"
                           else None}
    make = {"bwd": _backward_fns, "train": _train_fns}.get(spec.op, _forward_fns)
    routed = get_template(choice.template) if spec.op == "fwd" else spec
    if spec.op == "train" and served is not None:
        routed = served.trains[choice.template]
    configs = {"flashtune": (routed, choice.config),
               "flashtune_default": (spec, default)}
    if spec.op in ("fwd", "train") and served is not None:
        configs.update(served.own_implementations(p, device, train=spec.op == "train"))
    reason = _not_benched(p, spec.op)
    if reason is not None:  # a row that says why, never a plain problem's timing for it
        row.update({name: {"error": reason} for name in (*configs, *baselines)})
        return row
    fns, error = make(p, spec, configs, baselines, device, torch_device, row)
    checked: dict[str, float] = {}
    for name, fn in fns.items():
        try:
            err = error(fn())
        except Exception as exc:  # noqa: BLE001
            row[name] = {"error": _first_line(exc)}
            continue
        if not err < TOLERANCE[p.dtype]:  # also NaN
            row[name] = {"error": f"relative error {err:.3g} >= {TOLERANCE[p.dtype]} vs fp32; "
                                  f"not timed", "rel_err_vs_fp32": err}
            continue
        checked[name] = err
    planned = row.get("planned_rel_err_vs_fp32")
    if "flashtune" in checked and planned is not None \
            and not str(planned).startswith("not planned") \
            and not (isinstance(planned, float) and planned < TOLERANCE[p.dtype]):
        # the launcher passed, what a later call replays did not: the runtime is not timed
        what = (f"relative error {planned:.3g} >= {TOLERANCE[p.dtype]} vs fp32"
                if isinstance(planned, float) else planned)
        del checked["flashtune"]
        row["flashtune"] = {"error": f"the runtime's launch plan failed where the launcher "
                                     f"passed: {what}; not timed"}
    times: dict[str, list[float]] = {name: [] for name in checked}
    for _ in range(rounds):
        for name in list(times):
            try:
                times[name].append(bench(fns[name]).median_ms if torch_device == "cuda"
                                   else _wall_ms(fns[name]))
            except Exception as exc:  # noqa: BLE001
                row[name] = {"error": _first_line(exc)}
                del times[name]
    for name, ts in times.items():
        ms = statistics.median(ts)  # as the tuner's interleaved re-timing takes it
        row[name] = {"median_ms": ms, "tflops": tflops(row["flops"], ms),
                     "rel_err_vs_fp32": checked[name], "round_medians_ms": ts}
    measured = tflops_of(row, "flashtune")
    row["drift"] = (measured / row["recorded_tflops"]
                    if measured and row["recorded_tflops"] else None)
    return row


def round_spread(entry: Mapping[str, Any]) -> float | None:
    """How far apart a contender's round medians are, ``slowest / fastest - 1`` (None with
    fewer than two rounds)."""
    ts = entry.get("round_medians_ms") or []
    return max(ts) / min(ts) - 1 if len(ts) >= 2 and min(ts) > 0 else None


def tflops_of(row: Mapping[str, Any], name: str) -> float | None:
    """TFLOP/s of implementation ``name`` in ``row`` (None: errored or absent)."""
    value = row.get(name, {}).get("tflops")
    return float(value) if value else None


def _geomean(xs: Sequence[float]) -> float | None:
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def summarize(rows: Sequence[Mapping[str, Any]], ceiling: float | None) -> dict[str, Any]:
    """Geomean ratios ``<impl>_vs_<other>`` over the rows where both were timed (flashtune
    and its default against each other and every baseline), and flashtune's mean fraction
    of the matmul ceiling."""
    out: dict[str, Any] = {}
    own = sorted({name for r in rows for name in r if name.startswith("impl_")})
    for mine in ("flashtune", "flashtune_default", *own):
        for other in ("flashtune_default", *BASELINES):
            if other == mine:
                continue
            pairs = [(tflops_of(r, mine), tflops_of(r, other)) for r in rows]
            ratios = [a / b for a, b in pairs if a and b]
            if ratios:
                out[f"{mine}_vs_{other}_geomean"] = _geomean(ratios)
                out[f"{mine}_vs_{other}_min"] = min(ratios)
    # against the fastest baseline of each row (the target: never slower than the best of
    # what torch offers for the shape)
    best = [(tflops_of(r, "flashtune"), max((t for t in (tflops_of(r, b) for b in BASELINES)
                                             if t), default=None)) for r in rows]
    ratios = [a / b for a, b in best if a and b]
    if ratios:
        out["flashtune_vs_best_baseline_geomean"] = _geomean(ratios)
        out["flashtune_vs_best_baseline_min"] = min(ratios)
    if ceiling:
        fractions = [t / ceiling for t in (tflops_of(r, "flashtune") for r in rows) if t]
        out["flashtune_of_ceiling_geomean"] = _geomean(fractions)
    out["all_checked"] = all("tflops" in r.get("flashtune", {}) for r in rows)
    spread: dict[str, list[tuple[float, str]]] = {}
    for r in rows:
        for name in sorted(r):
            value = round_spread(r[name]) if isinstance(r[name], Mapping) else None
            if value is not None and value > SPREAD_NOTE:
                spread.setdefault(name, []).append((value, str(r.get("label", ""))))
    if spread:
        out["round_spread"] = {name: {"shapes": len(v), "max": max(v)[0], "at": max(v)[1]}
                               for name, v in sorted(spread.items())}
    drifts = [r["drift"] for r in rows if r.get("drift")]
    if drifts:  # measured / recorded TFLOP/s of the stored winners served for their problem
        out["drift_geomean"] = _geomean(drifts)
        out["drift_min"] = min(drifts)
        out["drift_max"] = max(drifts)
    return out
