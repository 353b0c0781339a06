"""A sweep on a real Ray cluster of three nodes on this machine, one of which is lost mid-sweep.

Three ``ray start`` processes (a head and two workers that join it, each with its own temp
folder, name, one CPU and its own emulated-GPU size declared as a node label), as a user starts
them on three machines. The sweep goes in through ``orchestrator run --address`` as a Ray Job.
Once a trial on ``node-b`` has written a checkpoint, ``node-b``'s raylet is killed (a machine
that disappears): Tune restarts that trial from its checkpoint in the shared storage path on a
surviving node, with its plan, re-made if that node's device is smaller. The test stops only
the Ray processes it started, by PID.
"""

from __future__ import annotations

import glob
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ray_cluster import alive_node_names, descendants, start_head, start_worker

from orchestrator.contract import records_from_report
from orchestrator.errors import UserError
from orchestrator.preflight import check_shared_storage
from orchestrator.trial.node import CAPACITY_LABEL
from tests.conftest import trial_results

ROOT = Path(__file__).resolve().parent.parent
CONFIG = "configs/multinode_cpu.yaml"
MiB = 2**20
#: node name -> the emulated device it declares
CAPACITIES = {"head": "4MiB", "node-b": "4MiB", "node-c": "2MiB"}


def test_a_relative_storage_path_is_refused_on_several_nodes():
    check_shared_storage("./results", "/somewhere/results", 1)  # one node: its disk is the cluster's
    check_shared_storage("/shared/results", "/shared/results", 3)
    with pytest.raises(UserError) as refused:
        check_shared_storage("./orchestrator_results", "/tmp/job/orchestrator_results", 3)
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith("storage_path: './orchestrator_results' is relative") and "3 nodes" in message


@pytest.fixture(scope="module")
def cluster(isolated_environment, ray_temp_dir):
    """Head plus node-b and node-c, one CPU each; stopped by PID, all of it, at the end."""
    root = ray_temp_dir("mn")
    head = start_head(root / "h", num_cpus=1, node_name="head", labels={CAPACITY_LABEL: CAPACITIES["head"]})
    workers = {}
    try:
        for name in ("node-b", "node-c"):
            workers[name] = start_worker(head, root / name[-1], name, 1, {CAPACITY_LABEL: CAPACITIES[name]})
        yield head, workers
    finally:
        pids = [head.process.pid, *descendants(head.process.pid)]
        for worker in workers.values():
            pids += [worker.process.pid, *descendants(worker.process.pid)]
            worker.stop()
        head.stop()
        time.sleep(1)
        left = [pid for pid in pids if Path(f"/proc/{pid}").exists() and _state(pid) != "Z"]
        assert not left, f"Ray processes left behind: {left}"


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"


def _results(storage: Path) -> dict[str, list[dict]]:
    return trial_results(f"{storage}/multinode_cpu_*/*/result.json")


