"""MLflow tracking against real MLflow (a SQLite store and a real server) and a real local Ray.

The sweeps here run :func:`fake_trial`, a function trainable without torch that reports
results of the shape the real trainable reports, so every tracking path (a Tune-level retry
with a smaller plan, an OOM event, a refused trial, a server outage) is exercised in seconds.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from orchestrator.config import parse_spec
from mlflow_server import MlflowServer
from orchestrator.tracking import MlflowTracking, plan_params, result_metrics, spec_params

ROOT = Path(__file__).resolve().parent.parent
GiB = 2**30

SPEC = {
    "experiment": "tracking_test",
    "workload": {"name": "mlp", "params": {"depth": 2}},
    "search_space": {"lr": {"grid": [0.01, 0.1]}, "width": 16},
    "effective_batch_size": 64,
    "stop": {"epochs": 3},
    "memory": {"device": "emulated", "capacity": "8GiB"},
}


def make_spec(**changes):
    return parse_spec({**SPEC, **changes})


# -- a trainable that reports what the real one reports ------------------------------------------


def _plan(micro_batch: int, reductions: int, refusal: str | None = None) -> dict:
    phases = {"train": micro_batch * GiB // 8, "eval": GiB // 4}
    return {
        "micro_batch": micro_batch, "accum_steps": 64 // micro_batch, "effective_batch": 64, "eval_batch": 64,
        "activation_checkpointing": False, "precision": "fp32", "estimator": "static",
        "budget_bytes": 6 * GiB, "predicted_peak_bytes": max(phases.values()), "predicted_phase": "train",
        "predicted_phases": phases, "reductions": reductions, "note": "", "refusal": refusal,
    }


def result_for(plan: dict, epoch: int, oom_events: list[dict]) -> dict:
    """A report at the end of an epoch as ``trainables.trainable`` builds it (emulated device: no
    reserved/NVML), for a trial of one optimizer step per epoch."""
    measured = int(plan["predicted_peak_bytes"] * 1.05)
    return {
        "epoch": epoch, "step": epoch, "train_loss": 1.0 / max(epoch, 1), "eval_loss": 1.5 / max(epoch, 1), "plan": plan,
        "micro_batch": plan["micro_batch"], "accum_steps": plan["accum_steps"], "effective_batch": 64,
        "eval_batch": plan["eval_batch"], "activation_checkpointing": 0, "precision": "fp32",
        "plan_reductions": plan["reductions"], "estimator": "static", "memory_source": "emulated",
        "peak_allocated_bytes": measured, "predicted_peak_bytes": plan["predicted_peak_bytes"],
        "predicted_phase": "train", "prediction_error": (measured - plan["predicted_peak_bytes"]) / plan["predicted_peak_bytes"],
        "budget_bytes": plan["budget_bytes"], "oom_retries": len(oom_events), "oom_events": oom_events,
    }


def fake_trial(config: dict) -> None:
    """Epochs of a trial, behaving as ``config["cases"][str(lr)]`` says. ``oom_at``: the first attempt
    dies there and Tune restarts it from its checkpoint with half the micro-batch. ``refuse``: report a
    refusal at epoch 0 and stop. ``gates``: {epoch: file} - wait for the file before that epoch.
    ``checkpoint_every``: epochs between checkpoints (a restored trial repeats the epochs after its last)."""
    import tempfile

    from ray import tune

    case = config["cases"][str(config["lr"])]
    if case.get("refuse"):
        plan = _plan(64, 0, refusal="needs 8.0 GiB at micro-batch 1; the budget is 6.0 GiB")
        report = {**result_for(plan, 0, []), "train_loss": float("nan"), "eval_loss": float("nan"),
                  "refused": 1, "refusal": plan["refusal"]}
        for measured in ("memory_source", "peak_allocated_bytes", "prediction_error"):  # nothing ran
            del report[measured]
        tune.report(report)
        return
    state = {"epoch": 0, "micro_batch": 32, "reductions": 0, "events": []}
    checkpoint = tune.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as folder:
            state = json.loads(Path(folder, "state.json").read_text())
    marker = Path(config["scratch"], f"{tune.get_context().get_trial_id()}.oom")
    if checkpoint is not None and marker.exists() and not state["events"]:
        state["events"].append({
            "phase": "train", "epoch": state["epoch"], "step": 3, "micro_batch": state["micro_batch"],
            "eval_batch": 64, "bytes_requested": 2 * GiB, "bytes_allocated": 5 * GiB, "bytes_reserved": 5 * GiB,
            "message": "CUDA out of memory. Tried to allocate 2.00 GiB", "action": "micro-batch 32->16",
        })
        state.update(micro_batch=state["micro_batch"] // 2, reductions=state["reductions"] + 1)
    for epoch in range(state["epoch"] + 1, case["epochs"] + 1):
        gate = case.get("gates", {}).get(str(epoch))
        deadline = time.monotonic() + 90
        while gate and not os.path.exists(gate) and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(case.get("epoch_s", 0))
        if epoch == case.get("oom_at") and not marker.exists():
            marker.touch()
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        state["epoch"] = epoch
        checkpoint = None
        if epoch % case.get("checkpoint_every", 1) == 0:
            folder = tempfile.mkdtemp()
            Path(folder, "state.json").write_text(json.dumps(state))
            checkpoint = tune.Checkpoint.from_directory(folder)
        plan = _plan(state["micro_batch"], state["reductions"])
        tune.report(result_for(plan, epoch, list(state["events"])), checkpoint=checkpoint)


@pytest.fixture(scope="module")
def local_ray():
    import ray

    ray.init(
        address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}},
    )
    yield
    ray.shutdown()


def run_fake_sweep(tmp_path: Path, tracking_uri: str, cases: dict[float, dict], **callback_args):
    """A real Tune sweep of :func:`fake_trial`: one trial per learning rate in ``cases``."""
    from ray import tune

    spec = make_spec(search_space={"lr": {"grid": list(cases)}, "width": 16})
    scratch = tmp_path / "scratch"
    scratch.mkdir(exist_ok=True)
    tuner = tune.Tuner(
        fake_trial,
        param_space={"workload": "mlp", "depth": 2, "width": 16, "seed": 0, "lr": tune.grid_search(list(cases)),
                     "scratch": str(scratch), "cases": {str(lr): case for lr, case in cases.items()}},
        tune_config=tune.TuneConfig(metric="eval_loss", mode="min"),
        run_config=tune.RunConfig(
            name="tracking_test_run", storage_path=str(tmp_path / "tune"), verbose=0,
            callbacks=[MlflowTracking(tracking_uri, spec, **callback_args)],
            failure_config=tune.FailureConfig(max_failures=1),
        ),
    )
    return spec, tuner.fit()


# -- reading back what MLflow has ------------------------------------------------------------


def runs_of(tracking_uri: str, experiment: str = "tracking_test"):
    """(parent runs, {run name: child run}) of the experiment."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri)
    runs = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    parents = [r for r in runs if r.data.tags.get("orchestrator.role") == "sweep"]
    children = {r.info.run_name: r for r in runs if r.data.tags.get("orchestrator.role") == "trial"}
    return client, parents, children


