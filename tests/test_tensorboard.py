"""The TensorBoard files a sweep leaves in each trial's folder: Tune's, with the trial's curves."""

import glob
import os
import struct

import pytest

from orchestrator.config import parse_spec
from orchestrator.runner import run_sweep
from orchestrator.trial_report import TrialReport


def test_the_curves_are_what_moves_and_the_workloads_own_numbers():
    report = TrialReport(epoch=2, step=64, train_loss=0.5, measurements={"eval_loss": 0.7, "eval_accuracy": 0.9},
                         micro_batch=32, accum_steps=4, effective_batch=128, budget_bytes=1 << 30,
                         predicted_peak_bytes=1 << 20, peak_allocated_bytes=1 << 19, plan_reductions=0, node_name="n1",
                         plan={"micro_batch": 32}, training_done=True)
    assert report.curves() == {"epoch": 2, "step": 64, "train_loss": 0.5, "eval_loss": 0.7, "eval_accuracy": 0.9,
                               "micro_batch": 32, "accum_steps": 4, "peak_allocated_bytes": 1 << 19, "oom_retries": 0}


def scalar_tags(event_file: str) -> dict[str, list[int]]:
    """Each scalar's steps in a TensorBoard event file (TFRecord: length, its CRC, the event, its CRC)."""
    from tensorboardX.proto import event_pb2

    tags: dict[str, list[int]] = {}
    with open(event_file, "rb") as f:
        while header := f.read(12):
            (length,) = struct.unpack("<Q", header[:8])
            event = event_pb2.Event.FromString(f.read(length))
            f.read(4)
            for value in event.summary.value:
                tags.setdefault(value.tag, []).append(event.step)
    return tags


@pytest.mark.integration
@pytest.mark.usefixtures("local_ray")
def test_a_trials_event_file_plots_its_curves_at_each_report(tmp_path):
    pytest.importorskip("tensorboardX")
    spec = parse_spec({
        "experiment": "curves", "workload": {"name": "mlp", "params": {"train_samples": 256}},
        "search_space": {"lr": {"grid": [0.01]}}, "effective_batch_size": 64, "stop": {"epochs": 2},
        "resources": {"cpu": 1}, "memory": {"device": "cpu"},
    })
    outcome = run_sweep(spec, tracking_uri=f"sqlite:///{tmp_path}/mlflow.db", storage_path=str(tmp_path / "results"))
    [trial] = [p for p in glob.glob(os.path.join(outcome.experiment_path, "train_trial_*")) if os.path.isdir(p)]
    [event_file] = glob.glob(os.path.join(trial, "events.out.tfevents.*"))
    tags = scalar_tags(event_file)
    curves = {"epoch", "step", "train_loss", "eval_loss", "learning_rate", "steps_per_second", "samples_per_second",
              "micro_batch", "accum_steps", "peak_allocated_bytes", "prediction_error", "oom_retries"}
    plotted = {tag.removeprefix("ray/tune/") for tag in tags if not tag.startswith("_hparams_/")}  # Tune's summary
    assert plotted <= curves | {"eval_accuracy"}
    assert {"ray/tune/eval_loss", "ray/tune/train_loss", "ray/tune/micro_batch"} <= set(tags)
    assert tags["ray/tune/eval_loss"] == [1, 2]  # at each report, by Tune's iteration
