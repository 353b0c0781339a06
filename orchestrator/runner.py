"""``orchestrator run``: a validated spec -> a Ray Tune sweep -> a summary table and an exit code.

Ray is embedded (a local Ray started for this process) unless the driver is pointed at a
cluster: ``--ray-address HOST:PORT`` (inside a SLURM job) or ``RAY_ADDRESS`` (set by Ray when
the sweep runs as a Ray Job). Never ``address="auto"``: on a shared node it can attach to
another user's cluster.
"""

from __future__ import annotations

import math
import os
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable

from orchestrator import follow_up
from orchestrator.allocator_conf import import_time_environment
from orchestrator.capacity import (
    WaitForNodes,
    alive_nodes,
    check_local_node,
    check_schedulable,
    local_node,
    trial_request,
)
from orchestrator.config import SweepSpec
from orchestrator.console import (
    TUNE_QUIET, TUNE_VERBOSE, cluster_text, config_text, plan_text, quiet_libraries, ray_logging_config, tune_lines_told_here,
)
from orchestrator.contract import MEMORY_LABELS, describe_moves, survived_ooms
from orchestrator.errors import ToldInterrupt, UserError
from orchestrator.failures import exception_line
from orchestrator.invocation import shell_command
from orchestrator.outcome import (
    INTERRUPTED,
    TERMINATED,
    SweepRecord,
    TrackingDelivery,
    finished,
    recording,
    trial_status,
)
from orchestrator.preflight import check_shared_storage, check_storage, check_workloads
from orchestrator.ray_group import ray_in_its_own_group
from orchestrator.ray_internals import LOCAL_RAY_SYSTEM_CONFIG, shut_down_local_ray
from orchestrator.ray_token import secure_token_files
from orchestrator.run_request import RunRequest
from orchestrator.stop_signal import ctrl_c_held, sigterm_stops_like_sigint
from orchestrator.sweep_guard import claim_sweep, recorded_tracking_store, running, sweeps_of
from orchestrator.table import format_table, trained_text
from orchestrator.tracking.runs import absolute_tracking_uri, default_tracking_uri
from orchestrator.trial.evidence import gave_up_events
from orchestrator.trial_report import STOPPED_EARLY, TrialReport
from orchestrator.units import human, size_flag
from orchestrator.writable import taken_back_if_refused

#: How long the driver waits for ``--ray-address`` to accept a connection.
GCS_CONNECT_TIMEOUT_S = 10


@dataclass(frozen=True)
class TrialRow:
    """One line of the final table: what a person needs to find and judge a trial."""

    name: str
    config: str
    status: str  # TERMINATED (finished, or stopped early by the scheduler), ERROR, REFUSED, INTERRUPTED, DIVERGED
    epochs: int  # finished
    steps: int  # optimizer steps
    final_metric: float | None
    plan: str  # "16 x 4"
    peak_bytes: int | None
    memory_source: str
    oom_retries: int
    note: str = ""
    node: str = ""  # the node of its last attempt (``ray start --node-name``, else its IP)
    moves: str = ""  # "moved node-b->node-c at epoch 2: node node-b lost" (orchestrator.contract.Move)
    stopped_early: bool = False  # TERMINATED before its budget, by ASHA (``TrialReport.stopped_early``)


@dataclass(frozen=True)
class SweepOutcome:
    rows: list[TrialRow]
    experiment_path: str
    tracking_uri: str
    tracking: TrackingDelivery | None = None  # None: the tracking callback did not report (no recording)
    stop_reason: str | None = None
    on_nan: str = "stop"  # whether a DIVERGED trial counts as finished (outcome.finished)

    @property
    def ok(self) -> bool:
        """Every trial finished and MLflow has all of it: what exit status 0 promises."""
        trained = bool(self.rows) and all(finished(r.status, self.on_nan) for r in self.rows)
        return trained and (self.tracking is None or self.tracking.complete)


