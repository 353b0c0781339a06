"""The sweep's OOM retries as a Prometheus counter, counted by the driver from the trials' reports.

    ray_orchestrator_oom_retries_total{experiment, trial_id, workload, phase}

``phase`` is the OOM event's (``train``, ``eval``), or ``killed`` for a worker that died of
memory and was restarted by Tune with a smaller plan (``orchestrator.retry``).

Why the driver and not the trial's worker: a Ray process exports what it recorded every
``metrics_report_interval_ms`` (10 s) and not when it exits, so a count made in a worker is lost
whenever the worker ends sooner: a trial that finishes a few seconds after its OOM, a worker
that died of memory (it never counted its own death), the last trial of a Ray Job. The driver
sees every report, the restarted trial's too, and outlives the trials; where the cluster
outlives the driver (a Ray Job, ``--ray-address``), :func:`wait_for_export` holds the driver's
exit until its last count has been exported. The gauges (plan, measured peaks, batch sizes) stay
with the worker (``orchestrator.trial.metrics``): they are live values, and Ray ages them out
once a worker stops reporting anyway.

A resumed driver counts only what the driver before it had not (the counts it saw are part of
Tune's experiment state): Prometheus' ``sum``/``increase`` over both drivers' series is the sweep's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from ray import tune

from orchestrator.ray_internals import metrics_export_interval_s
from orchestrator.trial.metrics import PREFIX, TRIAL_TAGS, trial_tags
from orchestrator.trial_report import TrialReport

#: The phase label of an OOM that killed the trial's worker (no phase was seen: the process died).
KILLED = "killed"
#: Ray exports on a timer: past its interval, a little longer before the count is surely out.
EXPORT_SLACK_S = 1.0

_last_count_at: float | None = None  # time.monotonic() of this process's last count (one counter a process)


@dataclass
class Counted:
    """What the driver has counted of one trial: its OOM events, and the restarts its killed workers got."""

    events: int = 0
    killed: int = 0

    @classmethod
    def of(cls, report: TrialReport) -> Counted:
        """All of a report's OOMs: its events, and the retries beyond them (restarts with one more
        reduction after a worker died of memory)."""
        return cls(len(report.oom_events), report.oom_retries - len(report.oom_events))


def new_counts(report: TrialReport, counted: Counted) -> dict[str, int]:
    """The OOMs in ``report`` not yet in ``counted``, by phase (a report carries all of its
    trial's events since it started, a restored trial's from its checkpoint)."""
    phases: dict[str, int] = {}
    for event in report.oom_events[counted.events:]:
        phases[event.phase] = phases.get(event.phase, 0) + 1
    killed = Counted.of(report).killed
    if killed > counted.killed:
        phases[KILLED] = killed - counted.killed
    return phases


class CountOomRetries(tune.Callback):
    """Tune callback (driver side): each trial's new OOM retries onto the Ray counter."""

    def __init__(self, experiment: str):
        self.experiment = experiment
        self._counted: dict[str, Counted] = {}  # trials that had OOMs, by id; a completed one reports no more
        self._counter = None

    # Tune pickles its callbacks with the run config; the Ray metric is this process's.
    def __getstate__(self) -> dict:
        return {**self.__dict__, "_counter": None}

    def get_state(self) -> dict:
        return {"counted": dict(self._counted)}

    def set_state(self, state: dict) -> None:
        self._counted = dict(state["counted"])

    def setup(self, **info) -> None:
        from ray.util.metrics import Counter

        # Prometheus appends `_total` to counters: exported as ray_orchestrator_oom_retries_total.
        self._counter = Counter(PREFIX + "oom_retries", "Out-of-memory errors the trial recovered from by shrinking its plan",
                                tag_keys=TRIAL_TAGS + ("phase",))

    def on_trial_result(self, iteration, trials, trial, result, **info) -> None:
        counted = self._counted.get(trial.trial_id, Counted())
        if (result.get("oom_retries") or 0) <= counted.events + counted.killed:  # most reports: read no further
            return
        report = TrialReport.from_result(result)
        tags = trial_tags(self.experiment, trial.trial_id, trial.config.get("workload"))
        for phase, count in new_counts(report, counted).items():
            self._counter.inc(count, tags={**tags, "phase": phase})
        self._counted[trial.trial_id] = Counted.of(report)
        global _last_count_at
        _last_count_at = time.monotonic()

    def on_trial_complete(self, iteration, trials, trial, **info) -> None:
        self._counted.pop(trial.trial_id, None)


def wait_for_export() -> float:
    """Where this driver counted an OOM less than one export interval ago, wait until Ray has
    exported it (the cluster keeps the value after the driver exits; a driver that exits first
    takes it along). Returns the seconds waited."""
    if _last_count_at is None:
        return 0.0
    interval = metrics_export_interval_s()
    left = _last_count_at + interval + EXPORT_SLACK_S - time.monotonic()
    if left <= 0:
        return 0.0
    print(f"Waiting {left:.0f} s for Ray to export the last OOM counts to the cluster's metrics "
          f"(it exports every {interval:g} s)", flush=True)
    time.sleep(left)
    return left
