"""A resumed sweep's scheduler decides as the uninterrupted one would: its state is saved with
Tune's snapshot (a callback's state) and put back into the scheduler ``tuner.pkl`` restores."""

from __future__ import annotations

import pickle
from types import SimpleNamespace

from ray.tune.schedulers import ASHAScheduler, TrialScheduler

from orchestrator.retry import OomAwareScheduler
from orchestrator.scheduler_state import SchedulerState


def _sweep():
    """An ASHA sweep's scheduler and its state callback, as ``tuner.pkl`` holds them (one pickle)."""
    asha = ASHAScheduler(time_attr="step", max_t=40, grace_period=10, reduction_factor=2)
    scheduler = OomAwareScheduler(asha)
    scheduler.set_search_properties("eval_loss", "min")
    return scheduler, SchedulerState(scheduler)


def _trial(name):
    return SimpleNamespace(trial_id=name, config={})


def _result(scheduler, trial, step, loss):
    return scheduler.on_trial_result(None, trial, {"step": step, "eval_loss": loss})


def _resumed(tuner_pkl: bytes, snapshot: dict | None):
    """The scheduler a resume runs with: unpickled from tuner.pkl, given the snapshot's state."""
    scheduler, callback = pickle.loads(tuner_pkl)
    if snapshot is not None:
        callback.set_state(pickle.loads(pickle.dumps(snapshot)))  # as Tune writes and reads it
    return scheduler


def test_a_resumed_asha_cuts_against_the_values_recorded_before_the_interruption():
    scheduler, callback = _sweep()
    tuner_pkl = pickle.dumps((scheduler, callback))  # written as the sweep begins
    a, b, c = _trial("a"), _trial("b"), _trial("c")
    for trial in (a, b, c):
        scheduler.on_trial_add(None, trial)
    assert _result(scheduler, a, 10, 0.60) == TrialScheduler.CONTINUE
    assert _result(scheduler, b, 10, 0.50) == TrialScheduler.CONTINUE
    snapshot = callback.get_state()  # Tune's snapshot; then Ctrl-C, and --resume

    for state, decision in ((snapshot, TrialScheduler.CONTINUE), (None, TrialScheduler.STOP)):
        resumed = _resumed(tuner_pkl, state)
        for trial in (a, b, c):
            resumed.on_trial_add(None, trial)
        # a's first result after the resume is at step 18, far better than it was at step 10.
        assert _result(resumed, a, 18, 0.30) == TrialScheduler.CONTINUE
        # c reaches the first rung with 0.52: between a's 0.60 and b's 0.50 at that rung, so it
        # goes on, as without the interruption; a scheduler without the state (Tune's own resume)
        # cuts it against a's step-18 value.
        assert _result(resumed, c, 10, 0.52) == decision


def test_the_data_errors_pending_are_kept_too():
    scheduler, callback = _sweep()
    tuner_pkl = pickle.dumps((scheduler, callback))
    scheduler.data_errors.add("a")
    assert _resumed(tuner_pkl, callback.get_state()).data_errors == {"a"}
