"""Does a cluster of several Ray nodes cost the sweep anything against one node of the same CPUs?

    python bench/multinode.py              # 2 interleaved rounds
    python bench/multinode.py --rounds 3

The same sweep (``configs/multinode_cpu.yaml``: 4 trials of the MLP, 6 epochs, one CPU each)
submitted with ``orchestrator run --address`` as a Ray Job to two clusters started here with
``ray start``, each with token auth, its own temp folder and free ports:

* ``3 nodes``: a head and two worker nodes joined to it, one CPU each;
* ``1 node``: one head with three CPUs.

Every node declares the same emulated device (4 MiB) so that the plans, and so the work, are
the same on both. The clusters' start-up is not timed: the wall time runs from submitting the
job to the end of its summary. On one machine the nodes share its cores, so this measures what
the cluster adds (scheduling over nodes, a raylet per node, checkpoints read back from the
shared storage path), not speed; expect a ratio near 1.0. Rounds are interleaved so that other
work on the machine slows each alike. Only the Ray processes started here are stopped, by PID.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from ray_cluster import start_head, start_worker  # noqa: E402 - the tests' cluster helpers

from orchestrator.trial.node import CAPACITY_LABEL  # noqa: E402

CONFIG = "configs/multinode_cpu.yaml"
LABELS = {CAPACITY_LABEL: "4MiB"}


def start(layout: str, root: Path):
    """The cluster's head and the processes to stop at the end."""
    if layout == "1 node":
        head = start_head(root / "h", num_cpus=3, node_name="head", labels=LABELS)
        return head, [head]
    head = start_head(root / "h", num_cpus=1, node_name="head", labels=LABELS)
    workers = [start_worker(head, root / f"w{i}", f"node-{i}", 1, LABELS) for i in (1, 2)]
    return head, [*workers, head]


def timed_sweep(head, folder: Path) -> float:
    started = time.perf_counter()
    run = subprocess.run(
        [sys.executable, "-m", "orchestrator", "run", CONFIG, "--address", head.dashboard_url,
         "--storage-path", str(folder / "results"), "--tracking-uri", f"sqlite:///{folder}/mlflow.db"],
        cwd=ROOT, capture_output=True, text=True,
    )
    seconds = time.perf_counter() - started
    if run.returncode != 0 or "4/4 trials finished" not in run.stdout:
        raise SystemExit(f"the sweep failed:\n{run.stdout[-3000:]}\n{run.stderr[-2000:]}")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    os.environ.update({"RAY_USAGE_STATS_ENABLED": "0", "MLFLOW_DISABLE_TELEMETRY": "true",
                       "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"})
    times: dict[str, list[float]] = {"3 nodes": [], "1 node": []}
    with tempfile.TemporaryDirectory(prefix="mnb", dir="/tmp") as tmp:
        os.environ["HOME"] = str(Path(tmp) / "home")  # Ray's token goes here, not into the user's home
        for round_ in range(args.rounds):
            for layout in times:
                folder = Path(tmp) / f"{round_}{layout[0]}"
                head, processes = start(layout, folder)
                try:
                    times[layout].append(timed_sweep(head, folder))
                finally:
                    for process in processes:
                        process.stop()
                print(f"round {round_ + 1} {layout}: {times[layout][-1]:.1f} s", flush=True)
    base = statistics.median(times["1 node"])
    print()
    print(f"{'cluster':<10} {'CPUs':>4} {'median s':>9} {'rounds':>16} {'vs 1 node':>9}")
    for layout, values in times.items():
        rounds = " ".join(f"{v:.1f}" for v in values)
        print(f"{layout:<10} {3:>4} {statistics.median(values):>9.1f} {rounds:>16} {statistics.median(values) / base:>8.2f}x")


if __name__ == "__main__":
    main()
