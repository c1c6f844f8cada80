"""Timing parity (issue 22, item 7): does the tuner time a config the way ``flashtune bench``
and the runtime do? One GPU run over a few shapes, each with fixed configs (the template
default and one other valid config), timed

* the tuner's way: ``LocalRunner.time_config`` (what ``_confirm`` records: ``timing.bench``,
  i.e. ``do_bench`` with an L2 flush before every call, 25 ms warm-up, 100 ms of repetitions,
  the median; re-timed by ``bench_queued`` below 1 ms) and ``LocalRunner.evaluate`` (a trial);
* bench's way: ``flashtune.runtime.bench._bench_problem``, the function ``bench_attention``
  runs per problem (its own inputs, its fp32 check, its rotation with the default and SDPA);
* through the runtime: ``flashtune.attention(..., config=cfg)`` and with the dispatcher
  serving cfg (plan + direct launch); for the backward, ``torch.autograd.grad`` through
  ``flashtune.attention`` with the attn_bwd dispatcher serving cfg;

and one variant per suspected cause that switches just that factor on the tuner's inputs
(L2 flush, LSE stored, (B, N, H, D) storage, TMA off, host launch gaps, queued re-timing,
CUDA graph, a cold or a hot GPU, a longer window). torch SDPA's flash and cuDNN backends are
timed on the same inputs in the same run. Every variant runs ``--rounds`` times, all variants
of a shape interleaved in each round (cold ones first, hot ones last); a row's figure is the
median of its per-round figures. Every timed call is checked once against the fp32
reference (``Case.error``: ``relative_error`` against the template's reference) before it is
timed; one over the tuner's tolerance is reported and never timed.

    python3 benchmarks/timing_parity.py --out $OUT/timing_parity_h100.json
        [--rounds 3] [--shapes gemma2_fwd,bert_bwd,d128_fwd] [--cold-s 2] [--heat-s 2]
        [--budget-s 420] [--db URL] [--other NAME=JSON]

Per shape the config the lookup chain serves (``--db URL``, else the default database, then
the configs shipped in ``flashtune/configs/``) is timed too (label ``served``) unless it is
the default or the other config; its recorded TFLOP/s is printed beside the measured ones.
``--other NAME=JSON`` replaces a shape's candidate "other" configs (the first that checks).

Printed last, per shape one line per (config, variant):
``ms`` median over rounds; ``TFLOP/s`` ANCHORS.md's count (backward 2.5x forward);
``vs tuner`` this row's TFLOP/s over the tuner's row of the same config (SDPA rows: over
the default's); ``spread`` (max - min) / median of the per-round figures; ``vs cuDNN``
TFLOP/s over SDPA cuDNN timed the tuner's way on the same inputs; ``host ms`` host time to
issue one call (its launches, no sync; ERROR: not timed, listed below the table). Then
``parity`` lines (bench and runtime over the tuner, per config) and the three variants
farthest from the tuner per config. JSON: every round's figure, errors vs fp32, notes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

log = logging.getLogger("timing_parity")

TUNER = "tuner"
DEFAULT = "default"
SDPA = "sdpa"  # the config label of the baselines' rows
BASELINES = ("sdpa_flash", "sdpa_cudnn")
HOST_REPS = 5
CPU_REPS = 2  # wall-clock calls per timing off the GPU (the interpreter: figures mean nothing)
LONG_WARMUP_MS, LONG_REP_MS = 500.0, 1500.0
SHAPE_NAMES = ("gemma2_fwd", "bert_bwd", "d128_fwd")  # gpu_shapes(), without importing torch


@dataclass(frozen=True)
class Variant:
    """One way of timing a config: ``factor`` is what it switches relative to the tuner's
    measurement. ``phase`` orders a round: 0 first (cold), 1 middle, 2 last (hot)."""

    name: str
    factor: str
    ops: tuple[str, ...] = ("fwd", "bwd")
    gpu_only: bool = False
    default_only: bool = False  # only for the default config (a compile per config saved)
    needs_tma: bool = False  # only for configs with USE_TMA=1
    phase: int = 1


VARIANTS: tuple[Variant, ...] = (
    Variant("cold", "the GPU idle --cold-s s right before (a trial right after its compile)",
            gpu_only=True, phase=0),
    Variant(TUNER, "reference: LocalRunner.time_config = timing.bench (do_bench, L2 flush "
            "before each call, 25/100 ms, median; bench_queued below 1 ms)"),
    Variant("tuner_trial", "LocalRunner.evaluate: launch + fp32 check, then the same timing"),
    Variant("bench", "runtime.bench._bench_problem: bench's inputs, check and rotation with "
            "the default and SDPA (rounds=1 per round)"),
    Variant("runtime", "fwd: flashtune.attention(config=cfg); bwd: autograd.grad through "
            "flashtune.attention, attn_bwd dispatcher serving cfg; timed as the tuner"),
    Variant("runtime_served", "flashtune.attention, dispatcher serving cfg (launch plan, "
            "direct launch)", ops=("fwd",)),
    Variant("runtime_events", "the runtime call, events around each call (host launch gaps "
            "included: no queued re-timing)", gpu_only=True),
    Variant("runtime_bnhd", "the runtime call on (B,N,H,D) storage viewed as (B,H,N,D), as "
            "models pass it"),
    Variant("layout_bnhd", "the launcher on (B,N,H,D) storage views (same values)"),
    Variant("lse", "the forward also stores the LSE (as the autograd forward does)",
            ops=("fwd",)),
    Variant("tma_off", "USE_TMA=0 (what an input the TMA cannot address falls back to)",
            gpu_only=True, default_only=True, needs_tma=True),
    Variant("no_flush", "no L2 flush between calls (L2 warm)", gpu_only=True),
    Variant("events", "do_bench alone: events around each call, never re-timed queued",
            gpu_only=True),
    Variant("queued", "bench_queued always (no host gaps, cold L2)", gpu_only=True),
    Variant("graph", "CUDA graph of 20 calls replayed (timing.bench_graph, L2 warm)",
            gpu_only=True),
    Variant("long", "warm-up 500 ms, 1500 ms of repetitions (clocks settle in the window)",
            gpu_only=True),
    Variant("hot", "--heat-s s of bf16 8192^3 matmuls right before (bench after its matmul "
            "ceiling and its rotation)", gpu_only=True, phase=2),
)
VARIANT_BY_NAME = {v.name: v for v in VARIANTS}
BASELINE_FACTOR = "torch SDPA backend on the tuner's inputs, timed as the tuner"


@dataclass(frozen=True)
class Shape:
    """One problem and the candidates for its "other" config (the first that checks)."""

    name: str
    op: str  # "fwd" | "bwd"
    problem: Any  # AttentionProblem
    others: tuple[Mapping[str, int], ...] = ()
    note: str = ""


def gpu_shapes() -> list[Shape]:
    from flashtune.core.problem import AttentionProblem

    return [
        Shape("gemma2_fwd", "fwd", AttentionProblem(1, 16, 8, 16384, 16384, 256, True, "bf16"),
              # the config flashtune/configs ships for this shape (recorded 480.3 TFLOP/s)
              ({"BLOCK_M": 128, "BLOCK_N": 32, "num_warps": 8, "num_stages": 4, "USE_TMA": 1,
                "REVERSE_M": 0},
               {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2, "USE_TMA": 1,
                "REVERSE_M": 1},
               {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2, "USE_TMA": 1,
                "REVERSE_M": 1}),
              "issue 22: tuner 528.5 vs bench 440.9 TFLOP/s (default 421.9 in both)"),
        Shape("bert_bwd", "bwd", AttentionProblem(32, 16, 16, 512, 512, 64, False, "bf16"),
              ({"BLOCK_M1": 64, "BLOCK_N1": 128, "BLOCK_M2": 128, "BLOCK_N2": 32,
                "num_warps": 4, "num_stages": 3, "SPLIT_LOOPS": 1},
               {"BLOCK_M1": 32, "BLOCK_N1": 64, "BLOCK_M2": 64, "BLOCK_N2": 32,
                "num_warps": 4, "num_stages": 2}),
              "issue 22: runtime 84-237 vs tuner 244 TFLOP/s"),
        Shape("d128_fwd", "fwd", AttentionProblem(4, 16, 16, 4096, 4096, 128, False, "bf16"),
              ({"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3, "USE_TMA": 1},
               {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3,
                "USE_TMA": 1}),
              "standard grid D128 N4096 (near the 1 ms queued re-timing threshold)"),
    ]


# -- pure logic: the plan of a round, the summary, the table ---------------------------------

def plan_round(op: str, labels: Sequence[str], *, on_gpu: bool,
               tma_labels: Sequence[str] = (),
               baselines: Sequence[str] = BASELINES) -> list[tuple[str, str]]:
    """The ``(config label, variant)`` slots of one round, in run order: phase 0 variants of
    every config, then each config's phase-1 variants, the SDPA baselines (label
    :data:`SDPA`), then phase 2. ``labels[0]`` is the default. The bench slot sits with the
    non-default configs (one ``_bench_problem`` call times a config *and* the default), or
    with the default when it is alone. GPU-only variants and the baselines are left out
    off the GPU."""
    variants = [v for v in VARIANTS if op in v.ops and (on_gpu or not v.gpu_only)]
    default, others = labels[0], list(labels[1:])

    def wanted(label: str, v: Variant) -> bool:
        if v.default_only and label != default:
            return False
        if v.needs_tma and label not in tma_labels:
            return False
        if v.name == "bench":
            return label in others if others else label == default
        return True

    slots: list[tuple[str, str]] = []
    for phase in (0, 1, 2):
        for label in labels:
            slots.extend((label, v.name) for v in variants
                         if v.phase == phase and wanted(label, v))
        if phase == 1 and on_gpu:
            slots.extend((SDPA, b) for b in baselines)
    return slots


def _median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


def summarize(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One summary per raw row (``shape``, ``config``, ``variant``, ``flops``, ``round_ms``
    and optionally ``host_ms``, ``rel_err``, ``error``): the median over rounds (and the
    minimum: what a min-over-measurements record would keep), TFLOP/s and
    the ratios ``vs_tuner`` (TFLOP/s over the tuner row of the same shape and config; SDPA
    rows over the default's), ``vs_cudnn`` (over the tuner-timed SDPA cuDNN row of the
    shape) and ``spread`` ((max - min) / median of the rounds). Rows without figures keep
    their error and None ratios."""
    medians: dict[tuple[str, str, str], float] = {}
    for r in rows:
        ms = [x for x in r.get("round_ms", []) if x and math.isfinite(x) and x > 0]
        if ms:
            medians[(r["shape"], r["config"], r["variant"])] = _median(ms)
    out = []
    for r in rows:
        key = (r["shape"], r["config"], r["variant"])
        ms = medians.get(key)
        tuner = medians.get((r["shape"], DEFAULT if r["config"] == SDPA else r["config"], TUNER))
        cudnn = medians.get((r["shape"], SDPA, "sdpa_cudnn"))
        rounds = [x for x in r.get("round_ms", []) if x and math.isfinite(x) and x > 0]
        flops = r.get("flops") or 0.0
        out.append({
            "shape": r["shape"], "config": r["config"], "variant": r["variant"],
            "median_ms": ms, "min_ms": min(rounds) if rounds else None,
            "tflops": flops / (ms * 1e-3) / 1e12 if ms and flops else None,
            "vs_tuner": tuner / ms if ms and tuner else None,
            "vs_cudnn": cudnn / ms if ms and cudnn else None,
            "spread": (max(rounds) - min(rounds)) / ms if ms and len(rounds) > 1 else None,
            "rounds": len(rounds), "host_ms": r.get("host_ms"), "rel_err": r.get("rel_err"),
            "error": r.get("error"), "note": r.get("note"),
        })
    return out


