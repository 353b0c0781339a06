"""A PostgreSQL cluster of the test's own, for an MLflow tracking server backed by a real database.

Made with Debian's ``postgresql`` binaries (``scripts/install_postgres.sh``) in a fresh folder:
``initdb`` (trust authentication, on the loopback only), ``pg_ctl start`` on a free port, one
database; ``stop`` ends that cluster with ``pg_ctl stop`` and removes its folder, and nothing
else. PostgreSQL refuses to run as root, so as root the cluster runs as the ``postgres`` user
the package creates, in a folder under the system's temporary directory that user may enter.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
from pathlib import Path

from ports import free_port
from system_packages import left_out

DATABASE = "mlflow"
PACKAGE = "PostgreSQL (Debian's postgresql package; scripts/install_postgres.sh installs it as root)"


def binaries() -> Path | None:
    """The folder of ``initdb`` and ``pg_ctl``: Debian keeps them out of the PATH."""
    found = shutil.which("initdb")
    if found:
        return Path(found).resolve().parent
    versions = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    return Path(versions[-1]).parent if versions else None


def why_not_here() -> str | None:
    """Why the PostgreSQL tests cannot run here, in one line; None when they can."""
    reason = left_out(PACKAGE)
    if reason:
        return reason
    if binaries() is None:
        return f"needs {PACKAGE}: initdb not found"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            return "runs as root, and PostgreSQL will not: no 'postgres' user to run it as"
    try:
        import psycopg2  # noqa: F401 - MLflow's SQL store needs it for postgresql:// URIs
    except ImportError:
        return "needs psycopg2-binary (the dev extra: pip install -e '.[dev]')"
    return None


class PostgresServer:
    """One PostgreSQL cluster on 127.0.0.1, with the database :data:`DATABASE`."""

    def __init__(self, port: int | None = None):
        self.port = port or free_port()
        self.folder: Path | None = None

    @property
    def uri(self) -> str:
        """What MLflow takes as ``--backend-store-uri`` (or a driver as ``--tracking-uri``): the
        driver named, since SQLAlchemy 2.1 takes ``postgresql://`` for psycopg 3."""
        return f"postgresql+psycopg2://postgres@127.0.0.1:{self.port}/{DATABASE}"

    def start(self) -> PostgresServer:
        bin_dir = binaries()
        self.folder = Path(tempfile.mkdtemp(prefix="orchestrator-postgres-"))
        if os.geteuid() == 0:
            owner = pwd.getpwnam("postgres")
            os.chown(self.folder, owner.pw_uid, owner.pw_gid)
        data = self.folder / "data"
        self._as_owner([bin_dir / "initdb", "-D", data, "-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-instructions"])
        options = f"-p {self.port} -k {self.folder} -c listen_addresses=127.0.0.1 -c fsync=off"
        self._as_owner([bin_dir / "pg_ctl", "-D", data, "-o", options, "-l", self.folder / "server.log", "-w", "start"])
        self._as_owner([bin_dir / "createdb", "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres", DATABASE])
        return self

    def stop(self) -> None:
        """``pg_ctl stop`` of this cluster (its postmaster and what it started), then its folder."""
        folder, self.folder = self.folder, None
        if folder is None:
            return
        if (folder / "data" / "postmaster.pid").exists():
            self._as_owner([binaries() / "pg_ctl", "-D", folder / "data", "-m", "fast", "-w", "stop"], check=False)
        shutil.rmtree(folder, ignore_errors=True)

    def log(self) -> str:
        path = self.folder / "server.log" if self.folder else None
        return path.read_text() if path and path.exists() else ""

    def _as_owner(self, command: list, check: bool = True) -> None:
        command = [str(part) for part in command]
        if os.geteuid() == 0:
            command = ["runuser", "-u", "postgres", "--", *command]
        done = subprocess.run(command, capture_output=True, text=True, check=False, cwd=self.folder, timeout=120)
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")

    def __enter__(self) -> PostgresServer:
        return self if self.folder else self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
