"""``flashtune tune``: tune one shape, a plan file's shapes or a named preset.

Exactly one source of problems: the shape options (``--batch --heads ... --head-dim``),
``--plan FILE`` (TOML, see :mod:`flashtune.autotune.plans`) or ``--preset NAME`` (see
:mod:`flashtune.autotune.presets`; ``--dtype`` picks the preset's dtype). The work is done
by :func:`flashtune.autotune.jobs.tune`; this module parses, decides the interpreter mode,
and prints the closing table.

Interpreter mode (``--interpret``, or automatic when torch sees no CUDA GPU) must be decided
before triton or any ``flashtune.kernel_templates`` module is imported: ``TRITON_INTERPRET``
is read when kernels are defined. So the order is: parse, decide, set the variable, then
import the jobs module.
"""

from __future__ import annotations

import importlib
import os
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import click

from flashtune.cli.options import (
    FiniteFloatRange,
    check_head_dims,
    db_url,
    fail,
    mods_options,
    search_options,
    shape_options,
    template_option,
)

__all__ = ["INTERPRETER_MAX_FLOPS", "OP_CHOICES", "format_config", "format_tflops",
           "refuse_under_interpreter", "render_op_results", "render_op_summary",
           "render_results", "tune_command"]

# flashtune.core.spec.USER_OPS, written out: parsing imports nothing of the library's kernels
# (a test keeps the two equal)
OP_CHOICES = ("fwd", "train", "decode")
# flashtune.autotune.options.MAX_SETTLE_MS, written out for the same reason (a test keeps
# the two equal)
MAX_SETTLE_MS = 10_000

_SHAPE_NAMES = ("batch", "heads", "kv_heads", "seqlen", "kv_seqlen", "head_dim", "causal")
_REQUIRED = ("batch", "heads", "seqlen", "head_dim")
# the largest launch (forward FLOPs; backward counts 2.5x) run under the Triton interpreter:
# it does about 0.4 GFLOP/s on a CPU core, so a launch of 1 GFLOP takes seconds and a tuning
# run of such shapes minutes; the presets' and the standard grid's shapes (tens to thousands
# of GFLOP a launch) would take hours
INTERPRETER_MAX_FLOPS = 1e9
TINY_SHAPE = "--batch 1 --heads 2 --seqlen 64 --head-dim 32"


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _sigterm_as_interrupt() -> Any:
    """While a tune runs, SIGTERM (``kill``, ``timeout``, a batch scheduler's pre-emption)
    stops it as Ctrl-C does: the trial in flight is failed, the run recorded INTERRUPTED,
    and the command exits 143. Returns the previous handler (None when signals cannot be
    set here, outside the main thread). The request is also recorded
    (:mod:`flashtune.autotune.stop`): where the exception is lost (raised inside a garbage
    collector's callback), the trial loop raises it at the next trial."""
    from flashtune.autotune import stop

    def handler(signum: int, frame: Any) -> None:
        stop.request("SIGTERM")
        if not stop.in_finalizer(frame):  # there CPython would print and drop it
            raise stop.Terminated("SIGTERM")

    try:
        return signal.signal(signal.SIGTERM, handler)
    except ValueError:
        return None


def _packed_problem(shape: dict[str, Any], dtype: str | None, spec: str, plan: str | None,
                    preset_name: str | None) -> Any:
    """The packed problem of --varlen-lengths with the other shape options."""
    from flashtune.autotune.plans import PlanError, varlen_lengths
    from flashtune.core.problem import AttentionProblem

    if plan is not None or preset_name is not None:
        raise click.UsageError("--varlen-lengths goes with shape options; in a plan set "
                               "varlen_lengths per [[shape]]")
    for name in ("batch", "kv_seqlen"):
        if shape[name] is not None:
            raise click.UsageError(f"{_flag(name)} cannot be combined with --varlen-lengths "
                                   f"(the lengths give the batch)")
    missing = [_flag(n) for n in ("heads", "head_dim") if shape[n] is None]
    if missing:
        raise click.UsageError(f"missing shape option(s): {', '.join(missing)}")
    try:
        lengths = varlen_lengths(spec, shape["seqlen"], "--varlen-lengths")
    except PlanError as exc:
        raise click.BadParameter(str(exc).removeprefix("--varlen-lengths: "),
                                 param_hint="'--varlen-lengths'") from exc
    if shape["seqlen"] is not None and not spec.startswith("random:") \
            and shape["seqlen"] != sum(lengths):
        raise click.UsageError(f"--seqlen {shape['seqlen']} is not the {sum(lengths)} "
                               f"tokens of --varlen-lengths (leave it out)")
    try:
        return AttentionProblem.from_lengths(
            lengths, None, heads_q=shape["heads"], heads_kv=shape["kv_heads"] or shape["heads"],
            head_dim=shape["head_dim"], causal=bool(shape["causal"]), dtype=dtype or "bf16")
    except ValueError as exc:
        raise click.UsageError(f"invalid shape: {exc}") from exc


