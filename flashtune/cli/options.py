"""Options shared by several commands, and small helpers every command module uses.

Light to import: click and flashtune's light modules, never torch, triton or optuna.
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

# light: no torch, triton or optuna
from flashtune.autotune.strategies import MAX_SEED, SAMPLERS, cmaes_installed
from flashtune.core.problem import DTYPES, MAX_HEAD_DIM
from flashtune.core.spec import USER_OPS

__all__ = ["SAMPLERS", "DTYPE_CHOICES", "HEAD_DIMS", "MAX_SEED", "FiniteFloatRange", "TemplateChoice",
           "check_template_op",
           "check_head_dims", "check_output", "cmaes_installed", "db_url", "device_filter_option", "fail",
           "json_option", "mods_options", "op_filter_option", "parse_ints", "search_options",
           "shape_options",
           "template_filter_option", "template_option"]

F = TypeVar("F", bound=Callable[..., Any])

DTYPE_CHOICES = DTYPES
HEAD_DIMS = range(1, MAX_HEAD_DIM + 1)  # every head dim flashtune serves

POSITIVE = click.IntRange(min=1)


class FiniteFloatRange(click.FloatRange):
    """``click.FloatRange`` that also refuses ``nan`` and ``inf`` (which a range check lets
    through, and which nothing downstream can store or compare)."""

    name = "float"

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> Any:
        rv = super().convert(value, param, ctx)
        if not math.isfinite(rv):
            self.fail(f"{value!r} is not a finite number.", param, ctx)
        return rv


def _check_sampler(ctx: click.Context, param: click.Parameter, value: str) -> str:
    if value == "cmaes" and not cmaes_installed():
        raise click.BadParameter("sampler 'cmaes' needs the cmaes package (pip install cmaes); "
                                 "or choose another sampler", ctx, param)
    return value


def _check_head_dim(ctx: click.Context, param: click.Parameter, value: int | None) -> int | None:
    if value is not None and value not in HEAD_DIMS:
        raise click.BadParameter(f"head dim {value} is not supported; supported: 1 to "
                                 f"{MAX_HEAD_DIM}", ctx, param)
    return value


def template_names(ops: tuple[str, ...] | None = None) -> list[str]:
    """The registered templates (of ``ops`` when given). Imports the kernels, so torch and
    triton: for shell completion and for commands once they have decided interpreter mode,
    never while options are parsed."""
    from flashtune.kernel_templates import catalog

    return sorted(n for n, s in catalog().items() if ops is None or s.op in ops)


def check_template_op(name: str, ops: tuple[str, ...], option: str = "--template") -> None:
    """BadParameter naming ``option`` unless template ``name`` computes one of ``ops``
    (imports the kernels: call once the command has decided interpreter mode)."""
    names = template_names(ops)
    if name not in names:
        raise click.BadParameter(f"template {name!r} is not of op {' or '.join(ops)}; "
                                 f"choose one of {', '.join(names)}", param_hint=f"'{option}'")


class TemplateChoice(click.ParamType):
    """A template name checked against the names the registry knows without importing a
    kernel (its template folders and what is registered already: a plugin's, a test's).
    Parsing must not import triton: ``tune`` and ``bench`` set the interpreter mode after
    it, and triton reads that on import. A command that needs the template's op checks it
    later (:func:`check_template_op`)."""

    name = "template"

    def __init__(self, *, listed: bool = True) -> None:
        self.listed = listed  # show the names in --help (False: NAME, for op subsets)

    def get_metavar(self, param: click.Parameter, ctx: click.Context | None = None) -> str:
        if not self.listed:
            return "NAME"
        from flashtune.kernel_templates import known_names

        return f"[{'|'.join(known_names())}]"

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> Any:
        from flashtune.kernel_templates import known_names

        names = known_names()
        if value not in names:
            self.fail(f"unknown template {value!r}; known templates: {', '.join(names)}",
                      param, ctx)
        return value

    def shell_complete(self, ctx: click.Context, param: click.Parameter,
                       incomplete: str) -> list[Any]:
        from click.shell_completion import CompletionItem

        return [CompletionItem(n) for n in template_names() if n.startswith(incomplete)]


def check_head_dims(values: Any, option: str) -> None:
    """BadParameter naming ``option`` unless every head dim in ``values`` is supported."""
    bad = sorted({int(v) for v in values if v not in HEAD_DIMS})
    if bad:
        raise click.BadParameter(f"head dim(s) {', '.join(map(str, bad))} not supported; "
                                 f"supported: 1 to {MAX_HEAD_DIM}",
                                 param_hint=f"'{option}'")


def db_url(ctx: click.Context) -> str | None:
    """The root group's ``--db`` URL, or None (the library's default)."""
    obj = ctx.find_root().obj
    return obj.get("db_url") if isinstance(obj, dict) else None


def fail(exc: BaseException) -> click.ClickException:
    """A library error as a one-line ``ClickException``."""
    return click.ClickException(" ".join(str(exc).split()) or type(exc).__name__)


def _apply(decorators: list[Callable[[F], F]], func: F) -> F:
    for decorator in reversed(decorators):
        func = decorator(func)
    return func


template_option = click.option(
    "--template", type=TemplateChoice(), default="attn_fwd", show_default=True,
    help="Kernel template to tune.")

device_filter_option = click.option(
    "--device", default=None, metavar="NAME", help="Only this device name.")

template_filter_option = click.option(
    "--template", type=TemplateChoice(), default=None,
    help="Only this template.")

json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")


def op_filter_option(help_text: str) -> Callable[[F], F]:
    """``--op fwd|train|decode``: a user op (``flashtune.core.spec.USER_OPS``), with the
    command's own ``help_text``."""
    return click.option("--op", type=click.Choice(USER_OPS), default=None, help=help_text)


