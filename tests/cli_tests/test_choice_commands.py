"""Op choices through the CLI: ``flashtune export`` / ``import`` of op choice files beside
the per-template files, and ``flashtune show --op``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from flashtune.cli.main import cli
from flashtune.db import open_store
from flashtune.db.exchange import ChoiceDocument, choice_file_name, config_file_name, read_document
from flashtune.kernel_templates import catalog, register_template, unregister_template
from tests.db_tests.choice_support import (
    EXTERN,
    FWD,
    FWD_CFG,
    FWD_PROBLEMS,
    decide,
    extern_spec,
    fill,
)
from tests.db_tests.exchange_support import dump, populate, without_exported_at
from tests.db_tests.support import A100, H100

H100_FWD = choice_file_name(H100.name, "fwd")
H100_DECODE = choice_file_name(H100.name, "decode")
H100_TEMPLATE = config_file_name(H100.name, "attn_fwd")


def invoke(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, list(args))
    assert result.exception is None or isinstance(result.exception, SystemExit), \
        result.exception
    assert "Traceback" not in result.output
    return result.exit_code, result.output


@pytest.fixture(autouse=True)
def toy_extern() -> Iterator[None]:
    """The toy extern implementation, registered: the CLI checks files against the
    registry's catalog."""
    register_template(extern_spec())
    yield
    unregister_template(EXTERN)


@pytest.fixture
def db(tmp_path: Path) -> str:
    """The H100: three attn_fwd best configs and five op choices (one stale)."""
    url = f"sqlite:///{tmp_path / 'tuned.db'}"
    populate(url, H100, {0: 1.0, 1: 2.0, 2: 3.0})
    fill(url, H100)
    return url


# -- export -----------------------------------------------------------------------------------

def test_export_writes_op_files_next_to_the_template_files(db: str, tmp_path: Path) -> None:
    out = tmp_path / "out"
    code, output = invoke("--db", db, "export", "-o", str(out))
    assert code == 0, output
    assert output.splitlines() == [f"wrote {out / H100_DECODE} (2 entries)",
                                   f"wrote {out / H100_FWD} (2 entries)",  # 1 stale
                                   f"wrote {out / H100_TEMPLATE} (3 entries)"]
    doc = read_document(out / H100_FWD, specs=catalog())
    assert isinstance(doc, ChoiceDocument) and doc.op == "fwd"


@pytest.mark.parametrize("args, names", [
    (["--op", "fwd"], [H100_FWD]),
    (["--op", "decode", "--device", H100.name], [H100_DECODE]),
    (["--template", "attn_fwd"], [H100_TEMPLATE]),
    (["--template", "attn_fwd", "--op", "fwd"], [H100_FWD, H100_TEMPLATE]),
    (["--device", A100.name], []),
])
def test_export_filters(db: str, tmp_path: Path, args: list[str], names: list[str]) -> None:
    out = tmp_path / "out"
    code, output = invoke("--db", db, "export", *args, "-o", str(out))
    assert code == 0, output
    assert (sorted(p.name for p in out.iterdir()) if out.exists() else []) == names


def test_one_op_file_to_one_json_file(db: str, tmp_path: Path) -> None:
    path = tmp_path / "fwd.json"
    code, output = invoke("--db", db, "export", "--op", "fwd", "-o", str(path))
    assert (code, output) == (0, f"wrote {path} (2 entries)\n")
    assert read_document(path, specs=catalog()).file_name() == H100_FWD


def test_nothing_to_export_for_an_op_says_so(db: str, tmp_path: Path) -> None:
    code, output = invoke("--db", db, "export", "--op", "fwd", "--device", "X", "-o",
                          str(tmp_path / "o"))
    assert (code, output) == (0, f"nothing to export from {db}: no op choices decided for "
                                 "the current implementation sources matching device=X "
                                 "op=fwd\n")


def test_the_vllm_format_says_what_it_leaves_out(db: str, tmp_path: Path) -> None:
    out = tmp_path / "vllm"
    code, output = invoke("--db", db, "export", "--format", "vllm", "-o", str(out))
    assert code == 0, output
    assert output.splitlines()[-1] == ("vLLM format carries Triton configs only; 4 op choices "
                                       "not exported (use --format flashtune for them)")
    assert all(p.name.startswith("template=attn_fwd,") for p in out.iterdir())
    code, output = invoke("--db", db, "export", "--format", "vllm", "--template", "attn_fwd",
                          "-o", str(tmp_path / "v2"))
    assert code == 0 and "op choice" not in output
    code, output = invoke("--db", db, "export", "--format", "vllm", "--op", "fwd", "-o",
                          str(tmp_path / "v3"))
    assert code == 2 and "--op selects op choice files, which the vLLM format does not " \
                         "carry" in output
    code, output = invoke("export", "--help")
    assert code == 0 and "Triton configs only" in output


