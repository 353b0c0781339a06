"""Does a sweep of hundreds of short trials cost what Tune's best case costs, and do the
driver, MLflow and ``orchestrator report`` stay flat as the trials grow?

    python bench/sweep_scale.py                          # 128 and 512 trials, FIFO
    python bench/sweep_scale.py --trials 128             # one size
    python bench/sweep_scale.py --large                  # also 2,048 trials, FIFO and ASHA
    python bench/sweep_scale.py --trials 128 --repeats 3 # each variant three times, alternating
    python bench/sweep_scale.py --trial-seconds 0.35      # shorter trials (default: about one second each)
    python bench/sweep_scale.py --trials 512 --variants orchestrator \\
        --tracking-uri postgresql://USER@127.0.0.1:PORT/DB   # the orchestrator's MLflow in a PostgreSQL store

Each size runs two variants, each in a fresh process that starts its own local Ray:

* ``tune-reuse``: plain Ray Tune, ``reuse_actors=True``, the hand-written loop of
  ``bench/plain_tune.py`` (an evaluation and a report per epoch, no checkpoints, no MLflow);
* ``orchestrator``: ``orchestrator run`` on the same sweep (its installed command).

A trial is the demo MLP, batch 32, 3 epochs, on as many samples as make about a second of
training on one thread of this machine (``--trial-seconds``: the issue's trials are one-second
trials, and these cores have run the same 10,240 samples in 0.35-0.93 s on different days, which
would weigh a trial's fixed costs, in both variants, up to 3x more on a fast day); the sweep
draws ``lr`` log-uniformly, ``--trials`` samples. Per variant the table gives
the wall time, its ratio to the compute floor (trials x one trial's training seconds, measured
here on one thread / cores) and to ``tune-reuse``; where that time went: a trial's mean
``time_total_s`` (Tune's clock in the worker, from the trial's start to its last report), how
much longer an epoch took in the last quarter of the trials to end than in the first (a worker
reused for hundreds of trials must not slow down as it goes), the
time outside the trials (the wall time less the trials' summed seconds / cores: the start, the
end and the turn-arounds between trials); the CPU time of the driver process (its
threads compete with the trials for the cores), the driver's peak RSS and how much its RSS
grew from the first to the last quarter of the trials (sampled each time a trial ends, from
``/proc``), and for the orchestrator MLflow's database size, how long the driver still waited
for MLflow after the last trial ended, and how long ``orchestrator report`` took on the result.
It also checks that MLflow holds every trial's every epoch exactly once (and stops if not).

One run of a variant is good to about +-0.1 in its ratio to the other here (plain Tune alone
took 64-80 s for the same 128 trials within one hour), which is the size of the gap a goal of
1.10x asks about. ``--repeats N`` runs each size N times, the variants alternating and their order
swapped every repeat, compares each orchestrator run with the plain run of its own repeat, and
ends with the per-repeat ratios and their median.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.plain_tune import bench_env, installed, train_plain, training_seconds
from orchestrator.trial_report import STOPPED_EARLY

TRIAL = {"width": 64, "samples": 10_240, "epochs": 3, "batch": 32}  # the shape; ``sized_trial`` sets the samples
LR_RANGE = (1e-4, 1e-1)
ASHA = {"grace_period": 1, "reduction_factor": 3}
#: A line of ``orchestrator run`` (``orchestrator.console``) or of the plain child that says a trial ended.
TRIAL_ENDED = re.compile(rf"^\S+ (finished|{re.escape(STOPPED_EARLY)}|refused|diverged|failed): ")


# -- plain Ray Tune (runs in its own process) ---------------------------------------------------
def run_plain(trials: int, scheduler: str, folder: str, trial: dict) -> None:
    import ray
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler

    class SayEnded(tune.Callback):
        """One line per ended trial, which the parent counts (as it counts ``orchestrator run``'s)."""

        def on_trial_complete(self, iteration, trials, trial, **info):
            print(f"{trial} finished: ", flush=True)

        def on_trial_error(self, iteration, trials, trial, **info):
            print(f"{trial} failed: ", flush=True)

    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, _temp_dir=os.path.join(folder, "ray"))
    space = {"lr": tune.loguniform(*LR_RANGE), **trial}
    chosen = (ASHAScheduler(time_attr="epoch", max_t=trial["epochs"], **ASHA) if scheduler == "asha"
              else FIFOScheduler())
    tuner = tune.Tuner(
        train_plain, param_space=space,
        tune_config=tune.TuneConfig(metric="eval_loss", mode="min", num_samples=trials, scheduler=chosen,
                                    reuse_actors=True),
        run_config=tune.RunConfig(storage_path=os.path.join(folder, "results"), verbose=0, callbacks=[SayEnded()]),
    )
    results = tuner.fit()
    assert not results.errors, results.errors
    ray.shutdown()


