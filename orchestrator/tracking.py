"""MLflow tracking for a sweep: one parent run per sweep, one nested child run per Tune trial.

Why not Ray's ``MLflowLoggerCallback``: it re-logs params at every actor start, and MLflow
refuses a changed param ("Changing param values is not allowed", ray #27783) - exactly what a
trial retried with a smaller plan does. Here what never changes during a trial (workload,
hyper-parameters, estimator, budget, GPU) is logged as params once; what can change (the plan)
is logged with every result as metrics, as a ``plan_history.json`` artifact whenever it changes, and as
``plan.*`` params only when the trial has ended. Params are only ever added, never changed.

Why a queue: a tracking server can be away for a while (restart, network). Every write is an
operation on an ordered queue that one background thread sends, so the Tune driver never waits
on MLflow and a sweep never fails because of it. An outage (nothing answers, a timeout, a 5xx,
a SQLite store locked by another process, credentials refused) is waited out: the operation is
resent until it lands. Only a rejection of the data itself (a 4xx such as an invalid value)
drops an operation, after a few attempts, and the drop is reported: the sweep run is marked
FAILED and ``run`` exits non-zero (:class:`orchestrator.outcome.TrackingDelivery`). What is still
queued is part of this callback's Tune state (saved with each experiment checkpoint) and, at the
end of a sweep that could not send everything, is kept in the sweep's folder
(:data:`UNSENT_FILE`), so ``run --resume`` sends it. Every operation is idempotent, so sending
one twice is harmless: runs are looked up by tags before they are created, a result is sent
only if the run does not have that step of the ``step`` metric yet (re-read from MLflow after
any failure, since a request may land although its reply was lost), params are only added,
artifacts are overwritten.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pickle
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from ray import tune

from orchestrator.config import Domain, SweepSpec
from orchestrator.contract import describe_moves, records_from_report
from orchestrator.errors import UserError
from orchestrator.failures import exception_line, last_failure
from orchestrator.outcome import TrackingDelivery, current_record, sweep_run_status, trial_status
from orchestrator.preflight import check_new_database

logger = logging.getLogger(__name__)

SWEEP_ID_TAG = "orchestrator.sweep_id"
ROLE_TAG = "orchestrator.role"  # "sweep" (the parent run) or "trial"
PARENT_TAG = "mlflow.parentRunId"  # what makes a run nested in MLflow's UI
#: Logged with every result at MLflow step = the trial's optimizer step: the record of which results a run has.
STEP_METRIC = "step"

#: Numeric keys of a Tune result that are bookkeeping, not measurements (``time_total_s`` is kept:
#: it is the trial's training time across restarts, which GPU hours are computed from).
TUNE_BOOKKEEPING = frozenset({
    "training_iteration", "timestamp", "pid", "time_this_iter_s", "time_since_restore",
    "iterations_since_restore", "done", "refused", "training_done",
})
#: Per-trial facts that do not change while it runs: params, logged once.
TRIAL_PARAM_KEYS = ("estimator", "estimated_by", "memory_source", "budget_bytes", "gpu_name", "gpu_total_bytes")
#: Strings that can change with the plan: tags, which MLflow lets us overwrite.
TRIAL_TAG_KEYS = ("precision", "predicted_phase", "memory_source", "node_name")

MAX_PARAM_CHARS = 6000  # MLflow's limit on a param value
MAX_TAG_CHARS = 8000
MAX_BATCH = 100  # params or tags per log_batch call

#: Defaults for MLflow's HTTP client in this process: fail fast, the outbox does the retrying.
HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}
RETRY_FIRST_S, RETRY_MAX_S = 1.0, 10.0
ATTEMPTS_WHEN_REJECTED = 3  # an operation MLflow rejects this often is dropped (and reported)
#: HTTP statuses that say nothing about the data: the server is away, overloaded or not letting us in yet.
OUTAGE_STATUSES = frozenset({401, 403, 408, 429})
#: In the sweep's folder: the writes a sweep could not send, for ``run --resume`` to send.
UNSENT_FILE = "mlflow_unsent.pkl"


# -- what is sent ---------------------------------------------------------------------------


@dataclass(frozen=True)
class TrialRef:
    """Enough to find or create a trial's child run, whether or not any earlier write arrived."""

    trial_id: str
    name: str  # str(trial), as in Tune's progress table
    workload: str


