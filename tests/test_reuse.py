"""What a worker remembers between the trials it runs (the sweeps that reuse workers are also in
``test_trainable.py``), and that a reused worker starts each trial with nothing left on its
device by the trials before it."""

import csv
import gc
import glob
import os

import pytest
import torch

from orchestrator.device import open_device
from orchestrator.trial.reuse import WorkerHistory


def test_a_reused_workers_budget_adds_back_its_own_cuda_context():
    history = WorkerHistory()
    assert history.gpu_free_before_context(70 * 2**30) == 70 * 2**30  # first trial: read before the context
    history.cuda_context_bytes = 600 * 2**20
    assert history.gpu_free_before_context(70 * 2**30) == 70 * 2**30 + 600 * 2**20
    assert history.gpu_free_before_context(None) is None  # no NVML


def test_a_reused_worker_collects_garbage_only_where_the_last_trial_left_something():
    """A trial that left nothing allocated costs the next one no garbage collection (a full one
    is a quarter of a one-second trial); one that left a tensor in a reference cycle has it
    collected before it is counted, so only what really outlived it is reported."""
    device = open_device("cpu")
    history = WorkerHistory(last_device=device)
    collections = []

    def seen(phase, info):
        if phase == "start":
            collections.append(info["generation"])

    was_enabled = gc.isenabled()
    gc.disable()  # only the collections left_behind asks for
    gc.callbacks.append(seen)
    try:
        assert history.left_behind() == 0 and collections == []
        with device.measuring():
            cycle = [torch.ones(1024)]
            cycle.append(cycle)  # only a collection frees it
            kept = torch.ones(256)
        del cycle
        assert history.left_behind() == kept.nbytes and collections == [2]
    finally:
        gc.callbacks.remove(seen)
        if was_enabled:
            gc.enable()


def _reused_sweep(tmp_path, workload: str) -> list[int | None]:
    """Three trials one after another (each takes both CPUs, so one worker runs them all) on the
    CPU, whose tensor tracker counts what each trial allocates: each trial's ``left_behind_bytes``
    in its first report (None where it has none), in order. A trial takes under a second here and
    Tune's ``timestamp`` counts whole seconds, so the order is not the reports' times: exactly one
    trial (the worker's first) has nothing to report, and the others come after it."""
    from orchestrator.config import parse_spec
    from orchestrator.runner import run_sweep

    raw = {
        "experiment": "reuse_test", "workload": {"name": workload, "params": {"width": 16, "train_samples": 256}},
        "search_space": {"lr": {"grid": [0.01, 0.003, 0.001]}}, "effective_batch_size": 64, "stop": {"epochs": 2},
        "resources": {"cpu": 2}, "memory": {"device": "cpu", "estimator": "none"},
    }
    outcome = run_sweep(parse_spec(raw), tracking_uri=f"sqlite:///{tmp_path}/mlflow.db", storage_path=str(tmp_path / "results"))
    assert outcome.ok, outcome.rows
    firsts = []
    for folder in glob.glob(os.path.join(outcome.experiment_path, "train_trial_*")):
        with open(os.path.join(folder, "progress.csv")) as f:
            firsts.append(next(csv.DictReader(f)))
    assert len(firsts) == 3 and len({r["pid"] for r in firsts}) == 1  # one worker ran all three
    left = [int(r["left_behind_bytes"]) if r.get("left_behind_bytes") else None for r in firsts]
    assert left.count(None) == 1, left  # a fresh worker: nothing to ask
    return sorted(left, key=lambda b: b is not None)


@pytest.mark.integration
@pytest.mark.usefixtures("local_ray")
def test_a_reused_worker_starts_each_trial_with_nothing_left_by_the_one_before(tmp_path):
    assert _reused_sweep(tmp_path / "clean", "mlp") == [None, 0, 0]
    # The check sees what does outlive a trial: a workload that keeps its models in a
    # module-level list leaves each trial's weights behind, which the next trial finds.
    weights = 4 * (32 * 16 + 16 + 16 * 16 + 16 + 16 * 8 + 8)  # the width-16 MLP's fp32 parameters
    assert _reused_sweep(tmp_path / "kept", "tests.workloads:KeepsItsModelWorkload") == [None, weights, weights]
