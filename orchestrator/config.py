"""A sweep's YAML -> a validated, typed :class:`SweepSpec`.

Everything a user can get wrong is caught here, before Ray starts, with one line that names
the key path and what was expected (``search_space.lr: expected ...``). The rest of the code
can then trust the spec.

Each YAML section is a frozen dataclass whose fields declare each key's type and default once.
pydantic validates the YAML against them (an unknown key is a mistake: ``extra="forbid"``) and
:func:`_describe` words its first error as the project's one line. Code that builds these values
itself (the loop, tests, benchmarks) gets plain dataclasses: validation guards the YAML's door
and costs nothing elsewhere.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import difflib
import functools
import math
import os
import re
import typing
from dataclasses import dataclass, field
from typing import Annotated, Any, Callable, Literal

import yaml
from pydantic import (
    AfterValidator,
    BeforeValidator,
    ConfigDict,
    Field,
    StringConstraints,
    TypeAdapter,
    ValidationError,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from orchestrator.allocator_conf import parse_alloc_conf
from orchestrator.device_kinds import AUTO, device_kind, device_names
from orchestrator.errors import ConfigError
from orchestrator.estimator_registry import NO_ESTIMATE
from orchestrator.estimator_registry import names as estimator_names
from orchestrator.units import human, parse_bytes

SEARCH_KINDS = ("choice", "grid", "uniform", "loguniform", "randint")
PRECISIONS = ("fp32", "bf16", "fp16")
SCHEDULERS = ("fifo", "asha")
LR_DECAYS = ("constant", "linear", "cosine")
#: How a trial's DataLoader starts its workers (``multiprocessing`` start methods): ``fork``
#: shares the dataset's pages with them, watched for a child that never runs Python
#: (``trainables.worker_start``); ``forkserver`` and ``spawn`` (Ray Train's advice) pickle it.
START_METHODS = ("fork", "forkserver", "spawn")
EVERY_UNITS = ("epochs", "steps", "minutes")
#: What a trial whose loss (or clipped gradient norm) is not finite does (``trainables.divergence``):
#: ends as DIVERGED, counted as finished (stop) or as failed (fail), or trains on (continue).
ON_NAN = ("stop", "fail", "continue")

#: Every section refuses keys it does not declare: a typo is a mistake, not a silent default.
SECTION = ConfigDict(extra="forbid")


# -- value types: what each key accepts, and how the message says what was expected -------------


def _invalid(message: str, *under: str | int) -> PydanticCustomError:
    """A rule's one-line message about the value being validated; ``under`` continues its key path
    to the key the message is about (a check on ``memory`` that blames ``memory.capacity``)."""
    return PydanticCustomError("config", "{message}", {"message": message, "under": under})


def _expect(what: str, text: bool = False) -> WrapValidator:
    """Whatever pydantic finds wrong with a value, say what was expected in the project's words.
    ``text``: the value is a word, which YAML may have read as something else."""

    def validate(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        try:
            return handler(value)
        except ValidationError:
            raise _invalid(f"expected {what}, got {_got(value, text)}") from None

    return WrapValidator(validate)


#: What YAML makes of an unquoted word that is not text: ``on``, ``2024-01-01``, ``1e3``, ``~``.
_YAML_READS = ((bool, "a boolean"), (datetime.date, "a date"), (int, "a number"), (float, "a number"),
               (type(None), "null"))


def _got(value: Any, text: bool) -> str:
    """The value as the user wrote it, as far as it can be told; where a word was expected and
    YAML made it something else (``experiment: 2024-01-01`` is a date), how to make it a word."""
    shown = value.isoformat() if isinstance(value, datetime.date) else repr(value)
    read_as = next((name for kind, name in _YAML_READS if isinstance(value, kind)), None)
    if text and read_as:
        return f"{shown}, which YAML reads as {read_as}; quote it to make it text"
    return shown


def _one_of(values: tuple[str, ...]) -> Any:
    return Annotated[Literal[values], _expect(f"one of {', '.join(values)}")]


def _registered_device(value: Any) -> str:
    """Device kinds register themselves (``orchestrator.device_kinds``), so the names a sweep may
    use are read when it is validated, not fixed here."""
    known = device_names()
    if value not in known:
        raise _invalid(f"expected one of {', '.join(known)}, got {value!r}")
    return value


def _registered_estimator(value: Any) -> None:
    """Estimators register themselves (``orchestrator.estimator_registry``), the user's too, from
    the module of a workload the sweep names: so the name is checked once those are imported
    (:func:`parse_spec`), not fixed here."""
    known = (*estimator_names(), NO_ESTIMATE)
    if value not in known:
        raise ConfigError(f"memory.estimator: expected one of {', '.join(known)}, got {value!r}")


PositiveInt = Annotated[int, Field(strict=True, gt=0), _expect("a positive integer")]
NonNegativeInt = Annotated[int, Field(strict=True, ge=0), _expect("an integer >= 0")]
PositiveNumber = Annotated[float, Field(strict=True, gt=0), _expect("a positive number")]
NonNegativeNumber = Annotated[float, Field(strict=True, ge=0), _expect("a number >= 0")]
Fraction = Annotated[float, Field(strict=True, gt=0, le=1), _expect("a number in (0, 1]")]
Flag = Annotated[bool, Field(strict=True), _expect("true or false")]
Text = Annotated[str, StringConstraints(strict=True, pattern=r"\S"), _expect("a non-empty string", text=True)]
Device = Annotated[str, BeforeValidator(_registered_device)]
Estimator = Annotated[str, StringConstraints(strict=True, pattern=r"^\w+$"), _expect("an estimator's name", text=True)]
Precision = _one_of(PRECISIONS)
Decay = _one_of(LR_DECAYS)
StartMethod = _one_of(START_METHODS)
Mode = _one_of(("min", "max"))
OnNan = _one_of(ON_NAN)
TimeAttr = _one_of(("epoch", "step"))
SchedulerType = Annotated[_one_of(SCHEDULERS), BeforeValidator(lambda v: "fifo" if v in (None, "none") else v)]
LrFraction = Annotated[float, Field(strict=True, ge=0, le=1), _expect("a fraction of lr in [0, 1]")]
#: Seeds Tune's draw (numpy, whose legacy generator takes 32 bits) and each trial's torch
#: generators, at ``seed * 1_000_003 + step`` (``trainables.loop.step_seed``): 32 bits keep those
#: within torch's 64-bit seeds, and a negative one is refused by numpy.
Seed = Annotated[int, Field(strict=True, ge=0, lt=2**32), _expect(f"an integer from 0 to {2**32 - 1}")]
#: Every workload's ``lr``: torch's optimizers refuse a negative one as the trial builds them, after
#: Ray started and, in a grid, after the other trials ran.
LearningRate = Annotated[float, Field(strict=True, ge=0, allow_inf_nan=False), _expect("a finite number >= 0")]


def _bytes(value: Any) -> int | None:
    if value is None:
        return None
    try:
        return parse_bytes(value)
    except ValueError as exc:
        raise _invalid(str(exc)) from None


Size = Annotated[int | None, BeforeValidator(_bytes)]
Budget = Annotated[Size, BeforeValidator(lambda v: None if v == "auto" else v)]


def _whole_above_one(gpu: float | str) -> float | str:
    if gpu != "auto" and gpu > 1 and gpu != int(gpu):
        raise _invalid(f"expected a whole number of GPUs above 1, got {gpu!r}")
    return gpu


GpuCount = Annotated[
    Literal["auto"] | Annotated[int, Field(strict=True, ge=0)] | Annotated[float, Field(strict=True, ge=0)],
    _expect("a GPU count, a fraction such as 0.25, or 'auto'"),
    AfterValidator(_whole_above_one),
]


def _checked_alloc_conf(conf: str | None) -> str | None:
    """``PYTORCH_CUDA_ALLOC_CONF`` for the trials, checked as PyTorch would check it (which only
    happens when a worker first touches CUDA, minutes into a sweep)."""
    try:
        parse_alloc_conf(conf)
    except ValueError as exc:
        raise _invalid(str(exc)) from None
    return conf


AllocatorConf = Annotated[Text | None, AfterValidator(_checked_alloc_conf)]


#: The longest sweep folder name (``--name``): a file name may be 255 bytes; kept well under, as
#: Ray's metric tag values and MLflow's experiment names have limits of their own near there.
MAX_NAME_LENGTH = 128
#: What the runner and ``submit`` add to an experiment's name for a sweep's folder (``_20261126-120000``).
START_TIME_SUFFIX = 16
#: POSIX's portable file name characters: every layer a name reaches takes them as they are (a
#: folder on any file system or object store URI, an MLflow experiment, Ray's metric tags, which
#: are encoded as ASCII, a glob of ``--resume``, a shell word); the first may not be ``-`` (an option).
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")


def _folder(name: str, longest: int = MAX_NAME_LENGTH) -> str:
    """A name that becomes one folder under the storage path, an MLflow experiment name and a tag
    of Ray's metrics: checked here for what all of them take, so a name that one of them would
    refuse (``café``: Ray's tags are ASCII; 250 characters: too long a file name) is one line
    before Ray starts, not an error in every trial.

    A path separator or ``..`` would put the sweep's results somewhere else (``../../x``,
    ``/tmp/x``), so a name is a name: one path component, not hidden.
    """
    if any(c in name for c in "/\\") or ".." in name or name.startswith("."):
        raise _invalid(f"expected a name, not a path (no '/', '\\', '..' or leading '.'), got {name!r}")
    if not _NAME.fullmatch(name):
        raise _invalid(
            f"expected a name of ASCII letters, digits, '_', '.' and '-' (not first), got {name!r}: it names a folder, "
            "an MLflow experiment and Ray's metric tags"
        )
    if len(name) > longest:
        added = " (the sweep's folder adds its start time)" if longest < MAX_NAME_LENGTH else ""
        raise _invalid(f"expected a name of at most {longest} characters{added}, got {len(name)}")
    return name


FolderName = Annotated[Text, AfterValidator(_folder)]
ExperimentName = Annotated[Text, AfterValidator(functools.partial(_folder, longest=MAX_NAME_LENGTH - START_TIME_SUFFIX))]


def folder_name(value: Any, path: str) -> str:
    """``value`` as a results folder's name, or a :class:`ConfigError` naming ``path`` (a flag, a key)."""
    return _validated(FolderName, value, path)