def steps(client, run, key: str = "step") -> list[int]:
    return sorted(int(m.step) for m in client.get_metric_history(run.info.run_id, key))


def artifact_json(client, run, path: str):
    local = client.download_artifacts(run.info.run_id, path)
    return json.loads(Path(local).read_text())


# -- tests -----------------------------------------------------------------------------------


def test_spec_and_plan_become_flat_params():
    params = spec_params(make_spec())
    assert params["experiment"] == "tracking_test"
    assert params["search_space.lr"] == "grid [0.01, 0.1]"
    assert params["params.depth"] == "2"
    assert params["memory.capacity"] == str(8 * GiB)
    assert params["memory.safety_margin"] == "0.98"

    plan = plan_params(_plan(32, 1))
    assert plan["plan.micro_batch"] == "32" and plan["plan.reductions"] == "1"
    assert plan["plan.predicted_phases.train"] == str(4 * GiB)
    staged = plan_params({**_plan(32, 0), "predicted_phases": {"train@epoch2": 5}})
    assert staged["plan.predicted_phases.train:epoch2"] == "5"  # MLflow refuses '@' in a param name
    assert "plan.refusal" not in plan  # None is not a value worth a param

    metrics = result_metrics({**result_for(_plan(32, 0), 2, []), "training_iteration": 2, "done": False,
                              "time_total_s": 3.5, "trial_id": "x", "refused": 1, "training_done": 0})
    assert metrics["peak_allocated_bytes"] == int(4 * GiB * 1.05) and metrics["time_total_s"] == 3.5
    assert metrics["epoch"] == 2  # the step is MLflow's step; the epoch is a metric
    assert not {"step", "training_iteration", "done", "refused", "training_done", "plan", "precision", "trial_id"} & set(metrics)


