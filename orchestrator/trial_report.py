"""What a trial reports to the driver, as one typed value instead of a dict of string keys.

A trial's worker builds a :class:`TrialReport` at every milestone and hands Tune its
:meth:`~TrialReport.to_metrics` (Tune only takes a flat dict); the driver (the final table, the
trial's status, MLflow tracking, Ray metrics) reads a Tune result back with
:meth:`~TrialReport.from_result`, and ``orchestrator report`` reads MLflow's metrics, which carry
the same names, the same way. The names are the fields' names, so the records MLflow already
holds stay readable. Neither torch nor Ray is imported here: both sides and ``report`` load it.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from dataclasses import dataclass, field
from typing import Any, Mapping

from orchestrator.contract import HostMemoryEvent, Move, OomEvent, PlanCheck, records_from_report, records_in_report

#: How ``run``'s line and summary, MLflow's tag and ``report`` tell a trial that
#: :attr:`TrialReport.stopped_early`: ASHA's cut is part of the sweep, not a failure, but a reader
#: comparing trials needs to know which ones it ended before their budget.
STOPPED_EARLY = "stopped early by ASHA"

#: Keys Tune adds to every result (``ray.tune.result``), which are not the trial's to report;
#: ``trial_id``, ``done`` and ``time_total_s`` among them are read back into the report.
TUNE_RESULT_KEYS = frozenset({
    "trial_id", "done", "time_total_s", "training_iteration", "timestamp", "pid", "time_this_iter_s",
    "time_since_restore", "iterations_since_restore", "timesteps_total", "episodes_total",
    "timesteps_since_restore", "node_ip", "hostname", "date", "config", "experiment_tag",
    "should_checkpoint", "checkpoint_dir_name",
})

#: A data-parallel trial's peak of one rank, flat: ``rank3_peak_reserved_bytes``.
_RANK_KEY = re.compile(r"rank(\d+)_peak_(allocated|reserved)_bytes")


@dataclass(frozen=True)
class RankPeak:
    """One rank's peak memory since the previous report, in a data-parallel trial."""

    allocated: int | None = None
    reserved: int | None = None

    @property
    def measured(self) -> int | None:
        return _measured(self.reserved, self.allocated)


