"""A sweep's YAML -> a validated, typed :class:`SweepSpec`.

Everything a user can get wrong is caught here, before Ray starts, with one line that names
the key path and what was expected (``search_space.lr: expected ...``). The rest of the code
can then trust the spec.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import re
from dataclasses import dataclass, field
from typing import Any

import yaml

from orchestrator.errors import ConfigError
from orchestrator.estimator_registry import NO_ESTIMATE
from orchestrator.estimator_registry import names as estimator_names
from orchestrator.units import parse_bytes

SEARCH_KINDS = ("choice", "grid", "uniform", "loguniform", "randint")
PRECISIONS = ("fp32", "bf16", "fp16")
DEVICES = ("auto", "cuda", "cpu", "emulated")


@dataclass(frozen=True)
class Domain:
    """One searched hyper-parameter as written in YAML, e.g. ``{loguniform: [1e-4, 1e-1]}``."""

    kind: str
    args: tuple


@dataclass(frozen=True)
class SchedulerSpec:
    type: str = "fifo"  # fifo | asha
    grace_period: int = 1
    reduction_factor: int = 2
    time_attr: str = "epoch"  # what ASHA's rungs count: "epoch" or "step" (optimizer steps)


@dataclass(frozen=True)
class Stop:
    """A trial's training budget: whichever of the two comes first (at least one is set)."""

    epochs: int | None = None
    steps: int | None = None  # optimizer steps


@dataclass(frozen=True)
class Every:
    """How often something happens during training: every ``count`` epochs, steps or minutes."""

    unit: str  # "epochs" | "steps" | "minutes"
    count: float

    def describe(self) -> str:
        return f"every {self.count:g} {self.unit}"


@dataclass(frozen=True)
class CheckpointPolicy:
    every: Every | None = None  # None: at every evaluation
    keep: int = 2  # checkpoints Tune keeps per trial (the newest)


@dataclass(frozen=True)
class DataLoading:
    """``torch.utils.data.DataLoader`` settings for the trials' training and eval data."""

    num_workers: int = 0
    pin_memory: bool | None = None  # None: when the trial trains on a GPU
    prefetch_factor: int | None = None  # batches each worker loads ahead (DataLoader's default 2)
    persistent_workers: bool = False


@dataclass(frozen=True)
class LrSchedule:
    """The learning rate over a trial's optimizer steps: linear warm-up, then a decay to ``final_lr``."""

    warmup_steps: int = 0
    decay: str = "constant"  # constant | linear | cosine
    final_lr: float = 0.0  # as a fraction of the workload's lr, reached at the last step


@dataclass(frozen=True)
class Resources:
    """What one trial asks Ray for. With ``workers: N`` (Ray Train's ``num_workers``) a trial is a
    data-parallel group of N ranks and ``cpu``/``gpu`` are what each worker asks for."""

    cpu: float = 1.0
    gpu: float | str = 0.0  # a count, a fraction, or "auto" (the fraction the plan needs)
    workers: int = 1  # ranks of a data-parallel trial (trainables.distributed)
    #: How long a sweep waits for a node that can hold one trial (an autoscaling cluster adds it);
    #: 0: a request no node can hold fails before the sweep starts.
    wait_minutes: float = 0.0


@dataclass(frozen=True)
class MemoryPolicy:
    """How trials' memory is estimated, budgeted and recovered when an estimate was wrong."""

    device: str = "auto"
    capacity: int | None = None  # bytes of the emulated device (the smallest rank's, when given per rank)
    budget: int | None = None  # bytes a plan may use per GPU; None = auto (NVML free - context)
    safety_margin: float = 0.98  # from the allocator model's measured error: docs/ARCHITECTURE.md
    estimator: str = "trace"
    fragmentation: float = 0.10
    allocator_conf: str | None = "expandable_segments:True"
    max_oom_retries: int = 3
    gpu_granularity: float = 0.125
    allow_activation_checkpointing: bool = True
    precision: str = "fp32"
    lower_precision: str | None = "bf16"
    #: ``capacity: [64MiB, 8MiB]``: each rank of a data-parallel trial opens an emulated device of
    #: its own size (a group whose cards differ); empty when one capacity serves every rank.
    rank_capacities: tuple[int, ...] = ()

    def capacity_of(self, rank: int) -> int | None:
        return self.rank_capacities[rank] if self.rank_capacities else self.capacity