_URI = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")


def _local_folder(path: str) -> str:
    """A storage path is a folder of a file system this machine (and every node) mounts.

    Tune takes a URI (``s3://bucket/sweeps``) and writes through pyarrow, but the orchestrator
    keeps its own sweep state beside Tune's (the claim on the sweep, whole copies of Tune's state
    files, MLflow writes left unsent, a trial's OOM evidence) and reads it back on ``--resume``
    with plain file I/O: a URI would become a local folder named ``s3:``. So it is refused, with
    what works instead. A leading ``~`` is the home folder, as in Tune's own ``~/ray_results``
    (no shell expands it in a YAML file or after ``--storage-path=``): kept, it made a folder
    named ``~`` in the working directory."""
    if _URI.match(path):
        raise _invalid(
            f"expected a folder, not a URI, got {path!r}: the sweep keeps its state beside Tune's with file I/O; "
            "use a folder every node mounts (a shared disk, NFS, or the bucket mounted with s3fs, gcsfuse or blobfuse2)"
        )
    return os.path.expanduser(path)


StoragePath = Annotated[Text, AfterValidator(_local_folder)]


def storage_folder(value: Any, path: str) -> str:
    """``value`` as a storage path, or a :class:`ConfigError` naming ``path`` (``--storage-path``)."""
    return _validated(StoragePath, value, path)


def tracking_store(value: Any, path: str) -> str:
    """``value`` as a tracking URI, or a :class:`ConfigError` naming ``path`` (``--tracking-uri``)."""
    return _validated(Text, value, path)


