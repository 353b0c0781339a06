"""What became of a sweep and of each of its trials: one set of rules for the summary table, the
exit code and the MLflow run statuses, so that they never disagree.

Tune's results do not carry everything the driver saw. A trial whose error could not be
written to the storage path (a full or read-only disk) comes back with ``Result.error = None``,
because the result grid reads errors back from storage; what the tracking callback could not
deliver to MLflow is nowhere in them; nor is why the sweep was stopped. The driver's callbacks
write those into a :class:`SweepRecord`. They cannot hand it to the runner by reference: Tune
pickles the callbacks with the experiment and ``Tuner.restore`` runs the unpickled copies. So
the runner opens the record around ``fit()`` (:func:`recording`) and the callbacks running in
its process find it with :func:`current_record`; outside a recording they record nothing.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterable, Iterator

from ray import tune

from orchestrator.failures import exception_line, last_failure
from orchestrator.trial_report import TrialReport

#: A trial's final status, as the summary table shows it.
TERMINATED = "TERMINATED"  # finished: completed, stopped early by the scheduler, or its budget spent
ERROR = "ERROR"
REFUSED = "REFUSED"  # not even micro-batch 1 fits: it never trained
INTERRUPTED = "INTERRUPTED"  # Ctrl-C, a SLURM time limit, a sweep stopped: `run --resume` continues it
DIVERGED = "DIVERGED"  # its loss (or clipped gradient norm) was not finite: ended there, not retried
#: Tune's statuses of a trial that will not run again (its own words for two of the above).
ENDED_IN_TUNE = frozenset({TERMINATED, ERROR})


def trial_status(errored: bool, report: TrialReport) -> str:
    """Tune marks a trial's last result ``done`` when it completes or its scheduler stops it; a
    trial whose last report says it spent its budget (``training_done``) finished just before
    an interruption, and is finished all the same."""
    if errored:
        return ERROR
    if report.refused:
        return REFUSED
    if report.diverged:
        return DIVERGED
    if not report.done and not report.training_done:
        return INTERRUPTED
    return TERMINATED


def finished(status: str, on_nan: str = "stop") -> bool:
    """Whether a trial of ``status`` counts as finished (``run`` exits 0 for it): a diverged trial
    does under the sweep's ``on_nan: stop``, and counts as an errored one under ``fail``."""
    return status == TERMINATED or (status == DIVERGED and on_nan == "stop")


def sweep_run_status(statuses: Iterable[str], on_nan: str = "stop") -> str:
    """The sweep's MLflow run status for its trials' statuses: FINISHED exactly when ``run`` exits
    0 for them; KILLED while a resume can still finish it; FAILED otherwise."""
    statuses = list(statuses)
    if statuses and all(finished(s, on_nan) for s in statuses):
        return "FINISHED"
    if INTERRUPTED in statuses:
        return "KILLED"
    return "FAILED"


@dataclass
class TrackingDelivery:
    """What the tracking callback could not deliver to MLflow by the end of the sweep."""

    tracking_uri: str
    unsent: int = 0  # writes still waiting (MLflow unreachable); kept for `run --resume`
    kept_at: str | None = None  # the file that keeps them, when it could be written
    dropped: list[str] = field(default_factory=list)  # writes MLflow rejected, described

    @property
    def complete(self) -> bool:
        return not self.unsent and not self.dropped


@dataclass
class SweepRecord:
    """What the driver's callbacks saw during one ``fit()``."""

    errors: dict[str, str] = field(default_factory=dict)  # trial path -> its final failure's exception line
    configs: dict[str, dict] = field(default_factory=dict)  # trial path -> its config, where it never reported
    tracking: TrackingDelivery | None = None
    stop_reason: str | None = None  # why the driver stopped the sweep before its trials finished


_current: SweepRecord | None = None


@contextlib.contextmanager
def recording() -> Iterator[SweepRecord]:
    global _current
    _current = SweepRecord()
    try:
        yield _current
    finally:
        _current = None


def current_record() -> SweepRecord | None:
    return _current


class WhatResultsLack(tune.Callback):
    """Records what Tune's results may lack for the final table.

    - Each trial's final failure, from the error file Tune writes on the driver: that file is
      written before the failure is synced to storage, so it is there even when the storage path
      is not writable any more.
    - The config of each trial that never reported (a sweep stopped before it started): a result
      carries its config in its metrics, and such a trial has none.
    """

    def on_trial_error(self, iteration, trials, trial, **info) -> None:
        record = current_record()
        if record is not None:
            record.errors[str(trial.path)] = exception_line(last_failure(trial.error_file))

    def on_experiment_end(self, trials, **info) -> None:
        record = current_record()
        if record is not None:
            record.configs.update({str(t.path): dict(t.config) for t in trials if "config" not in t.last_result})
