"""The runner's own decisions: what counts as finished, which sweep folder a run uses, and how a
driver joins a cluster."""

import dataclasses
import math
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import yaml
from ports import free_port

from orchestrator.config import parse_spec
from orchestrator.run_request import RunRequest
from orchestrator.runner import SweepOutcome, TrialRow, _experiment_name, _row, summary_lines, summary_table
from orchestrator.tracking.runs import default_tracking_uri

SPEC = parse_spec({
    "experiment": "exp", "workload": "mlp", "search_space": {"lr": {"choice": [0.1, 0.01]}},
    "effective_batch_size": 32, "stop": {"epochs": 3},
})
METRICS = {"trial_id": "abc_00000", "epoch": 3, "eval_loss": 0.5, "micro_batch": 16, "accum_steps": 2,
           "peak_allocated_bytes": 2048, "memory_source": "cpu_tensor_tracker", "oom_retries": 1}


def result(metrics, error=None):
    return SimpleNamespace(metrics=metrics, config={"workload": "mlp", "lr": 0.1, "seed": 0}, error=error, path="/x/t")


def test_a_completed_or_early_stopped_trial_is_finished():
    row = _row(result({**METRICS, "done": True}), SPEC)
    assert (row.status, row.plan, row.final_metric, row.oom_retries, row.config) == ("TERMINATED", "16 x 2", 0.5, 1, "lr=0.1")
    stopped = _row(result({**METRICS, "epoch": 1, "done": True}), SPEC)
    assert (stopped.status, stopped.stopped_early) == ("TERMINATED", True)  # ASHA stopped it
    assert not _row(result({**METRICS, "done": True, "training_done": 1}), SPEC).stopped_early


def test_an_interrupted_trial_is_not_finished_and_fails_the_sweep():
    rows = [_row(result({**METRICS, "done": True}), SPEC), _row(result({**METRICS, "epoch": 2, "done": False}), SPEC)]
    assert rows[1].status == "INTERRUPTED"
    assert not SweepOutcome(rows, "/x", "sqlite:///m.db").ok
    # The budget spent, interrupted before Tune saw it return: finished.
    assert _row(result({**METRICS, "epoch": 3, "done": False, "training_done": 1}), SPEC).status == "TERMINATED"


def test_a_trial_whose_last_report_was_a_checkpoint_s_shows_its_last_evaluation():
    """``checkpoint.every`` apart from ``eval_every``: an interrupted trial's last report may hold
    no evaluation; the table shows the last one it reported, as MLflow has it."""
    import pandas as pd

    last = {key: value for key, value in METRICS.items() if key != "eval_loss"}
    interrupted = result({**last, "epoch": 1, "done": False})
    interrupted.metrics_dataframe = pd.DataFrame({"step": [6, 10, 12, 15], "eval_loss": [0.9, None, 0.7, None]})
    assert _row(interrupted, SPEC).final_metric == 0.7
    assert _row(result({**last, "epoch": 1, "done": False}), SPEC).final_metric is None  # none reported
    # A NaN reached (on_nan: continue) is the trial's value, not a missing one.
    diverging = result({**METRICS, "eval_loss": float("nan"), "done": True})
    diverging.metrics_dataframe = pd.DataFrame({"eval_loss": [0.9, float("nan")]})
    assert math.isnan(_row(diverging, SPEC).final_metric)


def test_refused_and_errored_trials():
    # A refused trial reports the worst value (NaN) for the searcher; it trained nothing to show.
    refused = _row(result({"trial_id": "r", "epoch": 0, "refused": 1, "refusal": "needs 31 GiB", "done": True,
                           "eval_loss": float("nan")}), SPEC)
    assert refused.status == "REFUSED" and refused.note == "needs 31 GiB" and refused.plan == "-"
    assert refused.final_metric is None
    errored = _row(result({}, error=RuntimeError("ray::train()\n\x1b[36mTraceback\nValueError: bad width\n")), SPEC)
    assert errored.status == "ERROR" and errored.note == "ValueError: bad width"
    assert "REFUSED: needs 31 GiB" in summary_table([refused], SPEC)
    assert "  3/3 ep  " in summary_table([_row(result({**METRICS, "done": True}), SPEC)], SPEC)


