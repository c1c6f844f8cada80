"""The report's PNG plots, drawn with matplotlib's Agg backend (no display needed).

matplotlib is imported by :func:`load_pyplot` only, when a plot is drawn, so importing
this module (and ``flashtune --help``) stays light.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from flashtune.db.records import TrialState
from flashtune.report.studies import Importances, StudyReport, problem_label

__all__ = ["MATPLOTLIB_MISSING", "load_pyplot", "plot_bench", "plot_history",
           "plot_importances", "plot_summary"]

MATPLOTLIB_MISSING = ("flashtune report needs matplotlib, which is not installed: "
                      "pip install matplotlib (or pip install 'flashtune[report]')")

_COLORS = {"trial": "#1f77b4", "best": "#2ca02c", "default": "#ff7f0e", "median": "#7f7f7f",
           "failed": "#d62728", "pruned": "#9467bd"}


def load_pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend; ``ImportError`` when matplotlib is not
    installed (the CLI turns that into :data:`MATPLOTLIB_MISSING`)."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: Path) -> Path:
    plt = load_pyplot()
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=110)
    plt.close(fig)
    return path


def plot_history(study: StudyReport, path: Path) -> Path:
    """Trial number vs TFLOP/s (or median ms), completed trials as dots, the best so far as
    a step line, the template default and the stored best marked, failed trials as marks
    along the bottom (static prunes apart from the rest). Writes ``path``; returns it."""
    plt = load_pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    higher = study.uses_tflops
    points = [(t.number, v) for t in study.complete
              if (v := study.value(t)) is not None]
    if points:
        xs, ys = zip(*points)
        ax.scatter(xs, ys, s=18, color=_COLORS["trial"], label="completed trial", zorder=3)
        running: list[float] = []
        for y in ys:
            running.append(y if not running else (max if higher else min)(running[-1], y))
        ax.step(xs, running, where="post", color=_COLORS["best"], linewidth=1.6,
                label="best so far")
    default = study.default_trial
    if default is not None and study.value(default) is not None:
        ax.scatter([default.number], [study.value(default)], s=110, marker="*",
                   color=_COLORS["default"], label="template default", zorder=4)
    if study.best_value is not None:
        ax.axhline(study.best_value, color=_COLORS["best"], linestyle="--", linewidth=1,
                   label="stored best (re-timed)")
    # failed trials along the bottom edge: x in data units, y in axes units
    marks = ax.get_xaxis_transform()
    for kind, states, marker in (("pruned", {TrialState.PRUNED_STATIC}, "|"),
                                 ("failed", None, "x")):
        chosen = [t for t in study.failed
                  if (t.state in states if states else t.state is not TrialState.PRUNED_STATIC)]
        if chosen:
            names = sorted({t.state.value for t in chosen})
            ax.scatter([t.number for t in chosen], [0.03] * len(chosen), transform=marks,
                       marker=marker, s=40, color=_COLORS[kind], clip_on=False, zorder=4,
                       label=f"{', '.join(names)} ({len(chosen)})")
    if not points:
        ax.text(0.5, 0.35, "no completed trial in this database", transform=ax.transAxes,
                ha="center", va="center", color="#555555")
    ax.set_xlabel("trial number")
    ax.set_ylabel(f"{study.unit} ({'higher' if higher else 'lower'} is better)")
    ax.set_title(f"{study.device.name} {study.template.name}\n"
                 f"{problem_label(study.problem.key)}", fontsize=9)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, loc="best")
    return _save(fig, path)


def plot_importances(study: StudyReport, importances: Importances, path: Path) -> Path:
    """A horizontal bar per parameter, its share of the importance. Writes ``path``."""
    plt = load_pyplot()
    items = sorted(importances.values.items(), key=lambda kv: kv[1])
    fig, ax = plt.subplots(figsize=(6.0, 0.45 * len(items) + 1.4))
    ax.barh([k for k, _ in items], [v for _, v in items], color=_COLORS["trial"])
    for i, (_, v) in enumerate(items):
        ax.text(v, i, f" {v:.2f}", va="center", fontsize=8)
    ax.set_xlim(0, max(1.0, max(v for _, v in items) * 1.15))
    ax.set_xlabel("importance (PED-ANOVA, share of the total)")
    ax.set_title(f"parameter importances, {len(study.complete)} completed trials\n"
                 f"{study.device.name} {study.template.name} "
                 f"{problem_label(study.problem.key)}", fontsize=9)
    return _save(fig, path)


def plot_summary(studies: Sequence[StudyReport], path: Path) -> Path:
    """Per study a group of bars: the stored best (tuned), the template default's trial and
    the median completed trial, all in the studies' one unit (TFLOP/s or median ms: the
    caller passes studies of one unit). Writes ``path``; returns it."""
    plt = load_pyplot()
    unit = studies[0].unit
    n = len(studies)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * n + 2.0), 4.8))
    series: tuple[tuple[str, str, Callable[[StudyReport], float | None]], ...] = (
        ("tuned (stored best)", _COLORS["best"], lambda s: s.best_value),
        ("template default", _COLORS["default"],
         lambda s: s.value(s.default_trial) if s.default_trial else None),
        ("median trial", _COLORS["median"], lambda s: s.median_value))
    width = 0.8 / len(series)
    for i, (label, color, get) in enumerate(series):
        xs = [j + (i - 1) * width for j in range(n)]
        values = [get(s) for s in studies]
        ax.bar(xs, [v if v is not None else math.nan for v in values], width, color=color,
               label=label)
        for x, v in zip(xs, values):
            if v is None:
                ax.text(x, 0, "n/a", ha="center", va="bottom", fontsize=6, rotation=90)
    ax.set_xticks(range(n))
    ax.set_xticklabels([f"{s.device.name[:24]}\n{s.template.name}\n"
                        f"{problem_label(s.problem.key)}".replace(" Nq", "\nNq")
                        for s in studies], fontsize=6, rotation=0 if n <= 5 else 30,
                       ha="center" if n <= 5 else "right")
    ax.set_ylabel(f"{unit} ({'higher' if unit == 'TFLOP/s' else 'lower'} is better)")
    ax.set_title(f"tuned vs template default vs median trial ({unit})", fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


_BENCH_STYLE = {"flashtune": ("#2ca02c", "-", "o"), "flashtune_default": ("#98df8a", "--", "o"),
                "sdpa_flash": ("#1f77b4", "-", "s"), "sdpa_cudnn": ("#d62728", "-", "^"),
                "sdpa_efficient": ("#9467bd", ":", "v"), "flex": ("#ff7f0e", "-.", "D")}


def plot_bench(result: Mapping[str, Any], path: Path) -> Path:
    """A ``flashtune bench`` run (:func:`flashtune.runtime.bench.bench_attention`): TFLOP/s
    against the query length, one panel per (head dim, causal, dtype, GQA), one line per
    implementation (missing points: errored or unsupported there); the matmul ceiling as a
    dotted line when measured. Writes ``path``; returns it."""
    plt = load_pyplot()
    panels: dict[tuple[Any, ...], list[Mapping[str, Any]]] = {}
    for row in result["rows"]:
        p = row["problem"]
        key = (p["head_dim"], p["causal"], p["dtype"], p["heads_q"] // p["heads_kv"])
        panels.setdefault(key, []).append(row)
    n = max(1, len(panels))
    cols = min(n, 2)
    rows_n = -(-n // cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(6.0 * cols, 4.0 * rows_n), squeeze=False)
    ceiling = result.get("ceiling_tflops")
    for ax, (key, rows) in zip(axes.flat, sorted(panels.items())):
        d, causal, dtype, group = key
        rows = sorted(rows, key=lambda r: r["problem"]["seqlen_q"])
        xs = [r["problem"]["seqlen_q"] for r in rows]
        for name, (color, style, marker) in _BENCH_STYLE.items():
            ys = [r.get(name, {}).get("tflops") for r in rows]
            if any(y for y in ys):
                ax.plot(xs, [y if y else math.nan for y in ys], color=color, linestyle=style,
                        marker=marker, markersize=4, label=name)
        if ceiling:
            ax.axhline(ceiling, color="#7f7f7f", linestyle=":", linewidth=1,
                       label=f"bf16 matmul ceiling ({ceiling:.0f})")
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs)
        ax.set_xticklabels([str(x) for x in xs], fontsize=7)
        ax.set_xlabel("sequence length (Nq)")
        ax.set_ylabel("TFLOP/s")
        gqa = f", GQA {group}:1" if group > 1 else ""
        ax.set_title(f"D={d}, {'causal' if causal else 'non-causal'}, {dtype}{gqa}", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    device = result.get("device", {}).get("name", "")
    which = "backward" if result.get("benchmark") == "attn_bwd" else "forward"
    fig.suptitle(f"attention {which} on {device}", fontsize=11)
    return _save(fig, path)
