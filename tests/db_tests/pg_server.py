"""A throwaway PostgreSQL server for the tests, on loopback, when one is installed.

:func:`start` finds ``initdb`` and ``pg_ctl`` (on PATH, or Debian's
``/usr/lib/postgresql/<version>/bin``), creates a cluster in a fresh temporary folder with
trust authentication, and starts it on ``127.0.0.1`` at a free port (fsync off: nothing in
it outlives the test session). PostgreSQL refuses to run as root: as root the cluster is
made and run as the ``postgres`` user through ``runuser``. Anything missing (the psycopg
driver included) raises :class:`Unavailable` with the reason, for the tests to skip with.
"""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

__all__ = ["PgServer", "Unavailable", "find_binary", "start"]


class Unavailable(Exception):
    """No PostgreSQL server can be started here; the message says why."""


def find_binary(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    candidates = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"),
                        key=lambda p: [int(x) for x in Path(p).parts[4].split(".")
                                       if x.isdigit()])
    return candidates[-1] if candidates else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class PgServer:
    url: str
    datadir: Path
    pg_ctl: str
    prefix: list[str]

    def stop(self) -> None:
        subprocess.run([*self.prefix, self.pg_ctl, "-D", str(self.datadir), "-m", "immediate",
                        "-w", "stop"], capture_output=True, timeout=60, check=False)
        shutil.rmtree(self.datadir, ignore_errors=True)


def start() -> PgServer:
    try:
        import psycopg  # noqa: F401  (the driver of the URL below)
    except ImportError:
        raise Unavailable("the psycopg driver is not installed (pip install -e "
                          "'.[postgres]'; the test extra has it)") from None
    initdb, pg_ctl = find_binary("initdb"), find_binary("pg_ctl")
    if not initdb or not pg_ctl:
        raise Unavailable("no PostgreSQL server installed (initdb/pg_ctl not on PATH nor in "
                          "/usr/lib/postgresql/*/bin; .ci/run installs Debian's postgresql)")
    prefix: list[str] = []
    if os.geteuid() == 0:
        import pwd

        try:
            user = pwd.getpwnam("postgres")
        except KeyError:
            raise Unavailable("running as root and there is no 'postgres' user to run the "
                              "PostgreSQL server as") from None
        runuser = shutil.which("runuser")
        if runuser is None:
            raise Unavailable("running as root without runuser to drop to 'postgres'")
        prefix = [runuser, "-u", "postgres", "--"]
    datadir = Path(tempfile.mkdtemp(prefix="flashtune-pg-"))
    if prefix:
        os.chown(datadir, user.pw_uid, user.pw_gid)
    datadir.chmod(0o700)
    port = _free_port()

    def run(*args: str) -> None:
        proc = subprocess.run([*prefix, *args], capture_output=True, text=True, timeout=120,
                              check=False)
        if proc.returncode != 0:
            shutil.rmtree(datadir, ignore_errors=True)
            tail = " ".join((proc.stderr or proc.stdout).split())[-300:]
            raise Unavailable(f"{Path(args[0]).name} failed ({proc.returncode}): {tail}")

    run(initdb, "-D", str(datadir), "-U", "postgres", "--auth=trust", "-E", "UTF8",
        "--no-sync")
    run(pg_ctl, "-D", str(datadir), "-l", str(datadir / "server.log"), "-w", "-t", "60",
        "-o", f"-h 127.0.0.1 -p {port} -k {datadir} -F -c max_connections=300", "start")
    return PgServer(f"postgresql+psycopg://postgres@127.0.0.1:{port}/postgres", datadir,
                    pg_ctl, prefix)
