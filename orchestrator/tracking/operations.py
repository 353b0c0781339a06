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
        apply_to_run(mlflow, self.target, [self])


@dataclass
class AddParams:
    target: Target
    params: dict[str, str]

    def apply(self, mlflow: "MlflowWriter") -> None:
        apply_to_run(mlflow, self.target, [self])


@dataclass
class SetTags:
    target: Target
    tags: dict[str, str]

    def apply(self, mlflow: "MlflowWriter") -> None:
        apply_to_run(mlflow, self.target, [self])


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
        apply_to_run(mlflow, self.target, [self])  # one transaction: all of a result or none

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


def apply_to_run(mlflow: "MlflowWriter", target: Target, writes: list[Operation]) -> None:
    """Writes to one run (:class:`StartRun`, :class:`AddParams`, :class:`SetTags`,
    :class:`LogResult`, and an :class:`EndRun` last), in their order, as one ``log_batch`` of what
    the run lacks and then its status. A write alone and a round's writes merged
    (:mod:`orchestrator.tracking.batching`) go through this one rule."""
    run_id = mlflow.run_id(target)
    params: dict[str, str] = {}
    tags: dict[str, str] = {}
    results: dict[int, LogResult] = {}
    for op in writes:
        if isinstance(op, (StartRun, AddParams)):
            params.update(mlflow.new_params(run_id, op.params))
        if isinstance(op, (StartRun, SetTags)):
            tags.update(op.tags)
        if isinstance(op, LogResult):
            results.setdefault(op.step, op)  # a step reported twice keeps its first report
    logged = mlflow.steps(run_id) if results else set()
    new = [op for step, op in results.items() if step not in logged]
    mlflow.log_batch(run_id, params=params, tags=tags, results=[op.entities() for op in new])
    logged.update(op.step for op in new)
    if isinstance(writes[-1], EndRun):
        writes[-1].apply(mlflow)
    elif any(isinstance(op, StartRun) for op in writes) and not mlflow.is_running(run_id):
        mlflow.set_status(run_id, "RUNNING")  # a resumed sweep or trial


def describe(op: Operation) -> str:
    """``LogResult(step 300 of train_trial_ab12c_00001)``: for warnings, without payloads."""
    target = op.target.name if op.target else "the sweep run"
    detail = f"step {op.step} of " if isinstance(op, LogResult) else ""
    return f"{type(op).__name__}({detail}{target})"

