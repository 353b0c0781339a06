"""What ``orchestrator run`` prints while a sweep runs (``orchestrator/console.py``).

The lines are checked on synthetic reports and events; the demo sweeps run through the installed
command, piped as a user pipes them into a file, from a folder outside the repository.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import os
import pickle
import re
import signal
import subprocess
import sys
from types import SimpleNamespace

import pytest

from orchestrator.console import (
    Failed,
    Finished,
    LiveView,
    Moved,
    OomSurvived,
    Planned,
    Progress,
    Refused,
    Seen,
    Started,
    StopNotice,
    StorageFault,
    cluster_text,
    config_text,
    finished_event,
    format_event,
    format_progress,
    plan_text,
    report_events,
    trial_fraction,
    tune_lines_told_here,
)
from orchestrator.contract import Move, OomEvent
from orchestrator.trial_report import TrialReport
from tests.conftest import ROOT, command_env, installed_command, lines_until

TRAIN_OOM = OomEvent("train", 1, 1, micro_batch=128, eval_batch=128, bytes_requested=2**20, bytes_allocated=7 * 2**20,
                     bytes_reserved=None, message="emulated device out of memory",
                     action="micro-batch 128->64 (accumulation 1->2)", predicted_peak_bytes=6 * 2**20)
EVAL_OOM = OomEvent("eval", 1, 8, micro_batch=64, eval_batch=128, bytes_requested=None, bytes_allocated=2**20,
                    bytes_reserved=None, message="out of memory", action="eval batch 128->64", eval_batch_number=1)
PLANNED = TrialReport(micro_batch=64, accum_steps=2, effective_batch=128, estimator="trace",
                      predicted_peak_bytes=5 * 2**20, predicted_phase="train")


def test_each_event_is_one_line_naming_the_trial():
    lines = [
        format_event(Started("a_00000", "workload=mlp, lr=0.003")),
        format_event(Planned("a_00000", "64 x 1", "estimated peak 39.2 KiB in train (trace)")),
        format_event(OomSurvived("a_00000", TRAIN_OOM, "64 x 2")),
        format_event(OomSurvived("a_00000", EVAL_OOM)),
        format_event(Moved("a_00000", Move("node-b", "head", 2, "node node-b lost"))),
        format_event(Finished("a_00000", "3/3 epochs", "eval_loss 0.4609", "peak 36.0 KiB (tensor bytes)")),
        format_event(Refused("a_00001", "micro-batch 1 needs 9.0 GiB, the budget is 8.0 GiB")),
        format_event(Failed("a_00002", "ValueError: " + "x" * 300, "/r/t/error.txt")),
        format_event(Failed("a_00003", "RayActorError: the actor died", retrying="retrying from its last checkpoint")),
    ]
    assert lines[:2] == [
        "a_00000 started: workload=mlp, lr=0.003",
        "a_00000 plan: micro-batch x accumulation 64 x 1, estimated peak 39.2 KiB in train (trace)",
    ]
    # An OOM says its phase, step and epoch (from 1), and the plan it resumed with.
    assert lines[2] == ("a_00000 OOM in train step 1 (epoch 1) at micro-batch 128: resumed with micro-batch 128->64 "
                        "(accumulation 1->2), plan 64 x 2")
    assert lines[3] == "a_00000 OOM in eval after step 8 (epoch 1), batch 1 of 128 samples: resumed with eval batch 128->64"
    assert lines[4] == "a_00000 moved node-b->head after epoch 2: node node-b lost"
    assert lines[5] == "a_00000 finished: 3/3 epochs, eval_loss 0.4609, peak 36.0 KiB (tensor bytes)"
    assert lines[6] == "a_00001 refused: micro-batch 1 needs 9.0 GiB, the budget is 8.0 GiB"
    assert lines[7] == f"a_00002 failed: ValueError: {'x' * 300} (traceback: /r/t/error.txt)"  # the reason in full
    assert lines[8] == "a_00003 failed, retrying from its last checkpoint: RayActorError: the actor died"
    assert all("\n" not in line and "\x1b" not in line for line in lines)
    # A trial that gave up on OOMs: its events below the line, as its error lists them.
    gave_up = Failed("t", "OomRetriesExhausted: out of memory in train; 2 OOM event(s):\n  epoch 1 train step 1: ...", "e.txt")
    assert format_event(gave_up) == ("t failed: OomRetriesExhausted: out of memory in train; 2 OOM event(s): (traceback: e.txt)\n"
                                     "  epoch 1 train step 1: ...")


def test_ray_s_resources_are_one_line_as_they_reached_ray():
    nodes = [{"CPU": 2.0, "GPU": 2.0, "memory": 1e9}, {"CPU": 4.0, "node:10.0.0.2": 1.0}]
    assert cluster_text(nodes) == "Ray: 2 node(s), 6 CPUs, 2 GPUs"
    assert cluster_text([{"CPU": 1.0}]) == "Ray: 1 node(s), 1 CPUs, 0 GPUs"


def test_a_report_tells_the_plan_once_and_each_oom_and_move_once():
    seen = Seen()
    first = dataclasses.replace(PLANNED, oom_events=(TRAIN_OOM,))
    events = report_events("t", first, seen)
    # The plan it started with (before the OOM in the same report) and that plan's estimate, then
    # the OOM with the plan now.
    assert [format_event(e) for e in events] == [
        "t plan: micro-batch x accumulation 128 x 1, estimated peak 6.0 MiB (trace)",
        ("t OOM in train step 1 (epoch 1) at micro-batch 128: resumed with micro-batch 128->64 (accumulation 1->2), "
         "plan 64 x 2"),
    ]
    assert report_events("t", first, seen) == []  # the next report of the same events adds nothing
    move = Move("node-b", "node-c", 1, "node node-b lost")
    later = dataclasses.replace(first, oom_events=(TRAIN_OOM, EVAL_OOM), moves=(move,))
    assert report_events("t", later, seen) == [OomSurvived("t", EVAL_OOM, "64 x 2"), Moved("t", move)]
    # As Tune hands it over: the report's flat form, read back.
    assert report_events("t", TrialReport.from_result(later.to_metrics()), Seen())[1:] == [
        OomSurvived("t", TRAIN_OOM), OomSurvived("t", EVAL_OOM, "64 x 2"), Moved("t", move)]


def test_a_plan_that_lowered_the_precision_or_checkpoints_says_so_in_its_line():
    """The planner turns them on where not even micro-batch 1 fits otherwise: the line a user
    reads says so, not only ``report``'s table. fp32 without checkpointing goes unsaid."""
    lowered = dataclasses.replace(PLANNED, micro_batch=1, accum_steps=128, precision="bf16", activation_checkpointing=True)
    assert format_event(report_events("t", lowered, Seen())[0]) == (
        "t plan: micro-batch x accumulation 1 x 128, bf16, activation checkpointing, estimated peak 5.0 MiB in train (trace)")
    full = dataclasses.replace(PLANNED, precision="fp32", activation_checkpointing=False)
    assert format_event(report_events("t", full, Seen())[0]) == (
        "t plan: micro-batch x accumulation 64 x 2, estimated peak 5.0 MiB in train (trace)")


