"""Every test runs with its own HOME, so Ray's auth token, MLflow's telemetry settings and
any cache land in a temporary folder instead of the user's home."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session", autouse=True)
def isolated_environment(tmp_path_factory):
    home = tmp_path_factory.mktemp("home")
    saved = {k: os.environ.get(k) for k in ("HOME", "MLFLOW_DISABLE_TELEMETRY", "RAY_USAGE_STATS_ENABLED", "PATH")}
    os.environ["HOME"] = str(home)
    os.environ["MLFLOW_DISABLE_TELEMETRY"] = "true"
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    # Subprocesses (Ray workers, `orchestrator` CLI) must find this venv's executables first.
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    yield home
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