def _problems(shape: dict[str, Any], dtype: str | None, plan: str | None,
              preset_name: str | None, op: str | None = None) -> list[Any]:
    """The problems to tune from exactly one of shape options / --plan / --preset;
    ``--plan`` takes a TOML file or a packaged plan's name, and a plan made for one op
    refuses another ``op``."""
    from flashtune.core.problem import AttentionProblem

    given = [name for name in _SHAPE_NAMES if shape[name] not in (None, False)]
    sources = [label for label, used in (("shape options", bool(given)), ("--plan", plan),
                                         ("--preset", preset_name)) if used]
    if len(sources) != 1:
        what = " and ".join(sources) if sources else "none was given"
        raise click.UsageError("give exactly one of: shape options (--batch --heads --seqlen "
                               f"--head-dim ...), --plan FILE, --preset NAME ({what})")
    if plan is not None:
        if dtype is not None:
            raise click.UsageError("--dtype cannot be combined with --plan (set dtype per "
                                   "[[shape]] in the plan)")
        from flashtune.autotune.plans import PlanError, read_plan

        try:
            read = read_plan(plan)
        except PlanError as exc:
            raise click.BadParameter(" ".join(str(exc).split()), param_hint="'--plan'") from exc
        if op is not None and read.op is not None and read.op != op:
            raise click.UsageError(f"plan {plan} is made for --op {read.op}, not --op {op}")
        problems = list(read.problems)
        check_head_dims([p.head_dim for p in problems], "--plan")
        return problems
    if preset_name is not None:
        from flashtune.autotune.presets import UnknownPresetError, preset

        try:
            return preset(preset_name, dtype=dtype or "bf16")
        except UnknownPresetError as exc:
            raise click.BadParameter(str(exc), param_hint="'--preset'") from exc
    missing = [_flag(name) for name in _REQUIRED if shape[name] is None]
    if missing:
        raise click.UsageError(f"missing shape option(s): {', '.join(missing)}")
    try:
        return [AttentionProblem(shape["batch"], shape["heads"],
                                 shape["kv_heads"] or shape["heads"], shape["seqlen"],
                                 shape["kv_seqlen"] or shape["seqlen"], shape["head_dim"],
                                 bool(shape["causal"]), dtype or "bf16")]
    except ValueError as exc:
        raise click.UsageError(f"invalid shape: {exc}") from exc


def _decide_interpret(requested: bool) -> bool:
    """Whether to run under the Triton interpreter; sets ``TRITON_INTERPRET`` if so.

    Must run before triton or a kernel template module is imported.
    """
    if requested:
        reason = "--interpret"
    else:
        import torch  # torch alone does not import triton

        if torch.cuda.is_available():
            return False
        reason = "no CUDA GPU found"
    os.environ["TRITON_INTERPRET"] = "1"
    if "triton" in sys.modules:
        click.echo("warning: triton was imported before interpreter mode was set; kernels "
                   "may not run interpreted", err=True)
    click.echo(f"{reason}: running the whole pipeline on CPU under the Triton interpreter "
               "(slow; for testing, timings are not meaningful)", err=True)
    return True


