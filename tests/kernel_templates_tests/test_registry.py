"""The registry is the one extension point: a template registered from a test, with no
flashtune file edited, goes through tune (interpreter), show, export, import, re-export and
lookup; and the source hash follows the code, not its comments or layout."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

from flashtune.autotune.jobs import TuneOptions, tune
from flashtune.cli.main import cli
from flashtune.core.case import forward_case
from flashtune.core.device import DeviceFingerprint, interpreter_device
from flashtune.core.errors import UnknownTemplateError
from flashtune.core.problem import AttentionProblem
from flashtune.core.space import Config, SearchSpace
from flashtune.core.spec import TemplateSpec
from flashtune.kernel_templates import (
    catalog,
    get_template,
    known_names,
    register_template,
    template_names,
    unregister_template,
)
from flashtune.kernel_templates.attn_fwd.reference import attn_fwd_reference
from flashtune.kernel_templates.registry import hash_files, source_hash
from flashtune.runtime.lookup import Dispatcher

TOY = "toy_fwd"
PROBLEM = AttentionProblem(1, 2, 1, 21, 37, 16, True, "fp16")


def _toy_launcher(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  config: Mapping[str, int], *, causal: bool = False) -> torch.Tensor:
    """Attention in torch, ``ROWS`` query rows at a time (the knob changes nothing but the
    schedule)."""
    outs = [attn_fwd_reference(q[:, :, i:i + config["ROWS"]], k, v, causal=False,
                               dtype=torch.float32)[0]
            for i in range(0, q.shape[2], config["ROWS"])] if not causal else \
        [attn_fwd_reference(q, k, v, causal=True, dtype=torch.float32)[0]]
    return torch.cat(outs, dim=2).to(q.dtype)


def _toy_default(problem: AttentionProblem, device: DeviceFingerprint) -> Config:
    return {"ROWS": 8}


def _no_rows_over_seqlen(config: Mapping[str, int], problem: Any, device: Any) -> str | None:
    return "ROWS above seqlen_q" if config["ROWS"] > 4 * problem.seqlen_q else None


def toy_spec() -> TemplateSpec:
    return TemplateSpec(
        name=TOY, op="fwd", source_hash=source_hash(__file__),
        launcher=_toy_launcher, reference=attn_fwd_reference,
        space=SearchSpace({"ROWS": (4, 8, 16, 128)}, _no_rows_over_seqlen),
        default_config=_toy_default,
        make_case=lambda problem, device, **kw: forward_case(attn_fwd_reference, problem,
                                                             device, **kw))


@pytest.fixture
def toy() -> Any:
    spec = register_template(toy_spec())
    yield spec
    unregister_template(TOY)


def _invoke(*args: str) -> str:
    result = CliRunner().invoke(cli, list(args))
    assert result.exit_code == 0, result.output
    return result.output


def _without_export_time(text: str) -> str:
    data = json.loads(text)
    data.pop("exported_at")
    return json.dumps(data, sort_keys=True)


def test_a_toy_template_goes_through_tune_show_export_import_and_lookup(toy: TemplateSpec,
                                                                          tmp_path: Path
                                                                          ) -> None:
    assert TOY in template_names() and TOY in catalog() and TOY in known_names()
    url = f"sqlite:///{tmp_path / 'a.db'}"
    [result] = tune([PROBLEM], TuneOptions(template=TOY, trials=3, sampler="random", seed=0,
                                           interpret=True), db_url=url, progress=False)
    assert result.best_config is not None and set(result.best_config) == {"ROWS"}

    shown = json.loads(_invoke("--db", url, "show", "--template", TOY, "--json"))
    assert [r["template"] for r in shown] == [TOY]
    assert shown[0]["config"] == result.best_config

    first = tmp_path / "first"
    _invoke("--db", url, "export", "--template", TOY, "-o", str(first))
    [exported] = sorted(first.iterdir())
    assert f"template={TOY}" in exported.name

    other = f"sqlite:///{tmp_path / 'b.db'}"
    out = _invoke("--db", other, "import", str(exported))
    assert out.splitlines()[-1] == ("imported 1 file (policy keep-faster): 1 added, "
                                    "0 replaced, 0 kept, 0 skipped, 0 stale")
    second = tmp_path / "second"
    _invoke("--db", other, "export", "--template", TOY, "-o", str(second))
    again = second / exported.name
    assert _without_export_time(again.read_text()) == _without_export_time(exported.read_text())

    dispatcher = Dispatcher(get_template(TOY))
    dispatcher.reload(db_url=other)
    choice = dispatcher.choose(PROBLEM, interpreter_device())
    assert (choice.source, choice.config, choice.template) == ("exact", result.best_config, TOY)
    near = dataclasses.replace(PROBLEM, seqlen_q=23)
    assert dispatcher.choose(near, interpreter_device()).source in ("bucket", "nearest")


def test_an_unregistered_template_is_refused_everywhere(tmp_path: Path) -> None:
    assert TOY not in template_names()
    with pytest.raises(UnknownTemplateError, match=f"unknown template '{TOY}'; known templates: "
                       + ", ".join(template_names())):
        get_template(TOY)
    result = CliRunner().invoke(cli, ["--db", f"sqlite:///{tmp_path / 'x.db'}", "show",
                                      "--template", TOY])
    assert result.exit_code == 2 and f"unknown template '{TOY}'" in result.output


def test_registering_another_spec_under_a_taken_name_is_refused(toy: TemplateSpec) -> None:
    assert register_template(toy) is toy  # the same spec again: a no-op
    with pytest.raises(ValueError, match=f"template '{TOY}' is already registered"):
        register_template(dataclasses.replace(toy, source_hash="0" * 16))
    with pytest.raises(ValueError, match="op of template 'bad' is 'sideways'"):
        dataclasses.replace(toy, name="bad", op="sideways")


def test_every_builtin_folder_is_registered_under_its_name() -> None:
    for name in ("attn_fwd", "attn_bwd", "attn_decode", "attn_fwd_gluon", "sdpa_cudnn",
                 "sdpa_efficient", "sdpa_flash", "sdpa_math"):
        assert get_template(name).name == name
        assert name in known_names()
    assert {get_template(n).op for n in ("attn_fwd", "attn_bwd", "attn_decode")} == \
        {"fwd", "bwd", "decode"}


# -- the source hash ---------------------------------------------------------------------------

CODE = '''"""Module doc."""
import math


def f(x):
    """Function doc."""
    # a comment
    y = x * 2  # trailing
    return f"{y:>4}" + math.pi.__repr__()
'''
SAME = '''"""Another module doc, longer,
over two lines."""
import math



def f(x):
    y = x * 2
    return f"{y:>4}" + math.pi.__repr__()  # and a comment
'''
DIFFERENT_CODE = CODE.replace("x * 2", "x * 3")
DIFFERENT_FSTRING = CODE.replace("{y:>4}", "{y:>5}")


def _hash(tmp_path: Path, text: str, name: str = "m.py") -> str:
    path = tmp_path / name
    path.write_text(text)
    return source_hash(path)


def test_the_source_hash_ignores_comments_docstrings_and_layout(tmp_path: Path) -> None:
    assert _hash(tmp_path, CODE) == _hash(tmp_path, SAME)
    assert _hash(tmp_path, CODE) != _hash(tmp_path, DIFFERENT_CODE)
    assert _hash(tmp_path, CODE) != _hash(tmp_path, DIFFERENT_FSTRING)
    # a string that is not a docstring is code
    assert _hash(tmp_path, CODE) != _hash(tmp_path, CODE.replace("y = x * 2", "'s'\n    y = x * 2"))


def test_the_source_hash_covers_the_helpers_a_launcher_imports() -> None:
    root = Path(get_template("attn_bwd").launcher.__code__.co_filename).parent.parent
    rel = [p.relative_to(root).as_posix() for p in hash_files(root / "attn_bwd" / "kernel.py",
                                                              root / "attn_bwd" / "launcher.py")]
    assert rel[:2] == ["attn_bwd/kernel.py", "attn_bwd/launcher.py"]
    # the TMA descriptor helper and the head-dim padding rule the backward launcher calls
    assert {"tma.py", "attn_bwd/space.py", "attn_fwd/space.py"} <= set(rel)
    assert "attn_fwd/kernel.py" not in rel  # the forward's kernel does not decide its code


def test_the_registered_hashes_are_those_of_their_files() -> None:
    for name in ("attn_fwd", "attn_bwd", "attn_decode", "attn_fwd_gluon"):
        spec = get_template(name)
        folder = Path(spec.launcher.__code__.co_filename).parent
        assert spec.source_hash == source_hash(folder / "kernel.py", folder / "launcher.py")


def test_config_text_round_trips_and_refuses_what_it_did_not_write():
    from flashtune.core.errors import ConfigError
    from flashtune.core.space import config_from_text, config_text

    config = {"num_warps": 8, "BLOCK_M": 128, "USE_TMA": 1, "REVERSE_M": 0}
    text = config_text(config)
    assert text == "BLOCK_M=128,REVERSE_M=0,USE_TMA=1,num_warps=8"
    assert config_from_text(text) == config
    assert config_from_text(config_text({})) == {}
    for bad in ("BLOCK_M", "BLOCK_M=x", "=3", "BLOCK_M=1,,num_warps"):
        with pytest.raises(ConfigError, match="is not NAME=integer"):
            config_from_text(bad)