def _fmt(x: float | None, spec: str, suffix: str = "") -> str:
    return "-" if x is None else f"{x:{spec}}{suffix}"


def largest_effects(summary: Sequence[Mapping[str, Any]], k: int = 3) -> list[str]:
    """Per (shape, config): the ``k`` variants whose ``vs_tuner`` is farthest from 1."""
    groups: dict[tuple[str, str], list[Mapping[str, Any]]] = {}
    for s in summary:
        if s["config"] != SDPA and s["variant"] != TUNER and s["vs_tuner"]:
            groups.setdefault((s["shape"], s["config"]), []).append(s)
    lines = []
    for (shape, config), items in groups.items():
        items = sorted(items, key=lambda s: -abs(math.log(s["vs_tuner"])))[:k]
        lines.append(f"{shape} {config}: " + ", ".join(
            f"{s['variant']} {s['vs_tuner']:.3f}x" for s in items))
    return lines


def render_table(summary: Sequence[Mapping[str, Any]],
                 titles: Mapping[str, str] | None = None) -> str:
    """The closing table, one block per shape (headed by ``titles[shape]`` when given; see
    the module docstring for the columns), then the parity lines (bench and runtime over
    the tuner per shape and config), the largest effects, errors and notes."""
    header = ["config", "variant", "ms", "TFLOP/s", "vs tuner", "spread", "vs cuDNN",
              "host ms"]
    shapes = list(dict.fromkeys(s["shape"] for s in summary))
    bodies = {shape: [[s["config"], s["variant"], _fmt(s["median_ms"], ".4f"),
                       _fmt(s["tflops"], ".1f"), _fmt(s["vs_tuner"], ".3f"),
                       _fmt(None if s["spread"] is None else 100 * s["spread"], ".1f", "%"),
                       _fmt(s["vs_cudnn"], ".3f"),
                       "ERROR" if s["error"] and not s["median_ms"] else _fmt(s["host_ms"],
                                                                              ".3f")]
                      for s in summary if s["shape"] == shape] for shape in shapes}
    widths = [max(len(str(c)) for c in col)
              for col in zip(header, *(row for body in bodies.values() for row in body))]
    right = set(range(2, len(header)))

    def line(row: Sequence[str]) -> str:
        return "  ".join(str(c).rjust(w) if i in right else str(c).ljust(w)
                         for i, (c, w) in enumerate(zip(row, widths))).rstrip()

    lines = []
    for shape in shapes:
        lines.append(f"== {shape}" + (f": {titles[shape]}" if titles and shape in titles else ""))
        lines.extend(line(row) for row in [header, *bodies[shape]])
    by_key = {(s["shape"], s["config"], s["variant"]): s for s in summary}
    for shape, config in dict.fromkeys((s["shape"], s["config"]) for s in summary
                                       if s["config"] != SDPA):
        parts = [f"{v} {by_key[(shape, config, v)]['vs_tuner']:.3f}x"
                 for v in ("bench", "runtime", "runtime_served")
                 if (by_key.get((shape, config, v)) or {}).get("vs_tuner")]
        if parts:
            lines.append(f"parity {shape} {config}: " + ", ".join(parts) + " of the tuner's")
    effects = largest_effects(summary)
    if effects:
        lines += ["largest effects (vs tuner):", *effects]
    lines += [f"error {s['shape']} {s['config']} {s['variant']}: {str(s['error'])[:120]}"
              for s in summary if s["error"]]
    lines += [f"note {s['shape']} {s['config']} {s['variant']}: {s['note']}"
              for s in summary if s.get("note")]
    return "\n".join(lines)


