"""The harness around FlashAttention-2's test file, on CPU: the einops stand-in against
einops' semantics, FlashAttention-2's vendored helpers running on it, the sampling, and the
table. (The file itself runs on the GPU only.)"""

from __future__ import annotations

import contextlib
import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.fa2_suite import conftest as suite
from tests.fa2_suite import einops_lite, sampling
from tests.fa2_suite.einops_lite import rearrange, repeat

ROOT = Path(__file__).resolve().parents[2]

# every pattern FlashAttention-2's test file and the vendored helpers use, with the shape
# and keyword sizes they use it with
PATTERNS = [
    ("rearrange", "b h -> b h 1 1", (2, 3), {}),
    ("rearrange", "s -> s 1", (5,), {}),
    ("rearrange", "b -> b 1 1 1", (2,), {}),
    ("repeat", "s -> b 1 1 s", (5,), {"b": 3}),
    ("rearrange", "b s -> b 1 1 s", (2, 5), {}),
    ("repeat", "b s h d -> b s (h g) d", (2, 3, 2, 4), {"g": 3}),
    ("rearrange", "b s -> b 1 s 1", (2, 5), {}),
    ("rearrange", "b s -> b s 1 1", (2, 5), {}),
    ("rearrange", "(b s) h d -> b s h d", (6, 2, 4), {"b": 2}),
    ("rearrange", "b s h d -> (b s) h d", (2, 3, 2, 4), {}),
    ("rearrange", "(b s) t h d -> b s t h d", (6, 3, 2, 4), {"b": 3}),
    ("repeat", "s_16 s_256 -> (s_16 16) (s_256 256)", (2, 1), {}),
    ("rearrange", "t s -> 1 1 t s", (3, 4), {}),
    ("rearrange", "b h s -> b h s 1", (2, 3, 4), {}),
    ("repeat", "b s two h d -> b s two (h g) d", (2, 3, 2, 2, 4), {"g": 2}),
    ("rearrange", "b s ... -> s b ...", (2, 3, 4, 5), {}),
    ("rearrange", "b -> b 1", (3,), {}),
    ("rearrange", "s -> 1 s", (3,), {}),
    ("rearrange", "b s h d -> b 1 (s h) d", (2, 3, 4, 5), {}),
    ("rearrange", "b 1 (s h) d -> b s h d", (2, 1, 12, 5), {"s": 3}),
    ("rearrange", "b s ... -> (b s) ...", (2, 3, 4, 5), {}),
    ("rearrange", "(b nblocks) block_size ... -> b (nblocks block_size) ...", (6, 4, 2, 3),
     {"b": 2}),
    ("rearrange", "(b nblocks) -> b nblocks", (6,), {"b": 2}),
    ("rearrange", "b ... -> b (...)", (2, 3, 4), {}),
    ("repeat", "z -> z d", (4,), {"d": 3}),
    ("rearrange", "... d two -> ... (d two)", (2, 3, 4, 2), {"two": 2}),
    ("repeat", "... d -> ... 1 (2 d)", (5, 4), {}),
    ("repeat", "... d -> ... 1 (d 2)", (2, 5, 4), {}),
]


def _arange(shape):
    return torch.arange(torch.Size(shape).numel()).reshape(shape)


@pytest.mark.parametrize("fn,pattern,shape,sizes", PATTERNS, ids=[p[1] for p in PATTERNS])
def test_einops_lite_against_einops(fn, pattern, shape, sizes):
    """Where einops is installed, the stand-in matches it on every pattern the suite uses."""
    einops = pytest.importorskip("einops")
    x = _arange(shape)
    got = getattr(einops_lite, fn)(x, pattern, **sizes)
    want = getattr(einops, fn)(x, pattern, **sizes)
    assert got.shape == want.shape and torch.equal(got, want)