#: The run an operation writes to: a trial's child run, or ``None`` for the sweep's parent run.
Target = TrialRef | None


@dataclass
class StartRun:
    """Find or create the run, (re)mark it RUNNING, and add its params and tags."""

    target: Target
    params: dict[str, str] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)

    def apply(self, mlflow: "_MlflowWriter") -> None:
        run_id = mlflow.run_id(self.target)
        mlflow.add_params(run_id, self.params)
        mlflow.set_tags(run_id, self.tags)
        if mlflow.client.get_run(run_id).info.status != "RUNNING":  # a resumed sweep or trial
            mlflow.client.update_run(run_id, status="RUNNING")


@dataclass
class AddParams:
    target: Target
    params: dict[str, str]

    def apply(self, mlflow: "_MlflowWriter") -> None:
        mlflow.add_params(mlflow.run_id(self.target), self.params)


@dataclass
class SetTags:
    target: Target
    tags: dict[str, str]

    def apply(self, mlflow: "_MlflowWriter") -> None:
        mlflow.set_tags(mlflow.run_id(self.target), self.tags)


@dataclass
class LogResult:
    """One result's metrics at MLflow step = the trial's optimizer step; skipped if the run has it.

    A step reported twice (replayed after an OOM, a restart from an earlier checkpoint) keeps
    what was logged first.
    """

    target: TrialRef
    step: int
    metrics: dict[str, float]
    timestamp_ms: int  # when Tune received the result, not when it reached MLflow

    def apply(self, mlflow: "_MlflowWriter") -> None:
        from mlflow.entities import Metric

        run_id = mlflow.run_id(self.target)
        logged = mlflow.steps(run_id)
        if self.step in logged:
            return
        metrics = [Metric(k, v, self.timestamp_ms, self.step) for k, v in self.metrics.items()]
        metrics.append(Metric(STEP_METRIC, float(self.step), self.timestamp_ms, self.step))
        mlflow.client.log_batch(run_id, metrics=metrics)  # one transaction: all of a result or none
        logged.add(self.step)


@dataclass
class LogArtifact:
    """A small text or JSON file; sending it again overwrites it."""

    target: Target
    path: str
    content: Any  # str for text, else JSON-able

    def apply(self, mlflow: "_MlflowWriter") -> None:
        run_id = mlflow.run_id(self.target)
        if isinstance(self.content, str):
            mlflow.client.log_text(run_id, self.content, self.path)
        else:
            mlflow.client.log_dict(run_id, self.content, self.path)


@dataclass
class EndRun:
    target: Target
    status: str  # FINISHED | FAILED | KILLED

    def apply(self, mlflow: "_MlflowWriter") -> None:
        status = self.status
        if self.target is None and status == "FINISHED" and mlflow.dropped:
            status = "FAILED"  # its record is incomplete, and `run` exits non-zero for it
        mlflow.client.set_terminated(mlflow.run_id(self.target), status)


Operation = StartRun | AddParams | SetTags | LogResult | LogArtifact | EndRun


def describe(op: Operation) -> str:
    """``LogResult(step 300 of train_trial_ab12c_00001)``: for warnings, without payloads."""
    target = op.target.name if op.target else "the sweep run"
    detail = f"step {op.step} of " if isinstance(op, LogResult) else ""
    return f"{type(op).__name__}({detail}{target})"


# -- who sends it ---------------------------------------------------------------------------


@dataclass(frozen=True)
class SweepIdentity:
    """What finds the parent run again: the sweep id tag survives driver restarts via Tune state."""

    sweep_id: str
    run_name: str
    experiment: str


