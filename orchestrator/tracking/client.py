"""MLflow's client for a tracking URI, whose SQLite store one process of this machine opens at a time.

MLflow makes a new SQLite store's tables, then migrates them to its newest schema, when its
client first opens the file, with no lock. Two sweeps started together in one folder (a shell
loop of ``run ... &``, a SLURM job array) both find no tables and both migrate, or one opens the
file while the other is half-way (``no such column``, ``out-of-date database schema``), and a
sweep then fails on the store rather than on anything of its own. So every process of ours
opens a SQLite store under an exclusive lock named for the database: the second waits out the
first's second of migrations, then finds the tables whole. A server or another database needs
no lock (its migrations run once, by whoever set it up, and the server serialises the rest).
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

from orchestrator.file_lock import held
from orchestrator.tracking.runs import sqlite_path


def mlflow_client(tracking_uri: str):
    """``MlflowClient(tracking_uri)``, its store opened (a new SQLite store made) under the lock."""
    from mlflow import MlflowClient

    database = sqlite_path(tracking_uri)
    if database is None:
        return MlflowClient(tracking_uri)
    with held(str(lock_path(database))):
        return MlflowClient(tracking_uri)  # MLflow opens its store here, and keeps it for the URI


def lock_path(database: Path) -> Path:
    """The lock of ``database``'s opening: in the temp folder (where MLflow's own server keeps its
    lock of a store's creation), so that the user's folder gets no file of it; by user, so that
    no user's lock file stands in another's way."""
    digest = hashlib.sha256(str(database).encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / f"orchestrator-mlflow-{os.getuid()}-{digest}.lock"
