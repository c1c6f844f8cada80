"""Options shared by several commands, and small helpers every command module uses.

Light to import: click only.
"""

from __future__ import annotations

from typing import Any, Callable, TypeVar

import click

__all__ = ["SAMPLERS", "DTYPE_CHOICES", "db_url", "device_filter_option", "fail", "json_option",
           "search_options", "shape_options", "template_filter_option", "template_option"]

F = TypeVar("F", bound=Callable[..., Any])

SAMPLERS = ("tpe", "random", "grid", "cmaes")
DTYPE_CHOICES = ("fp16", "bf16")

POSITIVE = click.IntRange(min=1)


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
    "--template", default="attn_fwd", show_default=True, metavar="NAME",
    help="Kernel template to tune.")

device_filter_option = click.option(
    "--device", default=None, metavar="NAME", help="Only this device name.")

template_filter_option = click.option(
    "--template", default=None, metavar="NAME", help="Only this template.")

json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")


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
        click.option("--head-dim", type=POSITIVE, help="Head dimension D."),
        click.option("--causal", is_flag=True, help="Causal masking."),
        click.option("--dtype", type=click.Choice(DTYPE_CHOICES), default=None,
                     help="Element type (default bf16); also applies to --preset."),
    ], func)


def search_options(func: F) -> F:
    """How the search runs: trials, time budget, sampler, seed, workers, interpreter."""
    return _apply([
        click.option("--trials", type=POSITIVE, default=50, show_default=True,
                     help="Trials per problem."),
        click.option("--timeout", "timeout_s", type=click.FloatRange(min=0, min_open=True),
                     default=None, metavar="SECONDS",
                     help="Wall-clock budget per problem, checked between trial batches (the "
                          "first batch always runs)."),
        click.option("--patience", type=POSITIVE, default=None,
                     help="Stop after this many trials without improvement."),
        click.option("--sampler", type=click.Choice(SAMPLERS), default="tpe", show_default=True,
                     help="Optuna sampler."),
        click.option("--seed", type=int, default=None, help="Sampler seed (reproducible search)."),
        click.option("--workers", type=POSITIVE, default=None,
                     help="Parallel compile workers (default: the library's choice)."),
        click.option("--interpret", is_flag=True,
                     help="Run on CPU under the Triton interpreter (automatic without a GPU)."),
        click.option("--progress/--no-progress", default=True, show_default=True,
                     help="Show a progress bar."),
    ], func)
