"""A data-parallel trial whose smallest rank runs out of memory, against the same trial planned
per rank from the start.

    python bench/ddp_oom.py                                   # 2 CPU ranks (gloo), rank 1 emulated small
    python bench/ddp_oom.py --device cuda --num-gpus 2 \\
        --workload bench.zoo:ResNet50 --effective-batch 1024 --epochs 1 --samples 4096   # 2 GPUs (NCCL)

Two sweeps of one trial each, on a local Ray:

* ``surprised``: ``memory.estimator: none``, so every rank starts with its whole share of the
  step as one micro-batch, and whichever rank runs out recovers with the group (agreement, next
  reduction, back to the last checkpoint);
* ``planned``: the trace estimate, planned per rank (``planner.plan_for_ranks``).

The table gives the plan each ended with, the OOM events (rank, phase), seconds, the final eval
loss, each rank's peak in the last report, and the largest weight difference from ``planned``
(SGD: the same updates, float noise apart). On the CPU the per-rank capacities are emulated
(``memory.capacity`` per rank); on GPUs every rank has its whole card.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("emulated", "cuda"), default="emulated")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--capacity", nargs="+", default=["64MiB", "5.72MiB"], help="emulated: one size per rank")
    parser.add_argument("--num-gpus", type=int, default=0)
    parser.add_argument("--workload", default="mlp")
    parser.add_argument("--params", default='{"width": 128, "depth": 1, "in_features": 2048, "optimizer": "sgd"}')
    parser.add_argument("--effective-batch", type=int, default=512)
    parser.add_argument("--samples", type=int, default=2048)
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()

    import ray
    import torch

    from orchestrator.config import parse_spec
    from orchestrator.runner import run_sweep
    from orchestrator.table import format_table
    from orchestrator.trial_report import TrialReport

    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    work = tempfile.mkdtemp(prefix="ddp_oom-")
    ray.init(address="local", num_cpus=max(args.workers, 2), num_gpus=args.num_gpus, include_dashboard=False,
             log_to_driver=False, _temp_dir=os.path.join(work, "ray"),
             runtime_env={"env_vars": {"PYTHONPATH": ROOT}})
    params = {**json.loads(args.params), "train_samples": args.samples, "eval_samples": max(args.samples // 8, 64)}
    memory = {"device": "emulated", "capacity": args.capacity} if args.device == "emulated" else {"device": "cuda"}
    rows, states = [], {}
    for run, estimator in (("planned", "trace"), ("surprised", "none")):
        raw = {
            "experiment": f"ddp_oom_{run}", "workload": {"name": args.workload, "params": params},
            "search_space": {"lr": 0.05}, "effective_batch_size": args.effective_batch, "stop": {"epochs": args.epochs},
            "resources": {"cpu": 1, "gpu": 1 if args.device == "cuda" else 0, "workers": args.workers},
            "memory": {**memory, "estimator": estimator, "max_oom_retries": 6},
        }
        started = time.perf_counter()
        outcome = run_sweep(parse_spec(raw), tracking_uri=f"sqlite:///{work}/mlflow.db", storage_path=os.path.join(work, run))
        seconds = time.perf_counter() - started
        (trial,) = [p for p in glob.glob(os.path.join(outcome.experiment_path, "train_trial_*")) if os.path.isdir(p)]
        last = sorted(glob.glob(os.path.join(trial, "checkpoint_*")))[-1]
        states[run] = state = torch.load(os.path.join(last, "state.pt"), weights_only=False)
        report = TrialReport.from_result([json.loads(line) for line in open(os.path.join(trial, "result.json"))][-1])
        plan = state["plan"]
        events = state["oom_events"]
        rows.append([
            run, f"{plan['micro_batch']} x {plan['accum_steps']} x {plan['ranks']} (eval {plan['eval_batch']})",
            ", ".join(f"r{e['rank']} {e['phase']}" for e in events) or "-", f"{seconds:.1f}",
            f"{report.measurements.get('eval_loss', float('nan')):.4f}",
            " / ".join(f"{(peak.allocated or 0) / 2**20:.2f}" for peak in report.rank_peaks),
        ])
    reference = states["planned"]["trainer"]["model"]
    for row, run in zip(rows, ("planned", "surprised")):
        model = states[run]["trainer"]["model"]
        row.append(f"{max((model[k].float() - reference[k].float()).abs().max().item() for k in reference):.2e}")
    ray.shutdown()
    print(format_table(["run", "plan", "OOM events", "seconds", "eval_loss", "peak MiB per rank", "max |dw|"], rows))


if __name__ == "__main__":
    main()
