"""The Tune callback, on the driver: a sweep's and its trials' events become MLflow writes,
queued on the outbox (see the package's docstring for why a queue and what is logged how)."""

from __future__ import annotations

import logging
import os
import pickle
import time
import uuid
from dataclasses import dataclass, field

import yaml
from ray import tune

from orchestrator.atomic_file import atomic_write
from orchestrator.config import SweepSpec
from orchestrator.contract import COMPILED_MODEL_NOTE, describe_moves
from orchestrator.failures import exception_line, last_failure
from orchestrator.outcome import DIVERGED, TrackingDelivery, current_record, finished, sweep_run_status, trial_status
from orchestrator.tracking.flatten import param_text, plan_params, result_metrics, spec_params
from orchestrator.tracking.operations import AddParams, EndRun, LogArtifact, LogResult, Operation, SetTags, StartRun
from orchestrator.tracking.outbox import Outbox
from orchestrator.table import trained_text
from orchestrator.tracking.runs import EXPERIMENT_PATH_TAG, OOM_GAVE_UP_TAG, STOPPED_EARLY_TAG, SweepIdentity, TrialRef
from orchestrator.tracking.writer import MlflowWriter, fail_fast
from orchestrator.trial.evidence import gave_up_events
from orchestrator.trial_report import STOPPED_EARLY, TrialReport

logger = logging.getLogger(__name__)

MAX_TAG_CHARS = 8000
#: The sweep run's tag for the data loading settings ``run`` cut to fit the nodes' host memory.
HOST_MEMORY_TAG = "orchestrator.host_memory"
#: In the sweep's folder: the writes a sweep could not send, for ``run --resume`` to send.
UNSENT_FILE = "mlflow_unsent.pkl"
#: How long a sweep stopped at once (a second Ctrl-C) waits for MLflow to take its runs' ends.
STOPPED_AT_ONCE_FLUSH_S = 5.0
#: How long a sweep whose store never answered (``--offline-tracking``) waits for it at its end:
#: its writes are kept for ``run --resume`` to send either way.
UNREACHED_FLUSH_S = 10.0
#: This driver process, as opposed to one whose pickled callback ``Tuner.restore`` brings back.
_THIS_PROCESS = uuid.uuid4().hex


@dataclass
class _TrialLog:
    """What the driver remembers of a trial (saved in Tune's experiment state)."""

    ref: TrialRef
    plans: list[dict] = field(default_factory=list)  # [{"step": s, "epoch": e, "plan": {...}}], one per change
    oom_events_logged: int = 0
    plan_checks_logged: int = 0
    restarts: int = 0
    tags: dict[str, str] = field(default_factory=dict)  # as last queued: only changes are sent
    described: bool = False  # its once-only params were queued
    ended: bool = False  # Tune reported it complete or failed (an interrupted sweep's trials are not)