def summary_lines(outcome: SweepOutcome, spec: SweepSpec, request: RunRequest) -> list[str]:
    """Below the table: what finished, what did not and why, what MLflow lacks and how to fix it, the best trial."""
    rows = outcome.rows
    name = os.path.basename(outcome.experiment_path)
    done = sum(finished(r.status, outcome.on_nan) for r in rows)
    # Tune makes trials as it starts them: a sweep stopped early has made only some of its space's.
    total = max(len(rows), spec.trial_count())
    notes = []
    if stopped := sum(r.stopped_early for r in rows):
        notes.append(f"{stopped} {STOPPED_EARLY}")
    if total > len(rows):
        notes.append(f"{total - len(rows)} not started")
    of_them = f" ({'; '.join(notes)})" if notes else ""
    lines = [f"{done}/{total} trials finished{of_them}. Results: {outcome.experiment_path}"]
    if outcome.stop_reason:
        lines.append(f"Stopped: {outcome.stop_reason}")
    if any(r.status == INTERRUPTED for r in rows):
        lines.append(f"Interrupted trials continue from their last checkpoints with: {resume_command(request, name)}")
    delivery = outcome.tracking
    if delivery and delivery.dropped:
        lines.append(
            f"MLflow rejected {len(delivery.dropped)} write(s), so its record of this sweep is incomplete (its run "
            f"is marked FAILED); the first: {delivery.dropped[0]}"
        )
    if delivery and delivery.unsent:
        where = f"kept in {delivery.kept_at}" if delivery.kept_at else "they could not be kept"
        lines.append(f"MLflow at {delivery.tracking_uri} did not take {delivery.unsent} write(s) by the end; {where}.")
        if delivery.kept_at:
            lines.append(f"  Send them once MLflow is back with: {resume_command(request, name)}")
    best = best_row(rows, spec)
    if best is not None:  # of the finished trials: an interrupted one may be better so far
        so_far = " of the finished trials" if any(r.status == INTERRUPTED for r in rows) else ""
        lines.append(f"Best{so_far}: {best.name}, {spec.metric} {best.final_metric:.4f} ({best.config})")
    store = follow_up.tracking_uri() or outcome.tracking_uri  # a SLURM job's store, not its server gone with it
    lines.append(f"MLflow: {store} (experiment {spec.experiment!r}); see `{report_command(outcome)}`")
    return lines


def resume_command(request: RunRequest, name: str | None = None) -> str:
    """The command that continues this sweep (``--resume`` without a name takes the newest of the
    experiment), on the same resources: the embedded Ray's CPUs and GPUs decide how many trials
    run at once; or what the launcher that started this driver says continues it (``follow_up``:
    a SLURM job's ``sbatch`` of its script)."""
    return follow_up.resume() or request.replace(name=name or request.name, resume=True).command()


def report_command(outcome: SweepOutcome) -> str:
    """``orchestrator report SWEEP``, with the tracking URI where it is not the one ``report``
    reads by default (the working directory's ``mlflow.db``, which is also ``run``'s). The sweep
    by its name, not the experiment's: ``report EXPERIMENT`` is the experiment's newest sweep,
    another one where sweeps of it overlap."""
    tracking_uri = follow_up.tracking_uri() or outcome.tracking_uri  # a SLURM job's store, its server gone
    named = tracking_uri != default_tracking_uri()
    sweep = os.path.basename(outcome.experiment_path)
    return shell_command("report", sweep, *(["--tracking-uri", tracking_uri] if named else []))