# -- the orchestrator (its installed command) ---------------------------------------------------
def orchestrator_config(trials: int, scheduler: str, folder: str, tracking_uri: str, trial: dict = TRIAL) -> str:
    import yaml

    config = {
        "experiment": f"sweep_scale_{trials}_{scheduler}",
        "workload": {"name": "mlp", "params": {"train_samples": trial["samples"], "width": trial["width"]}},
        "search_space": {"lr": {"loguniform": list(LR_RANGE)}}, "num_samples": trials,
        "effective_batch_size": trial["batch"], "stop": {"epochs": trial["epochs"]}, "resources": {"cpu": 1},
        "memory": {"device": "cpu"}, "storage_path": os.path.join(folder, "results"), "tracking_uri": tracking_uri,
        "scheduler": {"type": "asha", "time_attr": "epoch", **ASHA} if scheduler == "asha" else "fifo",
    }
    path = os.path.join(folder, "sweep.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(config, f)
    return path


# -- measuring a variant ------------------------------------------------------------------------
@dataclass
class Measured:
    variant: str
    trials: int
    scheduler: str
    repeat: int  # which of ``--repeats`` (from 1); an orchestrator run is compared with plain Tune's of its repeat
    wall_s: float
    ended: int  # trials the output said ended
    peak_rss: int  # the driver's, bytes (VmHWM)
    driver_cpu_s: float = 0.0  # the driver process's own CPU time (all its threads; not Ray's processes)
    rss_at_end: list[int] = field(default_factory=list)  # the driver's RSS as each trial ended
    mlflow_db_bytes: int | None = None
    mlflow_wait_s: float | None = None  # from the last trial's end to the driver's summary line
    report_s: float | None = None
    epochs_logged: int | None = None  # (trial, epoch) pairs in MLflow, each checked to be there once
    trial_seconds: list[float] = field(default_factory=list)  # each trial's time_total_s, in the order the trials ended
    trial_epochs: list[int] = field(default_factory=list)  # the epochs each of them trained, in the same order

    def in_trials(self, cores: int) -> float:
        """The wall time the trials' own running takes when the cores run them side by side: what
        is left of ``wall_s`` is the start, the end and the turn-arounds between trials."""
        return sum(self.trial_seconds) / cores

    def rss_growth(self) -> float | None:
        """The driver's RSS as the last quarter of the trials ended, against the first quarter."""
        return quarter_growth(self.rss_at_end)

    def epoch_growth(self) -> float | None:
        """How much longer an epoch took in the last quarter of the trials than in the first: a
        reused worker that carries something from one trial to the next gets slower as the sweep
        goes on. Per epoch, as ASHA's trials run for different numbers of them."""
        return quarter_growth([seconds / epochs for seconds, epochs in zip(self.trial_seconds, self.trial_epochs)])


def quarter_growth(values: list[float]) -> float | None:
    """Mean of the last quarter of ``values`` over that of the first quarter, minus 1."""
    n = len(values)
    if n < 8:
        return None
    return statistics.mean(values[n - n // 4:]) / statistics.mean(values[: n // 4]) - 1


def proc_status(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM of a process, in bytes (empty once it has gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return {k: int(v.split()[0]) * 1024 for k, _, v in (line.partition(":") for line in f) if k in ("VmRSS", "VmHWM")}
    except (OSError, ValueError):
        return {}


def cpu_seconds(pid: int) -> float | None:
    """The user and system CPU time a process has used so far (None once it has gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(variant: str, trials: int, scheduler: str, repeat: int, folder: str, tracking_uri: str | None,
            trial: dict) -> Measured:
    """Run the variant in a fresh process, following its output line by line."""
    if variant == "orchestrator":
        uri = tracking_uri or f"sqlite:///{folder}/mlflow.db"
        command = [installed("orchestrator"), "run", orchestrator_config(trials, scheduler, folder, uri, trial)]
    else:
        command = [sys.executable, __file__, "--child", "--trials", str(trials), "--scheduler", scheduler,
                   "--folder", folder, "--samples", str(trial["samples"])]
    started = time.perf_counter()
    process = subprocess.Popen(command, cwd=folder, env=bench_env(), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, bufsize=1)
    peak, cpu = 0, 0.0
    stop = threading.Event()

    def watch_peak() -> None:  # VmHWM is the peak, the CPU time grows: read them until the process has gone
        nonlocal peak, cpu
        while not stop.wait(0.5):
            peak = max(peak, proc_status(process.pid).get("VmHWM", 0))
            cpu = max(cpu, cpu_seconds(process.pid) or 0.0)

    watcher = threading.Thread(target=watch_peak, daemon=True)
    watcher.start()
    rss, tail, last_end, summary_at = [], [], None, None
    for line in process.stdout:
        tail = (tail + [line])[-60:]
        if TRIAL_ENDED.match(line):
            rss.append(proc_status(process.pid).get("VmRSS", 0))
            last_end = time.perf_counter()
        elif summary_at is None and re.match(r"^\d+/\d+ trials finished", line):
            summary_at = time.perf_counter()
    process.wait()
    wall = time.perf_counter() - started
    stop.set()
    watcher.join()
    if process.returncode != 0:
        raise SystemExit(f"{variant} failed ({process.returncode}):\n{''.join(tail)}")
    times = trial_times(os.path.join(folder, "results"))
    measured = Measured(variant, trials, scheduler, repeat, wall, len(rss), peak, cpu, rss,
                        trial_seconds=[seconds for seconds, _ in times], trial_epochs=[epochs for _, epochs in times])
    if variant == "orchestrator":
        uri = tracking_uri or f"sqlite:///{folder}/mlflow.db"
        database = os.path.join(folder, "mlflow.db")
        measured.mlflow_db_bytes = os.path.getsize(database) if tracking_uri is None else None
        measured.mlflow_wait_s = summary_at - last_end if summary_at and last_end else None
        measured.epochs_logged = check_every_epoch_once(uri, f"sweep_scale_{trials}_{scheduler}", trials, scheduler,
                                                        trial["epochs"])
        measured.report_s = time_report(uri, f"sweep_scale_{trials}_{scheduler}", folder)
    return measured


def trial_times(storage: str) -> list[tuple[float, int]]:
    """Each trial's ``time_total_s`` and epochs in its last result, in the order the trials
    ended: Tune's clock in the worker, from the trial's start (its set-up included) to its last
    report."""
    found = []
    for path in glob.glob(os.path.join(storage, "*", "*", "result.json")):
        last = None
        with open(path) as f:
            for line in f:
                if line.strip():
                    last = line
        if last is not None:
            result = json.loads(last)
            # A trial whose last report came before its first epoch ended counts its reports instead.
            epochs = result.get("epoch") or result["training_iteration"]
            found.append((result["timestamp"], result["time_total_s"], epochs))
    return [(seconds, epochs) for _, seconds, epochs in sorted(found)]


def check_every_epoch_once(tracking_uri: str, experiment: str, trials: int, scheduler: str, epochs_each: int) -> int:
    """Every trial has a child run, and each run the epochs 1..its last exactly once (all of them
    under FIFO). Returns how many (trial, epoch) results that is."""
    from mlflow import MlflowClient

    from orchestrator.tracking.runs import ROLE_TAG

    client = MlflowClient(tracking_uri)
    found = client.get_experiment_by_name(experiment)
    runs, token = [], None
    while True:
        page = client.search_runs([found.experiment_id], f"tags.`{ROLE_TAG}` = 'trial'", max_results=1000, page_token=token)
        runs.extend(page)
        token = page.token
        if not token:
            break
    if len(runs) != trials:
        raise SystemExit(f"MLflow has {len(runs)} trial runs, the sweep ran {trials}")
    total = 0
    for run in runs:
        epochs = sorted(int(m.value) for m in client.get_metric_history(run.info.run_id, "epoch"))
        expected = list(range(1, (epochs_each if scheduler == "fifo" else max(epochs, default=0)) + 1))
        if epochs != expected:
            raise SystemExit(f"MLflow run {run.info.run_name}: epochs {epochs}, expected each of {expected} once")
        total += len(epochs)
    return total


def time_report(tracking_uri: str, experiment: str, folder: str) -> float:
    started = time.perf_counter()
    done = subprocess.run([installed("orchestrator"), "report", experiment, "--tracking-uri", tracking_uri,
                           "--out", os.path.join(folder, "report")],
                          cwd=folder, env=bench_env(), capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"orchestrator report failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    return time.perf_counter() - started


def sized_trial(seconds: float) -> tuple[dict, float]:
    """:data:`TRIAL` on as many samples (whole batches) as make about ``seconds`` of training on
    one thread here, and the training seconds measured at that size (the floor's trial)."""
    base = training_seconds({"lr": 1e-3, **TRIAL})
    batches = max(1, round(TRIAL["samples"] * seconds / base / TRIAL["batch"]))
    trial = {**TRIAL, "samples": batches * TRIAL["batch"]}
    return trial, training_seconds({"lr": 1e-3, **trial})


# -- the table ---------------------------------------------------------------------------------
def rows(results: list[Measured], trial_s: float, cores: int) -> list[list[str]]:
    out = []
    for m in results:
        floor = m.trials * trial_s / cores
        base = _plain_of(results, m)
        growth, epoch_growth = m.rss_growth(), m.epoch_growth()
        out.append([
            f"{m.trials} {m.scheduler}", m.variant, str(m.repeat), f"{m.wall_s:.0f}s", f"{floor:.0f}s", f"{m.wall_s / floor:.2f}x",
            f"{m.wall_s / base.wall_s:.2f}x" if base else "-",
            f"{statistics.mean(m.trial_seconds):.3f}s" if m.trial_seconds else "-",
            f"{epoch_growth:+.1%}" if epoch_growth is not None else "-",
            f"{m.wall_s - m.in_trials(cores):.1f}s" if m.trial_seconds else "-",
            f"{m.driver_cpu_s:.0f}s", f"{m.peak_rss / 2**20:.0f} MiB",
            f"{growth:+.1%}" if growth is not None else "-",
            f"{m.mlflow_db_bytes / 2**20:.1f} MiB" if m.mlflow_db_bytes else "-",
            f"{m.mlflow_wait_s:.1f}s" if m.mlflow_wait_s is not None else "-",
            f"{m.report_s:.1f}s" if m.report_s is not None else "-",
            f"{m.epochs_logged} once" if m.epochs_logged is not None else "-",
        ])
    return out


def _plain_of(results: list[Measured], m: Measured) -> Measured | None:
    """The plain Tune run of ``m``'s size and repeat."""
    return next((r for r in results if r.variant == "tune-reuse" and (r.trials, r.scheduler, r.repeat) == (m.trials, m.scheduler, m.repeat)), None)


def ratio_lines(results: list[Measured]) -> list[str]:
    """Per size: the orchestrator's wall time over plain Tune's, repeat by repeat, and their median."""
    lines = []
    for trials, scheduler in dict.fromkeys((m.trials, m.scheduler) for m in results):
        ratios = [m.wall_s / base.wall_s for m in results
                  if (m.trials, m.scheduler, m.variant) == (trials, scheduler, "orchestrator") and (base := _plain_of(results, m))]
        if ratios:
            lines.append(f"{trials} {scheduler}: orchestrator / tune-reuse {', '.join(f'{r:.2f}x' for r in ratios)}; "
                         f"median {statistics.median(ratios):.2f}x")
    return lines


HEADERS = ["trials", "variant", "repeat", "wall", "floor", "vs floor", "vs tune-reuse", "a trial", "epoch time q1->q4", "outside trials", "driver CPU", "driver peak RSS", "RSS growth q1->q4",
           "mlflow.db", "MLflow wait", "report", "epochs in MLflow"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--large", action="store_true", help="also 2,048 trials, FIFO and ASHA")
    parser.add_argument("--scheduler", choices=("fifo", "asha"), default="fifo")
    parser.add_argument("--variants", nargs="+", default=["tune-reuse", "orchestrator"])
    parser.add_argument("--repeats", type=int, default=1, help="runs of each variant per size, alternating")
    parser.add_argument("--tracking-uri", help="the orchestrator's MLflow (default: a SQLite file in its folder)")
    parser.add_argument("--trial-seconds", type=float, default=1.0,
                        help="a trial's training on one thread, which its samples are sized to (default: 1)")
    parser.add_argument("--json", help="write the measurements here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    parser.add_argument("--samples", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats: expected a number of runs of at least 1, got {args.repeats}")
    if not args.trial_seconds > 0:
        parser.error(f"--trial-seconds: expected a positive number of seconds, got {args.trial_seconds}")
    if args.child:
        run_plain(args.trials[0], args.scheduler, args.folder, {**TRIAL, "samples": args.samples})
        return

    from orchestrator.table import format_table

    cores = os.cpu_count() or 1
    trial, trial_s = sized_trial(args.trial_seconds)
    print(f"one trial's training: {trial_s:.2f}s on one thread ({trial['samples']:,} samples, {trial['epochs']} epochs); "
          f"{cores} cores", file=sys.stderr, flush=True)
    rounds = [(n, args.scheduler) for n in args.trials] + ([(2048, "fifo"), (2048, "asha")] if args.large else [])
    results = []
    for trials, scheduler in rounds:
        for repeat in range(1, args.repeats + 1):
            order = args.variants if repeat % 2 else args.variants[::-1]  # neither always runs first
            for variant in order:
                with tempfile.TemporaryDirectory(prefix="sweep-scale-") as folder:
                    results.append(measure(variant, trials, scheduler, repeat, folder, args.tracking_uri, trial))
                m = results[-1]
                print(f"{trials} {scheduler} {variant} #{repeat}: {m.wall_s:.1f}s, {m.ended} trials ended",
                      file=sys.stderr, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"trial_s": trial_s, "trial": trial, "cores": cores, "results": [asdict(r) for r in results]}, f,
                      indent=1)
    print(format_table(HEADERS, rows(results, trial_s, cores)))
    for line in ratio_lines(results):
        print(line)


if __name__ == "__main__":
    main()
