"""The writes to MLflow, as values: queued in order, kept in Tune's state and in the sweep's
folder while MLflow is away, and each one idempotent, so that sending one twice is harmless."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from orchestrator.tracking.runs import STEP_METRIC, Target, TrialRef

if TYPE_CHECKING:
    from orchestrator.tracking.writer import MlflowWriter


@dataclass
class StartRun:
    """Find or create the run, (re)mark it RUNNING, and add its params and tags."""

    target: Target
    params: dict[str, str] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)

    def apply(self, mlflow: "MlflowWriter") -> None:
        run_id = mlflow.run_id(self.target)
        mlflow.log_batch(run_id, params=mlflow.new_params(run_id, self.params), tags=self.tags)
        if not mlflow.is_running(run_id):  # a resumed sweep or trial
            mlflow.set_status(run_id, "RUNNING")


@dataclass
class AddParams:
    target: Target
    params: dict[str, str]

    def apply(self, mlflow: "MlflowWriter") -> None:
        run_id = mlflow.run_id(self.target)
        mlflow.log_batch(run_id, params=mlflow.new_params(run_id, self.params))


@dataclass
class SetTags:
    target: Target
    tags: dict[str, str]

    def apply(self, mlflow: "MlflowWriter") -> None:
        mlflow.log_batch(mlflow.run_id(self.target), tags=self.tags)


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

    def apply(self, mlflow: "MlflowWriter") -> None:
        run_id = mlflow.run_id(self.target)
        logged = mlflow.steps(run_id)
        if self.step in logged:
            return
        mlflow.log_batch(run_id, results=[self.entities()])  # one transaction: all of a result or none
        logged.add(self.step)

    def entities(self) -> list:
        """The result as MLflow metrics, with the step metric that says the run has it."""
        from mlflow.entities import Metric

        metrics = [Metric(k, v, self.timestamp_ms, self.step) for k, v in self.metrics.items()]
        metrics.append(Metric(STEP_METRIC, float(self.step), self.timestamp_ms, self.step))
        return metrics


@dataclass
class LogArtifact:
    """A small text or JSON file; sending it again overwrites it."""

    target: Target
    path: str
    content: Any  # str for text, else JSON-able

    def apply(self, mlflow: "MlflowWriter") -> None:
        run_id = mlflow.run_id(self.target)
        if isinstance(self.content, str):
            mlflow.client.log_text(run_id, self.content, self.path)
        else:
            mlflow.client.log_dict(run_id, self.content, self.path)


@dataclass
class EndRun:
    target: Target
    status: str  # FINISHED | FAILED | KILLED

    def apply(self, mlflow: "MlflowWriter") -> None:
        status = self.status
        if self.target is None and status == "FINISHED" and mlflow.dropped:
            status = "FAILED"  # its record is incomplete, and `run` exits non-zero for it
        mlflow.set_status(mlflow.run_id(self.target), status)


Operation = StartRun | AddParams | SetTags | LogResult | LogArtifact | EndRun


def describe(op: Operation) -> str:
    """``LogResult(step 300 of train_trial_ab12c_00001)``: for warnings, without payloads."""
    target = op.target.name if op.target else "the sweep run"
    detail = f"step {op.step} of " if isinstance(op, LogResult) else ""
    return f"{type(op).__name__}({detail}{target})"

