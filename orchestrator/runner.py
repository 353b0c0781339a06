"""``orchestrator run``: a validated spec -> a Ray Tune sweep -> a summary table and an exit code.

Ray is embedded (a local Ray started for this process) unless the driver is pointed at a
cluster: ``--ray-address HOST:PORT`` (inside a SLURM job) or ``RAY_ADDRESS`` (set by Ray when
the sweep runs as a Ray Job). Never ``address="auto"``: on a shared node it can attach to
another user's cluster.
"""

from __future__ import annotations

import glob
import math
import os
import time
from dataclasses import dataclass
from typing import Any

from orchestrator.config import SweepSpec, load_spec
from orchestrator.device import MEMORY_LABELS
from orchestrator.errors import UserError
from orchestrator.failures import exception_line
from orchestrator.table import format_table
from orchestrator.units import human

DEFAULT_TRACKING_DB = "mlflow.db"


@dataclass(frozen=True)
class TrialRow:
    """One line of the final table: what a person needs to find and judge a trial."""

    name: str
    config: str
    status: str  # TERMINATED (finished, or stopped early by the scheduler), ERROR, REFUSED, INTERRUPTED
    epochs: int  # finished
    steps: int  # optimizer steps
    final_metric: float | None
    plan: str  # "16 x 4"
    peak_bytes: int | None
    memory_source: str
    oom_retries: int
    note: str = ""


@dataclass(frozen=True)
class SweepOutcome:
    rows: list[TrialRow]
    experiment_path: str
    tracking_uri: str

    @property
    def ok(self) -> bool:
        return bool(self.rows) and all(r.status == "TERMINATED" for r in self.rows)


def run_command(args) -> int:
    spec = load_spec(args.config, args.overrides)
    outcome = run_sweep(
        spec,
        tracking_uri=args.tracking_uri,
        storage_path=args.storage_path,
        ray_address=args.ray_address,
        name=args.name,
        resume=args.resume,
        num_cpus=args.num_cpus,
        num_gpus=args.num_gpus,
        dashboard=args.dashboard,
        dashboard_host=args.dashboard_host,
    )
    print()
    print(summary_table(outcome.rows, spec))
    finished = sum(r.status == "TERMINATED" for r in outcome.rows)
    print(f"\n{finished}/{len(outcome.rows)} trials finished. Results: {outcome.experiment_path}")
    print(f"MLflow: {outcome.tracking_uri} (experiment {spec.experiment!r}); see `orchestrator report {spec.experiment}`")
    return 0 if outcome.ok else 1


def resolve_tracking_uri(flag: str | None, spec: SweepSpec) -> str:
    """The flag, else the config, else a SQLite file in the working directory (MLflow's own default)."""
    uri = flag or spec.tracking_uri or f"sqlite:///{os.path.abspath(DEFAULT_TRACKING_DB)}"
    return uri


def run_sweep(
    spec: SweepSpec,
    *,
    tracking_uri: str | None = None,
    storage_path: str | None = None,
    ray_address: str | None = None,
    name: str | None = None,
    resume: bool = False,
    num_cpus: int | None = None,
    num_gpus: float | None = None,
    dashboard: bool = False,
    dashboard_host: str = "127.0.0.1",
) -> SweepOutcome:
    import ray
    from ray import tune

    tracking_uri = resolve_tracking_uri(tracking_uri, spec)
    storage = os.path.abspath(storage_path or spec.storage_path)
    estimates = estimate_before_start(spec)  # before Ray starts: its CPUs are free, a broken model stops here
    started_ray = _connect_ray(ray_address, num_cpus, num_gpus, dashboard, dashboard_host)
    try:
        name, restore_from = _experiment_name(spec, storage, name, resume)
        trainable = _trainable(spec, estimates)
        if restore_from:
            print(f"Resuming {restore_from}: finishing the trials that did not finish")
            tuner = tune.Tuner.restore(restore_from, trainable=trainable, resume_unfinished=True, resume_errored=False)
        else:
            tuner = tune.Tuner(
                trainable,
                param_space=_param_space(spec),
                tune_config=_tune_config(spec),
                run_config=_run_config(spec, name, storage, tracking_uri),
            )
        results = tuner.fit()
        rows = [_row(result, spec) for result in results]
        return SweepOutcome(rows, os.path.join(storage, name), tracking_uri)
    finally:
        if started_ray:
            ray.shutdown()