def test_the_plan_before_an_oom_keeps_the_accumulation_that_covers_the_effective_batch():
    """54 x 2 covers 100 samples (54 + 46); 54 x 1 would not."""
    oom = dataclasses.replace(TRAIN_OOM, micro_batch=54, action="micro-batch 54->27 (accumulation 2->4)")
    report = dataclasses.replace(PLANNED, micro_batch=27, accum_steps=4, effective_batch=100, oom_events=(oom,))
    planned = report_events("t", report, Seen())[0]
    assert format_event(planned) == "t plan: micro-batch x accumulation 54 x 2 (last 46), estimated peak 6.0 MiB (trace)"


def test_a_plan_the_verification_changed_is_told_once_with_the_plan_it_started_with_and_its_estimate():
    from orchestrator.contract import PlanCheck

    grown = PlanCheck("train", 1, 2, 1000, 800, 2000, "64 x 2 (eval 128, fp32)", "128 x 1 (eval 128, fp32)")
    kept = PlanCheck("train", 1, 4, 1600, 1600, 2000, "128 x 1 (eval 128, fp32)", "128 x 1 (eval 128, fp32)")
    seen = Seen()
    events = report_events("t", dataclasses.replace(PLANNED, plan_checks=(grown, kept)), seen)
    assert [format_event(e) for e in events] == [
        "t plan: micro-batch x accumulation 64 x 2, estimated peak 1000 B in train (trace)",  # that plan's, as checked
        ("t plan verified on the device: train after step 2 (epoch 1): measured 800 B, predicted 1000 B (-20%), "
         "limit 2.0 KiB; plan 64 x 2 (eval 128, fp32) -> 128 x 1 (eval 128, fp32)"),
    ]  # a check that kept the plan is MLflow's, not a line
    assert report_events("t", dataclasses.replace(PLANNED, plan_checks=(grown, kept)), seen) == []
    # A check that kept the plan: the plan line is the plan's own, its peak in its worst phase.
    [planned] = report_events("t", dataclasses.replace(PLANNED, plan_checks=(kept,)), Seen())
    assert format_event(planned) == "t plan: micro-batch x accumulation 64 x 2, estimated peak 5.0 MiB in train (trace)"


