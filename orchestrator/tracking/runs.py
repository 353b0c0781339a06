"""How a sweep's runs are found in MLflow: by tags, each result by its ``step`` metric, a SQLite
store by its file, and which store by default. The writer, ``orchestrator run`` and
``orchestrator report`` all read this; it imports neither MLflow nor Ray."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

SWEEP_ID_TAG = "orchestrator.sweep_id"
ROLE_TAG = "orchestrator.role"  # "sweep" (the parent run) or "trial"
PARENT_TAG = "mlflow.parentRunId"  # what makes a run nested in MLflow's UI
EXPERIMENT_PATH_TAG = "tune.experiment_path"  # on the sweep's run: Tune's folder of the sweep, which `report` names
#: The store ``run`` writes to and ``report`` reads when neither is given one: MLflow's own default,
#: a SQLite file in the working directory.
DEFAULT_TRACKING_DB = "mlflow.db"
#: Logged with every result at MLflow step = the trial's optimizer step: the record of which results a run has.
STEP_METRIC = "step"
#: On the run of a trial that gave up on OOMs: how many events its ``oom_events.json`` holds (no
#: result counts them), which tells ``report`` to read that file.
OOM_GAVE_UP_TAG = "oom_events_gave_up"
#: On the run of a trial ASHA stopped before its budget (``TrialReport.stopped_early``): what it
#: trained of the budget. MLflow ends it FINISHED, as a trial that trained to the end.
STOPPED_EARLY_TAG = "stopped_early"


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


def default_tracking_uri() -> str:
    """The working directory's ``mlflow.db``, as an absolute URI: a sweep resumed or reported from
    another folder still names the database it wrote."""
    return f"sqlite:///{Path(DEFAULT_TRACKING_DB).absolute()}"


def absolute_tracking_uri(tracking_uri: str) -> str:
    """A SQLite URI with a relative path (``sqlite:///mlflow.db``, which MLflow reads against the
    working directory) made absolute, so that the sweep's recorded store is the same file from
    any folder; other URIs as they are."""
    if not is_relative_sqlite(tracking_uri):
        return tracking_uri
    database = sqlite_path(tracking_uri)
    query = tracking_uri.partition("?")[2]
    return f"sqlite:///{database}" + (f"?{query}" if query else "")


def is_relative_sqlite(tracking_uri: str) -> bool:
    """Whether the URI is a SQLite file named relative to the working directory."""
    return sqlite_path(tracking_uri) is not None and not tracking_uri.startswith("sqlite:////")


def sqlite_path(tracking_uri: str) -> Path | None:
    """The database file of a ``sqlite:///`` URI (``sqlite:///rel.db``, ``sqlite:////abs.db``)."""
    if not tracking_uri.startswith("sqlite:///"):
        return None
    path = tracking_uri[len("sqlite:///"):].split("?", 1)[0]
    return Path(path).resolve() if path and path != ":memory:" else None
