"""What a trial's plan is made for: the kind of device and the bytes it may fill.

One rule, used by ``orchestrator plan``, by ``run`` before the Tuner starts, by a trial and by
every rank of a data-parallel group, so that ``plan`` shows the plan a trial will make:

* **device**: ``memory.device`` when it names one; ``auto`` is the CPU when the trial asks Ray for
  no GPU (``resources.gpu: 0``), else the accelerator (CUDA) -- on the driver, which plans for
  the workers, and in a worker that sees one (a worker without one trains on its CPU).
  ``plan --device-memory`` plans for a card of that size, the accelerator unless the config
  names a device sized by the config (the emulated one). Its plans count for the device class's
  ``target`` (a new device may count as an existing one: a capped CPU as ``emulated``).
* **budget**: the smaller of ``memory.budget`` and the device's capacity, either may be absent
  (None: unbounded, or for the worker to tell). The capacity is what the caller measured (a
  trial its open device; ``plan`` NVML), else ``memory.capacity`` (this rank's, when it gives
  one per rank) for a device sized by the config.
* **torch device type** (:func:`trains_on`): where a trial of that kind keeps its tensors
  (``cuda`` | ``cpu``), which a workload that picks its optimizer by device is told, by the trial
  and by the estimate made for the trial alike.
"""

from __future__ import annotations

from dataclasses import dataclass

from orchestrator.config import SweepSpec
from orchestrator.device_kinds import AUTO, accelerator, device_kind


@dataclass(frozen=True)
class Target:
    """What a trial trains on and plans for.

    ``device``: the registered kind a trial opens (``orchestrator.device_kinds``); ``kind``: what
    its plans count for, the estimators' target (cuda | cpu | emulated: its ``Device.target``);
    ``capacity``: the device's bytes where known; ``budget``: what the plan may fill before the
    safety margin (None: unbounded, or for the worker to tell).
    """

    device: str
    kind: str
    capacity: int | None
    budget: int | None


def resolve_target(
    spec: SweepSpec, *, rank: int | None = None, measured: int | None = None, gpu_here: bool | None = None,
    card: int | None = None,
) -> Target:
    """The target of a trial of ``spec`` (of its rank ``rank`` in a group).

    ``measured``: the capacity this process read off its device (None where it has none).
    ``gpu_here``: whether this process sees a GPU (None on the driver, which plans for the workers).
    ``card``: plan for a device of this many bytes (``plan --device-memory``).
    """
    policy = spec.memory
    setting = policy.device
    if card is not None:
        named = device_kind(setting) if setting != AUTO else None
        device = setting if named is not None and (named.accelerator or named.sized_by_config) else accelerator()
        return Target(device, _counts_as(device), card, _smaller(policy.budget, card))
    if setting == AUTO:
        wants_gpu = spec.resources.gpu not in (0, 0.0)
        device = accelerator() if wants_gpu and gpu_here is not False else "cpu"
    else:
        device = device_kind(setting).name
    capacity = measured
    if capacity is None and device_kind(device).sized_by_config:
        capacity = policy.capacity_of(rank) if rank is not None else policy.capacity
    return Target(device, _counts_as(device), capacity, _smaller(policy.budget, capacity))


def trains_on(kind: str) -> str:
    """The torch device type (``cuda`` | ``cpu``) a trial of the registered kind ``kind`` (a
    ``Target``'s ``device``, or its ``kind``: the estimators' target) keeps its tensors on:
    its ``Device`` class's ``torch_type``, so the estimate builds the optimizer the trial builds."""
    return device_kind(kind).device_class().torch_type


def _counts_as(device: str) -> str:
    return device_kind(device).device_class().target


def _smaller(budget: int | None, capacity: int | None) -> int | None:
    if budget is None or capacity is None:
        return capacity if budget is None else budget
    return min(budget, capacity)