def test_the_plan_of_a_compiled_model_says_it_is_the_eager_modules_estimate():
    compiled = dataclasses.replace(PLANNED, plan={"compiled": True})
    [event] = report_events("t", TrialReport.from_result(compiled.to_metrics()), Seen())
    assert format_event(event) == ("t plan: micro-batch x accumulation 64 x 2, estimated peak 5.0 MiB in train "
                                   "(trace, of the compiled model's eager modules)")


def test_a_refused_trial_says_why_instead_of_a_plan():
    result = TrialReport(refusal="micro-batch 1 needs 9.0 GiB", micro_batch=0, accum_steps=0)
    assert report_events("t", result, Seen()) == [Refused("t", "micro-batch 1 needs 9.0 GiB")]
    assert finished_event("t", result, "eval_loss", 3) == Refused("t", "micro-batch 1 needs 9.0 GiB")


#: A refused trial's last report as a trial makes it: the plan it tried (micro-batch 1 at the
#: sweep's effective batch) and the worst value of the metric, told to the searcher.
REFUSED = TrialReport(refusal="micro-batch 1 needs 18.7KiB, budget 1.0KiB", micro_batch=1, accum_steps=64,
                      effective_batch=64, measurements={"eval_loss": float("nan")}, done=True)


def test_a_refused_trial_has_no_plan():
    """It trained nothing: the micro-batch it tried is no plan (the table's cell is ``-``)."""
    assert plan_text(REFUSED) == "-"
    assert plan_text(PLANNED) == "64 x 2"


