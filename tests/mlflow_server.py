"""A real ``mlflow server`` on 127.0.0.1 for tests: start it, stop it (by PID), start it again.

The outage test needs the server to go away and come back on the same port and database, so
this is a small object rather than a fixture. Everything it starts it stops: the server runs in
its own process group, is sent SIGTERM (which ends its workers in ~10 s) and only if it is
still there after a grace period is that group killed.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from ports import free_port


class MlflowServer:
    """``mlflow server`` with served artifacts in ``root/mlartifacts`` (as a SLURM job's server keeps
    them, and MLflow's default beside where it runs) and a SQLite store in ``root``, or the
    database at ``backend_store_uri`` (``postgres_server.PostgresServer``)."""

    def __init__(self, root: Path, port: int | None = None, backend_store_uri: str | None = None):
        self.root = Path(root)
        self.backend_store_uri = backend_store_uri or f"sqlite:///{self.root / 'mlflow.db'}"
        self.root.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.process: subprocess.Popen | None = None

    @property
    def uri(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 90.0) -> "MlflowServer":
        mlflow = Path(sys.executable).parent / "mlflow"
        command = [
            str(mlflow), "server",
            "--backend-store-uri", self.backend_store_uri,
            "--artifacts-destination", str(self.root / "mlartifacts"),
            "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1",
        ]
        log = open(self.root / "server.log", "ab")
        self.process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, cwd=self.root, start_new_session=True,
            # no job-execution subsystem (seven huey workers for MLflow's GenAI jobs), as in the SLURM job
            env={**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true", "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
        )
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"mlflow server exited with {self.process.returncode}; see {self.root / 'server.log'}")
            if self.healthy():
                return self
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"mlflow server not healthy after {timeout:.0f} s; see {self.root / 'server.log'}")

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as response:
                return response.status == 200
        except OSError:
            return False

    def stop(self, grace: float = 30.0) -> None:
        """SIGTERM the server by PID, then whatever is left of the process group it started in
        (its job runner's consumers can outlive it); SIGKILL only what outlives ``grace``."""
        process, self.process = self.process, None
        if process is None:
            return
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass
        group = process.pid  # start_new_session: the group id is the server's PID
        _signal_group(group, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and (_signal_group(group, 0) or not _port_free(self.port)):
            time.sleep(0.2)
        _signal_group(group, signal.SIGKILL)
        if process.poll() is None:
            process.wait()

    def __enter__(self) -> "MlflowServer":
        return self if self.process else self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _signal_group(group: int, sig: int) -> bool:
    """Signal every process of the group; False if none is left."""
    try:
        os.killpg(group, sig)
        return True
    except ProcessLookupError:
        return False


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds
        try:
            sock.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False
