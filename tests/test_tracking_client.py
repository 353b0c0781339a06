"""``orchestrator.tracking.client``: a new SQLite store made by one process at a time."""

from __future__ import annotations

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
    assert not lock_path(database.resolve()).exists()  # gone with its last holder
    assert [e.name for e in mlflow_client(f"sqlite:///{database}").search_experiments()] == ["Default"]


def test_the_lock_is_beside_the_database_and_a_folder_that_takes_no_file_is_read_without_it(tmp_path, monkeypatch):
    """Beside it: SLURM jobs may each have a /tmp of their own, and share the database's folder. A
    colleague's store in a folder this user cannot write is still read (the lock is for making
    one); the lock's file refused as such a folder refuses it (as root, no folder does)."""
    import orchestrator.tracking.client as client

    database = tmp_path / "store" / "mlflow.db"
    assert lock_path(database) == tmp_path / "store" / ".mlflow.db.lock"
    mlflow_client(f"sqlite:///{database}").search_experiments()
    assert sorted(p.name for p in database.parent.iterdir()) == ["mlflow.db"]

    def refused(path):
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr(client, "held", refused)
    assert [e.name for e in mlflow_client(f"sqlite:///{database}").search_experiments()] == ["Default"]


@pytest.mark.integration  # a real MLflow server
def test_a_run_ended_on_a_server_prints_no_link(tmp_path, monkeypatch, capfd):
    """MLflow's client prints two lines per run it ends on a server (a SLURM job's log had 16 for
    8 trials, linking to a server gone with the job); ours print none."""
    from mlflow_server import MlflowServer

    monkeypatch.delenv("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", raising=False)
    with MlflowServer(tmp_path / "server") as server:
        client = mlflow_client(server.uri)
        run = client.create_run(client.create_experiment("links"))
        client.set_terminated(run.info.run_id)
        assert client.get_run(run.info.run_id).info.status == "FINISHED"
    assert "View run" not in capfd.readouterr().out