def test_a_step_budget_shows_steps_run():
    spec = parse_spec({**SPEC.raw, "stop": {"epochs": 3, "steps": 500}})
    row = _row(result({**METRICS, "epoch": 1, "step": 500, "done": True}), spec)
    table = summary_table([row], spec)
    assert "1/3 ep, 500/500 steps" in table and "eval_loss" in table.splitlines()[0]


def test_on_several_nodes_the_table_shows_each_trials_node_and_its_moves():
    move = {"from_node": "node-b", "to_node": "node-c", "epoch": 2, "reason": "node node-b lost", "replanned": ""}
    rows = [_row(result({**METRICS, "done": True, "node_name": "head"}), SPEC),
            _row(result({**METRICS, "done": True, "node_name": "node-c", "moves": [move]}), SPEC)]
    table = summary_table(rows, SPEC)
    assert table.splitlines()[0].split()[:2] == ["trial", "node"]
    assert "node-c" in table.splitlines()[3]
    assert "TERMINATED: moved node-b->node-c after epoch 2: node node-b lost" in table
    # One node, nothing moved: no node column.
    assert "node" not in summary_table(rows[:1], SPEC).splitlines()[0]


def finished_row(index: int, loss: float, **changes) -> TrialRow:
    return TrialRow(**{"name": f"t_{index:05d}", "config": f"lr={index}", "status": "TERMINATED", "epochs": 3,
                       "steps": 3, "final_metric": loss, "plan": "32 x 1", "peak_bytes": None, "memory_source": "",
                       "oom_retries": 0, **changes})


def test_a_large_sweeps_table_lists_the_trials_to_look_at_and_says_what_it_left_out():
    """800 trials: not 800 rows but every trial that did not simply finish and the best, at least
    10 of them, in the 20 rows Tune's table shows too, in the sweep's order, and a line saying so."""
    from orchestrator.runner import BEST_ROWS, TABLE_ROWS

    rows = [finished_row(i, loss=1.0 + (i % 97) / 100) for i in range(800)]
    rows[5] = finished_row(5, loss=0.01, oom_retries=1)  # the best, but it survived an OOM: listed as one to look at
    rows[700] = finished_row(700, loss=0.02)
    rows[300] = finished_row(300, loss=float("nan"), status="ERROR", note="ValueError: bad width")
    table = summary_table(rows, SPEC)
    listed = [line.split()[0] for line in table.splitlines()[2:-1]]
    assert len(listed) == TABLE_ROWS and listed == sorted(listed)
    assert {"t_00005", "t_00300", "t_00700"} <= set(listed)  # the OOM survivor, the error, the best
    assert table.splitlines()[-1] == ("(20 of 800 trials: the 18 best by eval_loss and all 2 that did not simply "
                                      "finish; `orchestrator report` lists every trial)")
    # Hundreds of errors: some of them, and still the best, in at most TABLE_ROWS rows.
    failing = [finished_row(i, loss=float(i), status="ERROR" if i % 2 else "TERMINATED") for i in range(800)]
    table = summary_table(failing, SPEC)
    assert len(table.splitlines()) == 2 + TABLE_ROWS + 1 and "t_00000 " in table  # the best finished
    assert table.splitlines()[-1].startswith(f"(20 of 800 trials: the {BEST_ROWS} best by eval_loss and 10 of 400 that did not")
    # mode: max ranks the other way; a table of up to TABLE_ROWS trials lists every one, with no note.
    spec = parse_spec({**SPEC.raw, "mode": "max"})
    assert "t_00799 " in summary_table([finished_row(i, loss=float(i)) for i in range(800)], spec)
    assert len(summary_table(rows[:TABLE_ROWS], SPEC).splitlines()) == 2 + TABLE_ROWS


