"""A real GPU: PyTorch's allocator statistics, NVML's view of the card, an optional memory cap."""

from __future__ import annotations

import contextlib

import torch

from orchestrator.device import nvml
from orchestrator.device.base import Device, MemoryReading


class CudaDevice(Device):
    """One GPU; ``memory_fraction`` caps this process's allocator (a trial's share of the card)."""

    kind = "cuda_allocator"
    target = "cuda"
    torch_type = "cuda"
    collective_backend = "nccl"
    pins_host_memory = True
    scales_fp16_loss = True

    def __init__(self, index: int = 0, memory_fraction: float | None = None):
        self.torch_device = torch.device(self.torch_type, index)
        self._fraction = memory_fraction
        total = torch.cuda.get_device_properties(self.torch_device).total_memory
        # Always set: a reused worker keeps the previous trial's cap otherwise.
        torch.cuda.set_per_process_memory_fraction(allocator_fraction(memory_fraction, total), index)

    @classmethod
    def open(cls, *, capacity: int | None = None, memory_fraction: float | None = None) -> Device:
        # A shared GPU's allocator is capped to the trial's share less its context: its growth can't OOM a neighbour.
        return cls(torch.cuda.current_device(), memory_fraction)

    def seed(self, seed: int) -> None:
        super().seed(seed)
        with torch.cuda.device(self.torch_device):
            torch.cuda.manual_seed(seed)

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

    def available(self, free_before_context: int | None) -> int | None:
        """The memory free before this trial started, within the card; a trial that shares the
        card (a memory fraction) counts on its share: its neighbours' use is theirs to cap."""
        capacity = self.capacity()
        if self._fraction is None and free_before_context is not None:
            return min(free_before_context, capacity)
        return capacity

    def card(self) -> nvml.GpuInfo | None:
        return nvml.gpu_info(self.torch_device.index or 0)

    def reading(self) -> MemoryReading:
        info = nvml.gpu_info(self.torch_device.index or 0)
        return MemoryReading(
            self.kind,
            torch.cuda.max_memory_allocated(self.torch_device),
            torch.cuda.max_memory_reserved(self.torch_device),
            device_used=info.used if info else None,
        )


def allocator_fraction(share: float | None, total: int, context: int = nvml.DEFAULT_CUDA_CONTEXT_BYTES) -> float:
    """The cap of a trial's caching allocator, as a fraction of the card's ``total`` bytes: its
    ``share`` of the card less its CUDA context. The share is a plan's peak, which counts the
    context; PyTorch's cap counts the allocator alone. Capped at the whole share, trials that
    share a card could together hold a context each more than it has, and one's growth would
    OOM a neighbour. The context is the figure plans count (``memory.profile``)."""
    if share is None:
        return 1.0
    return max(share - context / total, 0.0)


def gpu_visible() -> bool:
    """Whether this process sees a GPU PyTorch can use."""
    return torch.cuda.is_available()


def gpu_count() -> int:
    """The GPUs this process sees (as Ray detects them on a machine it starts on)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0