#: Metadata of a field that no YAML key sets: it is derived from other keys or from the file.
DERIVED = {"derived": True}


def _keys(section: type) -> list[str]:
    """The keys a section's YAML may hold."""
    return sorted(f.name for f in dataclasses.fields(section) if not f.metadata.get("derived"))


def _no_derived_keys(section: type, data: dict) -> None:
    """pydantic accepts every field as a key; a derived one is still not the YAML's to set."""
    derived = {f.name for f in dataclasses.fields(section) if f.metadata.get("derived")}
    for key in data:
        if key in derived:
            raise PydanticCustomError("unknown_key", "unknown key", {"under": (key,)})


# -- sections -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Domain:
    """One searched hyper-parameter as written in YAML, e.g. ``{loguniform: [1e-4, 1e-1]}``."""

    kind: str
    args: tuple


#: ``randint``'s bounds, ``[low, high)``: Tune draws it with numpy's ``Generator.integers`` as int64.
INT64_LOW, INT64_HIGH = -(2**63), 2**63


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _domain(value: Any) -> Domain | Any:
    """A constant, or a one-key mapping naming a Tune search primitive.

    A distribution's bounds are checked against what Tune's sampling (numpy) takes: one it would
    refuse (infinite, NaN, past int64) fails only when ``plan`` or the sweep draws the configs, as a
    traceback, so it is one line here instead."""
    if not isinstance(value, dict):
        return value
    if len(value) != 1 or next(iter(value)) not in SEARCH_KINDS:
        raise _invalid(f"expected a constant or one of {{{', '.join(k + ': ...' for k in SEARCH_KINDS)}}}, got {value!r}")
    kind, args = next(iter(value.items()))
    if kind in ("choice", "grid"):
        if not isinstance(args, list) or not args:
            raise _invalid(f"expected a non-empty list of values, got {args!r}", kind)
        return Domain(kind, (tuple(args),))
    if not (isinstance(args, list) and len(args) == 2 and all(_is_number(a) for a in args)):
        raise _invalid(f"expected [low, high] (two numbers), got {args!r}", kind)
    low, high = args
    given = f"[{low}, {high}]"
    # Compared as given: Python compares ints and floats exactly, where float() of a large int overflows.
    if not all(isinstance(a, int) or math.isfinite(a) for a in args):
        raise _invalid(f"expected finite bounds, got {given}", kind)
    if not low < high:
        raise _invalid(f"expected low < high, got {given}", kind)
    if kind == "loguniform" and low <= 0:
        raise _invalid(f"expected a positive low bound, got {low}", kind)
    if kind == "randint":
        if not all(isinstance(a, int) for a in args):
            raise _invalid(f"expected two integers [low, high), got {args!r}", kind)
        if not (INT64_LOW <= low and high <= INT64_HIGH):
            raise _invalid(
                f"expected integers from -2**63 to 2**63 (Tune samples randint as numpy's int64), got {given}", kind
            )
        return Domain(kind, (low, high))
    try:  # numpy samples low + (high - low) * u: the span must be a float too
        span = float(high) - float(low)
    except OverflowError:
        span = math.inf
    if not math.isfinite(span):
        raise _invalid(f"expected high - low within a float's range (at most 1.8e308), got {given}", kind)
    return Domain(kind, (float(low), float(high)))


def _not_empty(space: dict) -> dict:
    if not space:
        raise _invalid("expected at least one hyper-parameter to search, got an empty mapping")
    return space


SearchSpace = Annotated[dict[str, Annotated[Any, AfterValidator(_domain)]], AfterValidator(_not_empty)]


@dataclass(frozen=True)
class WorkloadRef:
    """The YAML's ``workload: {name, params}``: the workload and the parameters every trial shares."""

    __pydantic_config__ = SECTION

    name: Text
    params: Annotated[dict[str, Any], BeforeValidator(lambda v: {} if v is None else v)] = field(default_factory=dict)


@dataclass(frozen=True)
class SchedulerSpec:
    """Tune's trial scheduler. Every key but ``type`` is ASHA's (``AsyncHyperBandScheduler``): its
    first rung, how many trials each rung keeps (1 in ``reduction_factor``; Tune asserts it is
    above 1) and what its rungs count; its last rung is the stop budget in that unit
    (:meth:`SweepSpec._sections_agree`)."""

    __pydantic_config__ = SECTION

    type: SchedulerType = "fifo"  # fifo | asha
    grace_period: PositiveInt = 1
    reduction_factor: Annotated[int, Field(strict=True, ge=2), _expect("an integer >= 2")] = 2
    time_attr: TimeAttr = "epoch"  # what ASHA's rungs count: "epoch" or "step" (optimizer steps)

    @model_validator(mode="before")
    @classmethod
    def _asha_keys_need_asha(cls, data: Any) -> Any:
        """FIFO reads none of ASHA's keys: one given under it would be silently ignored (a sweep
        meant to stop early runs every trial to its end), so it is a mistake."""
        if not isinstance(data, dict) or _nested(SchedulerType, data.get("type"), "type") != "fifo":
            return data
        asha_keys = [key for key in data if key != "type" and key in _keys(cls)]
        if asha_keys:
            raise _invalid(
                "needs type: asha (FIFO runs every trial to its stop), got type: fifo; for FIFO, set the scheduler whole "
                "(--set scheduler=fifo)", asha_keys[0],
            )
        return data


def _scheduler_by_name(value: Any) -> Any:
    """``scheduler: asha`` (or nothing) is short for ``scheduler: {type: asha}``."""
    if value is None or isinstance(value, str):
        return SchedulerSpec(_nested(SchedulerType, value))
    return value


Scheduler = Annotated[SchedulerSpec, BeforeValidator(_scheduler_by_name)]


