"""``flashtune bench``: the forward (``--template attn_bwd``: the backward) against torch's
attention backends, one run.

Problems: the standard grid (:func:`flashtune.autotune.grids.standard_grid`: the
FlashAttention papers' grid, batch x seqlen = 16384 tokens, hidden 2048 = heads x head dim,
``--head-dims`` x ``--seqlens``, causal and not) by default, or one shape (the shape
options), ``--plan FILE`` or ``--preset NAME`` as for ``flashtune tune``. Per problem it
times the config the dispatcher serves from the database (``--db``: tuned exact or nearest,
else the default), the template default, and SDPA's flash / cuDNN / efficient backends and
FlexAttention, each checked against fp32 first (see :mod:`flashtune.runtime.bench`).
Prints a table, writes the run as JSON (``--out``; rewritten after every shape, so a cut-off
run keeps what it measured) and a PNG plot (``--plot``). Both paths are checked before
anything runs (their folders are created then), and the table is printed before the plot
is drawn.

Without a CUDA GPU (or with ``--interpret``) it runs under the Triton interpreter on CPU
tensors, which checks the pipeline and numerics on small shapes; its timings mean nothing.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import click

from flashtune.cli.bench_modes import (
    MODEL_BASELINES,
    MODEL_FAMILIES,
    MODEL_OPTIONS,
    run_dispatch_bench,
    run_model_bench,
)
from flashtune.cli.options import (
    TemplateChoice,
    check_head_dims,
    check_output,
    check_template_op,
    db_url,
    fail,
    parse_ints,
    shape_options,
)
from flashtune.cli.tune_commands import (
    _SHAPE_NAMES,
    _decide_interpret,
    _problems,
    _table,
    format_tflops,
    refuse_under_interpreter,
)

__all__ = ["bench_command", "render_bench"]

STANDARD_SEQLENS = "512,1024,2048,4096,8192,16384"
_SHORT = {"flashtune": "flashtune", "flashtune_default": "default", "sdpa_flash": "sdpa flash",
          "sdpa_cudnn": "sdpa cudnn", "sdpa_efficient": "sdpa efficient", "flex": "flex"}


def render_bench(result: Mapping[str, Any]) -> str:
    """The closing table: TFLOP/s per implementation and shape, flashtune's ratios to SDPA
    flash and cuDNN, its fraction of the matmul ceiling; then the geomeans."""
    from flashtune.runtime.bench import IMPLS, SPREAD_NOTE, tflops_of

    rows = result["rows"]
    own = sorted({n for r in rows for n in r if n.startswith("impl_")})
    impls = [n for n in (*IMPLS[:2], *own, *IMPLS[2:]) if any(n in r for r in rows)]
    ceiling = result.get("ceiling_tflops")
    header = ["shape", "route", *(_SHORT.get(n, n[len("impl_"):]) for n in impls),
              "vs flash", "vs cudnn", "of ceiling", "vs recorded"]
    body = []
    for r in rows:
        mine, fa2, cud = (tflops_of(r, n) for n in ("flashtune", "sdpa_flash", "sdpa_cudnn"))
        route = f"{r['implementation']} ({r['source']})" if "implementation" in r \
            else r["source"]
        body.append([r["label"], route,
                     *(format_tflops(t) if (t := tflops_of(r, n)) else
                       ("error" if "error" in r.get(n, {}) else "-") for n in impls),
                     f"{mine / fa2:.2f}x" if mine and fa2 else "-",
                     f"{mine / cud:.2f}x" if mine and cud else "-",
                     f"{mine / ceiling:.0%}" if mine and ceiling else "-",
                     f"{r['drift']:.2f}x" if r.get("drift") else "-"])
    lines = [_table(header, body, right=set(range(2, len(header))))]
    s = result.get("summary", {})
    parts = [f"{label} {s[key]:.2f}x" for key, label in (
        ("flashtune_vs_flashtune_default_geomean", "vs default"),
        ("flashtune_vs_sdpa_flash_geomean", "vs SDPA flash"),
        ("flashtune_vs_sdpa_cudnn_geomean", "vs SDPA cuDNN"),
        ("flashtune_vs_flex_geomean", "vs FlexAttention"),
        ("flashtune_vs_best_baseline_geomean", "vs the fastest baseline of each shape"),
        ("flashtune_vs_best_baseline_min", "its minimum")) if s.get(key)]
    if parts:
        lines.append("flashtune (geomean): " + ", ".join(parts))
    if ceiling:
        lines.append(f"bf16 matmul ceiling measured in this run: {ceiling:.0f} TFLOP/s")
    if s.get("drift_geomean"):
        lines.append(f"stored winners measured against their recorded TFLOP/s: geomean "
                     f"{s['drift_geomean']:.2f}x (min {s['drift_min']:.2f}x, max "
                     f"{s['drift_max']:.2f}x); below 0.95x: re-tune (flashtune tune ...)")
    if s.get("round_spread"):
        lines.append(f"round medians more than {SPREAD_NOTE:.0%} apart (a ratio there is "
                     "that uncertain): "
                     + "; ".join(f"{_SHORT.get(n, n.removeprefix('impl_'))} on "
                                 f"{v['shapes']} shape(s), at most {v['max']:.0%} ({v['at']})"
                                 for n, v in s["round_spread"].items()))
    errors = sorted({f"{n}: {r[n]['error']}" for r in rows for n in impls
                     if "error" in r.get(n, {})})
    for e in errors[:8]:
        lines.append(f"not timed: {e}")
    return "\n".join(lines)


# flashtune.runtime.bench.BENCH_OPS, spelled out: importing flashtune.runtime imports torch
# (tests/cli_tests/test_options.py checks that the two agree)
BENCH_OPS = ("fwd", "bwd")


@click.command("bench")
@click.option("--template", type=TemplateChoice(listed=False), default="attn_fwd",
              show_default=True, help="The forward, or the backward (dQ, dK, dV given dO).")
@shape_options
@click.option("--plan", type=click.Path(dir_okay=False), default=None, metavar="FILE",
              help="TOML file of [[shape]] tables to benchmark.")
@click.option("--preset", "preset_name", default=None, metavar="NAME",
              help="Named problem set (as for tune).")
@click.option("--head-dims", default="64,128", show_default=True,
              help="Standard grid (when no shape, plan or preset is given: the "
                   "FlashAttention papers' grid, causal and not): head dims.")
@click.option("--seqlens", default=STANDARD_SEQLENS, show_default=True,
              help="Standard grid: sequence lengths (batch x seqlen = 16384 tokens, "
                   "heads x head dim = 2048).")
@click.option("--baselines", default="sdpa_flash,sdpa_cudnn,sdpa_efficient,flex",
              show_default=True, help="Baselines to time, comma-separated.")
@click.option("--rounds", type=click.IntRange(min=1), default=1, show_default=True,
              help="Time each implementation this many times in rotation (median kept).")
@click.option("--out", "out_path", type=click.Path(dir_okay=False), default="bench.json",
              show_default=True, help="Where to write the run as JSON.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None,
              help="Where to write the PNG plot (default: --out with .png).")
@click.option("--no-plot", is_flag=True, help="Do not draw the plot.")
@click.option("--interpret", is_flag=True,
              help="Run on CPU under the Triton interpreter (automatic without a GPU).")
@click.option("--train", is_flag=True,
              help="The training step: forward and backward as flashtune.attention runs a "
                   "call with gradients (the train op's choice), against the baselines' "
                   "forward and backward through autograd.")
@click.option("--model", "model_family", type=click.Choice(MODEL_FAMILIES), default=None,
              help="End to end in a transformers model (random weights, bf16): prefill or "
                   "inference at --seqlens with --batch, a training step, and for the "
                   "decoders (llama, mistral, gemma2, gemma3) greedy generation; "
                   "attn_implementation='flashtune' against sdpa as torch picks it and forced "
                   f"to each --baselines backend (default {MODEL_BASELINES}; mistral: "
                   "sdpa,sdpa_cudnn,flex_attention; gemma2: eager,flex_attention, its "
                   "reference eager: SDPA has no softcap). Presets: llama (Llama-3-8B layers, "
                   "8 of them), mistral (Mistral-7B layers, 8: every layer in a 4096-key "
                   "sliding window, the training step on 2 x 8192 tokens), gemma2 (Gemma-2-9B layers, 8: heads of 256, softcap 50, every "
                   "other layer in a 4096-key sliding window), gemma3 (Gemma-3-12B layers, 8: "
                   "heads of 256, local layers with a 1024-key sliding window), bert "
                   "(BERT-large), vit (ViT-L/16); --heads --kv-heads and the options below "
                   "override them.")
@click.option("--layers", type=click.IntRange(min=1), default=None, help="--model: layers.")
@click.option("--hidden", type=click.IntRange(min=1), default=None,
              help="--model: hidden size (heads x head dim; gemma3 keeps its head dim).")
@click.option("--intermediate", type=click.IntRange(min=1), default=None,
              help="--model: MLP width.")
@click.option("--train-batch", type=click.IntRange(min=1), default=None,
              help="--model: training step batch.")
@click.option("--train-seqlen", type=click.IntRange(min=1), default=None,
              help="--model: training step sequence length.")
@click.option("--gen-batch", type=click.IntRange(min=1), default=None,
              help="--model llama, mistral, gemma2, gemma3: prompts generated for at once.")
@click.option("--gen-prompt", type=click.IntRange(min=1), default=None,
              help="--model llama, mistral, gemma2, gemma3: prompt length before generating.")
@click.option("--new-tokens", type=click.IntRange(min=1), default=None,
              help="--model llama, mistral, gemma2, gemma3: tokens generated (greedy, KV cache).")
@click.option("--phases", default=None,
              help="--model: phases to run, comma-separated (decoders: prefill,train,"
                   "generate,generate_static,generate_new; "
                   "bert, vit: forward,train; default all).")
@click.option("--dispatch", is_flag=True,
              help="The host cost of one flashtune.attention call (small shapes, loops of "
                   "--calls calls) against torch's SDPA (as torch picks, and forced to flash "
                   "and cuDNN), the routed implementation's own launch and a bare Triton "
                   "launch; default shapes, or the one the shape options give.")
@click.option("--calls", type=click.IntRange(min=1), default=2000, show_default=True,
              help="--dispatch: calls per timed loop.")
@click.pass_context
def bench_command(ctx: click.Context, template: str, plan: str | None, preset_name: str | None,
                  head_dims: str, seqlens: str, baselines: str, rounds: int, out_path: str,
                  plot_path: str | None, no_plot: bool, interpret: bool, train: bool,
                  model_family: str | None, dispatch: bool, calls: int,
                  **shape: Any) -> None:
    """Benchmark the forward (or backward, or the training step): tuned and default
    flashtune vs SDPA and Flex; or, with --model, a transformers model end to end."""
    model_params = {k: shape.pop(k) for k in MODEL_OPTIONS}
    if dispatch:
        if model_family is not None:
            raise click.UsageError("give --dispatch or --model, not both")
        run_dispatch_bench(ctx, {**model_params, **shape, "calls": calls, "rounds": rounds,
                                 "out_path": out_path, "interpret": interpret})
        return
    if ctx.get_parameter_source("calls") is not click.core.ParameterSource.DEFAULT:
        raise click.UsageError("--calls only applies with --dispatch")
    if model_family is not None:
        run_model_bench(ctx, model_family, {
            **model_params, **shape, "seqlens": seqlens, "baselines": baselines,
            "rounds": rounds, "out_path": out_path, "interpret": interpret})
        return
    given = [f"--{k.replace('_', '-')}" for k in MODEL_OPTIONS
             if ctx.get_parameter_source(k) is not click.core.ParameterSource.DEFAULT]
    if given:
        raise click.UsageError(f"{', '.join(given)} only apply with --model")
    if train and ctx.get_parameter_source("template") \
            is not click.core.ParameterSource.DEFAULT:
        raise click.UsageError("--train benchmarks the training step of the routed forward; "
                               "give it without --template")
    dtype = shape.pop("dtype")
    names = [b for b in baselines.split(",") if b]
    interpreting = _decide_interpret(interpret)  # before anything imports triton
    from flashtune.runtime.bench import BASELINES

    unknown = [b for b in names if b not in BASELINES]
    if unknown:
        raise click.BadParameter(f"unknown baselines {unknown}; choose from "
                                 f"{', '.join(BASELINES)}", param_hint="'--baselines'")
    chosen = any(shape[n] not in (None, False) for n in _SHAPE_NAMES) or plan or preset_name
    if chosen:
        problems = _problems(shape, dtype, plan, preset_name)
    else:
        from flashtune.autotune.grids import standard_grid

        dims = parse_ints(head_dims, "--head-dims")
        check_head_dims(dims, "--head-dims")
        problems = standard_grid(dims, seqlens=parse_ints(seqlens, "--seqlens"),
                                 dtype=dtype or "bf16")
    plot = None if no_plot else Path(plot_path or Path(out_path).with_suffix(".png"))
    if plot is not None:
        try:
            from flashtune.report.plots import load_pyplot

            load_pyplot()
        except ImportError:
            from flashtune.report.plots import MATPLOTLIB_MISSING

            raise click.UsageError(MATPLOTLIB_MISSING + "; or pass --no-plot") from None
    check_template_op(template, BENCH_OPS)
    if interpreting:
        if not chosen:
            raise click.UsageError("the standard grid (batch x seqlen = 16384) would take hours "
                                   "under the Triton interpreter; give a small shape (--batch "
                                   "--heads --seqlen --head-dim) or --plan FILE")
        refuse_under_interpreter(problems, backward=template == "attn_bwd" or train,
                                 doing="benchmarking")
    out = Path(out_path)
    check_output(out, "--out")
    if plot is not None:
        check_output(plot, "--plot")
    from flashtune.runtime.bench import bench_attention

    partial: dict[str, Any] = {"rows": []}

    def write(path: Path, text: str) -> None:
        try:
            path.write_text(text)
        except OSError as exc:
            raise fail(exc) from exc

    def on_row(row: dict[str, Any]) -> None:
        partial["rows"].append(row)
        write(out, json.dumps(partial, indent=1))
        t = row.get("flashtune", {}).get("tflops")
        click.echo(f"{row['label']}: flashtune {format_tflops(t)} TFLOP/s" if t else
                   f"{row['label']}: flashtune not timed", err=True)

    result = bench_attention(problems, template=template, baselines=names, rounds=rounds,
                             db_url=db_url(ctx), on_row=on_row, train=train)
    write(out, json.dumps(result, indent=1))
    click.echo(render_bench(result))
    if plot is not None:
        from flashtune.report.plots import plot_bench

        try:
            plot_bench(result, plot)
        except OSError as exc:
            raise click.ClickException(f"wrote {out} but not the plot: "
                                       f"{' '.join(str(exc).split())}") from exc
    click.echo(f"wrote {out}" + (f" and {plot}" if plot is not None else ""))