@dataclass(frozen=True)
class SweepSpec:
    experiment: str
    workload: str
    params: dict[str, Any]
    search_space: dict[str, Domain | Any]
    effective_batch_size: int
    stop: Stop
    num_samples: int = 1
    metric: str = "eval_loss"
    mode: str = "min"
    scheduler: SchedulerSpec = SchedulerSpec()
    resources: Resources = Resources()
    memory: MemoryPolicy = MemoryPolicy()
    storage_path: str = "./orchestrator_results"
    tracking_uri: str | None = None
    seed: int = 0
    max_failures: int = 0
    reuse: bool = True  # Tune's reuse_actors: a finished trial's worker runs the next (trainables.reuse)
    eval_every: Every = Every("epochs", 1)
    checkpoint: CheckpointPolicy = CheckpointPolicy()
    data: DataLoading = DataLoading()
    schedule: LrSchedule | None = None  # None: a workload's build_scheduler, else a constant lr
    max_grad_norm: float | None = None
    source: str | None = field(default=None, compare=False)
    raw: dict = field(default_factory=dict, compare=False)

    def workload_names(self) -> list[str]:
        """Every workload the sweep may run: the default, or those its search space names."""
        searched = self.search_space.get("workload")
        if isinstance(searched, Domain) and searched.kind in ("choice", "grid"):
            return list(searched.args[0])
        return [searched if isinstance(searched, str) else self.workload]


# -- loading --------------------------------------------------------------------------------


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

TOP_LEVEL_KEYS = {
    "experiment", "workload", "search_space", "effective_batch_size", "stop", "num_samples",
    "metric", "mode", "scheduler", "resources", "memory", "storage_path", "tracking_uri", "seed",
    "max_failures", "reuse", "eval_every", "checkpoint", "data", "schedule", "max_grad_norm",
}
LR_DECAYS = ("constant", "linear", "cosine")


def load_spec(path: str, overrides: list[str] | tuple[str, ...] = ()) -> SweepSpec:
    """Read, override (``key.path=value``) and validate a sweep file."""
    try:
        with open(path) as f:
            raw = yaml.load(f, Loader=SweepLoader)
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML ({exc})".replace("\n", " ")) from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of config keys at the top level")
    for override in overrides:
        apply_override(raw, override)
    spec = parse_spec(raw)
    return dataclasses.replace(spec, source=os.path.abspath(path))


def apply_override(raw: dict, override: str) -> None:
    """``--set memory.safety_margin=0.8``: the value is read as YAML, the path may be new."""
    key_path, sep, text = override.partition("=")
    if not sep or not key_path.strip():
        raise ConfigError(f"--set {override}: expected KEY.PATH=VALUE")
    keys = key_path.strip().split(".")
    node = raw
    for i, key in enumerate(keys[:-1]):
        child = node.get(key)
        if child is None:
            child = node[key] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"--set {override}: {'.'.join(keys[: i + 1])} is not a mapping")
        node = child
    try:
        node[keys[-1]] = yaml.load(text, Loader=SweepLoader)
    except yaml.YAMLError:
        raise ConfigError(f"--set {override}: value is not valid YAML") from None


def parse_spec(raw: dict) -> SweepSpec:
    raw = copy.deepcopy(raw)
    _no_unknown(raw, TOP_LEVEL_KEYS, "")
    workload, params = _workload(_require(raw, "workload", ""))
    search_space = _search_space(_require(raw, "search_space", ""))
    spec = SweepSpec(
        experiment=folder_name(_require(raw, "experiment", ""), "experiment"),
        workload=workload,
        params=params,
        search_space=search_space,
        effective_batch_size=_positive_int(_require(raw, "effective_batch_size", ""), "effective_batch_size"),
        stop=_stop(_require(raw, "stop", "")),
        num_samples=_positive_int(raw.get("num_samples", 1), "num_samples"),
        metric=_string(raw.get("metric", "eval_loss"), "metric"),
        mode=_one_of(raw.get("mode", "min"), ("min", "max"), "mode"),
        scheduler=_scheduler(raw.get("scheduler", "fifo")),
        resources=_resources(raw.get("resources", {})),
        memory=_memory(raw.get("memory", {})),
        storage_path=_string(raw.get("storage_path", "./orchestrator_results"), "storage_path"),
        tracking_uri=_optional_string(raw.get("tracking_uri"), "tracking_uri"),
        seed=_int(raw.get("seed", 0), "seed"),
        max_failures=_non_negative_int(raw.get("max_failures", 0), "max_failures"),
        reuse=_bool(raw.get("reuse", True), "reuse"),
        eval_every=_every(raw.get("eval_every", {"epochs": 1}), "eval_every"),
        checkpoint=_checkpoint(raw.get("checkpoint", {})),
        data=_data(raw.get("data", {})),
        schedule=None if raw.get("schedule") is None else _schedule(raw["schedule"]),
        max_grad_norm=None if raw.get("max_grad_norm") is None
        else _positive_number(raw["max_grad_norm"], "max_grad_norm"),
        raw=raw,
    )
    _check_scheduler_time(spec)
    _check_data_parallel(spec)
    _check_workload_parameters(spec)
    return spec


