"""The contract between a model and the orchestrator.

A workload is everything the generic training loop, the memory estimators and the planner
need to know about one model: how to build it and its optimizer, where its data comes from, and
how to compute its loss. Hyper-parameters are dataclass fields, so a sweep's YAML can be checked
against them before anything starts, and a user's own model plugs in by subclassing
:class:`Workload` and naming it as ``my_package.my_module:MyWorkload``.
"""

from __future__ import annotations

import dataclasses
import importlib
import types
import typing
from typing import Any, ClassVar, Literal, Sequence

import torch
from torch import nn
from torch.utils.data import Dataset

#: A batch is whatever ``Dataset.__getitem__`` yields, collated: usually a tuple of tensors.
Batch = Any


@dataclasses.dataclass
class Workload:
    """Base class of every workload; subclasses add their hyper-parameters as fields.

    ``lr`` and ``optimizer`` live here because every workload has them and sweeps search them.
    Field annotations are checked against the sweep's values (:meth:`parameter_error`), so a
    subclass whose ``build_optimizer`` knows more optimizers redeclares ``optimizer``.
    """

    lr: float = 1e-3
    optimizer: Literal["sgd", "adam", "adamw"] = "adamw"
    seed: int = 0

    #: Whether :meth:`set_activation_checkpointing` does anything (the planner may then use it).
    supports_activation_checkpointing: ClassVar[bool] = False

    # -- what a subclass must provide ---------------------------------------------------------
    def build_model(self) -> nn.Module:
        raise NotImplementedError

    def train_data(self) -> Dataset:
        raise NotImplementedError

    def eval_data(self) -> Dataset:
        raise NotImplementedError

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        """Mean loss over the batch (the loop rescales it for gradient accumulation)."""
        raise NotImplementedError

    # -- what a subclass may override ---------------------------------------------------------
    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        params = [p for p in model.parameters() if p.requires_grad]
        if self.optimizer == "sgd":
            return torch.optim.SGD(params, lr=self.lr, momentum=0.9)
        if self.optimizer == "adam":
            return torch.optim.Adam(params, lr=self.lr)
        if self.optimizer == "adamw":
            return torch.optim.AdamW(params, lr=self.lr)
        raise ValueError(f"optimizer: expected one of sgd, adam, adamw, got {self.optimizer!r}")

    def activation_schedule(self) -> dict[str, int]:
        """Epoch at which each optional module switches on (none by default).

        The estimators take a profile of every stage, so a module that appears at epoch 3 is
        planned for from epoch 0 instead of crashing the trial when it arrives.
        """
        return {}

    def set_epoch(self, model: nn.Module, epoch: int) -> None:
        """Switch on the modules of :meth:`activation_schedule` whose epoch has come.

        The default calls ``model.set_active(name, bool)`` for each scheduled module, which is
        what the built-in staged workload implements; override for other mechanisms.
        """
        for name, start in self.activation_schedule().items():
            model.set_active(name, epoch >= start)

    def set_activation_checkpointing(self, model: nn.Module, enabled: bool) -> None:
        if enabled:
            raise NotImplementedError(f"{type(self).__name__} does not support activation checkpointing")

    def stage_epochs(self) -> list[int]:
        """First epoch of every distinct module-activation stage (0 included)."""
        return sorted({0, *self.activation_schedule().values()})

    @classmethod
    def parameter_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def parameter_error(cls, name: str, value: Any) -> str | None:
        """What ``value`` should have been for the hyper-parameter ``name``; None when it fits.

        Read from the field's annotation (``int``, ``float``, ``str``, ``bool``, ``Literal[...]``,
        unions of those), so ``lr: fast`` in a sweep fails before Ray starts instead of in every
        trial. Annotations this does not know are not checked.
        """
        try:
            hints = typing.get_type_hints(cls)
        except Exception:  # a user's annotation that does not resolve: nothing to check against
            return None
        return None if name not in hints else _mismatch(hints[name], value)


def _mismatch(annotation: Any, value: Any) -> str | None:
    origin = typing.get_origin(annotation)
    if origin is Literal:
        options = typing.get_args(annotation)
        return None if value in options else "one of " + ", ".join(map(str, options))
    if origin in (typing.Union, types.UnionType):
        wanted = [_mismatch(arg, value) for arg in typing.get_args(annotation)]
        return None if None in wanted else " or ".join(w for w in wanted if w)
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    checks = {
        bool: (isinstance(value, bool), "true or false"),
        int: (is_number and isinstance(value, int), "an integer"),
        float: (is_number, "a number"),
        str: (isinstance(value, str), "a string"),
        type(None): (value is None, "null"),
    }
    fits, expected = checks.get(annotation, (True, ""))
    return None if fits else expected


BUILTIN_WORKLOADS: dict[str, str] = {
    "mlp": "trainables.mlp:MLPWorkload",
    "cnn": "trainables.cnn:CNNWorkload",
    "staged_mlp": "trainables.staged:StagedMLPWorkload",
}


class WorkloadNotFound(ValueError):
    pass


def resolve_workload(name: str) -> type[Workload]:
    """A built-in name or ``package.module:Class`` -> the workload class."""
    target = BUILTIN_WORKLOADS.get(name, name)
    if ":" not in target:
        raise WorkloadNotFound(
            f"unknown workload {name!r}: expected one of {', '.join(sorted(BUILTIN_WORKLOADS))} "
            "or an import path 'package.module:Class'"
        )
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise WorkloadNotFound(f"workload {name!r}: cannot import module {module_name!r} ({exc})") from None
    cls = getattr(module, attr, None)
    if not (isinstance(cls, type) and issubclass(cls, Workload)):
        raise WorkloadNotFound(f"workload {name!r}: {target} is not a subclass of trainables.Workload")
    return cls


def build_workload(config: dict[str, Any]) -> Workload:
    """A trial's config (``workload`` plus hyper-parameters) -> the workload instance.

    Keys that are not fields of the workload are ignored here: a sweep over two workloads may
    carry hyper-parameters that only one of them has (the config layer already checked each key
    belongs to at least one workload of the sweep).
    """
    cls = resolve_workload(config["workload"])
    names = set(cls.parameter_names())
    return cls(**{k: v for k, v in config.items() if k in names})


def to_device(batch: Batch, device: torch.device) -> Batch:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch


def take(dataset: Dataset, indices: Sequence[int]) -> Batch:
    """Collate ``dataset[i] for i in indices`` the way a DataLoader would."""
    from torch.utils.data import TensorDataset, default_collate

    if isinstance(dataset, TensorDataset):  # one gather per tensor instead of one per sample
        index = torch.as_tensor(indices, dtype=torch.long)
        return tuple(t[index] for t in dataset.tensors)
    return default_collate([dataset[i] for i in indices])
