"""MLflow tracking against real MLflow (a SQLite store, and a real server in the integration
tier) and a real local Ray.

The sweeps here run ``fake_sweep.fake_trial``, a function trainable without torch that reports
results of the shape the real trainable reports, so every tracking path (a Tune-level retry
with a smaller plan, an OOM event, a refused trial, a server outage) is exercised in seconds.
The driver-level tests call the callback's hooks as Tune does, without Ray.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time

import pytest
from fake_sweep import (
    GiB, artifact_json, drive, fake_trial, fake_trial_object, finish, make_spec, plan_dict, result_for, resume_from,
    run_fake_sweep, runs_of, steps,
)
from mlflow_server import MlflowServer
from ports import free_port
from postgres_server import PostgresServer, why_not_here

from orchestrator.config import parse_spec
from orchestrator.contract import COMPILED_MODEL_NOTE
from orchestrator.errors import UserError
from orchestrator.outcome import recording
from orchestrator.runner import run_sweep
from orchestrator.tracking.callback import UNSENT_FILE, MlflowTracking
from orchestrator.tracking.check import check_tracking
from orchestrator.tracking.flatten import plan_params, result_metrics, spec_params
from orchestrator.tracking.outbox import is_outage
from orchestrator.tracking.reader import artifact_text
from orchestrator.tracking.store import reading, unusable
from orchestrator.trial_report import TrialReport
from tests.conftest import ROOT, command_env, installed_command


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.1)


# -- tests -----------------------------------------------------------------------------------


def test_spec_and_plan_become_flat_params():
    params = spec_params(make_spec())
    assert params["experiment"] == "tracking_test"
    assert params["search_space.lr"] == "grid [0.01, 0.1]"
    assert params["params.depth"] == "2"
    assert params["memory.capacity"] == str(8 * GiB)
    assert params["memory.safety_margin"] == "0.98"

    plan = plan_params(plan_dict(32, 1))
    assert plan["plan.micro_batch"] == "32" and plan["plan.reductions"] == "1"
    assert plan["plan.predicted_phases.train"] == str(4 * GiB)
    staged = plan_params({**plan_dict(32, 0), "predicted_phases": {"train@epoch2": 5}})
    assert staged["plan.predicted_phases.train:epoch2"] == "5"  # MLflow refuses '@' in a param name
    assert "plan.refusal" not in plan  # None is not a value worth a param

    metrics = result_metrics(TrialReport.from_result({
        **result_for(plan_dict(32, 0), 2, []), "training_iteration": 2, "done": False, "time_total_s": 3.5,
        "trial_id": "x", "refused": 1, "training_done": 0}))
    assert metrics["peak_allocated_bytes"] == int(4 * GiB * 1.05) and metrics["time_total_s"] == 3.5
    assert metrics["epoch"] == 2  # the step is MLflow's step; the epoch is a metric
    assert (metrics["learning_rate"], metrics["steps_per_second"], metrics["samples_per_second"]) == (0.01, 2.0, 128.0)
    assert not {"step", "training_iteration", "done", "refused", "training_done", "plan", "precision", "trial_id"} & set(metrics)
    # A diverged trial's worst value is the scheduler's, not a measurement: MLflow would keep inf as 1.8e308.
    diverged = result_metrics(TrialReport(epoch=1, step=9, train_loss=float("nan"), measurements={"eval_loss": float("inf")},
                                          diverged="loss not finite at step 9 (epoch 2)", diverged_at_step=9))
    assert "eval_loss" not in diverged and diverged["epoch"] == 1 and diverged["diverged_at_step"] == 9


@pytest.mark.integration
def test_sweep_with_a_retried_and_a_refused_trial(local_ray, tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cases = {0.01: {"epochs": 3}, 0.1: {"epochs": 3, "oom_at": 2}, 0.2: {"refuse": True}}
    spec, results = run_fake_sweep(tmp_path, uri, cases)
    assert not results.errors

    client, parents, children = runs_of(uri)
    assert len(parents) == 1
    parent = parents[0]
    assert parent.info.status == "FAILED"  # as `run` exits 1: a trial was refused
    assert parent.info.run_name == "tracking_test_run"  # Tune's experiment folder
    assert parent.data.params["search_space.lr"] == "grid [0.01, 0.1, 0.2]"
    sweep_yaml = artifact_text(client, parent.info.run_id, "sweep.yaml")
    assert "effective_batch_size: 64" in sweep_yaml
    assert (tmp_path / "mlartifacts").is_dir()  # a SQLite store keeps artifacts beside its database

    by_lr = {r.data.params["config.lr"]: r for r in children.values()}
    assert set(by_lr) == {"0.01", "0.1", "0.2"}
    trial_ids = {result.config["lr"]: result.metrics["trial_id"] for result in results}
    for lr, run in by_lr.items():
        assert run.info.run_name == f"fake_trial_{trial_ids[float(lr)]}"  # as in Tune's progress table
        assert run.data.tags["mlflow.parentRunId"] == parent.info.run_id
        assert run.data.tags["trial_id"] == trial_ids[float(lr)] and run.data.tags["workload"] == "mlp"
        assert run.data.params["config.width"] == "16" and run.data.params["config.depth"] == "2"

    plain = by_lr["0.01"]
    assert plain.info.status == "FINISHED"
    assert steps(client, plain) == [1, 2, 3] and steps(client, plain, "train_loss") == [1, 2, 3]
    assert plain.data.params["estimator"] == "static" and plain.data.params["budget_bytes"] == str(6 * GiB)
    assert plain.data.params["plan.micro_batch"] == "32"
    assert plain.data.params["plan.predicted_phases.train"] == str(4 * GiB)
    assert plain.data.metrics["peak_allocated_bytes"] == int(4 * GiB * 1.05)

    # Restarted by Tune with half the micro-batch: no "Changing param values" anywhere, final plan as params.
    retried = by_lr["0.1"]
    assert retried.info.status == "FINISHED"
    assert steps(client, retried) == [1, 2, 3]
    assert [m.value for m in sorted(client.get_metric_history(retried.info.run_id, "micro_batch"), key=lambda m: m.step)] == [32, 16, 16]
    assert retried.data.params["plan.micro_batch"] == "16" and retried.data.params["plan.reductions"] == "1"
    assert retried.data.metrics["oom_retries"] == 1
    assert retried.data.tags["tune.restarts"] == "1" and "out of memory" in retried.data.tags["tune.last_error"]
    events = artifact_json(client, retried, "oom_events.json")
    assert [e["bytes_requested"] for e in events] == [2 * GiB]
    history = artifact_json(client, retried, "plan_history.json")
    assert [(h["epoch"], h["plan"]["micro_batch"]) for h in history] == [(1, 32), (2, 16)]

    refused = by_lr["0.2"]
    assert refused.info.status == "FAILED"
    assert "needs 8.0 GiB" in refused.data.tags["refusal"]
    assert "needs 8.0 GiB" in refused.data.params["plan.refusal"]
    assert steps(client, refused) == [0] and refused.data.metrics["predicted_peak_bytes"] == 8 * GiB


@pytest.mark.integration
def test_a_trial_logs_its_learning_rate_and_speed_at_each_report(local_ray, tmp_path):
    """The real trainable: a ``ReduceLROnPlateau`` workload's learning rate, as MLflow holds it step
    by step, is divided by 4 at each evaluation after the eval loss stopped improving."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    spec = parse_spec({
        "experiment": "tracking_test", "workload": "tests.workloads:PlateauWorkload", "search_space": {"lr": 0.25},
        "effective_batch_size": 8, "stop": {"steps": 6}, "eval_every": {"steps": 1, "max_batches": 1},
        "resources": {"cpu": 1}, "memory": {"device": "emulated", "capacity": "64MiB", "estimator": "none"},
    })
    assert run_sweep(spec, tracking_uri=uri, storage_path=str(tmp_path / "results")).ok
    client, _, children = runs_of(uri)
    (run,) = children.values()

    def history(key):
        return [m.value for m in sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: m.step)]

    assert history("eval_loss") == [0.75, 0.5, 0.25, 0.0, 0.0, 0.0]
    assert history("learning_rate") == [0.25, 0.25, 0.25, 0.25, 0.0625, 0.015625]
    speeds = history("steps_per_second")
    assert len(speeds) == 6 and all(speed > 0 for speed in speeds)
    assert history("samples_per_second") == pytest.approx([8 * speed for speed in speeds])


