"""The contract every device meets (:class:`Device`), and what it reads (:class:`MemoryReading`).

The backends are one module each (``cpu``, ``emulated``, ``cuda``), registered by name in
``orchestrator.device_kinds``; nothing outside this package asks which one it holds.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from orchestrator.device.nvml import GpuInfo


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
    def peak(self) -> int:
        """The peak a plan's prediction is compared with: the allocator's reserved bytes where an
        allocator reserves (a GPU), the tensor bytes where only those exist (CPU, emulated)."""
        return self.peak_reserved if self.peak_reserved is not None else self.peak_allocated

    def merged(self, other: MemoryReading) -> MemoryReading:
        """The peak of two windows of the same device, one after the other."""
        def most(a, b):
            return b if a is None else a if b is None else max(a, b)

        return MemoryReading(self.source, max(self.peak_allocated, other.peak_allocated),
                             most(self.peak_reserved, other.peak_reserved), most(self.device_used, other.device_used))

    @property
    def fragmentation(self) -> float | None:
        if self.peak_reserved is None or self.peak_allocated == 0:
            return None
        return self.peak_reserved / self.peak_allocated


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
    target: str  # what plans for this device count: its registered kind (orchestrator.device_kinds)
    #: The torch device type its tensors live on (``cuda`` | ``cpu``): what a workload that picks
    #: its optimizer by device is told (``Workload.build_optimizer``), by the trial and by the
    #: estimate made for it (``target.trains_on``).
    torch_type: str
    torch_device: torch.device
    #: ``torch.distributed``'s backend for a data-parallel group of such devices
    collective_backend = "gloo"
    #: Batches are collated into pinned host memory, for an asynchronous copy to the device.
    pins_host_memory = False
    #: fp16 on this device needs loss scaling (``torch.amp.GradScaler``) to keep small gradients.
    scales_fp16_loss = False

    @classmethod
    def open(cls, *, capacity: int | None = None, memory_fraction: float | None = None) -> Device:
        """A device of this class for a trial: ``capacity`` for one sized by the config,
        ``memory_fraction`` for a share of a GPU; a class ignores what it has no use for."""
        return cls()

    def seed(self, seed: int) -> None:
        """Seed the random generators a step draws from: the CPU's (dropout on the CPU,
        augmentation in the main process) and the device's own, where it has one.

        Not ``torch.manual_seed``, which also seeds every other backend and, while CUDA is not
        initialised (every CPU trial), formats the Python stack to queue a seed for later: 1-5 ms
        per call, once per optimizer step (``bench/loop_throughput.py``).
        """
        torch.default_generator.manual_seed(seed)

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

    def card(self) -> GpuInfo | None:
        """What NVML says of this device (name, total memory), where it is a GPU NVML sees."""
        return None

    def available(self, free_before_context: int | None) -> int | None:
        """What a plan may count on: the capacity, or less where the device is shared and
        ``free_before_context`` (NVML's free bytes before this process's context) says so."""
        return self.capacity()