class MlflowTracking(tune.Callback):
    """Tune callback (driver side) that records the sweep in MLflow; see the module docstring."""

    def __init__(self, tracking_uri: str, spec: SweepSpec, *, flush_timeout_s: float = 120.0,
                 unsent_file: str | None = None, host_cuts: list[str] | None = None):
        """``host_cuts``: the data loading settings ``run`` cut for the nodes' memory, one line each
        as the console said them (``orchestrator.node_memory``); the params keep the config as written."""
        self.tracking_uri = tracking_uri
        self.spec = spec
        self.host_cuts = host_cuts or []
        self.flush_timeout_s = flush_timeout_s
        self.unsent_file = unsent_file  # in the sweep's folder: where writes left unsent wait for a resume
        self._sweep = SweepIdentity(uuid.uuid4().hex, f"sweep-{time.strftime('%Y%m%d-%H%M%S')}", spec.experiment)
        self._trials: dict[str, _TrialLog] = {}
        self._restored: list[Operation] = []  # unsent operations of the driver we resume from
        self._outbox: Outbox | None = None
        self._sweep_named = False  # this driver has tagged the sweep run with Tune's experiment
        self._made_in = _THIS_PROCESS  # with no state set: the sweep's runs can only be ours to create
        self._resumed = False  # set_state was called: an earlier driver may have created runs

    # Tune pickles its callbacks with the run config; the thread and client are not part of that.
    def __getstate__(self) -> dict:
        return {**self.__dict__, "_outbox": None}

    # -- Tune state: what a resumed driver needs to continue the same runs -------------------
    def get_state(self) -> dict:
        pending = self._outbox.pending() if self._outbox else self._restored
        return {"sweep": self._sweep, "trials": dict(self._trials), "pending": pending}

    def set_state(self, state: dict) -> None:
        self._resumed = True
        self._sweep = state["sweep"]
        self._trials = dict(state["trials"])
        self._restored = list(state["pending"])

    # -- hooks -------------------------------------------------------------------------------
    def setup(self, stop=None, num_samples=None, total_num_samples=None, **info) -> None:
        fail_fast()
        kept = self._kept()
        new_sweep = self._made_in == _THIS_PROCESS and not (self._resumed or kept or self._restored)
        self._outbox = Outbox(MlflowWriter(self.tracking_uri, self._sweep, new_sweep=new_sweep), kept or self._restored)
        self._restored = []
        tags = {"orchestrator.config": self.spec.source} if self.spec.source else {}
        if self.host_cuts:
            tags[HOST_MEMORY_TAG] = "\n".join(self.host_cuts)[:MAX_TAG_CHARS]
        self._put(StartRun(None, params=spec_params(self.spec), tags=tags))
        self._put(LogArtifact(None, "sweep.yaml", yaml.safe_dump(self.spec.raw, sort_keys=False)))

    def on_trial_start(self, iteration, trials, trial, **info) -> None:
        log = self._log(trial)
        log.ended = False  # also a trial restarted by a resumed sweep
        resources = trial.placement_group_factory.required_resources
        params = {f"config.{k}": param_text(v) for k, v in trial.config.items() if k in self._hyper_parameter_names()}
        params.update({f"resources.{kind.lower()}": param_text(resources.get(kind, 0)) for kind in ("CPU", "GPU")})
        self._put(StartRun(log.ref, params=params, tags={"tune.trial_path": str(trial.path or "")}))
        if not self._sweep_named:
            # Named like Tune's experiment folder, so the sweep is found from Tune's output.
            tags = {"mlflow.runName": trial.experiment_dir_name, EXPERIMENT_PATH_TAG: str(trial.remote_experiment_path)}
            self._put(SetTags(None, tags))
            self._sweep_named = True

    def on_trial_result(self, iteration, trials, trial, result, **info) -> None:
        log = self._log(trial)
        report = TrialReport.from_result(result)
        if not log.described:
            self._put(AddParams(log.ref, once_params(report)))
            log.described = True
        tags = changing_tags(report)
        plan = report.plan
        if plan and (not log.plans or log.plans[-1]["plan"] != plan):
            log.plans.append({"step": report.step, "epoch": report.epoch, "plan": plan})
            if len(log.plans) > 1:  # a first plan is in the metrics and, at the end, the params
                self._put(LogArtifact(log.ref, "plan_history.json", list(log.plans)))
        if plan and plan.get("compiled"):  # planned from a compiled model's eager modules
            tags["compiled_model"] = COMPILED_MODEL_NOTE
        if report.refusal:
            tags["refusal"] = report.refusal[:MAX_TAG_CHARS]
        if report.diverged:
            tags["diverged"] = report.diverged[:MAX_TAG_CHARS]
        if report.host_memory_events:
            tags["host_memory_events"] = "; ".join(e.describe() for e in report.host_memory_events)[:MAX_TAG_CHARS]
        if report.storage_fault:
            tags["storage_fault"] = report.storage_fault[:MAX_TAG_CHARS]
        if report.moves:
            tags["moves"] = describe_moves(report.moves)[:MAX_TAG_CHARS]
        changed = {k: v for k, v in tags.items() if log.tags.get(k) != v}
        if changed:
            self._put(SetTags(log.ref, changed))
            log.tags.update(changed)
        if len(report.oom_events) > log.oom_events_logged:
            self._put(LogArtifact(log.ref, "oom_events.json", [e.to_dict() for e in report.oom_events]))
            log.oom_events_logged = len(report.oom_events)
        if len(report.plan_checks) > log.plan_checks_logged:
            self._put(LogArtifact(log.ref, "plan_checks.json", [c.to_dict() for c in report.plan_checks]))
            log.plan_checks_logged = len(report.plan_checks)
        if report.step is not None and not report.storage_fault:  # the step is logged again after --resume
            self._put(LogResult(log.ref, report.step, result_metrics(report), int(time.time() * 1000)))

    def on_trial_recover(self, iteration, trials, trial, **info) -> None:
        """Tune restarts the trial (from its last checkpoint, possibly with a changed config)."""
        log = self._log(trial)
        log.restarts += 1
        self._put(SetTags(log.ref, {"tune.restarts": str(log.restarts), "tune.last_error": _error_summary(trial)}))

    def on_trial_complete(self, iteration, trials, trial, **info) -> None:
        report = TrialReport.from_result(trial.last_result)
        failed = report.refused or (report.diverged and not finished(DIVERGED, self.spec.on_nan))
        if report.stopped_early:
            stop = self.spec.stop
            trained = trained_text(report.epoch or 0, report.step or 0, stop.epochs, stop.steps, unit="epochs")
            self._put(SetTags(self._log(trial).ref, {STOPPED_EARLY_TAG: f"{STOPPED_EARLY} after {trained}"}))
        self._end_trial(trial, "FAILED" if failed else "FINISHED")

    def on_trial_error(self, iteration, trials, trial, **info) -> None:
        log = self._log(trial)
        tags = {"error": _error_summary(trial)}
        # A trial that gave up on OOMs: its events, which no report carried, from its folder.
        events = gave_up_events(str(trial.path) if trial.path else None)
        if len(events) > log.oom_events_logged:
            self._put(LogArtifact(log.ref, "oom_events.json", events))
            log.oom_events_logged = len(events)
            tags[OOM_GAVE_UP_TAG] = str(len(events))
        self._put(SetTags(log.ref, tags))
        self._end_trial(trial, "FAILED")

    def on_experiment_end(self, trials, **info) -> None:
        if self._outbox is None:
            return
        statuses = [trial_status(t.status == "ERROR", TrialReport.from_result(t.last_result)) for t in trials]
        self._end(sweep_run_status(statuses, self.spec.on_nan), self.flush_timeout_s)

    def stopped_at_once(self) -> None:
        """A second Ctrl-C stopped Tune at once, with no ``on_experiment_end``: the sweep's runs
        end KILLED, as one Ctrl-C leaves them, not RUNNING (which ``report`` reads as a sweep still
        running); MLflow is given a few seconds, and what it has not taken by then is kept for the resume."""
        if self._outbox is not None:
            self._end("KILLED", min(self.flush_timeout_s, STOPPED_AT_ONCE_FLUSH_S))

    def _end(self, sweep_status: str, flush_timeout_s: float) -> None:
        # Interrupted (Ctrl-C, SIGUSR1 before a SLURM requeue): Tune stops these trials as TERMINATED
        # although they did not finish. A resumed sweep marks them RUNNING again.
        for log in self._trials.values():
            if not log.ended:
                self._put(EndRun(log.ref, "KILLED"))
        self._put(EndRun(None, sweep_status))
        if not self._outbox.reached:  # never once this sweep (--offline-tracking): one more try, not minutes
            flush_timeout_s = min(flush_timeout_s, UNREACHED_FLUSH_S)
        self._outbox.drain(flush_timeout_s)
        self._outbox.close()
        unsent, dropped = self._outbox.pending(), list(self._outbox.dropped)
        self._outbox = None
        kept_at = self._keep(unsent)
        if unsent:
            logger.warning(
                "MLflow at %s: %d write(s) still unsent after %.0f s; %s", self.tracking_uri, len(unsent),
                flush_timeout_s, f"kept in {kept_at} for `run --resume` to send" if kept_at else "they are lost",
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
            with atomic_write(self.unsent_file, "wb") as f:
                pickle.dump(unsent, f)
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
        plan = TrialReport.from_result(trial.last_result).plan or {}
        self._put(AddParams(log.ref, plan_params(plan)))
        self._put(EndRun(log.ref, status))
        log.ended = True


def once_params(report: TrialReport) -> dict[str, str]:
    """Per-trial facts that do not change while it runs: params, logged once (those it has)."""
    facts = {"estimator": report.estimator, "estimated_by": report.estimated_by, "memory_source": report.memory_source,
             "budget_bytes": report.budget_bytes, "gpu_name": report.gpu_name, "gpu_total_bytes": report.gpu_total_bytes}
    return {k: param_text(v) for k, v in facts.items() if v is not None}


def changing_tags(report: TrialReport) -> dict[str, str]:
    """Facts that can change with the plan or the node: tags, which MLflow lets us overwrite."""
    facts = {"precision": report.precision, "predicted_phase": report.predicted_phase,
             "memory_source": report.memory_source, "node_name": report.node_name}
    return {k: str(v) for k, v in facts.items() if v is not None}


def _error_summary(trial) -> str:
    """The exception line of the trial's newest failure."""
    return exception_line(last_failure(trial.error_file))[:MAX_TAG_CHARS]