def refuse_under_interpreter(problems: Sequence[Any], *, backward: bool = False,
                             doing: str = "tuning") -> None:
    """UsageError when a problem is too big for the Triton interpreter (over
    :data:`INTERPRETER_MAX_FLOPS` a launch): on the CPU it would take hours.

    Arguments:
        problems: the :class:`~flashtune.core.problem.AttentionProblem` s to run.
        backward: count the backward's FLOPs (2.5x the forward's).
        doing: what would take hours, for the message.
    """
    big = [p for p in problems if p.flops(backward=backward) > INTERPRETER_MAX_FLOPS]
    if not big:
        return
    worst = max(big, key=lambda p: p.flops(backward=backward))
    which = "" if len(problems) == 1 else f" ({len(big)} of the {len(problems)} shapes are)"
    raise click.UsageError(
        f"{worst.describe()} is too big for the Triton interpreter{which}: "
        f"{_gflop(worst.flops(backward=backward))} a launch, over its limit of "
        f"{_gflop(INTERPRETER_MAX_FLOPS)}; {doing} it on the CPU would take hours. Run on a "
        f"CUDA GPU, or give a tiny shape (e.g. {TINY_SHAPE})")


def _gflop(flops: float) -> str:
    g = flops / 1e9
    return f"{g:,.0f} GFLOP" if g >= 10 else f"{g:.2g} GFLOP"


def _parse_gpus(text: str | None) -> list[int] | None:
    """``--gpus 0,1,3`` -> ``[0, 1, 3]``; BadParameter for anything else."""
    if text is None:
        return None
    try:
        gpus = [int(x) for x in text.split(",")]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated GPU indices like 0,1, got {text!r}",
                                 param_hint="'--gpus'") from None
    if any(g < 0 for g in gpus) or len(set(gpus)) != len(gpus):
        raise click.BadParameter(f"GPU indices must be distinct and >= 0, got {text!r}",
                                 param_hint="'--gpus'")
    return gpus


def _check_gpus(gpus: list[int] | None, interpret: bool) -> None:
    """The GPUs must exist (under the interpreter they are only worker slots)."""
    if gpus is None:
        return
    if interpret:
        click.echo(f"--gpus under the interpreter: {len(gpus)} worker processes on the CPU",
                   err=True)
        return
    import torch

    count = torch.cuda.device_count()
    missing = [g for g in gpus if g >= count]
    if missing:
        raise click.BadParameter(f"GPU(s) {missing} do not exist; this machine has {count} "
                                 f"(indices 0-{count - 1})", param_hint="'--gpus'")


def _check_impls(op: str | None, impls: Sequence[str]) -> None:
    """BadParameter naming ``--impl`` for a name that is not an implementation of ``op``
    (the registry's, listed: a training pair such as ``attn_fwd_gluon_bwd_gluon`` is
    registered by its backward's folder, so parsing cannot know it without importing)."""
    from flashtune.kernel_templates import implementations

    names = [spec.name for spec in implementations(op or "fwd")]
    unknown = [name for name in impls if name not in names]
    if unknown:
        raise click.BadParameter(f"{', '.join(map(repr, unknown))}: not an implementation of "
                                 f"op {op!r}; its implementations: {', '.join(names)}",
                                 param_hint="'--impl'")


def format_config(config: dict[str, Any] | None) -> str:
    """``BM,BN,w,s`` of an attn_fwd config (other templates: ``k=v`` pairs); ``-`` for None."""
    if not config:
        return "-"
    keys = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")
    if all(k in config for k in keys):
        rest = {k: v for k, v in config.items() if k not in keys}
        text = ",".join(str(config[k]) for k in keys)
        return text + "".join(f" {k}={v}" for k, v in sorted(rest.items()))
    return " ".join(f"{k}={v}" for k, v in sorted(config.items()))


def format_tflops(value: float | None) -> str:
    """TFLOP/s with one decimal; three significant digits below 1 (interpreter runs)."""
    if value is None:
        return "-"
    return f"{value:.1f}" if value >= 1 else f"{value:.3g}"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], right: set[int]) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    lines = []
    for row in [header, *rows]:
        cells = [str(c).rjust(w) if i in right else str(c).ljust(w)
                 for i, (c, w) in enumerate(zip(row, widths))]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def render_results(results: Sequence[Any]) -> str:
    """The closing table: one row per :class:`~flashtune.autotune.options.TuneResult`."""
    fwd = all("BLOCK_M" in r.best_config for r in results if r.best_config)
    header = ("shape", "best BM,BN,w,s" if fwd else "best config", "best TFLOP/s",
              "default TFLOP/s", "speed-up", "trials", "wall s", "stored best")
    rows = [(r.problem.describe(), format_config(r.best_config), format_tflops(r.best_tflops),
             format_tflops(r.default_tflops),
             "-" if r.speedup is None else f"{r.speedup:.2f}x", str(r.trials),
             f"{r.wall_s:.1f}", "yes" if r.became_best else "no") for r in results]
    return _table(header, rows, right={2, 3, 4, 5, 6})