# -- measuring ------------------------------------------------------------------------------

def _first_line(exc: BaseException) -> str:
    text = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {text}"[:200]


def _same(x: Any) -> Any:
    return x


def _sync(on_gpu: bool) -> None:
    if on_gpu:
        import torch

        torch.cuda.synchronize()


def host_ms(fn: Callable[[], Any], on_gpu: bool, reps: int = HOST_REPS) -> float:
    """Median host time to issue one call of ``fn`` (a sync before each, none after): its
    Python, checks and launches, with an idle GPU queue."""
    times = []
    for _ in range(reps if on_gpu else 1):
        _sync(on_gpu)
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    _sync(on_gpu)
    return _median(times)


def events_ms(fn: Callable[[], Any], *, flush: bool, queued: bool | None,
              warmup_ms: float = 25.0, rep_ms: float = 100.0, chunk: int = 200) -> float:
    """Median GPU time of ``fn`` with events around each call, as ``do_bench`` (estimate,
    warm-up, repetitions), with the L2 flush on or off and, when ``queued`` (None: when the
    estimate is under ``SHORT_KERNEL_MS``, as ``timing.bench`` decides), the calls queued
    behind a sleep kernel in chunks so that host launch gaps do not show."""
    import torch

    from flashtune.autotune.timing import _SLEEP_CYCLES_PER_MS, FLUSH_BYTES, SHORT_KERNEL_MS

    cache = torch.empty(FLUSH_BYTES // 4, dtype=torch.int32, device="cuda") if flush else None
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    start.record()
    for _ in range(5):
        if cache is not None:
            cache.zero_()
        fn()
    end.record()
    torch.cuda.synchronize()
    host = (time.perf_counter() - t0) * 1e3 / 5
    est = max(start.elapsed_time(end) / 5, 1e-3)
    if queued is None:
        queued = est < SHORT_KERNEL_MS
    for _ in range(max(1, int(warmup_ms / est))):
        fn()
    n = max(5, int(rep_ms / est))
    times: list[float] = []
    while len(times) < n:
        m = min(chunk, n - len(times)) if queued else n
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(m)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(m)]
        if queued:
            torch.cuda.synchronize()
            torch.cuda._sleep(int((1.0 + 2.0 * m * host) * _SLEEP_CYCLES_PER_MS))
        for s, e in zip(starts, ends):
            if cache is not None:
                cache.zero_()
            s.record()
            fn()
            e.record()
        torch.cuda.synchronize()
        times.extend(s.elapsed_time(e) for s, e in zip(starts, ends))
    return _median(times)