def test_the_best_trial_is_named_below_the_table(typed):
    rows = [finished_row(0, loss=0.5), finished_row(1, loss=0.25), finished_row(2, loss=float("nan")),
            finished_row(3, loss=0.1, status="ERROR")]
    lines = summary_lines(SweepOutcome(rows, "/r/exp_1", "sqlite:///m.db"), SPEC, run_args())
    assert lines[-2] == "Best: t_00001, eval_loss 0.2500 (lr=1)"
    assert not any(line.startswith("Best:") for line in summary_lines(
        SweepOutcome(rows[2:], "/r/exp_1", "sqlite:///m.db"), SPEC, run_args()))  # no finished trial has a value
    # Interrupted: a running trial may be better so far; the line says whose best it is.
    interrupted = [*rows, finished_row(4, loss=0.01, status="INTERRUPTED")]
    lines = summary_lines(SweepOutcome(interrupted, "/r/exp_1", "sqlite:///m.db"), SPEC, run_args())
    assert "Best of the finished trials: t_00001, eval_loss 0.2500 (lr=1)" in lines


def test_the_first_line_below_the_table_counts_the_trials_asha_stopped_among_the_finished(typed):
    rows = [finished_row(0, loss=0.5), dataclasses.replace(finished_row(1, loss=0.9), stopped_early=True),
            finished_row(2, loss=0.1, status="ERROR")]
    lines = summary_lines(SweepOutcome(rows, "/r/exp_1", "sqlite:///m.db"), SPEC, run_args())
    assert lines[0] == "2/3 trials finished (1 stopped early by ASHA). Results: /r/exp_1"
    lines = summary_lines(SweepOutcome(rows[:1], "/r/exp_1", "sqlite:///m.db"), SPEC, run_args())
    assert lines[0] == "1/1 trials finished. Results: /r/exp_1"


def test_a_sweep_stopped_before_tune_made_all_its_trials_counts_them_all(typed):
    """Tune makes a trial as it starts it: Ctrl-C in a sweep of 10,000 samples leaves 200 made."""
    spec = parse_spec({**SPEC.raw, "num_samples": 10_000})
    rows = [finished_row(0, loss=0.5), dataclasses.replace(finished_row(1, loss=0.9), stopped_early=True),
            *(finished_row(i, loss=0.1, status="INTERRUPTED") for i in range(2, 200))]
    lines = summary_lines(SweepOutcome(rows, "/r/exp_1", "sqlite:///m.db"), spec, run_args())
    assert lines[0] == "2/10000 trials finished (1 stopped early by ASHA; 9800 not started). Results: /r/exp_1"


def test_run_says_which_models_the_trace_could_not_run_before_ray_starts(capsys):
    """`plan` showed their static fallback's plan; the trials plan from their own device's estimate."""
    from orchestrator.runner import estimate_before_start

    spec = parse_spec({**SPEC.raw, "workload": {"name": "tests.workloads:PredictionMaskedWorkload"},
                       "search_space": {"width": {"grid": [16, 32]}}})
    estimate_before_start(spec)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("Estimated the memory of 2 distinct trial configuration(s) for a cpu device")
    assert lines[1].startswith("  tests.workloads:PredictionMaskedWorkload width=16; tests.workloads:PredictionMaskedWorkload "
                               "width=32: trace impossible (aten.nonzero")
    assert lines[1].endswith("fell back to static; their trials estimate again on their own device")


def test_each_run_gets_its_own_folder_unless_named(tmp_path):
    name, restore, named = _experiment_name(SPEC, str(tmp_path), None, resume=False)
    assert name.startswith("exp_") and restore is None and not named  # the claim may make it name_2
    assert _experiment_name(SPEC, str(tmp_path), "exp-job7", resume=False) == ("exp-job7", None, True)
    # Nothing there to resume: a named run starts its sweep under that name.
    assert _experiment_name(SPEC, str(tmp_path), "exp-job7", resume=True) == ("exp-job7", None, True)
    assert not os.listdir(tmp_path)


def test_a_resume_without_a_name_finds_the_experiments_running_sweep_and_is_refused_there(tmp_path):
    """``run CONFIG --resume`` while a sweep of the experiment runs, under a name of its own and
    before Tune saved anything: that sweep is the one meant, and its claim refuses the second
    driver (a second copy of the sweep started beside it)."""
    from orchestrator.errors import UserError
    from orchestrator.sweep_guard import claim_sweep

    folder = tmp_path / "X1"
    claim = claim_sweep(str(folder), SPEC, resuming=False, new=True)
    try:
        claim.record(SPEC, "sqlite:///mlflow.db")
        assert _experiment_name(SPEC, str(tmp_path), None, resume=True) == ("X1", None, True)
        with pytest.raises(UserError, match=f"^sweep {folder} is already running"):
            claim_sweep(str(folder), SPEC, resuming=False)
    finally:
        claim.release()
    name, restore, _ = _experiment_name(SPEC, str(tmp_path), None, resume=True)  # ended before Tune saved: a new sweep
    assert name.startswith("exp_") and restore is None


