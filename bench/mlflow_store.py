"""What one trial's MLflow writes cost the driver, and whether that grows with the runs a store holds.

    python bench/mlflow_store.py                      # 2,048 trials into a fresh SQLite store
    python bench/mlflow_store.py --trials 512 --uri sqlite:////tmp/other.db

A sweep of short trials spends a large part of its driver's CPU in the MLflow outbox
(``bench/sweep_scale.py``: ~50 ms a trial at 128 trials, ~60 ms at 2,048). This bench sends, for
each of ``--trials`` trials one after another, what the tracking callback queues for a trial of
three evaluations (its start with its config and resources, its once-only facts, three results
of a real report's numbers, its final plan, its end), merged into rounds as the outbox merges
them (``orchestrator.tracking.batching``) and applied by the outbox's own ``MlflowWriter``. It
prints, per block of trials, the CPU time a trial took in each MLflow call (``create_run``,
``log_batch``, ``set_terminated``) and in all: a cost that grows with the runs the store already
holds shows as rising rows.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
import time
import uuid

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

from orchestrator.tracking.batching import merged  # noqa: E402
from orchestrator.tracking.callback import changing_tags, once_params  # noqa: E402
from orchestrator.tracking.flatten import param_text, plan_params, result_metrics  # noqa: E402
from orchestrator.tracking.operations import AddParams, EndRun, LogResult, SetTags, StartRun  # noqa: E402
from orchestrator.tracking.runs import SweepIdentity, TrialRef  # noqa: E402
from orchestrator.tracking.writer import MlflowWriter  # noqa: E402
from orchestrator.trial_report import TrialReport  # noqa: E402

#: A trial's report as the demo MLP's trials send it (an evaluation of ``orchestrator run
#: configs/demo_cpu.yaml``), less Tune's own keys.
PLAN = {"micro_batch": 64, "accum_steps": 1, "effective_batch": 64, "eval_batch": 64, "activation_checkpointing": False,
        "precision": "fp32", "estimator": "trace", "budget_bytes": None, "predicted_peak_bytes": 40100,
        "predicted_phase": "train", "predicted_phases": {"train": 40100, "eval": 28152}, "reductions": 0, "note": "",
        "refusal": None, "safety_margin": None, "ranks": 1, "rank_budgets": [], "exchange_bytes": 0, "corrections": {},
        "measured_phases": {}, "error_bound": 0.0, "compiled": False}
REPORT = {"train_loss": 2.0990, "eval_loss": 2.1012, "learning_rate": 0.01, "steps_per_second": 31.4,
          "samples_per_second": 2007.0, "plan": PLAN, "micro_batch": 64, "accum_steps": 1, "effective_batch": 64,
          "eval_batch": 64, "activation_checkpointing": 0, "precision": "fp32", "plan_reductions": 0, "estimator": "trace",
          "estimated_by": "driver", "predicted_peak_bytes": 40100, "predicted_phase": "train",
          "memory_source": "cpu_tensor_tracker", "peak_allocated_bytes": 29410, "prediction_error": -0.27,
          "node_name": "127.0.0.1", "oom_retries": 0, "moved": 0, "time_total_s": 1.6}
EPOCHS = 3
STEPS_PER_EPOCH = 160


def trial_writes(n: int) -> list[list]:
    """The writes the callback queues for trial ``n``, in the outbox rounds a short trial's
    writes fall into: its start and first result, its other results, its end."""
    ref = TrialRef(f"bench_{n:05d}", f"train_trial_bench_{n:05d}", "mlp")
    config = {"config.workload": "mlp", "config.lr": param_text(0.001 * (n % 97 + 1)), "config.width": "64",
              "resources.cpu": "1", "resources.gpu": "0"}
    reports = [TrialReport.from_result({**REPORT, "epoch": epoch, "step": epoch * STEPS_PER_EPOCH})
               for epoch in range(1, EPOCHS + 1)]
    results = [LogResult(ref, report.step, result_metrics(report), int(time.time() * 1000)) for report in reports]
    start = [StartRun(ref, params=config, tags={"tune.trial_path": f"/tmp/bench/{ref.name}"}),
             AddParams(ref, once_params(reports[0])), SetTags(ref, changing_tags(reports[0])), results[0]]
    return [start, results[1:], [AddParams(ref, plan_params(PLAN)), EndRun(ref, "FINISHED")]]


class Timed:
    """The CPU time spent in each of an MLflow client's calls, summed by name."""

    def __init__(self, client, names: tuple[str, ...]):
        self.spent: collections.Counter[str] = collections.Counter()
        for name in names:
            setattr(client, name, self._timed(name, getattr(client, name)))

    def _timed(self, name, call):
        def timed(*args, **kwargs):
            started = time.process_time()
            try:
                return call(*args, **kwargs)
            finally:
                self.spent[name] += time.process_time() - started
        return timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=2048)
    parser.add_argument("--block", type=int, default=256, help="trials a row of the table sums")
    parser.add_argument("--uri", help="the tracking store (default: a SQLite file in a temporary folder)")
    args = parser.parse_args()

    folder = tempfile.mkdtemp(prefix="mlflow_store_")
    uri = args.uri or f"sqlite:///{folder}/mlflow.db"
    writer = MlflowWriter(uri, SweepIdentity(uuid.uuid4().hex, "bench-sweep", "mlflow_store"), new_sweep=True)
    writer.log_batch(writer.run_id(None), params={"experiment": "mlflow_store"})  # the parent run, not timed
    calls = ("create_run", "log_batch", "set_terminated", "get_run", "get_metric_history", "update_run")
    timed = Timed(writer.client, calls)

    print(f"{args.trials} trials x {EPOCHS} results into {uri}\n")
    print("| trials | create_run | log_batch | set_terminated | other calls | all, a trial | wall, a trial |")
    print("|---|---|---|---|---|---|---|")
    block_started, wall_started = dict(timed.spent), time.perf_counter()
    for n in range(1, args.trials + 1):
        for round_of_writes in trial_writes(n):
            for send in merged(round_of_writes):
                send.apply(writer)
        if n % args.block == 0:
            spent = {name: (timed.spent[name] - block_started.get(name, 0.0)) / args.block * 1e3 for name in calls}
            other = sum(spent[name] for name in calls[3:])
            wall = (time.perf_counter() - wall_started) / args.block * 1e3
            print(f"| {n - args.block + 1}-{n} | {spent['create_run']:.1f} ms | {spent['log_batch']:.1f} ms | "
                  f"{spent['set_terminated']:.1f} ms | {other:.1f} ms | {sum(spent.values()):.1f} ms | {wall:.1f} ms |",
                  flush=True)
            block_started, wall_started = dict(timed.spent), time.perf_counter()
    database = os.path.join(folder, "mlflow.db")
    if os.path.exists(database):
        print(f"\nmlflow.db: {os.path.getsize(database) / 2**20:.1f} MiB ({folder})")


if __name__ == "__main__":
    main()
