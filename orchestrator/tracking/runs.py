"""How a sweep's runs are found in MLflow: by tags, each result by its ``step`` metric, a SQLite
store by its file. The writer and ``orchestrator report`` both read this; it imports neither
MLflow nor Ray."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

SWEEP_ID_TAG = "orchestrator.sweep_id"
ROLE_TAG = "orchestrator.role"  # "sweep" (the parent run) or "trial"
PARENT_TAG = "mlflow.parentRunId"  # what makes a run nested in MLflow's UI
#: Logged with every result at MLflow step = the trial's optimizer step: the record of which results a run has.
STEP_METRIC = "step"


@dataclass(frozen=True)
class TrialRef:
    """Enough to find or create a trial's child run, whether or not any earlier write arrived."""

    trial_id: str
    name: str  # str(trial), as in Tune's progress table
    workload: str


#: The run an operation writes to: a trial's child run, or ``None`` for the sweep's parent run.
Target = TrialRef | None


@dataclass(frozen=True)
class SweepIdentity:
    """What finds the parent run again: the sweep id tag survives driver restarts via Tune state."""

    sweep_id: str
    run_name: str
    experiment: str


def sqlite_path(tracking_uri: str) -> Path | None:
    """The database file of a ``sqlite:///`` URI (``sqlite:///rel.db``, ``sqlite:////abs.db``)."""
    if not tracking_uri.startswith("sqlite:///"):
        return None
    path = tracking_uri[len("sqlite:///"):].split("?", 1)[0]
    return Path(path).resolve() if path and path != ":memory:" else None