class _MlflowWriter:
    """The outbox thread's MLflow client, with the run ids and logged steps it has looked up."""

    def __init__(self, tracking_uri: str, sweep: SweepIdentity):
        self.tracking_uri = tracking_uri
        self._client = None
        self.sweep = sweep
        self._experiment_id: str | None = None
        self._runs: dict[str | None, str] = {}  # trial id (None: the sweep) -> run id
        self._steps: dict[str, set[int]] = {}  # run id -> steps MLflow has
        self.dropped: list[str] = []  # operations MLflow rejected, described

    @property
    def client(self):
        """Made on first use, in the outbox's thread: opening a store can fail like any request
        (a SQLite file that cannot be opened yet) and is then retried like one."""
        if self._client is None:
            from mlflow import MlflowClient

            self._client = MlflowClient(self.tracking_uri)
        return self._client

    def forget_steps(self) -> None:
        """After a failed request: what landed is unknown, so re-read it before sending results."""
        self._steps.clear()

    def experiment_id(self) -> str:
        if self._experiment_id is None:
            self._experiment_id = get_or_create_experiment(self.client, self.sweep.experiment, self.tracking_uri)
        return self._experiment_id

    def run_id(self, target: Target) -> str:
        key = target.trial_id if target else None
        if key not in self._runs:
            self._runs[key] = self._find_run(target) or self._create_run(target)
        return self._runs[key]

    def steps(self, run_id: str) -> set[int]:
        if run_id not in self._steps:
            history = self.client.get_metric_history(run_id, STEP_METRIC)
            self._steps[run_id] = {int(m.step) for m in history}
        return self._steps[run_id]

    def add_params(self, run_id: str, params: dict[str, str]) -> None:
        """Log the params the run does not have yet. A different value for one it has is kept
        as it was (MLflow params are immutable) and reported once."""
        if not params:
            return
        existing = self.client.get_run(run_id).data.params
        changed = sorted(k for k, v in params.items() if k in existing and existing[k] != v)
        if changed:
            logger.warning(
                "MLflow run %s keeps its first value of param(s) %s (params cannot change); "
                "the change is in its metrics and plan_history.json", run_id, ", ".join(changed),
            )
        self._log_batch(run_id, params={k: v for k, v in params.items() if k not in existing})

    def set_tags(self, run_id: str, tags: dict[str, str]) -> None:
        self._log_batch(run_id, tags=tags)

    def _log_batch(self, run_id: str, params: dict[str, str] | None = None, tags: dict[str, str] | None = None) -> None:
        from mlflow.entities import Param, RunTag

        for kind, items in (("params", params or {}), ("tags", tags or {})):
            entities = [Param(k, v) if kind == "params" else RunTag(k, v) for k, v in items.items()]
            for start in range(0, len(entities), MAX_BATCH):
                self.client.log_batch(run_id, **{kind: entities[start:start + MAX_BATCH]})

    def _find_run(self, target: Target) -> str | None:
        query = f"tags.`{SWEEP_ID_TAG}` = '{self.sweep.sweep_id}'"
        query += f" and tags.trial_id = '{target.trial_id}'" if target else f" and tags.`{ROLE_TAG}` = 'sweep'"
        runs = self.client.search_runs([self.experiment_id()], query, max_results=1, order_by=["attributes.start_time ASC"])
        return runs[0].info.run_id if runs else None

    def _create_run(self, target: Target) -> str:
        tags = {SWEEP_ID_TAG: self.sweep.sweep_id, ROLE_TAG: "trial" if target else "sweep"}
        if target:
            tags.update({PARENT_TAG: self.run_id(None), "trial_id": target.trial_id, "workload": target.workload})
        name = target.name if target else self.sweep.run_name
        return self.client.create_run(self.experiment_id(), run_name=name, tags=tags).info.run_id


def get_or_create_experiment(client, name: str, tracking_uri: str) -> str:
    """The experiment's id. With a SQLite store its artifacts go next to the database file,
    not into ``./mlruns`` of whatever directory the driver happens to run in."""
    from mlflow.exceptions import MlflowException

    experiment = client.get_experiment_by_name(name)
    if experiment is None:
        database = sqlite_path(tracking_uri)
        location = str(database.parent / "mlartifacts") if database else None
        try:
            return client.create_experiment(name, artifact_location=location)
        except MlflowException:  # created meanwhile by another driver
            experiment = client.get_experiment_by_name(name)
            if experiment is None:
                raise
    if experiment.lifecycle_stage != "active":
        raise RuntimeError(f"MLflow experiment {name!r} is deleted; restore it or use another experiment name")
    return experiment.experiment_id