def test_a_resumed_trial_says_where_it_had_got_to_and_tells_only_its_new_events(monkeypatch):
    """``--resume``: the run that started the sweep told its plan and OOMs; the resumed one does
    not tell them again as if they had just happened."""
    log = io.StringIO()
    monkeypatch.setattr(sys, "stdout", log)
    view = LiveView(["lr"], "eval_loss", 3, None)
    before = dataclasses.replace(PLANNED, epoch=1, step=18, oom_events=(TRAIN_OOM,), oom_retries=1)
    trial = SimpleNamespace(trial_id="t", config={"lr": 0.1}, last_result=before.to_metrics(), checkpoint=object())
    view.on_trial_start(0, [trial], trial)
    view.on_trial_result(0, [trial], trial, dataclasses.replace(before, step=24).to_metrics())
    assert log.getvalue() == ("t resumed: lr=0.1 (reported up to epoch 1, step 18; plan 64 x 2), from its last checkpoint\n")
    view.on_trial_result(0, [trial], trial, dataclasses.replace(before, step=30, oom_events=(TRAIN_OOM, EVAL_OOM)).to_metrics())
    assert log.getvalue().splitlines()[1].startswith("t OOM in eval after step 8")
    assert view._ooms == 2  # the one survived before the resume, and the new one
    # One whose checkpoints the sweep's saved state does not hold (Tune's, made every ~10 s) trains again from its start.
    log.seek(0), log.truncate()
    unsaved = SimpleNamespace(trial_id="v", config={"lr": 0.3}, last_result=before.to_metrics(), checkpoint=None)
    view.on_trial_start(0, [unsaved], unsaved)
    assert log.getvalue() == ("v resumed: lr=0.3 (reported up to epoch 1, step 18; plan 64 x 2), from the start: "
                              "the sweep's saved state has no checkpoint of it\n")
    # A trial that had not reported before the resume starts as any other.
    log.seek(0), log.truncate()
    fresh = SimpleNamespace(trial_id="u", config={"lr": 0.2}, last_result={})
    view.on_trial_start(0, [fresh], fresh)
    assert log.getvalue() == "u started: lr=0.2\n"


def test_a_refused_trial_is_told_once_though_its_last_report_and_its_end_both_say_it(monkeypatch):
    log = io.StringIO()
    monkeypatch.setattr(sys, "stdout", log)
    view = LiveView(["lr"], "eval_loss", 3, None)
    trial = SimpleNamespace(trial_id="t", config={"lr": 0.1}, last_result=REFUSED.to_metrics())
    view.on_trial_start(0, [trial], trial)
    view.on_trial_result(0, [trial], trial, REFUSED.to_metrics())
    view.on_trial_complete(0, [trial], trial)
    assert log.getvalue() == "t started: lr=0.1\nt refused: micro-batch 1 needs 18.7KiB, budget 1.0KiB\n"
    # One that never reported (a report Tune did not pass on) is told at its end.
    log.seek(0), log.truncate()
    other = SimpleNamespace(trial_id="u", config={"lr": 0.1}, last_result=REFUSED.to_metrics())
    view.on_trial_complete(0, [other], other)
    assert log.getvalue() == "u refused: micro-batch 1 needs 18.7KiB, budget 1.0KiB\n"


def test_a_trial_that_spent_its_budget_as_the_sweep_was_stopped_is_told_finished_once(monkeypatch):
    """Ctrl-C as a trial's last report arrives: Tune ends it without calling on_trial_complete."""
    log = io.StringIO()
    monkeypatch.setattr(sys, "stdout", log)
    view = LiveView(["lr"], "eval_loss", 3, None)
    last = TrialReport(epoch=3, step=24, measurements={"eval_loss": 0.5}, training_done=True).to_metrics()
    stopped, interrupted, told = (SimpleNamespace(trial_id=t, config={}, last_result=last) for t in "sit")
    view.on_trial_result(0, [], stopped, last)
    view.on_trial_result(0, [], interrupted, TrialReport(epoch=1, step=8, measurements={"eval_loss": 0.9}).to_metrics())
    view.on_trial_result(0, [], told, last)
    view.on_trial_complete(0, [], told)
    view.on_experiment_end([stopped, interrupted, told])
    assert log.getvalue() == "t finished: 3/3 epochs, eval_loss 0.5000\ns finished: 3/3 epochs, eval_loss 0.5000\n"