def resolve_tracking_uri(flag: str | None, spec: SweepSpec, recorded: str | None = None) -> str:
    """The flag, else (resuming) the store the sweep recorded, else the config's, else a SQLite
    file in the working directory (MLflow's own default); a relative SQLite path made absolute.

    A resume writes where its sweep did unless the flag names another store (a server that
    moved, a requeued SLURM job's server on another port): the config's ``tracking_uri``, like
    Tune's other restored settings, is the stored sweep's (``sweep_guard`` refuses a change), but
    the working directory a relative one or the default is read against may not be.
    ``recorded``: the store the resumed sweep recorded (``sweep_guard.recorded_tracking_store``)."""
    return absolute_tracking_uri(flag or recorded or spec.tracking_uri or default_tracking_uri())


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
    host_memory: str | None = None,
    dashboard: bool = False,
    dashboard_host: str = "127.0.0.1",
    offline_tracking: bool = False,
    verbose: bool = False,
    allow_config_change: bool = False,
) -> SweepOutcome:
    """``verbose``: Ray's and Tune's own output as they print it, instead of ``orchestrator.console``'s view.
    ``allow_config_change``: resume even where the config differs from the stored sweep's (``sweep_guard``).
    ``host_memory``: each node's available memory for the trials (``orchestrator.node_memory``)."""
    import ray
    from ray import tune

    quiet_libraries(verbose)
    storage = os.path.abspath(storage_path or spec.storage_path)
    node_memory = size_flag("--host-memory", host_memory)
    embedded = ray_address is None and not os.environ.get("RAY_ADDRESS") and not ray.is_initialized()
    if embedded:
        local = local_node(num_cpus, num_gpus)
        # Given to Ray: alone it would count the machine's CPUs, not the ones a taskset, SLURM step or container gives us.
        num_cpus = int(local["CPU"])
        check_local_node(trial_request(spec), spec.resources.workers, local)
    # A Ctrl-C from the sweep's start to the end (Ray's shutdown too) is a StoppedAtOnce naming it.
    with _StopsAtOnce() as stopping:
        started_ray = False
        claim = None
        try:
            with taken_back_if_refused(storage), _before_start():
                name, restore_from, named = _experiment_name(spec, storage, name, resume)
                recorded_store = recorded_tracking_store(restore_from) if restore_from else None
                tracking_uri = resolve_tracking_uri(tracking_uri, spec, recorded_store)
                _check_before_ray(spec, storage, tracking_uri, offline_tracking)
                if embedded:  # the trials' spec: data loading cut to what this machine holds (the user's is recorded)
                    trial_spec, host_cuts = _fit_host_memory(spec, node_memory, local=local)
                # The sweep's folder is this driver's before Ray starts: a second driver of it is
                # refused at once, and so is a resume whose config differs (orchestrator.sweep_guard).
                claim = claim_sweep(os.path.join(storage, name), spec, resuming=restore_from is not None, new=not resume,
                                    allow_config_change=allow_config_change, named=named)
                name = os.path.basename(claim.folder)  # a name of our own may have become name_2: another sweep had it
                try:
                    from orchestrator.tune_state import restore_cut_off

                    put_back = restore_cut_off(restore_from) if restore_from else []
                    estimates, started_ray = _estimate_while_ray_starts(
                        spec, lambda: _connect_ray(ray_address, num_cpus, num_gpus, dashboard, dashboard_host, verbose,
                                                   import_time_environment(spec.memory.allocator_conf)))
                    nodes = alive_nodes()
                    print(cluster_text(nodes))
                    check_shared_storage(storage_path or spec.storage_path, storage, len(nodes))
                    wait = check_schedulable(trial_request(spec), spec.resources.wait_minutes, spec.resources.workers)
                    if not embedded:
                        trial_spec, host_cuts = _fit_host_memory(spec, node_memory, cluster=nodes)
                    # The sweep starts: its config kept, Tune's Tuner made (its tuner.pkl in the folder).
                    claim.record(spec, tracking_uri)
                    trainable = _trainable(trial_spec, estimates)
                    _tune_settings()
                    if restore_from:
                        print(f"Resuming {restore_from}: finishing the trials that did not finish")
                        for cut_off in put_back:
                            print(f"{cut_off} was cut off (a full storage?): resuming from its last whole copy")
                        tuner = tune.Tuner.restore(restore_from, trainable=trainable, resume_unfinished=True,
                                                   resume_errored=False)
                        # (A SLURM job's own server fronts its job's one store, on each attempt's port.)
                        if recorded_store and recorded_store != tracking_uri and not follow_up.tracking_uri():
                            print(f"MLflow: this resume writes to {tracking_uri} (--tracking-uri); "
                                  f"the sweep so far is in {recorded_store}")
                        _track_in(tuner, tracking_uri)
                    else:
                        tune_config = _tune_config(spec)
                        tuner = tune.Tuner(
                            trainable,
                            param_space=_param_space(spec),
                            tune_config=tune_config,
                            run_config=_run_config(spec, name, storage, tracking_uri, tune_config.scheduler, wait, verbose,
                                                   host_cuts=host_cuts),
                        )
                # Refused, or stopped before it started: Ctrl-C, or SIGTERM once Ray's start has made it
                # raise SystemExit (before that, the signal ends the process, and the claim's lock with it).
                except (UserError, KeyboardInterrupt, SystemExit):
                    claim.release(refused=True)
                    raise
            stopping.started(name)
            with sigterm_stops_like_sigint(), recording() as record, tune_lines_told_here(verbose):
                try:
                    results = tuner.fit()
                except KeyboardInterrupt:  # a second Ctrl-C: Tune stopped at once, its callbacks not ended
                    _end_tracking_at_once(tuner)
                    raise
            if not embedded:  # the cluster outlives this driver: its Prometheus endpoint gets the last counts
                from orchestrator.oom_counter import wait_for_export

                wait_for_export()
            # A restored sweep lists its trials in the order they were restored: the table keeps the sweep's.
            rows = sorted((_row(result, spec, record) for result in results), key=lambda row: row.name)
            return SweepOutcome(rows, os.path.join(storage, name), tracking_uri, record.tracking, record.stop_reason, spec.on_nan)
        finally:
            if claim is not None:
                claim.release()
            if started_ray:
                shut_down_local_ray()


class InterruptedBeforeStart(ToldInterrupt):
    """A Ctrl-C before the sweep started (its checks, the estimates, Ray's start): no trial ran,
    ``taken_back_if_refused`` has removed what the run made, and the same command starts it again
    (a ``--resume`` without a name would take the experiment's newest sweep instead)."""


@contextmanager
def _before_start() -> Iterator[None]:
    try:
        yield
    except KeyboardInterrupt:
        raise InterruptedBeforeStart from None


class StoppedAtOnce(ToldInterrupt):
    """A second Ctrl-C (or SIGTERM) once the sweep started: Tune stopped at once (or its graceful
    stop had just returned), with no table.
    ``name``: the sweep's folder, which its resume command names (the experiment's newest sweep,
    which a ``--resume`` without a name takes, may be another one started since)."""

    def __init__(self, name: str):
        super().__init__()
        self.name = name


class _StopsAtOnce:
    """Once the sweep has started (:meth:`started`), a Ctrl-C that ends the command leaves it as a
    :class:`StoppedAtOnce` naming the sweep: a second Ctrl-C in Tune, or one during Ray's shutdown
    once Tune's graceful stop has returned (its table is then lost too)."""

    def __init__(self) -> None:
        self.name: str | None = None

    def started(self, name: str) -> None:
        self.name = name

    def __enter__(self) -> _StopsAtOnce:
        return self

    def __exit__(self, kind, exc, traceback) -> None:
        if self.name is not None and kind is not None and issubclass(kind, KeyboardInterrupt) \
                and not issubclass(kind, StoppedAtOnce):
            raise StoppedAtOnce(self.name) from None


