"""The sweep's storage refused a trial's checkpoint: the sweep stops as Ctrl-C stops it.

A trial whose checkpoint the storage would not take, tried again for a while
(``orchestrator.trial.storage``), says so in a report and waits. The storage is the sweep's:
the other trials' next checkpoints, Tune's experiment state and the MLflow outbox go there too.
So the driver stops the whole sweep gracefully, as Ctrl-C (and SIGTERM) does: each trial stays
``INTERRUPTED`` at its last stored checkpoint, none counts as failed, the table says why the
sweep stopped, and the summary prints the ``run ... --resume`` that continues every trial once
the storage is back.
"""

from __future__ import annotations

import signal
import threading

from ray import tune

from orchestrator.outcome import current_record
from orchestrator.trial_report import TrialReport


class StopOnStorageFault(tune.Callback):
    """Stops the sweep at the first trial report of a storage fault."""

    def __init__(self) -> None:
        self._stopping = False

    def __getstate__(self) -> dict:
        """A resumed sweep stops afresh."""
        return {**self.__dict__, "_stopping": False}

    def on_trial_result(self, iteration, trials, trial, result, **info) -> None:
        fault = TrialReport.from_result(result).storage_fault
        if not fault or self._stopping:
            return
        self._stopping = True
        record = current_record()
        if record is not None:
            record.stop_reason = f"the storage did not take trial {trial.trial_id}'s checkpoint: {fault}"
        stop_as_ctrl_c_does()


def stop_as_ctrl_c_does() -> None:
    """Runs the SIGINT handler of the moment, as Ctrl-C would: during ``Tuner.fit`` in the main
    thread it is Tune's, which stops the trials and saves the experiment. Nothing where Tune
    installed none (a driver run from another thread): the trial then fails after its wait."""
    if threading.current_thread() is not threading.main_thread():
        return
    handler = signal.getsignal(signal.SIGINT)
    if callable(handler) and handler is not signal.default_int_handler:
        handler(signal.SIGINT, None)