@dataclass(frozen=True)
class Stop:
    """A trial's training budget: whichever of the two comes first (at least one is set)."""

    __pydantic_config__ = SECTION

    epochs: PositiveInt | None = None
    steps: PositiveInt | None = None  # optimizer steps

    @model_validator(mode="after")
    def _some_budget(self) -> Stop:
        if self.epochs is None and self.steps is None:
            raise _invalid("expected epochs, steps or both (training ends at whichever comes first)")
        return self

    def last_step(self, steps_per_epoch: int) -> int:
        """The optimizer step a trial's training ends at: whichever budget comes first, with
        ``steps_per_epoch`` of its data (the loop's, and the pre-flight's check of ASHA's rungs)."""
        return min(b for b in (self.steps, self.epochs and self.epochs * steps_per_epoch) if b)


@dataclass(frozen=True)
class Every:
    """How often something happens during training: every ``count`` epochs, steps or minutes.

    ``max_batches`` (evaluations only) caps an evaluation at that many batches of
    ``effective_batch_size`` samples: the first ``max_batches x effective_batch_size`` eval
    samples, the same ones whatever eval batch the plan (or an OOM's reduction) runs them in, so
    a metric means the same before and after a reduction.
    """

    unit: str  # "epochs" | "steps" | "minutes"
    count: float
    max_batches: int | None = None  # None: the whole eval set

    def describe(self) -> str:
        at_most = f" on at most {self.max_batches} batches" if self.max_batches is not None else ""
        return f"every {self.count:g} {self.unit}{at_most}"


def _steps(count: Any) -> dict:
    """What a cadence given as a bare number is short for."""
    return {"steps": count}


def _cadence(value: Any) -> Every:
    """``{steps: 500}``, ``{minutes: 10}`` or ``{epochs: 1}``; a bare number means steps."""
    if _is_number(value):
        value = _steps(value)
    if not isinstance(value, dict):
        raise _invalid(f"expected a mapping, got {value!r}")
    if not (len(value) == 1 and next(iter(value)) in EVERY_UNITS):
        raise _invalid(f"expected one of {{steps: N}}, {{minutes: N}}, {{epochs: N}}, got {value!r}")
    ((unit, count),) = value.items()
    return Every(unit, _nested(PositiveNumber if unit == "minutes" else PositiveInt, count, unit))


def _eval_cadence(value: Any) -> Every:
    """A cadence that may add ``max_batches: N``; ``{max_batches: N}`` alone keeps every epoch."""
    if not (isinstance(value, dict) and "max_batches" in value):
        return _cadence(value)
    rest = {k: v for k, v in value.items() if k != "max_batches"}
    every = _cadence(rest or {"epochs": 1})
    return dataclasses.replace(every, max_batches=_nested(PositiveInt, value["max_batches"], "max_batches"))


Cadence = Annotated[Every, BeforeValidator(_cadence)]
EvalCadence = Annotated[Every, BeforeValidator(_eval_cadence)]


@dataclass(frozen=True)
class CheckpointPolicy:
    __pydantic_config__ = SECTION

    every: Cadence | None = None  # None: at every evaluation (to storage at most every 10 s: trial/checkpoint.py)
    keep: PositiveInt = 2  # checkpoints Tune keeps per trial (the newest)


@dataclass(frozen=True)
class DataLoading:
    """``torch.utils.data.DataLoader`` settings for the trials' training and eval data."""

    __pydantic_config__ = SECTION

    num_workers: NonNegativeInt = 0
    pin_memory: Flag | None = None  # None: when the trial trains on a GPU
    prefetch_factor: PositiveInt | None = None  # batches each worker loads ahead (DataLoader's default 2)
    persistent_workers: Flag = False
    multiprocessing_context: StartMethod = "fork"  # how the workers start: fork | forkserver | spawn

    @model_validator(mode="after")
    def _settings_of_workers(self) -> DataLoading:
        for key, given in (("prefetch_factor", self.prefetch_factor is not None), ("persistent_workers", self.persistent_workers)):
            if given and self.num_workers == 0:
                raise _invalid("needs worker processes (data.num_workers > 0), got num_workers 0", key)
        return self


@dataclass(frozen=True)
class LrSchedule:
    """The learning rate over a trial's optimizer steps: linear warm-up, then a decay to ``final_lr``."""

    __pydantic_config__ = SECTION

    warmup_steps: NonNegativeInt = 0
    decay: Decay = "constant"  # constant | linear | cosine
    final_lr: LrFraction = 0.0  # as a fraction of the workload's lr, reached at the last step


@dataclass(frozen=True)
class Resources:
    """What one trial asks Ray for. With ``workers: N`` (Ray Train's ``num_workers``) a trial is a
    data-parallel group of N ranks and ``cpu``/``gpu`` are what each worker asks for."""

    __pydantic_config__ = SECTION

    cpu: PositiveNumber = 1.0
    gpu: GpuCount = 0  # a count, a fraction, or "auto" (the fraction the plan needs)
    workers: PositiveInt = 1  # ranks of a data-parallel trial (trainables.distributed)
    #: How long a sweep waits for a node that can hold one trial (an autoscaling cluster adds it);
    #: 0: a request no node can hold fails before the sweep starts.
    wait_minutes: NonNegativeNumber = 0.0

    @model_validator(mode="after")
    def _one_gpu_per_rank(self) -> Resources:
        if self.workers > 1 and self.gpu not in (0, 1):
            raise _invalid(
                f"with resources.workers: {self.workers} each worker is one rank on one GPU; expected 0 or 1 "
                f"(per worker), got {self.gpu!r}", "gpu",
            )
        return self