def _fit_host_memory(spec: SweepSpec, host_memory: int | None, *, local: dict[str, float] | None = None,
                     cluster: list[dict[str, float]] | None = None) -> tuple[SweepSpec, list[str]]:
    """The spec the trials run with: its ``data`` settings cut so that the embedded Ray's machine
    (``local``), or each node of the ``cluster``, holds the trials it runs at once
    (``orchestrator.node_memory``), and the cuts; ``host_memory``: ``--host-memory``, each node's
    available memory."""
    from orchestrator.device.target import resolve_target
    from orchestrator.node_memory import cluster_nodes, fit_host_memory, local_nodes

    nodes = local_nodes(local, host_memory) if local is not None else cluster_nodes(cluster or [], host_memory)
    return fit_host_memory(spec, nodes, resolve_target(spec).device)


def _estimate_while_ray_starts(spec: SweepSpec, connect: Callable[[], bool]):
    """The driver's memory estimates, made while Ray starts (each takes seconds; in spawned
    processes, so they do not wait on each other), and whether we started Ray.

    A model whose estimate fails still stops the sweep before any trial: the Ray we started for
    it is shut down again and the error is the estimate's one line.

    A Ctrl-C meanwhile waits for an estimate under way in the thread (two cores or fewer:
    ``orchestrator.estimates``) to end, and no further one starts. Left to run on as a daemon, the
    thread was still in torch when the interpreter shut down, which then aborted ("terminate called
    without an active exception") or hung on a lock the interrupted main thread held. A Ctrl-C
    during Ray's own start is held until that start ends (``stop_signal.ctrl_c_held``), and then
    Ray is shut down; no further estimate starts from the moment it came (a start slowed by a busy
    machine outlasted a 5 s estimate, and the next one began).
    """
    stop = threading.Event()
    with ThreadPoolExecutor(1, thread_name_prefix="estimate") as pool:
        estimating = pool.submit(estimate_before_start, spec, stop)
        started_ray = False
        try:
            with ctrl_c_held(on_hold=stop.set):
                started_ray = connect()
            return estimating.result(), started_ray
        except BaseException:
            stop.set()
            if started_ray:
                shut_down_local_ray()
            raise


def _check_before_ray(spec: SweepSpec, storage: str, tracking_uri: str, offline_tracking: bool) -> None:
    """The mistakes that are cheap to find before Ray starts, each one line and exit 2; the checks
    that write nothing first (the storage check makes the folder, which ``taken_back_if_refused``
    removes again if a later check refuses the sweep)."""
    check_workloads(spec)
    check_storage(storage)
    if not offline_tracking:
        from orchestrator.tracking.check import check_tracking

        check_tracking(tracking_uri, spec.experiment)


def _connect_ray(address: str | None, num_cpus, num_gpus, dashboard: bool, dashboard_host: str, verbose: bool = False,
                 worker_env: dict[str, str] | None = None) -> bool:
    """Join the cluster we were pointed at, or start an embedded local Ray. True if we started one.
    ``worker_env``: variables the trials' workers must start with (``import_time_environment``)."""
    import ray

    if ray.is_initialized():
        return False
    secure_token_files()  # before Ray writes a token into ~/.ray, and after it did
    try:
        return _init_ray(address, num_cpus, num_gpus, dashboard, dashboard_host, verbose, worker_env)
    finally:
        secure_token_files()


def _init_ray(address: str | None, num_cpus, num_gpus, dashboard: bool, dashboard_host: str, verbose: bool = False,
              worker_env: dict[str, str] | None = None) -> bool:
    import ray

    logging_config = ray_logging_config(verbose)
    # Only where needed: a job-wide runtime environment makes Ray start workers of its own for it.
    runtime_env = {"env_vars": worker_env} if worker_env else None

    # Workers import the user's own workloads (``my_package.module:Class``) from the driver's
    # working directory: Ray puts it on every worker's sys.path (a Ray Job's uploaded working_dir
    # takes its place), as long as the driver runs with no working_dir of its own.
    if os.environ.get("RAY_ADDRESS"):  # inside a Ray Job: the job's runtime environment applies (ray_job)
        # A job of ours has the variables in the driver's environment too; one submitted otherwise,
        # or an address the user exported, may not.
        missing = worker_env and any(os.environ.get(k) != v for k, v in worker_env.items())
        ray.init(address=os.environ["RAY_ADDRESS"], logging_config=logging_config,
                 runtime_env=runtime_env if missing else None)
    elif address:
        if address == "auto":
            raise UserError("--ray-address: give the head's HOST:PORT; 'auto' can attach to another user's cluster")
        _check_gcs_answers(address)
        try:
            with _native_errors_held(verbose):
                ray.init(address=address, logging_config=logging_config, runtime_env=runtime_env)
        except ConnectionError as exc:
            raise UserError(f"--ray-address {address}: {_refusal(exc)}") from None
    else:
        # A SIGTERM to the driver's process group (SLURM, Kubernetes) reaches the driver alone:
        # it stops the sweep gracefully (orchestrator.stop_signal), then Ray (orchestrator.ray_group).
        with ray_in_its_own_group():
            context = ray.init(
                address="local", num_cpus=num_cpus, num_gpus=num_gpus, include_dashboard=dashboard,
                dashboard_host=dashboard_host, logging_config=logging_config, _system_config=LOCAL_RAY_SYSTEM_CONFIG,
                runtime_env=runtime_env,
            )
        if dashboard:
            from orchestrator.dashboard import how_to_open, metrics_line, token_required

            url = f"http://{context.dashboard_url}"
            print(how_to_open(url, token_required(url)))
            if line := metrics_line(ray.nodes()):
                print(line)
    return True