def test_a_plan_made_from_a_compiled_models_eager_trace_says_so_on_the_trials_run(tmp_path):
    """A ``torch.compile``d model is planned from its eager modules: its run carries the caveat as
    a tag from its first report, and ``plan.compiled`` among the plan's params at its end."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    callback = MlflowTracking(uri, make_spec())
    callback.setup()
    trial = fake_trial_object()
    callback.on_trial_start(iteration=0, trials=[trial], trial=trial)
    trial.last_result = result_for({**plan_dict(32, 0), "compiled": True}, 1, [])
    callback.on_trial_result(iteration=1, trials=[trial], trial=trial, result=trial.last_result)
    finish(callback, trial)
    callback.on_experiment_end(trials=[trial])
    _, _, children = runs_of(uri)
    (run,) = children.values()
    assert run.data.tags["compiled_model"] == COMPILED_MODEL_NOTE
    assert "the compiled graph's memory may differ" in COMPILED_MODEL_NOTE
    assert run.data.params["plan.compiled"] == "True"


@pytest.mark.integration
def test_a_compiled_models_trial_records_that_it_was_planned_from_the_eager_trace(local_ray, tmp_path):
    """The real trainable with a model ``build_model`` returns compiled: the driver's trace plans
    it from its eager modules, the trial trains the compiled model, and its run says so."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    spec = parse_spec({
        "experiment": "tracking_test", "workload": {"name": "tests.workloads:CompiledMLPWorkload",
                                                    "params": {"width": 16, "train_samples": 64, "eval_samples": 16}},
        "search_space": {"lr": 0.01}, "effective_batch_size": 16, "stop": {"steps": 2},
        "resources": {"cpu": 1}, "memory": {"device": "emulated", "capacity": "64MiB", "estimator": "trace"},
    })
    assert run_sweep(spec, tracking_uri=uri, storage_path=str(tmp_path / "results")).ok
    _, _, children = runs_of(uri)
    (run,) = children.values()
    assert run.info.status == "FINISHED"
    assert run.data.tags["compiled_model"] == COMPILED_MODEL_NOTE
    assert run.data.params["plan.compiled"] == "True" and run.data.params["plan.estimator"] == "trace"


