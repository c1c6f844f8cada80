"""The option values the CLI spells out (so ``--help`` imports neither torch nor triton)
agree with the library's own lists."""

from __future__ import annotations

from flashtune.autotune.strategies import MAX_SEED, SAMPLERS
from flashtune.cli import options
from flashtune.kernel_templates import template_names
from flashtune.core.problem import SUPPORTED_HEAD_DIMS


def test_templates_are_the_registered_ones() -> None:
    assert list(options.TEMPLATES) == template_names()


def test_head_dims_are_the_supported_ones() -> None:
    assert options.HEAD_DIMS == SUPPORTED_HEAD_DIMS


def test_samplers_and_seed_range_agree_with_the_library() -> None:
    assert options.SAMPLERS == SAMPLERS
    assert options.MAX_SEED == MAX_SEED == 2**32 - 1
