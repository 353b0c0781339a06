"""A sweep whose trials no node can hold fails before it starts, or, on an autoscaling cluster,
after ``resources.wait_minutes`` with the reason, instead of staying PENDING forever."""

from __future__ import annotations

import time

import pytest

from orchestrator.capacity import check_local_node, group_unschedulable_reason, trial_request, unschedulable_reason
from orchestrator.config import parse_spec
from orchestrator.errors import UserError

RAW = {
    "experiment": "capacity", "workload": {"name": "mlp", "params": {"depth": 1, "width": 16}},
    "search_space": {"lr": {"grid": [0.01, 0.1]}}, "effective_batch_size": 64, "stop": {"epochs": 1},
    "memory": {"device": "cpu", "estimator": "none"},
}
LAPTOP, GPU_BOX = {"CPU": 8.0, "memory": 1e10}, {"CPU": 16.0, "GPU": 2.0}


def test_a_trial_fits_when_one_node_has_all_it_asks():
    assert unschedulable_reason({"CPU": 2.0, "GPU": 1.0}, [LAPTOP, GPU_BOX]) is None
    assert unschedulable_reason({"CPU": 2.0, "GPU": 0.25}, [GPU_BOX]) is None
    assert unschedulable_reason({"CPU": 2.0, "GPU": 0.0}, [LAPTOP]) is None


def test_what_no_node_has_is_said():
    assert unschedulable_reason({"CPU": 2.0, "GPU": 3.0}, [LAPTOP, GPU_BOX]) == (
        "a trial needs CPU 2, GPU 3 on one node, and no node of the cluster has that (the largest of 2: CPU 16, GPU 2)"
    )
    # Resources of two nodes do not add up for one trial.
    assert unschedulable_reason({"CPU": 12.0, "GPU": 0.0}, [LAPTOP, LAPTOP]) is not None
    assert "no alive node" in unschedulable_reason({"CPU": 1.0, "GPU": 0.0}, [])


def test_a_data_parallel_trial_spreads_its_workers_over_nodes():
    worker = {"CPU": 1.0, "GPU": 1.0}
    assert group_unschedulable_reason(worker, 4, [GPU_BOX, GPU_BOX]) is None  # 2 + 2 GPUs on two nodes
    assert group_unschedulable_reason(worker, 4, [GPU_BOX, LAPTOP]) == (
        "a trial needs 4 workers of CPU 1, GPU 1 each, and the cluster's 2 node(s) hold 2 such worker(s) at most; "
        "use resources.workers: 2"
    )
    assert "no node of the cluster holds one" in group_unschedulable_reason(worker, 2, [LAPTOP])


def test_a_local_ray_too_small_for_a_group_is_one_line_before_it_starts():
    with pytest.raises(UserError) as err:
        check_local_node({"CPU": 1.0, "GPU": 1.0}, 4, {"CPU": 16.0, "GPU": 2.0})
    assert str(err.value) == (
        "resources: a trial needs 4 workers of CPU 1, GPU 1 each, and the cluster's 1 node(s) hold 2 such worker(s) "
        "at most; use resources.workers: 2; ask for less (resources.workers, resources.cpu, resources.gpu) or give "
        "the local Ray more (--num-cpus, --num-gpus)"
    )
    check_local_node({"CPU": 1.0, "GPU": 0.0}, 2, {"CPU": 2.0, "GPU": 0.0})  # fits: nothing raised


def test_the_request_is_the_trials():
    assert trial_request(parse_spec({**RAW, "resources": {"cpu": 2, "gpu": 3}})) == {"CPU": 2.0, "GPU": 3.0}
    auto = parse_spec({**RAW, "resources": {"gpu": "auto"}, "memory": {"gpu_granularity": 0.25}})
    assert trial_request(auto) == {"CPU": 1.0, "GPU": 0.25}  # some share of a GPU: any GPU will do


@pytest.mark.integration
def test_unschedulable_trials_fail_before_the_sweep_or_after_the_wait(local_ray, tmp_path):
    """On a 2-CPU local Ray: 3 CPUs per trial stop the run at once; with a wait (an autoscaling
    cluster's) the sweep starts, nothing joins, and it stops with the reason in every row."""
    from orchestrator.runner import run_sweep

    where = {"tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}", "storage_path": str(tmp_path / "results")}
    with pytest.raises(UserError) as err:
        run_sweep(parse_spec({**RAW, "resources": {"cpu": 3}}), **where)
    assert str(err.value).startswith("resources: a trial needs CPU 3 on one node, and no node of the cluster has that")

    started = time.monotonic()
    outcome = run_sweep(parse_spec({**RAW, "resources": {"cpu": 3, "wait_minutes": 0.05}}), **where)
    assert time.monotonic() - started < 120
    assert not outcome.ok and outcome.stop_reason.endswith("after waiting 0.05 min (resources.wait_minutes)")
    assert [(r.status, r.note) for r in outcome.rows] == [("INTERRUPTED", outcome.stop_reason)] * 2
