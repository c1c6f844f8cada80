"""``flashtune export`` / ``flashtune import`` through click's CliRunner."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from flashtune.cli.exchange_commands import POLICIES
from flashtune.cli.main import cli
from flashtune.db.exchange import config_file_name, read_document
from flashtune.db.store import IMPORT_POLICIES
from flashtune.kernel_templates import catalog, known_names  # noqa: E402
from tests.db_tests.exchange_support import OLD_SOURCE, dump, populate, without_exported_at
from tests.db_tests.support import A100, H100

SPECS = catalog()

H100_FILE = config_file_name(H100.name, "attn_fwd")
A100_FILE = config_file_name(A100.name, "attn_fwd")


def invoke(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, list(args))
    assert result.exception is None or isinstance(result.exception, SystemExit), \
        result.exception
    assert "Traceback" not in result.output
    return result.exit_code, result.output


def snapshot(url: str) -> tuple[bytes, bytes]:
    """The bytes of a SQLite database file and of its write-ahead log (a reader of a WAL
    database may leave an empty log behind: that is no write)."""
    path = Path(url.removeprefix("sqlite:///"))
    wal = path.with_name(path.name + "-wal")
    return path.read_bytes(), wal.read_bytes() if wal.exists() else b""


@pytest.fixture
def db(tmp_path: Path) -> str:
    """Two devices tuned for the current attn_fwd source, one entry of an old source."""
    url = f"sqlite:///{tmp_path / 'tuned.db'}"
    populate(url, H100, {0: 1.0, 1: 2.0, 2: 3.0})
    populate(url, A100, {0: 1.5, 3: 2.5})
    populate(url, A100, {4: 1.0}, source=OLD_SOURCE)
    return url


def test_export_to_a_directory(db: str, tmp_path: Path) -> None:
    before = snapshot(db)
    out = tmp_path / "exports" / "fleet"  # created, parents too
    code, output = invoke("--db", db, "export", "-o", str(out))
    assert code == 0, output
    assert output.splitlines() == [f"wrote {out / A100_FILE} (2 entries)",
                                   f"wrote {out / H100_FILE} (3 entries)"]
    assert sorted(p.name for p in out.iterdir()) == [A100_FILE, H100_FILE]
    doc = read_document(out / H100_FILE, specs=SPECS)
    assert doc.device.hardware_key() == H100.hardware_key() and len(doc.entries) == 3
    assert snapshot(db) == before  # opened read-only: not a byte written


def test_export_to_one_file(db: str, tmp_path: Path) -> None:
    path = tmp_path / "h100.json"
    code, output = invoke("--db", db, "export", "--device", H100.name, "--template",
                          "attn_fwd", "-o", str(path))
    assert (code, output) == (0, f"wrote {path} (3 entries)\n")
    assert read_document(path, specs=SPECS).file_name() == H100_FILE
    assert path.read_text().endswith("}\n") and json.loads(path.read_text())["entries"]


def test_several_documents_into_one_json_file_is_a_usage_error(db: str,
                                                               tmp_path: Path) -> None:
    path = tmp_path / "all.json"
    code, output = invoke("--db", db, "export", "-o", str(path))
    assert code == 2 and "Usage:" in output
    assert f"-o {path} names one .json file but there are 2 documents" in output
    assert "pass a directory" in output and not path.exists()


def test_export_to_an_existing_file_without_json_suffix_is_refused(db: str,
                                                                   tmp_path: Path) -> None:
    notes = tmp_path / "notes"
    notes.write_text("mine")
    code, output = invoke("--db", db, "export", "-o", str(notes))
    assert code == 2 and "exists and is not a directory" in output
    assert notes.read_text() == "mine"


def test_export_from_a_missing_database_creates_nothing(tmp_path: Path) -> None:
    missing = tmp_path / "missing.db"
    out = tmp_path / "out"
    code, output = invoke("--db", f"sqlite:///{missing}", "export", "-o", str(out))
    assert (code, output) == (0, f"nothing to export (database {missing} does not exist yet)\n")
    assert not missing.exists() and not out.exists()


def test_export_with_nothing_current_says_so(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'old.db'}"
    populate(url, H100, {0: 1.0}, source=OLD_SOURCE)
    code, output = invoke("--db", url, "export", "-o", str(tmp_path / "out"))
    assert code == 0
    assert output == (f"nothing to export from {url}: no best configs tuned for the current "
                      "template sources\n")
    code, output = invoke("--db", url, "export", "--device", "X", "-o", str(tmp_path / "o"))
    assert output.endswith("sources matching device=X\n")


def test_export_errors_are_one_line(db: str, tmp_path: Path) -> None:
    code, output = invoke("--db", db, "export", "--template", "attn_nope", "-o",
                          str(tmp_path / "out"))
    assert code == 2 and output.endswith(
        "Error: Invalid value for '--template': unknown template 'attn_nope'; known "
        f"templates: {', '.join(known_names())}\n")
    assert ("attn_fwd, attn_fwd_bwd_gluon, attn_fwd_gluon, attn_fwd_gluon_bwd_cudnn, "
            "attn_fwd_gluon_bwd_gluon, sdpa_cudnn, sdpa_cudnn_bwd, sdpa_cudnn_bwd_gluon, "
            "sdpa_efficient, sdpa_flash, sdpa_math") in output
    code, output = invoke("--db", db, "export")
    assert code == 2 and "Missing option '-o'" in output


def test_import_files_then_a_directory_prints_the_report(db: str, tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert invoke("--db", db, "export", "-o", str(out))[0] == 0
    fresh = f"sqlite:///{tmp_path / 'fresh.db'}"
    h100, a100 = out / H100_FILE, out / A100_FILE
    code, output = invoke("--db", fresh, "import", str(h100))
    assert code == 0, output
    assert output.splitlines() == [
        f"{h100}: {H100.name} attn_fwd: 3 added, 0 replaced, 0 kept, 0 skipped, 0 stale",
        "imported 1 file (policy keep-faster): 3 added, 0 replaced, 0 kept, 0 skipped, 0 stale"]
    code, output = invoke("--db", fresh, "import", str(out), str(h100))  # h100 once
    assert code == 0, output
    assert output.splitlines() == [
        f"{a100}: {A100.name} attn_fwd: 2 added, 0 replaced, 0 kept, 0 skipped, 0 stale",
        f"{h100}: {H100.name} attn_fwd: 0 added, 0 replaced, 3 kept, 0 skipped, 0 stale",
        "imported 2 files (policy keep-faster): 2 added, 0 replaced, 3 kept, 0 skipped, 0 stale"]
    code, output = invoke("--db", fresh, "import", "--policy", "overwrite", str(out))
    assert code == 0 and output.splitlines()[-1] == (
        "imported 2 files (policy overwrite): 0 added, 5 replaced, 0 kept, 0 skipped, 0 stale")
    code, output = invoke("--db", fresh, "import", "--policy", "skip", str(h100))
    assert code == 0 and "0 added, 0 replaced, 0 kept, 3 skipped" in output


def test_export_import_export_writes_the_same_files(db: str, tmp_path: Path) -> None:
    """The files of a second export, from a fresh database the first one was imported
    into, are the first export's bytes but for exported_at; here the H100's entries were
    tuned under two softwares."""
    populate(db, H100, {3: 0.5}, versions=dict(torch_version="2.7.0", triton_version="3.3.0"))
    first, second = tmp_path / "first", tmp_path / "second"
    assert invoke("--db", db, "export", "-o", str(first))[0] == 0
    fresh = f"sqlite:///{tmp_path / 'fresh.db'}"
    assert invoke("--db", fresh, "import", str(first))[0] == 0
    assert invoke("--db", fresh, "export", "-o", str(second))[0] == 0
    assert sorted(p.name for p in second.iterdir()) == [A100_FILE, H100_FILE]
    for name in (A100_FILE, H100_FILE):
        assert without_exported_at((second / name).read_text()) == \
            without_exported_at((first / name).read_text())
    data = json.loads((second / H100_FILE).read_text())
    assert data["schema_version"] == 2 and data["software"]["torch"] == "2.7.0"
    assert sorted(e.get("software", {}).get("torch", "-") for e in data["entries"]) == \
        ["-", "2.5.1", "2.5.1", "2.5.1"]
    assert json.loads((second / A100_FILE).read_text())["schema_version"] == 1


def test_import_reports_stale_files(tmp_path: Path) -> None:
    old = f"sqlite:///{tmp_path / 'old.db'}"
    populate(old, H100, {0: 1.0, 1: 1.0})
    out = tmp_path / "out"
    invoke("--db", old, "export", "-o", str(out))
    path = out / H100_FILE
    data = json.loads(path.read_text())
    data["template"]["source_hash"] = OLD_SOURCE
    path.write_text(json.dumps(data))
    fresh = f"sqlite:///{tmp_path / 'fresh.db'}"
    code, output = invoke("--db", fresh, "import", str(path))
    assert code == 0 and "0 added, 0 replaced, 0 kept, 0 skipped, 2 stale" in output
    assert "not imported" in output


def test_one_bad_file_writes_nothing(db: str, tmp_path: Path) -> None:
    out = tmp_path / "out"
    invoke("--db", db, "export", "-o", str(out))
    (out / "zz-broken.json").write_text('{"format": "flashtune-configs"')
    target = f"sqlite:///{tmp_path / 'target.db'}"
    populate(target, H100, {0: 9.0})
    before = dump(target)
    code, output = invoke("--db", target, "import", "--policy", "overwrite", str(out))
    assert code == 1 and output.count("\n") == 1
    assert output.startswith(f"Error: {out / 'zz-broken.json'}: is not valid JSON")
    assert dump(target) == before


def test_policy_choices_and_bad_paths(db: str, tmp_path: Path) -> None:
    assert POLICIES == IMPORT_POLICIES
    some = tmp_path / "x.json"
    some.write_text("{}")
    code, output = invoke("--db", db, "import", "--policy", "newest", str(some))
    assert code == 2 and "Invalid value for '--policy'" in output
    assert "'keep-faster', 'overwrite', 'skip'" in output
    code, output = invoke("--db", db, "import", str(tmp_path / "missing.json"))
    assert code == 2 and "does not exist" in output
    empty = tmp_path / "empty"
    empty.mkdir()
    code, output = invoke("--db", db, "import", str(empty))
    assert code == 2 and "holds no *.json files" in output
    code, output = invoke("--db", db, "import")
    assert code == 2 and "Missing argument" in output