# -- sections -------------------------------------------------------------------------------


def _workload(value: Any) -> tuple[str, dict]:
    if isinstance(value, str):
        return _string(value, "workload"), {}
    section = _mapping(value, "workload")
    _no_unknown(section, {"name", "params"}, "workload")
    name = _string(_require(section, "name", "workload"), "workload.name")
    params = _mapping(section.get("params") or {}, "workload.params")
    return name, params


def _search_space(value: Any) -> dict[str, Domain | Any]:
    section = _mapping(value, "search_space")
    if not section:
        raise ConfigError("search_space: expected at least one hyper-parameter to search, got an empty mapping")
    return {str(key): _domain(val, f"search_space.{key}") for key, val in section.items()}


def _domain(value: Any, path: str) -> Domain | Any:
    """A constant, or a one-key mapping naming a Tune search primitive."""
    if not isinstance(value, dict):
        return value
    if len(value) != 1 or next(iter(value)) not in SEARCH_KINDS:
        raise ConfigError(
            f"{path}: expected a constant or one of {{{', '.join(k + ': ...' for k in SEARCH_KINDS)}}}, "
            f"got {value!r}"
        )
    kind, args = next(iter(value.items()))
    if kind in ("choice", "grid"):
        if not isinstance(args, list) or not args:
            raise ConfigError(f"{path}.{kind}: expected a non-empty list of values, got {args!r}")
        return Domain(kind, (tuple(args),))
    if not (isinstance(args, list) and len(args) == 2 and all(_is_number(a) for a in args)):
        raise ConfigError(f"{path}.{kind}: expected [low, high] (two numbers), got {args!r}")
    low, high = (float(a) for a in args)
    if not low < high:
        raise ConfigError(f"{path}.{kind}: expected low < high, got [{args[0]}, {args[1]}]")
    if kind == "loguniform" and low <= 0:
        raise ConfigError(f"{path}.loguniform: expected a positive low bound, got {args[0]}")
    if kind == "randint":
        if not all(isinstance(a, int) for a in args):
            raise ConfigError(f"{path}.randint: expected two integers [low, high), got {args!r}")
        return Domain(kind, (int(args[0]), int(args[1])))
    return Domain(kind, (low, high))


def _scheduler(value: Any) -> SchedulerSpec:
    if value is None or isinstance(value, str):
        kind = "fifo" if value in (None, "none") else value
        return SchedulerSpec(_one_of(kind, ("fifo", "asha"), "scheduler"))
    section = _mapping(value, "scheduler")
    _no_unknown(section, {"type", "grace_period", "reduction_factor", "time_attr"}, "scheduler")
    kind = section.get("type", "fifo")
    return SchedulerSpec(
        type=_one_of("fifo" if kind == "none" else kind, ("fifo", "asha"), "scheduler.type"),
        grace_period=_positive_int(section.get("grace_period", 1), "scheduler.grace_period"),
        reduction_factor=_positive_int(section.get("reduction_factor", 2), "scheduler.reduction_factor"),
        time_attr=_one_of(section.get("time_attr", "epoch"), ("epoch", "step"), "scheduler.time_attr"),
    )