def test_a_sweep_stopped_before_tune_saved_its_state_is_started_again_not_resumed(tmp_path):
    """Stopped between the Tuner's making (its tuner.pkl) and its first step: Tune's restore would
    run one trial of no config; the resume starts the sweep instead, in its folder."""
    from ray import tune

    def trainable(config):
        pass

    tune.Tuner(trainable, run_config=tune.RunConfig(name="exp_1", storage_path=str(tmp_path)))
    assert tune.Tuner.can_restore(str(tmp_path / "exp_1"))
    assert _experiment_name(SPEC, str(tmp_path), "exp_1", resume=True) == ("exp_1", None, True)
    name, restore, _ = _experiment_name(SPEC, str(tmp_path), None, resume=True)
    assert name != "exp_1" and restore is None
    (tmp_path / "exp_1" / "experiment_state-2026-12-05_16-00-00.json").write_text("{}")  # its first save
    assert _experiment_name(SPEC, str(tmp_path), "exp_1", resume=True) == ("exp_1", str(tmp_path / "exp_1"), True)
    assert _experiment_name(SPEC, str(tmp_path), None, resume=True) == ("exp_1", str(tmp_path / "exp_1"), True)


def test_an_error_tune_could_not_store_is_shown_with_its_reason():
    """Storage unwritable mid-sweep: Tune's result has no error (it reads errors back from storage),
    but the driver's callback recorded it, so the row is ERROR with the reason, not INTERRUPTED."""
    from orchestrator.outcome import SweepRecord, sweep_run_status

    record = SweepRecord(errors={"/x/t": "PermissionError: [Errno 13] Permission denied: '/x/t/checkpoint_000002'"})
    row = _row(result({**METRICS, "epoch": 2, "done": False}), SPEC, record)
    assert row.status == "ERROR" and row.note.startswith("PermissionError: [Errno 13]")
    assert sweep_run_status([row.status, "TERMINATED"]) == "FAILED"  # the sweep's MLflow run, as `run` exits 1
    assert sweep_run_status(["TERMINATED", "INTERRUPTED"]) == "KILLED" and sweep_run_status(["TERMINATED"]) == "FINISHED"


#: How the user typed the command: the venv's script, its folder not on PATH (not activated).
TYPED = "/opt/sweeps/.venv/bin/orchestrator"


@pytest.fixture
def typed(monkeypatch):
    monkeypatch.setattr(sys, "argv", [TYPED, "run", "sweep.yaml"])


def run_args(**changes):
    return RunRequest(**{"config": "sweep.yaml", "overrides": ("stop.epochs=2",),
                         "tracking_uri": "http://127.0.0.1:5000", **changes})


def test_what_mlflow_lacks_fails_the_run_and_says_how_to_send_it(typed):
    from orchestrator.outcome import TrackingDelivery
    from orchestrator.runner import summary_lines

    rows = [_row(result({**METRICS, "done": True}), SPEC)]
    assert SweepOutcome(rows, "/r/exp_1", "sqlite:///m.db", TrackingDelivery("sqlite:///m.db")).ok
    unsent = TrackingDelivery("http://127.0.0.1:5000", unsent=18, kept_at="/r/exp_1/mlflow_unsent.pkl")
    outcome = SweepOutcome(rows, "/r/exp_1", unsent.tracking_uri, unsent)
    assert not outcome.ok
    lines = summary_lines(outcome, SPEC, run_args())
    assert "did not take 18 write(s) by the end; kept in /r/exp_1/mlflow_unsent.pkl." in lines[1]
    assert lines[2].strip() == (f"Send them once MLflow is back with: {TYPED} run sweep.yaml --set stop.epochs=2 "
                                "--tracking-uri http://127.0.0.1:5000 --name exp_1 --resume")
    dropped = TrackingDelivery("sqlite:///m.db", dropped=["LogResult(step 2 of t): Invalid metric name"])
    lines = summary_lines(SweepOutcome(rows, "/r/exp_1", "sqlite:///m.db", dropped), SPEC, run_args())
    assert not SweepOutcome(rows, "/r/exp_1", "sqlite:///m.db", dropped).ok
    assert "MLflow rejected 1 write(s)" in lines[1] and "Invalid metric name" in lines[1]


