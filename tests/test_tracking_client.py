"""``orchestrator.tracking.client``: a new SQLite store made by one process at a time."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from orchestrator.tracking.client import lock_path, mlflow_client

# Each process imports MLflow first (a second or more), then waits for the others at the start
# line, so that all of them open the new store within a few milliseconds of each other.
OPENS_THE_STORE = textwrap.dedent("""
    import os, sys, time
    uri, start, opener = sys.argv[1:]
    from mlflow import MlflowClient
    from orchestrator.tracking.client import mlflow_client
    import mlflow.store.tracking.sqlalchemy_store  # noqa: F401 - imported before the start, not timed
    open(start + "." + str(os.getpid()), "w").close()
    while not os.path.exists(start):
        time.sleep(0.001)
    client = mlflow_client(uri) if opener == "ours" else MlflowClient(uri)
    client.search_experiments()
    print("opened")
""")


def open_together(uri: str, start, opener: str, processes: int = 4) -> list[subprocess.CompletedProcess]:
    starters = [subprocess.Popen([sys.executable, "-c", OPENS_THE_STORE, uri, str(start), opener],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(processes)]
    deadline = time.monotonic() + 120
    while len(list(start.parent.glob(f"{start.name}.*"))) < processes and time.monotonic() < deadline:
        time.sleep(0.01)
    start.touch()
    done = []
    for process in starters:
        out, err = process.communicate(timeout=120)
        done.append(subprocess.CompletedProcess(process.args, process.returncode, out, err))
    return done


@pytest.mark.integration  # real processes, real MLflow
def test_processes_that_open_a_new_sqlite_store_at_once_all_find_it_whole(tmp_path):
    """Four processes open one new ``mlflow.db`` at the same moment, as sweeps started together in
    one folder do: each waits for the one making the tables, and each then reads the store. No lock
    file is left in the temp folder."""
    database = tmp_path / "mlflow.db"
    done = open_together(f"sqlite:///{database}", tmp_path / "start", "ours")
    assert [p.returncode for p in done] == [0] * 4, [p.stderr[-2000:] for p in done]
    assert all(p.stdout.strip() == "opened" for p in done)
    assert not lock_path(database.resolve()).exists()
    assert [e.name for e in mlflow_client(f"sqlite:///{database}").search_experiments()] == ["Default"]


def test_the_lock_is_by_database_and_by_user(tmp_path):
    one, other = lock_path(tmp_path / "a" / "mlflow.db"), lock_path(tmp_path / "b" / "mlflow.db")
    assert one != other and one.parent == other.parent
    assert f"-{os.getuid()}-" in one.name