def check_tracking(tracking_uri: str, experiment: str) -> None:
    """Before a sweep starts: MLflow answers at ``tracking_uri``, lets us in, and the sweep's
    experiment is not a deleted one (which no write could go to). A mistake here is one line and
    exit 2, not a sweep that trains for hours and then says its records are still unsent."""
    database = sqlite_path(tracking_uri)
    if database is not None and not database.exists():
        check_new_database(database)
        return
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    for key, value in HTTP_DEFAULTS.items():
        os.environ.setdefault(key, value)
    try:
        found = MlflowClient(tracking_uri).get_experiment_by_name(experiment)
    except Exception as exc:  # noqa: BLE001 - whatever it is, the sweep cannot record there
        if isinstance(exc, MlflowException) and exc.get_http_status_code() in (401, 403):
            raise UserError(
                f"tracking_uri: MLflow at {tracking_uri} refused our credentials (HTTP {exc.get_http_status_code()}); set "
                "MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN)"
            ) from None
        raise UserError(
            f"tracking_uri: MLflow at {tracking_uri} is not usable ({first_line(exc)}); start it or fix the URI, "
            "or pass --offline-tracking to run anyway (the records then wait in the sweep's folder for `run --resume`)"
        ) from None
    if found is not None and found.lifecycle_stage != "active":
        raise UserError(
            f"experiment: the MLflow experiment {experiment!r} at {tracking_uri} is deleted; restore it "
            f"(`mlflow experiments restore --experiment-id {found.experiment_id}`) or use another experiment name"
        )


def sqlite_path(tracking_uri: str) -> Path | None:
    """The database file of a ``sqlite:///`` URI (``sqlite:///rel.db``, ``sqlite:////abs.db``)."""
    if not tracking_uri.startswith("sqlite:///"):
        return None
    path = tracking_uri[len("sqlite:///"):].split("?", 1)[0]
    return Path(path).resolve() if path and path != ":memory:" else None


def is_outage(exc: BaseException) -> bool:
    """Whether a failed MLflow call says the store is unavailable rather than that the data is bad.

    MLflow turns a locked SQLite database into ``TEMPORARILY_UNAVAILABLE``, a connection error or
    a timeout into an ``INTERNAL_ERROR`` (500) wrapping the ``requests`` error, and a server's
    error reply into its HTTP status; a rejected value is a 4xx. Credentials refused (401, 403)
    are not the data's fault either: fixed, the same write goes through.
    """
    from mlflow.exceptions import MlflowException

    if isinstance(exc, MlflowException):
        status = exc.get_http_status_code()
        return status >= 500 or status in OUTAGE_STATUSES
    if isinstance(exc, OSError):  # requests' errors, a full or unreadable disk under a local store
        return True
    return any(type(e).__name__ in ("OperationalError", "TimeoutError") for e in _chain(exc))


def _chain(exc: BaseException) -> list[BaseException]:
    seen = []
    while exc is not None and exc not in seen:
        seen.append(exc)
        exc = exc.__cause__ or exc.__context__
    return seen


def first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]