def _check_scheduler_time(spec: SweepSpec) -> None:
    """ASHA's rungs need the budget in the unit they count."""
    if spec.scheduler.type != "asha":
        return
    unit = spec.scheduler.time_attr
    budget = spec.stop.epochs if unit == "epoch" else spec.stop.steps
    if budget is None:
        raise ConfigError(f"scheduler.time_attr: {unit} needs stop.{unit}s (ASHA's last rung), which is not set")


def _check_data_parallel(spec: SweepSpec) -> None:
    """A group's ranks share every optimizer step exactly, and agree on every milestone without a clock."""
    workers = spec.resources.workers
    rank_capacities = spec.memory.rank_capacities
    if rank_capacities and len(rank_capacities) != workers:
        raise ConfigError(
            f"memory.capacity: expected one capacity per worker (resources.workers: {workers}), got {len(rank_capacities)}"
        )
    if workers == 1:
        return
    batch = spec.effective_batch_size
    if batch % workers:
        below, above = batch - batch % workers, batch + workers - batch % workers
        fits = [n for n in range(workers - 1, 0, -1) if batch % n == 0][:1]
        raise ConfigError(
            f"effective_batch_size: {batch} does not split evenly over resources.workers: {workers}; "
            f"use {below or above} or {above}" + (f", or workers: {fits[0]}" if fits and fits[0] > 1 else "")
        )
    for path, every in (("eval_every", spec.eval_every), ("checkpoint.every", spec.checkpoint.every)):
        if every is not None and every.unit == "minutes":
            raise ConfigError(f"{path}: minutes are not supported with resources.workers > 1 (ranks' clocks differ); use steps or epochs")


def _stop(value: Any) -> Stop:
    section = _mapping(value, "stop")
    _no_unknown(section, {"epochs", "steps"}, "stop")
    if not section:
        raise ConfigError("stop: expected epochs, steps or both (training ends at whichever comes first)")
    return Stop(
        epochs=None if section.get("epochs") is None else _positive_int(section["epochs"], "stop.epochs"),
        steps=None if section.get("steps") is None else _positive_int(section["steps"], "stop.steps"),
    )


EVERY_UNITS = ("epochs", "steps", "minutes")


def _every(value: Any, path: str) -> Every:
    """``{steps: 500}``, ``{minutes: 10}`` or ``{epochs: 1}``; a bare number means steps."""
    if _is_number(value):
        value = {"steps": value}
    section = _mapping(value, path)
    if len(section) != 1 or next(iter(section)) not in EVERY_UNITS:
        raise ConfigError(f"{path}: expected one of {{steps: N}}, {{minutes: N}}, {{epochs: N}}, got {value!r}")
    unit, count = next(iter(section.items()))
    if unit == "minutes":
        return Every(unit, _positive_number(count, f"{path}.minutes"))
    return Every(unit, _positive_int(count, f"{path}.{unit}"))


def _checkpoint(value: Any) -> CheckpointPolicy:
    section = _mapping(value, "checkpoint")
    _no_unknown(section, {"every", "keep"}, "checkpoint")
    return CheckpointPolicy(
        every=None if section.get("every") is None else _every(section["every"], "checkpoint.every"),
        keep=_positive_int(section.get("keep", 2), "checkpoint.keep"),
    )


def _data(value: Any) -> DataLoading:
    section = _mapping(value, "data")
    _no_unknown(section, {f.name for f in dataclasses.fields(DataLoading)}, "data")
    workers = _non_negative_int(section.get("num_workers", 0), "data.num_workers")
    prefetch = section.get("prefetch_factor")
    persistent = _bool(section.get("persistent_workers", False), "data.persistent_workers")
    for key, given in (("prefetch_factor", prefetch is not None), ("persistent_workers", persistent)):
        if given and workers == 0:
            raise ConfigError(f"data.{key}: needs worker processes (data.num_workers > 0), got num_workers 0")
    pin = section.get("pin_memory")
    return DataLoading(
        num_workers=workers,
        pin_memory=None if pin is None else _bool(pin, "data.pin_memory"),
        prefetch_factor=None if prefetch is None else _positive_int(prefetch, "data.prefetch_factor"),
        persistent_workers=persistent,
    )


