"""The Ray Tune trainable: where Tune hands a trial over to this package.

A restart the retry scheduler already judged hopeless (``orchestrator.retry``) fails here at
once; a one-process trial is a :class:`~orchestrator.trial.run.TrialRun`, a data-parallel one a
:class:`~orchestrator.trial.group.GroupTrialRun`.
"""

from __future__ import annotations

from typing import Any

from orchestrator.config import SweepSpec
from orchestrator.contract import NOT_RETRIED_KEY, OOM_GAVE_UP_KEY, OTHER_FAILURES_KEY
from orchestrator.estimates import Estimates
from orchestrator.trial.errors import NotRetriedError, OomRetriesExhausted
from orchestrator.trial.group import GroupTrialRun
from orchestrator.trial.run import TrialRun
from orchestrator.trial.worker_exit import exit_requests_survive_finalisers


def train_trial(config: dict[str, Any], spec: SweepSpec, estimates: Estimates | None = None) -> None:
    """Tune entry point (wrapped with ``tune.with_parameters(train_trial, spec=spec, estimates=...)``:
    ``estimates`` are the driver's memory profiles, ``orchestrator.estimates``)."""
    exit_requests_survive_finalisers()
    if config.get(OOM_GAVE_UP_KEY):
        raise OomRetriesExhausted(config[OOM_GAVE_UP_KEY])
    if config.get(NOT_RETRIED_KEY):
        raise NotRetriedError(
            f"{config[NOT_RETRIED_KEY]} (failed {config.get(OTHER_FAILURES_KEY, 1)} time(s); errors other "
            f"than out-of-memory are retried at most max_failures={spec.max_failures} time(s))"
        )
    if spec.resources.workers > 1:
        GroupTrialRun(config, spec, estimates).run()
        return
    TrialRun(config, spec, estimates).run()