@pytest.mark.integration
def test_a_sweep_spreads_over_nodes_and_survives_losing_one(cluster, tmp_path):
    head, workers = cluster
    storage = tmp_path / "shared"  # on one machine every absolute path is reachable by every node
    tracking = f"sqlite:///{tmp_path}/mlflow.db"

    # A relative storage path is refused on this cluster, in one line, before any trial.
    refused = subprocess.run(
        [sys.executable, "-m", "orchestrator", "run", CONFIG, "--address", head.dashboard_url,
         "--tracking-uri", tracking], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert refused.returncode != 0
    assert "storage_path: './orchestrator_results' is relative" in refused.stdout + refused.stderr

    started = time.monotonic()
    # A worker per trial (`reuse: false`): Tune places the first three trials on the three nodes at
    # once. With reuse, the head's worker, started first, may take the trial node-b's worker is
    # still starting for on a busy machine (Tune cancels that start), and node-b runs nothing.
    run = subprocess.Popen(
        [sys.executable, "-m", "orchestrator", "run", CONFIG, "--address", head.dashboard_url,
         "--storage-path", str(storage), "--tracking-uri", tracking, "--set", "reuse=false"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    # Lose node-b once one of its trials has a checkpoint and has epochs left.
    killed_trial = None
    deadline = time.monotonic() + 300
    while killed_trial is None and time.monotonic() < deadline and run.poll() is None:
        for trial, lines in _results(storage).items():
            last = lines[-1]
            has_checkpoint = glob.glob(f"{trial}/checkpoint_*")
            # Epochs left (6 in all): the trial cannot finish between this look and the kill.
            if last.get("node_name") == "node-b" and has_checkpoint and last.get("epoch", 6) <= 3:
                workers["node-b"].kill()
                killed_trial = trial
                break
        time.sleep(0.5)
    assert killed_trial, "no trial of node-b reached a checkpoint with epochs left"
    out, _ = run.communicate(timeout=400)
    print(out[-6000:])
    print(f"sweep with a lost node took {time.monotonic() - started:.0f} s")
    assert run.returncode == 0, out[-6000:]
    assert "node-b" not in alive_node_names(head)

    results = _results(storage)
    assert len(results) == 4
    # Spread: trials ran on every node, each planned for its node's device.
    firsts = {lines[0]["node_name"] for lines in results.values()}
    assert firsts >= {"node-b", "node-c"} and len(firsts) >= 2
    for lines in results.values():
        for line in lines:
            budget = line["budget_bytes"]
            if line.get("moved"):
                continue
            assert budget == {"4MiB": 4 * MiB, "2MiB": 2 * MiB}[CAPACITIES[line["node_name"]]]
    plans = {(line["budget_bytes"], line["micro_batch"]) for lines in results.values() for line in lines}
    assert {b for b, _ in plans} == {2 * MiB, 4 * MiB}
    assert all(micro == 256 for b, micro in plans if b == 4 * MiB)
    # At 2 MiB the estimate plans under 256 x 1; the measurement of the first steps on the device
    # (plan verification) may take a trial up to 256 x 1 where that measured within the limit.
    for lines in results.values():
        for line in lines:
            if line["budget_bytes"] == 2 * MiB and line["micro_batch"] >= 256:
                checks = records_from_report(line.get("plan_checks"))
                assert any(c["new_plan"].startswith(f"{line['micro_batch']} x") for c in checks), line
                assert all(c["measured_bytes"] <= c["limit_bytes"] for c in checks
                           if c["plan"].startswith(f"{line['micro_batch']} x")), line
                assert line["oom_retries"] == 0, line

    # The lost node's trial moved, resumed from its checkpoint (not from epoch 0), and finished.
    moved = results[killed_trial]
    final = moved[-1]
    assert final["training_done"] == 1 and final["epoch"] == 6
    [move] = records_from_report(final["moves"])
    assert move["from_node"] == "node-b" and move["to_node"] in {"head", "node-c"}
    assert move["reason"] == "node node-b lost"
    assert move["epoch"] >= 1
    if move["to_node"] == "node-c":  # smaller device: re-planned from the checkpoint
        assert move["replanned"].startswith("256 x 1") and "budget 4.0 MiB -> 2.0 MiB" in move["replanned"]
    else:
        assert move["replanned"] == ""
    assert final["oom_retries"] == 0  # a lost node is not an OOM
    after = [line for line in moved if line.get("moved")]
    assert after and after[0]["epoch"] == move["epoch"] + 1
    assert all(line["node_name"] == "node-b" for line in moved if not line.get("moved"))
    # The final table shows where each trial ran and which one moved, and why.
    assert "node" in out and f"moved node-b->{move['to_node']} after epoch {move['epoch']}: node node-b lost" in out
    assert "4/4 trials finished" in out

    # MLflow has every epoch of every trial exactly once, and the moved trial's node and move.
    import mlflow

    client = mlflow.MlflowClient(tracking)
    [experiment] = [e for e in client.search_experiments() if e.name == "multinode_cpu"]
    runs = [r for r in client.search_runs([experiment.experiment_id]) if r.data.tags.get("orchestrator.role") == "trial"]
    assert len(runs) == 4
    for r in runs:
        epochs = sorted(m.value for m in client.get_metric_history(r.info.run_id, "epoch"))
        assert epochs == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0], (r.info.run_name, epochs)
    moved_runs = [r for r in runs if "moves" in r.data.tags]
    assert len(moved_runs) == 1 and "node node-b lost" in moved_runs[0].data.tags["moves"]
    assert moved_runs[0].data.tags["node_name"] == move["to_node"]

    # The report read from MLflow: the node of each trial, and the move.
    report = subprocess.run(
        [sys.executable, "-m", "orchestrator", "report", "multinode_cpu", "--tracking-uri", tracking,
         "--out", str(tmp_path / "report")], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert report.returncode == 0, report.stderr
    header = next(line for line in report.stdout.splitlines() if line.startswith("trial "))
    assert header.split()[:2] == ["trial", "node"]
    assert "moved node-b->" in report.stdout and "node node-b lost" in report.stdout


@pytest.mark.integration
def test_a_data_parallel_trial_spans_two_nodes_and_plans_for_the_smaller_device(cluster, tmp_path):
    """Two ranks of one CPU each on a cluster of one-CPU nodes: Ray places them on two nodes,
    gloo connects them over the nodes' addresses, and the group runs the tightest rank's plan."""
    head, workers = cluster
    if "node-b" in alive_node_names(head):  # run alone: leave head (4 MiB) and node-c (2 MiB)
        workers["node-b"].kill()
        deadline = time.monotonic() + 120
        while "node-b" in alive_node_names(head) and time.monotonic() < deadline:
            time.sleep(1)
    storage = tmp_path / "shared"
    run = subprocess.run(
        [sys.executable, "-m", "orchestrator", "run", CONFIG, "--address", head.dashboard_url,
         "--storage-path", str(storage), "--tracking-uri", f"sqlite:///{tmp_path}/mlflow.db",
         "--set", "resources.workers=2", "--set", "search_space.lr={grid: [0.01]}", "--set", "stop.epochs=2"],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    out = run.stdout + run.stderr
    print(out[-6000:])
    assert run.returncode == 0, out[-6000:]
    assert "1/1 trials finished" in out
    assert alive_node_names(head) == {"head", "node-c"}  # one CPU each: a rank on each
    [lines] = _results(storage).values()
    final = lines[-1]
    assert final["ranks"] == 2 and final["training_done"] == 1 and final["effective_batch"] == 256
    # 128 samples per rank per step: 4 MiB holds them at once (256 x 1 for one process), 2 MiB does
    # not, so the group's plan is the 2 MiB rank's, whichever rank that was, and both ranks stay under it.
    assert final["micro_batch"] < 128 and final["micro_batch"] * final["accum_steps"] >= 128
    assert max(final["rank0_peak_allocated_bytes"], final["rank1_peak_allocated_bytes"]) <= 2 * MiB
    assert f"{final['micro_batch']} x {final['accum_steps']} x 2 ranks" in out