def test_an_interrupted_sweep_says_our_resume_command(typed):
    from orchestrator.runner import summary_lines

    rows = [_row(result({**METRICS, "epoch": 2, "done": False}), SPEC)]
    lines = summary_lines(SweepOutcome(rows, "/r/exp_1", "sqlite:///m.db"), SPEC, run_args(storage_path="/r"))
    assert (f"Interrupted trials continue from their last checkpoints with: {TYPED} run sweep.yaml --set "
            "stop.epochs=2 --storage-path /r --tracking-uri http://127.0.0.1:5000 --name exp_1 --resume") in lines
    # On the same resources as the interrupted run: they decide how many trials run at once.
    lines = summary_lines(SweepOutcome(rows, "/r/exp_1", "sqlite:///m.db"), SPEC, run_args(num_cpus=2, num_gpus=0.5))
    assert lines[-2].endswith("--tracking-uri http://127.0.0.1:5000 --num-cpus 2 --num-gpus 0.5 --name exp_1 --resume")


def test_the_report_command_names_the_tracking_uri_the_user_chose(typed):
    from orchestrator.runner import summary_lines

    rows = [_row(result({**METRICS, "done": True}), SPEC)]
    chosen = summary_lines(SweepOutcome(rows, "/r/exp_1", "http://127.0.0.1:5000"), SPEC, run_args())
    assert chosen[-1].endswith(f"see `{TYPED} report exp_1 --tracking-uri http://127.0.0.1:5000`")  # this sweep
    # The default, the working directory's mlflow.db, is where `report` looks by itself.
    here = default_tracking_uri()
    default = summary_lines(SweepOutcome(rows, "/r/exp_1", here), SPEC, run_args(tracking_uri=None))
    assert default[-1] == f"MLflow: {here} (experiment 'exp'); see `{TYPED} report exp_1`"
    # A resume that named no store wrote to the one its sweep recorded: the command names it.
    recorded = summary_lines(SweepOutcome(rows, "/r/exp_1", "sqlite:////w/other.db"), SPEC, run_args(tracking_uri=None))
    assert recorded[-1].endswith(f"see `{TYPED} report exp_1 --tracking-uri sqlite:////w/other.db`")


def test_a_resume_writes_to_the_store_its_sweep_recorded_unless_told_another(tmp_path, monkeypatch):
    """Tune restores the sweep's MLflow callback: a resume that names no store writes (and
    checks, and prints) the one the sweep recorded, although the config's relative SQLite path
    or the default would name another file from another folder."""
    from orchestrator.runner import resolve_tracking_uri
    from orchestrator.sweep_guard import claim_sweep, recorded_tracking_store

    monkeypatch.chdir(tmp_path)
    relative = dataclasses.replace(SPEC, tracking_uri="sqlite:///records.db")
    folder = str(tmp_path / "exp_1")
    assert resolve_tracking_uri(None, relative) == f"sqlite:///{tmp_path / 'records.db'}"  # made absolute
    claim = claim_sweep(folder, relative, resuming=False, new=True)
    claim.record(relative, "sqlite:////w/records.db")  # started from /w
    claim.release()
    recorded = recorded_tracking_store(folder)
    assert resolve_tracking_uri(None, relative, recorded) == "sqlite:////w/records.db"
    assert resolve_tracking_uri(None, SPEC, recorded) == "sqlite:////w/records.db"
    assert resolve_tracking_uri("http://mlflow:5000", relative, recorded) == "http://mlflow:5000"  # told another
    assert resolve_tracking_uri(None, SPEC) == default_tracking_uri()  # a new sweep
    # A sweep started before stores were kept: none recorded.
    assert recorded_tracking_store(str(tmp_path / "older")) is None


