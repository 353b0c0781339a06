"""A run's artifacts where a store is read directly whose artifacts a tracking server kept.

A run logged through ``mlflow server`` (which proxies artifacts, its default) has an artifact URI
``mlflow-artifacts:/<experiment>/<run>/artifacts`` that only a server can resolve: the server
keeps the files under its ``--artifacts-destination``. A SLURM job's server keeps them in
``mlartifacts`` beside its ``mlflow.db`` (``slurm/sweep.sbatch.tmpl``; MLflow's own default is
``./mlartifacts`` beside where the server runs), and after the job the store is read as
``sqlite:///<job folder>/mlflow.db``, with no server: the same path under that folder is the
artifact. ``report`` reads a trial's OOM events and logs its files there, as the server would.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from orchestrator.tracking.reader import artifact_text
from orchestrator.tracking.runs import sqlite_path

SERVED = "mlflow-artifacts:"
#: Where ``mlflow server`` keeps proxied artifacts by default, beside a SQLite store of the same folder.
SERVED_FOLDER = "mlartifacts"


def served_folder(client, tracking_uri: str, run_id: str) -> Path | None:
    """The folder of a run's artifacts a server kept, for a SQLite store read directly; else None
    (the client reaches them itself). Only a SQLite store costs the run's lookup."""
    database = sqlite_path(tracking_uri)
    if database is None:
        return None
    artifact_uri = client.get_run(run_id).info.artifact_uri
    if not artifact_uri.startswith(SERVED):
        return None
    return database.parent / SERVED_FOLDER / artifact_uri[len(SERVED):].lstrip("/")


def read_text(client, tracking_uri: str, run_id: str, path: str) -> str:
    """A run's artifact as text: from the folder a server kept it in, else as the client downloads it."""
    folder = served_folder(client, tracking_uri, run_id)
    return (folder / path).read_text() if folder is not None else artifact_text(client, run_id, path)


def log_files(client, tracking_uri: str, run_id: str, files: list[Path], under: str) -> None:
    """``files`` as the run's artifacts under ``under``: into the folder a server kept them in, where one did."""
    folder = served_folder(client, tracking_uri, run_id)
    for file in files:
        if folder is None:
            client.log_artifact(run_id, str(file), under)
        else:
            (folder / under).mkdir(parents=True, exist_ok=True)
            shutil.copyfile(file, folder / under / file.name)
