"""A packed batch (``attention_varlen``) as a tuning problem: its key, its canonical batch,
the tuning cases of every kernel that serves it, plans and ``tune --varlen-lengths``, and
the router finding what was tuned for it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from flashtune.autotune.plans import PlanError, parse_plan, varlen_lengths
from flashtune.cli.main import cli
from flashtune.core.device import interpreter_device
from flashtune.core.problem import PACKED_DISTANCE, AttentionProblem
from flashtune.kernel_templates.registry import get_template, implementations

PACKED = AttentionProblem.from_lengths([20, 7, 13, 3], None, heads_q=4, heads_kv=2,
                                       head_dim=32, causal=True, dtype="fp16")


def test_a_packed_key_keeps_count_longest_and_total_and_a_dense_key_is_unchanged() -> None:
    assert PACKED.key() == dict(batch=4, heads_q=4, heads_kv=2, seqlen_q=20, seqlen_k=20,
                                head_dim=32, causal=True, dtype="fp16", tokens_q=43,
                                tokens_k=43)
    assert AttentionProblem.from_key(PACKED.key()) == PACKED
    dense = AttentionProblem(4, 4, 2, 20, 20, 32, True, "fp16")
    assert "tokens_q" not in dense.key() and not dense.packed and PACKED.packed
    assert PACKED.bucket() == dense.bucket() + "-packed64"
    assert "packed(43/43 tokens)" in PACKED.describe()


def test_the_canonical_batch_has_the_keys_count_longest_and_total() -> None:
    lengths_q, lengths_k = PACKED.packed_lengths()
    assert lengths_q == lengths_k == (20, 8, 8, 7)
    few = AttentionProblem(3, 1, 1, 10, 10, 16, False, "fp16", tokens_q=2, tokens_k=2)
    assert few.packed_lengths()[0] == (1, 1, 0)  # fewer tokens than sequences: empty ones
    # the work counted is the canonical sequences' own (causal: their triangles)
    per_sequence = sum(AttentionProblem(1, 4, 2, n, n, 32, True, "fp16").flops()
                       for n in lengths_q)
    assert PACKED.flops() == pytest.approx(per_sequence)
    assert PACKED.flops(backward=True) == pytest.approx(2.5 * per_sequence)


@pytest.mark.parametrize("fields, needle", [
    (dict(tokens_q=81, tokens_k=81), "cannot be 4 sequences of at most 20"),
    (dict(tokens_q=40, tokens_k=0), "set together"),
    (dict(tokens_q=-1, tokens_k=-1), "tokens_q must be an int >= 0"),
])
def test_bad_packed_fields_are_refused(fields: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        AttentionProblem(4, 4, 2, 20, 20, 32, True, "fp16", **fields)


def test_from_lengths_refuses_what_is_no_batch() -> None:
    with pytest.raises(ValueError, match="lengths_q must be a non-empty list"):
        AttentionProblem.from_lengths([], None, heads_q=1, heads_kv=1, head_dim=16,
                                      causal=False, dtype="fp16")
    with pytest.raises(ValueError, match="2 query lengths but 1 key"):
        AttentionProblem.from_lengths([3, 4], [5], heads_q=1, heads_kv=1, head_dim=16,
                                      causal=False, dtype="fp16")


def test_a_packed_problem_is_nearer_a_packed_one_than_the_dense_one_of_its_key() -> None:
    dense = AttentionProblem(4, 4, 2, 20, 20, 32, True, "fp16")
    other = AttentionProblem.from_lengths([20, 5, 5, 5, 5], None, heads_q=4, heads_kv=2,
                                          head_dim=32, causal=True, dtype="fp16")
    assert PACKED.distance(dense) >= PACKED_DISTANCE
    assert PACKED.distance(other) < PACKED.distance(dense)
    assert PACKED.distance(PACKED) == 0


def test_only_the_kernels_with_varlen_serve_a_packed_problem() -> None:
    device = interpreter_device()
    serving = {s.name for s in implementations("fwd") if s.refuse(PACKED, device) is None}
    assert serving == {"attn_fwd"}
    assert get_template("attn_bwd").refuse(PACKED, device) is None
    assert "packed batch" in (get_template("sdpa_math").refuse(
        AttentionProblem(4, 4, 4, 20, 20, 32, False, "fp16", tokens_q=43, tokens_k=43),
        device) or "")


@pytest.mark.parametrize("op", ["fwd", "bwd", "train"])
def test_the_tuning_cases_of_a_packed_problem_check_against_the_per_sequence_reference(
        op: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    device = interpreter_device()
    problem = AttentionProblem.from_lengths([11, 3, 17], None, heads_q=4, heads_kv=2,
                                            head_dim=32, causal=True, dtype="fp16",
                                            window_left=5)
    spec = {"fwd": get_template("attn_fwd"), "bwd": get_template("attn_bwd"),
            "train": next(s for s in implementations("train") if s.name == "attn_fwd")}[op]
    case = spec.make_case(problem, device, torch_device="cpu",
                          generator=torch.Generator().manual_seed(0), launcher=spec.launcher)
    error = case.error(case.launch(spec.default_config(problem, device)))
    assert error < 2e-3
    # the check can fail: a batch that attends across its sequences is caught
    if op == "fwd":
        q, k, v = case.inputs["q"], case.inputs["k"], case.inputs["v"]
        across = get_template("attn_fwd").launcher(
            q, k, v, spec.default_config(problem, device), causal=True, window=(5, 0),
            cu_seqlens_q=torch.tensor([0, 31], dtype=torch.int32),
            cu_seqlens_k=torch.tensor([0, 31], dtype=torch.int32), max_seqlen_q=31)
        assert case.error(across) > 0.05
    assert case.flops == pytest.approx(problem.flops(backward=op == "bwd")
                                       + (problem.flops(backward=True) if op == "train" else 0))


def test_random_lengths_are_seeded_and_fill_the_tokens() -> None:
    lengths = varlen_lengths("random:0", 16384)
    assert lengths == varlen_lengths("random:0", 16384) != varlen_lengths("random:1", 16384)
    assert sum(lengths) == 16384 and all(1 <= n <= 4096 for n in lengths)
    assert all(128 <= n for n in lengths[:-1])  # only the last one is cut
    short = varlen_lengths("random:3:10-20", 100)
    assert sum(short) == 100 and all(n <= 20 for n in short)


def test_a_lengths_file_reads_whitespace_commas_and_comments(tmp_path: Path) -> None:
    path = tmp_path / "lengths.txt"
    path.write_text("20 7\n# a comment\n13, 3  # tail\n")
    assert varlen_lengths(str(path), None) == [20, 7, 13, 3]
    path.write_text("[4, 5]")
    assert varlen_lengths(str(path), None) == [4, 5]


@pytest.mark.parametrize("spec, total, needle", [
    ("random:x", 10, "expected 'random:SEED'"),
    ("random:0:5-2", 10, "1 <= MIN <= MAX"),
    ("random:0", None, "needs the tokens to fill"),
    ("/no/such/file", None, "cannot read lengths file"),
    ([3, 0], None, "positive token counts"),
])
def test_bad_lengths_name_the_option(spec: object, total: int | None, needle: str) -> None:
    with pytest.raises(PlanError, match=needle):
        varlen_lengths(spec, total, "--varlen-lengths")


def test_a_plan_shape_with_varlen_lengths(tmp_path: Path) -> None:
    (tmp_path / "docs.txt").write_text("20 7 13 3")
    text = """