@dataclass(frozen=True)
class TrialReport:
    """One report of a trial: where it is, its plan, what it measured, what befell it.

    Every field may be missing from a result (a trial that never reported, a refused one that
    never trained, an MLflow history that lacks a key at some step): ``None`` (or empty) then,
    and :meth:`to_metrics` leaves it out.
    """

    # -- progress --------------------------------------------------------------------------
    epoch: int | None = None
    step: int | None = None  # optimizer steps: MLflow's step of the result
    training_done: bool = False  # the trial spent its budget (Tune may not have seen it return)
    train_loss: float | None = None
    #: The workload's own numbers (``eval_loss``, ``eval_accuracy``, ...), by name.
    measurements: dict[str, Any] = field(default_factory=dict)
    learning_rate: float | None = None  # in force after the report's step (the first parameter group's)
    #: Training speed since the previous report (its evaluation, checkpoint and report left out):
    #: what shows that a schedule or a plan did what was meant.
    steps_per_second: float | None = None
    samples_per_second: float | None = None

    # -- the plan in force -----------------------------------------------------------------
    plan: dict[str, Any] | None = None  # ``Plan.to_dict()``: the planner sits above this layer
    micro_batch: int | None = None
    accum_steps: int | None = None
    effective_batch: int | None = None
    eval_batch: int | None = None
    activation_checkpointing: bool | None = None
    precision: str | None = None
    plan_reductions: int | None = None
    estimator: str | None = None
    estimated_by: str | None = None  # where the plan's profile was made: driver | worker | checkpoint | none
    budget_bytes: int | None = None
    predicted_peak_bytes: int | None = None
    predicted_phase: str | None = None
    refusal: str | None = None  # why not even micro-batch 1 fits: the trial never trained

    # -- memory measured since the previous report ------------------------------------------
    memory_source: str | None = None  # how it was measured: a key of ``contract.MEMORY_LABELS``
    peak_allocated_bytes: int | None = None
    peak_reserved_bytes: int | None = None  # the CUDA allocator's; None elsewhere
    fragmentation: float | None = None
    device_used_bytes: int | None = None
    prediction_error: float | None = None  # (measured - predicted) / predicted
    rank_peaks: tuple[RankPeak, ...] = ()  # each rank's, in a data-parallel trial (the fields above: its worst)

    # -- where it ran and what befell it ----------------------------------------------------
    node_id: str | None = None
    node_name: str | None = None
    gpu_name: str | None = None
    gpu_total_bytes: int | None = None
    oom_retries: int = 0  # OOMs recovered in the worker, plus workers that died of one
    oom_events: tuple[OomEvent, ...] = ()
    host_memory_events: tuple[HostMemoryEvent, ...] = ()  # DataLoader workers lost (orchestrator.trial.host_memory)
    moves: tuple[Move, ...] = ()
    #: Each phase's plan verified on the device, oldest first (``orchestrator.trial.verify``).
    plan_checks: tuple[PlanCheck, ...] = ()
    #: A sample its data could not load, in one line: reported just before the trial fails of it,
    #: so that the retry scheduler lets that failure be its last (``orchestrator.retry``).
    data_error: str | None = None
    #: Where its loss (or clipped gradient norm) stopped being finite, in one line
    #: (``trainables.divergence``): the trial's last report; ``diverged_at_step`` is that step.
    diverged: str | None = None
    diverged_at_step: int | None = None
    #: What the trials its reused worker ran before still held on the device when it started
    #: (``orchestrator.trial.reuse``); None in a fresh worker
    left_behind_bytes: int | None = None
    #: The storage did not take its checkpoint, in one line (``orchestrator.trial.storage``): the
    #: driver stops the sweep, this trial to be continued from its last checkpoint.
    storage_fault: str | None = None

    # -- filled in by Tune on the driver's side; a worker leaves them unset -----------------
    trial_id: str | None = None
    done: bool = False  # Tune's: the trial completed or its scheduler stopped it
    time_total_s: float | None = None  # training time across restarts

    # -- derived ---------------------------------------------------------------------------
    @property
    def refused(self) -> bool:
        return self.refusal is not None

    @property
    def stopped_early(self) -> bool:
        """Of a trial Tune completed: whether it ended short of its budget, which only its
        scheduler does (ASHA: the sweep's ``fifo`` stops no trial); a refused or diverged trial
        ends early for its own reason, which is told instead."""
        return not (self.training_done or self.refused or self.diverged)

    @property
    def ranks(self) -> int:
        return max(len(self.rank_peaks), 1)

    @property
    def worst_rank(self) -> int | None:
        peaks = [r.measured for r in self.rank_peaks]
        if not peaks or None in peaks:
            return None
        return max(range(len(peaks)), key=peaks.__getitem__)

    @property
    def measured_peak(self) -> int | None:
        """The peak a prediction is compared with: the allocator's reserved bytes on a GPU (the
        plan budgets those), tensor bytes where only those exist."""
        return _measured(self.peak_reserved_bytes, self.peak_allocated_bytes)

    def metric(self, name: str) -> Any:
        """A number the report carries, by the name Tune and MLflow know it by (the sweep's metric)."""
        return self.to_metrics().get(name)

    # -- the flat form ---------------------------------------------------------------------
    def to_metrics(self) -> dict[str, Any]:
        """The flat dict Tune gets (and MLflow, its numbers): one key per field set, events and
        moves as JSON text (``contract.records_in_report``: Tune's loggers take no lists), each
        rank's peaks as ``rank<r>_peak_<kind>_bytes``."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "measurements":
                out.update(value)
            elif f.name in ("oom_events", "host_memory_events", "moves", "plan_checks"):
                out[f.name] = records_in_report([item.to_dict() for item in value])
            elif f.name == "rank_peaks":
                for rank, peak in enumerate(value):
                    out.update({f"rank{rank}_peak_{kind}_bytes": getattr(peak, kind)
                                for kind in ("allocated", "reserved") if getattr(peak, kind) is not None})
            elif f.name in ("training_done", "activation_checkpointing"):
                if value is not None:
                    out[f.name] = int(value)
            elif f.name == "done":
                if value:
                    out[f.name] = True
            elif value is not None:
                out[f.name] = value
        out["moved"] = len(self.moves)
        if self.refused:
            out["refused"] = 1
        if self.rank_peaks:
            out["ranks"] = self.ranks
            if self.worst_rank is not None:
                out["worst_rank"] = self.worst_rank
        return out

    def numbers(self) -> dict[str, int | float]:
        """The numbers of :meth:`to_metrics` (what MLflow keeps as metrics), without its flags:
        whether a trial was refused or is done is its status, not a measurement."""
        return {key: value for key, value in self.to_metrics().items()
                if isinstance(value, (int, float)) and not isinstance(value, bool) and key not in _FLAGS}

    def curves(self) -> dict[str, int | float]:
        """The numbers of :meth:`numbers` that move from report to report: progress, losses and the
        workload's measurements, speed, the micro-batch and accumulation in force, memory measured,
        OOMs survived. What TensorBoard plots (``orchestrator.tensorboard``); the plan's
        constants are a trial's params in MLflow."""
        return {key: value for key, value in self.numbers().items()
                if key in _CURVES or key in self.measurements or _RANK_KEY.fullmatch(key)}

    @classmethod
    def from_result(cls, result: Mapping[str, Any] | None) -> "TrialReport":
        """A Tune result (or the metrics of one MLflow step) read back; keys it lacks stay unset,
        keys it does not know are the workload's measurements, Tune's own are dropped."""
        result = dict(result or {})
        plan = result.get("plan") if isinstance(result.get("plan"), dict) else None
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.name in result and f.name not in _SPECIAL:
                values[f.name] = _typed(_KINDS[f.name], result[f.name])
        values["plan"] = plan
        values["refusal"] = result.get("refusal") or (plan or {}).get("refusal") or None
        values["oom_events"] = tuple(OomEvent.from_dict(e) for e in records_from_report(result.get("oom_events")))
        values["host_memory_events"] = tuple(
            HostMemoryEvent.from_dict(e) for e in records_from_report(result.get("host_memory_events")))
        values["moves"] = tuple(Move.from_dict(m) for m in records_from_report(result.get("moves")))
        values["plan_checks"] = tuple(PlanCheck.from_dict(c) for c in records_from_report(result.get("plan_checks")))
        values["rank_peaks"] = _rank_peaks(result)
        known = {f.name for f in dataclasses.fields(cls)} | _DERIVED | TUNE_RESULT_KEYS
        values["measurements"] = {k: v for k, v in result.items() if k not in known and not _RANK_KEY.fullmatch(k)}
        return cls(**values)

    @classmethod
    def integer_keys(cls) -> frozenset[str]:
        """The keys whose numbers are counts or bytes (MLflow gives every metric back as a float)."""
        counts = {name for name, kind in _KINDS.items() if kind in (int, bool)}  # flags are 0/1
        return frozenset(counts | {"moved", "ranks", "worst_rank"})


