"""How long does ``orchestrator report`` take over a sweep of thousands of trials?

    python bench/report_scale.py                            # 2,048 trials, a SQLite store
    python bench/report_scale.py --trials 512 2048 --server # also through an ``mlflow server``
    python bench/report_scale.py --folder /tmp/rs           # keep the stores there (and reuse them)

Running thousands of trials to time a report would take hours, so the bench records a real
sweep of a few trials once (``orchestrator run`` on ``bench/sweep_scale.py``'s sweep: the demo
MLP, 3 epochs, FIFO) and copies it in MLflow into a sweep of ``--trials`` trials: the same
parent run, and per trial a child run with one of the recorded trials' tags, params (``config.lr``
drawn anew) and every metric's whole history (a value per epoch), written with
``MlflowClient.log_batch`` and ended FINISHED, as the tracking writes them. It then times the
installed ``orchestrator report`` on it (start-up included), checks that the Parquet file has a
row per trial per epoch, and prints a row per store: the trials, the MLflow requests of a naive
report (one history read per metric per run), the database size and the report's wall time and
CPU time (its own process; through a server, the server's CPU is not in it).

``--server`` also starts ``mlflow server`` (one worker) over a copy of the SQLite store and times
the report through its REST API, as a team sharing a tracking server would run it.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))  # tests/mlflow_server.py: the server the tests start

from bench.plain_tune import bench_env, installed
from bench.sweep_scale import LR_RANGE, TRIAL, orchestrator_config

TEMPLATE_TRIALS = 4
MAX_PARAMS = 100  # MLflow's limit per log_batch call (tags too)
MAX_METRICS = 1000


@dataclass
class Timed:
    store: str
    trials: int
    requests_naive: int  # one search per 1,000 runs + one history read per metric per run
    db_bytes: int
    report_s: float
    report_cpu_s: float
    rows: int


def template(folder: str) -> str:
    """A real sweep of :data:`TEMPLATE_TRIALS` trials in ``folder/template.db`` (made once)."""
    database = os.path.join(folder, "template.db")
    if not os.path.exists(database):
        uri = f"sqlite:///{database}"
        work = os.path.join(folder, "template")
        os.makedirs(work, exist_ok=True)
        done = subprocess.run([installed("orchestrator"), "run", orchestrator_config(TEMPLATE_TRIALS, "fifo", work, uri)],
                              cwd=work, env=bench_env(), capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise SystemExit(f"the template sweep failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return database


def copy_sweep(template_db: str, database: str, trials: int, seed: int = 0) -> None:
    """The template's sweep as one of ``trials`` trials in ``database`` (a new SQLite store)."""
    from mlflow import MlflowClient
    from mlflow.entities import Metric, Param, RunTag

    from orchestrator.tracking.runs import PARENT_TAG, ROLE_TAG, SWEEP_ID_TAG
    from orchestrator.tracking.writer import get_or_create_experiment

    source = MlflowClient(f"sqlite:///{template_db}")
    runs = source.search_runs([e.experiment_id for e in source.search_experiments()], max_results=1000)
    parent = next(r for r in runs if r.data.tags.get(ROLE_TAG) == "sweep")
    children = [r for r in runs if r.data.tags.get(ROLE_TAG) == "trial"]
    assert len(children) == TEMPLATE_TRIALS, f"the template has {len(children)} trial runs"
    histories = [{key: source.get_metric_history(run.info.run_id, key) for key in run.data.metrics} for run in children]

    uri = f"sqlite:///{database}"
    client = MlflowClient(uri)
    experiment = get_or_create_experiment(client, f"report_scale_{trials}", uri)
    sweep_id = f"report-scale-{trials}"

    def write(run_id: str, params: dict[str, str], tags: dict[str, str], metrics: list) -> None:
        params_list = [Param(k, v) for k, v in params.items()]
        tags_list = [RunTag(k, v) for k, v in tags.items()]
        while params_list or tags_list:
            client.log_batch(run_id, params=params_list[:MAX_PARAMS], tags=tags_list[:MAX_PARAMS])
            params_list, tags_list = params_list[MAX_PARAMS:], tags_list[MAX_PARAMS:]
        for start in range(0, len(metrics), MAX_METRICS):
            client.log_batch(run_id, metrics=metrics[start:start + MAX_METRICS])

    parent_tags = {**{k: v for k, v in parent.data.tags.items() if not k.startswith("mlflow.")}, SWEEP_ID_TAG: sweep_id}
    sweep = client.create_run(experiment, run_name=f"report_scale_{trials}", tags=parent_tags)
    write(sweep.info.run_id, dict(parent.data.params), {}, [])
    draw = random.Random(seed)
    low, high = LR_RANGE
    for i in range(trials):
        run, history = children[i % len(children)], histories[i % len(children)]
        trial_id = f"{i:05d}"
        tags = {k: v for k, v in run.data.tags.items() if not k.startswith("mlflow.")}
        tags.update({SWEEP_ID_TAG: sweep_id, PARENT_TAG: sweep.info.run_id, "trial_id": trial_id})
        child = client.create_run(experiment, run_name=f"train_trial_{trial_id}", tags=tags,
                                  start_time=run.info.start_time)
        params = dict(run.data.params)
        params["config.lr"] = str(low * (high / low) ** draw.random())
        metrics = [Metric(m.key, m.value, m.timestamp, m.step) for points in history.values() for m in points]
        write(child.info.run_id, params, {}, metrics)
        client.set_terminated(child.info.run_id, "FINISHED", end_time=run.info.end_time)
    client.set_terminated(sweep.info.run_id, "FINISHED")


