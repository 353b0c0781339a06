"""Per-trial gauges: a no-op outside Ray, and ``ray_orchestrator_*`` series with the right
values on the node's Prometheus endpoint when a Ray actor records them (the OOM counter is the
driver's: tests/test_oom_counter.py, and on the endpoint tests/test_ray_job.py)."""

from __future__ import annotations

import glob
import time
from dataclasses import replace
from pathlib import Path

import pytest
import requests
from ports import free_ports
from prometheus_client.parser import text_string_to_metric_families

from orchestrator.trial.metrics import TrialMetrics
from orchestrator.trial_report import RankPeak, TrialReport

EPOCH = TrialReport(
    predicted_peak_bytes=1_000_000, peak_allocated_bytes=800_000, peak_reserved_bytes=900_000,
    micro_batch=16, eval_batch=32, oom_retries=0,
)


def test_outside_ray_every_call_is_a_no_op():
    metrics = TrialMetrics("exp", "trial_0", "mlp")
    metrics.record_result(EPOCH)
    assert metrics._metrics is None


def samples(text: str, name: str) -> list:
    """The samples of one metric family in Prometheus text (counters drop `_total` in the family name)."""
    return [s for family in text_string_to_metric_families(text) if family.name == name for s in family.samples]


@pytest.mark.integration
def test_actor_metrics_reach_the_prometheus_endpoint(isolated_environment, ray_temp_dir):
    ray = pytest.importorskip("ray")
    temp_dir = ray_temp_dir("m")
    dashboard_port, metrics_port = free_ports(2)
    ray.init(
        address="local", include_dashboard=True, num_cpus=1, dashboard_host="127.0.0.1",
        dashboard_port=dashboard_port, _temp_dir=str(temp_dir), _metrics_export_port=metrics_port,
    )
    try:
        @ray.remote(num_cpus=1)
        class Trial:
            def run(self):
                metrics = TrialMetrics("exp_m", "trial_a", "mlp")
                metrics.record_result(replace(EPOCH, peak_allocated_bytes=1))
                metrics.record_result(replace(EPOCH, peak_reserved_bytes=None))  # a gauge keeps the last value
                # A data-parallel trial: its worst rank above, each rank here.
                metrics.record_result(TrialReport(rank_peaks=(RankPeak(700_000), RankPeak(800_000))))
                return True

        trial = Trial.remote()
        assert ray.get(trial.run.remote())

        # Users find the port the same way: Ray writes it under session_latest.
        [port_file] = glob.glob(str(temp_dir / "session_latest" / "metrics_export_port_*"))
        url = f"http://127.0.0.1:{Path(port_file).read_text().strip()}/metrics"
        started, text = time.monotonic(), ""
        while time.monotonic() - started < 60:  # Ray exports every few seconds, ~15 s after the call
            text = requests.get(url, timeout=10).text
            if samples(text, "ray_orchestrator_eval_batch"):
                break
            time.sleep(2)
        print(f"metrics seen after {time.monotonic() - started:.1f} s")

        def values(name: str) -> dict:
            return {
                tuple(sorted((k, v) for k, v in s.labels.items() if k in ("kind", "phase", "rank"))): s.value
                for s in samples(text, name)
                if s.labels.get("experiment") == "exp_m" and s.labels.get("trial_id") == "trial_a"
                and s.labels.get("workload") == "mlp"
            }

        assert values("ray_orchestrator_planned_peak_bytes") == {(): 1_000_000}
        assert values("ray_orchestrator_measured_peak_bytes") == {
            (("kind", "allocated"),): 800_000, (("kind", "reserved"),): 900_000,
        }
        assert values("ray_orchestrator_rank_peak_bytes") == {
            (("kind", "allocated"), ("rank", "0")): 700_000, (("kind", "allocated"), ("rank", "1")): 800_000,
        }
        assert values("ray_orchestrator_micro_batch") == {(): 16}
        assert values("ray_orchestrator_eval_batch") == {(): 32}
        ray.kill(trial)
    finally:
        ray.shutdown()
