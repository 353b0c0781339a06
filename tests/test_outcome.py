"""What became of a trial and of a sweep: one set of rules for the table, the exit code and MLflow."""

import pytest

from orchestrator.outcome import (
    DIVERGED,
    ERROR,
    INTERRUPTED,
    TERMINATED,
    finished,
    sweep_run_status,
    trial_status,
)
from orchestrator.trial_report import TrialReport

DIVERGENCE = TrialReport(step=5, training_done=True, diverged="loss not finite at step 5 (epoch 1); last finite loss 0.4",
                         diverged_at_step=5, done=True)


def test_a_diverged_trial_is_diverged_unless_it_errored():
    assert trial_status(False, DIVERGENCE) == DIVERGED
    assert trial_status(True, DIVERGENCE) == ERROR
    assert trial_status(False, TrialReport(done=True)) == TERMINATED


@pytest.mark.parametrize("on_nan, counts, sweep", [("stop", True, "FINISHED"), ("fail", False, "FAILED")])
def test_on_nan_says_whether_a_diverged_trial_counts_as_finished(on_nan, counts, sweep):
    assert finished(DIVERGED, on_nan) is counts
    assert sweep_run_status([TERMINATED, DIVERGED], on_nan) == sweep
    assert finished(TERMINATED, on_nan) and not finished(ERROR, on_nan) and not finished(INTERRUPTED, on_nan)
    assert sweep_run_status([DIVERGED, INTERRUPTED], on_nan) == "KILLED"  # a resume may still finish it
