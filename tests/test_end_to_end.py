"""The README's first command, cut to two trials: a real CLI process, a real local Ray, a real
MLflow SQLite store read back with MLflow's client."""

import os
import subprocess
import sys

import mlflow
import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.integration

TWO_TRIALS = [
    "--set", "search_space.workload={grid: [mlp, cnn]}",
    "--set", "search_space.lr=0.03",
    "--set", "search_space.width=16",
    "--set", "stop.epochs=2",
]


def test_the_demo_sweep_runs_and_every_trial_is_in_mlflow(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "orchestrator", "run", str(ROOT / "configs" / "demo_cpu.yaml"), *TWO_TRIALS,
         "--num-cpus", "2"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Estimated the memory of 2 distinct trial configuration(s) for a cpu device" in proc.stdout
    table = proc.stdout[proc.stdout.index("trial  "):]
    assert "micro x accum" in table and "peak memory" in table
    assert table.count("TERMINATED") == 2 and "2/2 trials finished" in table
    assert "workload=mlp" in table and "workload=cnn" in table

    # The default store: a SQLite file in the working directory.
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    experiment = client.get_experiment_by_name("demo_cpu")
    runs = client.search_runs([experiment.experiment_id])
    trials = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    assert len(trials) == 2 and len(runs) == 3
    for run in trials:
        assert run.info.status == "FINISHED"
        assert run.data.params["config.lr"] == "0.03"
        assert run.data.params["estimated_by"] == "driver"  # one estimate per workload, made before the trials
        assert run.data.params["config.workload"] in ("mlp", "cnn")
        # one report per epoch, at MLflow step = optimizer steps so far (2048 or 1024 samples / 64)
        per_epoch = {"mlp": 32, "cnn": 16}[run.data.params["config.workload"]]
        for metric in ("train_loss", "eval_loss", "peak_allocated_bytes", "epoch"):
            assert [m.step for m in client.get_metric_history(run.info.run_id, metric)] == [per_epoch, 2 * per_epoch], metric