def test_a_finished_trial_says_what_it_trained_its_metric_and_peak():
    result = TrialReport(epoch=3, measurements={"eval_loss": 0.46091}, peak_allocated_bytes=36 * 1024,
                         memory_source="cpu_tensor_tracker", training_done=True)
    assert format_event(finished_event("t", result, "eval_loss", 3)) == (
        "t finished: 3/3 epochs, eval_loss 0.4609, peak 36.0 KiB (tensor bytes)")
    unfinished = TrialReport(epoch=1, measurements={"eval_loss": float("nan")}, training_done=True)
    assert format_event(finished_event("t", unfinished, "eval_loss", None)) == "t finished: 1 epochs"
    # A step budget reached mid-epoch: the steps say the trial trained to its end, not that it was stopped early.
    at_its_steps = TrialReport(epoch=1, step=10, measurements={"eval_loss": 0.5}, training_done=True)
    assert format_event(finished_event("t", at_its_steps, "eval_loss", 4, 10)) == (
        "t finished: 1/4 epochs, 10/10 steps, eval_loss 0.5000")


def test_a_trial_asha_stopped_says_so_in_its_last_line():
    """Tune completes it as it does a trial that spent its budget; its last report says it did not."""
    cut = TrialReport(epoch=1, step=8, measurements={"eval_loss": 2.07})
    assert format_event(finished_event("t", cut, "eval_loss", 4)) == "t stopped early by ASHA: 1/4 epochs, eval_loss 2.0700"


def test_a_diverged_trial_ends_in_one_line_with_its_step_and_last_finite_loss():
    line = "loss not finite at step 37 (epoch 2); last finite loss 0.4123; not retried (on_nan: stop)"
    result = TrialReport(epoch=1, step=37, measurements={"eval_loss": float("inf")}, diverged=line, diverged_at_step=37)
    assert format_event(finished_event("t", result, "eval_loss", 3)) == f"t diverged: {line}"


def test_a_checkpoint_the_storage_refused_is_one_line_naming_the_path_and_the_stop():
    fault = "[Errno 30] Cannot create directory '/s/cut/t0/checkpoint_000003'. Detail: [errno 30] Read-only file system"
    [event] = report_events("t0", TrialReport(storage_fault=fault), Seen(planned=True))
    assert event == StorageFault("t0", fault)
    line = format_event(event)
    assert "\n" not in line and line.startswith(f"t0 checkpoint not stored: {fault}; stopping the sweep")


def test_tune_s_failed_saves_to_a_refusing_storage_are_one_line_each():
    """Tune's and its syncer's records of a storage that refuses the experiment's state: one line
    each, the error's, instead of their tracebacks (put back after the sweep)."""
    import logging

    def record_of(name, message, exc_info=None):
        return logging.getLogger(name).makeRecord(name, logging.ERROR, __file__, 1, message, (), exc_info)

    try:
        raise OSError(30, "Failed to open local file '/s/cut/state.json'.\nDetail: [errno 30] Read-only file system")
    except OSError:
        error = sys.exc_info()
    state = record_of("ray.tune.execution.experiment_state", "Saving experiment state to storage at '/s/cut' failed with exception: ", error)
    synced = record_of("ray.train._internal.syncer", "Last sync command failed with the following error:\nTraceback (most recent call last):\n"
                       "  File \"x.py\", line 1, in f\nOSError: [Errno 30] Read-only file system\n")
    with tune_lines_told_here(verbose=False):
        for record in (state, synced):
            assert logging.getLogger(record.name).filter(record)
    assert state.getMessage() == ("Saving experiment state to storage at '/s/cut' failed with exception: [Errno 30] Failed to open "
                                  "local file '/s/cut/state.json'. Detail: [errno 30] Read-only file system")
    assert state.exc_info is None
    assert synced.getMessage() == "Last sync command failed with the following error: OSError: [Errno 30] Read-only file system"
    assert not logging.getLogger("ray.train._internal.syncer").filters


def test_the_config_shows_what_differs_between_trials_in_the_configs_order():
    config = {"workload": "mlp", "depth": 2, "lr": 0.0030000001, "width": 16, "seed": 0}
    assert config_text(config, ["lr", "workload", "width"]) == "workload=mlp, lr=0.003, width=16"


