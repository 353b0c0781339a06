"""Where a trial's tensors live and how their memory is measured.

Three backends share one small contract (:class:`Device`): the real CUDA device, whose
allocator keeps the statistics we report; the CPU, where we count live tensor bytes ourselves
(honestly labelled: that is not what a GPU would reserve); and an *emulated* device, the CPU
tracker with a capacity that raises a real ``torch.OutOfMemoryError`` when a step's tensors
would not fit. The emulated device is the test double of the CUDA one: the whole OOM path
(catch, free, shrink, resume, record) runs for real on a machine without a GPU.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from typing import Callable, Iterable

import torch
from orchestrator.allocator_conf import ALLOC_CONF_VARIABLES
from orchestrator.device.tensor_tracker import StorageTracker
from orchestrator.device.torch_internals import disable_current_modes, tree_leaves
from orchestrator.units import human

#: How tables and plots name each kind of reading (``MemoryReading.source``).
MEMORY_LABELS = {"cuda_allocator": "reserved", "cpu_tensor_tracker": "tensor bytes", "emulated": "emulated"}

#: The CPU measures the first steps of every report window, then one step per this many seconds.
CPU_SAMPLED_STEPS = 2
CPU_SAMPLE_EVERY_S = 1.0



@dataclass(frozen=True)
class MemoryReading:
    """Peak memory of one window (an epoch, a probe step).

    ``source`` says what was measured: ``cuda_allocator`` (PyTorch's allocator statistics),
    ``cpu_tensor_tracker`` (live tensor bytes counted on the CPU) or ``emulated`` (the same
    count, against an emulated capacity). ``peak_reserved`` is None where no allocator reserves.
    """

    source: str
    peak_allocated: int
    peak_reserved: int | None
    device_used: int | None = None  # NVML's view of the whole GPU, when there is one

    @property
    def fragmentation(self) -> float | None:
        if self.peak_reserved is None or self.peak_allocated == 0:
            return None
        return self.peak_reserved / self.peak_allocated


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


class Device:
    """Contract: a torch device plus a way to measure the peak memory of a window of work.

    Use as ``with device.measuring(): ...`` around the work (a trial keeps it open for its
    whole life, so the emulated device counts every byte at every moment),
    ``device.reset_peak()`` at the start of a window and ``device.reading()`` at its end.
    ``track`` registers state that was created before measuring began (a no-op where the
    allocator sees everything anyway). Host-side work, loading and collating data, runs
    inside ``with device.host():``, and a batch becomes device memory through ``admit``
    when a step takes it (on a GPU, the step's copy to the device does that). Each train step
    and eval batch runs inside ``with device.step(phase, state):``, where a device that measures only
    some steps (the CPU) decides which.
    """

    kind: str  # what a reading measured: cuda_allocator | cpu_tensor_tracker | emulated
    target: str  # what plans for this device count: cuda | cpu | emulated
    torch_device: torch.device

    def measuring(self):
        raise NotImplementedError

    def track(self, tensors: Iterable[torch.Tensor]) -> None:
        raise NotImplementedError

    def host(self):
        """Work whose tensors live in host memory, not on this device."""
        return contextlib.nullcontext()

    def admit(self, batch):
        """``batch``, now counted as this device's memory until it is dropped."""
        return batch

    def step(self, phase: str, state: Callable[[], Iterable[torch.Tensor]]):
        """One train step or eval batch (``phase``: train | eval); ``state`` gives the tensors
        that outlive steps (weights, optimizer state), for a device that did not see them made."""
        return contextlib.nullcontext()

    def reset_peak(self) -> None:
        raise NotImplementedError

    def reading(self) -> MemoryReading:
        raise NotImplementedError

    def allocated(self) -> int:
        raise NotImplementedError

    def reserved(self) -> int | None:
        return None

    def capacity(self) -> int | None:
        """Memory the trial may use on this device, or None where that has no meaning (CPU)."""
        return None


class CpuDevice(Device):
    """The CPU: peak = the most tensor bytes alive at once (not process RSS, not a GPU figure).

    Counting runs every op through a Python dispatch mode, about 1 ms a step for a small MLP,
    which would make a CPU trial 2-3x slower than a plain loop (``bench/sweep_overhead.py
    --long``). So a trial's steps are sampled: the first ``CPU_SAMPLED_STEPS`` train steps and
    eval batches of each report window (the first step creates the optimizer's state), then one
    every ``CPU_SAMPLE_EVERY_S``; the others run with the tracker off and admit nothing. A step's
    tensors are temporaries, so a sampled step peaks as any step of its shape does; batches of
    varying shape may peak between samples.
    """

    kind = "cpu_tensor_tracker"
    target = "cpu"

    def __init__(self, capacity: int | None = None):
        self.torch_device = torch.device("cpu")
        self.tracker = CapacityTracker(capacity) if capacity is not None else StorageTracker("cpu")
        self._window_samples: dict[str, int] = {}  # steps measured per phase since the last reset_peak
        self._last_sample = -float("inf")
        self._measuring_step = True  # False inside a step that is not sampled

    def measuring(self):
        return self.tracker

    def track(self, tensors):
        self.tracker.track(tensors)

    def host(self):
        # Host and device are one memory here: what is made outside the tracker is not counted.
        return disable_current_modes()

    def admit(self, batch):
        if self._measuring_step:
            self.tracker.track(t for t in tree_leaves(batch) if isinstance(t, torch.Tensor))
        return batch

    @contextlib.contextmanager
    def step(self, phase, state):
        now = time.monotonic()
        sampled = self._window_samples.get(phase, 0)
        if sampled < CPU_SAMPLED_STEPS or now - self._last_sample >= CPU_SAMPLE_EVERY_S:
            self._window_samples[phase] = sampled + 1
            self._last_sample = now
            self.tracker.track(state())  # what earlier, unmeasured steps made and kept
            yield
            return
        self._measuring_step = False
        try:
            with disable_current_modes():
                yield
        finally:
            self._measuring_step = True

    def reset_peak(self):
        self.tracker.reset_peak()
        self._window_samples.clear()

    def allocated(self) -> int:
        return self.tracker.allocated

    def reading(self) -> MemoryReading:
        return MemoryReading(self.kind, self.tracker.peak, None)


class EmulatedDevice(CpuDevice):
    """A small GPU emulated on the CPU: tracked tensor bytes may not pass ``capacity``.

    Every step is measured, as a GPU's allocator sees every one: an OOM may come at any.
    """

    kind = "emulated"
    target = "emulated"

    def __init__(self, capacity: int):
        super().__init__(capacity)

    def step(self, phase, state):
        return contextlib.nullcontext()

    def capacity(self) -> int | None:
        return self.tracker.capacity


class CudaDevice(Device):
    """A real GPU: PyTorch's allocator statistics, NVML's device view, an optional memory cap."""

    kind = "cuda_allocator"
    target = "cuda"

    def __init__(self, index: int = 0, memory_fraction: float | None = None):
        self.torch_device = torch.device("cuda", index)
        # Always set: a reused worker keeps the previous trial's cap otherwise.
        torch.cuda.set_per_process_memory_fraction(1.0 if memory_fraction is None else memory_fraction, index)
        self._fraction = memory_fraction

    def measuring(self):
        return contextlib.nullcontext()

    def track(self, tensors):
        return None

    def reset_peak(self):
        torch.cuda.reset_peak_memory_stats(self.torch_device)

    def allocated(self) -> int:
        return torch.cuda.memory_allocated(self.torch_device)

    def reserved(self) -> int | None:
        return torch.cuda.memory_reserved(self.torch_device)

    def capacity(self) -> int | None:
        total = torch.cuda.get_device_properties(self.torch_device).total_memory
        return int(total * self._fraction) if self._fraction is not None else total

    def reading(self) -> MemoryReading:
        from orchestrator.device import nvml
        info = nvml.gpu_info(self.torch_device.index or 0)
        return MemoryReading(
            self.kind,
            torch.cuda.max_memory_allocated(self.torch_device),
            torch.cuda.max_memory_reserved(self.torch_device),
            device_used=info.used if info else None,
        )


def configure_allocator(alloc_conf: str | None) -> None:
    """Set ``PYTORCH_CUDA_ALLOC_CONF`` before CUDA initialises (it is read once, at first use).

    A value the user already exported wins: they may know their model better than our default.
    """
    if alloc_conf and not any(v in os.environ for v in ALLOC_CONF_VARIABLES):
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = alloc_conf


def open_device(kind: str, *, capacity: int | None = None, memory_fraction: float | None = None) -> Device:
    """``memory.device`` of the config -> a Device. ``auto`` is CUDA when PyTorch sees a GPU."""
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "cuda":
        return CudaDevice(torch.cuda.current_device(), memory_fraction)
    if kind == "emulated":
        if capacity is None:
            raise ValueError("memory.device: emulated needs memory.capacity")
        return EmulatedDevice(capacity)
    return CpuDevice()