@pytest.mark.integration
def test_a_model_whose_estimate_fails_stops_the_sweep_and_the_ray_started_for_it(tmp_path):
    """The driver estimates while Ray starts; a model whose loss fails (it builds: the pre-flight
    passes it) ends the sweep in the estimate's one line, before any trial, and the Ray it started
    is shut down again."""
    import ray

    from orchestrator.errors import UserError
    from orchestrator.runner import run_sweep

    spec = parse_spec({
        "experiment": "broken", "workload": {"name": "tests.workloads:BuggyWorkload"},
        "search_space": {"lr": 0.01}, "effective_batch_size": 32, "stop": {"epochs": 1}, "resources": {"cpu": 1},
    })
    with pytest.raises(UserError, match=r"the trace estimate failed \(ValueError: mat1 and mat2 shapes cannot be "
                                        r"multiplied .*\); fix the workload: its trials would fail the same way$"):
        run_sweep(spec, tracking_uri=f"sqlite:///{tmp_path}/mlflow.db", storage_path=str(tmp_path / "results"),
                  num_cpus=1)
    assert not ray.is_initialized()


LOSS_AND_METRICS = """
import torch.nn.functional as F

from trainables.mlp import MLPWorkload


class LossAndMetrics(MLPWorkload):
    def loss(self, model, batch):
        x, y = batch
        logits = model(x)
        return F.cross_entropy(logits, y), {"accuracy": (logits.argmax(-1) == y).float().mean()}
"""


@pytest.mark.integration  # the estimate runs while the command's Ray starts
def test_the_installed_run_refuses_a_loss_that_is_not_one_number_before_any_trial(tmp_path):
    """A ``(loss, metrics)`` tuple, a common training step's answer, fails every trial at its first
    step: ``orchestrator run`` from the user's folder says so in one line naming the loss and the
    fix, exit 2, before any trial, and leaves no results folder or MLflow database behind."""
    from tests.conftest import command_env, installed_command

    (tmp_path / "my_models").mkdir()
    (tmp_path / "my_models" / "__init__.py").write_text("")
    (tmp_path / "my_models" / "tuple_loss.py").write_text(LOSS_AND_METRICS.lstrip())
    (tmp_path / "sweep.yaml").write_text(
        "experiment: tuple_loss\nworkload: {name: 'my_models.tuple_loss:LossAndMetrics'}\n"
        "search_space: {lr: {grid: [0.01, 0.1]}}\neffective_batch_size: 32\nstop: {epochs: 1}\nresources: {cpu: 1}\n"
    )
    done = subprocess.run([installed_command(), "run", "sweep.yaml"], cwd=tmp_path, env=command_env(),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr == (
        "error: workload my_models.tuple_loss:LossAndMetrics: the trace estimate failed (LossTypeError: "
        "LossAndMetrics.loss (my_models/tuple_loss.py:7) returned a tuple of 2; expected the batch's mean loss as a "
        "one-element tensor: return the loss alone (numbers to report go in eval_metrics)); fix the workload: its "
        "trials would fail the same way\n"
    )
    assert "started" not in done.stdout
    assert not (tmp_path / "orchestrator_results").exists() and not (tmp_path / "mlflow.db").exists()


@pytest.mark.integration
def test_the_embedded_ray_starts_its_workers_with_the_allocator_backend_set(ray_temp_dir, monkeypatch):
    """``backend:cudaMallocAsync`` set by a trial after ``import torch`` fails its first CUDA call
    (pytorch#104801): the embedded Ray's workers have it in their environment from the start."""
    import ray

    from orchestrator.runner import _init_ray

    monkeypatch.setenv("RAY_TMPDIR", str(ray_temp_dir("allocator_backend")))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert _init_ray(None, 1, 0, False, "127.0.0.1", worker_env={"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"})
    try:
        read = ray.remote(lambda: os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))
        assert ray.get(read.remote(), timeout=120) == "backend:cudaMallocAsync"
    finally:
        ray.shutdown()


