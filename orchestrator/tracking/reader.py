"""A sweep's trial runs read back from MLflow whole (params, tags, every metric's history), in a
number of requests that does not grow with the runs times their metrics: what ``orchestrator
report`` reads. The counterpart of :mod:`~orchestrator.tracking.writer`.

MLflow's client reads one metric of one run per request (``get_metric_history``): a sweep of
2,048 trials that report 20 numbers is 40,000 of them, minutes on a SQLite file and longer
through a tracking server; and its ``search_runs`` builds an ORM object per param, tag and
metric, seconds for thousands of runs. Its stores can do better, but its client does not say
so, so this module is the one place that reaches past the client to its store:

* a SQL store (SQLite, PostgreSQL, MySQL: MLflow's ``SqlAlchemyStore``, the client's own store
  for a ``sqlite:///`` URI) is read with a few plain ``SELECT``\\ s over MLflow's own table models
  (``mlflow.store.tracking.dbmodels``): the trial runs, then their params, tags and metric points
  :data:`SQL_RUNS` runs at a time, as rows rather than ORM objects;
* a tracking server is searched once (``search_runs``, :data:`RUNS_PER_SEARCH` runs a page) and
  answers ``metrics/get-history-bulk`` (the endpoint MLflow's UI compares runs with, one SQL
  query on the server) for up to :data:`REST_RUNS` runs a request: a request per metric per 100
  runs, :data:`READERS` at a time. An answer cut off at :data:`REST_POINTS` points has its runs
  read one by one; a server without the endpoint (404) is read run by run. (The documented
  ``metrics/get-history-bulk-interval`` was 20 times slower here: the server samples each run
  with its own window query, and a history longer than 2,500 points comes back sampled.)

Any other store (a ``file:`` store) is read run by run, :data:`READERS` requests at a time.
Imports MLflow only when called, and neither torch nor Ray.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from orchestrator.tracking.runs import ROLE_TAG, SWEEP_ID_TAG

#: step -> metric -> value: what a run logged with each result (MLflow step = the result's step).
History = dict[int, dict[str, float]]

#: Runs per SQL query: under the 999 bound variables of an SQLite built before 3.32.
SQL_RUNS = 500
#: Runs per search request: MLflow's most (``SEARCH_MAX_RESULTS_THRESHOLD``, also the server's).
RUNS_PER_SEARCH = 50_000
#: The server's bulk history endpoint (the one MLflow's UI compares runs with) and its limits
#: (``mlflow.server.handlers.get_metric_history_bulk_handler``): runs per request, points per answer.
REST_ENDPOINT = "/ajax-api/2.0/mlflow/metrics/get-history-bulk"
REST_RUNS = 100
REST_POINTS = 25_000
#: Requests in flight at once where they go to a server or one by one.
READERS = 8


@dataclass(frozen=True)
class StoredRun:
    """One trial's run as MLflow holds it."""

    run_id: str
    name: str
    status: str  # RUNNING, FINISHED, FAILED, KILLED
    start_time: int | None  # ms since the epoch
    end_time: int | None
    params: dict[str, str]
    tags: dict[str, str]
    history: History  # a step a metric was logged at twice keeps the value logged last


def trial_runs(client, experiment_id: str, sweep_id: str) -> list[StoredRun]:
    """The active trial runs of the sweep ``sweep_id`` in the experiment, whole."""
    store = client._tracking_client.store  # what MlflowClient reads through; no public accessor
    if _is_sql(store):
        return _sql_runs(store, experiment_id, sweep_id)
    return _searched_runs(client, store, experiment_id, sweep_id)


def artifact_text(client, run_id: str, path: str) -> str:
    """A run's artifact file as text. Read from a download into a folder of its own, removed
    again: ``download_artifacts`` without a destination leaves a new temporary folder behind
    for every file it fetches."""
    with tempfile.TemporaryDirectory(prefix="orchestrator-artifact-") as folder:
        return Path(client.download_artifacts(run_id, path, dst_path=folder)).read_text()


def _is_sql(store) -> bool:
    try:
        from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore
    except ImportError:  # a server-only MLflow client (mlflow-skinny) has no SQL store
        return False
    return isinstance(store, SqlAlchemyStore)


# -- a SQL store ----------------------------------------------------------------------------------


