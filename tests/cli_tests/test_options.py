"""The option values the CLI offers come from the library's own lists: the registry for
template names (checked when a command runs, so ``--help`` imports neither torch nor
triton), core for head dims and dtypes, the strategies for samplers."""

from __future__ import annotations

import pytest

from flashtune.autotune.strategies import MAX_SEED, SAMPLERS
from flashtune.cli import options
from flashtune.core.problem import MAX_HEAD_DIM
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
    assert list(options.HEAD_DIMS) == list(range(1, MAX_HEAD_DIM + 1))


def test_samplers_and_seed_range_agree_with_the_library() -> None:
    assert options.SAMPLERS == SAMPLERS
    assert options.MAX_SEED == MAX_SEED == 2**32 - 1


def test_bench_ops_agree_with_the_benchmark() -> None:
    from flashtune.cli import bench_commands
    from flashtune.runtime.bench import BENCH_OPS

    assert bench_commands.BENCH_OPS == BENCH_OPS


_PARSE_PROBE = """
import sys
from flashtune.cli.options import TemplateChoice
assert TemplateChoice().convert("attn_bwd", None, None) == "attn_bwd"
print("TRITON=" + str("triton" in sys.modules))
"""


def test_parsing_a_template_name_imports_no_triton() -> None:
    # tune and bench set the interpreter mode after parsing, and triton reads it on import
    # (before this, `flashtune tune` on a CPU machine compiled for a GPU it does not have)
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(root) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", _PARSE_PROBE], capture_output=True,
                          text=True, env=env, cwd=root, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "TRITON=False"


def test_bench_refuses_a_template_of_another_op(tmp_path) -> None:
    from click.testing import CliRunner

    from flashtune.cli.main import cli

    result = CliRunner().invoke(cli, ["bench", "--template", "attn_decode", "--batch", "1",
                                      "--heads", "2", "--seqlen", "16", "--head-dim", "16",
                                      "--out", str(tmp_path / "b.json"), "--no-plot"])
    assert result.exit_code == 2
    assert ("Invalid value for '--template': template 'attn_decode' is not of op fwd or bwd; "
            "choose one of attn_bwd, attn_bwd_gluon, attn_fwd") in result.output