def heat(seconds: float) -> None:
    """Keep the GPU busy with bf16 8192^3 matmuls for ``seconds`` (the heat of bench's
    matmul ceiling and of its rotation through other implementations)."""
    if seconds <= 0:
        return
    import torch

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    t_end = time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        for _ in range(10):
            a @ b
        torch.cuda.synchronize()


@contextlib.contextmanager
def serving(fwd: Mapping[str, int] | None = None,
            bwd: Mapping[str, int] | None = None) -> Iterator[None]:
    """Make the runtime's attn_fwd / attn_bwd dispatchers serve these configs (as if tuned
    exactly for the problem) while the block runs; the memoised routes and launch plans are
    dropped on entry and exit, so a plan built for another config is never reused."""
    from flashtune.runtime import routing
    from flashtune.runtime.lookup import ConfigChoice

    patched = []
    for dispatcher, cfg, template in ((routing._DISPATCH, fwd, "attn_fwd"),
                                      (routing._DISPATCH_BWD, bwd, "attn_bwd")):
        if cfg is None:
            continue
        choice = ConfigChoice(dict(cfg), "exact", origin="timing_parity", template=template)
        dispatcher.choose = (lambda problem, device, c=choice: c)
        patched.append(dispatcher)
    routing._FAST.clear()
    routing._PLANS.clear()
    try:
        yield
    finally:
        for dispatcher in patched:
            del dispatcher.choose
        routing._FAST.clear()
        routing._PLANS.clear()


@dataclass
class Job:
    """How one slot is checked and measured. ``fn`` is the call checked against fp32 (its
    output through ``extract`` goes to ``Case.error``) and, with ``timer``, timed; ``run``
    instead measures itself and returns figures for one or more slots."""

    slot: tuple[str, str]
    fn: Callable[[], Any] | None = None
    timer: Callable[[Callable[[], Any]], float] | None = None
    extract: Callable[[Any], Any] = _same
    context: Callable[[], Any] = contextlib.nullcontext
    run: Callable[[], dict[tuple[str, str], float]] | None = None
    host: bool = True  # measure its host time once


