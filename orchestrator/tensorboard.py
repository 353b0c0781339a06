"""Tune's TensorBoard files, with each trial's curves and not its constants.

Tune writes a TensorBoard event for every number of every result, and flushes the trial's file
after each. A trial's report carries some forty numbers, most of them the same at every report
(the plan's budget and prediction, twice: flat and nested; its node; flags), so a sweep's event
files were mostly flat lines, and writing them was the largest part of the driver's work per
result (3.6-4.1 ms a result against 0.8 ms for a plain Tune result of two metrics, measured on
the 2-core machine of ``bench/sweep_scale.py``). TensorBoard gets what moves instead, the
report's :meth:`~orchestrator.trial_report.TrialReport.curves` (1.7 ms a result). MLflow keeps
every number.
"""

from __future__ import annotations

from typing import Any

from ray.tune.logger import TBXLoggerCallback
from ray.tune.result import TIMESTEPS_TOTAL, TRAINING_ITERATION

from orchestrator.trial_report import TrialReport


class TrialCurves(TBXLoggerCallback):
    """Tune's TensorBoard logger (one event file per trial folder, ``tensorboard --logdir`` on the
    sweep's folder as with any Tune run), given a result's curves and the step Tune plots them at."""

    def log_trial_result(self, iteration: int, trial, result: dict[str, Any]) -> None:
        curves = TrialReport.from_result(result).curves()
        for key in (TRAINING_ITERATION, TIMESTEPS_TOTAL):
            if result.get(key) is not None:
                curves[key] = result[key]
        super().log_trial_result(iteration, trial, curves)


def tensorboard_logger() -> TrialCurves | None:
    """The logger, or None where tensorboardX is not installed (Tune then writes no event files
    either: it only warns)."""
    try:
        return TrialCurves()
    except ImportError:
        return None