def _margin(ratio: float | None, name: str | None) -> str:
    return "-" if ratio is None or name is None else f"{ratio:.2f}x {name}"


def render_op_results(results: Sequence[Any]) -> str:
    """The closing table of ``tune --op``: one row per
    :class:`~flashtune.autotune.select.OpResult`, then the implementations skipped."""
    rows = []
    for r in results:
        win, up, ext = r.winner, r.runner_up, r.best_extern
        rows.append((r.problem.describe(), win.implementation if win else "none",
                     format_config(win.config) if win else "-",
                     f"{win.median_ms:.4g}" if win and win.median_ms else "-",
                     format_tflops(win.tflops if win else None),
                     _margin(r.margin, up.implementation if up else None),
                     _margin(r.extern_margin, ext.implementation if ext else None)))
    text = _table(("shape", "implementation", "config", "ms", "TFLOP/s", "over runner-up",
                   "over extern"), rows, right={3, 4})
    skipped = [f"  {r.problem.describe()}: {name} skipped: {why}"
               for r in results for name, why in r.skipped]
    skipped += [f"  {r.problem.describe()}: already tuned on this device: not tuned again"
                for r in results if r.reused]
    skipped += [f"  {r.problem.describe()}: the stored choice was stale ({r.stale}): tuned "
                f"again" for r in results if r.stale]
    return text + ("\n" + "\n".join(skipped) if skipped else "")


def render_op_summary(results: Sequence[Any], total: int) -> str:
    """One line counting the shapes of a ``tune --op`` command: tuned (with the seconds
    spent on them, added over the GPUs' workers), already tuned (skipped), and not started
    (of ``total``)."""
    reused = sum(1 for r in results if r.reused)
    seconds = [r.seconds for r in results if not r.reused]
    parts = [f"{len(seconds)} tuned"]
    if seconds:  # what a device command's share of a plan costs, to size the next one
        parts[0] += (f" ({sum(seconds):.0f} s, {sum(seconds) / len(seconds):.0f} s a shape, "
                     f"the longest {max(seconds):.0f} s)")
    if reused:
        parts.append(f"{reused} already tuned (skipped)")
    if total > len(results):
        parts.append(f"{total - len(results)} not done")
    return f"{total} shape{'s' if total != 1 else ''}: " + ", ".join(parts)


@click.command("tune")
@template_option
@click.option("--op", type=click.Choice(OP_CHOICES), default=None,
              help="Search across the implementations of this op (every one that can serve "
                   "the shape here, or those named by --impl) and store the fastest with "
                   "its margins; without it, --template's configs are tuned.")
@click.option("--impl", "impls", multiple=True, metavar="NAME",
              help="With --op: search only this implementation of the op (repeatable; "
                   "train's include the pairs attn_fwd_gluon_bwd_gluon and "
                   "sdpa_cudnn_bwd_gluon, which no template folder is named after).")
@shape_options
@mods_options
@click.option("--plan", default=None, metavar="FILE|NAME",
              help="TOML file of [[shape]] and [[grid]] tables to tune (score modifications "
                   "per shape: window = [L, R], softcap, alibi; dropout), or the name of a "
                   "plan shipped in flashtune/plans: shipped-fwd, shipped-train, "
                   "shipped-decode (with --op fwd, train, decode).")
@click.option("--preset", "preset_name", default=None, metavar="NAME",
              help="Named problem set: llama3-8b, llama3-70b, mistral-7b, qwen2.5-7b, "
                   "gemma2-9b, standard (sized for a GPU: too big for the interpreter).")
@search_options
@click.option("--gpus", "gpus_text", default=None, metavar="LIST",
              help="Tune on these GPUs, one worker process each (e.g. 0,1,2,3), all writing "
                   "to the same database; with --op each worker takes whole shapes. "
                   "Default: the current GPU only.")