@dataclass(frozen=True)
class MemoryPolicy:
    """How trials' memory is estimated, budgeted and recovered when an estimate was wrong."""

    __pydantic_config__ = SECTION

    device: Device = "auto"
    capacity: Size = None  # bytes of the emulated device (the smallest rank's, when given per rank)
    budget: Budget = None  # bytes a plan may use per GPU; None = auto (NVML free - context)
    safety_margin: Fraction = 0.98  # from the allocator model's measured error: docs/ARCHITECTURE.md
    estimator: Estimator = "trace"
    fragmentation: NonNegativeNumber = 0.10
    allocator_conf: AllocatorConf = "expandable_segments:True"
    max_oom_retries: NonNegativeInt = 3
    gpu_granularity: Fraction = 0.125
    allow_activation_checkpointing: Flag = True
    precision: Precision = "fp32"
    lower_precision: Precision | None = "bf16"
    #: Verify the plan on the device in a trial's first steps and switch to the corrected plan
    #: (``orchestrator.trial.verify``); false: the estimate's plan is trusted until an OOM.
    verify: Flag = True
    #: ``capacity: [64MiB, 8MiB]``: each rank of a data-parallel trial opens an emulated device of
    #: its own size (a group whose cards differ); empty when one capacity serves every rank.
    rank_capacities: tuple[int, ...] = field(default=(), metadata=DERIVED)

    def capacity_of(self, rank: int) -> int | None:
        return self.rank_capacities[rank] if self.rank_capacities else self.capacity

    @model_validator(mode="before")
    @classmethod
    def _capacity_per_rank(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        _no_derived_keys(cls, data)
        capacity = data.get("capacity")
        if not isinstance(capacity, list):
            return data
        if not capacity:
            raise _invalid("expected a size, or a list of one size per worker, got []", "capacity")
        sizes = tuple(_nested(Size, c, "capacity", i) for i, c in enumerate(capacity))
        return {**data, "capacity": min(sizes), "rank_capacities": sizes}

    @model_validator(mode="after")
    def _emulated_has_capacity(self) -> MemoryPolicy:
        if self.device != AUTO and device_kind(self.device).sized_by_config and self.capacity is None:
            raise _invalid(f"memory.device '{self.device}' needs a capacity, e.g. capacity: 8MiB", "capacity")
        return self


@dataclass(frozen=True)
class SweepSpec:
    __pydantic_config__ = SECTION

    experiment: ExperimentName
    workload: Text
    params: dict[str, Any] = field(metadata=DERIVED)  # written as workload.params
    search_space: SearchSpace
    effective_batch_size: PositiveInt
    stop: Stop
    num_samples: PositiveInt = 1
    #: The most trials the search space may make (:meth:`trial_count`): Tune holds every trial in
    #: the driver, so a grid of a million is refused in one line before anything expands it.
    max_trials: PositiveInt = 10_000
    metric: Text = "eval_loss"
    mode: Mode = "min"
    scheduler: Scheduler = SchedulerSpec()
    resources: Resources = Resources()
    memory: MemoryPolicy = MemoryPolicy()
    storage_path: StoragePath = "./orchestrator_results"
    tracking_uri: Text | None = None
    seed: Seed = 0
    max_failures: NonNegativeInt = 0
    reuse: Flag = True  # Tune's reuse_actors: a finished trial's worker runs the next (orchestrator.trial.reuse)
    eval_every: EvalCadence = Every("epochs", 1)
    checkpoint: CheckpointPolicy = CheckpointPolicy()
    data: DataLoading = DataLoading()
    schedule: LrSchedule | None = None  # None: a workload's build_scheduler, else a constant lr
    max_grad_norm: PositiveNumber | None = None
    on_nan: OnNan = "stop"
    source: str | None = field(default=None, compare=False, metadata=DERIVED)
    raw: dict = field(default_factory=dict, compare=False, metadata=DERIVED)  # the YAML as given

    def workload_names(self) -> list[str]:
        """Every workload the sweep may run: the default, or those its search space names."""
        searched = self.search_space.get("workload")
        if isinstance(searched, Domain) and searched.kind in ("choice", "grid"):
            return list(searched.args[0])
        return [searched if isinstance(searched, str) else self.workload]

    def trial_count(self) -> int:
        """The trials Tune makes of the search space, counted without making them: every
        combination of the grids, ``num_samples`` times (a ``choice`` or a distribution is drawn
        once per trial, so it adds none)."""
        count = self.num_samples
        for grid in self._grid_sizes():
            count *= grid
        return count

    def asha_last_rung(self) -> int | None:
        """ASHA's last rung (Tune's ``max_t``): the stop budget in the unit its rungs count."""
        return self.stop.epochs if self.scheduler.time_attr == "epoch" else self.stop.steps

    def _grid_sizes(self) -> list[int]:
        return [len(v.args[0]) for v in self.search_space.values() if isinstance(v, Domain) and v.kind == "grid"]

    @model_validator(mode="before")
    @classmethod
    def _from_yaml(cls, data: Any) -> Any:
        """The YAML names the workload and its params in one section (or the workload alone)."""
        if not isinstance(data, dict):
            return data
        _no_derived_keys(cls, data)
        fields = {**data, "raw": data}
        workload = data.get("workload")
        if isinstance(workload, str) or "workload" not in data:
            fields["params"] = {}
        else:
            ref = _nested(WorkloadRef, workload, "workload")
            fields.update(workload=ref.name, params=ref.params)
        return fields

    @model_validator(mode="after")
    def _every_seed_and_lr_is_one(self) -> SweepSpec:
        """A trial's seed and learning rate may come from the search space or the workload's params;
        each value they can take must be one :data:`Seed` or :data:`LearningRate` allows, or every
        trial drawn with it fails in torch, once Ray has started (``manual_seed`` of ``seed *
        1_000_003 + step``; the optimizer's constructor). A distribution's bounds stand for its values."""
        for key, kind, integers in (("seed", Seed, True), ("lr", LearningRate, False)):
            for where, value in ((("search_space", key), self.search_space.get(key)),
                                 (("workload", "params", key), self.params.get(key))):
                if integers and isinstance(value, Domain) and value.kind not in ("choice", "grid", "randint"):
                    raise _invalid(f"expected integers (a randint, choice or grid of them), got a {value.kind} "
                                   "distribution", *where)
                if isinstance(value, Domain):
                    values = list(value.args[0]) if value.kind in ("choice", "grid") else [
                        value.args[0], value.args[1] - 1 if value.kind == "randint" else value.args[1]]
                else:
                    values = [] if value is None else [value]
                for one in values if integers else filter(_is_number, values):  # other types: the workload's check
                    _nested(kind, one, *where)
        return self

    @model_validator(mode="after")
    def _trials_within_bound(self) -> SweepSpec:
        count = self.trial_count()
        if count > self.max_trials:
            made = " x ".join(f"{n:,}" for n in (self.num_samples, *self._grid_sizes()))
            raise _invalid(
                f"makes {count:,} trials (num_samples x grid sizes: {made}), more than max_trials: {self.max_trials:,}; "
                f"raise max_trials (--set max_trials={count}) to run a sweep this large",
                "search_space" if self._grid_sizes() else "num_samples",
            )
        return self

    @model_validator(mode="after")
    def _sections_agree(self) -> SweepSpec:
        """Rules across sections: ASHA's rungs need a budget in the unit they count; a GPU device
        needs a GPU from Ray; a group's ranks share every optimizer step exactly and agree on every
        milestone without a clock."""
        if self.scheduler.type == "asha":
            unit = self.scheduler.time_attr
            last_rung = self.asha_last_rung()
            if last_rung is None:
                raise _invalid(f"{unit} needs stop.{unit}s (ASHA's last rung), which is not set", "scheduler", "time_attr")
            if self.scheduler.grace_period > last_rung:  # Tune asserts grace_period <= max_t
                raise _invalid(
                    f"expected at most stop.{unit}s ({last_rung}, ASHA's last rung), got {self.scheduler.grace_period}",
                    "scheduler", "grace_period",
                )
        device = self.memory.device
        if device != AUTO and device_kind(device).accelerator and self.resources.gpu == 0:
            raise _invalid(
                f"'{device}' trains on a GPU, but resources.gpu is 0 (Ray gives such a trial no GPU); "
                "ask for one (resources.gpu: 1) or use memory.device: auto",
                "memory", "device",
            )
        workers = self.resources.workers
        rank_capacities = self.memory.rank_capacities
        if rank_capacities and len(rank_capacities) != workers:
            raise _invalid(
                f"expected one capacity per worker (resources.workers: {workers}), got {len(rank_capacities)}",
                "memory", "capacity",
            )
        if workers == 1:
            return self
        batch = self.effective_batch_size
        if batch % workers:
            below, above = batch - batch % workers, batch + workers - batch % workers
            fits = [n for n in range(workers - 1, 0, -1) if batch % n == 0][:1]
            raise _invalid(
                f"{batch} does not split evenly over resources.workers: {workers}; "
                f"use {below or above} or {above}" + (f", or workers: {fits[0]}" if fits and fits[0] > 1 else ""),
                "effective_batch_size",
            )
        for path, every in (("eval_every",), self.eval_every), (("checkpoint", "every"), self.checkpoint.every):
            if every is not None and every.unit == "minutes":
                raise _invalid(
                    "minutes are not supported with resources.workers > 1 (ranks' clocks differ); use steps or epochs",
                    *path,
                )
        return self


# -- pydantic's errors -> one line --------------------------------------------------------------


@functools.cache
def _adapter(kind: Any) -> TypeAdapter:
    """Built on first use: a ``plan`` or ``run`` pays for the schema once, an import does not."""
    return TypeAdapter(kind)


def _validated(kind: Any, value: Any, path: str = "") -> Any:
    """``value`` as ``kind``, or a :class:`ConfigError` whose one line starts with the key path."""
    try:
        return _adapter(kind).validate_python(value)
    except ValidationError as exc:
        where, message = _describe(exc, kind)
        raise ConfigError(f"{_path((path, *where) if path else where) or 'config'}: {message}") from None


def _nested(kind: Any, value: Any, *under: str | int) -> Any:
    """``value`` as ``kind`` from inside a validator, its error kept under the key path ``under``."""
    try:
        return _adapter(kind).validate_python(value)
    except ValidationError as exc:
        where, message = _describe(exc, kind)
        raise _invalid(message, *under, *where) from None


#: pydantic's error types for a key the section does not have.
UNKNOWN_KEY_ERRORS = ("unexpected_keyword_argument", "unknown_key")


def _describe(exc: ValidationError, kind: Any) -> tuple[tuple, str]:
    """pydantic's first error -> (key path below ``kind``, what was expected, in the project's words).

    A misspelt key is first, whatever pydantic's order: it is also why a required key is missing
    (``effective_batch_sise``), and naming that one first would send the user to add what is there."""
    errors = exc.errors(include_url=False)
    error = next((e for e in errors if e["type"] in UNKNOWN_KEY_ERRORS), errors[0])
    where = (*error["loc"], *error.get("ctx", {}).get("under", ()))
    if error["type"] in UNKNOWN_KEY_ERRORS:
        return where, f"unknown key {_one_of(str(where[-1]), _keys(_section_at(kind, where[:-1])))}"
    if error["type"] in ("missing", "missing_argument"):
        return where, "required key is missing"
    if error["type"] in ("dataclass_type", "dict_type"):
        return where, f"expected a mapping, got {error['input']!r}"
    return where, error["msg"]


def _one_of(key: str, keys: list[str]) -> str:
    """``(did you mean num_samples? expected one of: ...)``: the nearest of ``keys`` to a misspelt ``key``, if one is near."""
    close = difflib.get_close_matches(key, keys, n=1)
    meant = f"did you mean {close[0]}? " if close else ""
    return f"({meant}expected one of: {', '.join(keys)})"


def _section_at(kind: type, where: tuple) -> type:
    """The section dataclass a key path leads to from ``kind`` (``memory`` -> MemoryPolicy)."""
    for key in where:
        hint = typing.get_type_hints(kind)[key]
        kind = next(t for t in (hint, *typing.get_args(hint)) if dataclasses.is_dataclass(t))
    return kind


def _path(where: tuple) -> str:
    text = ""
    for part in where:
        text += f"[{part}]" if isinstance(part, int) else f".{part}" if text else str(part)
    return text


# -- loading ------------------------------------------------------------------------------------


class SweepLoader(yaml.SafeLoader):
    """PyYAML reads YAML 1.1, where ``1e-3`` is a string; sweeps write learning rates that way.

    YAML 1.2 (and every user) reads it as a number, so exponent floats without a dot are
    resolved as floats here too.
    """


SweepLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)