def test_the_progress_line_counts_trials_time_left_and_ooms():
    assert format_progress(Progress(3, 2, 3, 75, 0.5, 2)) == (
        "3 done, 2 running, 3 pending | 1:15 elapsed | ~1:15 left | 2 OOM(s) survived")
    assert format_progress(Progress(0, 2, 6, 4000, 0.0, 0)) == "0 done, 2 running, 6 pending | 1:06:40 elapsed"
    # On a terminal, within its width (one column to spare): the parts that fit; a line that
    # wrapped left a fragment of itself above each redraw.
    progress = Progress(3, 2, 3, 75, 0.5, 2)
    assert format_progress(progress, 80) == format_progress(progress)
    assert format_progress(progress, 44) == "3 done, 2 running, 3 pending | 1:15 elapsed"
    assert format_progress(progress, 30) == "3 done, 2 running, 3 pending"
    assert format_progress(progress, 20) == "3 done, 2 running, "
    assert trial_fraction("RUNNING", {"epoch": 1, "step": 10}, 4, None) == 0.25
    assert trial_fraction("RUNNING", {"epoch": 0, "step": 300}, 4, 400) == 0.75  # the nearer budget
    assert trial_fraction("ERROR", {}, 4, None) == trial_fraction("TERMINATED", {}, 4, None) == 1.0


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _trials():
    return [SimpleNamespace(status="TERMINATED", last_result={"epoch": 3}),
            SimpleNamespace(status="RUNNING", last_result={"epoch": 1}),
            SimpleNamespace(status="PENDING", last_result={})]


def test_on_a_terminal_the_progress_line_is_redrawn_in_place_and_cleared_for_each_event(monkeypatch):
    screen = Terminal()
    monkeypatch.setattr(sys, "stdout", screen)
    view = LiveView(["lr"], "eval_loss", 3, None)
    view.setup(total_num_samples=4)
    view.on_step_end(0, _trials())
    assert screen.getvalue().startswith("\r\x1b[K1 done, 1 running, 2 pending | 0:00 elapsed | ~")
    view.on_trial_start(0, _trials(), SimpleNamespace(trial_id="t", config={"lr": 0.1}, last_result={}))
    assert screen.getvalue().endswith("\r\x1b[Kt started: lr=0.1\n")  # the progress line made way
    view.on_experiment_end(_trials())
    assert screen.getvalue().endswith("\n")


class Writes(io.StringIO):
    """A stream that keeps each write: a signal handler runs between two of them."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[str] = []

    def write(self, text: str) -> int:
        self.writes.append(text)
        return super().write(text)


def test_each_event_line_is_written_whole_so_a_signal_cannot_split_it(monkeypatch):
    """The stop notice is written from Ctrl-C's handler, which runs between two writes of the
    console's: a line written as its text and then its newline (``print``, unbuffered or on a
    pipe that is full) would have the notice glued to its end."""
    out = Writes()
    monkeypatch.setattr(sys, "stdout", out)
    view = LiveView(["lr"], "eval_loss", 3, None)
    view.on_trial_start(0, _trials(), SimpleNamespace(trial_id="t", config={"lr": 0.1}, last_result={}))
    view.on_trial_result(0, _trials(), SimpleNamespace(trial_id="t"), PLANNED.to_metrics())
    assert out.writes == ["t started: lr=0.1\n",
                          "t plan: micro-batch x accumulation 64 x 2, estimated peak 5.0 MiB in train (trace)\n"]


def test_ctrl_c_on_a_terminal_says_its_line_on_a_line_of_its_own_not_after_the_progress_line(monkeypatch):
    """On a terminal the progress line stays open (no newline, redrawn in place): Ctrl-C's
    notice, written straight to the terminal, first clears it, as each event's line does."""
    import pty

    control, terminal = pty.openpty()
    with open(terminal, "w", closefd=True) as screen:
        monkeypatch.setattr(sys, "stdout", screen)
        monkeypatch.setattr(sys, "stderr", screen)
        view = LiveView(["lr"], "eval_loss", 3, None)
        view.setup(total_num_samples=4)
        view.on_step_end(0, _trials())
        record = logging.LogRecord("ray.tune.tune", logging.WARNING, "tune.py", 1,
                                   "Stop signal received (e.g. via SIGINT/Ctrl+C), ending Ray Tune run.", None, None)
        assert StopNotice().filter(record) is False  # Tune's own record is not shown
        view.on_experiment_end(_trials())
        screen.flush()
    shown = b""
    with contextlib.suppress(OSError):  # EIO: all read, the terminal's side closed
        while chunk := os.read(control, 65536):  # a terminal hands its output over in pieces
            shown += chunk
    os.close(control)
    shown = shown.decode()
    progress = shown[:shown.index("Stopping")]
    assert progress.startswith("\r\x1b[K1 done, 1 running, 2 pending") and progress.endswith("\r\x1b[K")
    assert shown[len(progress):].startswith(StopNotice.LINE.rstrip("\n"))