@click.option("--skip-tuned", is_flag=True,
              help="With --op: skip a shape whose choice is stored for this device and "
                   "current (every implementation that can serve it timed at its current "
                   "source), and do not search again an implementation whose search of a "
                   "shape finished at its current source; a stale choice is made again. "
                   "Runs the rest of a plan that an earlier command did not finish.")
@click.option("--stop-after", "stop_after_s", type=FiniteFloatRange(min=0, min_open=True),
              default=None, metavar="SECONDS",
              help="With --op --skip-tuned: start no shape that would end after SECONDS "
                   "of wall time, judged by the longest shape this command tuned so far "
                   "(one started finishes; a longer one than any before can still run "
                   "over: leave margin) and exit 0; the same command then goes on with the "
                   "shapes not done.")
@click.option("--isolate/--no-isolate", default=None,
              help="Evaluate candidates in a worker process that a crash or a hang (past "
                   "the trial timeout) kills instead of the job. Default: on with a GPU, off "
                   "under the interpreter.")
@click.option("--settle-ms", type=FiniteFloatRange(min=0, max=MAX_SETTLE_MS), default=0.0,
              show_default=True, metavar="MS",
              help="Run each candidate back to back for MS milliseconds before each timing "
                   "window, so it is timed at the clock its own power leaves (a GPU at its "
                   "power cap slows within 0.1-0.2 s of sustained use; 200 or more times "
                   "every candidate sustained, as a long training run sees it). 0: time "
                   "as before, near the cool figure.")