#: A sweep file is a page of settings (a search space is written as Tune's primitives, not as its
#: values): a larger one is a mistake, refused before it is read.
MAX_FILE_BYTES = 2**20
#: Aliases (``*name``) may repeat parts of a file, not multiply it: nested ones ("billion laughs")
#: would expand a few lines into more values than memory holds, so all of a document's aliases,
#: expanded, may add at most this many YAML nodes to it.
MAX_ALIAS_NODES = 100_000


def read_yaml(text: str | bytes, where: str) -> Any:
    """``text`` as YAML (with :class:`SweepLoader`), bounded: a document whose aliases add more
    than :data:`MAX_ALIAS_NODES` nodes to it, or refer to themselves, is a :class:`ConfigError` about
    ``where`` before anything is built from it."""
    loader = SweepLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_expansion(node, where)
        _check_duplicate_keys(node)
        return loader.construct_document(node)
    except RecursionError:
        raise ConfigError(f"{where}: nested deeper than a sweep file can be read") from None
    finally:
        loader.dispose()


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """PyYAML's error as one line's end, ``at line 2, column 5: expected ',' or ']', but got ':'
    (while parsing a flow sequence at line 1, column 13)``: where it is, not PyYAML's several lines
    that name the text it read (``"<byte string>"``) and quote it."""
    if isinstance(exc, yaml.MarkedYAMLError) and exc.problem_mark is not None:
        context = f" ({exc.context} at {_line_column(exc.context_mark)})" if exc.context and exc.context_mark else ""
        return f"at {_line_column(exc.problem_mark)}: {exc.problem}{context}"
    if isinstance(exc, yaml.reader.ReaderError):  # a byte that is not UTF-8 text, or a control character
        return f"at position {exc.position}: unacceptable character #x{exc.character:04x}: {exc.reason}"
    return f"({' '.join(str(exc).split())})"