@dataclass
class ShapeRun:
    """Builds the jobs of one shape on the tuner's inputs (its :class:`LocalRunner`)."""

    shape: Shape
    device: Any
    on_gpu: bool
    cold_s: float = 2.0
    heat_s: float = 2.0
    baselines: Sequence[str] = BASELINES
    configs: dict[str, dict[str, int]] = field(default_factory=dict)
    errors: dict[tuple[str, str], str] = field(default_factory=dict)
    bench_errs: dict[tuple[str, str], float] = field(default_factory=dict)
    notes: dict[tuple[str, str], str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        from flashtune.autotune.runners import LocalRunner
        from flashtune.core.case import TOLERANCE
        from flashtune.kernel_templates import get_template

        p = self.shape.problem
        self.spec = get_template("attn_fwd" if self.shape.op == "fwd" else "attn_bwd")
        self.fwd_spec = get_template("attn_fwd")
        self.runner = LocalRunner(self.spec, p, self.device, seed=0)
        self.case = self.runner.case
        self.tol = TOLERANCE[p.dtype]
        self.flops = float(self.case.flops)
        self.checked: dict[int, tuple[float | None, str | None]] = {}
        self._cache: dict[str, Any] = {}

    # -- configs --------------------------------------------------------------------------

    def check(self, fn: Callable[[], Any], extract: Callable[[Any], Any] = _same,
              context: Callable[[], Any] = contextlib.nullcontext
              ) -> tuple[float | None, str | None]:
        """(relative error vs fp32, why it must not be timed or None), once per ``fn``."""
        found = self.checked.get(id(fn))
        if found is not None:
            return found
        try:
            with context():
                out = fn()
                _sync(self.on_gpu)
                err = float(self.case.error(extract(out)))
            result: tuple[float | None, str | None] = (
                (err, None) if err < self.tol else
                (err, f"relative error {err:.3g} >= {self.tol:g} vs fp32; not timed"))
        except Exception as exc:  # noqa: BLE001 - a failure is data
            result = (None, _first_line(exc))
        self.checked[id(fn)] = result
        return result

    def choose_configs(self, others: Sequence[Mapping[str, int]],
                       extra: Mapping[str, Mapping[str, int]] = ()) -> dict[str, dict[str, int]]:
        """The default, the first candidate of ``others`` that the space accepts and that
        checks against fp32 (label ``other``), and ``extra`` (label -> config) not equal to
        either."""
        space, p = self.spec.space, self.shape.problem
        default = space.validate(self.spec.default_config(p, self.device))
        configs = {DEFAULT: default}
        for cand in others:
            try:
                cfg = space.validate(cand)
            except Exception as exc:  # noqa: BLE001
                log.warning("%s: candidate %s refused: %s", self.shape.name, cand, exc)
                continue
            reason = space.check(cfg, p, self.device)
            if cfg == default or reason is not None:
                log.info("%s: candidate %s skipped: %s", self.shape.name, cfg,
                         reason or "the default")
                continue
            err, why = self.check(self._launch(cfg))
            if why is None:
                configs["other"] = cfg
                break
            log.warning("%s: candidate %s failed its check: %s", self.shape.name, cfg, why)
        for label, cand in dict(extra).items():
            try:
                cfg = space.validate(cand)
            except Exception as exc:  # noqa: BLE001
                log.warning("%s: %s config %s refused: %s", self.shape.name, label, cand, exc)
                continue
            if cfg not in configs.values():
                configs[label] = cfg
        self.configs = configs
        return configs

    # -- calls ----------------------------------------------------------------------------

    def _launch(self, cfg: Mapping[str, int]) -> Callable[[], Any]:
        key = ("launch", json.dumps(dict(cfg), sort_keys=True))
        if key not in self._cache:
            case = self.case
            self._cache[key] = lambda: case.launch(cfg)
        fn: Callable[[], Any] = self._cache[key]
        return fn

    def _views(self) -> dict[str, Any]:
        """The case's tensors in (B, N, H, D) storage, viewed as (B, H, N, D): same values."""
        if "views" not in self._cache:
            names = ("q", "k", "v", "do") if self.shape.op == "bwd" else ("q", "k", "v")
            self._cache["views"] = {n: self.case.inputs[n].transpose(1, 2).contiguous()
                                   .transpose(1, 2) for n in names}
        views: dict[str, Any] = self._cache["views"]
        return views

    def _fwd_fn(self, cfg: Mapping[str, int], variant: str) -> tuple[Callable[[], Any],
                                                                     Callable[[Any], Any],
                                                                     Callable[[], Any]]:
        import flashtune

        p, x = self.shape.problem, self.case.inputs
        q, k, v = x["q"], x["k"], x["v"]
        causal = p.causal
        launcher = self.spec.launcher
        if variant == "lse":
            return (lambda: launcher(q, k, v, cfg, causal=causal, return_lse=True),
                    lambda o: o[0], contextlib.nullcontext)
        if variant == "layout_bnhd":
            b = self._views()
            return (lambda: launcher(b["q"], b["k"], b["v"], cfg, causal=causal), _same,
                    contextlib.nullcontext)
        if variant == "tma_off":
            off = {**cfg, "USE_TMA": 0}
            return (lambda: launcher(q, k, v, off, causal=causal), _same,
                    contextlib.nullcontext)
        if variant in ("runtime", "runtime_events"):
            return (lambda: flashtune.attention(q, k, v, causal=causal, config=cfg), _same,
                    contextlib.nullcontext)
        if variant == "runtime_served":
            return (lambda: flashtune.attention(q, k, v, causal=causal), _same,
                    lambda: serving(fwd=cfg))
        if variant == "runtime_bnhd":
            b = self._views()
            return (lambda: flashtune.attention(b["q"], b["k"], b["v"], causal=causal), _same,
                    lambda: serving(fwd=cfg))
        return self._launch(cfg), _same, contextlib.nullcontext

    def _bwd_fn(self, cfg: Mapping[str, int], variant: str) -> tuple[Callable[[], Any],
                                                                     Callable[[Any], Any],
                                                                     Callable[[], Any]]:
        import torch

        import flashtune

        p, x = self.shape.problem, self.case.inputs
        q, k, v, do, out, lse = (x[n] for n in ("q", "k", "v", "do", "out", "lse"))
        causal = p.causal
        launcher = self.spec.launcher
        if variant == "layout_bnhd":
            b = self._views()
            return (lambda: launcher(b["q"], b["k"], b["v"], out, lse, b["do"], cfg,
                                     causal=causal), _same, contextlib.nullcontext)
        if variant == "tma_off":
            off = {**cfg, "USE_TMA": 0}
            return (lambda: launcher(q, k, v, out, lse, do, off, causal=causal), _same,
                    contextlib.nullcontext)
        if variant in ("runtime", "runtime_events", "runtime_bnhd"):
            fwd_cfg = self.fwd_spec.default_config(p, self.device)
            if variant == "runtime_bnhd":
                b = self._views()
                leaves = [b[n].transpose(1, 2).detach().requires_grad_(True)
                          for n in ("q", "k", "v")]
                inputs = [t.transpose(1, 2) for t in leaves]  # (B,H,N,D) views of the leaves
                dout = b["do"]
            else:
                inputs = [t.detach().requires_grad_(True) for t in (q, k, v)]
                dout = do
            o = flashtune.attention(*inputs, causal=causal, config=fwd_cfg)

            def grads() -> Any:
                return torch.autograd.grad(o, inputs, dout, retain_graph=True)
            return grads, _same, lambda: serving(bwd=cfg)
        return self._launch(cfg), _same, contextlib.nullcontext

    def _sdpa_fn(self, name: str) -> Callable[[], Any]:
        """SDPA backend ``name`` on the case's inputs (the backward through autograd). A
        backend that refuses GQA gets K/V repeated to the query heads (outside the timed
        call for the forward, inside the graph for the backward), with a note."""
        import torch

        from flashtune.runtime.bench import _sdpa

        p, x = self.shape.problem, self.case.inputs
        group = p.heads_q // p.heads_kv

        def build(expand: bool) -> Callable[[], Any]:
            if self.shape.op == "fwd":
                k, v = x["k"], x["v"]
                if expand:
                    k, v = (t.repeat_interleave(group, dim=1) for t in (k, v))
                return _sdpa(name, x["q"], k, v, p.causal)
            leaves = [x[n].detach().requires_grad_(True) for n in ("q", "k", "v")]
            q, k, v = leaves
            if expand:
                k, v = (t.repeat_interleave(group, dim=1) for t in (k, v))
            o = _sdpa(name, q, k, v, p.causal)()
            do = x["do"]
            return lambda: torch.autograd.grad(o, leaves, do, retain_graph=True)

        if group == 1:
            return build(False)
        try:
            fn = build(False)
            fn()
            return fn
        except Exception as exc:  # noqa: BLE001 - e.g. a backend without GQA
            self.notes[(SDPA, name)] = (f"K/V repeated to {p.heads_q} heads: the backend "
                                        f"refused GQA ({_first_line(exc)[:80]})")
            return build(True)

    # -- timers ---------------------------------------------------------------------------

    def _timer(self, variant: str) -> Callable[[Callable[[], Any]], float]:
        if not self.on_gpu:
            from flashtune.runtime.bench import _wall_ms

            return lambda fn: _wall_ms(fn, CPU_REPS)
        from triton.testing import do_bench

        from flashtune.autotune.timing import bench, bench_graph, bench_queued

        def tuner_way(fn: Callable[[], Any]) -> float:
            return bench(fn).median_ms

        def cold(fn: Callable[[], Any]) -> float:
            time.sleep(self.cold_s)
            return bench(fn).median_ms

        def hot(fn: Callable[[], Any]) -> float:
            heat(self.heat_s)
            return bench(fn).median_ms

        def events(fn: Callable[[], Any]) -> float:
            return float(do_bench(fn, warmup=25, rep=100, quantiles=[0.5, 0.2, 0.8])[0])

        return {
            "cold": cold, "hot": hot, "events": events, "runtime_events": events,
            "no_flush": lambda fn: events_ms(fn, flush=False, queued=None),
            "queued": lambda fn: bench_queued(fn).median_ms,
            "graph": lambda fn: bench_graph(fn),
            "long": lambda fn: events_ms(fn, flush=True, queued=None,
                                         warmup_ms=LONG_WARMUP_MS, rep_ms=LONG_REP_MS),
        }.get(variant, tuner_way)

    # -- jobs -----------------------------------------------------------------------------

    def job(self, slot: tuple[str, str]) -> Job:
        label, variant = slot
        if label == SDPA:
            return Job(slot, fn=self._sdpa_fn(variant), timer=self._timer(variant))
        cfg = self.configs[label]
        if variant == TUNER:
            return Job(slot, fn=self._launch(cfg),
                       timer=lambda fn: self.runner.time_config(cfg)[0])
        if variant == "tuner_trial":
            return Job(slot, fn=self._launch(cfg), run=lambda: self._trial(slot, cfg),
                       host=False)
        if variant == "bench":
            return Job(slot, run=lambda: self._bench(cfg, first=self._first_bench(label)),
                       host=False)
        make = self._fwd_fn if self.shape.op == "fwd" else self._bwd_fn
        fn, extract, context = make(cfg, variant)
        return Job(slot, fn=fn, timer=self._timer(variant), extract=extract, context=context)

    def _first_bench(self, label: str) -> bool:
        others = [c for c in self.configs if c != DEFAULT]
        return not others or label == others[0]

    def _trial(self, slot: tuple[str, str], cfg: Mapping[str, int]) -> dict[tuple[str, str],
                                                                          float]:
        res = self.runner.evaluate(cfg)
        if not res.ok or res.median_ms is None:
            raise RuntimeError(f"trial {res.state.value}: {res.message}")
        return {slot: float(res.median_ms)}

    def _bench(self, cfg: Mapping[str, int], *, first: bool) -> dict[tuple[str, str], float]:
        """One ``_bench_problem`` call (rounds=1): ``flashtune`` is ``cfg`` and
        ``flashtune_default`` the default, in bench's rotation with the SDPA baselines."""
        from flashtune.runtime.bench import _bench_problem
        from flashtune.runtime.lookup import ConfigChoice

        label = next(lbl for lbl, c in self.configs.items() if c == dict(cfg))
        baselines = list(self.baselines) if self.on_gpu else []
        row = _bench_problem(self.shape.problem, self.spec, ConfigChoice(dict(cfg), "explicit"),
                             self.device, "cuda" if self.on_gpu else "cpu", baselines, 1)
        names = {"flashtune": (label, "bench")}
        if first:
            if label != DEFAULT:
                names["flashtune_default"] = (DEFAULT, "bench")
            names.update({b: (SDPA, f"bench:{b}") for b in baselines})
        got: dict[tuple[str, str], float] = {}
        for name, slot in names.items():
            entry = row.get(name, {})
            if "median_ms" in entry:
                got[slot] = float(entry["median_ms"])
                self.bench_errs[slot] = float(entry["rel_err_vs_fp32"])
            elif "error" in entry:
                self.errors.setdefault(slot, str(entry["error"]))
        if (label, "bench") not in got:
            raise RuntimeError(self.errors.get((label, "bench"), "bench did not time it"))
        return got


# -- the run ---------------------------------------------------------------------------------

def _row(shape: Shape, label: str, variant: str, flops: float,
         configs: Mapping[str, Mapping[str, int]]) -> dict[str, Any]:
    v = VARIANT_BY_NAME.get(variant)
    if label == SDPA:
        factor = (BASELINE_FACTOR if not variant.startswith("bench:")
                  else "torch SDPA backend timed inside bench's rotation")
    else:
        factor = v.factor if v is not None else variant
    return {"shape": shape.name, "op": shape.op, "config": label, "variant": variant,
            "factor": factor, "flops": flops, "round_ms": [], "host_ms": None,
            "rel_err": None, "error": None,
            "config_values": dict(configs[label]) if label in configs else None}


def served_choice(shape: Shape, device: Any, db_url: str | None) -> dict[str, Any]:
    """What the lookup chain serves for ``shape`` (the tuning database ``db_url`` or the
    default one, ``$FLASHTUNE_CONFIG_DIR``, the shipped configs), with its recorded
    figures: the number recorded for what users get."""
    from flashtune.kernel_templates import get_template
    from flashtune.runtime.lookup import Dispatcher

    d = Dispatcher(get_template("attn_fwd" if shape.op == "fwd" else "attn_bwd"))
    d.reload(db_url=db_url)
    c = d.choose(shape.problem, device)
    return {"config": dict(c.config), "source": c.source, "origin": c.origin,
            "recorded_ms": c.median_ms, "recorded_tflops": c.tflops,
            "tuned_problem": c.tuned_problem.key() if c.tuned_problem else None}


def run_shape(shape: Shape, device: Any, *, on_gpu: bool, rounds: int, cold_s: float,
              heat_s: float, baselines: Sequence[str], extra: Mapping[str, Mapping[str, int]],
              deadline: float | None = None, lookup: bool = False,
              db_url: str | None = None) -> dict[str, Any]:
    """Check and time every slot of ``shape`` for ``rounds`` interleaved rounds (fewer when
    ``deadline``, a ``time.monotonic()`` value, would be passed); returns the shape's
    result with its raw rows. With ``lookup``, the config the lookup chain serves is timed
    too (label ``served``) unless it is one of the others."""
    t0 = time.monotonic()
    sr = ShapeRun(shape, device, on_gpu, cold_s=cold_s, heat_s=heat_s,
                  baselines=baselines if on_gpu else ())
    served = served_choice(shape, device, db_url) if lookup else None
    if served is not None and served["source"] != "default":
        extra = {"served": served["config"], **extra}
    configs = sr.choose_configs(shape.others, extra)
    if served is not None:
        try:
            want = sr.spec.space.validate(served["config"])
        except Exception:  # noqa: BLE001 - refused above with a warning
            want = None
        served["label"] = next((lbl for lbl, c in configs.items() if c == want), None)
    tma = [lbl for lbl, c in configs.items() if c.get("USE_TMA", 0)]
    slots = plan_round(shape.op, list(configs), on_gpu=on_gpu, tma_labels=tma,
                       baselines=sr.baselines)
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    jobs: dict[tuple[str, str], Job] = {}
    hosts: dict[int, float] = {}
    for slot in slots:
        rows[slot] = _row(shape, *slot, sr.flops, configs)
        try:
            jobs[slot] = sr.job(slot)
        except Exception as exc:  # noqa: BLE001 - a call that cannot be built is data
            rows[slot]["error"] = _first_line(exc)
            continue
        job = jobs[slot]
        if job.fn is not None:  # every timed call is checked once, first
            err, why = sr.check(job.fn, job.extract, job.context)
            rows[slot]["rel_err"] = err
            if why is not None:
                rows[slot]["error"] = why
                del jobs[slot]
                continue
            if job.host:
                try:
                    if id(job.fn) not in hosts:  # calls shared by timing variants: once
                        with job.context():
                            hosts[id(job.fn)] = host_ms(job.fn, on_gpu)
                    rows[slot]["host_ms"] = hosts[id(job.fn)]
                except Exception as exc:  # noqa: BLE001
                    rows[slot]["error"] = _first_line(exc)
                    del jobs[slot]
    round_s: list[float] = []
    for r in range(max(1, rounds)):
        if r and deadline is not None and round_s \
                and time.monotonic() + max(round_s) > deadline:
            log.warning("%s: stopping after %d round(s) to stay within the budget",
                        shape.name, r)
            break
        t_round = time.monotonic()
        for slot in slots:
            job = jobs.get(slot)
            if job is None:
                continue
            try:
                with job.context():
                    if job.run is not None:
                        got = job.run()
                    else:
                        assert job.fn is not None and job.timer is not None
                        got = {slot: float(job.timer(job.fn))}
            except Exception as exc:  # noqa: BLE001 - a failed timing is data
                rows[slot]["error"] = _first_line(exc)
                del jobs[slot]
                continue
            for key, ms in got.items():
                if key not in rows:
                    rows[key] = _row(shape, *key, sr.flops, configs)
                rows[key]["round_ms"].append(ms)
        round_s.append(time.monotonic() - t_round)
        log.info("%s: round %d in %.1f s", shape.name, r + 1, round_s[-1])
    for key, why in sr.errors.items():
        if key in rows and not rows[key]["round_ms"]:
            rows[key]["error"] = rows[key]["error"] or why
    for key, err in sr.bench_errs.items():
        if key in rows:
            rows[key]["rel_err"] = err
    for key, note in sr.notes.items():
        if key in rows:
            rows[key]["note"] = note
    order = {v.name: i for i, v in enumerate(VARIANTS)}
    labels = [*configs, SDPA]
    ordered = sorted(rows.values(), key=lambda r: (labels.index(r["config"]),
                                                   order.get(r["variant"], len(order)),
                                                   r["variant"]))
    return {"name": shape.name, "op": shape.op, "note": shape.note,
            "problem": shape.problem.key(), "label": shape.problem.describe(),
            "flops": sr.flops, "configs": configs, "served": served, "rounds": len(round_s),
            "round_s": round_s, "wall_s": time.monotonic() - t0, "rows": ordered}


def run_parity(shapes: Sequence[Shape], *, rounds: int = 3, cold_s: float = 2.0,
               heat_s: float = 2.0, baselines: Sequence[str] = BASELINES,
               extra: Mapping[str, Mapping[str, Mapping[str, int]]] | None = None,
               budget_s: float | None = None, device: Any = None, lookup: bool = False,
               db_url: str | None = None,
               on_shape: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Run every shape (see :func:`run_shape`); the GPU when there is one, else the Triton
    interpreter on CPU tensors (tiny shapes only: timings there mean nothing). ``extra``:
    shape name -> {label: config} of configs to time besides the default and the other.
    ``lookup``/``db_url``: also time what the lookup chain serves (see :func:`run_shape`).
    Returns the JSON-ready result, ``summary`` included."""
    import torch
    import triton

    from flashtune.core.device import current_device, interpreter_device, interpreting
    from flashtune.kernel_templates import get_template

    on_gpu = torch.cuda.is_available() and not interpreting()
    if device is None:
        device = current_device() if on_gpu else interpreter_device()
    t0 = time.monotonic()
    result: dict[str, Any] = {
        "benchmark": "timing parity: tuner vs bench vs runtime (issue 22 item 7)",
        "device": device.to_dict(), "torch": torch.__version__, "triton": triton.__version__,
        "source_hash": {n: get_template(n).source_hash for n in ("attn_fwd", "attn_bwd")},
        "host": platform.node(), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "on_gpu": on_gpu, "rounds": rounds, "cold_s": cold_s, "heat_s": heat_s,
        "variants": {v.name: v.factor for v in VARIANTS}, "shapes": [], "summary": []}
    for i, shape in enumerate(shapes):
        deadline = None
        if budget_s is not None:  # the time left, shared by the shapes left
            left = budget_s - (time.monotonic() - t0)
            deadline = time.monotonic() + left / (len(shapes) - i)
        log.info("%s: %s", shape.name, shape.problem.describe())
        done = run_shape(shape, device, on_gpu=on_gpu, rounds=rounds, cold_s=cold_s,
                         heat_s=heat_s, baselines=baselines,
                         extra=(extra or {}).get(shape.name, {}), deadline=deadline,
                         lookup=lookup, db_url=db_url)
        result["shapes"].append(done)
        result["summary"] = summarize([r for s in result["shapes"] for r in s["rows"]])
        result["wall_s"] = time.monotonic() - t0
        if on_shape is not None:
            on_shape(result)
        if on_gpu:
            torch.cuda.empty_cache()
    result["all_checked"] = all(r["error"] is None for s in result["shapes"]
                                for r in s["rows"])
    return result


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/timing_parity_h100.json")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--shapes", default=",".join(SHAPE_NAMES),
                    help="comma-separated, from: " + ", ".join(SHAPE_NAMES))
    ap.add_argument("--cold-s", type=float, default=2.0,
                    help="idle seconds before the 'cold' variant")
    ap.add_argument("--heat-s", type=float, default=2.0,
                    help="seconds of matmuls before the 'hot' variant")
    ap.add_argument("--budget-s", type=float, default=420.0,
                    help="wall budget: later rounds are skipped to stay within it")
    ap.add_argument("--baselines", default=",".join(BASELINES))
    ap.add_argument("--db", default=None, metavar="URL",
                    help="the tuning database the lookup chain reads for the 'served' config "
                         "(default: $FLASHTUNE_DB or the default one, then the shipped configs)")
    ap.add_argument("--other", action="append", default=[], metavar="NAME=JSON",
                    help="a shape's 'other' config (repeatable)")
    return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from flashtune.core.device import interpreting

    if not torch.cuda.is_available() or interpreting():
        raise SystemExit("timing_parity.py times on a CUDA GPU (its shapes would take hours "
                         "under the Triton interpreter); tests/autotune_tests/"
                         "test_timing_parity.py runs its logic on tiny shapes on the CPU")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s",
                        stream=sys.stderr)
    log.setLevel(logging.INFO)
    by_name = {s.name: s for s in gpu_shapes()}
    names = [n for n in args.shapes.split(",") if n]
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise SystemExit(f"unknown shapes {unknown}; known: {', '.join(by_name)}")
    shapes = [by_name[n] for n in names]
    for item in args.other:
        name, _, text = item.partition("=")
        if name not in by_name:
            raise SystemExit(f"--other {item!r}: unknown shape {name!r}")
        shapes = [Shape(s.name, s.op, s.problem, (json.loads(text),), s.note)
                  if s.name == name else s for s in shapes]
    baselines = [b for b in args.baselines.split(",") if b]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save(result: dict[str, Any]) -> None:  # after every shape: a cut-off run keeps it
        out.write_text(json.dumps(result, indent=1, default=str))

    result = run_parity(shapes, rounds=args.rounds, cold_s=args.cold_s, heat_s=args.heat_s,
                        baselines=baselines, budget_s=args.budget_s, lookup=True,
                        db_url=args.db, on_shape=save)
    save(result)
    dev = result["device"]
    print(f"timing parity on {dev.get('name')} ({result['torch']}, triton "
          f"{result['triton']}), {result['wall_s']:.0f} s, all checked: "
          f"{result['all_checked']}")
    for s in result["shapes"]:
        print(f"{s['name']}: {s['label']} ({s['rounds']} rounds); "
              + "; ".join(f"{lbl} {json.dumps(c, separators=(',', ':'))}"
                          for lbl, c in s["configs"].items()))
        served = s.get("served") or {}
        if served:
            rec = served.get("recorded_tflops")
            print(f"  the lookup chain serves {served.get('label') or served['config']} "
                  f"({served['source']}, {served['origin']}"
                  + (f", recorded {rec:.1f} TFLOP/s" if rec else "") + ")")
    print(render_table(result["summary"], {s["name"]: s["label"] for s in result["shapes"]}))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