def shape_options(func: F) -> F:
    """One attention shape: --batch --heads [--kv-heads] --seqlen [--kv-seqlen] --head-dim
    [--causal] --dtype."""
    return _apply([
        click.option("--batch", type=POSITIVE, help="Batch size B."),
        click.option("--heads", type=POSITIVE, help="Query heads Hq."),
        click.option("--kv-heads", type=POSITIVE,
                     help="Key/value heads Hkv (GQA); default: --heads."),
        click.option("--seqlen", type=POSITIVE, help="Query sequence length Nq."),
        click.option("--kv-seqlen", type=POSITIVE, help="Key/value length Nk; default: --seqlen."),
        click.option("--head-dim", type=POSITIVE, callback=_check_head_dim,
                     help=f"Head dimension D: 1 to {MAX_HEAD_DIM}."),
        click.option("--causal", is_flag=True, help="Causal masking."),
        click.option("--dtype", type=click.Choice(DTYPE_CHOICES), default=None,
                     help="Element type (default bf16); also applies to --preset."),
    ], func)


def _parse_window(ctx: click.Context, param: click.Parameter,
                  value: str | None) -> tuple[int, int] | None:
    if value is None:
        return None
    parts = value.split(",")
    try:
        left, right = (int(p) for p in parts)
    except ValueError:
        raise click.BadParameter(f"expected LEFT,RIGHT (two integers, -1 for unbounded), "
                                 f"got {value!r}") from None
    if left < -1 or right < -1:
        raise click.BadParameter(f"each bound must be >= 0, or -1 for unbounded; got {value!r}")
    return left, right


def mods_options(func: F) -> F:
    """The score modifications of a shape: --window L,R --softcap X --alibi, attention
    dropout (--dropout P), and a packed batch's --varlen-lengths."""
    return _apply([
        click.option("--window", callback=_parse_window, default=None, metavar="L,R",
                     help="Local window (FlashAttention-2's window_size): keys within L "
                          "before and R after the query's position; -1 unbounded (with "
                          "--causal R is 0)."),
        click.option("--softcap", type=FiniteFloatRange(min=0, min_open=True), default=None,
                     help="Logit softcap: scores become softcap * tanh(s / softcap)."),
        click.option("--alibi", is_flag=True, help="ALiBi slopes (random ones when tuning)."),
        click.option("--dropout", type=FiniteFloatRange(min=0, max=1, max_open=True),
                     default=None, metavar="P",
                     help="Attention dropout probability (FlashAttention-2's dropout_p, "
                          "e.g. 0.1 for BERT-family training); 0: none."),
        click.option("--varlen-lengths", "varlen_lengths", default=None,
                     metavar="FILE|random:SEED[:MIN-MAX]",
                     help="A packed batch (attention_varlen) of these sequence lengths, "
                          "instead of --batch: a file of token counts, or documents of "
                          "random lengths (default 128-4096) filling --seqlen tokens."),
    ], func)


def search_options(func: F) -> F:
    """How the search runs: trials, time budget, sampler, seed, workers, interpreter."""
    return _apply([
        click.option("--trials", type=POSITIVE, default=50, show_default=True,
                     help="Trials per problem."),
        click.option("--timeout", "timeout_s", type=FiniteFloatRange(min=0, min_open=True),
                     default=None, metavar="SECONDS",
                     help="Wall-clock budget per problem, checked between trial batches (the "
                          "first batch always runs)."),
        click.option("--patience", type=POSITIVE, default=None,
                     help="Stop after this many trials without improvement."),
        click.option("--sampler", type=click.Choice(SAMPLERS), default="tpe", show_default=True,
                     callback=_check_sampler, help="Optuna sampler (cmaes: pip install cmaes)."),
        click.option("--seed", type=click.IntRange(0, MAX_SEED), default=None,
                     help="Sampler seed (reproducible search)."),
        click.option("--workers", type=POSITIVE, default=None,
                     help="Parallel compile workers (default: the library's choice)."),
        click.option("--interpret", is_flag=True,
                     help="Run on CPU under the Triton interpreter (automatic without a GPU)."),
        click.option("--progress/--no-progress", default=True, show_default=True,
                     help="Show a progress bar."),
    ], func)


def parse_ints(text: str, option: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers like 64,128, got {text!r}",
                                 param_hint=f"'{option}'") from None
    if not values or any(x < 1 for x in values):
        raise click.BadParameter(f"expected positive integers, got {text!r}",
                                 param_hint=f"'{option}'")
    return values


def check_output(path: Path, option: str) -> None:
    """BadParameter naming ``option`` unless a file can be written at ``path``: its folder
    is created (as the run would) and a scratch file written in it and removed."""
    hint = f"'{option}'"
    if path.is_dir():
        raise click.BadParameter(f"{path} is a directory", param_hint=hint)
    folder = path.parent
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise click.BadParameter(f"cannot write {path}: {existing} is not a folder",
                                 param_hint=hint)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, scratch = tempfile.mkstemp(dir=folder, prefix=".flashtune-bench-")
        os.close(fd)
        os.unlink(scratch)
    except OSError as exc:
        raise click.BadParameter(f"cannot write in folder {folder}: "
                                 f"{exc.strerror or exc}", param_hint=hint) from None