def _schedule(value: Any) -> LrSchedule:
    section = _mapping(value, "schedule")
    _no_unknown(section, {f.name for f in dataclasses.fields(LrSchedule)}, "schedule")
    final = section.get("final_lr", 0.0)
    if not _is_number(final) or not 0 <= final <= 1:
        raise ConfigError(f"schedule.final_lr: expected a fraction of lr in [0, 1], got {final!r}")
    return LrSchedule(
        warmup_steps=_non_negative_int(section.get("warmup_steps", 0), "schedule.warmup_steps"),
        decay=_one_of(section.get("decay", "constant"), LR_DECAYS, "schedule.decay"),
        final_lr=float(final),
    )


def _resources(value: Any) -> Resources:
    section = _mapping(value, "resources")
    _no_unknown(section, {"cpu", "gpu", "workers", "wait_minutes"}, "resources")
    cpu = _positive_number(section.get("cpu", 1), "resources.cpu")
    gpu = section.get("gpu", 0)
    workers = _positive_int(section.get("workers", 1), "resources.workers")
    if gpu != "auto":
        if not _is_number(gpu) or gpu < 0:
            raise ConfigError(f"resources.gpu: expected a GPU count, a fraction such as 0.25, or 'auto', got {gpu!r}")
        if gpu > 1 and gpu != int(gpu):
            raise ConfigError(f"resources.gpu: expected a whole number of GPUs above 1, got {gpu!r}")
    if workers > 1 and gpu not in (0, 1):
        raise ConfigError(
            f"resources.gpu: with resources.workers: {workers} each worker is one rank on one GPU; expected 0 or 1 "
            f"(per worker), got {gpu!r}"
        )
    return Resources(cpu=cpu, gpu=gpu, workers=workers,
                     wait_minutes=_non_negative_number(section.get("wait_minutes", 0), "resources.wait_minutes"))


MEMORY_KEYS = {f.name for f in dataclasses.fields(MemoryPolicy)} - {"rank_capacities"}


def _memory(value: Any) -> MemoryPolicy:
    section = _mapping(value, "memory")
    _no_unknown(section, MEMORY_KEYS, "memory")
    defaults = MemoryPolicy()

    def get(key):
        return section.get(key, getattr(defaults, key))

    budget = get("budget")
    capacity = get("capacity")
    rank_capacities: tuple[int, ...] = ()
    if isinstance(capacity, list):
        if not capacity:
            raise ConfigError("memory.capacity: expected a size, or a list of one size per worker, got []")
        rank_capacities = tuple(_size(c, f"memory.capacity[{i}]") for i, c in enumerate(capacity))
        capacity = min(rank_capacities)
    else:
        capacity = _size(capacity, "memory.capacity")
    policy = MemoryPolicy(
        device=_one_of(get("device"), DEVICES, "memory.device"),
        capacity=capacity,
        rank_capacities=rank_capacities,
        budget=None if budget in (None, "auto") else _size(budget, "memory.budget"),
        safety_margin=_fraction(get("safety_margin"), "memory.safety_margin"),
        estimator=_one_of(get("estimator"), (*estimator_names(), NO_ESTIMATE), "memory.estimator"),  # registered ones
        fragmentation=_non_negative_number(get("fragmentation"), "memory.fragmentation"),
        allocator_conf=_allocator_conf(get("allocator_conf")),
        max_oom_retries=_non_negative_int(get("max_oom_retries"), "memory.max_oom_retries"),
        gpu_granularity=_fraction(get("gpu_granularity"), "memory.gpu_granularity"),
        allow_activation_checkpointing=_bool(get("allow_activation_checkpointing"), "memory.allow_activation_checkpointing"),
        precision=_one_of(get("precision"), PRECISIONS, "memory.precision"),
        lower_precision=None if get("lower_precision") is None
        else _one_of(get("lower_precision"), PRECISIONS, "memory.lower_precision"),
    )
    if policy.device == "emulated" and policy.capacity is None:
        raise ConfigError("memory.capacity: memory.device 'emulated' needs a capacity, e.g. capacity: 8MiB")
    return policy


def _allocator_conf(value: Any) -> str | None:
    """``PYTORCH_CUDA_ALLOC_CONF`` for the trials, checked as PyTorch would check it (which only
    happens when a worker first touches CUDA, minutes into a sweep)."""
    from orchestrator.allocator_conf import parse_alloc_conf

    conf = _optional_string(value, "memory.allocator_conf")
    try:
        parse_alloc_conf(conf)
    except ValueError as exc:
        raise ConfigError(f"memory.allocator_conf: {exc}") from None
    return conf


