"""What does the orchestrator cost over plain Ray Tune on a sweep of short trials?

    python bench/sweep_overhead.py                 # 16 short trials, 2 interleaved rounds
    python bench/sweep_overhead.py --long          # 4 trials of about a minute each (2-core machine)

The same sweep three ways, each in a fresh process that starts its own local Ray (so each pays
Ray's start-up, as a user's command does), interleaved so that other work on the machine slows
each alike:

* ``tune``: plain Ray Tune with its defaults, a function trainable with a hand-written PyTorch
  loop (a ``DataLoader``, the workload's optimizer, a report per epoch), no checkpoints;
* ``tune-reuse``: the same with ``reuse_actors=True``;
* ``orchestrator``: ``orchestrator run`` on the same sweep (memory estimate before Ray starts,
  a checkpoint per epoch, MLflow in a SQLite store, the summary table).

The sweep: the demo MLP (``trainables/mlp.py``) with 8 learning rates x 2 widths on 512
samples, batch 32, 3 epochs, one CPU per trial; ``--long`` trains 4 trials of a 512-wide MLP
(4 learning rates) on 400000 samples, about a minute each on one core, so that start-up does not
matter and what is left is the cost of the loop itself (its memory measurement, checkpoints,
MLflow). The table gives seconds per round and the ratio to ``tune``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.plain_tune import bench_env, installed, train_plain

LRS = [0.0003, 0.0006, 0.001, 0.002, 0.003, 0.006, 0.01, 0.02]


def sweep(long: bool) -> dict:
    if long:
        return {"lr": LRS[2:6], "width": [512], "samples": 400_000, "epochs": 3}
    return {"lr": LRS, "width": [32, 64], "samples": 512, "epochs": 3}


# -- plain Ray Tune (runs in its own process) ---------------------------------------------------
def run_plain(long: bool, reuse: bool, folder: str) -> None:
    import ray
    from ray import tune

    s = sweep(long)
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, _temp_dir=os.path.join(folder, "ray"))
    space = {"lr": tune.grid_search(s["lr"]), "width": tune.grid_search(s["width"]),
             "samples": s["samples"], "epochs": s["epochs"]}
    tuner = tune.Tuner(
        train_plain, param_space=space,
        tune_config=tune.TuneConfig(metric="eval_loss", mode="min", reuse_actors=reuse),
        run_config=tune.RunConfig(storage_path=os.path.join(folder, "results"), verbose=0),
    )
    results = tuner.fit()
    assert not results.errors, results.errors
    ray.shutdown()


# -- the orchestrator (its installed command) ---------------------------------------------------
def orchestrator_config(long: bool, folder: str) -> str:
    import yaml

    s = sweep(long)
    config = {
        "experiment": "sweep_overhead",
        "workload": {"name": "mlp", "params": {"train_samples": s["samples"]}},
        "search_space": {"lr": {"grid": s["lr"]}, "width": {"grid": s["width"]}},
        "effective_batch_size": 32, "stop": {"epochs": s["epochs"]}, "resources": {"cpu": 1},
        "memory": {"device": "cpu"}, "storage_path": os.path.join(folder, "results"),
        "tracking_uri": f"sqlite:///{folder}/mlflow.db",
    }
    path = os.path.join(folder, "sweep.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(config, f)
    return path


def timed(variant: str, long: bool) -> float:
    """Seconds the variant's whole command took, from a fresh process in a fresh folder."""
    with tempfile.TemporaryDirectory(prefix="sweep-overhead-") as folder:
        if variant == "orchestrator":
            command = [installed("orchestrator"), "run", orchestrator_config(long, folder)]
        else:
            command = [sys.executable, __file__, "--child", variant, "--folder", folder] + (["--long"] if long else [])
        env = bench_env()
        started = time.perf_counter()
        done = subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True)
        seconds = time.perf_counter() - started
        if done.returncode != 0:
            raise SystemExit(f"{variant} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--long", action="store_true", help="4 trials of about a minute each")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--variants", nargs="+", default=["tune", "tune-reuse", "orchestrator"])
    parser.add_argument("--json", help="write the timings here")
    parser.add_argument("--child", choices=("tune", "tune-reuse"), help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        run_plain(args.long, args.child == "tune-reuse", args.folder)
        return

    from orchestrator.table import format_table

    seconds: dict[str, list[float]] = {v: [] for v in args.variants}
    for r in range(args.rounds):
        order = args.variants[r % len(args.variants):] + args.variants[:r % len(args.variants)]
        for variant in order:
            seconds[variant].append(timed(variant, args.long))
            print(f"round {r + 1}: {variant} {seconds[variant][-1]:.1f}s", file=sys.stderr, flush=True)
    rows = []
    for variant in args.variants:
        ratios = [s / t for s, t in zip(seconds[variant], seconds["tune"])] if "tune" in seconds else []
        rows.append([variant] + [f"{s:.1f}s" for s in seconds[variant]]
                    + [f"{statistics.median(ratios):.2f}x" if ratios else "-"])
    headers = ["variant"] + [f"round {r + 1}" for r in range(args.rounds)] + ["vs tune (median)"]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"long": args.long, "seconds": seconds}, f, indent=1)
    print(format_table(headers, rows))


if __name__ == "__main__":
    main()