def test_a_ctrl_c_while_ray_starts_is_taken_once_the_start_has_ended(default_sigint):
    """The start (here a function that gets the Ctrl-C halfway, and starts no Ray) runs to its end,
    the estimate made beside it too, and then the command stops: a ``KeyboardInterrupt`` inside
    ``ray.init`` can leave logging's lock taken, and the command hanging (``stop_signal.ctrl_c_held``)."""
    import signal

    from orchestrator.runner import _estimate_while_ray_starts

    started = []

    def connect():
        signal.raise_signal(signal.SIGINT)
        started.append("Ray up")
        return False

    with pytest.raises(KeyboardInterrupt):
        _estimate_while_ray_starts(SPEC, connect)
    assert started == ["Ray up"]


def test_a_ctrl_c_while_ray_starts_stops_further_estimates_at_once(default_sigint, monkeypatch):
    """The estimates are told to start no new one as the held Ctrl-C comes, not once Ray's start
    has ended: a start slowed by a busy machine outlasted an estimate, and the next one began."""
    import signal
    import threading

    import orchestrator.runner as runner

    given, stop_when_held = {}, []
    asked = threading.Event()

    def estimate_before_start(spec, stop):
        given["stop"] = stop
        asked.set()
        return {}

    def connect():
        assert asked.wait(30)
        signal.raise_signal(signal.SIGINT)
        stop_when_held.append(given["stop"].is_set())
        return False

    monkeypatch.setattr(runner, "estimate_before_start", estimate_before_start)
    with pytest.raises(KeyboardInterrupt):
        runner._estimate_while_ray_starts(SPEC, connect)
    assert stop_when_held == [True]


def test_a_ctrl_c_that_ends_a_started_sweep_carries_its_name():
    """From the sweep's start on (a second Ctrl-C in Tune, or one in Ray's shutdown after Tune's
    graceful stop returned); before it, a Ctrl-C is what it was (``InterruptedBeforeStart``)."""
    from orchestrator.runner import InterruptedBeforeStart, StoppedAtOnce, _StopsAtOnce

    with pytest.raises(InterruptedBeforeStart), _StopsAtOnce():
        raise InterruptedBeforeStart
    with pytest.raises(StoppedAtOnce) as stopped, _StopsAtOnce() as stopping:
        stopping.started("exp_1")
        raise KeyboardInterrupt
    assert stopped.value.name == "exp_1" and isinstance(stopped.value, KeyboardInterrupt)  # still exit 130
    with pytest.raises(ValueError), _StopsAtOnce() as stopping:
        stopping.started("exp_1")
        raise ValueError("not a stop")


IDLE_WORKERS_SEEN = """
import os, sys, time, ray
from orchestrator.runner import _connect_ray

def idle_workers():  # this Ray's: the processes that inherited this one's mark
    found = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                named = f.read().startswith(b"ray::IDLE")
            with open(f"/proc/{pid}/environ", "rb") as f:
                found += named and f"IDLE_MARK={os.environ['IDLE_MARK']}".encode() in f.read().split(b"\\0")
        except OSError:
            pass
    return found

if sys.argv[1] == "stock":
    ray.init(address="local", num_cpus=2, include_dashboard=False)
else:
    _connect_ray(None, 2, 0, False, "127.0.0.1")
started, most = time.monotonic(), 0
while time.monotonic() - started < float(sys.argv[2]) and not (sys.argv[1] == "stock" and most):
    most = max(most, idle_workers())
    time.sleep(0.2)
print(most, round(time.monotonic() - started, 1))
ray.shutdown()
"""


@pytest.mark.integration
def test_the_ray_a_sweep_starts_prestarts_no_idle_worker(tmp_path):
    """A stock local Ray prestarts idle workers for its first driver, which no trial runs in
    (``ray_internals.LOCAL_RAY_SYSTEM_CONFIG``: why); the one ``run`` starts has none, watched
    for twice as long as the stock one took to show its first (5 s at least)."""
    def most_idle(kind: str, watch_s: float) -> tuple[int, float]:
        env = {**os.environ, "IDLE_MARK": f"{os.getpid()}-{kind}"}
        proc = subprocess.run([sys.executable, "-c", IDLE_WORKERS_SEEN, kind, str(watch_s)], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=180)
        assert proc.returncode == 0, proc.stderr[-3000:]
        most, seconds = proc.stdout.split()
        return int(most), float(seconds)

    stock, took = most_idle("stock", 60)
    assert stock >= 1, "a stock Ray showed no idle worker in 60 s: this test cannot see them"
    assert most_idle("ours", max(5.0, 2 * took))[0] == 0


