"""The driver counts each OOM retry once, by phase, across reports, restarts and a resumed driver,
and waits for Ray's export only when a count is younger than one export interval."""

from __future__ import annotations

import pickle
import time
from types import SimpleNamespace

import pytest

from orchestrator import oom_counter
from orchestrator.contract import OomEvent
from orchestrator.oom_counter import (
    KILLED,
    Counted,
    CountOomRetries,
    new_counts,
    wait_for_export,
)
from orchestrator.ray_internals import metrics_export_interval_s
from orchestrator.trial_report import TrialReport


def oom(phase: str, step: int) -> OomEvent:
    return OomEvent(phase=phase, epoch=1, step=step, micro_batch=64, eval_batch=64,
                    bytes_requested=None, bytes_allocated=1, bytes_reserved=None, message="CUDA out of memory")


def report(*events: OomEvent, killed: int = 0) -> TrialReport:
    return TrialReport(oom_events=events, oom_retries=len(events) + killed)


def test_only_the_events_a_report_adds_are_counted_by_phase():
    assert new_counts(report(), Counted()) == {}
    assert new_counts(report(oom("train", 3), oom("train", 5), oom("eval", 5)), Counted()) == {"train": 2, "eval": 1}
    assert new_counts(report(oom("train", 3), oom("eval", 5)), Counted(events=1)) == {"eval": 1}


def test_a_worker_killed_by_memory_is_counted_once_when_its_restart_reports():
    """The restart's reports carry the reduction Tune asked for (``oom_retries`` beyond the events)."""
    assert new_counts(report(oom("train", 3), killed=1), Counted(events=1)) == {KILLED: 1}
    assert new_counts(report(oom("train", 3), killed=1), Counted(events=1, killed=1)) == {}


def result(*events: OomEvent, killed: int = 0) -> dict:
    return report(*events, killed=killed).to_metrics()


def test_the_callback_counts_each_retry_once_and_a_resumed_driver_goes_on_from_its_state():
    trial = SimpleNamespace(trial_id="t1", config={"workload": "mlp"})
    first = CountOomRetries("exp")
    first.setup()
    first.on_trial_result(0, [], trial, result(oom("train", 3)))
    first.on_trial_result(1, [], trial, result(oom("train", 3)))
    assert first.get_state()["counted"] == {"t1": Counted(events=1)}

    resumed = pickle.loads(pickle.dumps(first))  # how Tune keeps the callback with the run config
    resumed.set_state(pickle.loads(pickle.dumps(first.get_state())))
    resumed.setup()
    resumed.on_trial_result(2, [], trial, result(oom("train", 3), oom("eval", 4), killed=1))
    assert resumed.get_state()["counted"] == {"t1": Counted(events=2, killed=1)}
    resumed.on_trial_complete(3, [], trial)
    assert resumed.get_state()["counted"] == {}


@pytest.fixture
def last_count(monkeypatch):
    """Sets when this process last counted, as the callback does."""
    return lambda at: monkeypatch.setattr(oom_counter, "_last_count_at", at)


def test_nothing_counted_or_counted_long_ago_is_no_wait(last_count):
    last_count(None)
    assert wait_for_export() == 0
    last_count(time.monotonic() - metrics_export_interval_s() - 5)
    assert wait_for_export() == 0


def test_a_recent_count_waits_out_the_rest_of_one_export_interval(last_count, capsys):
    last_count(time.monotonic() - metrics_export_interval_s() + 0.5)
    started = time.monotonic()
    waited = wait_for_export()
    assert 1.0 <= waited <= 1.6 and time.monotonic() - started >= waited - 0.05
    assert "Waiting 1 s for Ray to export the last OOM counts" in capsys.readouterr().out
