"""Presets (model ladders, standard grid) and the TOML plan parser."""

from __future__ import annotations

from pathlib import Path

import pytest

from flashtune.autotune.grids import standard_grid
from flashtune.autotune.plans import PlanError, load_plan, parse_plan
from flashtune.autotune.presets import MODELS, PRESET_TOKENS, UnknownPresetError, preset, presets
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
