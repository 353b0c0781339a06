"""What ``run --dashboard`` prints beside the dashboard's address."""

from orchestrator.dashboard import metrics_line


def test_the_metrics_port_is_the_sweeps_own_rays():
    """Read from ``ray.nodes()`` of the sweep's Ray: ``session_latest`` may be another Ray's."""
    nodes = [{"NodeManagerAddress": "127.0.0.1", "MetricsExportPort": 43557, "Alive": True},
             {"NodeManagerAddress": "10.0.0.2", "MetricsExportPort": 41000, "Alive": False}]
    assert metrics_line(nodes) == "  Its metrics (Prometheus text, ray_orchestrator_*): http://127.0.0.1:43557/metrics"
    assert metrics_line([{"NodeManagerAddress": "127.0.0.1"}]) is None