def _connect_ray(address: str | None, num_cpus, num_gpus, dashboard: bool, dashboard_host: str) -> bool:
    """Join the cluster we were pointed at, or start an embedded local Ray. True if we started one."""
    import ray

    if ray.is_initialized():
        return False
    # Workers import the user's own workloads (``my_package.module:Class``) from the driver's
    # working directory: Ray puts it on every worker's sys.path (a Ray Job's uploaded working_dir
    # takes its place), as long as the driver runs with no working_dir of its own.
    if os.environ.get("RAY_ADDRESS"):  # inside a Ray Job: the job's runtime environment applies
        ray.init(address=os.environ["RAY_ADDRESS"])
    elif address:
        if address == "auto":
            raise UserError("--ray-address: give the head's HOST:PORT; 'auto' can attach to another user's cluster")
        ray.init(address=address)
    else:
        context = ray.init(
            address="local", num_cpus=num_cpus, num_gpus=num_gpus, include_dashboard=dashboard,
            dashboard_host=dashboard_host,
        )
        if dashboard:
            from orchestrator.dashboard import how_to_open, token_required

            url = f"http://{context.dashboard_url}"
            print(how_to_open(url, token_required(url)))
    return True


def _experiment_name(spec: SweepSpec, storage: str, name: str | None, resume: bool) -> tuple[str, str | None]:
    """The sweep's folder, and the folder to restore from when resuming.

    Each run gets a fresh, timestamped folder unless ``--name`` fixes it (a SLURM job does, so
    its requeued attempts resume exactly their own sweep); ``--resume`` without a name picks
    the newest folder of the experiment.
    """
    from ray import tune

    if name:
        path = os.path.join(storage, name)
        if resume and tune.Tuner.can_restore(path):
            return name, path
        if resume:
            print(f"Nothing to resume at {path}: starting the sweep")
        return name, None
    if resume:
        candidates = sorted(
            (p for p in glob.glob(os.path.join(storage, f"{spec.experiment}_*")) if tune.Tuner.can_restore(p)),
            key=os.path.getmtime,
        )
        if candidates:
            return os.path.basename(candidates[-1]), candidates[-1]
        print(f"Nothing to resume under {storage} for {spec.experiment!r}: starting the sweep")
    return f"{spec.experiment}_{time.strftime('%Y%m%d-%H%M%S')}", None


def estimate_before_start(spec: SweepSpec):
    """The trials' memory, estimated once per memory signature before the Tuner starts.

    A workload whose estimate raises (its model or loss fails on the first batch) stops the sweep
    here, in one line, instead of failing every trial after Ray has started.
    """
    from orchestrator.estimates import describe_signature, estimate_trials, planning_target
    from orchestrator.space import memory_configs

    target = planning_target(spec)
    policy = spec.memory
    budget = policy.budget
    if target == "emulated":
        budget = min(budget, policy.capacity) if budget else policy.capacity
    started = time.perf_counter()
    estimates = estimate_trials(memory_configs(spec), policy, target, budget, spec.effective_batch_size)
    if estimates.errors:
        signature, error = next(iter(estimates.errors.items()))
        raise UserError(f"workload {describe_signature(signature, spec.search_space)}: the {policy.estimator} estimate failed ({error}); "
                        "fix the workload, or set memory.estimator: none to start trials without an estimate")
    if estimates.by_signature:
        print(f"Estimated the memory of {len(estimates.by_signature)} distinct trial configuration(s) for a "
              f"{target} device in {time.perf_counter() - started:.1f}s ({policy.estimator})", flush=True)
    return estimates


def _trainable(spec: SweepSpec, estimates):
    from ray import tune

    from orchestrator.packing import auto_gpu_resources
    from trainables.trainable import train_trial

    trainable = tune.with_parameters(train_trial, spec=spec, estimates=estimates)
    if spec.resources.gpu == "auto":
        return tune.with_resources(trainable, auto_gpu_resources(spec, estimates))
    return tune.with_resources(trainable, {"cpu": spec.resources.cpu, "gpu": spec.resources.gpu})


def _param_space(spec: SweepSpec) -> dict[str, Any]:
    from orchestrator.space import tune_param_space

    return tune_param_space(spec)


