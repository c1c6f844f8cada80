"""``flashtune bench``'s two modes beside the kernel benchmark: ``--model
llama|mistral|gemma2|gemma3|bert|vit`` (flashtune inside a transformers model against torch's SDPA,
end to end: see :mod:`flashtune.integrations.model_bench`) and ``--dispatch`` (the host cost
of one call: see :mod:`flashtune.runtime.dispatch_bench`).

The model's shape comes from a preset (:data:`~flashtune.integrations.model_bench.PRESETS`)
with ``--layers --hidden --heads --kv-heads --intermediate`` overriding it; the work from
the family's defaults with ``--batch --seqlens`` (inference), ``--train-batch
--train-seqlen``, ``--gen-batch --gen-prompt --new-tokens`` and ``--phases`` overriding it.
Without a GPU it says so and stops; ``--interpret`` runs the family's tiny model on CPU under
the Triton interpreter (the pipeline and numerics, not speed).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import click

from flashtune.cli.options import check_output, parse_ints
from flashtune.cli.tune_commands import _decide_interpret

__all__ = ["MODEL_FAMILIES", "MODEL_OPTIONS", "run_dispatch_bench", "run_model_bench"]

# flashtune.integrations.model_bench.FAMILIES, spelled out: that module imports torch and
# transformers (tests/cli_tests/test_bench_model.py checks the two agree)
MODEL_FAMILIES = ("llama", "mistral", "gemma2", "gemma3", "bert", "vit")
# bench's options that only --model reads, and the default contenders beside flashtune
MODEL_OPTIONS = ("layers", "hidden", "intermediate", "train_batch", "train_seqlen",
                 "gen_batch", "gen_prompt", "new_tokens", "phases")
MODEL_BASELINES = "sdpa,sdpa_flash,sdpa_cudnn"
_SHAPE_FLAGS = {"batch": "--batch", "heads": "--heads", "kv_heads": "--kv-heads",
                "seqlen": "--seqlen", "kv_seqlen": "--kv-seqlen", "head_dim": "--head-dim",
                "causal": "--causal"}
# bench's options that mean nothing for a model
_NOT_WITH_MODEL = {"template": "--template", "plan": "--plan", "preset_name": "--preset",
                   "train": "--train", "head_dims": "--head-dims", "seqlen": "--seqlen",
                   "kv_seqlen": "--kv-seqlen", "head_dim": "--head-dim", "causal": "--causal",
                   "dtype": "--dtype", "plot_path": "--plot"}


def _refuse(ctx: click.Context, flags: dict[str, str], mode: str) -> None:
    for name, flag in flags.items():
        if ctx.get_parameter_source(name) is not click.core.ParameterSource.DEFAULT:
            raise click.UsageError(f"{flag} does not apply to {mode}")


def _gpu_or_interpret(interpret: bool, why: str) -> None:
    """UsageError ``no CUDA GPU found: <why>`` without a GPU unless ``interpret``; then the
    interpreter decided, before anything imports triton."""
    if not interpret:
        import torch

        if not torch.cuda.is_available():
            raise click.UsageError(f"no CUDA GPU found: {why}")
    _decide_interpret(interpret)


def run_dispatch_bench(ctx: click.Context, params: dict[str, Any]) -> None:
    """The ``--dispatch`` branch of ``flashtune bench``, given every bench parameter: the
    default shapes, or the one given by ``--batch --heads [--kv-heads] --seqlen
    [--kv-seqlen] --head-dim [--causal]``."""
    _refuse(ctx, {**{k: v for k, v in _NOT_WITH_MODEL.items() if k not in _SHAPE_FLAGS},
                  "seqlens": "--seqlens", "baselines": "--baselines",
                  **{k: f"--{k.replace('_', '-')}" for k in MODEL_OPTIONS}}, "--dispatch")
    interpret = params["interpret"]
    _gpu_or_interpret(interpret, "bench --dispatch measures the host cost of a GPU launch; "
                                 "--interpret checks the pipeline on CPU")
    shape = {k: params[k] for k in _SHAPE_FLAGS}
    given = [k for k, v in shape.items() if v not in (None, False)]
    from flashtune.runtime.dispatch_bench import DEFAULT_SHAPES, DispatchShape

    shapes: tuple[DispatchShape, ...] = DEFAULT_SHAPES
    if given:
        missing = [_SHAPE_FLAGS[k] for k in ("batch", "heads", "seqlen", "head_dim")
                   if shape[k] is None]
        if missing:
            raise click.UsageError(f"a --dispatch shape needs {', '.join(missing)} too")
        shapes = (DispatchShape(shape["batch"], shape["heads"], shape["seqlen"],
                                shape["head_dim"], bool(shape["causal"]),
                                shape["kv_heads"] or 0, shape["kv_seqlen"] or 0),)
    out = Path(params["out_path"])
    check_output(out, "--out")
    rounds = params["rounds"]
    if ctx.get_parameter_source("rounds") is click.core.ParameterSource.DEFAULT:
        rounds = 5
    from flashtune.runtime.dispatch_bench import bench_dispatch, render_dispatch

    result = bench_dispatch(shapes, calls=params["calls"], rounds=rounds, interpret=interpret)
    _write(out, result)
    click.echo(render_dispatch(result))
    click.echo(f"wrote {out}")


def _write(out: Path, result: dict[str, Any]) -> None:
    try:
        out.write_text(json.dumps(result, indent=1))
    except OSError as exc:
        raise click.ClickException(f"cannot write {out}: {exc.strerror or exc}") from exc


def run_model_bench(ctx: click.Context, family: str, params: dict[str, Any]) -> None:
    """The ``--model`` branch of ``flashtune bench``, given every bench parameter."""
    _refuse(ctx, _NOT_WITH_MODEL,
            "--model (a model's attention shapes come from the model and its workload)")
    interpret = params["interpret"]
    _gpu_or_interpret(interpret, "bench --model measures a model on the GPU; --interpret "
                                 "runs a tiny model on CPU under the Triton interpreter to "
                                 "check the pipeline (timings mean nothing)")
    from flashtune.integrations.model_bench import (
        BASELINES,
        CONTENDERS,
        PRESETS,
        TINY,
        bench_model,
        default_workload,
        render_model,
    )

    spec = (TINY if interpret else PRESETS)[family]
    changes = {k: params[k] for k in ("layers", "hidden", "intermediate") if params[k]}
    changes.update({k: params[k] for k in ("heads", "kv_heads") if params[k]})
    if params["heads"] and not params["kv_heads"] and family in ("bert", "vit"):
        changes["kv_heads"] = params["heads"]
    spec = replace(spec, **changes)
    try:
        spec.check()
    except ValueError as exc:
        raise click.UsageError(f"--model {family}: {exc}") from None
    work = default_workload(family, tiny=interpret)
    wchanges: dict[str, Any] = {k: params[k] for k in ("train_batch", "train_seqlen",
                                                       "gen_batch", "gen_prompt", "new_tokens")
                                if params[k]}
    if params["batch"]:
        wchanges["batch"] = params["batch"]
    if ctx.get_parameter_source("seqlens") is not click.core.ParameterSource.DEFAULT:
        wchanges["seqlens"] = parse_ints(params["seqlens"], "--seqlens")
    if params["phases"]:
        phases = tuple(p for p in params["phases"].split(",") if p)
        known = set(work.phases)
        if not phases or set(phases) - known:
            raise click.BadParameter(f"{params['phases']!r}: --model {family} has phases "
                                     f"{', '.join(work.phases)}", param_hint="'--phases'")
        wchanges["phases"] = phases
    work = replace(work, **wchanges)
    baselines = params["baselines"]
    if ctx.get_parameter_source("baselines") is click.core.ParameterSource.DEFAULT:
        baselines = ",".join(BASELINES[family]) if family in BASELINES else MODEL_BASELINES
    names = [b for b in baselines.split(",") if b]
    unknown = [b for b in names if b not in CONTENDERS or b == "flashtune"]
    if unknown:
        raise click.BadParameter(f"unknown baselines for --model {unknown}; choose from "
                                 f"{', '.join(c for c in CONTENDERS if c != 'flashtune')}",
                                 param_hint="'--baselines'")
    rounds = params["rounds"]
    if ctx.get_parameter_source("rounds") is click.core.ParameterSource.DEFAULT:
        rounds = 5
    out = Path(params["out_path"])
    check_output(out, "--out")
    if ctx.obj and ctx.obj.get("db_url"):
        from flashtune.runtime import reload_configs

        reload_configs(db_url=ctx.obj["db_url"])

    def on_phase(row: dict[str, Any]) -> None:
        mine = row["ms"].get("flashtune")
        click.echo(f"{row['phase']} {row['label']}: flashtune "
                   + (f"{mine:.2f} ms" if mine is not None else "not timed"), err=True)

    result = bench_model(spec, work, contenders=["flashtune", *names], rounds=rounds,
                         interpret=interpret, on_phase=on_phase)
    _write(out, result)
    click.echo(render_model(result))
    click.echo(f"wrote {out}")
