"""Attention dropout as part of the tuning problem (issue 31, item 2): its key (only where
set), bucket, distance and line; who serves it (attn_fwd, attn_bwd and their training
pair); the tuning cases of each op checked against the reference given the case's one mask;
export/import validation; plans and ``tune --dropout``; the router finding what was tuned
for it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from flashtune.autotune.plans import PlanError, parse_plan
from flashtune.cli.main import cli
from flashtune.core.case import mods_kwargs, mods_options
from flashtune.core.device import interpreter_device
from flashtune.core.problem import DROPOUT_DISTANCE, OPTIONAL, AttentionProblem
from flashtune.db.exchange_checks import Bad
from flashtune.db.exchange_checks import problem as check_problem
from flashtune.kernel_templates.registry import get_template, implementations

DROP = AttentionProblem(2, 4, 2, 33, 40, 32, True, "fp16", dropout=0.1)
PLAIN = AttentionProblem(2, 4, 2, 33, 40, 32, True, "fp16")


def test_the_key_has_dropout_only_where_set() -> None:
    assert DROP.key() == {**PLAIN.key(), "dropout": 0.1} and "dropout" not in PLAIN.key()
    assert "dropout" in OPTIONAL
    assert AttentionProblem.from_key(DROP.key()) == DROP
    assert AttentionProblem.from_key(PLAIN.key()) == PLAIN  # keys from before it existed
    assert DROP.bucket() == PLAIN.bucket() + "-drop0.1"
    assert DROP.describe().endswith(" dropout=0.1")
    assert DROP.flops() == PLAIN.flops()  # FlashAttention's count: the same dots
    # any rate is as near as another; none against some is farther
    assert DROP.distance(AttentionProblem(2, 4, 2, 33, 40, 32, True, "fp16", dropout=0.3)) \
        == 0
    assert DROP.distance(PLAIN) == DROPOUT_DISTANCE


@pytest.mark.parametrize("bad", [1.0, -0.1, True, "0.1", float("nan")])
def test_bad_dropout_is_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="dropout must be a probability"):
        AttentionProblem(1, 1, 1, 8, 8, 16, False, "fp16", dropout=bad)  # type: ignore


def test_only_attn_fwd_attn_bwd_and_their_pair_serve_dropout() -> None:
    device = interpreter_device()
    assert {s.name for s in implementations("fwd") if s.refuse(DROP, device) is None} \
        == {"attn_fwd"}
    assert get_template("attn_bwd").refuse(DROP, device) is None
    train = {s.name for s in implementations("train") if s.refuse(DROP, device) is None}
    assert train == {"attn_fwd"}
    short = AttentionProblem(2, 4, 2, 1, 40, 32, False, "fp16", dropout=0.1)
    assert "dropout 0.1" in get_template("attn_decode").refuse(short, device)


def test_the_launcher_keywords_carry_one_seed_per_case() -> None:
    g = torch.Generator().manual_seed(0)
    options = mods_options(DROP, "cpu", g)
    assert options["dropout_p"] == 0.1 and options["seed"].dtype == torch.int64
    assert mods_options(PLAIN, "cpu", g) == {}
    assert mods_kwargs(DROP, seed="stand-in") == {"dropout_p": 0.1, "seed": "stand-in"}


@pytest.mark.parametrize("op", ["fwd", "bwd", "train"])
@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
def test_the_tuning_cases_check_against_the_reference_with_the_cases_mask(
        op: str, packed: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    device = interpreter_device()
    problem = DROP
    if packed:
        problem = AttentionProblem.from_lengths([11, 3, 17], None, heads_q=4, heads_kv=2,
                                                head_dim=32, causal=True, dtype="fp16",
                                                dropout=0.2)
    spec = {"fwd": get_template("attn_fwd"), "bwd": get_template("attn_bwd"),
            "train": next(s for s in implementations("train") if s.name == "attn_fwd")}[op]
    case = spec.make_case(problem, device, torch_device="cpu",
                          generator=torch.Generator().manual_seed(0), launcher=spec.launcher)
    config = spec.default_config(problem, device)
    out = case.launch(config)
    assert case.error(out) < 2e-3
    if op == "fwd" and not packed:
        # the check can fail: another seed drops other scores
        q, k, v = case.inputs["q"], case.inputs["k"], case.inputs["v"]
        other = spec.launcher(q, k, v, config, causal=True, dropout_p=0.1,
                              seed=torch.tensor([12345]))
        assert case.error(other) > 0.05


def test_export_import_checks_validate_dropout() -> None:
    assert check_problem(DROP.key(), "entries[0].problem") == DROP
    with pytest.raises(Bad, match=r"entries\[0\]\.problem\.dropout"):
        check_problem({**DROP.key(), "dropout": 1.5}, "entries[0].problem")


def test_a_plan_shape_with_dropout() -> None:
    text = "[[shape]]\nbatch = 32\nheads = 12\nseqlen = 512\nhead_dim = 64\ndropout = 0.1\n"
    (shape,) = parse_plan(text)
    assert shape.dropout == 0.1
    with pytest.raises(PlanError, match=r"shape\[1\]\.dropout: expected a probability"):
        parse_plan(text.replace("0.1", "1.0"))


def _cli(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, list(args))
    assert "Traceback" not in result.output, result.output
    return result.exit_code, result.output


def test_tune_dropout_usage(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 't.db'}"
    code, output = _cli("--db", db, "tune", "--dropout", "1", "--batch", "1", "--heads", "2",
                        "--seqlen", "16", "--head-dim", "16")
    assert code == 2 and "--dropout" in output
    plan = tmp_path / "p.toml"
    plan.write_text("[[shape]]\nbatch = 1\nheads = 2\nseqlen = 16\nhead_dim = 16\n")
    code, output = _cli("--db", db, "tune", "--dropout", "0.1", "--plan", str(plan))
    assert code == 2 and "in a plan set them per [[shape]]" in output


def test_tune_dropout_and_the_router_runs_what_was_tuned(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """End to end under the interpreter: ``tune --dropout 0.1`` stores the problem with its
    rate; a dropout call finds it by its exact key, a call at another rate by the nearest
    one with dropout."""
    import flashtune

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    url = f"sqlite:///{tmp_path / 't.db'}"
    code, output = _cli("--db", url, "tune", "--template", "attn_fwd", "--batch", "1",
                        "--heads", "2", "--seqlen", "32", "--head-dim", "16", "--dtype",
                        "fp16", "--dropout", "0.1", "--trials", "2", "--no-progress")
    assert code == 0, output
    assert "dropout=0.1" in output
    flashtune.reload_configs(db_url=url)
    try:
        q = torch.randn(1, 2, 32, 16, dtype=torch.float16)
        exact = flashtune.lookup_config(q, q, q, dropout_p=0.1)
        assert exact.source == "exact" and exact.tuned_problem.dropout == 0.1
        near = flashtune.lookup_config(q, q, q, dropout_p=0.3)
        assert near.source in ("nearest", "bucket") and near.tuned_problem.dropout == 0.1
        assert torch.isfinite(flashtune.attention(q, q, q, dropout_p=0.1).float()).all()
    finally:
        flashtune.reload_configs()


def test_shared_inputs_hand_out_one_draw_and_move_the_generator_as_drawing_would():
    """``shared_inputs``: the same draw (problem, names, generator state) is the same
    tensors, and what the generator draws next (a dropout seed, ALiBi slopes) is what it
    would have drawn without the sharing; packed batches too."""
    from dataclasses import replace

    from flashtune.core.case import packed_inputs, random_inputs, shared_inputs

    p = AttentionProblem(2, 4, 2, 24, 40, 16, True, "fp16", dropout=0.1)

    def draw(problem, names=("q", "k", "v")):
        g = torch.Generator().manual_seed(3)
        t = random_inputs(problem, "cpu", g, names)
        return t, mods_options(problem, "cpu", g)

    alone, alone_mods = draw(p)
    with shared_inputs():
        first, first_mods = draw(p)
        second, second_mods = draw(p)
        other, _ = draw(p, ("q", "k", "v", "do"))  # another draw: its own tensors
        packed = replace(p, tokens_q=50, tokens_k=60, batch=3)
        pa = packed_inputs(packed, "cpu", torch.Generator().manual_seed(1))[0]
        pb = packed_inputs(packed, "cpu", torch.Generator().manual_seed(1))[0]
    assert all(first[n] is second[n] for n in "qkv") and pa["k"] is pb["k"]
    assert other["q"] is not first["q"] and torch.equal(other["q"], first["q"])
    assert all(torch.equal(alone[n], first[n]) for n in "qkv")
    assert int(alone_mods["seed"]) == int(first_mods["seed"]) == int(second_mods["seed"])
    after = draw(p)[0]  # the sharing ended with the block
    assert after["q"] is not first["q"]
