"""A trainable without torch that reports what the real one reports, the Tune sweep that runs
it with the MLflow callback, and what the tracking and report tests read back from MLflow.

Ray workers import :func:`fake_trial` from this module: the ``local_ray`` fixture puts ``tests/``
on their path.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

from orchestrator.config import parse_spec
from orchestrator.contract import OomEvent
from orchestrator.tracking.callback import MlflowTracking
from orchestrator.tracking.reader import artifact_text
from orchestrator.trial_report import TrialReport

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


def plan_dict(micro_batch: int, reductions: int, refusal: str | None = None) -> dict:
    phases = {"train": micro_batch * GiB // 8, "eval": GiB // 4}
    return {
        "micro_batch": micro_batch, "accum_steps": 64 // micro_batch, "effective_batch": 64, "eval_batch": 64,
        "activation_checkpointing": False, "precision": "fp32", "estimator": "static",
        "budget_bytes": 6 * GiB, "predicted_peak_bytes": max(phases.values()), "predicted_phase": "train",
        "predicted_phases": phases, "reductions": reductions, "note": "", "refusal": refusal,
    }


def report_for(plan: dict, epoch: int, oom_events: list[dict], training_done: bool = False) -> TrialReport:
    """A report at the end of an epoch as ``orchestrator.trial.run`` builds it (emulated device: no
    reserved/NVML), for a trial of one optimizer step per epoch; ``training_done`` at its last."""
    measured = int(plan["predicted_peak_bytes"] * 1.05)
    return TrialReport(
        epoch=epoch, step=epoch, training_done=training_done, train_loss=1.0 / max(epoch, 1), measurements={"eval_loss": 1.5 / max(epoch, 1)},
        learning_rate=0.01, steps_per_second=2.0, samples_per_second=128.0,
        plan=plan, micro_batch=plan["micro_batch"], accum_steps=plan["accum_steps"], effective_batch=64,
        eval_batch=plan["eval_batch"], activation_checkpointing=False, precision="fp32",
        plan_reductions=plan["reductions"], estimator="static", memory_source="emulated",
        peak_allocated_bytes=measured, predicted_peak_bytes=plan["predicted_peak_bytes"], predicted_phase="train",
        prediction_error=(measured - plan["predicted_peak_bytes"]) / plan["predicted_peak_bytes"],
        budget_bytes=plan["budget_bytes"], oom_retries=len(oom_events),
        oom_events=tuple(OomEvent.from_dict(e) for e in oom_events),
    )


def result_for(plan: dict, epoch: int, oom_events: list[dict], training_done: bool = False) -> dict:
    """What Tune gets from :func:`report_for`."""
    return report_for(plan, epoch, oom_events, training_done).to_metrics()


def fake_trial(config: dict) -> None:
    """Epochs of a trial, behaving as ``config["cases"][str(lr)]`` says. ``oom_at``: the first attempt
    dies there and Tune restarts it from its checkpoint with half the micro-batch. ``refuse``: report a
    refusal at epoch 0 and stop. ``gates``: {epoch: file} - wait for the file before that epoch.
    ``checkpoint_every``: epochs between checkpoints (a restored trial repeats the epochs after its last)."""

    from ray import tune

    case = config["cases"][str(config["lr"])]
    if case.get("refuse"):
        plan = plan_dict(64, 0, refusal="needs 8.0 GiB at micro-batch 1; the budget is 6.0 GiB")
        nothing_ran = {"memory_source": None, "peak_allocated_bytes": None, "prediction_error": None}
        report = replace(report_for(plan, 0, []), train_loss=float("nan"), measurements={"eval_loss": float("nan")},
                         refusal=plan["refusal"], **nothing_ran)
        tune.report(report.to_metrics())
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
            folder = tempfile.mkdtemp(dir=config["scratch"])  # the test's, not the machine's /tmp
            Path(folder, "state.json").write_text(json.dumps(state))
            checkpoint = tune.Checkpoint.from_directory(folder)
        plan = plan_dict(state["micro_batch"], state["reductions"])
        tune.report(result_for(plan, epoch, list(state["events"]), epoch == case["epochs"]), checkpoint=checkpoint)
        Path(config["scratch"], f"{tune.get_context().get_trial_id()}.reported{epoch}").touch()  # for tests to wait on


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
    return json.loads(artifact_text(client, run.info.run_id, path))


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
        trial.last_result = {**result_for(plan_dict(32, 0), epoch, []), "train_loss": train_loss}
        callback.on_trial_result(iteration=epoch, trials=[trial], trial=trial, result=trial.last_result)


def finish(callback: MlflowTracking, trial: FakeTrial) -> None:
    """Tune completes the trial that spent its budget: its last result is marked done."""
    trial.status = "TERMINATED"
    trial.last_result = {**trial.last_result, "done": True, "training_done": True}
    callback.on_trial_complete(iteration=0, trials=[trial], trial=trial)


def resume_from(state: dict, uri: str, spec, **callback_args) -> MlflowTracking:
    """A new driver restored from an earlier one's Tune state (Tune pickles it with the experiment)."""
    import pickle

    state = pickle.loads(pickle.dumps(state))
    second = pickle.loads(pickle.dumps(MlflowTracking(uri, spec, **callback_args)))
    second.set_state(state)
    second.setup()
    return second