def naive_requests(database: str) -> int:
    """What reading every metric's history run by run costs: a request per metric per run."""
    import sqlite3

    with sqlite3.connect(database) as db:
        keys = db.execute("select count(*) from latest_metrics").fetchone()[0]
        runs = db.execute("select count(*) from runs").fetchone()[0]
    return keys + (runs + 999) // 1000


def time_report(uri: str, experiment: str, folder: str) -> tuple[float, float, int]:
    """The report's wall time and CPU time (its own process: on a loaded machine the CPU time is
    the steadier number), and the rows of its Parquet file."""
    import resource

    import pyarrow.parquet as pq

    out = os.path.join(folder, "report")
    cpu = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    done = subprocess.run([installed("orchestrator"), "report", experiment, "--tracking-uri", uri, "--out", out],
                          cwd=folder, env=bench_env(), capture_output=True, text=True, check=False)
    elapsed = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = after.ru_utime + after.ru_stime - cpu.ru_utime - cpu.ru_stime
    if done.returncode != 0:
        raise SystemExit(f"orchestrator report failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    return elapsed, cpu_s, pq.read_metadata(os.path.join(out, "results.parquet")).num_rows


def measure(folder: str, trials: int, server: bool) -> list[Timed]:
    database = os.path.join(folder, f"report_scale_{trials}.db")
    if not os.path.exists(database):
        started = time.perf_counter()
        copy_sweep(template(folder), database, trials)
        print(f"wrote {trials} trial runs in {time.perf_counter() - started:.0f}s", file=sys.stderr, flush=True)
    experiment = f"report_scale_{trials}"
    requests, size = naive_requests(database), os.path.getsize(database)
    results = []
    results.append(Timed("sqlite", trials, requests, size, *time_report(f"sqlite:///{database}", experiment, folder)))
    if server:
        from mlflow_server import MlflowServer

        root = os.path.join(folder, f"server_{trials}")
        shutil.rmtree(root, ignore_errors=True)
        os.makedirs(root)
        shutil.copy(database, os.path.join(root, "mlflow.db"))
        with MlflowServer(root) as running:
            timed = time_report(running.uri, experiment, folder)
        results.append(Timed("mlflow server (sqlite)", trials, requests, size, *timed))
    for timed in results:
        expected = trials * TRIAL["epochs"]
        if timed.rows != expected:
            raise SystemExit(f"{timed.store}: results.parquet has {timed.rows} rows, expected {expected}")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, nargs="+", default=[2048])
    parser.add_argument("--server", action="store_true", help="also through an mlflow server over the same store")
    parser.add_argument("--folder", help="keep the stores here, and reuse any already there (default: a temporary folder)")
    args = parser.parse_args()

    from orchestrator.table import format_table

    folder = args.folder or tempfile.mkdtemp(prefix="report-scale-")
    os.makedirs(folder, exist_ok=True)
    results = []
    try:
        for trials in args.trials:
            results.extend(measure(folder, trials, args.server))
    finally:
        if not args.folder:
            shutil.rmtree(folder, ignore_errors=True)
    print(format_table(
        ["trials", "store", "naive requests", "mlflow.db", "report", "report CPU", "parquet rows"],
        [[str(t.trials), t.store, f"{t.requests_naive:,}", f"{t.db_bytes / 2**20:.1f} MiB", f"{t.report_s:.1f}s",
          f"{t.report_cpu_s:.1f}s", f"{t.rows:,}"] for t in results],
    ))


if __name__ == "__main__":
    main()