def _check_workload_parameters(spec: SweepSpec) -> None:
    """Every parameter must belong to a workload of the sweep (catches typos such as ``widht``),
    every value a trial may get must fit the type each workload declares for it, and the
    sweep's metric must be one that every workload reports."""
    from trainables.workload import WorkloadNotFound, resolve_workload

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
                raise ConfigError(
                    f"{section}.{key}: not a parameter of workload {' or '.join(classes)} "
                    f"(expected one of: {', '.join(sorted(accepted - {'workload'}))})"
                )
            if key != "workload":
                _check_parameter_values(classes, f"{section}.{key}", key, value)
    for name, cls in classes.items():
        reported = ["train_loss", *(f"eval_{m}" for m in cls.metrics)]
        if spec.metric not in reported:
            raise ConfigError(f"metric: workload {name} does not report {spec.metric!r} (it reports: {', '.join(reported)})")
        if spec.schedule is not None and cls.overrides("build_scheduler"):
            raise ConfigError(
                f"schedule: workload {name} builds its own scheduler (build_scheduler); "
                "remove schedule from the sweep or build_scheduler from the workload"
            )


def _check_parameter_values(classes: dict, path: str, key: str, value: Domain | Any) -> None:
    if not isinstance(value, Domain):
        candidates = [(path, value, f"got {value!r}")]
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


# -- scalar checks --------------------------------------------------------------------------


def _require(section: dict, key: str, path: str) -> Any:
    if key not in section:
        where = f"{path}.{key}" if path else key
        raise ConfigError(f"{where}: required key is missing")
    return section[key]


def _no_unknown(section: dict, allowed: set[str], path: str) -> None:
    for key in section:
        if key not in allowed:
            where = f"{path}.{key}" if path else str(key)
            raise ConfigError(f"{where}: unknown key (expected one of: {', '.join(sorted(allowed))})")


def _mapping(value: Any, path: str) -> dict:
    if not isinstance(value, dict):
        raise ConfigError(f"{path}: expected a mapping, got {value!r}")
    return value


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _string(value: Any, path: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{path}: expected a non-empty string, got {value!r}")
    return value


def folder_name(value: Any, path: str) -> str:
    """A name that becomes one folder under the storage path (and an MLflow experiment name).

    A path separator or ``..`` would put the sweep's results somewhere else (``../../x``,
    ``/tmp/x``), so a name is a name: one path component, not hidden, printable.
    """
    name = _string(value, path)
    if any(c in name for c in "/\\") or ".." in name or name.startswith(".") or not name.isprintable():
        raise ConfigError(f"{path}: expected a name, not a path (no '/', '\\', '..' or leading '.'), got {name!r}")
    return name


def _optional_string(value: Any, path: str) -> str | None:
    return None if value is None else _string(value, path)


def _one_of(value: Any, allowed: tuple[str, ...], path: str) -> str:
    if value not in allowed:
        raise ConfigError(f"{path}: expected one of {', '.join(allowed)}, got {value!r}")
    return value


def _bool(value: Any, path: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{path}: expected true or false, got {value!r}")
    return value


def _int(value: Any, path: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(f"{path}: expected an integer, got {value!r}")
    return value


def _positive_int(value: Any, path: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{path}: expected a positive integer, got {value!r}")
    return value


def _non_negative_int(value: Any, path: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ConfigError(f"{path}: expected an integer >= 0, got {value!r}")
    return value


def _positive_number(value: Any, path: str) -> float:
    if not _is_number(value) or value <= 0:
        raise ConfigError(f"{path}: expected a positive number, got {value!r}")
    return float(value)


def _non_negative_number(value: Any, path: str) -> float:
    if not _is_number(value) or value < 0:
        raise ConfigError(f"{path}: expected a number >= 0, got {value!r}")
    return float(value)


def _fraction(value: Any, path: str) -> float:
    if not _is_number(value) or not 0 < value <= 1:
        raise ConfigError(f"{path}: expected a number in (0, 1], got {value!r}")
    return float(value)


def _size(value: Any, path: str) -> int | None:
    if value is None:
        return None
    try:
        return parse_bytes(value)
    except ValueError as exc:
        raise ConfigError(f"{path}: {exc}") from None
