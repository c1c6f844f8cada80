"""Presets (model ladders, standard grid) and the TOML plan parser."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from flashtune.autotune.grids import standard_grid
from flashtune.autotune.plans import (
    PACKAGED_DIR,
    PlanError,
    load_plan,
    packaged_plans,
    parse_plan,
    read_plan,
    resolve_plan,
    tune_command,
    varlen_lengths,
)
from flashtune.autotune.presets import MODELS, PRESET_TOKENS, UnknownPresetError, preset, presets
from flashtune.core.device import DeviceFingerprint
from flashtune.core.errors import FlashtuneError
from flashtune.core.problem import AttentionProblem


def test_preset_names() -> None:
    assert presets() == ["llama3-8b", "llama3-70b", "mistral-7b", "qwen2.5-7b", "gemma2-9b",
                         "standard"]


@pytest.mark.parametrize("name,hq,hkv,d", [("llama3-8b", 32, 8, 128), ("llama3-70b", 64, 8, 128),
                                          ("mistral-7b", 32, 8, 128), ("qwen2.5-7b", 28, 4, 128),
                                          ("gemma2-9b", 16, 8, 256)])
def test_model_presets(name: str, hq: int, hkv: int, d: int) -> None:
    problems = preset(name)
    assert MODELS[name].source
    seqlens = [p.seqlen_q for p in problems]
    assert seqlens[0] == 512 and seqlens[-1] == 16384 and seqlens == sorted(seqlens)
    for p in problems:
        assert (p.heads_q, p.heads_kv, p.head_dim) == (hq, hkv, d)
        assert p.causal and p.seqlen_q == p.seqlen_k and p.dtype == "bf16"
        assert p.batch * p.seqlen_q == PRESET_TOKENS


def test_preset_dtype_and_case() -> None:
    assert {p.dtype for p in preset("LLaMA3-8B", dtype="fp16")} == {"fp16"}


def test_standard_preset() -> None:
    assert preset("standard") == standard_grid()


def test_unknown_preset_lists_known() -> None:
    with pytest.raises(UnknownPresetError, match="llama3-8b.*standard") as info:
        preset("llama4")
    assert isinstance(info.value, FlashtuneError)
    assert "'llama4'" in str(info.value)


GOOD = """
[[shape]]
batch = 2
heads = 32
kv_heads = 8
seqlen = 1024
head_dim = 128
causal = true
dtype = "fp16"