def test_ctrl_c_into_a_file_is_its_line_alone(monkeypatch, tmp_path):
    """Where standard output is no terminal there is no progress line, and nothing to clear."""
    with open(tmp_path / "log", "w") as log:
        monkeypatch.setattr(sys, "stdout", log)
        monkeypatch.setattr(sys, "stderr", log)
        record = logging.LogRecord("ray.tune.tune", logging.WARNING, "tune.py", 1, "Stop signal received", None, None)
        StopNotice().filter(record)
    assert (tmp_path / "log").read_text() == StopNotice.LINE


def test_into_a_file_there_is_no_progress_line(monkeypatch):
    log = io.StringIO()
    monkeypatch.setattr(sys, "stdout", log)
    view = LiveView(["lr"], "eval_loss", 3, None)
    view.on_step_end(0, _trials())
    view.on_trial_start(0, _trials(), SimpleNamespace(trial_id="t", config={"lr": 0.1}, last_result={}))
    view.on_experiment_end(_trials())
    assert log.getvalue() == "t started: lr=0.1\n"


def test_a_failure_names_its_traceback_file_unless_its_error_names_one(tmp_path):
    error_file = tmp_path / "error.txt"
    view = LiveView(["lr"], "eval_loss", 3, None)
    trial = SimpleNamespace(trial_id="t", path="/r/t", error_file=str(error_file), config={})
    error_file.write_text("Failure # 1 (occurred at ...)\nTraceback ...\nValueError: bad shape\n")
    assert view._failure(trial) == Failed("t", "ValueError: bad shape", "/r/t/error.txt")
    error_file.write_text("Failure # 1\nDataError: train_data sample 3: x.py:1: ValueError: no; traceback in /r/t/trial.log\n")
    assert view._failure(trial).log == ""


def test_verbose_reaches_every_launcher_through_the_run_request():
    from orchestrator.run_request import RunRequest

    assert RunRequest.from_args(SimpleNamespace(config="s.yaml", overrides=[], verbose=True)).arguments()[-1] == "--verbose"
    assert "--verbose" not in RunRequest("s.yaml").arguments()


def test_the_view_pickles_without_its_state_for_a_resumed_sweep():
    """Tune pickles its callbacks with the experiment; ``Tuner.restore`` runs the copies."""
    view = LiveView(["lr"], "eval_loss", 3, None)
    view._seen["t"] = Seen(planned=True)
    copy = pickle.loads(pickle.dumps(view))
    assert copy._seen == {} and copy.shown_keys == ["lr"] and copy.metric == "eval_loss"


def test_run_help_offers_ray_s_own_output_as_verbose():
    from orchestrator.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["run", "x.yaml", "-v"]).verbose and not parser.parse_args(["run", "x.yaml"]).verbose
    run_help = parser._subparsers._group_actions[0].choices["run"].format_help()
    assert "-v, --verbose" in run_help