#: Fields :meth:`TrialReport.from_result` reads its own way.
_SPECIAL = frozenset({"plan", "refusal", "oom_events", "host_memory_events", "moves", "plan_checks", "rank_peaks",
                      "measurements"})
#: Keys of :meth:`TrialReport.to_metrics` that are 0/1 flags.
_FLAGS = frozenset({"refused", "training_done", "done"})
#: The fields whose numbers move from report to report (:meth:`TrialReport.curves`).
_CURVES = frozenset({
    "epoch", "step", "train_loss", "learning_rate", "steps_per_second", "samples_per_second", "micro_batch",
    "accum_steps", "peak_allocated_bytes", "peak_reserved_bytes", "fragmentation", "device_used_bytes",
    "prediction_error", "oom_retries",
})
#: Keys :meth:`TrialReport.to_metrics` derives from the fields.
_DERIVED = frozenset({"moved", "refused", "ranks", "worst_rank"})


def _measured(reserved: int | None, allocated: int | None) -> int | None:
    return reserved if reserved is not None else allocated


def _scalar(hint: Any) -> type | None:
    """``int`` for a field typed ``int`` or ``int | None``, ``bool`` likewise, else None."""
    kinds = set(typing.get_args(hint)) - {type(None)} or {hint}
    kind = kinds.pop() if len(kinds) == 1 else None
    return kind if kind in (int, bool) else None


#: The fields whose values a result may carry as another type: name -> int or bool (else None).
_KINDS = {name: _scalar(hint) for name, hint in typing.get_type_hints(TrialReport).items()}


def _typed(kind: type | None, value: Any) -> Any:
    """A value as its field holds it: MLflow stores every number as a float, Tune a flag as 0/1."""
    if value is None:
        return None
    if kind is bool:
        return bool(value)
    if kind is int and isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _rank_peaks(result: Mapping[str, Any]) -> tuple[RankPeak, ...]:
    found: dict[int, dict[str, Any]] = {}
    for key, value in result.items():
        match = _RANK_KEY.fullmatch(key)
        if match and value is not None:
            found.setdefault(int(match[1]), {})[match[2]] = _typed(int, value)
    return tuple(RankPeak(**found.get(rank, {})) for rank in range(max(found, default=-1) + 1))