@contextmanager
def _native_errors_held(verbose: bool) -> Iterator[None]:
    """Standard error held in a file while the driver joins a cluster, written out after a join
    that succeeded. Ray's C++ client writes each try to reach a GCS that refuses our token there
    (``Failed to get cluster ID from GCS server: Unauthenticated``: 20 lines over 25 s) before
    ``ray.init`` raises, and the one line :func:`_refusal` makes says why; ``--verbose`` shows them."""
    if verbose:
        yield
        return
    with tempfile.TemporaryFile() as held:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(held.fileno(), 2)
        joined = False
        try:
            yield
            joined = True
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            if joined:
                held.seek(0)
                sys.stderr.write(held.read().decode(errors="replace"))


def _check_gcs_answers(address: str) -> None:
    """Something listens at ``HOST:PORT``, or one line now: Ray itself waits on an address where
    nothing answers for minutes, warning every 30 s."""
    import socket

    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise UserError(f"--ray-address {address!r}: give the head's HOST:PORT, as `ray start --head` prints it (e.g. 10.0.0.1:6379)")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=GCS_CONNECT_TIMEOUT_S).close()
    except OSError as exc:
        raise UserError(f"--ray-address {address}: nothing answers there ({exc.strerror or exc}); give the head's "
                        "HOST:PORT, as `ray start --head` prints it, and check the head is up (`ray status`)") from None


def _refusal(exc: ConnectionError) -> str:
    """Why Ray could not join the cluster, in a line: its error's cause is a traceback's text."""
    from orchestrator.ray_token import token_refused, token_to_send

    if "InvalidAuthToken" in str(exc.__cause__ or exc):
        return token_refused(token_to_send())
    return f"Ray could not join the cluster there ({str(exc).splitlines()[0]})"


def _experiment_name(spec: SweepSpec, storage: str, name: str | None, resume: bool) -> tuple[str, str | None, bool]:
    """The sweep's folder, the folder to restore from when resuming, and whether the name is one
    the claim must have (given, or the sweep to resume) rather than one of our own.

    Each run gets a fresh, timestamped folder unless ``--name`` fixes it (a SLURM job does, so
    its requeued attempts resume exactly their own sweep); ``--resume`` without a name picks
    the newest sweep of the experiment that can be resumed or is running (which the claim on
    its folder then refuses, rather than a second copy of it starting beside it).
    """
    from orchestrator.tune_state import restorable

    if name:
        path = os.path.join(storage, name)
        if resume and restorable(path):
            return name, path, True
        if resume:
            print(f"Nothing to resume at {path}: starting the sweep")
        return name, None, True
    if resume:
        resumable = {p: restorable(p) for p in sweeps_of(storage, spec.experiment)}
        candidates = sorted((p for p, can in resumable.items() if can or running(p)), key=os.path.getmtime)
        if candidates:
            newest = candidates[-1]
            return os.path.basename(newest), newest if resumable[newest] else None, True
        print(f"Nothing to resume under {storage} for {spec.experiment!r}: starting the sweep")
    return f"{spec.experiment}_{time.strftime('%Y%m%d-%H%M%S')}", None, False


