"""The driver's memory stays flat as a sweep's trials grow: what it keeps of a trial that ended.

Tune keeps every trial of a sweep in the driver until the sweep ends, and with each its running
statistics of every number it reported (``metric_analysis``: max, min, average, last-5 and
last-10 averages, and the deques behind them), which its experiment-state snapshots also copy
into each trial's cached JSON. A trial of ours reports about fifty numbers (its plan, memory,
speed), so that was ~110 KB of the ~150 KB the driver grew per trial (tracemalloc, 120 trials of
the demo MLP: ``bench/sweep_scale.py``), and a driver of thousands of short trials grew by
hundreds of MB. Nothing of ours reads them (the final table reads each trial's last result, as
MLflow does), so once a trial has ended they are dropped, except the sweep metric's, which
``ResultGrid.get_best_result`` reads.
"""

from __future__ import annotations

from ray import tune

from orchestrator.ray_internals import forget_running_statistics


class EndedTrialsKeepLess(tune.Callback):
    """Drops an ended trial's running statistics, but those of ``metric``."""

    def __init__(self, metric: str):
        self.metric = metric

    def on_trial_complete(self, iteration, trials, trial, **info) -> None:
        forget_running_statistics(trial, self.metric)

    def on_trial_error(self, iteration, trials, trial, **info) -> None:
        forget_running_statistics(trial, self.metric)
