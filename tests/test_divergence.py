"""Divergence (``trainables.divergence``): the watch keeps the first non-finite step without
reading the device, and a sweep whose loss turns NaN ends that trial as DIVERGED at its step, in
one line, through the installed command: the exit status ``on_nan`` says, the worst metric value
for the searcher and the scheduler, and MLflow's record of it."""

import math

import pytest
import torch

from trainables.divergence import NonFiniteWatch


def test_the_watch_keeps_the_first_bad_step_and_the_last_finite_loss_before_it():
    watch = NonFiniteWatch(torch.device("cpu"))
    assert watch.reads_free and watch.found() is None
    for step, loss in enumerate([0.9, 0.7, float("inf"), float("nan"), 0.5], 1):
        watch.observe(step, 1 + step // 4, torch.tensor(loss))
    found = watch.found()
    assert (found.step, found.epoch, found.what, found.last_finite_loss) == (3, 1, "loss", pytest.approx(0.7))
    assert found.describe() == "loss not finite at step 3 (epoch 1); last finite loss 0.7"


def test_a_first_step_that_diverges_has_no_last_finite_loss():
    watch = NonFiniteWatch(torch.device("cpu"))
    watch.observe(1, 1, torch.tensor(float("nan")))
    assert watch.found().describe() == "loss not finite at step 1 (epoch 1); last finite loss none"
    assert NonFiniteWatch(torch.device("meta")).reads_free is False  # an accelerator: read at milestones


@pytest.mark.parametrize("losses, norms", [
    ([0.9, 0.7, float("nan"), 0.5], [1.0, 2.0, 3.0, 4.0]),
    ([0.9, 0.7, 0.6, float("inf")], [1.0, float("inf"), float("nan"), 4.0]),
    ([0.9, 0.8], [1.0, 2.0]),
], ids=["loss", "gradient norm", "none"])
def test_reading_at_once_finds_what_the_queued_watch_finds(losses, norms):
    """On the CPU the watch reads each step (free there); on a GPU it queues tensor ops: the same answer."""
    read, queued = NonFiniteWatch(torch.device("cpu")), NonFiniteWatch(torch.device("cpu"))
    queued.reads_free = False  # as on a GPU
    for step, (loss, norm) in enumerate(zip(losses, norms), 1):
        for watch in (read, queued):
            watch.observe(step, 1, torch.tensor(loss), torch.tensor(norm))
    assert read.found() == queued.found()


UNSTABLE = '''
import dataclasses

from trainables.mlp import MLPWorkload


@dataclasses.dataclass
class Unstable(MLPWorkload):
    """Its loss is NaN from optimizer step ``nan_at_step`` on (0: never); with ``infinite_gradient``
    the loss stays finite and its gradient is infinite instead."""

    nan_at_step: int = 0
    infinite_gradient: bool = False

    def build_optimizer(self, model):
        optimizer = super().build_optimizer(model)
        self.steps_done = 0
        optimizer.register_step_post_hook(lambda *_: setattr(self, "steps_done", self.steps_done + 1))
        return optimizer

    def loss(self, model, batch):
        loss = super().loss(model, batch)
        bad = model.training and self.nan_at_step and getattr(self, "steps_done", 0) + 1 >= self.nan_at_step
        if bad and self.infinite_gradient:
            weight = next(model.parameters())
            return loss + (weight - weight.detach()).sqrt().sum()  # 0, with an infinite derivative
        return loss * float("nan") if bad else loss
'''

SWEEP = """
experiment: unstable
workload: {name: "my_models.unstable:Unstable", params: {depth: 1, width: 16, train_samples: 512, eval_samples: 64}}
search_space:
  nan_at_step: {grid: [0, 5]}
effective_batch_size: 64
stop: {epochs: 2}
memory: {estimator: static}
"""


def user_folder(tmp_path):
    """The user's model package and sweep file, in a folder outside the repository."""
    (tmp_path / "my_models").mkdir()
    (tmp_path / "my_models" / "__init__.py").write_text("")
    (tmp_path / "my_models" / "unstable.py").write_text(UNSTABLE)
    (tmp_path / "sweep.yaml").write_text(SWEEP)


def run_in_user_folder(tmp_path, *overrides: str):
    """``orchestrator run sweep.yaml`` with each ``--set`` override, installed, from the user's
    folder (made here): the finished process, and all it printed."""
    import subprocess

    from tests.conftest import command_env, installed_command

    user_folder(tmp_path)
    done = subprocess.run([installed_command(), "run", "sweep.yaml", "--num-cpus", "1",
                           *(word for override in overrides for word in ("--set", override))],
                          cwd=tmp_path, env=command_env(), capture_output=True, text=True, timeout=600, check=False)
    return done, done.stdout + done.stderr


@pytest.mark.integration
def test_a_loss_that_turns_nan_ends_its_trial_as_diverged_in_one_line(tmp_path):
    """The installed command, from the user's folder, with the default ``on_nan: stop``: exit 0
    (a diverged trial counts as finished), one console line naming the step and the last finite
    loss, the table's DIVERGED row with the last evaluation the trial reached, the worst eval_loss
    reported to Tune (for the searcher and ASHA) and not to MLflow, MLflow's tag, step metric and
    statuses, and ``report`` showing the row as ``run`` did. The loss turns NaN at step 12, in
    the second epoch of 8 steps, after the first epoch's evaluation."""
    import re
    import subprocess

    import mlflow

    from tests.conftest import command_env, installed_command, trial_results

    done, console = run_in_user_folder(tmp_path, "search_space.nan_at_step={grid: [0, 12]}")
    assert done.returncode == 0, console[-3000:]
    assert "Traceback" not in console and "NaN or Inf found" not in console, console[-3000:]
    said = [line for line in done.stdout.splitlines() if " diverged: " in line]
    assert len(said) == 1, console[-3000:]
    assert re.fullmatch(r"\S+ diverged: loss not finite at step 12 \(epoch 2\); last finite loss \d\.\d+; "
                        r"not retried \(on_nan: stop\)", said[0]), said
    [row] = [line for line in done.stdout.splitlines() if "DIVERGED: " in line]
    assert "nan_at_step=12" in row and "loss not finite at step 12" in row
    assert "2/2 trials finished" in done.stdout

    results = trial_results(str(tmp_path / "orchestrator_results" / "unstable_*" / "*" / "result.json"))
    last = {reports[-1].get("diverged_at_step"): reports for reports in results.values()}
    assert last[12][-1]["eval_loss"] == math.inf and last[12][-1]["step"] == 12  # the worst, for the searcher and ASHA
    assert last[12][-1]["peak_allocated_bytes"] > 0  # its steps since the first epoch's report, measured
    reached = last[12][-2]["eval_loss"]  # the first epoch's evaluation
    assert last[None][-1]["step"] == 16 and math.isfinite(last[None][-1]["eval_loss"]) and math.isfinite(reached)

    client = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    experiment = client.get_experiment_by_name("unstable")
    runs = client.search_runs([experiment.experiment_id])
    [sweep_run] = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    [diverged] = [r for r in runs if "diverged" in r.data.tags]
    assert sweep_run.info.status == "FINISHED" and diverged.info.status == "FINISHED"
    assert diverged.data.tags["diverged"].startswith("loss not finite at step 12 (epoch 2); last finite loss ")
    assert [(m.step, m.value) for m in client.get_metric_history(diverged.info.run_id, "diverged_at_step")] == [(12, 12.0)]
    assert [(m.step, m.value) for m in client.get_metric_history(diverged.info.run_id, "eval_loss")] == [(8, reached)]

    # `orchestrator report` reads it back from MLflow: DIVERGED, with the row `run` printed.
    shown = subprocess.run([installed_command(), "report", "unstable", "--out", str(tmp_path / "report")], cwd=tmp_path,
                           env=command_env(), capture_output=True, text=True, timeout=300, check=False)
    assert shown.returncode == 0, shown.stderr[-3000:]
    trial = diverged.data.tags["trial_id"]
    [line, why] = [line for line in shown.stdout.splitlines() if line.startswith(trial + " ")]  # its row, then why
    assert line.split()[1] == "DIVERGED" and line.split()[-1] == f"{reached:.4f}" and f" {reached:.4f} " in row, (line, row)
    measured = re.split(r"\s{2,}", line)[5]  # trial, status, trained, plan, predicted peak, measured peak, ...
    assert measured != "-" and f" {measured} (" in row, (line, row)  # the peak of run's table, not its last report's "-"
    assert "Trials: 2 (1 diverged, 1 finished)" in shown.stdout and "OOMs survived: 0 (in 0 of 1 finished trials)" in shown.stdout
    assert why == f"{trial} diverged: {diverged.data.tags['diverged']}", shown.stdout


@pytest.mark.integration
def test_on_nan_fail_counts_a_diverged_trial_as_an_errored_one(tmp_path):
    """Exit 1, the trial not finished, its MLflow run and the sweep's FAILED; still not retried."""
    import mlflow

    done, console = run_in_user_folder(tmp_path, "on_nan=fail", "search_space.nan_at_step=5")
    assert done.returncode == 1, console[-3000:]
    assert "Traceback" not in console and " restarted: " not in console, console[-3000:]
    [row] = [line for line in done.stdout.splitlines() if "DIVERGED: " in line]
    assert row.endswith("; not retried (on_nan: fail)") and "0/1 trials finished" in done.stdout
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("unstable").experiment_id])
    assert sorted(r.info.status for r in runs) == ["FAILED", "FAILED"] and len(runs) == 2