def estimate_before_start(spec: SweepSpec, stop: threading.Event | None = None):
    """The trials' memory, estimated once per memory signature before the Tuner starts.

    A workload whose estimate raises (its model or loss fails on the first batch) stops the sweep
    here, in one line, instead of failing every trial after Ray has started. ``stop``: set when
    the command is interrupted; no more estimates are made.
    """
    from orchestrator.device.target import resolve_target
    from orchestrator.estimates import describe_signature, estimate_trials
    from orchestrator.memory.phases import TrainingLength
    from orchestrator.space import memory_configs

    policy = spec.memory
    planned = resolve_target(spec)  # the workers' device and budget, as far as the driver can tell
    target, budget = planned.kind, planned.budget
    started = time.perf_counter()
    rank_batch = spec.effective_batch_size // spec.resources.workers  # what one rank of a trial computes per step
    estimates = estimate_trials(memory_configs(spec), policy, target, budget, rank_batch, stop=stop,
                                length=TrainingLength.of(spec))
    if stop is not None and stop.is_set():
        return estimates
    if estimates.errors:
        signature, error = next(iter(estimates.errors.items()))
        raise UserError(f"workload {describe_signature(signature, spec.search_space)}: the {policy.estimator} estimate failed "
                        f"({error}); {_estimate_advice(error, policy.precision, target)}")
    if estimates.by_signature:
        print(f"Estimated the memory of {len(estimates.by_signature)} distinct trial configuration(s) for "
              f"{'an' if target[0] in 'aeiou' else 'a'} {target} device in {time.perf_counter() - started:.1f}s ({policy.estimator})", flush=True)
    reasons: dict[str, list[str]] = {}  # `plan` showed the fallback's plan: the trials' may differ
    for signature, why in estimates.fell_back.items():
        reasons.setdefault(why, []).append(describe_signature(signature, spec.search_space))
    for why, described in reasons.items():
        print(f"  {'; '.join(described)}: {why}; {'their' if len(described) > 1 else 'its'} trials estimate again "
              "on their own device", flush=True)
    return estimates


def _estimate_advice(error: str, precision: str = "fp32", target: str = "cuda") -> str:
    """What helps with an estimate that failed. An op that failed on the estimator's fake tensors
    (``aten.nonzero ...``) may run on real ones, so starting without an estimate can help; any
    other error (the model's own code raised: the pre-flight already built it) would stop every
    trial the same way, and only fixing the workload helps. fp16 on a device whose kernels are the
    CPU's fails in some ops whatever the tensors (an LSTM's oneDNN kernel), and so would its trials."""
    if "aten." in error and precision == "fp16" and target != "cuda":
        return (f"the CPU has no fp16 kernel for some ops, and this {target} device runs the CPU's: "
                "set memory.precision: bf16 or fp32, fix the workload, or set memory.estimator: none")
    if "aten." in error:
        return "fix the workload, or set memory.estimator: none to start trials without an estimate"
    return "fix the workload: its trials would fail the same way"


def _trainable(spec: SweepSpec, estimates):
    from ray import tune

    from orchestrator.packing import auto_gpu_resources
    from orchestrator.trial.trainable import train_trial

    trainable = tune.with_parameters(train_trial, spec=spec, estimates=estimates)
    if spec.resources.gpu == "auto":
        return tune.with_resources(trainable, auto_gpu_resources(spec, estimates))
    if spec.resources.workers > 1:  # one bundle per rank; rank 0 is the trial's own actor (orchestrator.trial.group)
        bundle = {"CPU": spec.resources.cpu, "GPU": float(spec.resources.gpu)}
        return tune.with_resources(trainable, tune.PlacementGroupFactory([bundle] * spec.resources.workers))
    return tune.with_resources(trainable, {"cpu": spec.resources.cpu, "gpu": spec.resources.gpu})


def _param_space(spec: SweepSpec) -> dict[str, Any]:
    from orchestrator.space import tune_param_space

    return tune_param_space(spec)


def _tune_settings() -> None:
    """Tune's process-wide settings, made in one place for a new and a restored sweep alike:
    ``Tuner.restore`` (``--resume``, a SLURM requeue) builds no ``TuneConfig`` of ours, so a
    setting made while building one would be missing exactly when a sweep resumes."""
    # Checkpoint-only reports (checkpoint.every apart from eval_every) carry no eval metric; the
    # metric's name was checked against every workload's declared metrics before Ray started.
    os.environ.setdefault("TUNE_DISABLE_STRICT_METRIC_CHECKING", "1")


def _tune_config(spec: SweepSpec):
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler

    from orchestrator.retry import OomAwareScheduler
    from orchestrator.space import search_algorithm

    if spec.scheduler.type == "asha":
        inner = ASHAScheduler(
            time_attr=spec.scheduler.time_attr, max_t=spec.asha_last_rung(),
            grace_period=spec.scheduler.grace_period, reduction_factor=spec.scheduler.reduction_factor,
        )
    else:
        inner = FIFOScheduler()
    return tune.TuneConfig(
        metric=spec.metric, mode=spec.mode, num_samples=spec.num_samples, search_alg=search_algorithm(spec),
        scheduler=OomAwareScheduler(inner, max_failures=spec.max_failures), reuse_actors=spec.reuse,
    )


def _run_config(spec: SweepSpec, name: str, storage: str, tracking_uri: str, scheduler, wait: WaitForNodes | None = None,
                verbose: bool = False, *, host_cuts: list[str] = ()):
    from ray import tune

    return tune.RunConfig(
        name=name,
        storage_path=storage,
        callbacks=_callbacks(spec, os.path.join(storage, name), tracking_uri, scheduler, host_cuts),
        verbose=TUNE_VERBOSE if verbose else TUNE_QUIET,  # quiet: orchestrator.console's LiveView tells
        stop=wait,
        # In-process OOMs are retried by the trainable; Tune restarts workers that died (of
        # memory, mostly) and, up to max_failures, trials that failed otherwise. The scheduler
        # spends this shared budget by kind of failure.
        failure_config=tune.FailureConfig(max_failures=spec.memory.max_oom_retries + spec.max_failures),
        checkpoint_config=tune.CheckpointConfig(num_to_keep=spec.checkpoint.keep),
    )


