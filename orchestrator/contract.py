"""What the driver and a trial's worker agree on, in a module that imports neither torch nor Ray.

The driver (``run``, the retry scheduler, MLflow tracking, the tables, ``report``) and the
trial runtime (``orchestrator.trial``) run in different processes and talk through Tune: the
trial's config (the scheduler's restart keys), its reports (OOM events, moves), its checkpoint
folder (the state file) and its storage folder (the OOM evidence file). Every name both sides
read lives here, once, so neither side imports the other's machinery to learn a string.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from typing import Any, Iterable

from orchestrator.units import human

# -- the trial's config keys that the retry scheduler sets before Tune restarts a trial ---------

#: The number of plan reductions a restarted trial applies on top of its checkpoint's plan, set
#: when its worker died of an OOM it could not recover from in-process.
OOM_SHRINKS_KEY = "_oom_shrinks"
#: Set after the trial gave up on OOMs, so that the restart Tune insists on fails at once
#: instead of training into the same OOM again.
OOM_GAVE_UP_KEY = "_oom_gave_up"
#: How often the trial failed for a reason other than memory.
OTHER_FAILURES_KEY = "_other_failures"
#: Set, with the error's line, when such failures exceed the sweep's ``max_failures``: the
#: restart fails at once instead of running into the same bug again.
NOT_RETRIED_KEY = "_not_retried"
#: The kind of failure (``worker_died``, ``node_died``, ``node_unreachable``) when a trial's
#: worker or node died of something other than memory: why it moved, should it resume elsewhere.
RESTART_REASON_KEY = "_restart_reason"

# -- files -------------------------------------------------------------------------------------

#: The one file of a trial's checkpoint folder: model, optimizer, position, plan, OOM events.
STATE_FILE = "state.pt"
#: In the trial's folder on the storage path: the OOM event a trial is recovering from. Written
#: when the trial catches an OOM, before it releases the failed attempt and builds the next, and
#: removed once the recovery reports; a worker that dies in between (a CUDA context an OOM left
#: unusable) leaves it behind, which is how the driver knows that death was about memory.
OOM_EVIDENCE_FILE = "oom_before_death.json"
#: In the trial's folder on the storage path: every OOM event of a trial that gave up on them (no
#: smaller plan, or ``memory.max_oom_retries`` reached), which its reports never carried: the
#: driver logs them to the trial's MLflow run as the reports' ``oom_events.json`` is logged.
OOM_GAVE_UP_FILE = "oom_events_gave_up.json"

#: In the trial's folder on the storage path: the full traceback of the error that ended the
#: trial where its one line names this file instead (a sample its data could not load).
TRIAL_LOG_FILE = "trial.log"

# -- memory ------------------------------------------------------------------------------------

#: How each kind of device measures the peak a report carries, as the tables label it.
MEMORY_LABELS = {"cuda_allocator": "reserved", "cpu_tensor_tracker": "tensor bytes", "emulated": "emulated"}

#: Said wherever a plan's estimate comes from a ``torch.compile``d model's eager modules (the
#: profile's notes, so ``plan``; the trial's MLflow run, as its ``compiled_model`` tag): the
#: trace runs the modules the compiled graph was made from, whose memory the graph may not keep.
COMPILED_MODEL_NOTE = (
    "the model is compiled (torch.compile): planned from its eager modules' trace; "
    "the compiled graph's memory may differ (fused kernels, saved tensors, its own workspaces); "
    "the trial's first steps measure it against the plan unless memory.verify is off"
)

#: Messages of allocation failures that do not come as ``torch.OutOfMemoryError`` (cuBLAS/cuDNN
#: workspaces, the CUDA driver itself): the trial recognises an OOM by them, the driver reads
#: them in a dead trial's error text.
OOM_MESSAGES = re.compile(
    r"out of memory|CUBLAS_STATUS_ALLOC_FAILED|CUDNN_STATUS_ALLOC_FAILED|cudaErrorMemoryAllocation",
    re.IGNORECASE,
)


#: The action of the OOM (or lost loader worker) a trial did not survive: it failed there.
GAVE_UP = "gave up"


@dataclass(frozen=True)
class OomEvent:
    """One out-of-memory failure and what was done about it. It travels with the trial: in its
    checkpoints, its reports, MLflow and, when retries run out, its error.

    Epochs and steps count from 1, as the tables do: ``epoch 1, step 1`` is the first optimizer
    step. An eval OOM happens after a training step, so it names that step, and the eval batch.
    """

    phase: str  # "train" | "eval"
    epoch: int  # the epoch under way (from 1); an evaluation at an epoch's end belongs to that epoch
    step: int  # train: the optimizer step that ran out (from 1); eval: the step the evaluation followed
    micro_batch: int
    eval_batch: int
    bytes_requested: int | None
    bytes_allocated: int
    bytes_reserved: int | None
    message: str
    action: str = ""  # what was done about it: the reduction applied, or GAVE_UP
    rank: int | None = None  # in a data-parallel trial, the rank that ran out (the lowest, when several did)
    eval_batch_number: int | None = None  # eval: the batch of the evaluation that ran out (from 1)
    predicted_peak_bytes: int | None = None  # the plan's predicted peak (its worst phase) as it ran out; None: no estimate

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "OomEvent":
        return cls(**data)


def survived_ooms(events: list[dict]) -> int:
    """The OOMs a trial's events (as dicts: MLflow's ``oom_events.json``, a gave-up trial's file)
    say it survived: each one but the one it gave up at."""
    return sum(1 for e in events if e.get("action") != GAVE_UP)


@dataclass(frozen=True)
class HostMemoryEvent:
    """A DataLoader worker that died (killed by a signal: the kernel's OOM killer, mostly) or ran
    out of host memory, and what was done about it: the trial went back to its last checkpoint
    with fewer loader workers (``orchestrator.trial.host_memory``). Travels as :class:`OomEvent` does."""

    phase: str  # "train" | "eval"
    epoch: int  # the epoch under way (from 1)
    step: int  # train: the optimizer step whose data it was loading (from 1); eval: the step it followed
    num_workers: int  # data.num_workers when it happened
    message: str  # torch's line: "DataLoader worker (pid(s) 4242) exited unexpectedly"
    action: str = ""  # "data.num_workers 2->1", or GAVE_UP

    def describe(self) -> str:
        where = f"train step {self.step} (epoch {self.epoch})" if self.phase == "train" else f"eval after step {self.step}"
        what = GAVE_UP if self.action == GAVE_UP else f"resumed from its last checkpoint with {self.action}"
        return f"host memory: a DataLoader worker was lost in {where} ({self.message}): {what}"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "HostMemoryEvent":
        return cls(**data)


@dataclass(frozen=True)
class PlanCheck:
    """One phase's plan verified on the device (``orchestrator.trial.verify``): its predicted and
    measured peaks at the plan it ran, and the plan the trial went on with. It travels as an
    :class:`OomEvent` does: in checkpoints, reports and MLflow.

    ``epoch`` counts from 1, ``step`` is the optimizer step after which it was measured.
    """

    phase: str  # "train", "eval", "train@epoch3"
    epoch: int
    step: int
    predicted_bytes: int  # the estimate's, at ``plan`` (what the device's peak is compared with)
    measured_bytes: int
    limit_bytes: int  # what a plan may fill: budget x safety margin
    plan: str  # "8 x 16 (eval 64, fp32)": the plan it ran
    new_plan: str  # the plan it went on with (the same where the estimate held)

    @property
    def changed(self) -> bool:
        return self.new_plan != self.plan

    @property
    def error(self) -> float:
        """(measured - predicted) / predicted: the estimate's error on this device."""
        return (self.measured_bytes - self.predicted_bytes) / self.predicted_bytes

    def describe(self) -> str:
        """'train after step 2 (epoch 1): measured 3.0 MiB, predicted 2.4 MiB (+25%), limit 4.0 MiB; plan 8 x 16 -> 12 x 11'"""
        head = (f"{self.phase} after step {self.step} (epoch {self.epoch}): measured {human(self.measured_bytes)}, "
                f"predicted {human(self.predicted_bytes)} ({self.error:+.0%}), limit {human(self.limit_bytes)}")
        return f"{head}; plan {self.plan} -> {self.new_plan}" if self.changed else f"{head}; plan {self.plan} kept"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "PlanCheck":
        return cls(**data)


# -- nodes -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Move:
    """A trial that resumed on another node than the one its checkpoint was made on."""

    from_node: str
    to_node: str
    epoch: int  # epochs finished at the checkpoint it resumed from
    reason: str  # why it stopped where it was ("node node-b lost", "worker died")
    replanned: str = ""  # "64 x 2 -> 32 x 4 (budget 96.0 MiB -> 48.0 MiB)" when the new node is smaller

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Move":
        return cls(**d)

    def describe(self) -> str:
        when = f"after epoch {self.epoch}" if self.epoch else "in epoch 1"
        text = f"moved {self.from_node}->{self.to_node} {when}: {self.reason}"
        return text + (f"; re-planned {self.replanned}" if self.replanned else "")


def describe_moves(moves: Iterable[Move]) -> str:
    """The moves a trial's last report lists, for the final table and MLflow."""
    return "; ".join(m.describe() for m in moves)


# -- lists in a trial's reports ----------------------------------------------------------------


def records_in_report(records: list[dict[str, Any]]) -> str:
    """A list of records (OOM events, moves) as a trial's report carries it: JSON text. Tune's
    loggers take numbers and text; a list they try to draw as a histogram, and warn that it is
    an invalid value."""
    return json.dumps(records)


def records_from_report(value: Any) -> list[dict[str, Any]]:
    """The records a report carries (:func:`records_in_report`); a list as reports made before
    that carried them (a sweep resumed across the change), nothing for a missing value."""
    if not value:
        return []
    return json.loads(value) if isinstance(value, str) else list(value)
