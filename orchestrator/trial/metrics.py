"""Per-trial memory metrics as Ray metrics, so they show next to the sweep's job.

The trainable calls :class:`TrialMetrics` with every report from inside its trial actor. Ray's
metrics agent exports the values on the node's Prometheus endpoint (the metrics export port,
no auth, all interfaces) about 15 s later, with Ray's ``ray_`` prefix:

    ray_orchestrator_planned_peak_bytes{experiment, trial_id, workload}
    ray_orchestrator_measured_peak_bytes{..., kind="allocated"|"reserved"}   (a group's worst rank)
    ray_orchestrator_rank_peak_bytes{..., rank, kind}    (each rank of a data-parallel trial)
    ray_orchestrator_micro_batch{...}
    ray_orchestrator_eval_batch{...}

and the driver counts ``ray_orchestrator_oom_retries_total{..., phase}`` (``orchestrator.oom_counter``).
Every name starts with ``orchestrator_`` so ``{__name__=~"ray_orchestrator_.*"}`` finds them all.
These are gauges, live values: a worker exports what it recorded every
``metrics_report_interval_ms`` (Ray's default: 10 s) and Ray drops a gauge a worker stopped
reporting after two intervals; MLflow, written with each report, keeps every value.
Outside Ray (unit tests of the training loop, a plain script) every call is a cheap no-op.
"""

from __future__ import annotations

import sys
from typing import Any

from orchestrator.trial_report import TrialReport

PREFIX = "orchestrator_"
TRIAL_TAGS = ("experiment", "trial_id", "workload")


class _RayMetrics:
    """The Ray metric objects; building them registers the names with this process's Ray worker."""

    def __init__(self) -> None:
        from ray.util.metrics import Gauge

        self.planned_peak = Gauge(
            PREFIX + "planned_peak_bytes",
            "Peak memory (bytes) the plan expects for the trial's worst phase",
            tag_keys=TRIAL_TAGS,
        )
        self.measured_peak = Gauge(
            PREFIX + "measured_peak_bytes",
            "Peak memory (bytes) measured since the previous report; kind=allocated (tensors) or reserved (allocator)",
            tag_keys=TRIAL_TAGS + ("kind",),
        )
        self.rank_peak = Gauge(
            PREFIX + "rank_peak_bytes",
            "Peak memory (bytes) of one rank of a data-parallel trial since the previous report",
            tag_keys=TRIAL_TAGS + ("rank", "kind"),
        )
        self.micro_batch = Gauge(
            PREFIX + "micro_batch", "Training micro-batch size in force", tag_keys=TRIAL_TAGS
        )
        self.eval_batch = Gauge(
            PREFIX + "eval_batch", "Evaluation batch size in force", tag_keys=TRIAL_TAGS
        )


def trial_tags(experiment: str, trial_id: str, workload: str) -> dict[str, str]:
    """The :data:`TRIAL_TAGS` of one trial's series, the gauges' and the driver's OOM counter's alike."""
    return {"experiment": str(experiment), "trial_id": str(trial_id), "workload": str(workload)}


class TrialMetrics:
    """One trial's gauges, tagged with the experiment, trial id and workload."""

    def __init__(self, experiment: str, trial_id: str, workload: str):
        self.tags = trial_tags(experiment, trial_id, workload)
        self._metrics: _RayMetrics | None = None

    def _ray(self) -> _RayMetrics | None:
        """The Ray metric objects, built on first use once Ray is up here; None outside Ray.

        Built per instance rather than per process so a process that shuts Ray down and starts
        it again (tests do) never records into metrics of a finished session.
        """
        if self._metrics is None:
            ray = sys.modules.get("ray")  # not imported means not initialised: don't pay the import
            if ray is None or not ray.is_initialized():
                return None
            self._metrics = _RayMetrics()
        return self._metrics

    def record_result(self, report: TrialReport) -> None:
        """Publish a report's plan and measured peaks; what it lacks is skipped."""
        metrics = self._ray()
        if metrics is None:
            return
        _set(metrics.planned_peak, report.predicted_peak_bytes, self.tags)
        _set(metrics.measured_peak, report.peak_allocated_bytes, {**self.tags, "kind": "allocated"})
        _set(metrics.measured_peak, report.peak_reserved_bytes, {**self.tags, "kind": "reserved"})
        for rank, peak in enumerate(report.rank_peaks if report.ranks > 1 else ()):
            for kind in ("allocated", "reserved"):
                _set(metrics.rank_peak, getattr(peak, kind), {**self.tags, "rank": str(rank), "kind": kind})
        _set(metrics.micro_batch, report.micro_batch, self.tags)
        _set(metrics.eval_batch, report.eval_batch, self.tags)


def _set(gauge: Any, value: Any, tags: dict[str, str]) -> None:
    if value is not None:
        gauge.set(float(value), tags=tags)
