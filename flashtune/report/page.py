"""``flashtune report``'s output: PNG plots and one HTML page that shows them.

:func:`write_report` draws, per study, the optimisation history and (when there are enough
completed trials) the parameter importances, plus one summary bar chart per unit, and
writes ``index.html`` next to them. The page references the PNGs by relative name, so the
folder moves as a whole (copy it, zip it, serve it).
"""

from __future__ import annotations

import html
import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from flashtune.report.plots import plot_history, plot_importances, plot_summary
from flashtune.report.studies import StudyReport, param_importances, problem_label

__all__ = ["PAGE_NAME", "ReportFiles", "write_report"]

PAGE_NAME = "index.html"

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #222; }
table { border-collapse: collapse; font-size: 0.85em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.5em; text-align: left; }
td.num { text-align: right; }
img { max-width: 100%; border: 1px solid #eee; margin: 0.3em 0; }
.note { color: #666; font-style: italic; }
code { font-size: 0.85em; word-break: break-all; }
"""


@dataclass(frozen=True)
class ReportFiles:
    """What :func:`write_report` wrote: the page, the PNGs in order, the studies shown."""

    page: Path
    images: tuple[Path, ...]
    studies: int


def _slug(text: str, limit: int = 80) -> str:
    return re.sub(r"[^0-9A-Za-z.+-]+", "_", text).strip("_.")[:limit] or "study"


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def _speedup(study: StudyReport) -> str:
    best = study.best_value
    default = study.value(study.default_trial) if study.default_trial else None
    if not best or not default:
        return "-"
    return f"{(best / default) if study.uses_tflops else (default / best):.2f}x"


def _config(config: dict[str, object] | None) -> str:
    return "-" if not config else ", ".join(f"{k}={v}" for k, v in config.items())


def _summary_rows(studies: Sequence[StudyReport]) -> str:
    rows = []
    for i, s in enumerate(studies, 1):
        default = s.value(s.default_trial) if s.default_trial else None
        cells = [f'<a href="#study-{i}">{i}</a>', html.escape(s.device.name),
                 html.escape(f"{s.template.name}@{s.template.source_hash[:8]}"),
                 html.escape(problem_label(s.problem.key)),
                 f"{len(s.complete)} / {len(s.failed)}", html.escape(s.unit),
                 _fmt(s.best_value), _fmt(default), _fmt(s.median_value), _speedup(s),
                 html.escape(_config(s.best.config if s.best else None))]
        rows.append("<tr>" + "".join(
            f'<td class="num">{c}</td>' if 4 <= j <= 9 and j != 5 else f"<td>{c}</td>"
            for j, c in enumerate(cells)) + "</tr>")
    head = ("#", "device", "template", "shape", "completed / failed trials", "unit", "tuned",
            "default", "median trial", "tuned vs default", "best config")
    return ("<table><tr>" + "".join(f"<th>{h}</th>" for h in head) + "</tr>\n"
            + "\n".join(rows) + "</table>")


def _img(path: Path, alt: str) -> str:
    return f'<img src="{html.escape(path.name)}" alt="{html.escape(alt)}">'


def write_report(studies: Sequence[StudyReport], out_dir: Path, *, source: str,
                 filters: str = "") -> ReportFiles:
    """Draw the plots of ``studies`` into ``out_dir`` (created) and write its
    ``index.html``; ``source`` (the database URL, password hidden) and ``filters`` are
    shown on the page. Needs matplotlib (``ImportError`` otherwise); an empty ``studies``
    is a ``ValueError`` (the caller says there is nothing to report)."""
    if not studies:
        raise ValueError("no studies to report")
    out_dir.mkdir(parents=True, exist_ok=True)
    images: list[Path] = []
    sections: list[str] = []
    for i, study in enumerate(studies, 1):
        stem = f"study{i:03d}-" + _slug(f"{study.device.name}-{study.template.name}-"
                                         f"{study.problem.bucket}")
        history = plot_history(study, out_dir / f"{stem}-history.png")
        # the default in the study's own terms when it was measured (its space may be smaller)
        default = study.default_trial.config if study.default_trial else study.default_config
        images.append(history)
        best = study.best.config if study.best else None
        parts = [f'<h3 id="study-{i}">{i}. {html.escape(study.label())}</h3>',
                 (f"<p>{len(study.trials)} trials ({len(study.complete)} completed, "
                  f"{len(study.failed)} failed or pruned); best config: "
                  f"<code>{html.escape(_config(best))}</code>; template default: "
                  f"<code>{html.escape(_config(default))}</code>"
                  f"{'' if study.default_trial else ' (not measured in this study)'}</p>")]
        if study.study_name:
            parts.append(f"<p>Optuna study: <code>{html.escape(study.study_name)}</code></p>")
        if study.best is not None and not study.trials:
            parts.append('<p class="note">imported best config: no trials in this '
                         "database</p>")
        parts.append(_img(history, f"optimisation history of study {i}"))
        importances = param_importances(study)
        if importances.values:
            chart = plot_importances(study, importances, out_dir / f"{stem}-importance.png")
            images.append(chart)
            parts.append(_img(chart, f"parameter importances of study {i}"))
        else:
            parts.append(f'<p class="note">parameter importances skipped: '
                         f"{html.escape(importances.note or '')}</p>")
        sections.append("\n".join(parts))

    summary: list[str] = []
    for unit, name in (("TFLOP/s", "summary-tflops.png"), ("median ms", "summary-ms.png")):
        chosen = [s for s in studies if s.unit == unit and s.best_value is not None]
        if chosen:
            chart = plot_summary(chosen, out_dir / name)
            images.append(chart)
            summary.append(_img(chart, f"tuned vs default vs median trial, {unit}"))
    if not summary:
        summary.append('<p class="note">no study has a stored best config yet: no summary '
                       "chart</p>")
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    page = out_dir / PAGE_NAME
    page.write_text(f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>flashtune tuning report</title>
<style>{_STYLE}</style></head><body>
<h1>flashtune tuning report</h1>
<p>Database <code>{html.escape(source)}</code>{html.escape(filters)}, {len(studies)}
stud{'y' if len(studies) == 1 else 'ies'}, generated {when}.</p>
<h2>Tuned vs template default vs median trial</h2>
<p>Tuned: the stored best config, re-timed against the other top configs at the end of its
run. Default: the template default config's trial in the same study, as measured during the
search (absent when it was never measured there). Median trial: the median over the
study's completed trials, what a config picked at random gives. The database holds no
other baselines (SDPA, cuDNN): <code>benchmarks/</code> measures those.</p>
{chr(10).join(summary)}
{_summary_rows(studies)}
<h2>Studies</h2>
{chr(10).join(sections)}
</body></html>
""", encoding="utf-8")
    return ReportFiles(page, tuple(images), len(studies))