[[shape]]
heads = 4
kv_heads = 2
head_dim = 32
causal = true
dtype = "fp16"
varlen_lengths = "docs.txt"

[[shape]]
heads = 4
head_dim = 32
seqlen = 300
varlen_lengths = "random:0:10-100"
"""
    first, second = parse_plan(text, "plan.toml", tmp_path)
    assert first == PACKED
    assert second.packed and second.tokens_q == 300 and second.seqlen_q <= 100
    with pytest.raises(PlanError, match="takes no batch or kv_seqlen"):
        parse_plan("[[shape]]\nbatch = 2\nheads = 4\nhead_dim = 32\nvarlen_lengths = [3, 4]\n")


def _cli(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, list(args))
    assert "Traceback" not in result.output, result.output
    return result.exit_code, result.output


@pytest.mark.parametrize("args, needle", [
    (["--batch", "2"], "--batch cannot be combined with --varlen-lengths"),
    (["--seqlen", "40"], "--seqlen 40 is not the 43 tokens"),
])
def test_tune_varlen_lengths_usage_errors(args: list[str], needle: str,
                                          tmp_path: Path) -> None:
    path = tmp_path / "lengths.txt"
    path.write_text("20 7 13 3")
    code, output = _cli("--db", f"sqlite:///{tmp_path / 't.db'}", "tune", "--varlen-lengths",
                        str(path), "--heads", "4", "--head-dim", "32", *args)
    assert code == 2 and needle in output


def test_tune_varlen_lengths_random_needs_the_tokens(tmp_path: Path) -> None:
    code, output = _cli("--db", f"sqlite:///{tmp_path / 't.db'}", "tune", "--varlen-lengths",
                        "random:0", "--heads", "4", "--head-dim", "32")
    assert code == 2 and "needs the tokens to fill" in output


def test_tune_a_packed_batch_and_attention_varlen_runs_what_was_tuned(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """End to end under the interpreter: ``tune --varlen-lengths FILE`` stores the packed
    problem's best config; ``attention_varlen`` on a batch of those lengths finds it by its
    exact key, and a batch of other lengths by the nearest packed entry."""
    import flashtune
    from flashtune.runtime.scored import lookup_varlen

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    url = f"sqlite:///{tmp_path / 't.db'}"
    path = tmp_path / "lengths.txt"
    path.write_text("20 7 13 3")
    code, output = _cli("--db", url, "tune", "--template", "attn_fwd", "--varlen-lengths",
                        str(path), "--heads", "4", "--kv-heads", "2", "--head-dim", "32",
                        "--causal", "--dtype", "fp16", "--trials", "2", "--no-progress")
    assert code == 0, output
    assert "packed(43/43 tokens)" in output
    flashtune.reload_configs(db_url=url)
    try:
        def call(lengths: list[int]) -> flashtune.ConfigChoice:
            cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()],
                              dtype=torch.int32)
            q = torch.randn(sum(lengths), 4, 32, dtype=torch.float16)
            k = torch.randn(sum(lengths), 2, 32, dtype=torch.float16)
            out = flashtune.attention_varlen(q, k, k, cu, cu, max(lengths), max(lengths),
                                             causal=True)
            assert torch.isfinite(out.float()).all()
            problem = AttentionProblem.from_lengths(lengths, None, heads_q=4, heads_kv=2,
                                                    head_dim=32, causal=True, dtype="fp16")
            return lookup_varlen(problem, q, k, k)

        assert call([20, 7, 13, 3]).source == "exact"
        nearest = call([18, 9, 9])
        assert nearest.source in ("nearest", "bucket")
        assert nearest.tuned_problem == PACKED
    finally:
        flashtune.reload_configs()