@pytest.mark.integration
def test_a_driver_joins_a_token_cluster_from_a_users_shell_or_says_in_a_line_why_not(ray_head, tmp_path):
    """`ray start --head` turns token authentication on. A user's shell has the token
    (~/.ray/auth_token) but not RAY_AUTH_MODE=token, without which Ray's client sends none: the
    driver retried for 20 s and ended in a traceback. An address where nothing listens made Ray
    wait for minutes."""
    from tests.conftest import command_env, installed_command

    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump({
        "experiment": "joined", "workload": "mlp", "search_space": {"lr": {"grid": [0.01, 0.1]}},
        "effective_batch_size": 32, "stop": {"epochs": 1}, "resources": {"cpu": 1},
    }))
    results = tmp_path / "results"

    def run(address: str, **env: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [installed_command(), "run", "sweep.yaml", "--ray-address", address, "--storage-path", str(results),
             "--tracking-uri", f"sqlite:///{tmp_path}/mlflow.db"],
            cwd=tmp_path, env={**command_env(), **env}, capture_output=True, text=True, timeout=300, check=False)

    joined = run(ray_head.gcs_address)
    assert joined.returncode == 0, joined.stdout[-3000:] + joined.stderr[-3000:]
    assert "Ray: 1 node(s), 2 CPUs" in joined.stdout and "2/2 trials finished" in joined.stdout
    [sweep] = list(results.iterdir())

    port = free_port()
    nobody = run(f"127.0.0.1:{port}")
    assert nobody.returncode == 2
    assert nobody.stderr.splitlines() == [
        f"error: --ray-address 127.0.0.1:{port}: nothing answers there (Connection refused); give the head's HOST:PORT, "
        "as `ray start --head` prints it, and check the head is up (`ray status`)"]

    (tmp_path / "empty-home").mkdir()
    no_token = run(ray_head.gcs_address, HOME=str(tmp_path / "empty-home"))
    assert no_token.returncode == 2 and "Traceback" not in no_token.stderr
    assert len(no_token.stderr.splitlines()) == 1, no_token.stderr  # not Ray's native client's every try first
    assert no_token.stderr.splitlines()[-1] == (
        f"error: --ray-address {ray_head.gcs_address}: the cluster needs a token and none was found. Put the "
        "cluster's token (`ray get-auth-token` where it was started) in RAY_AUTH_TOKEN, the file named by "
        "RAY_AUTH_TOKEN_PATH, or ~/.ray/auth_token")
    assert list(results.iterdir()) == [sweep]  # the refused runs left no sweep folder


@pytest.mark.parametrize("on_nan, ok", [("stop", True), ("fail", False)])
def test_a_diverged_trial_says_where_and_counts_as_on_nan_says(on_nan, ok):
    line = "loss not finite at step 5 (epoch 1); last finite loss 0.4123; not retried (on_nan: stop)"
    metrics = {**METRICS, "epoch": 0, "step": 5, "eval_loss": float("inf"), "diverged": line,
               "diverged_at_step": 5, "training_done": 1, "done": True}
    rows = [_row(result(metrics), SPEC), _row(result({**METRICS, "done": True}), SPEC)]
    assert (rows[0].status, rows[0].note, rows[0].final_metric) == ("DIVERGED", line, None)
    assert f"DIVERGED: {line}" in summary_table(rows, SPEC)
    trained_on = _row(result({**METRICS, "eval_loss": float("nan"), "done": True}), SPEC)  # on_nan: continue
    assert trained_on.status == "TERMINATED" and " nan " in summary_table([trained_on], SPEC)
    outcome = SweepOutcome(rows, "/x", "sqlite:///m.db", on_nan=on_nan)
    assert outcome.ok is ok
    request = RunRequest(config="sweep.yaml")
    assert summary_lines(outcome, SPEC, request)[0].startswith(f"{2 if ok else 1}/2 trials finished")