def test_einops_lite_by_hand():
    x = _arange((2, 3, 4, 5))
    assert torch.equal(rearrange(x, "b s h d -> (b s) h d"), x.reshape(6, 4, 5))
    assert torch.equal(rearrange(x, "b s ... -> s b ..."), x.transpose(0, 1))
    assert torch.equal(rearrange(x, "b s h d -> b 1 (s h) d"), x.reshape(2, 1, 12, 5))
    assert torch.equal(rearrange(x.reshape(2, 1, 12, 5), "b 1 (s h) d -> b s h d", s=3), x)
    kv = _arange((2, 3, 2, 4))
    g = repeat(kv, "b s h d -> b s (h g) d", g=3)
    assert g.shape == (2, 3, 6, 4)
    assert torch.equal(g, kv.repeat_interleave(3, dim=2))
    c = _arange((5, 4))
    assert torch.equal(repeat(c, "... d -> ... 1 (2 d)"), torch.cat([c, c], -1)[:, None])
    assert torch.equal(repeat(c, "... d -> ... 1 (d 2)"), c.repeat_interleave(2, -1)[:, None])
    assert torch.equal(repeat(torch.arange(4), "z -> z d", d=3),
                       torch.arange(4)[:, None].expand(4, 3))
    s = repeat(torch.tensor([[True], [False]]), "s_16 s_256 -> (s_16 16) (s_256 256)")
    assert s.shape == (32, 256) and s[:16].all() and not s[16:].any()
    with pytest.raises(einops_lite.EinopsError, match="missing on the right"):
        rearrange(x, "b s h d -> b s h")
    with pytest.raises(einops_lite.EinopsError, match="not on the left"):
        rearrange(x, "b s h d -> b s h d e")
    with pytest.raises(einops_lite.EinopsError, match="does not split"):
        rearrange(torch.zeros(7), "(b s) -> b s", b=2)


@pytest.fixture
def fa2_helpers(monkeypatch):
    """FlashAttention-2's vendored helpers, imported as the suite imports them (einops:
    the real one if installed, else the stand-in)."""
    monkeypatch.syspath_prepend(str(suite.SHIM))
    if importlib.util.find_spec("einops") is None:
        monkeypatch.setitem(sys.modules, "einops", einops_lite)
    for name in [n for n in sys.modules if n.startswith("flash_attn")]:
        monkeypatch.delitem(sys.modules, name)
    yield importlib.import_module("flash_attn.bert_padding"), importlib.import_module(
        "flash_attn.layers.rotary")
    for name in [n for n in sys.modules if n.startswith("flash_attn")]:
        del sys.modules[name]


def test_vendored_padding_helpers_round_trip(fa2_helpers):
    bert_padding, _ = fa2_helpers
    x = torch.randn(3, 7, 2, 4, requires_grad=True)
    mask = torch.arange(7)[None, :] < torch.tensor([[7], [2], [5]])
    unpadded, indices, cu, longest, used = bert_padding.unpad_input(x, mask)
    assert unpadded.shape == (14, 2, 4) and longest == 7
    assert cu.tolist() == [0, 7, 9, 14] and cu.dtype == torch.int32
    assert torch.equal(unpadded, x[mask])
    back = bert_padding.pad_input(unpadded, indices, 3, 7)
    assert torch.equal(back, x * mask[..., None, None])
    back.sum().backward()
    assert torch.equal(x.grad, mask[..., None, None].expand_as(x).float())