def _callbacks(spec: SweepSpec, experiment_path: str, tracking_uri: str, scheduler, host_cuts: list[str] = ()) -> list:
    """The driver's Tune callbacks: MLflow (with the data loading ``host_cuts`` made for the nodes'
    memory), the final errors and configs Tune's results may lack (outcome.py), the scheduler's
    state for a resume (scheduler_state.py),
    the live view of the trials' events (console.py), the OOM retries counted for Prometheus
    (oom_counter.py), the stop when the storage refuses a checkpoint
    (storage_fault.py), the last whole copy of Tune's state files and a resume's trials rid of the
    checkpoints a killed driver deleted (tune_state.py), Tune's TensorBoard
    files with the trials' curves (tensorboard.py; Tune adds its JSON and CSV loggers itself), and what
    is dropped of ended trials so that the driver stays flat as trials grow (driver_memory.py; last,
    after the others read them)."""
    from orchestrator.console import LiveView
    from orchestrator.driver_memory import EndedTrialsKeepLess
    from orchestrator.oom_counter import CountOomRetries
    from orchestrator.outcome import WhatResultsLack
    from orchestrator.scheduler_state import SchedulerState
    from orchestrator.storage_fault import StopOnStorageFault
    from orchestrator.tensorboard import tensorboard_logger
    from orchestrator.tune_state import ForgetGoneCheckpoints, KeepWholeState
    from orchestrator.tracking.callback import UNSENT_FILE, MlflowTracking

    view = LiveView(list(spec.search_space), spec.metric, spec.stop.epochs, spec.stop.steps)
    tracking = MlflowTracking(tracking_uri, spec, unsent_file=os.path.join(experiment_path, UNSENT_FILE),
                              host_cuts=list(host_cuts))
    tensorboard = tensorboard_logger()
    return [tracking, WhatResultsLack(), SchedulerState(scheduler), view, CountOomRetries(spec.experiment), StopOnStorageFault(),
            KeepWholeState(), ForgetGoneCheckpoints(), *([tensorboard] if tensorboard else []),
            EndedTrialsKeepLess(spec.metric)]


def _end_tracking_at_once(tuner) -> None:
    """The sweep's MLflow runs end KILLED when Tune stopped at once (``MlflowTracking.stopped_at_once``)."""
    for callback in _tracking_of(tuner):
        callback.stopped_at_once()


def _track_in(tuner, tracking_uri: str) -> None:
    """A restored sweep's MLflow callback writes to ``tracking_uri``. Tune restores the callbacks
    the sweep started with (``Tuner.restore`` takes no run config), and so the store they
    named: a resume that names another (an MLflow server that moved, a requeued SLURM job's new
    server port) would otherwise print one store and write to the other."""
    for callback in _tracking_of(tuner):
        callback.tracking_uri = tracking_uri


def _tracking_of(tuner) -> list:
    """The MLflow callback ``tuner`` runs with (Tune's own objects: a restored sweep's unpickled)."""
    from orchestrator.ray_internals import callbacks_of
    from orchestrator.tracking.callback import MlflowTracking

    return [callback for callback in callbacks_of(tuner) if isinstance(callback, MlflowTracking)]


# -- the final table ---------------------------------------------------------------------------


def _row(result, spec: SweepSpec, record: SweepRecord | None = None) -> TrialRow:
    report = TrialReport.from_result(result.metrics)
    record = record or SweepRecord()
    config = result.config or record.configs.get(str(result.path), {})
    # Tune reads errors back from storage: a trial whose error could not be written there has
    # none in its result, but the driver's callback saw it fail.
    error = exception_line(str(result.error)) if result.error is not None else record.errors.get(str(result.path))
    status = trial_status(error is not None, report)
    value = report.metric(spec.metric)
    if value is None or report.diverged:  # a checkpoint's report, or the worst value told to the searcher
        value = _last_evaluated(result, spec.metric)  # its last evaluation's, as `report` shows it
    note = report.refusal or error or report.diverged or ""  # in full: the reason is what a person reads the row for
    if status == INTERRUPTED and record.stop_reason:
        note = record.stop_reason
    return TrialRow(
        name=str(report.trial_id or (os.path.basename(result.path) if result.path else "?")),
        config=config_text(config, list(spec.search_space)),  # what differs between trials
        status=status,
        epochs=report.epoch or 0,
        steps=report.step or 0,
        # A trial trained on through a NaN (on_nan: continue) reached NaN, and the table says so.
        final_metric=value if isinstance(value, (int, float)) and not report.refused else None,
        plan=plan_text(report),
        peak_bytes=_highest_peak(result) or report.measured_peak,
        memory_source=report.memory_source or "",
        oom_retries=max(report.oom_retries, survived_ooms(gave_up_events(result.path)) if error and result.path else 0),
        note=note,
        node=report.node_name or "",
        moves=describe_moves(report.moves),
        stopped_early=status == TERMINATED and report.stopped_early,
    )


