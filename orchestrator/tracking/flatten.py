"""What a sweep's values become in MLflow: flat, dotted params as text within MLflow's limits,
and a trial's report as numeric metrics."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from orchestrator.config import Domain, SweepSpec
from orchestrator.tracking.runs import STEP_METRIC
from orchestrator.trial_report import TrialReport

MAX_PARAM_CHARS = 6000  # MLflow's limit on a param value


def result_metrics(report: TrialReport) -> dict[str, float]:
    """Every number the trial reported, and its training time across restarts (which GPU hours
    are computed from), except the step itself: that is the MLflow step of the metrics. A diverged
    trial's last report gives the searcher and the scheduler the worst value of the metric (an
    infinity, which MLflow would keep as the largest double): not a value it measured, so not logged."""
    placed = set(report.measurements) if report.diverged else set()
    return {key: float(value) for key, value in report.numbers().items() if key != STEP_METRIC and key not in placed}


def plan_params(plan: dict[str, Any]) -> dict[str, str]:
    """The final plan as ``plan.*`` params, ``predicted_phases`` as ``plan.predicted_phases.<phase>``
    (a stage's phase ``train@epoch2`` as ``train:epoch2``: MLflow refuses ``@`` in a name)."""
    flat = _flatten(plan, "plan")
    return {key.replace("@", ":"): param_text(value) for key, value in flat.items() if value is not None}


def spec_params(spec: SweepSpec) -> dict[str, str]:
    """The validated spec, defaults included, as dotted params (``memory.safety_margin``)."""
    values = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec) if f.name not in ("raw", "source")}
    return {key: param_text(value) for key, value in _flatten(values, "").items()}


def param_text(value: Any) -> str:
    """A value as an MLflow param: a search domain as ``grid [0.01, 0.1]``, containers as JSON."""
    if isinstance(value, Domain):
        args = list(value.args[0]) if value.kind in ("choice", "grid") else list(value.args)
        text = f"{value.kind} {json.dumps(args)}"
    elif isinstance(value, (dict, list, tuple)):
        text = json.dumps(value, default=str)
    else:
        text = str(value)
    return text[:MAX_PARAM_CHARS]


def _flatten(value: Any, prefix: str) -> dict[str, Any]:
    if dataclasses.is_dataclass(value) and not isinstance(value, Domain):
        value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if isinstance(value, dict) and value:
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(_flatten(item, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: value}