@pytest.mark.parametrize("interleaved", [False, True])
def test_vendored_rotary_kernel_matches_its_torch_reference(fa2_helpers, interleaved,
                                                            monkeypatch):
    """FlashAttention-2's Triton rotary kernel (the test's reference for the KV-cache call's
    rotary), under the interpreter, against the torch formula in the same file, per-sequence
    offsets included."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the interpreter check runs on CPU")
    _, rotary = fa2_helpers
    # its launch picks the tensor's CUDA device; a CPU tensor has none
    monkeypatch.setattr(torch.cuda, "device", lambda index: contextlib.nullcontext())
    x = torch.randn(2, 3, 2, 32)
    angle = torch.rand(12, 8) * 6.28
    cos, sin = torch.cos(angle), torch.sin(angle)
    offsets = torch.tensor([0, 5], dtype=torch.int32)
    got = rotary.apply_rotary_emb(x, cos, sin, seqlen_offsets=offsets, interleaved=interleaved)
    for b in range(2):
        o = int(offsets[b])
        want = rotary.apply_rotary_emb_torch(x[b:b + 1], cos[o:o + 3], sin[o:o + 3],
                                             interleaved=interleaved)
        torch.testing.assert_close(got[b:b + 1], want, atol=1e-5, rtol=0)


def test_sampling_is_fixed_and_covers_every_function():
    groups = {f"test_{g}": [(f"{g}-{i}", (g, i)) for i in range(n)]
              for g, n in (("a", 100), ("b", 7), ("c", 1000))}
    first = sampling.sample(groups, 40, seed=0)
    assert first == sampling.sample(groups, 40, seed=0)
    assert [len(first[g]) for g in sorted(first)] == [40, 7, 40]
    assert first != sampling.sample(groups, 40, seed=1)
    # a function's sample does not depend on the others
    assert sampling.sample({"test_a": groups["test_a"]}, 40, 0)["test_a"] == first["test_a"]
    assert sum(map(len, sampling.sample(groups, None).values())) == 1107
    flat = [c for g in sorted(first) for c in first[g]]
    parts = [sampling.shard(flat, (i, 3)) for i in (1, 2, 3)]
    assert sorted(c for p in parts for c in p) == sorted(flat)
    assert sampling.parse_cases(None) == sampling.DEFAULT_CASES
    assert sampling.parse_cases("all") is None and sampling.parse_cases("0") is None
    assert sampling.parse_shard("2/4") == (2, 4)
    with pytest.raises(ValueError, match="1 <= i <= n"):
        sampling.parse_shard("5/4")


def test_the_table():
    """Its rows say what they do; the dropout-mask row deselects exactly the four functions'
    dropout cases, the xfail rows follow what flashtune takes."""
    assert {r.action for r in suite.TABLE} == {"deselect", "skip", "xfail"}
    dmask = suite.TABLE[0]
    assert dmask.applies("test_flash_attn_output", {"dropout_p": 0.17})
    assert not dmask.applies("test_flash_attn_output", {"dropout_p": 0.0})
    assert not dmask.applies("test_flash_attn_race_condition", {"dropout_p": 0.17})
    xfail = [r for r in suite.TABLE if r.action == "xfail"]
    drop = next(r for r in xfail if "dropout" in r.reason)
    assert drop.applies("test_flash_attn_race_condition", {"dropout_p": 0.17}) == (
        not suite.accepts("attention", "dropout_p"))
    head = next(r for r in xfail if "head dim" in r.reason)
    assert not head.applies("test_flash_attn_causal", {"d": 64})
    assert head.applies("test_flash_attn_causal", {"d": 300})


def test_cpu_collection_skips_the_file_without_importing_it():
    """Without the GPU run, FlashAttention-2's file (which reads the CUDA device at import)
    is one skipped placeholder, collected in well under a second."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("FLASHTUNE_TEST_DEVICE", "FLASHTUNE_FA2_DRY")}
    done = subprocess.run([sys.executable, "-m", "pytest", "tests/fa2_suite/test_flash_attn.py",
                           "-q", "-p", "no:cacheprovider", "-rs"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 skipped" in done.stdout and "needs a CUDA GPU" in done.stdout


def _junit(path: Path, cases: dict[str, str | None], props: dict[str, str] | None = None) -> Path:
    """A JUnit XML of the suite's cases: name -> None (passed) or a failure message."""
    rows = []
    for name, failure in cases.items():
        body = "" if failure is None else f'<failure message="{failure}">trace</failure>'
        rows.append(f'<testcase classname="tests.fa2_suite.test_flash_attn" name="{name}" '
                    f'time="1.5">{body}</testcase>')
    prop = "".join(f'<property name="{k}" value="{v}"/>' for k, v in (props or {}).items())
    path.write_text(f'<testsuites><testsuite><properties>{prop}</properties>{"".join(rows)}'
                    "</testsuite></testsuites>")
    return path


def test_report_adds_shards_and_counts_reruns(tmp_path):
    """The shards add up; a case run again on its own (out of GPU memory while the shards
    shared the GPU) counts with its re-run outcome and is listed; a re-run case the runs do
    not hold is an error."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        report_mod = importlib.import_module("fa2_suite_report")
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    one = _junit(tmp_path / "1.xml", {"test_flash_attn_kvcache[a]": "CUDA out of memory",
                                      "test_flash_attn_output[b]": None},
                 {"fa2_function test_flash_attn_kvcache": "10 8 1"})
    two = _junit(tmp_path / "2.xml", {"test_flash_attn_output[c]": "wrong result"},
                 {"fa2_function test_flash_attn_kvcache": "10 8 0"})
    first = report_mod.read([one, two])
    assert first["counts"]["test_flash_attn_kvcache"]["failed"] == 1
    assert first["counts"]["test_flash_attn_output"] == {"passed": 1, "failed": 1}
    assert first["selection"]["test_flash_attn_kvcache"] == [10, 8, 1]
    again = _junit(tmp_path / "rerun.xml", {"test_flash_attn_kvcache[a]": None})
    merged = report_mod.read([one, two], [again])
    assert merged["counts"]["test_flash_attn_kvcache"] == {"passed": 1}
    assert merged["counts"]["test_flash_attn_output"] == {"passed": 1, "failed": 1}
    assert merged["reruns"] == [{"case": "test_flash_attn_kvcache[a]", "first": "failed",
                                 "first_reason": "CUDA out of memory", "rerun": "passed"}]
    assert "test_flash_attn_kvcache[a]: failed" in report_mod.render(merged)
    stray = _junit(tmp_path / "stray.xml", {"test_flash_attn_output[z]": None})
    with pytest.raises(SystemExit, match=r"output\[z\] is in none"):
        report_mod.read([one], [stray])
