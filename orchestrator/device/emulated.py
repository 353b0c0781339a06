"""A small GPU emulated on the CPU: the test double of the CUDA device.

The CPU's tensor tracker with a capacity that raises a real ``torch.OutOfMemoryError`` when a
step's tensors would not fit, so the whole OOM path (catch, free, shrink, resume, record) runs
for real on a machine without a GPU.
"""

from __future__ import annotations

import contextlib

import torch

from orchestrator.device.base import Device
from orchestrator.device.cpu import CpuDevice
from orchestrator.device.tensor_tracker import StorageTracker
from orchestrator.units import human


class CapacityTracker(StorageTracker):
    """The CPU tensor tracker with a capacity: an allocation past it raises
    ``torch.OutOfMemoryError`` with the facts a CUDA OOM message carries."""

    def __init__(self, capacity: int):
        super().__init__("cpu")
        self.capacity = capacity

    def admit(self, size: int) -> None:
        if self.allocated + size > self.capacity:
            free = max(self.capacity - self.allocated, 0)
            raise torch.OutOfMemoryError(
                f"CUDA out of memory (emulated device). Tried to allocate {human(size)}. "
                f"Emulated device has a total capacity of {human(self.capacity)} of which "
                f"{human(free)} is free. Of the allocated memory {human(self.allocated)} is "
                f"allocated by PyTorch."
            )


class EmulatedDevice(CpuDevice):
    """A small GPU emulated on the CPU: tracked tensor bytes may not pass ``capacity``.

    Every step is measured, as a GPU's allocator sees every one: an OOM may come at any.
    """

    kind = "emulated"
    target = "emulated"

    def __init__(self, capacity: int):
        super().__init__(CapacityTracker(capacity))

    @classmethod
    def open(cls, *, capacity: int | None = None, memory_fraction: float | None = None) -> Device:
        if capacity is None:
            raise ValueError("memory.device: emulated needs memory.capacity")
        return cls(capacity)

    def step(self, phase, state):
        return contextlib.nullcontext()

    def capacity(self) -> int | None:
        return self.tracker.capacity