#: The most trials the final table lists (Tune's progress table shows 20 rows too); ``report`` lists them all.
TABLE_ROWS = 20
#: Of those, the finished trials with the best metric, when the sweep has more trials than the table rows.
BEST_ROWS = 10


def summary_table(rows: list[TrialRow], spec: SweepSpec) -> str:
    """trial, config, progress against the budget, the metric, micro-batch x accumulation, peak memory, status;
    on a cluster of several nodes also the node of each trial, and the moves of those that moved.

    A sweep of more than :data:`TABLE_ROWS` trials (hundreds under ASHA) lists the trials to look
    at, not a screenful per hundred: those that did not simply finish (an error, a refusal, an
    interruption, an OOM survived, a move) and the best by the sweep's metric, at least
    :data:`BEST_ROWS` of them, with a line that says what was left out."""
    if len(rows) <= TABLE_ROWS:
        return _table(rows, spec)
    to_look_at, simply_finished = [], []
    for r in rows:
        (to_look_at if r.status != TERMINATED or r.oom_retries or r.moves else simply_finished).append(r)
    ranked = _by_metric(simply_finished, spec)
    looked = to_look_at[:TABLE_ROWS - min(BEST_ROWS, len(ranked))]
    best = ranked[:TABLE_ROWS - len(looked)]
    chosen = {id(r) for r in looked + best}
    shown = [r for r in rows if id(r) in chosen]
    parts = [f"the {len(best)} best by {spec.metric}"] if best else []
    if to_look_at:
        parts.append(f"{'all ' if len(looked) == len(to_look_at) else f'{len(looked)} of '}{len(to_look_at)} "
                     "that did not simply finish")
    return (f"{_table(shown, spec)}\n({len(shown)} of {len(rows)} trials: {' and '.join(parts)}; "
            "`orchestrator report` lists every trial)")


def _last_evaluated(result, metric: str):
    """The trial's last reported value of ``metric`` that is not an infinity (Tune's table of its
    results; a diverged trial's last is the worst value, for the searcher), or None."""
    frame = getattr(result, "metrics_dataframe", None)
    if frame is None or metric not in frame:
        return None
    values = [float(v) for v in frame[metric].dropna() if not math.isinf(v)]
    return values[-1] if values else None


def _highest_peak(result) -> int | None:
    """The highest peak any of the trial's reports measured, as `report` shows it (each report's
    peak is its window's: the steps since the report before)."""
    frame = getattr(result, "metrics_dataframe", None)
    if frame is None:
        return None
    columns = [frame[key] if key in frame else [None] * len(frame) for key in ("peak_allocated_bytes", "peak_reserved_bytes")]
    peaks = [TrialReport(peak_allocated_bytes=_number(allocated), peak_reserved_bytes=_number(reserved)).measured_peak
             for allocated, reserved in zip(*columns)]
    return max((p for p in peaks if p), default=None)


def _number(value) -> int | None:
    return None if value is None or value != value else int(value)  # pandas' NaN: not reported


def best_row(rows: list[TrialRow], spec: SweepSpec) -> TrialRow | None:
    """The finished trial with the best final metric (None when no trial has one)."""
    ranked = _by_metric([r for r in rows if r.status == TERMINATED], spec)
    return ranked[0] if ranked else None


def _by_metric(rows: list[TrialRow], spec: SweepSpec) -> list[TrialRow]:
    """The rows with a finite final metric, best first in the sweep's mode."""
    measured = [r for r in rows if r.final_metric is not None and math.isfinite(r.final_metric)]
    return sorted(measured, key=lambda r: r.final_metric, reverse=spec.mode == "max")


def _table(rows: list[TrialRow], spec: SweepSpec) -> str:
    nodes = {r.node for r in rows if r.node}
    body = [
        (
            r.name,
            r.config,
            trained_text(r.epochs, r.steps, spec.stop.epochs, spec.stop.steps),
            f"{r.final_metric:.4f}" if r.final_metric is not None else "-",
            r.plan,
            f"{human(r.peak_bytes)} ({MEMORY_LABELS.get(r.memory_source, r.memory_source)})" if r.peak_bytes else "-",
            r.oom_retries,
            _status(r),
        )
        for r in rows
    ]
    header = ["trial", "config", "trained", spec.metric, "micro x accum", "peak memory", "OOMs", "status"]
    if len(nodes) > 1 or any(r.moves for r in rows):
        header.insert(1, "node")
        body = [(row[0], r.node or "-", *row[1:]) for row, r in zip(body, rows)]
    return format_table(header, body)


def _status(row: TrialRow) -> str:
    """The status, with why it did not finish, or the moves of a trial that finished on another node."""
    notes = [n for n in (row.note if row.status != TERMINATED else "", row.moves) if n]
    return row.status + (f": {'; '.join(notes)}" if notes else "")
