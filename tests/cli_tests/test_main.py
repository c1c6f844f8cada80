"""The root ``flashtune`` group: global options, commands, light ``--help``."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from flashtune._version import __version__
from flashtune.cli.main import cli

ROOT = Path(__file__).resolve().parents[2]


def test_commands_registered() -> None:
    assert {"db", "tune", "show", "export", "import", "report"} <= set(cli.commands)


def test_version() -> None:
    result = CliRunner().invoke(cli, ["--version"])
    assert result.exit_code == 0
    assert __version__ in result.output


@pytest.mark.parametrize("args", [[], ["tune"], ["show"], ["db"], ["db", "info"], ["export"],
                                  ["import"], ["report"]])
def test_help(args: list[str]) -> None:
    result = CliRunner().invoke(cli, [*args, "--help"])
    assert result.exit_code == 0, result.output
    assert "Usage:" in result.output


def test_db_option_and_envvar(tmp_path: Path) -> None:
    missing = tmp_path / "a.db"
    result = CliRunner().invoke(cli, ["--db", f"sqlite:///{missing}", "show"])
    assert result.exit_code == 0 and str(missing) in result.output
    other = tmp_path / "b.db"
    result = CliRunner().invoke(cli, ["show"], env={"FLASHTUNE_DB": f"sqlite:///{other}"})
    assert result.exit_code == 0 and str(other) in result.output
    assert not missing.exists() and not other.exists()


def test_verbose_sets_logging_level() -> None:
    import logging

    before = logging.getLogger("flashtune").level
    try:
        result = CliRunner().invoke(cli, ["-vv", "db", "--help"])
        assert result.exit_code == 0
        assert logging.getLogger("flashtune").level == logging.DEBUG
    finally:
        logging.getLogger("flashtune").setLevel(before)


def test_v_logs_flashtune_info_and_leaves_other_libraries_at_warning() -> None:
    """-v is flashtune's info (with times); alembic's plugin setup lines, seven per process
    and worker, come only with -vv."""
    import subprocess
    import sys

    code = """
import logging
from flashtune.cli.main import cli
try:
    cli.main(["{flag}", "db", "--help"], standalone_mode=False)
except SystemExit:
    pass
logging.getLogger("flashtune.autotune.select").info("ours")
logging.getLogger("alembic.runtime.plugins").info("theirs")
"""
    for flag, theirs in (("-v", False), ("-vv", True)):
        out = subprocess.run([sys.executable, "-c", code.format(flag=flag)],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert "INFO flashtune.autotune.select: ours" in out.stderr
        assert ("theirs" in out.stderr) is theirs, out.stderr


def test_unknown_command_is_usage_error() -> None:
    result = CliRunner().invoke(cli, ["frobnicate"])
    assert result.exit_code == 2
    assert "Traceback" not in result.output


_PROBE = """
import sys
from click.testing import CliRunner
from flashtune.cli.main import cli
for args in ([], ["tune"], ["show"], ["db"], ["db", "info"], ["db", "upgrade"], ["export"],
             ["import"], ["report"]):
    result = CliRunner().invoke(cli, [*args, "--help"])
    assert result.exit_code == 0, (args, result.output)
heavy = sorted(m for m in ("torch", "triton", "matplotlib") if m in sys.modules)
print("HEAVY=" + ",".join(heavy))
"""


def test_help_imports_no_torch_triton_or_matplotlib() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "HEAVY=\n" in proc.stdout or proc.stdout.strip() == "HEAVY=", proc.stdout


def test_python_dash_m_works() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-m", "flashtune.cli.main", "--help"],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "tune" in proc.stdout and "show" in proc.stdout
    assert "torch" not in proc.stderr


@pytest.mark.parametrize("value", ["/tmp/x.db", "x.db", "~/tuned.db"])
def test_db_that_is_a_path_not_a_url_names_the_option(value: str) -> None:
    result = CliRunner().invoke(cli, ["--db", value, "show"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    [line] = [ln for ln in result.output.splitlines() if ln.startswith("Error:")]
    path = os.path.abspath(os.path.expanduser(value))
    assert "'--db'" in line and repr(value) in line and "is not a database URL" in line
    assert f"sqlite:///{path}" in line  # sqlite:/// + the absolute path
    result = CliRunner().invoke(cli, ["show"], env={"FLASHTUNE_DB": value})
    assert result.exit_code == 2 and "(from FLASHTUNE_DB)" in result.output


def test_db_url_typo_keeps_a_password_hidden() -> None:
    result = CliRunner().invoke(cli, ["--db", "postgresql:/u:hunter2@host/db", "show"])
    assert result.exit_code == 2
    assert "hunter2" not in result.output and "u:***@host" in result.output


def test_a_plain_path_given_to_the_library_says_what_a_url_looks_like() -> None:
    from flashtune.core.errors import StoreError
    from flashtune.db import open_store

    with pytest.raises(StoreError, match=r"expected a SQLAlchemy URL such as sqlite:////"):
        open_store("/tmp/x.db")


def test_readme_and_bench_help_cite_only_files_of_this_repo() -> None:
    """They cited "the standard grid of ANCHORS.md", a file this repository does not have."""
    from flashtune.cli import bench_commands

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    help_text = CliRunner().invoke(cli, ["bench", "--help"]).output
    for text in (readme, help_text, bench_commands.__doc__ or ""):
        for name in re.findall(r"\b[\w./-]+\.md\b", text):
            assert (ROOT / name).is_file(), f"{name} is cited but not in the repository"
    assert "flashtune/autotune/grids.py" in readme
