"""A sweep's trial runs read back whole from a real MLflow store, in bulk: the same runs, params,
tags and histories as MLflow's client reads one metric of one run at a time, from a SQLite file
and through a real ``mlflow server``."""

from __future__ import annotations

import math

import pytest
from mlflow import MlflowClient
from mlflow.entities import Metric, Param
from mlflow_server import MlflowServer
from postgres_server import PostgresServer, why_not_here

from orchestrator.tracking import reader
from orchestrator.tracking.reader import StoredRun, trial_runs
from orchestrator.tracking.runs import PARENT_TAG, ROLE_TAG, SWEEP_ID_TAG
from orchestrator.tracking.writer import get_or_create_experiment


def make_store(uri: str) -> str:
    """A sweep of 5 trials as the tracking writes it, beside what must not be read: another
    sweep's trial, a deleted trial, the parent run. Returns the experiment's id."""
    client = MlflowClient(uri)
    experiment = get_or_create_experiment(client, "reader", uri)  # its artifact location as the tracking's
    parent = client.create_run(experiment, run_name="sweep", tags={ROLE_TAG: "sweep", SWEEP_ID_TAG: "s1"})
    client.log_metric(parent.info.run_id, "trials", 5)

    def trial(name: str, sweep: str = "s1") -> str:
        run = client.create_run(experiment, run_name=name, start_time=1_000, tags={
            ROLE_TAG: "trial", SWEEP_ID_TAG: sweep, PARENT_TAG: parent.info.run_id, "trial_id": name})
        return run.info.run_id

    for i in range(5):
        run_id = trial(f"t{i}")
        client.log_batch(run_id, params=[Param("config.lr", str(10 ** -i)), Param("budget_bytes", "4096")])
        client.log_batch(run_id, metrics=[Metric(key, value * (i + 1), 1_000 + step, step)
                                          for step in (8, 16, 24) for key, value in
                                          (("eval_loss", 1 / step), ("peak_allocated_bytes", 100 * step), ("step", step))])
        if i == 1:  # a restored trial logged step 16 again, later: that value is the one kept
            client.log_metric(run_id, "eval_loss", 0.25, timestamp=9_000, step=16)
        if i == 2:  # a diverged trial: NaN, and a metric only its last result has
            client.log_metric(run_id, "train_loss", float("nan"), timestamp=2_000, step=24)
        if i < 4:
            client.set_terminated(run_id, "FINISHED", end_time=5_000)
    client.log_metric(trial("other", sweep="s2"), "eval_loss", 1.0, step=8)
    deleted = trial("deleted")
    client.log_metric(deleted, "eval_loss", 1.0, step=8)
    client.delete_run(deleted)
    return experiment


def as_client_reads(client: MlflowClient, experiment: str) -> list[StoredRun]:
    """What MLflow's client says of the sweep's trials, a request per metric per run."""
    found = client.search_runs([experiment], f"tags.`{SWEEP_ID_TAG}` = 's1' and tags.`{ROLE_TAG}` = 'trial'")
    runs = []
    for run in found:
        history: dict[int, dict[str, float]] = {}
        for key in run.data.metrics:
            for point in client.get_metric_history(run.info.run_id, key):
                history.setdefault(point.step, {})[key] = point.value
        runs.append(StoredRun(run.info.run_id, run.info.run_name, run.info.status, run.info.start_time,
                              run.info.end_time, dict(run.data.params), dict(run.data.tags), history))
    return runs


def by_name(runs: list[StoredRun]) -> dict[str, StoredRun]:
    return {run.name: run for run in runs}


def same(a: StoredRun, b: StoredRun) -> bool:
    """Equal, NaN equal to NaN."""
    def plain(run: StoredRun):
        history = {step: {k: "nan" if math.isnan(v) else v for k, v in values.items()} for step, values in run.history.items()}
        return (run.run_id, run.name, run.status, run.start_time, run.end_time, run.params, run.tags, history)
    return plain(a) == plain(b)


def check_sweep(runs: list[StoredRun], client: MlflowClient, experiment: str) -> None:
    found = by_name(runs)
    assert sorted(found) == ["t0", "t1", "t2", "t3", "t4"]  # not another sweep's, not a deleted one, not the parent
    expected = by_name(as_client_reads(client, experiment))
    for name, run in found.items():
        assert same(run, expected[name]), name
    assert found["t1"].history[16]["eval_loss"] == 0.25  # logged last at that step
    assert math.isnan(found["t2"].history[24]["train_loss"]) and "train_loss" not in found["t2"].history[8]
    assert found["t3"].history[24] == {"eval_loss": 4 / 24, "peak_allocated_bytes": 9600.0, "step": 96.0}
    assert found["t4"].status == "RUNNING" and found["t4"].end_time is None and found["t0"].end_time == 5_000
    assert found["t0"].params == {"config.lr": "1", "budget_bytes": "4096"}
    assert found["t0"].tags["trial_id"] == "t0"


def test_a_sqlite_store_is_read_whole_as_the_client_reads_it(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    experiment = make_store(uri)
    client = MlflowClient(uri)
    check_sweep(trial_runs(client, experiment, "s1"), client, experiment)
    assert trial_runs(client, experiment, "nope") == []


@pytest.mark.integration  # starts a PostgreSQL cluster
def test_a_postgresql_store_is_read_whole_as_the_client_reads_it():
    """The SQL path on the database a shared tracking store runs on (``--tracking-uri postgresql://``)."""
    reason = why_not_here()
    if reason:
        pytest.skip(f"PostgreSQL: {reason}")
    with PostgresServer() as database:
        experiment = make_store(database.uri)
        client = MlflowClient(database.uri)
        assert reader._is_sql(client._tracking_client.store)
        check_sweep(trial_runs(client, experiment, "s1"), client, experiment)


@pytest.mark.integration  # starts an mlflow server
def test_a_tracking_server_is_read_whole_as_the_client_reads_it(tmp_path, monkeypatch):
    with MlflowServer(tmp_path / "server") as server:
        experiment = make_store(server.uri)
        client = MlflowClient(server.uri)
        check_sweep(trial_runs(client, experiment, "s1"), client, experiment)
        # An answer cut off at the server's limit: its runs are read one by one, nothing lost.
        monkeypatch.setattr(reader, "REST_POINTS", 4)
        monkeypatch.setattr(reader, "REST_RUNS", 2)
        check_sweep(trial_runs(client, experiment, "s1"), client, experiment)
        # A server without the bulk endpoint (an older one, a hosted one) answers 404: run by run.
        monkeypatch.setattr(reader, "REST_ENDPOINT", "/ajax-api/2.0/mlflow/metrics/no-such-endpoint")
        check_sweep(trial_runs(client, experiment, "s1"), client, experiment)


def test_any_other_store_is_read_run_by_run(tmp_path):
    """A store that is neither SQL nor a server (a ``file:`` store) is searched and read a request
    per metric per run: the same runs (read here through the SQLite store's client)."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    experiment = make_store(uri)
    client = MlflowClient(uri)
    check_sweep(reader._searched_runs(client, client._tracking_client.store, experiment, "s1"), client, experiment)