@pytest.mark.integration
def test_on_nan_continue_trains_through_a_nan_loss_to_the_end(tmp_path):
    """The watch is off: the trial trains on to its budget and ends TERMINATED, exit 0, nothing
    said about a divergence; the NaN losses are what Tune and MLflow get."""
    import mlflow

    from tests.conftest import trial_results

    done, console = run_in_user_folder(tmp_path, "on_nan=continue", "search_space.nan_at_step=5")
    assert done.returncode == 0, console[-3000:]
    assert "Traceback" not in console and "diverged" not in console and "DIVERGED" not in console, console[-3000:]
    [row] = [line for line in done.stdout.splitlines() if "nan_at_step=5" in line and "TERMINATED" in line]
    assert "2/2 ep" in row and " nan " in row and "1/1 trials finished" in done.stdout, console[-3000:]  # what it reached

    [reports] = trial_results(str(tmp_path / "orchestrator_results" / "unstable_*" / "*" / "result.json")).values()
    assert [r["step"] for r in reports] == [8, 16] and all(math.isnan(r["eval_loss"]) for r in reports)
    assert "diverged_at_step" not in reports[-1]

    client = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("unstable").experiment_id])
    assert sorted(r.info.status for r in runs) == ["FINISHED", "FINISHED"] and len(runs) == 2
    [trial] = [r for r in runs if r.data.tags.get("orchestrator.role") == "trial"]
    assert "diverged" not in trial.data.tags and math.isnan(trial.data.metrics["eval_loss"])


@pytest.mark.integration
def test_an_infinite_gradient_norm_that_clipping_computes_ends_its_trial_as_diverged(tmp_path):
    """With ``max_grad_norm`` the loop computes the gradient norm anyway: an infinite one ends the
    trial at its step, in one line that names it, though the loss is finite."""
    import re

    done, console = run_in_user_folder(tmp_path, "max_grad_norm=1", "search_space.nan_at_step=5",
                                       "workload.params.infinite_gradient=true")
    assert done.returncode == 0, console[-3000:]
    assert "Traceback" not in console, console[-3000:]
    [said] = [line for line in done.stdout.splitlines() if " diverged: " in line]
    assert re.fullmatch(r"\S+ diverged: gradient norm not finite at step 5 \(epoch 1\); last finite loss \d\.\d+; "
                        r"not retried \(on_nan: stop\)", said), said
    assert "1/1 trials finished" in done.stdout and "DIVERGED: gradient norm not finite at step 5" in done.stdout
