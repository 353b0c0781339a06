"""The MLflow client of the outbox's thread: finds or creates the sweep's and trials' runs and
adds to them only what they lack (params are immutable in MLflow, results are known by step)."""

from __future__ import annotations

import logging
import os

from orchestrator.tracking.client import mlflow_client
from orchestrator.tracking.runs import PARENT_TAG, ROLE_TAG, STEP_METRIC, SWEEP_ID_TAG, SweepIdentity, Target, sqlite_path

logger = logging.getLogger(__name__)

MAX_BATCH = 100  # params or tags per log_batch call (MLflow's limit)
MAX_METRICS = 800  # metrics per log_batch call, with up to 2 x MAX_BATCH params and tags: MLflow's 1,000 entities
#: Defaults for MLflow's HTTP client in this process: fail fast, the outbox does the retrying.
HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}


def fail_fast() -> None:
    """MLflow's HTTP client in this process gives up at once; the caller decides what to retry."""
    for key, value in HTTP_DEFAULTS.items():
        os.environ.setdefault(key, value)


class MlflowWriter:
    """The outbox thread's MLflow client, with the run ids and logged steps it has looked up."""

    def __init__(self, tracking_uri: str, sweep: SweepIdentity, *, new_sweep: bool = False):
        """``new_sweep``: the sweep's identity was made by this driver, so every run of it is one
        this writer creates, and a run it has not created yet need not be looked for (until a
        request fails: what landed is then unknown)."""
        self.tracking_uri = tracking_uri
        self._client = None
        self.sweep = sweep
        self._experiment_id: str | None = None
        self._runs: dict[str | None, str] = {}  # trial id (None: the sweep) -> run id
        self._steps: dict[str, set[int]] = {}  # run id -> steps MLflow has
        self._params: dict[str, dict[str, str]] = {}  # run id -> params MLflow has, where known
        self._running: set[str] = set()  # runs known to be RUNNING (created by this writer)
        self._all_runs_ours = new_sweep
        self.dropped: list[str] = []  # operations MLflow rejected, described

    @property
    def client(self):
        """Made on first use, in the outbox's thread: opening a store can fail like any request
        (a SQLite file that cannot be opened yet) and is then retried like one."""
        if self._client is None:
            self._client = mlflow_client(self.tracking_uri)
        return self._client

    def forget(self) -> None:
        """After a failed request: what landed is unknown (a run may have been created although
        the reply was lost), so runs are looked for, and their steps and params re-read."""
        self._steps.clear()
        self._params.clear()
        self._running.clear()
        self._all_runs_ours = False

    def experiment_id(self) -> str:
        if self._experiment_id is None:
            self._experiment_id = get_or_create_experiment(self.client, self.sweep.experiment, self.tracking_uri)
        return self._experiment_id

    def run_id(self, target: Target) -> str:
        key = target.trial_id if target else None
        if key not in self._runs:
            found = None if self._all_runs_ours else self._find_run(target)
            self._runs[key] = found or self._create_run(target)
        return self._runs[key]

    def is_running(self, run_id: str) -> bool:
        """Whether the run is RUNNING (one this writer created is, until it ends it)."""
        return run_id in self._running or self.client.get_run(run_id).info.status == "RUNNING"

    def set_status(self, run_id: str, status: str) -> None:
        if status == "RUNNING":
            self.client.update_run(run_id, status="RUNNING")
            self._running.add(run_id)
        else:
            self._running.discard(run_id)
            self.client.set_terminated(run_id, status)
            # An ended run is written again only if its trial restarts, which re-reads these:
            # the driver keeps nothing per ended trial that grows with the sweep.
            self._params.pop(run_id, None)
            self._steps.pop(run_id, None)

    def steps(self, run_id: str) -> set[int]:
        if run_id not in self._steps:
            history = self.client.get_metric_history(run_id, STEP_METRIC)
            self._steps[run_id] = {int(m.step) for m in history}
        return self._steps[run_id]

    def new_params(self, run_id: str, params: dict[str, str]) -> dict[str, str]:
        """The params the run does not have yet, counted as the run's from now on (the request
        that sends them either lands or makes the outbox :meth:`forget`). A different value for
        one it has is kept as it was (MLflow params are immutable) and reported once."""
        if not params:
            return {}
        if run_id not in self._params:
            self._params[run_id] = dict(self.client.get_run(run_id).data.params)
        existing = self._params[run_id]
        changed = sorted(k for k, v in params.items() if k in existing and existing[k] != v)
        if changed:
            logger.warning(
                "MLflow run %s keeps its first value of param(s) %s (params cannot change); "
                "the change is in its metrics and plan_history.json", run_id, ", ".join(changed),
            )
        new = {k: v for k, v in params.items() if k not in existing}
        existing.update(new)
        return new

    def log_batch(self, run_id: str, params: dict[str, str] | None = None, tags: dict[str, str] | None = None,
                  results: list[list] | None = None) -> None:
        """Params, tags and results' metrics (one list of ``mlflow.entities.Metric`` per result),
        in as few requests (transactions) as MLflow's batch limits allow: one for a trial's
        start, one for all its writes an outbox round merged. A result is never split over two
        requests: it is in MLflow whole or not at all."""
        from mlflow.entities import Param, RunTag

        params, tags = [Param(k, v) for k, v in (params or {}).items()], [RunTag(k, v) for k, v in (tags or {}).items()]
        results = list(results or [])
        while params or tags or results:
            some_params, params = params[:MAX_BATCH], params[MAX_BATCH:]
            some_tags, tags = tags[:MAX_BATCH], tags[MAX_BATCH:]
            metrics = list(results.pop(0)) if results else []
            while results and len(metrics) + len(results[0]) <= MAX_METRICS:
                metrics += results.pop(0)
            self.client.log_batch(run_id, params=some_params, tags=some_tags, metrics=metrics)

    def _find_run(self, target: Target) -> str | None:
        query = f"tags.`{SWEEP_ID_TAG}` = '{self.sweep.sweep_id}'"
        query += f" and tags.trial_id = '{target.trial_id}'" if target else f" and tags.`{ROLE_TAG}` = 'sweep'"
        runs = self.client.search_runs([self.experiment_id()], query, max_results=1, order_by=["attributes.start_time ASC"])
        return runs[0].info.run_id if runs else None

    def _create_run(self, target: Target) -> str:
        tags = {SWEEP_ID_TAG: self.sweep.sweep_id, ROLE_TAG: "trial" if target else "sweep"}
        if target:
            tags.update({PARENT_TAG: self.run_id(None), "trial_id": target.trial_id, "workload": target.workload})
        name = target.name if target else self.sweep.run_name
        run_id = self.client.create_run(self.experiment_id(), run_name=name, tags=tags).info.run_id
        self._params[run_id], self._steps[run_id] = {}, set()
        self._running.add(run_id)
        return run_id


def get_or_create_experiment(client, name: str, tracking_uri: str) -> str:
    """The experiment's id. With a SQLite store its artifacts go next to the database file,
    not into ``./mlruns`` of whatever directory the driver happens to run in."""
    from mlflow.exceptions import MlflowException

    experiment = client.get_experiment_by_name(name)
    if experiment is None:
        database = sqlite_path(tracking_uri)
        location = str(database.parent / "mlartifacts") if database else None
        try:
            return client.create_experiment(name, artifact_location=location)
        except MlflowException:  # created meanwhile by another driver
            experiment = client.get_experiment_by_name(name)
            if experiment is None:
                raise
    if experiment.lifecycle_stage != "active":
        raise RuntimeError(f"MLflow experiment {name!r} is deleted; restore it or use another experiment name")
    return experiment.experiment_id