def _line_column(mark: yaml.Mark) -> str:
    return f"line {mark.line + 1}, column {mark.column + 1}"  # PyYAML counts from 0, editors from 1


def _check_expansion(root: yaml.Node, where: str) -> None:
    """Refuse ``root`` when its aliases, expanded, would add more than :data:`MAX_ALIAS_NODES`
    nodes or one of them contains itself. Counted without expanding anything: each distinct node's
    expanded size once, iteratively (a deep file does not exhaust Python's stack here)."""
    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, children_counted = stack.pop()
        children = _children(node)
        if children_counted:
            open_nodes.discard(id(node))
            sizes[id(node)] = 1 + sum(sizes[id(child)] for child in children)
            continue
        if id(node) in sizes:
            continue
        open_nodes.add(id(node))
        stack.append((node, True))
        for child in children:
            if id(child) in open_nodes:
                raise ConfigError(f"{where}: an alias (*name) refers to a node that contains it; a sweep file cannot be recursive")
            stack.append((child, False))
    added = sizes[id(root)] - len(sizes)
    if added > MAX_ALIAS_NODES:
        raise ConfigError(
            f"{where}: its aliases (*name) expand to {added:,} more YAML nodes, past the {MAX_ALIAS_NODES:,} "
            "a sweep file's aliases may add; write the values out, or nest fewer aliases"
        )


def _check_duplicate_keys(root: yaml.Node) -> None:
    """YAML forbids a key twice in one mapping, where PyYAML keeps the last without a word: a
    sweep that says ``lr`` twice is refused, naming both lines. Checked on the nodes as written,
    before construction flattens merges (``<<: *base``), whose keys those beside them may override."""
    seen: set[int] = set()
    stack = [root]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, yaml.MappingNode):
            first: dict[tuple[str, str], yaml.Node] = {}
            for key, _ in node.value:
                if not isinstance(key, yaml.ScalarNode) or key.tag == "tag:yaml.org,2002:merge":
                    continue
                if (key.tag, key.value) in first:
                    earlier = first[(key.tag, key.value)].start_mark
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key {key.value!r} (first at {_line_column(earlier)})", key.start_mark
                    )
                first[(key.tag, key.value)] = key
        stack.extend(_children(node))


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    return node.value if isinstance(node, yaml.SequenceNode) else []


def load_spec(path: str, overrides: list[str] | tuple[str, ...] = ()) -> SweepSpec:
    """Read, override (``key.path=value``) and validate a sweep file."""
    try:
        with open(path, "rb") as f:
            text = f.read(MAX_FILE_BYTES + 1)
            size = os.fstat(f.fileno()).st_size
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the config file ({exc.strerror or exc})") from None
    if len(text) > MAX_FILE_BYTES:
        read = f"{size:,} bytes" if size > MAX_FILE_BYTES else f"{len(text):,} bytes or more"  # a pipe has no size
        raise ConfigError(
            f"{path}: {read}, more than the {MAX_FILE_BYTES:,} ({human(MAX_FILE_BYTES)}) a sweep file may be "
            "(a search space is written as Tune's primitives such as {grid: [...]}, not as its trials)"
        )
    try:
        raw = read_yaml(text, path)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML {_yaml_problem(exc)}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of config keys at the top level")
    for override in overrides:
        apply_override(raw, override)
    spec = parse_spec(raw)
    return dataclasses.replace(spec, source=os.path.abspath(path))


#: The sections a YAML may give as one value, and the mapping that value is short for (as the
#: sections' validators read them): ``--set scheduler.grace_period=2`` on ``scheduler: asha``
#: extends ``{type: asha}``, as it would have had the YAML spelled it out.
SHORT_FORMS: dict[str, Callable[[Any], dict]] = {
    "workload": lambda name: {"name": name},
    "scheduler": lambda name: {"type": name},
    "eval_every": _steps,
    "checkpoint.every": _steps,
}


