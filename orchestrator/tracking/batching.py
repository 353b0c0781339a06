"""Consecutive writes to one run, sent as one request.

A trial of a few seconds queues about eight writes (its start, its first result's facts and
tags, a result per evaluation, its final plan, its end), and with a SQLite store each write is a
transaction whose commit waits for the disk: the outbox's sends were the largest part of the
driver's CPU in a sweep of hundreds of short trials (``bench/sweep_scale.py``). The outbox
therefore takes what is queued, a moment after the first write (:data:`LINGER_S`, as MLflow's
own asynchronous logging batches), and :func:`merged` turns each run's writes into one
:class:`RunBatch`: one ``log_batch`` of params, tags and results, then the run's status.

Only a run's own order matters (a result after the run's start, its end last), so a batch keeps
its writes in their order and stops at a write it cannot merge (an artifact), after which that
run's writes start a new batch. Merging changes no outcome: a batch applies what its writes
would have applied one by one, and a batch MLflow rejects is sent again write by write, so that
only the write at fault is dropped (:mod:`orchestrator.tracking.outbox`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from orchestrator.tracking.operations import (
    AddParams, EndRun, LogResult, Operation, SetTags, StartRun, apply_to_run,
)
from orchestrator.tracking.runs import Target

if TYPE_CHECKING:
    from orchestrator.tracking.writer import MlflowWriter

#: How long the outbox lets the first queued write wait for others to go with it. A second:
#: a short trial's writes mostly share a request, and MLflow's view lags by about as much.
LINGER_S = 1.0
MERGEABLE = (StartRun, AddParams, SetTags, LogResult, EndRun)


@dataclass
class RunBatch:
    """Writes to one run, in their order, applied as one ``log_batch`` and then the run's status."""

    target: Target
    parts: list[Operation] = field(default_factory=list)

    def apply(self, mlflow: "MlflowWriter") -> None:
        apply_to_run(mlflow, self.target, self.parts)


def merged(ops: list[Operation]) -> list[Operation | RunBatch]:
    """The writes to send for ``ops``, in order: each run's consecutive mergeable writes as one
    :class:`RunBatch` (at the place of its first), up to and including the run's end; a write
    alone stays as it is."""
    sends: list[Operation | RunBatch] = []
    open_batches: dict[str | None, RunBatch] = {}
    for op in ops:
        key = op.target.trial_id if op.target else None
        if not isinstance(op, MERGEABLE):
            open_batches.pop(key, None)
            sends.append(op)
            continue
        if key not in open_batches:
            open_batches[key] = RunBatch(op.target)
            sends.append(open_batches[key])
        open_batches[key].parts.append(op)
        if isinstance(op, EndRun):
            del open_batches[key]
    return [send.parts[0] if isinstance(send, RunBatch) and len(send.parts) == 1 else send for send in sends]


def parts(send: Operation | RunBatch) -> list[Operation]:
    """The queued writes a send stands for."""
    return send.parts if isinstance(send, RunBatch) else [send]