def _piped_run(config: str, cwd) -> subprocess.CompletedProcess:
    """``orchestrator run CONFIG > file``, as a user starts it: stdout and stderr into a pipe."""
    return subprocess.run([installed_command(), "run", str(ROOT / "configs" / config), "--num-cpus", "2"],
                          cwd=cwd, env=command_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=600)


@pytest.mark.integration
def test_the_demo_sweep_piped_to_a_file_is_a_short_plain_log(tmp_path):
    proc = _piped_run("demo_cpu.yaml", tmp_path)
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:]
    assert len(out.splitlines()) <= 60, out
    assert "\x1b" not in out and "\r" not in out
    # One line per event of each of the 8 trials, then our table; none of Ray's boxes or chatter.
    assert len(re.findall(r"^\w+_\d{5} started: workload=", out, re.M)) == 8
    assert len(re.findall(r"^\w+_\d{5} plan: micro-batch x accumulation 64 x 1, estimated peak", out, re.M)) == 8
    assert len(re.findall(r"^\w+_\d{5} finished: 3/3 epochs, eval_loss \d", out, re.M)) == 8
    assert "8/8 trials finished" in out
    for noise in ("╭", "Trial status", "Checkpoint successfully created", "snapshotting", "Started a local Ray",
                  "TensorBoard", "mlflow.store", "Token authentication"):
        assert noise not in out, noise


@pytest.mark.integration
def test_ctrl_c_is_one_line_of_ours_then_the_table_of_every_trial_with_its_config(tmp_path):
    """Ctrl-C at the first plan (SIGINT to the command's group, as a terminal sends it): Tune's
    notice of it (with Ray's ids and a timestamp) and its warning, building the results, of every
    trial that never started are not shown; one line says what stopping does, and the table lists
    every trial with its config, started or not."""
    run = subprocess.Popen([installed_command(), "run", str(ROOT / "configs" / "demo_cpu.yaml")], cwd=tmp_path,
                           env=command_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           start_new_session=True)
    try:
        seen = lines_until(run, " plan: ")
        os.killpg(run.pid, signal.SIGINT)
        out = "".join(seen) + run.communicate(timeout=300)[0]
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    assert run.returncode == 1, out[-3000:]
    assert out.count("Stopping the sweep: its trials stop, its state is saved one last time (Ctrl-C again skips that)") == 1
    for noise in ("Stop signal received", "Failed to fetch metrics", "FileNotFoundError", "job_id=", "timestamp_ns="):
        assert noise not in out, noise
    rows = re.findall(r"^(\w+_\d{5})  +(\S.*?)  +\d/3 ep .* (INTERRUPTED|TERMINATED)$", out, re.M)
    assert len(rows) == 8, out[-3000:]
    assert sorted(config for _, config, _ in rows) == sorted(
        f"workload={w}, lr={lr}, width={width}" for w in ("mlp", "cnn") for lr in ("0.003", "0.03") for width in (16, 32))
    assert "INTERRUPTED" in {status for *_, status in rows}
    assert re.search(r"^Interrupted trials continue from their last checkpoints with: .* --resume$", out, re.M)


@pytest.mark.integration
def test_the_oom_demo_announces_each_oom_with_its_step_and_new_plan(tmp_path):
    proc = _piped_run("demo_oom_cpu.yaml", tmp_path)
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:]
    assert "\x1b" not in out and "invalid value" not in out  # no list in Tune's metrics for TensorBoard
    ooms = re.findall(r"^\w+_\d{5} OOM in (train step|eval after step) (\d+) \(epoch (\d)\).*: resumed with (.*)$", out, re.M)
    assert ooms, out
    assert all(int(step) >= 1 and int(epoch) >= 1 for _, step, epoch, _ in ooms)  # counted from 1
    assert any(change.startswith("micro-batch 128->64 (accumulation 1->2)") for *_, change in ooms)
    # The staged trial's auxiliary block switches on in its third epoch (aux_start_epoch 2, from 0).
    assert any(phase == "train step" and epoch == "3" for phase, _, epoch, _ in ooms)
    assert "6/6 trials finished" in out