def _sql_runs(store, experiment_id: str, sweep_id: str) -> list[StoredRun]:
    from mlflow.store.tracking.dbmodels.models import (
        SqlMetric,
        SqlParam,
        SqlRun,
        SqlTag,
    )
    from sqlalchemy import and_, select
    from sqlalchemy.orm import aliased

    sweep, role = aliased(SqlTag), aliased(SqlTag)
    found = (
        select(SqlRun.run_uuid, SqlRun.name, SqlRun.status, SqlRun.start_time, SqlRun.end_time)
        .join(sweep, and_(sweep.run_uuid == SqlRun.run_uuid, sweep.key == SWEEP_ID_TAG, sweep.value == sweep_id))
        .join(role, and_(role.run_uuid == SqlRun.run_uuid, role.key == ROLE_TAG, role.value == "trial"))
        .where(SqlRun.experiment_id == int(experiment_id), SqlRun.lifecycle_stage == "active")
    )
    with store.ManagedSessionMaker() as session:
        runs = session.execute(found).all()
        params: dict[str, dict[str, str]] = {run.run_uuid: {} for run in runs}
        tags: dict[str, dict[str, str]] = {run.run_uuid: {} for run in runs}
        histories: dict[str, History] = {run.run_uuid: {} for run in runs}
        for chunk in _chunks(list(params), SQL_RUNS):
            for run_id, key, value in session.execute(
                    select(SqlParam.run_uuid, SqlParam.key, SqlParam.value).where(SqlParam.run_uuid.in_(chunk))):
                params[run_id][key] = value
            for run_id, key, value in session.execute(
                    select(SqlTag.run_uuid, SqlTag.key, SqlTag.value).where(SqlTag.run_uuid.in_(chunk))):
                tags[run_id][key] = value
            # get_metric_history's order (timestamp, step, value): the last value of a step wins.
            points = (select(SqlMetric.run_uuid, SqlMetric.key, SqlMetric.step, SqlMetric.value, SqlMetric.is_nan)
                      .where(SqlMetric.run_uuid.in_(chunk))
                      .order_by(SqlMetric.run_uuid, SqlMetric.key, SqlMetric.timestamp, SqlMetric.step, SqlMetric.value))
            for run_id, key, step, value, is_nan in session.execute(points):
                histories[run_id].setdefault(int(step), {})[key] = float("nan") if is_nan else value
    return [StoredRun(run.run_uuid, run.name, run.status, run.start_time, run.end_time, params[run.run_uuid],
                      tags[run.run_uuid], histories[run.run_uuid]) for run in runs]


# -- a tracking server or any other store ---------------------------------------------------------


def _searched_runs(client, store, experiment_id: str, sweep_id: str) -> list[StoredRun]:
    query = f"tags.`{SWEEP_ID_TAG}` = '{sweep_id}' and tags.`{ROLE_TAG}` = 'trial'"
    runs, token = [], None
    while True:
        page = client.search_runs([experiment_id], query, max_results=RUNS_PER_SEARCH, page_token=token)
        runs.extend(page)
        token = page.token
        if not token:
            break
    histories: dict[str, History] = {run.info.run_id: {} for run in runs}
    by_key: dict[str, list[str]] = {}
    for run in runs:
        for key in run.data.metrics:
            by_key.setdefault(key, []).append(run.info.run_id)
    from mlflow.store.tracking.rest_store import RestStore

    points = _rest_points(client, store, by_key) if isinstance(store, RestStore) else _points_one_by_one(client, by_key)
    for run_id, key, step, value in points:
        histories[run_id].setdefault(step, {})[key] = value
    return [StoredRun(run.info.run_id, run.info.run_name, run.info.status, run.info.start_time, run.info.end_time,
                      dict(run.data.params), dict(run.data.tags), histories[run.info.run_id]) for run in runs]


#: (run id, metric, step, value): each run's points of a metric in the order they were logged.
Point = tuple[str, str, int, float]


def _rest_points(client, store, by_key: dict[str, list[str]]) -> list[Point]:
    from mlflow.exceptions import MlflowException

    requests = [(key, chunk) for key, run_ids in by_key.items() for chunk in _chunks(run_ids, REST_RUNS)]
    try:
        with ThreadPoolExecutor(READERS, thread_name_prefix="mlflow-history") as pool:
            answers = list(pool.map(lambda request: _rest_request(client, store, *request), requests))
    except MlflowException as exc:
        if exc.get_http_status_code() != 404:
            raise
        return _points_one_by_one(client, by_key)
    return [point for answer in answers for point in answer]


def _rest_request(client, store, key: str, run_ids: list[str]) -> list[Point]:
    from mlflow.utils.rest_utils import http_request, verify_rest_response

    params = {"run_id": run_ids, "metric_key": key, "max_results": REST_POINTS}
    answer = verify_rest_response(http_request(store.get_host_creds(), REST_ENDPOINT, "GET", params=params),
                                  REST_ENDPOINT).json()["metrics"]
    if len(answer) >= REST_POINTS:  # cut off: these runs one by one
        return _points_one_by_one(client, {key: run_ids})
    # By run, then timestamp, step and value (get_metric_history's order): the last value of a step wins.
    return [(found["run_id"], key, int(found.get("step", 0)), float(found["value"])) for found in answer]


def _points_one_by_one(client, by_key: dict[str, list[str]]) -> list[Point]:
    def read(request: tuple[str, str]) -> list[Point]:
        key, run_id = request
        return [(run_id, key, int(m.step), m.value) for m in client.get_metric_history(run_id, key)]

    requests = [(key, run_id) for key, run_ids in by_key.items() for run_id in run_ids]
    with ThreadPoolExecutor(READERS, thread_name_prefix="mlflow-history") as pool:
        return [point for answer in pool.map(read, requests) for point in answer]


def _chunks(items: list[str], size: int) -> Iterator[list[str]]:
    for start in range(0, len(items), size):
        yield items[start:start + size]