def _tune_config(spec: SweepSpec):
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler

    from orchestrator.retry import OomAwareScheduler

    if spec.scheduler.type == "asha":
        unit = spec.scheduler.time_attr
        inner = ASHAScheduler(
            time_attr=unit, max_t=spec.stop.epochs if unit == "epoch" else spec.stop.steps,
            grace_period=spec.scheduler.grace_period, reduction_factor=spec.scheduler.reduction_factor,
        )
    else:
        inner = FIFOScheduler()
    # Checkpoint-only reports (checkpoint.every apart from eval_every) carry no eval metric; the
    # metric's name was checked against every workload's declared metrics before Ray started.
    os.environ.setdefault("TUNE_DISABLE_STRICT_METRIC_CHECKING", "1")
    return tune.TuneConfig(
        metric=spec.metric, mode=spec.mode, num_samples=spec.num_samples,
        scheduler=OomAwareScheduler(inner, max_failures=spec.max_failures), reuse_actors=False,
    )


def _run_config(spec: SweepSpec, name: str, storage: str, tracking_uri: str):
    from ray import tune

    from orchestrator.tracking import MlflowTracking

    return tune.RunConfig(
        name=name,
        storage_path=storage,
        callbacks=[MlflowTracking(tracking_uri, spec)],
        # In-process OOMs are retried by the trainable; Tune restarts workers that died (of
        # memory, mostly) and, up to max_failures, trials that failed otherwise. The scheduler
        # spends this shared budget by kind of failure.
        failure_config=tune.FailureConfig(max_failures=spec.memory.max_oom_retries + spec.max_failures),
        checkpoint_config=tune.CheckpointConfig(num_to_keep=spec.checkpoint.keep),
    )


# -- the final table ---------------------------------------------------------------------------


def _row(result, spec: SweepSpec) -> TrialRow:
    metrics = result.metrics or {}
    config = result.config or {}
    shown = {k: v for k, v in config.items() if k in spec.search_space}  # what differs between trials
    if result.error is not None:
        status = "ERROR"
    elif metrics.get("refused"):
        status = "REFUSED"
    elif not metrics.get("done") and not metrics.get("training_done"):
        # Tune marks a trial's last result done when it completes or its scheduler stops it; a
        # trial that spent its budget just before an interruption is finished all the same.
        status = "INTERRUPTED"
    else:
        status = "TERMINATED"
    value = metrics.get(spec.metric)
    note = metrics.get("refusal") or (exception_line(str(result.error))[:160] if result.error else "")
    return TrialRow(
        name=str(metrics.get("trial_id") or (os.path.basename(result.path) if result.path else "?")),
        config=", ".join(f"{k}={_short(v)}" for k, v in shown.items()),
        status=status,
        epochs=int(metrics.get("epoch", 0) or 0),
        steps=int(metrics.get("step", 0) or 0),
        final_metric=value if isinstance(value, (int, float)) and math.isfinite(value) else None,
        plan=f"{metrics['micro_batch']} x {metrics['accum_steps']}" if "micro_batch" in metrics else "-",
        peak_bytes=metrics.get("peak_reserved_bytes", metrics.get("peak_allocated_bytes")),
        memory_source=metrics.get("memory_source", ""),
        oom_retries=int(metrics.get("oom_retries", 0) or 0),
        note=note,
    )


def _short(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def summary_table(rows: list[TrialRow], spec: SweepSpec) -> str:
    """trial, config, progress against the budget, the metric, micro-batch x accumulation, peak memory, status."""
    body = [
        (
            r.name,
            r.config,
            _progress(r, spec),
            f"{r.final_metric:.4f}" if r.final_metric is not None else "-",
            r.plan,
            f"{human(r.peak_bytes)} ({MEMORY_LABELS.get(r.memory_source, r.memory_source)})" if r.peak_bytes else "-",
            r.oom_retries,
            r.status + (f": {r.note}" if r.note and r.status != "TERMINATED" else ""),
        )
        for r in rows
    ]
    return format_table(["trial", "config", "trained", spec.metric, "micro x accum", "peak memory", "OOMs", "status"], body)


def _progress(row: TrialRow, spec: SweepSpec) -> str:
    """Epochs (and steps, where the budget counts them) run of the budget: '3/3 ep', '1 ep, 500/500 steps'."""
    epochs = f"{row.epochs}/{spec.stop.epochs} ep" if spec.stop.epochs else f"{row.epochs} ep"
    return epochs if spec.stop.steps is None else f"{epochs}, {row.steps}/{spec.stop.steps} steps"
