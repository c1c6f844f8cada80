"""The option values the CLI offers come from the library's own lists: the registry for
template names (checked when a command runs, so ``--help`` imports neither torch nor
triton), core for head dims and dtypes, the strategies for samplers."""

from __future__ import annotations

import pytest

from flashtune.autotune.strategies import MAX_SEED, SAMPLERS
from flashtune.cli import options
from flashtune.core.problem import SUPPORTED_HEAD_DIMS
from flashtune.kernel_templates import template_names


def test_templates_are_the_registered_ones() -> None:
    import click

    choice = options.TemplateChoice()
    for name in template_names():
        assert choice.convert(name, None, None) == name
    with pytest.raises(click.BadParameter, match="unknown template 'nope'; known templates: "
                       + ", ".join(template_names())):
        choice.convert("nope", None, None)


def test_a_template_registered_later_is_a_valid_choice() -> None:
    import dataclasses

    import click

    from flashtune.kernel_templates import get_template, register_template, unregister_template

    toy = dataclasses.replace(get_template("attn_fwd"), name="toy_registered_late")
    choice = options.TemplateChoice()
    with pytest.raises(click.BadParameter):
        choice.convert(toy.name, None, None)
    register_template(toy)
    try:
        assert choice.convert(toy.name, None, None) == toy.name
    finally:
        unregister_template(toy.name)


def test_head_dims_are_the_supported_ones() -> None:
    assert options.HEAD_DIMS == SUPPORTED_HEAD_DIMS


def test_samplers_and_seed_range_agree_with_the_library() -> None:
    assert options.SAMPLERS == SAMPLERS
    assert options.MAX_SEED == MAX_SEED == 2**32 - 1


def test_bench_ops_agree_with_the_benchmark() -> None:
    from flashtune.cli import bench_commands
    from flashtune.runtime.bench import BENCH_OPS

    assert bench_commands.BENCH_OPS == BENCH_OPS