# -- import -----------------------------------------------------------------------------------

def test_export_import_export_round_trips_both_kinds(db: str, tmp_path: Path) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    assert invoke("--db", db, "export", "-o", str(first))[0] == 0
    fresh = f"sqlite:///{tmp_path / 'fresh.db'}"
    code, output = invoke("--db", fresh, "import", str(first))
    assert code == 0, output
    assert output.splitlines() == [
        f"{first / H100_DECODE}: {H100.name} op decode: 2 added, 0 replaced, 0 kept, "
        "0 skipped, 0 stale",
        f"{first / H100_FWD}: {H100.name} op fwd: 2 added, 0 replaced, 0 kept, 0 skipped, "
        "0 stale",
        f"{first / H100_TEMPLATE}: {H100.name} attn_fwd: 3 added, 0 replaced, 0 kept, "
        "0 skipped, 0 stale",
        "imported 3 files (policy keep-faster): 7 added, 0 replaced, 0 kept, 0 skipped, "
        "0 stale"]
    assert invoke("--db", fresh, "export", "-o", str(second))[0] == 0
    for name in (H100_DECODE, H100_FWD, H100_TEMPLATE):
        assert without_exported_at((second / name).read_text()) == \
            without_exported_at((first / name).read_text())
    code, output = invoke("--db", fresh, "import", "--policy", "skip", str(first / H100_FWD))
    assert code == 0 and "op fwd: 0 added, 0 replaced, 0 kept, 2 skipped" in output


@pytest.mark.parametrize("damage, message", [
    (lambda d: d["implementations"].update(no_such_impl=FWD),
     "implementations names 'no_such_impl', an unknown implementation; expected one of "
     "attn_fwd"),
    (lambda d: d.update(op="bwd"), "op is the string 'bwd'; expected one of 'fwd', 'train', 'decode'"),
    (lambda d: next(e for e in d["entries"] if e["implementation"] == "attn_fwd")["config"]
     .update(BLOCK_M=7), "config.BLOCK_M is the integer 7, outside the search space"),
    (lambda d: next(e for e in d["entries"] if e["implementation"] == EXTERN)["config"]
     .update(BLOCK_M=64), f"config has the unknown key 'BLOCK_M'; expected {{}}: {EXTERN} "
                          "has no parameters"),
    (lambda d: d["implementations"].update(attn_decode=d["implementations"]["attn_fwd"]),
     "implementations names 'attn_decode', which does not serve op 'fwd'"),
])
def test_one_bad_op_file_writes_nothing(db: str, tmp_path: Path, damage, message: str) -> None:
    out = tmp_path / "out"
    assert invoke("--db", db, "export", "-o", str(out))[0] == 0
    path = out / H100_FWD
    data = json.loads(path.read_text())
    damage(data)
    path.write_text(json.dumps(data))
    target = f"sqlite:///{tmp_path / 'target.db'}"
    populate(target, A100, {0: 9.0})
    before = dump(target)
    code, output = invoke("--db", target, "import", str(out))
    assert code == 1 and output.count("\n") == 1, output
    assert output.startswith(f"Error: {path}: ") and message in output
    assert dump(target) == before


# -- show --op --------------------------------------------------------------------------------

def test_show_op_lists_the_choices_with_their_margins(db: str) -> None:
    code, output = invoke("--db", db, "show", "--op", "fwd")
    assert code == 0, output
    table, stale = output.split("stale, not served (1):\n")
    header, *rows, worth = table.strip().splitlines()
    assert header.split() == ["device", "op", "shape", "implementation", "config", "median",
                              "ms", "TFLOP/s", "vs", "runner-up", "vs", "extern",
                              "decided_at"]
    assert len(rows) == 3  # the stale one too: show lists what is stored
    # ... and names it after the table, with why and the command that re-tunes it
    assert "decided at another source" not in stale and "source" in stale
    assert "re-tune on that GPU: flashtune tune --op fwd --batch" in stale
    won_by_fwd = next(r for r in rows if "D=64 bf16 causal" in r)
    assert "attn_fwd" in won_by_fwd and "128,64,8,3" in won_by_fwd
    assert "1.30x over sdpa_toy" in won_by_fwd and "300.0" in won_by_fwd
    won_by_extern = next(r for r in rows if "Nq=77" in r)
    assert "1.25x over attn_fwd" in won_by_extern and won_by_extern.count("winner") == 1
    assert " - " in won_by_extern  # the extern's empty config
    # what the choices are worth against the fastest extern (the stale one left out): the
    # extern's time over the chosen one's (1.3, 1.0) and over the fastest own kernel's
    # (1.3; 0.02 / 0.025 = 0.8, the runner-up's, where the decision kept no candidates)
    assert worth == (f"{H100.name} fwd, 2 shapes against an extern: chosen 1.14x (1.00-1.30x), "
                     "flashtune's own fastest 1.02x (0.80-1.30x) on 2; own kernels chosen on 1")
    only = invoke("--db", db, "show", "--op", "fwd", "--template", EXTERN)[1]
    assert len(only.strip().splitlines()) == 3 and "Nq=77" in only
    assert "chosen 1.00x (1.00-1.00x)" in only and "own kernels chosen on 0" in only
    # no extern timed beside any decode winner: no line
    decode = invoke("--db", db, "show", "--op", "decode")[1]
    assert "against an extern" not in decode


