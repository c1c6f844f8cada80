"""``flashtune bench --model`` through click's CliRunner: the tiny model under the interpreter,
the JSON and table, and every option that does not apply refused before any work."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from flashtune.cli import bench_modes as model_commands
from flashtune.cli.main import cli

pytest.importorskip("transformers")


def _bench(tmp_path, *args):
    return CliRunner().invoke(cli, ["--db", f"sqlite:///{tmp_path / 'ft.db'}", "bench",
                                    *args])


def test_the_families_agree_with_the_integration():
    from flashtune.integrations.model_bench import FAMILIES

    assert model_commands.MODEL_FAMILIES == FAMILIES


def test_bench_model_interpret_writes_json_and_prints_the_table(tmp_path):
    out = tmp_path / "runs" / "llama.json"
    res = _bench(tmp_path, "--model", "llama", "--interpret", "--phases", "prefill,generate",
                 "--baselines", "sdpa_math", "--rounds", "1", "--new-tokens", "2",
                 "--out", str(out))
    assert res.exit_code == 0, res.output
    result = json.loads(out.read_text())
    assert [r["phase"] for r in result["phases"]] == ["prefill", "generate"]
    assert result["contenders"] == ["flashtune", "sdpa_math", "sdpa"]
    assert result["workload"]["new_tokens"] == 2 and result["rounds"] == 1
    assert result["model"]["family"] == "llama" and result["interpret"] is True
    for row in result["phases"]:
        assert set(row["ms"]) == {"flashtune", "sdpa", "sdpa_math"}, row["errors"]
    assert "vs sdpa_math" in res.output and "decode ms/token" in res.output
    assert "attention calls ran on flashtune's route" in res.output
    assert f"wrote {out}" in res.output


def test_gemma2s_default_contenders_are_eager_and_flex_attention(tmp_path):
    """SDPA has no softcap, so Gemma 2's baselines are transformers' eager attention (the
    reference) and FlexAttention; a baseline that cannot run here is reported, not fatal."""
    out = tmp_path / "gemma2.json"
    res = _bench(tmp_path, "--model", "gemma2", "--interpret", "--phases", "prefill",
                 "--rounds", "1", "--out", str(out))
    assert res.exit_code == 0, res.output
    result = json.loads(out.read_text())
    assert result["contenders"] == ["flashtune", "eager", "flex_attention"]
    (row,) = result["phases"]
    assert {"flashtune", "eager"} <= set(row["ms"]), row["errors"]
    assert set(row["ms"]) | set(row["errors"]) == {"flashtune", "eager", "flex_attention"}
    assert "vs eager" in res.output


def test_model_shape_options_override_the_tiny_preset(tmp_path):
    out = tmp_path / "bert.json"
    res = _bench(tmp_path, "--model", "bert", "--interpret", "--phases", "forward",
                 "--layers", "1", "--heads", "2", "--batch", "1", "--seqlens", "9",
                 "--rounds", "1", "--out", str(out))
    assert res.exit_code == 0, res.output
    result = json.loads(out.read_text())
    assert result["model"]["layers"] == 1 and result["model"]["kv_heads"] == 2
    (row,) = result["phases"]
    assert row["label"] == "B1 x 9 tokens"
    assert row["routes"][0]["call"].startswith("q (1, 2, 9, 32)")


@pytest.mark.parametrize("args,message", [
    (["--model", "llama", "--causal"], "--causal does not apply to --model"),
    (["--model", "llama", "--plan", "x.toml"], "--plan does not apply to --model"),
    (["--layers", "2"], "--layers only apply with --model"),
    (["--model", "bert", "--interpret", "--phases", "generate"],
     "--model bert has phases forward, train"),
    (["--model", "llama", "--interpret", "--baselines", "flex"],
     "unknown baselines for --model ['flex']"),
    (["--model", "llama", "--interpret", "--hidden", "66"],
     "hidden 66 is not a multiple of heads 4"),
    (["--model", "gpt"], "'gpt' is not one of 'llama', 'mistral', 'gemma2', 'gemma3', 'bert', 'vit'"),
])
def test_options_that_do_not_apply_are_refused(tmp_path, args, message):
    res = _bench(tmp_path, *args, "--out", str(tmp_path / "x.json"))
    assert res.exit_code != 0
    assert message in " ".join(res.output.split()), res.output
    assert not (tmp_path / "x.json").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU refusal")
def test_without_a_gpu_it_says_so_and_stops(tmp_path):
    res = _bench(tmp_path, "--model", "vit", "--out", str(tmp_path / "x.json"))
    assert res.exit_code != 0
    assert "no CUDA GPU found" in res.output and "--interpret" in res.output


def test_bench_dispatch_interpret_checks_and_times_every_contender(tmp_path):
    out = tmp_path / "dispatch.json"
    res = _bench(tmp_path, "--dispatch", "--interpret", "--batch", "1", "--heads", "2",
                 "--kv-heads", "1", "--seqlen", "16", "--head-dim", "16", "--causal",
                 "--calls", "2", "--rounds", "2", "--out", str(out))
    assert res.exit_code == 0, res.output
    result = json.loads(out.read_text())
    (row,) = result["rows"]
    assert row["label"] == "B1 H2/1 N16 D16 causal" and row["errors"] == {}
    assert set(row["us_per_call"]) == {"attention", "routed", "triton", "sdpa",
                                       "attention_new_shape", "sdpa_new_shape"}
    assert row["new_shape_over_sdpa"] == pytest.approx(  # a new key length every call
        row["us_per_call"]["attention_new_shape"] / row["us_per_call"]["sdpa_new_shape"])
    assert row["attention_over_sdpa"] == pytest.approx(
        row["us_per_call"]["attention"] / row["us_per_call"]["sdpa"])
    assert row["attention_over_sdpa_best"] == pytest.approx(  # the fastest rounds'
        min(row["samples_us"]["attention"]) / min(row["samples_us"]["sdpa"]))
    assert row["route"].startswith("attn_fwd (") and "dispatch us" in res.output
    assert "new shape / sdpa" in res.output


@pytest.mark.parametrize("args,message", [
    (["--dispatch", "--model", "llama"], "give --dispatch or --model, not both"),
    (["--dispatch", "--interpret", "--batch", "1"], "a --dispatch shape needs --heads, "
                                                    "--seqlen, --head-dim too"),
    (["--dispatch", "--plan", "x.toml"], "--plan does not apply to --dispatch"),
    (["--dispatch", "--layers", "2"], "--layers does not apply to --dispatch"),
    (["--calls", "5"], "--calls only applies with --dispatch"),
    (["--model", "llama", "--calls", "5"], "--calls only applies with --dispatch"),
])
def test_dispatch_options_that_do_not_apply_are_refused(tmp_path, args, message):
    res = _bench(tmp_path, *args, "--out", str(tmp_path / "x.json"))
    assert res.exit_code != 0
    assert message in " ".join(res.output.split()), res.output
    assert not (tmp_path / "x.json").exists()