def test_resumed_driver_continues_the_same_runs_without_duplicate_epochs(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    spec = make_spec()
    first = MlflowTracking(uri, spec)
    first.setup()
    trial = fake_trial_object()
    drive(first, trial, [1, 2], train_loss=1.0)
    assert first._outbox.drain(60)
    # The driver dies here (SLURM requeue): no on_experiment_end. Tune restores the trial from its
    # checkpoint of epoch 1, so epoch 2 is reported again, with another value.
    second = resume_from(first.get_state(), uri, spec)
    drive(second, trial, [2, 3], train_loss=2.0)
    finish(second, trial)
    second.on_experiment_end(trials=[trial])

    client, parents, children = runs_of(uri)
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    assert list(children) == ["fake_trial_abcde_00000"]
    run = children["fake_trial_abcde_00000"]
    assert run.info.status == "FINISHED"
    assert steps(client, run) == [1, 2, 3]
    losses = {int(m.step): m.value for m in client.get_metric_history(run.info.run_id, "train_loss")}
    assert losses == {1: 1.0, 2: 1.0, 3: 2.0}  # the first report of an epoch is the one kept


@pytest.mark.integration
def test_writes_a_driver_could_not_send_are_sent_by_the_resumed_driver(tmp_path, caplog):
    server = MlflowServer(tmp_path / "server")  # not started: nothing answers on its port yet
    spec = make_spec()
    first = MlflowTracking(server.uri, spec, flush_timeout_s=1)
    first.setup()
    trial = fake_trial_object()
    drive(first, trial, [1, 2], train_loss=1.0)
    wait_for(lambda: "unavailable" in caplog.text, 30, "the callback to find MLflow away")
    state = first.get_state()  # Tune's final experiment checkpoint comes before on_experiment_end
    assert sum(type(op).__name__ == "LogResult" for op in state["pending"]) == 2
    first.on_experiment_end(trials=[trial])
    assert "still unsent" in caplog.text

    with server:
        second = resume_from(state, server.uri, spec)
        drive(second, trial, [3], train_loss=1.0)
        finish(second, trial)
        second.on_experiment_end(trials=[trial])
        client, parents, children = runs_of(server.uri)
        assert len(parents) == 1 and parents[0].info.status == "FINISHED"
        assert steps(client, children["fake_trial_abcde_00000"]) == [1, 2, 3]
        assert children["fake_trial_abcde_00000"].info.status == "FINISHED"


def test_writes_still_unsent_at_the_end_are_kept_for_the_resume_which_sends_them(tmp_path):
    """The store cannot be opened during the sweep (its folder's name is taken by a file): every
    write waits, the end keeps them in the sweep's folder, the record says so, and a resumed
    driver, once the store can be opened, sends all of them, even those queued after Tune's last
    experiment checkpoint (the runs' final statuses)."""
    blocker = tmp_path / "tracking"
    blocker.write_text("not a folder")
    uri = f"sqlite:///{blocker / 'mlflow.db'}"
    kept = tmp_path / "sweep" / UNSENT_FILE
    spec = make_spec()
    first = MlflowTracking(uri, spec, flush_timeout_s=1, unsent_file=str(kept))
    first.setup()
    trial = fake_trial_object()
    drive(first, trial, [1, 2], train_loss=1.0)
    finish(first, trial)
    state = first.get_state()
    with recording() as record:
        first.on_experiment_end(trials=[trial])
    delivery = record.tracking
    assert delivery.unsent > len(state["pending"]) and delivery.kept_at == str(kept) and not delivery.dropped
    assert kept.exists() and not delivery.complete

    blocker.unlink()
    second = resume_from(state, uri, spec, unsent_file=str(kept))
    with recording() as record:
        second.on_experiment_end(trials=[trial])
    assert record.tracking.complete and not kept.exists()
    client, parents, children = runs_of(uri)
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    run = children["fake_trial_abcde_00000"]
    assert run.info.status == "FINISHED" and steps(client, run) == [1, 2]
    assert run.data.params["plan.micro_batch"] == "32"  # queued when the trial completed, after the checkpoint


def test_a_write_mlflow_rejects_is_dropped_reported_and_fails_the_sweep_run(tmp_path):
    """A metric name MLflow refuses: the result is rejected (400) three times and dropped; the rest
    arrives, the sweep's run is FAILED and the record names the drop, so `run` exits non-zero."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    spec = make_spec()
    tracking = MlflowTracking(uri, spec)
    tracking.setup()
    trial = fake_trial_object()
    tracking.on_trial_start(iteration=0, trials=[trial], trial=trial)
    for epoch, extra in ((1, {}), (2, {"eval_top@5": 0.5}), (3, {})):
        trial.last_result = {**result_for(plan_dict(32, 0), epoch, []), **extra}
        tracking.on_trial_result(iteration=epoch, trials=[trial], trial=trial, result=trial.last_result)
    finish(tracking, trial)
    with recording() as record:
        tracking.on_experiment_end(trials=[trial])
    delivery = record.tracking
    assert delivery.unsent == 0 and len(delivery.dropped) == 1
    assert delivery.dropped[0].startswith("LogResult(step 2 of fake_trial_abcde_00000): ") and "eval_top@5" in delivery.dropped[0]
    client, parents, children = runs_of(uri)
    assert parents[0].info.status == "FAILED"
    assert steps(client, children["fake_trial_abcde_00000"]) == [1, 3]


def test_outages_and_rejections_are_told_apart():
    from mlflow.exceptions import MlflowException, RestException
    from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE, TEMPORARILY_UNAVAILABLE
    from requests.exceptions import ConnectionError as RequestsConnectionError

    assert is_outage(MlflowException("(sqlite3.OperationalError) database is locked", error_code=TEMPORARILY_UNAVAILABLE))
    assert is_outage(RestException({"error_code": "503", "message": "Service Unavailable"}))
    assert is_outage(RestException({"error_code": "UNAUTHENTICATED", "message": "no credentials"}))
    try:  # how MLflow's HTTP client reports a server that is not there
        raise MlflowException("API request to http://h/api failed with exception") from RequestsConnectionError("refused")
    except MlflowException as exc:
        assert is_outage(exc)
    assert is_outage(FileExistsError(17, "File exists"))
    assert not is_outage(MlflowException("Invalid metric name: 'a@b'", error_code=INVALID_PARAMETER_VALUE))
    assert not is_outage(RestException({"error_code": "RESOURCE_DOES_NOT_EXIST", "message": "Run 'x' not found"}))
    assert not is_outage(ValueError("a bug"))


def test_a_store_that_cannot_be_used_is_said_in_one_line():
    """``run``'s check and ``report`` word it alike: refused credentials name the variables that carry
    them; anything else is the store's first line and the command's advice. Only the store's own
    errors are worded so: a bug in the code reading it keeps its traceback."""
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import PERMISSION_DENIED, UNAUTHENTICATED

    for code, status in ((UNAUTHENTICATED, 401), (PERMISSION_DENIED, 403)):
        said = unusable("http://mlflow:5000", MlflowException("no", error_code=code), "start it")
        assert said == (f"MLflow at http://mlflow:5000 refused our credentials (HTTP {status}); set "
                        "MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN)")
    said = unusable("sqlite:///m.db", sqlite3.DatabaseError("database disk image is malformed\nmore"), "restore it")
    assert said == "MLflow at sqlite:///m.db is not usable (database disk image is malformed); restore it"
    with pytest.raises(UserError, match=r"^MLflow at sqlite:///m.db is not usable \(file is not a database\); restore it$"):
        with reading("sqlite:///m.db", "restore it"):
            raise sqlite3.DatabaseError("file is not a database")
    with pytest.raises(KeyError), reading("sqlite:///m.db", "restore it"):
        raise KeyError("a bug of ours")


def test_a_file_store_and_a_missing_database_driver_say_what_to_do(monkeypatch):
    """MLflow 3 refuses its file store with a paragraph whose advice came after the cut of a first
    line; a database URI whose driver is not installed raised a bare ModuleNotFoundError (in
    ``report``, a traceback). Both are one line that says what to do."""
    from mlflow.exceptions import MlflowException

    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    refusal = MlflowException("The filesystem tracking backend (e.g., './mlruns') is in maintenance mode ...")
    for uri in ("./mlruns", "file:///data/mlruns"):
        assert unusable(uri, refusal, "start it") == (
            f"{uri} is MLflow's file store, which MLflow 3 refuses (it is in maintenance mode); use a database store, "
            "e.g. sqlite:///mlflow.db (`mlflow migrate-filestore` moves the runs already there into one), "
            "or set MLFLOW_ALLOW_FILE_STORE=true")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # allowed, and failing for another reason: that reason
    assert unusable("./mlruns", MlflowException("disk full"), "start it") == "MLflow at ./mlruns is not usable (disk full); start it"

    try:
        try:
            raise ModuleNotFoundError("No module named 'psycopg'", name="psycopg")
        except ModuleNotFoundError as missing:
            raise RuntimeError("could not create the engine") from missing
    except RuntimeError as exc:
        said = unusable("postgresql://u@db/mlflow", exc, "start it")
    assert said == ("MLflow at postgresql://u@db/mlflow needs the database driver 'psycopg', which is not installed "
                    "here: pip install 'psycopg[binary]' (or write postgresql+psycopg2://..., whose driver "
                    "`pip install -e '.[postgres]'` installs)")
    with pytest.raises(UserError, match=r"needs the database driver 'MySQLdb', which is not installed here: pip install 'mysqlclient'$"):
        with reading("mysql://u@db/mlflow", "restore it"):
            raise ModuleNotFoundError("No module named 'MySQLdb'", name="MySQLdb")


def test_a_uri_scheme_mlflow_has_no_store_for_names_the_schemes_it_has():
    """MLflow's own words name its model registry, and its list of schemes was cut mid-way by the
    first line's limit: the line names the URI and every scheme of MLflow's registry, in full."""
    from orchestrator.tracking.client import mlflow_client

    with pytest.raises(UserError) as refused, reading("foo://bar", "start it"):
        mlflow_client("foo://bar")
    said = str(refused.value)
    assert said.startswith("foo://bar: MLflow has no tracking store for this URI's scheme; it takes ")
    assert said.endswith("(e.g. sqlite:///mlflow.db, or http://HOST:5000 for a tracking server)")
    for scheme in ("file://", "http://", "https://", "sqlite://", "postgresql://", "mysql://", "databricks://"):
        assert scheme in said
    assert "registry" not in said


@pytest.mark.parametrize("verb", ["run", "report"])
def test_a_database_store_that_does_not_answer_is_one_line_at_once(tmp_path, verb):
    """A PostgreSQL store whose server is down: the driver's refusal in one line, exit 2, not
    MLflow's ten tries over ~100 s with a warning of several lines each (nothing listens there)."""
    pytest.importorskip("psycopg2")
    uri = f"postgresql+psycopg2://mlflow@127.0.0.1:{free_port()}/mlflow"
    (tmp_path / "sweep.yaml").write_text((ROOT / "configs" / "demo_cpu.yaml").read_text())
    command = [installed_command(), verb, *(["sweep.yaml"] if verb == "run" else []), "--tracking-uri", uri]
    done = subprocess.run(command, cwd=tmp_path, env=command_env(), capture_output=True, text=True, timeout=90, check=False)
    assert done.returncode == 2, done.stderr[-3000:]
    [line] = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert f"MLflow at {uri} is not usable ((psycopg2.OperationalError) connection to server at" in line
    assert "could not be created" not in done.stderr and "Traceback" not in done.stderr


def test_the_tracking_store_is_checked_before_a_sweep_starts(tmp_path):
    from mlflow import MlflowClient

    # A database that does not exist yet is not made by the check (the sweep may still be refused).
    check_tracking(f"sqlite:///{tmp_path / 'ok' / 'mlflow.db'}", "tracking_test")
    assert not (tmp_path / "ok").exists()
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(UserError, match=r"tracking_uri: cannot create the MLflow database .*file/mlflow.db"):
        check_tracking(f"sqlite:///{tmp_path / 'file' / 'mlflow.db'}", "tracking_test")
    with pytest.raises(UserError) as err:
        check_tracking(f"http://127.0.0.1:{free_port()}", "tracking_test")
    assert "is not usable" in str(err.value) and "--offline-tracking" in str(err.value) and "\n" not in str(err.value)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    client.delete_experiment(client.create_experiment("gone"))
    with pytest.raises(UserError, match="experiment: the MLflow experiment 'gone' .* is deleted; restore it"):
        check_tracking(uri, "gone")


HOLD_LOCK = """
import sqlite3, sys, time
db = sqlite3.connect(sys.argv[1], isolation_level=None)
db.execute("BEGIN EXCLUSIVE")
print("locked", flush=True)
time.sleep(float(sys.argv[2]))
db.execute("COMMIT")
"""


@pytest.mark.integration
def test_a_sqlite_store_locked_by_another_process_is_waited_for_not_dropped(tmp_path, caplog):
    """Another process holds the write lock longer than MLflow's own busy timeout (20 s): every
    write that met it waits and arrives once; nothing is dropped."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    spec = make_spec()
    tracking = MlflowTracking(uri, spec)
    tracking.setup()
    trial = fake_trial_object()
    drive(tracking, trial, [1], train_loss=1.0)
    assert tracking._outbox.drain(60)
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(tmp_path / "mlflow.db"), "24"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        drive(tracking, trial, [2, 3], train_loss=1.0)
        finish(tracking, trial)
        with recording() as record:
            tracking.on_experiment_end(trials=[trial])
    finally:
        holder.wait(timeout=60)
    assert "database is locked" in caplog.text and "unavailable" in caplog.text
    assert record.tracking.complete
    client, parents, children = runs_of(uri)
    assert parents[0].info.status == "FINISHED"
    assert steps(client, children["fake_trial_abcde_00000"]) == [1, 2, 3]


@pytest.mark.integration
def test_server_outage_mid_sweep_loses_and_duplicates_nothing(local_ray, tmp_path, caplog):
    """Stop the server after epoch 3 of both trials, let them report epochs 4-6 while it is down,
    start it again (same port, same database), then epochs 7-8: every epoch is there exactly once."""
    server = MlflowServer(tmp_path / "server").start()
    outage, back = tmp_path / "outage", tmp_path / "back"
    case = {"epochs": 8, "epoch_s": 0.2, "gates": {"4": str(outage), "7": str(back)}}
    failures: list[BaseException] = []

    def operate_server():
        from mlflow import MlflowClient

        try:
            client = MlflowClient(server.uri)
            deadline = time.monotonic() + 90
            while time.monotonic() < deadline:
                experiment = client.get_experiment_by_name("tracking_test")
                runs = client.search_runs([experiment.experiment_id], "metrics.epoch >= 3") if experiment else []
                if len(runs) == 2:
                    break
                time.sleep(0.5)
            else:
                raise TimeoutError("the trials did not reach epoch 3 in MLflow")
            server.stop()
            outage.touch()
            # Epochs 4-6 of both trials are reported while nothing listens.
            wait_for(lambda: len(list((tmp_path / "scratch").glob("*.reported6"))) == 2, 90, "epoch 6 of both trials")
            server.start()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread
            failures.append(exc)
        finally:
            outage.touch()
            back.touch()

    operator = threading.Thread(target=operate_server)
    try:
        operator.start()
        _, results = run_fake_sweep(tmp_path, server.uri, {0.01: case, 0.1: case})
        operator.join()
        assert not failures, failures
        assert not results.errors
        assert "unavailable" in caplog.text and "reachable again" in caplog.text

        client, parents, children = runs_of(server.uri)
        assert len(parents) == 1 and parents[0].info.status == "FINISHED"
        assert len(children) == 2
        for run in children.values():
            assert run.info.status == "FINISHED"
            for key in ("epoch", "train_loss", "peak_allocated_bytes", "micro_batch"):
                assert steps(client, run, key) == list(range(1, 9)), key
    finally:
        operator.join()
        server.stop()


@pytest.mark.integration
def test_interrupted_and_restored_sweep_continues_the_same_runs(local_ray, tmp_path):
    """SIGUSR1 (what SLURM sends before a requeue) stops the sweep after epoch 3; ``Tuner.restore``
    continues it from checkpoints of epoch 2, so epoch 3 is reported twice and logged once."""
    from ray import tune

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    go = tmp_path / "go"
    case = {"epochs": 5, "checkpoint_every": 2, "gates": {"4": str(go)}}
    failures: list[BaseException] = []

    def interrupt_after_epoch_3():
        try:
            deadline = time.monotonic() + 90
            while time.monotonic() < deadline:
                try:
                    _, _, children = runs_of(uri)
                    if len(children) == 2 and all(r.data.metrics.get("epoch") == 3 for r in children.values()):
                        break
                except Exception:  # noqa: BLE001 - the experiment may not exist yet
                    pass
                time.sleep(0.5)
            else:
                raise TimeoutError("the trials did not reach epoch 3 in MLflow")
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread
            failures.append(exc)
        finally:
            os.kill(os.getpid(), signal.SIGUSR1)

    interrupter = threading.Thread(target=interrupt_after_epoch_3)
    interrupter.start()
    run_fake_sweep(tmp_path, uri, {0.01: case, 0.1: case})
    interrupter.join()
    assert not failures, failures
    _, parents, children = runs_of(uri)
    assert parents[0].info.status == "KILLED" and {r.info.status for r in children.values()} == {"KILLED"}

    go.touch()
    restored = tune.Tuner.restore(str(tmp_path / "tune" / "tracking_test_run"), trainable=fake_trial, resume_unfinished=True)
    results = restored.fit()
    assert not results.errors and {r.metrics["epoch"] for r in results} == {5}

    client, parents, after = runs_of(uri)
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    assert {name: r.info.run_id for name, r in after.items()} == {name: r.info.run_id for name, r in children.items()}
    for run in after.values():
        assert run.info.status == "FINISHED"
        assert steps(client, run) == [1, 2, 3, 4, 5] and steps(client, run, "train_loss") == [1, 2, 3, 4, 5]


POSTGRES_TRIALS = 24  # bench/sweep_scale.py --tracking-uri runs the 512 of the issue; this keeps CI to a minute or two


@pytest.mark.integration
def test_a_tracking_server_backed_by_postgresql_takes_a_sweep_with_nothing_lost(tmp_path):
    """What a team sharing one tracking server runs: ``mlflow server`` on a PostgreSQL database
    (a cluster of the test's own), and ``orchestrator run --tracking-uri http://...`` from a
    user's folder. Every trial has its run, every epoch of it is there once, and ``report``
    reads the sweep back."""
    reason = why_not_here()
    if reason:
        pytest.skip(f"PostgreSQL-backed MLflow server: {reason}")
    import yaml

    sweep = {
        "experiment": "postgres_test", "workload": {"name": "mlp", "params": {"width": 16, "train_samples": 256}},
        "search_space": {"lr": {"loguniform": [1e-4, 1e-1]}}, "num_samples": POSTGRES_TRIALS,
        "effective_batch_size": 64, "stop": {"epochs": 2}, "resources": {"cpu": 1}, "memory": {"device": "cpu"},
        "storage_path": str(tmp_path / "results"),
    }
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump(sweep))
    with PostgresServer() as database, MlflowServer(tmp_path / "server", backend_store_uri=database.uri) as server:
        done = subprocess.run([installed_command(), "run", "sweep.yaml", "--tracking-uri", server.uri],
                              cwd=tmp_path, env=command_env(), capture_output=True, text=True, timeout=600, check=False)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        client, parents, children = runs_of(server.uri, "postgres_test")
        assert len(parents) == 1 and parents[0].info.status == "FINISHED"
        assert len(children) == POSTGRES_TRIALS
        for run in children.values():
            assert run.info.status == "FINISHED"
            assert sorted(int(m.value) for m in client.get_metric_history(run.info.run_id, "epoch")) == [1, 2]
        report = subprocess.run([installed_command(), "report", "postgres_test", "--tracking-uri", server.uri,
                                 "--out", str(tmp_path / "report")],
                                cwd=tmp_path, env=command_env(), capture_output=True, text=True, timeout=300, check=False)
        assert report.returncode == 0, report.stdout[-3000:] + report.stderr[-3000:]
        assert report.stdout.count(" FINISHED") >= POSTGRES_TRIALS
