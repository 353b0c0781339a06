"""MLflow's client for a tracking URI, whose SQLite store one of our processes opens at a time.

MLflow makes a new SQLite store's tables, then migrates them to its newest schema, when its
client first opens the file, with no lock. Two sweeps started together in one folder (a shell
loop of ``run ... &``, a SLURM job array) both find no tables and both migrate, or one opens the
file while the other is half-way (``no such column``, ``out-of-date database schema``), and a
sweep then fails on the store rather than on anything of its own. So every process of ours
opens a SQLite store under an exclusive lock beside the database: the second waits out the
first's second of migrations, then finds the tables whole. Beside it, not in the temp folder:
SLURM jobs may each have a /tmp of their own (``job_container/tmpfs``, or a TMPDIR per job),
and jobs on several nodes share the database's folder, not a /tmp. The lock's file goes with its
last holder. A server or another database needs no lock (its migrations run once, by whoever set
it up, and the server serialises the rest).

Our clients print no links: MLflow's client writes two lines (``View run ... at: <server URL>``)
to standard output for each run it ends on a tracking server, and asks the server for the run
to make them: 16 lines among a sweep of 8 trials' own, in a SLURM job's log pointing at a server
that is gone once the job ends. ``run`` and ``report`` say where the sweep is instead.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from orchestrator.file_lock import held
from orchestrator.tracking.runs import sqlite_path


def mlflow_client(tracking_uri: str):
    """``MlflowClient(tracking_uri)``, its store opened (a new SQLite store made) under the lock;
    without it where the database's folder takes no file (a store to read, not to make)."""
    from mlflow import MlflowClient

    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")  # read by MLflow as each run ends
    database = sqlite_path(tracking_uri)
    if database is None:
        return MlflowClient(tracking_uri)
    with contextlib.ExitStack() as opening:
        with contextlib.suppress(OSError):
            database.parent.mkdir(parents=True, exist_ok=True)  # as MLflow would make it, a moment later
            opening.enter_context(held(str(lock_path(database))))
        return MlflowClient(tracking_uri)  # MLflow opens its store here, and keeps it for the URI


def lock_path(database: Path) -> Path:
    """``.mlflow.db.lock`` beside ``mlflow.db``: hidden, and there only while a process opens it."""
    return database.with_name(f".{database.name}.lock")