class _Outbox:
    """Operations waiting to reach MLflow, in order, and the one thread that sends them."""

    def __init__(self, writer: _MlflowWriter, pending: list[Operation]):
        self._writer = writer
        self._ops: deque[Operation] = deque(pending)
        self._cv = threading.Condition()
        self._closing = False
        self._offline_since: float | None = None
        self._thread = threading.Thread(target=self._run, name="mlflow-outbox", daemon=True)
        self._thread.start()

    def put(self, op: Operation) -> None:
        with self._cv:
            self._ops.append(op)
            self._cv.notify_all()

    def pending(self) -> list[Operation]:
        with self._cv:
            return list(self._ops)

    @property
    def dropped(self) -> list[str]:
        return self._writer.dropped

    def drain(self, timeout: float) -> bool:
        """Wait until everything was sent (or ``timeout`` passed); True if the queue is empty."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._ops, timeout=timeout)

    def close(self) -> None:
        """Stop the thread once its current request (bounded by the HTTP timeout) returns."""
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        delay, failures = RETRY_FIRST_S, 0
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._ops or self._closing)
                if self._closing:
                    return
                op = self._ops[0]
            try:
                op.apply(self._writer)
            except Exception as exc:  # noqa: BLE001 - tracking must never take the sweep down
                self._writer.forget_steps()
                if is_outage(exc):
                    self._went_offline(exc)
                    self._pause(delay)
                    delay = min(2 * delay, RETRY_MAX_S)
                    continue
                failures += 1
                if failures < ATTEMPTS_WHEN_REJECTED:
                    self._pause(RETRY_FIRST_S)
                    continue
                logger.warning("MLflow rejected %s %d times, dropping it: %s", describe(op), failures, first_line(exc))
                self._writer.dropped.append(f"{describe(op)}: {first_line(exc)}")
            self._came_back()
            delay, failures = RETRY_FIRST_S, 0
            with self._cv:
                self._ops.popleft()
                self._cv.notify_all()

    def _pause(self, seconds: float) -> None:
        with self._cv:
            self._cv.wait_for(lambda: self._closing, timeout=seconds)

    def _went_offline(self, exc: Exception) -> None:
        if self._offline_since is None:
            self._offline_since = time.monotonic()
            logger.warning(
                "MLflow at %s is unavailable (%s); keeping %d write(s) and retrying",
                self._writer.tracking_uri, first_line(exc), len(self._ops),
            )

    def _came_back(self) -> None:
        if self._offline_since is not None:
            logger.warning(
                "MLflow at %s is reachable again after %.0f s; sending %d buffered write(s)",
                self._writer.tracking_uri, time.monotonic() - self._offline_since, len(self._ops),
            )
            self._offline_since = None


# -- the Tune callback ----------------------------------------------------------------------


@dataclass
class _TrialLog:
    """What the driver remembers of a trial (saved in Tune's experiment state)."""

    ref: TrialRef
    plans: list[dict] = field(default_factory=list)  # [{"step": s, "epoch": e, "plan": {...}}], one per change
    oom_events_logged: int = 0
    restarts: int = 0
    tags: dict[str, str] = field(default_factory=dict)  # as last queued: only changes are sent
    described: bool = False  # its once-only params were queued
    ended: bool = False  # Tune reported it complete or failed (an interrupted sweep's trials are not)


class MlflowTracking(tune.Callback):
    """Tune callback (driver side) that records the sweep in MLflow; see the module docstring."""

    def __init__(self, tracking_uri: str, spec: SweepSpec, *, flush_timeout_s: float = 120.0,
                 unsent_file: str | None = None):
        self.tracking_uri = tracking_uri
        self.spec = spec
        self.flush_timeout_s = flush_timeout_s
        self.unsent_file = unsent_file  # in the sweep's folder: where writes left unsent wait for a resume
        self._sweep = SweepIdentity(uuid.uuid4().hex, f"sweep-{time.strftime('%Y%m%d-%H%M%S')}", spec.experiment)
        self._trials: dict[str, _TrialLog] = {}
        self._restored: list[Operation] = []  # unsent operations of the driver we resume from
        self._outbox: _Outbox | None = None
        self._sweep_named = False  # this driver has tagged the sweep run with Tune's experiment

    # Tune pickles its callbacks with the run config; the thread and client are not part of that.
    def __getstate__(self) -> dict:
        return {**self.__dict__, "_outbox": None}

    # -- Tune state: what a resumed driver needs to continue the same runs -------------------
    def get_state(self) -> dict:
        pending = self._outbox.pending() if self._outbox else self._restored
        return {"sweep": self._sweep, "trials": dict(self._trials), "pending": pending}

    def set_state(self, state: dict) -> None:
        self._sweep = state["sweep"]
        self._trials = dict(state["trials"])
        self._restored = list(state["pending"])

    # -- hooks -------------------------------------------------------------------------------
    def setup(self, stop=None, num_samples=None, total_num_samples=None, **info) -> None:
        for key, value in HTTP_DEFAULTS.items():
            os.environ.setdefault(key, value)
        self._outbox = _Outbox(_MlflowWriter(self.tracking_uri, self._sweep), self._kept() or self._restored)
        self._restored = []
        tags = {"orchestrator.config": self.spec.source} if self.spec.source else {}
        self._put(StartRun(None, params=spec_params(self.spec), tags=tags))
        self._put(LogArtifact(None, "sweep.yaml", yaml.safe_dump(self.spec.raw, sort_keys=False)))

    def on_trial_start(self, iteration, trials, trial, **info) -> None:
        log = self._log(trial)
        log.ended = False  # also a trial restarted by a resumed sweep
        resources = trial.placement_group_factory.required_resources
        params = {f"config.{k}": _param_text(v) for k, v in trial.config.items() if k in self._hyper_parameter_names()}
        params.update({f"resources.{kind.lower()}": _param_text(resources.get(kind, 0)) for kind in ("CPU", "GPU")})
        self._put(StartRun(log.ref, params=params, tags={"tune.trial_path": str(trial.path or "")}))
        if not self._sweep_named:
            # Named like Tune's experiment folder, so the sweep is found from Tune's output.
            tags = {"mlflow.runName": trial.experiment_dir_name, "tune.experiment_path": str(trial.remote_experiment_path)}
            self._put(SetTags(None, tags))
            self._sweep_named = True

    def on_trial_result(self, iteration, trials, trial, result, **info) -> None:
        log = self._log(trial)
        if not log.described:
            params = {k: _param_text(result[k]) for k in TRIAL_PARAM_KEYS if result.get(k) is not None}
            self._put(AddParams(log.ref, params))
            log.described = True
        tags = {k: str(result[k]) for k in TRIAL_TAG_KEYS if result.get(k) is not None}
        plan = result.get("plan")
        if plan and (not log.plans or log.plans[-1]["plan"] != plan):
            log.plans.append({"step": result.get("step"), "epoch": result.get("epoch"), "plan": plan})
            self._put(LogArtifact(log.ref, "plan_history.json", list(log.plans)))
        if refusal := _refusal(result):
            tags["refusal"] = refusal[:MAX_TAG_CHARS]
        if moves := describe_moves(result.get("moves")):
            tags["moves"] = moves[:MAX_TAG_CHARS]
        changed = {k: v for k, v in tags.items() if log.tags.get(k) != v}
        if changed:
            self._put(SetTags(log.ref, changed))
            log.tags.update(changed)
        events = records_from_report(result.get("oom_events"))
        if len(events) > log.oom_events_logged:
            self._put(LogArtifact(log.ref, "oom_events.json", list(events)))
            log.oom_events_logged = len(events)
        if isinstance(result.get("step"), int):
            self._put(LogResult(log.ref, result["step"], result_metrics(result), int(time.time() * 1000)))

    def on_trial_recover(self, iteration, trials, trial, **info) -> None:
        """Tune restarts the trial (from its last checkpoint, possibly with a changed config)."""
        log = self._log(trial)
        log.restarts += 1
        self._put(SetTags(log.ref, {"tune.restarts": str(log.restarts), "tune.last_error": _error_summary(trial)}))

    def on_trial_complete(self, iteration, trials, trial, **info) -> None:
        refused = _refusal(trial.last_result or {})
        self._end_trial(trial, "FAILED" if refused else "FINISHED")

    def on_trial_error(self, iteration, trials, trial, **info) -> None:
        self._put(SetTags(self._log(trial).ref, {"error": _error_summary(trial)}))
        self._end_trial(trial, "FAILED")

    def on_experiment_end(self, trials, **info) -> None:
        if self._outbox is None:
            return
        # Interrupted (Ctrl-C, SIGUSR1 before a SLURM requeue): Tune stops these trials as TERMINATED
        # although they did not finish. A resumed sweep marks them RUNNING again.
        for log in self._trials.values():
            if not log.ended:
                self._put(EndRun(log.ref, "KILLED"))
        statuses = [trial_status(t.status == "ERROR", t.last_result or {}) for t in trials]
        self._put(EndRun(None, sweep_run_status(statuses)))
        self._outbox.drain(self.flush_timeout_s)
        self._outbox.close()
        unsent, dropped = self._outbox.pending(), list(self._outbox.dropped)
        self._outbox = None
        kept_at = self._keep(unsent)
        if unsent:
            logger.warning(
                "MLflow at %s: %d write(s) still unsent after %.0f s; %s", self.tracking_uri, len(unsent),
                self.flush_timeout_s, f"kept in {kept_at} for `run --resume` to send" if kept_at else "they are lost",
            )
        record = current_record()
        if record is not None:
            record.tracking = TrackingDelivery(self.tracking_uri, len(unsent), kept_at, dropped)

    def _kept(self) -> list[Operation]:
        """The writes an earlier driver of this sweep could not send by its end (newer than its Tune state)."""
        if not self.unsent_file or not os.path.exists(self.unsent_file):
            return []
        with open(self.unsent_file, "rb") as f:
            return pickle.load(f)

    def _keep(self, unsent: list[Operation]) -> str | None:
        """Save the unsent writes in the sweep's folder (Tune's last experiment checkpoint was taken
        before this hook, so its copy lacks the last ones); once all are sent, remove the file."""
        if not self.unsent_file:
            return None
        try:
            if not unsent:
                if os.path.exists(self.unsent_file):
                    os.remove(self.unsent_file)
                return None
            os.makedirs(os.path.dirname(self.unsent_file), exist_ok=True)
            partial = f"{self.unsent_file}.partial"
            with open(partial, "wb") as f:
                pickle.dump(unsent, f)
            os.replace(partial, self.unsent_file)
            return self.unsent_file
        except OSError as exc:
            logger.warning("cannot keep the unsent MLflow writes in %s: %s", self.unsent_file, exc)
            return None

    # -- helpers -----------------------------------------------------------------------------
    def _put(self, op: Operation) -> None:
        if self._outbox is None:
            raise RuntimeError("MlflowTracking used before Tune called its setup()")
        self._outbox.put(op)

    def _log(self, trial) -> _TrialLog:
        if trial.trial_id not in self._trials:
            workload = str(trial.config.get("workload", self.spec.workload))
            self._trials[trial.trial_id] = _TrialLog(TrialRef(trial.trial_id, str(trial), workload))
        return self._trials[trial.trial_id]

    def _hyper_parameter_names(self) -> set[str]:
        return {"workload", "seed", *self.spec.params, *self.spec.search_space}

    def _end_trial(self, trial, status: str) -> None:
        log = self._log(trial)
        plan = (trial.last_result or {}).get("plan") or {}
        self._put(AddParams(log.ref, plan_params(plan)))
        self._put(EndRun(log.ref, status))
        log.ended = True


# -- what a result becomes --------------------------------------------------------------------


def result_metrics(result: dict[str, Any]) -> dict[str, float]:
    """Every number the trial reported, except Tune's bookkeeping and the step itself."""
    return {
        key: float(value)
        for key, value in result.items()
        if isinstance(value, (int, float)) and not isinstance(value, bool)
        and key not in TUNE_BOOKKEEPING and key != STEP_METRIC
    }


def plan_params(plan: dict[str, Any]) -> dict[str, str]:
    """The final plan as ``plan.*`` params, ``predicted_phases`` as ``plan.predicted_phases.<phase>``
    (a stage's phase ``train@epoch2`` as ``train:epoch2``: MLflow refuses ``@`` in a name)."""
    flat = _flatten(plan, "plan")
    return {key.replace("@", ":"): _param_text(value) for key, value in flat.items() if value is not None}


def spec_params(spec: SweepSpec) -> dict[str, str]:
    """The validated spec, defaults included, as dotted params (``memory.safety_margin``)."""
    values = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec) if f.name not in ("raw", "source")}
    return {key: _param_text(value) for key, value in _flatten(values, "").items()}


def _flatten(value: Any, prefix: str) -> dict[str, Any]:
    if dataclasses.is_dataclass(value) and not isinstance(value, Domain):
        value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if isinstance(value, dict) and value:
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(_flatten(item, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: value}


def _param_text(value: Any) -> str:
    if isinstance(value, Domain):
        args = list(value.args[0]) if value.kind in ("choice", "grid") else list(value.args)
        text = f"{value.kind} {json.dumps(args)}"
    elif isinstance(value, (dict, list, tuple)):
        text = json.dumps(value, default=str)
    else:
        text = str(value)
    return text[:MAX_PARAM_CHARS]


def _refusal(result: dict[str, Any]) -> str | None:
    plan = result.get("plan") or {}
    return plan.get("refusal") or result.get("refusal") or None


def _error_summary(trial) -> str:
    """The exception line of the trial's newest failure."""
    return exception_line(last_failure(trial.error_file))[:MAX_TAG_CHARS]