def test_show_op_json(db: str) -> None:
    rows = json.loads(invoke("--db", db, "show", "--op", "decode", "--json")[1])
    with open_store(db, read_only=True) as store:
        stored = store.list_choices(op="decode")
    assert [r["implementation"] for r in rows] == [c.implementation for c in stored]
    first = rows[[r["implementation"] for r in rows].index("attn_decode")]
    assert first["margin"] == pytest.approx(0.09 / 0.05) and first["extern"] is None
    assert first["extern_margin"] is None and first["op"] == "decode"
    assert first["software"]["torch"] == "2.7.0" and first["decided_at"].endswith("+00:00")
    assert set(first) >= {"device", "problem", "bucket", "config", "median_ms", "tflops",
                          "runner_up", "runner_up_ms", "candidates", "source_hash"}


def test_show_without_op_counts_the_choices(db: str, tmp_path: Path) -> None:
    code, output = invoke("--db", db, "show")
    assert code == 0
    lines = output.strip().splitlines()
    assert lines[0].split()[:2] == ["device", "template"] and len(lines) == 5
    assert lines[-1] == ("5 op choices stored (decode: 2, fwd: 3): list them with "
                         "`flashtune show --op OP`")
    assert isinstance(json.loads(invoke("--db", db, "show", "--json")[1]), list)
    only_choices = f"sqlite:///{tmp_path / 'c.db'}"
    decide(only_choices, H100, "fwd", FWD_PROBLEMS[0], implementation="attn_fwd",
           source_hash=FWD, config=FWD_CFG, median_ms=1.0, tflops=None)
    assert invoke("--db", only_choices, "show")[1].splitlines() == [
        f"no tuned configs in {only_choices}",
        "1 op choice stored (fwd: 1): list them with `flashtune show --op OP`"]


def test_show_op_when_there_are_none(db: str, tmp_path: Path) -> None:
    code, output = invoke("--db", db, "show", "--op", "fwd", "--device", "X")
    assert (code, output) == (0, f"no op choices in {db} matching device=X op=fwd\n")
    missing = tmp_path / "none.db"
    code, output = invoke("--db", f"sqlite:///{missing}", "show", "--op", "fwd")
    assert output.startswith("no op choices (database") and not missing.exists()
    code, output = invoke("--db", db, "show", "--op", "bwd")
    assert code == 2 and "Invalid value for '--op'" in output


def test_the_vllm_format_leaves_out_configs_of_non_triton_implementations(
        tmp_path: Path) -> None:
    """A best config of an implementation that is not a Triton template (here the toy
    extern's empty one) is not written as a vLLM file, and the command says so."""
    url = f"sqlite:///{tmp_path / 'x.db'}"
    populate(url, H100, {0: 1.0})
    with open_store(url) as store:
        d = store.ensure_device(H100)
        t = store.ensure_template(EXTERN, extern_spec().source_hash)
        p = store.ensure_problem(EXTERN, FWD_PROBLEMS[1].key(), FWD_PROBLEMS[1].bucket())
        store.offer_best(d.id, t.id, p.id, config={}, median_ms=0.5, tflops=None,
                         trial_id=None, trials_count=1)
    out = tmp_path / "v"
    code, output = invoke("--db", url, "export", "--format", "vllm", "-o", str(out))
    assert code == 0, output
    assert output.splitlines()[-1] == ("vLLM format carries Triton configs only; 1 config of "
                                       "a non-Triton implementation not exported (use "
                                       "--format flashtune for them)")
    assert [p.name.split(",")[0] for p in out.iterdir()] == ["template=attn_fwd"]
