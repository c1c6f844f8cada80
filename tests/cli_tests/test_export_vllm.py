"""``flashtune export --format vllm`` through click's CliRunner."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from flashtune.cli.exchange_commands import FORMATS
from flashtune.cli.main import cli
from flashtune.db.exchange import config_file_name, vllm_config_file_name
from flashtune.db.exchange_vllm import parse_shape_key
from tests.db_tests.exchange_support import CONFIGS, OLD_SOURCE, PROBLEMS, populate
from tests.db_tests.support import A100, H100


def invoke(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, list(args))
    assert result.exception is None or isinstance(result.exception, SystemExit), \
        result.exception
    assert "Traceback" not in result.output
    return result.exit_code, result.output


def vname(device: str, i: int) -> str:
    p = PROBLEMS[i]
    return vllm_config_file_name(device, "attn_fwd", dtype=p.dtype, head_dim=p.head_dim,
                                 causal=p.causal)


@pytest.fixture
def db(tmp_path: Path) -> str:
    """H100: PROBLEMS 0-2 (three dtype/head_dim/causal groups); A100: 0 and 3; an old
    source's entry that is never exported."""
    url = f"sqlite:///{tmp_path / 'tuned.db'}"
    populate(url, H100, {0: 1.0, 1: 2.0, 2: 3.0})
    populate(url, A100, {0: 1.5, 3: 2.5})
    populate(url, A100, {4: 1.0}, source=OLD_SOURCE)
    return url


def test_formats() -> None:
    assert FORMATS == ("flashtune", "vllm")


def test_vllm_export_to_a_directory(db: str, tmp_path: Path) -> None:
    out = tmp_path / "vllm"
    code, output = invoke("--db", db, "export", "--format", "vllm", "-o", str(out))
    assert code == 0, output
    expected = sorted([vname(H100.name, 0), vname(H100.name, 1), vname(H100.name, 2),
                       vname(A100.name, 0), vname(A100.name, 3)])
    assert output.splitlines() == [f"wrote {out / n} (1 entry)" for n in expected]
    assert sorted(p.name for p in out.iterdir()) == expected
    data = json.loads((out / vname(H100.name, 2)).read_text())
    [(key, config)] = data.items()
    assert parse_shape_key(key) == {k: PROBLEMS[2].key()[k] for k in
                                    ("batch", "heads_q", "heads_kv", "seqlen_q", "seqlen_k")}
    assert key == "B=4,Hq=32,Hkv=8,Nq=4096,Nk=4096"
    assert {k: v for k, v in config.items() if k in CONFIGS[2]} == CONFIGS[2]
    assert vname(H100.name, 0) == ("template=attn_fwd,dtype=bf16,head_dim=64,causal=1,"
                                   "device_name=NVIDIA_H100_80GB_HBM3.json")


def test_vllm_export_to_one_file_needs_one_group(db: str, tmp_path: Path) -> None:
    path = tmp_path / "one.json"
    code, output = invoke("--db", db, "export", "--format", "vllm", "--device", H100.name,
                          "-o", str(path))
    assert code == 2 and "there are 3 documents" in output and not path.exists()
    code, output = invoke("--db", db, "export", "--format", "vllm", "--device", A100.name,
                          "-o", str(tmp_path / "dir"))
    assert code == 0 and len(output.splitlines()) == 2


def test_default_format_is_unchanged(db: str, tmp_path: Path) -> None:
    plain, flashtune = tmp_path / "plain", tmp_path / "flashtune"
    assert invoke("--db", db, "export", "-o", str(plain))[0] == 0
    assert invoke("--db", db, "export", "--format", "flashtune", "-o", str(flashtune))[0] == 0
    names = sorted(p.name for p in plain.iterdir())
    assert names == sorted([config_file_name(A100.name, "attn_fwd"),
                            config_file_name(H100.name, "attn_fwd")])
    assert names == sorted(p.name for p in flashtune.iterdir())


def test_unknown_format_is_a_usage_error(db: str, tmp_path: Path) -> None:
    code, output = invoke("--db", db, "export", "--format", "triton", "-o", str(tmp_path))
    assert code == 2 and "'--format'" in output