def apply_override(raw: dict, override: str) -> None:
    """``--set memory.safety_margin=0.8``: the value is read as YAML, the path may be new."""
    key_path, sep, text = override.partition("=")
    if not sep or not key_path.strip():
        raise ConfigError(f"--set {override}: expected KEY.PATH=VALUE")
    keys = key_path.strip().split(".")
    if not all(keys):  # ".stop", "stop..epochs": an empty key would be one no section has, named as nothing
        raise ConfigError(f"--set {override}: expected KEY.PATH=VALUE with no empty key part")
    node = raw
    for i, key in enumerate(keys[:-1]):
        path = ".".join(keys[: i + 1])
        child = node.get(key)
        if child is None:
            child = node[key] = {}
        elif not isinstance(child, dict) and path in SHORT_FORMS:
            child = node[key] = SHORT_FORMS[path](child)
        if not isinstance(child, dict):
            raise ConfigError(f"--set {override}: {path} is {child!r} in the config, not a mapping; "
                              f"set it whole (--set {path}=VALUE)")
        node = child
    try:
        node[keys[-1]] = read_yaml(text, f"--set {key_path.strip()}")
    except yaml.YAMLError as exc:
        raise ConfigError(f"--set {override}: value is not valid YAML {_yaml_problem(exc)}") from None


def parse_spec(raw: dict) -> SweepSpec:
    """The sweep's sections, each validated against its dataclass, then its parameters against its workloads."""
    spec = _validated(SweepSpec, copy.deepcopy(raw))  # the spec keeps the YAML as given (raw)
    _check_workload_parameters(spec)
    _registered_estimator(spec.memory.estimator)
    return spec


# -- the sweep against its workloads -----------------------------------------------------------


def _check_workload_parameters(spec: SweepSpec) -> None:
    """Every parameter must belong to a workload of the sweep (catches typos such as ``widht``),
    every value a trial may get must fit the type each workload declares for it, every field a
    workload has no default for must be given, and the sweep's metric must be one that every
    workload reports."""
    from trainables.workload import WorkloadNotFound, resolve_workload

    _check_searched_workloads(spec.search_space.get("workload"))
    classes = {}
    for name in spec.workload_names():
        try:
            classes[name] = resolve_workload(name)
        except WorkloadNotFound as exc:
            where = "search_space.workload" if "workload" in spec.search_space else "workload.name"
            raise ConfigError(f"{where}: {exc}") from None
    accepted = {"workload"}.union(*(cls.parameter_names() for cls in classes.values()))
    for section, values in (("workload.params", spec.params), ("search_space", spec.search_space)):
        for key, value in values.items():
            if key not in accepted:
                raise ConfigError(f"{section}.{key}: not a parameter of workload {' or '.join(classes)} "
                                  f"{_one_of(key, sorted(accepted - {'workload'}))}")
            if key != "workload":
                _check_parameter_values(classes, f"{section}.{key}", key, value)
    given = {"seed", *spec.params, *spec.search_space}  # every trial gets the sweep's seed (orchestrator.space)
    for name, cls in classes.items():
        needed = [f.name for f in dataclasses.fields(cls) if f.init and f.name not in given
                  and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        if needed:
            raise ConfigError(f"workload.params.{needed[0]}: workload {name} needs a value for it (its field has no "
                              "default); give it in workload.params or search_space")
        reported = ["train_loss", *(f"eval_{m}" for m in cls.metrics)]
        if spec.metric not in reported:
            raise ConfigError(f"metric: workload {name} does not report {spec.metric!r} (it reports: {', '.join(reported)})")
        if spec.schedule is not None and cls.overrides("build_scheduler"):
            raise ConfigError(
                f"schedule: workload {name} builds its own scheduler (build_scheduler); "
                "remove schedule from the sweep or build_scheduler from the workload"
            )
    # A loss improves downwards; any other metric (accuracy, F1, perplexity) the sweep cannot
    # guess, and the default mode would crown the worst trial "Best" and let ASHA stop the best.
    if "mode" not in spec.raw and not spec.metric.endswith("loss"):
        raise ConfigError(f"mode: metric {spec.metric!r} is not a loss; say whether a better trial has a higher value "
                          "(mode: max) or a lower one (mode: min)")


def _check_searched_workloads(searched: Domain | Any) -> None:
    """A searched workload is a name, or a grid or choice of names: a trial cannot draw its
    workload from a distribution, and a name is the only thing a workload is found by."""
    if searched is None:
        return
    expected = "expected a workload name, or {grid: [...]} or {choice: [...]} of names"
    if isinstance(searched, Domain):
        if searched.kind not in ("choice", "grid"):
            raise ConfigError(f"search_space.workload: {expected}, got {{{searched.kind}: ...}}")
        names = searched.args[0]
    else:
        names = (searched,)
    for name in names:
        if not isinstance(name, str):
            raise ConfigError(f"search_space.workload: {expected}, got {name!r}")


def _check_parameter_values(classes: dict, path: str, key: str, value: Domain | Any) -> None:
    if not isinstance(value, Domain):
        # A list where one value is expected is most likely the values to try, written without a primitive.
        meant = ""
        if isinstance(value, list):
            where = "" if path.startswith("search_space.") else f"search_space.{key}: "
            meant = f" (to try each, write {where}{{grid: {value!r}}} or {{choice: {value!r}}})"
        candidates = [(path, value, f"got {value!r}{meant}")]
    elif value.kind in ("choice", "grid"):
        candidates = [(f"{path}.{value.kind}", v, f"got {v!r}") for v in value.args[0]]
    else:  # a distribution: one of its samples stands for all (floats, or integers for randint)
        sampled = "integers" if value.kind == "randint" else "floats"
        candidates = [(f"{path}.{value.kind}", value.args[0], f"{value.kind} samples {sampled}")]
    for name, cls in classes.items():
        for where, candidate, got in candidates:
            expected = cls.parameter_error(key, candidate)
            if expected is not None:
                raise ConfigError(f"{where}: workload {name}'s {key} expects {expected}, {got}")