[[shape]]
batch = 1
heads = 4
seqlen = 128
kv_seqlen = 256
head_dim = 64
"""


def test_parse_plan() -> None:
    assert parse_plan(GOOD) == [
        AttentionProblem(2, 32, 8, 1024, 1024, 128, True, "fp16"),
        AttentionProblem(1, 4, 4, 128, 256, 64, False, "bf16"),
    ]


def test_plan_score_modifications() -> None:
    text = ("[[shape]]\nbatch = 1\nheads = 4\nseqlen = 64\nhead_dim = 32\ncausal = true\n"
            "window = [15, 3]\nsoftcap = 5.0\nalibi = true\n"
            "[[shape]]\nbatch = 1\nheads = 4\nseqlen = 64\nhead_dim = 32\nwindow = [-1, 7]\n")
    causal, full = parse_plan(text)
    # causal is the right bound: the key keeps the left one only
    assert causal == AttentionProblem(1, 4, 4, 64, 64, 32, True, "bf16", 15, -1, 5.0, True)
    assert full.window_left == -1 and full.window_right == 7 and full.mods() == ("window",)


def test_load_plan(tmp_path: Path) -> None:
    path = tmp_path / "plan.toml"
    path.write_text(GOOD)
    assert len(load_plan(path)) == 2


def test_load_plan_missing_file(tmp_path: Path) -> None:
    with pytest.raises(PlanError, match="cannot read plan"):
        load_plan(tmp_path / "nope.toml")


@pytest.mark.parametrize("text,match", [
    ("[[shape]]\nbatch = 1\nheads = 4\nseqlen = 128\n", r"shape\[1\]: missing required field 'head_dim'"),
    ("[[shape]]\nbatch = 1\nheads = 4\nseqlen = '128'\nhead_dim = 64\n", r"shape\[1\]\.seqlen: expected an integer"),
    ("[[shape]]\nbatch = 1\nheads = 4\nseqlen = 1.5\nhead_dim = 64\n", r"shape\[1\]\.seqlen: expected an integer"),
    ("[[shape]]\nbatch = 0\nheads = 4\nseqlen = 8\nhead_dim = 64\n", r"shape\[1\]\.batch: must be positive"),
    ("[[shape]]\nbatch = 1\nheads = 4\nseqlen = 8\nhead_dim = 64\ncausal = 'yes'\n", r"shape\[1\]\.causal"),
    ("[[shape]]\nbatch = 1\nheads = 4\nseqlen = 8\nhead_dim = 64\ndtype = 'fp32'\n", r"shape\[1\]\.dtype: expected one of fp16, bf16"),
    ("[[shape]]\nbatch = 1\nheads = 4\nseqlen = 8\nhead_dim = 64\nheadz = 3\n", r"shape\[1\]: unknown field\(s\) headz"),
    ("[[shape]]\nbatch = 1\nheads = 6\nkv_heads = 4\nseqlen = 8\nhead_dim = 64\n", r"shape\[1\]: heads_q \(6\) must be a multiple"),
    ("[[shape]]\nbatch = 1\nheads = 4\nseqlen = 8\nhead_dim = 64\n[[shape]]\nbatch = 1\n", r"shape\[2\]: missing required field 'heads'"),
    ("[[shape]\nbatch = 1\n", r"not valid TOML"),
    ("", r"no \[\[shape\]\] tables"),
    ("shape = 3\n", r"no \[\[shape\]\] tables"),
    ("shape = [3]\n", r"shape\[1\]: expected a table"),
    ("title = 'x'\n[[shape]]\nbatch = 1\n", r"unknown top-level key\(s\) title"),
    ("[[shape]]\nbatch = 1\nheads = 4\nseqlen = 8\nhead_dim = 64\nwindow = [3]\n",
     r"shape\[1\]\.window: expected \[left, right\]"),
    ("[[shape]]\nbatch = 1\nheads = 4\nseqlen = 8\nhead_dim = 64\nwindow = [-2, 0]\n",
     r"shape\[1\]\.window"),
    ("[[shape]]\nbatch = 1\nheads = 4\nseqlen = 8\nhead_dim = 64\nsoftcap = -1.0\n",
     r"shape\[1\]\.softcap: expected a number >= 0"),
    ("[[shape]]\nbatch = 1\nheads = 4\nseqlen = 8\nhead_dim = 64\nalibi = 1\n",
     r"shape\[1\]\.alibi: expected true or false"),
])
def test_plan_errors(text: str, match: str) -> None:
    with pytest.raises(PlanError, match=match) as info:
        parse_plan(text, "p.toml")
    assert str(info.value).startswith("p.toml")


# -- grids, derived fields, packaged plans ----------------------------------------------------

def test_grid_is_the_product_in_written_order() -> None:
    text = ("[[grid]]\nbatch = 1\nheads = 4\nhead_dim = 32\nseqlen = [64, 128]\n"
            "causal = [false, true]\nwindow = [[-1, -1], [15, 0]]\n")
    problems = parse_plan(text)
    assert len(problems) == 8
    assert [(p.seqlen_q, p.causal, p.window_left) for p in problems[:4]] == [
        (64, False, -1), (64, False, 15), (64, True, -1), (64, True, 15)]
    # one pair is one window, not two values
    one = parse_plan("[[grid]]\nbatch = 1\nheads = 4\nhead_dim = 32\nseqlen = 64\n"
                     "window = [15, 0]\n")
    assert [(p.window_left, p.window_right) for p in one] == [(15, 0)]


def test_derived_fields_match_the_presets_and_the_standard_grid() -> None:
    text = ("[[grid]]\nhidden = 2048\ntokens = 16384\nhead_dim = [64, 128]\n"
            "causal = [false, true]\nseqlen = [512, 1024, 2048, 4096, 8192, 16384]\n"
            "[[grid]]\nmodel = 'llama3-70b'\ntokens = 16384\nseqlen = [512, 2048, 8192, 16384]\n"
            "causal = true\n")
    problems = parse_plan(text)
    assert problems == [*standard_grid(), *preset("llama3-70b")]


def test_a_problem_listed_twice_is_tuned_once() -> None:
    text = ("[[shape]]\nbatch = 2\nheads = 4\nseqlen = 64\nhead_dim = 32\n"
            "[[grid]]\ntokens = 128\nheads = 4\nseqlen = [64, 32]\nhead_dim = 32\n")
    assert [(p.batch, p.seqlen_q) for p in parse_plan(text)] == [(2, 64), (4, 32)]


@pytest.mark.parametrize("text,match", [
    ("[[grid]]\nmodel = 'llama9'\ntokens = 8\nseqlen = 8\n", r"grid\[1\]\.model: expected one of llama3-8b"),
    ("[[grid]]\nmodel = 'llama3-8b'\nheads = 4\ntokens = 8\nseqlen = 8\n", r"grid\[1\]: model gives .* drop heads"),
    ("[[grid]]\nhidden = 100\nhead_dim = [64, 50]\ntokens = 8\nseqlen = 8\n",
     r"grid\[1\] \(head_dim=64\)\.hidden: 100 is not a multiple of head_dim 64"),
    ("[[grid]]\nhidden = 128\nheads = 2\nhead_dim = 64\ntokens = 8\nseqlen = 8\n", r"hidden gives heads"),
    ("[[grid]]\nhidden = 128\ntokens = 8\nseqlen = 8\n", r"hidden needs head_dim"),
    ("[[grid]]\nheads = 2\nhead_dim = 64\ntokens = 8\nbatch = 2\nseqlen = 8\n", r"tokens gives the batch"),
    ("[[grid]]\nheads = 2\nhead_dim = 64\ntokens = 8\n", r"tokens needs seqlen"),
    ("[[grid]]\nheads = 2\nhead_dim = 64\nbatch = 1\nseqlen = []\n", r"grid\[1\]\.seqlen: an empty list"),
    ("[[grid]]\nheads = 2\nhead_dim = [64, 0]\nbatch = 1\nseqlen = 8\n", r"grid\[1\] \(head_dim=0\)\.head_dim: must be positive"),
    ("op = 'bwd'\n[[shape]]\nbatch = 1\nheads = 4\nseqlen = 8\nhead_dim = 64\n", r"op: expected one of fwd, train, decode"),
    ("grid = 3\n", r"no \[\[grid\]\] tables"),
])
def test_grid_errors(text: str, match: str) -> None:
    with pytest.raises(PlanError, match=match):
        parse_plan(text, "p.toml")


def test_varlen_lengths_as_a_comma_list() -> None:
    (packed,) = parse_plan("[[shape]]\nheads = 4\nhead_dim = 32\nvarlen_lengths = '64,30,2'\n")
    assert (packed.batch, packed.seqlen_q, packed.tokens_q) == (3, 64, 96)
    with pytest.raises(PlanError, match="positive token counts"):
        varlen_lengths("64,0", None)


def test_packaged_plans_by_name_and_path(tmp_path: Path) -> None:
    assert packaged_plans() == ["shipped-decode", "shipped-fwd", "shipped-train"]
    assert resolve_plan("shipped-fwd") == PACKAGED_DIR / "shipped-fwd.toml"
    assert resolve_plan("shipped-fwd.toml") == PACKAGED_DIR / "shipped-fwd.toml"
    own = tmp_path / "shipped-fwd"  # a file of that name wins over the packaged plan
    own.write_text(GOOD)
    assert resolve_plan(own) == own and len(read_plan(own).problems) == 2
    with pytest.raises(PlanError, match="cannot read plan 'nope': it does not exist and is not a "
                                        "packaged plan; "
                                        "packaged plans: shipped-decode, shipped-fwd, "
                                        "shipped-train"):
        read_plan("nope")
    with pytest.raises(PlanError, match="is not a file"):
        read_plan(tmp_path)


H100 = DeviceFingerprint("NVIDIA_H100_80GB_HBM3", "9.0", 132, 232448, 85 << 30)
H200 = DeviceFingerprint("NVIDIA_H200", "9.0", 132, 232448, 141 << 30)


@pytest.mark.parametrize("name", ["shipped-fwd", "shipped-train", "shipped-decode"])
def test_every_packaged_plan_shape_is_served_on_hopper(name: str) -> None:
    """Each shape of a shipped plan has an implementation of the plan's op that serves it on
    an H100 and an H200 (else tuning it would store nothing), bf16 only."""
    from flashtune.kernel_templates import implementations

    plan = read_plan(name)
    assert plan.op == name.removeprefix("shipped-") and plan.description
    assert len(plan.problems) >= 40
    specs = implementations(plan.op)
    for problem in plan.problems:
        assert problem.dtype == "bf16"
        for device in (H100, H200):
            assert any(s.refuse(problem, device) is None for s in specs), problem.describe()
    if plan.op == "decode":
        assert {p.seqlen_q for p in plan.problems} == {1}
        assert {p.batch for p in plan.problems} == {1, 4, 16, 64}
        assert {p.seqlen_k for p in plan.problems} >= {4096, 32768}
    else:  # the standard grid, and every preset model's geometry at 2048 and 8192 tokens
        assert set(standard_grid()) <= set(plan.problems)
        plain = {replace(p, window_left=-1, softcap=0.0) for p in plan.problems}
        for model in MODELS:
            ladder = [p for p in preset(model) if p.seqlen_q in (2048, 8192)]
            assert set(ladder) <= plain, model
        if plan.op == "fwd":  # the forward keeps every preset's whole ladder, plain
            assert {p for m in MODELS for p in preset(m)} <= set(plan.problems)
    families = {(p.heads_q, p.heads_kv, p.head_dim) for p in plan.problems}
    assert {(32, 8, 128), (64, 8, 128), (28, 4, 128), (16, 8, 256), (32, 32, 96)} <= families
    assert any(p.softcap == 50 and p.window_left == 4095 for p in plan.problems)
    if plan.op == "fwd":  # multi-query: a choice lent across GQA groups is a far one
        assert {(48, 1, 128), (8, 1, 256)} <= families
    if plan.op == "train":  # small D64 decoders (GPT-2-small, Llama-3.2-1B)
        assert {(12, 12, 64), (32, 8, 64)} <= families


def test_tune_command_round_trips_through_the_cli(monkeypatch: pytest.MonkeyPatch) -> None:
    """The command :func:`tune_command` writes parses back to the same problem key."""
    from click.testing import CliRunner

    from flashtune.cli import tune_commands
    from flashtune.cli.main import cli

    seen: list[AttentionProblem] = []

    def stop(problems: list[AttentionProblem], *args: object, **kwargs: object) -> None:
        seen.extend(problems)
        raise SystemExit(0)
    monkeypatch.setattr(tune_commands, "refuse_under_interpreter", stop)
    problems = [*read_plan("shipped-train").problems, *read_plan("shipped-decode").problems[:3],
                AttentionProblem(2, 4, 2, 77, 133, 40, False, "fp16", 8, 3, alibi=True)]
    for problem in problems:
        command = tune_command(problem, op="train")
        assert command.startswith("flashtune tune --op train ")
        result = CliRunner().invoke(cli, command.split()[1:] + ["--interpret"])
        assert result.exit_code == 0, (command, result.output)
        assert seen[-1].key() == problem.key(), command
    assert tune_command(problems[0], template="attn_bwd", plan="shipped-train") == \
        "flashtune tune --template attn_bwd --plan shipped-train"
    with pytest.raises(ValueError, match="exactly one of op and template"):
        tune_command(problems[0])