@click.pass_context
def tune_command(ctx: click.Context, template: str, op: str | None, impls: tuple[str, ...],
                 batch: int | None, heads: int | None,
                 kv_heads: int | None, seqlen: int | None, kv_seqlen: int | None,
                 head_dim: int | None, causal: bool, dtype: str | None,
                 window: tuple[int, int] | None, softcap: float | None, alibi: bool,
                 dropout: float | None, varlen_lengths: str | None, plan: str | None,
                 preset_name: str | None, trials: int, timeout_s: float | None,
                 patience: int | None, sampler: str, seed: int | None, workers: int | None,
                 interpret: bool, progress: bool, gpus_text: str | None, skip_tuned: bool,
                 stop_after_s: float | None, isolate: bool | None, settle_ms: float) -> None:
    """Search kernel configs for attention shapes and store the best ones.

    Give exactly one of: a shape (--batch --heads [--kv-heads] --seqlen [--kv-seqlen]
    --head-dim [--causal] [--dtype] [--window L,R] [--softcap X] [--alibi] [--dropout P]),
    --plan FILE,
    or --preset NAME. A packed batch (attention_varlen) takes --varlen-lengths instead of
    --batch: a file of sequence lengths, or random:SEED[:MIN-MAX] filling --seqlen tokens.

    With --op, every implementation of the op that can serve the shape on this machine
    (flashtune's Triton and Gluon kernels, torch SDPA's backends) is searched, the leaders
    are timed side by side, and the fastest is stored as the op's choice for the shape; an
    implementation that cannot run here (a GPU-only one on a CPU machine) is skipped with a
    line saying why. --op train chooses the training step: a forward that saves the LSE and
    its backward (flashtune's pairs, each kernel searched on its own, then the pair timed
    as one step) or an SDPA backend's forward and backward.

    A plan too long for one sitting is finished over several commands: run the same
    command with --skip-tuned until every shape is tuned (shapes stored and current are
    skipped; a command killed mid-shape loses only the implementation search in flight), with
    --stop-after SECONDS to stop starting shapes before a time limit. --gpus 0,1 spreads the
    shapes over GPUs, one worker process each, into the same database.
    """
    if impls and op is None:
        raise click.UsageError("--impl needs --op (the op whose implementations to search)")
    if op is not None and ctx.get_parameter_source("template") \
            is not click.core.ParameterSource.DEFAULT:
        raise click.UsageError("give --op (search across implementations) or --template "
                               "(tune one template's configs), not both")
    if op is None and (skip_tuned or stop_after_s is not None):
        raise click.UsageError(f"{'--skip-tuned' if skip_tuned else '--stop-after'} goes "
                               "with --op (tune a plan's op choices over several commands)")
    if stop_after_s is not None and not skip_tuned:
        raise click.UsageError("--stop-after needs --skip-tuned: without it the next "
                               "command would tune again the shapes this one finished")
    shape = dict(batch=batch, heads=heads, kv_heads=kv_heads, seqlen=seqlen,
                 kv_seqlen=kv_seqlen, head_dim=head_dim, causal=causal)
    if varlen_lengths is not None:
        problems = [_packed_problem(shape, dtype, varlen_lengths, plan, preset_name)]
    else:
        problems = _problems(shape, dtype, plan, preset_name, op)
    if window is not None or softcap is not None or alibi or dropout:
        if plan is not None or preset_name is not None:
            raise click.UsageError("--window, --softcap, --alibi and --dropout go with shape "
                                   "options; in a plan set them per [[shape]]")
        try:
            problems = [replace(p, window_left=window[0] if window else -1,
                                window_right=-1 if p.causal or not window else window[1],
                                softcap=softcap or 0.0, alibi=alibi, dropout=dropout or 0.0)
                        for p in problems]
        except ValueError as exc:
            raise click.UsageError(f"invalid shape: {exc}") from exc
    gpus = _parse_gpus(gpus_text)
    interpret = _decide_interpret(interpret)
    if interpret:
        refuse_under_interpreter(problems, backward=template == "attn_bwd" or op == "train")
    _check_gpus(gpus, interpret)
    if impls:  # checked now that the interpreter mode is set (the names import kernels)
        _check_impls(op, impls)

    from flashtune.autotune import stop
    from flashtune.core.errors import FlashtuneError

    deadline = None if stop_after_s is None else time.time() + stop_after_s
    previous = _sigterm_as_interrupt()
    try:
        jobs = importlib.import_module("flashtune.autotune.jobs")
        options = jobs.TuneOptions(template=template, trials=trials, timeout_s=timeout_s,
                                   sampler=sampler, seed=seed, patience=patience,
                                   interpret=interpret, workers=workers, isolate=isolate,
                                   settle_ms=settle_ms)
        if op is not None:
            _tune_op(problems, op, options, impls, db_url(ctx), progress, gpus, skip_tuned,
                     deadline, stop_after_s)
            return
        results = jobs.tune(problems, options, db_url=db_url(ctx), progress=progress,
                            gpus=gpus)
    except FlashtuneError as exc:
        finished = getattr(exc, "results", None)  # a worker died: show what the others did
        if finished:
            click.echo(render_op_results(finished) if op is not None
                       else render_results(finished))
            if op is not None:
                click.echo(render_op_summary(finished, len(problems)))
        raise fail(exc) from exc
    except stop.Terminated:
        again = "the same command with --skip-tuned goes on" if op is not None \
            else "the same command resumes it"
        click.echo(f"flashtune: terminated (SIGTERM); the run is recorded as interrupted "
                   f"and {again}", err=True)
        ctx.exit(128 + signal.SIGTERM)
    except KeyboardInterrupt:
        raise click.Abort() from None
    finally:
        stop.clear()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    click.echo(render_results(results))


def _tune_op(problems: Sequence[Any], op: str, options: Any, impls: tuple[str, ...],
             url: str | None, progress: bool, gpus: list[int] | None, skip_tuned: bool,
             deadline: float | None, stop_after_s: float | None) -> None:
    """``tune --op``: here or on ``gpus``, then the closing table and the count of shapes."""
    if gpus is None:
        select = importlib.import_module("flashtune.autotune.select")
        results = select.tune_op(problems, op, options, impls=impls or None, db_url=url,
                                 progress=progress, skip_tuned=skip_tuned, deadline=deadline)
    else:
        workers = importlib.import_module("flashtune.autotune.workers")
        results = workers.tune_op_on_gpus(problems, op, options, impls=impls or None,
                                          db_url=url, gpus=gpus, progress=progress,
                                          skip_tuned=skip_tuned, deadline=deadline)
    click.echo(render_op_results(results))
    click.echo(render_op_summary(results, len(problems)))
    if stop_after_s is not None and len(results) < len(problems):
        click.echo(f"--stop-after {stop_after_s:g}: {len(problems) - len(results)} shape(s) "
                   f"not started; run the same command again to go on")