def test_sweep_with_a_retried_and_a_refused_trial(local_ray, tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cases = {0.01: {"epochs": 3}, 0.1: {"epochs": 3, "oom_at": 2}, 0.2: {"refuse": True}}
    spec, results = run_fake_sweep(tmp_path, uri, cases)
    assert not results.errors

    client, parents, children = runs_of(uri)
    assert len(parents) == 1
    parent = parents[0]
    assert parent.info.status == "FINISHED"
    assert parent.info.run_name == "tracking_test_run"  # Tune's experiment folder
    assert parent.data.params["search_space.lr"] == "grid [0.01, 0.1, 0.2]"
    sweep_yaml = Path(client.download_artifacts(parent.info.run_id, "sweep.yaml")).read_text()
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


class FakeTrial(SimpleNamespace):
    """The parts of ``ray.tune.experiment.Trial`` the callback reads, for driver-level tests."""

    def __str__(self) -> str:
        return f"fake_trial_{self.trial_id}"


def fake_trial_object(trial_id: str = "abcde_00000") -> FakeTrial:
    return FakeTrial(
        trial_id=trial_id, config={"workload": "mlp", "lr": 0.01, "width": 16, "depth": 2, "seed": 0},
        status="RUNNING", last_result={}, path="/tune/trial", remote_experiment_path="/tune/exp",
        experiment_dir_name="exp", placement_group_factory=SimpleNamespace(required_resources={"CPU": 1.0}),
        error_file=None,
    )


def drive(callback: MlflowTracking, trial: FakeTrial, epochs: list[int], train_loss: float) -> None:
    callback.on_trial_start(iteration=0, trials=[trial], trial=trial)
    for epoch in epochs:
        trial.last_result = {**result_for(_plan(32, 0), epoch, []), "train_loss": train_loss}
        callback.on_trial_result(iteration=epoch, trials=[trial], trial=trial, result=trial.last_result)


def resume_from(state: dict, uri: str, spec) -> MlflowTracking:
    """A new driver restored from an earlier one's Tune state (Tune pickles it with the experiment)."""
    import pickle

    state = pickle.loads(pickle.dumps(state))
    second = pickle.loads(pickle.dumps(MlflowTracking(uri, spec)))
    second.set_state(state)
    second.setup()
    return second


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
    trial.status = "TERMINATED"
    second.on_trial_complete(iteration=4, trials=[trial], trial=trial)
    second.on_experiment_end(trials=[trial])

    client, parents, children = runs_of(uri)
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    assert list(children) == ["fake_trial_abcde_00000"]
    run = children["fake_trial_abcde_00000"]
    assert run.info.status == "FINISHED"
    assert steps(client, run) == [1, 2, 3]
    losses = {int(m.step): m.value for m in client.get_metric_history(run.info.run_id, "train_loss")}
    assert losses == {1: 1.0, 2: 1.0, 3: 2.0}  # the first report of an epoch is the one kept


def test_writes_a_driver_could_not_send_are_sent_by_the_resumed_driver(tmp_path, caplog):
    server = MlflowServer(tmp_path / "server")  # not started: nothing answers on its port yet
    spec = make_spec()
    first = MlflowTracking(server.uri, spec, flush_timeout_s=1)
    first.setup()
    trial = fake_trial_object()
    drive(first, trial, [1, 2], train_loss=1.0)
    time.sleep(1)
    state = first.get_state()  # Tune's final experiment checkpoint comes before on_experiment_end
    assert sum(type(op).__name__ == "LogResult" for op in state["pending"]) == 2
    first.on_experiment_end(trials=[trial])
    assert "unreachable" in caplog.text and "still unsent" in caplog.text

    with server:
        second = resume_from(state, server.uri, spec)
        drive(second, trial, [3], train_loss=1.0)
        trial.status = "TERMINATED"
        second.on_trial_complete(iteration=4, trials=[trial], trial=trial)
        second.on_experiment_end(trials=[trial])
        client, parents, children = runs_of(server.uri)
        assert len(parents) == 1 and parents[0].info.status == "FINISHED"
        assert steps(client, children["fake_trial_abcde_00000"]) == [1, 2, 3]
        assert children["fake_trial_abcde_00000"].info.status == "FINISHED"


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
            time.sleep(3)  # epochs 4-6 of both trials are reported while nothing listens
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
        assert "unreachable" in caplog.text and "reachable again" in caplog.text

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
