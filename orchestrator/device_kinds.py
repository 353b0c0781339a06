"""The registry of device kinds: what each value of ``memory.device`` names.

A kind is a name, the :class:`orchestrator.device.Device` class that opens it and the two facts
the code above the device needs before one is open: whether Ray schedules it as a GPU
(``resources.gpu``), and whether its size comes from the config (``memory.capacity``). This
module imports neither torch nor Ray, so the config can check a name against it; the class is
named by ``"module:Class"`` and imported only where a device is opened.

A new device is one new module (its ``Device`` subclass, under ``orchestrator/device/``) plus one
:func:`register_device` line below (docs/ARCHITECTURE.md, "How to add a device").
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

#: ``memory.device: auto``: the accelerator when a trial asks Ray for a GPU and one is there.
AUTO = "auto"


@dataclass(frozen=True)
class DeviceKind:
    """One kind of device a trial can train on.

    ``device``: the ``Device`` subclass, or ``"module:Class"`` where importing it would load torch
    too early. ``accelerator``: Ray schedules it as a GPU, and ``memory.device: auto`` picks it for
    a trial with ``resources.gpu`` above 0. ``sized_by_config``: its capacity is
    ``memory.capacity`` (required), not something the machine tells.
    """

    name: str
    device: Any
    accelerator: bool = False
    sized_by_config: bool = False

    def device_class(self) -> type:
        if not isinstance(self.device, str):
            return self.device
        module, _, name = self.device.partition(":")
        return getattr(importlib.import_module(module), name)


KINDS: dict[str, DeviceKind] = {}


def register_device(kind: DeviceKind) -> DeviceKind:
    """Add (or replace) a kind; ``memory.device`` accepts its name from now on, in this process."""
    if kind.name == AUTO:
        raise ValueError(f"{AUTO!r} is not a device kind: it chooses one")
    KINDS[kind.name] = kind
    return kind


def device_kind(name: str) -> DeviceKind:
    try:
        return KINDS[name]
    except KeyError:
        raise ValueError(f"memory.device: expected one of {', '.join(device_names())}, got {name!r}") from None


def device_names() -> tuple[str, ...]:
    """What ``memory.device`` accepts: ``auto``, then every registered kind."""
    return (AUTO, *KINDS)


def accelerator() -> str:
    """The kind ``auto`` picks for a trial that asks for a GPU: the first accelerator registered."""
    return next(k.name for k in KINDS.values() if k.accelerator)


register_device(DeviceKind("cuda", "orchestrator.device.cuda:CudaDevice", accelerator=True))
register_device(DeviceKind("cpu", "orchestrator.device.cpu:CpuDevice"))
register_device(DeviceKind("emulated", "orchestrator.device.emulated:EmulatedDevice", sized_by_config=True))
