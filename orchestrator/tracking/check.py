"""Before a sweep starts: the tracking store can take its records, or ``run`` says why in one line."""

from __future__ import annotations

from orchestrator.errors import UserError
from orchestrator.preflight import check_new_database
from orchestrator.tracking.client import mlflow_client
from orchestrator.tracking.runs import sqlite_path
from orchestrator.tracking.store import database_answers, unusable
from orchestrator.tracking.writer import fail_fast


def check_tracking(tracking_uri: str, experiment: str) -> None:
    """Before a sweep starts: MLflow answers at ``tracking_uri``, lets us in, and the sweep's
    experiment is not a deleted one (which no write could go to). A mistake here is one line and
    exit 2, not a sweep that trains for hours and then says its records are still unsent."""
    database = sqlite_path(tracking_uri)
    if database is not None and not database.exists():
        check_new_database(database)
        return
    fail_fast()
    try:
        database_answers(tracking_uri)
        found = mlflow_client(tracking_uri).get_experiment_by_name(experiment)
    except Exception as exc:  # noqa: BLE001 - whatever it is, the sweep cannot record there
        raise UserError("tracking_uri: " + unusable(
            tracking_uri, exc, "start it or fix the URI, or pass --offline-tracking to run anyway "
            "(the records then wait in the sweep's folder for `run --resume`)",
        )) from None
    if found is not None and found.lifecycle_stage != "active":
        raise UserError(
            f"experiment: the MLflow experiment {experiment!r} at {tracking_uri} is deleted; restore it "
            f"(`mlflow experiments restore --experiment-id {found.experiment_id}`) or use another experiment name"
        )

