"""Where a trial's tensors live and how their memory is measured.

Three backends share one small contract (:class:`Device`, ``base``), one module each: the real
CUDA device (``cuda``), whose allocator keeps the statistics we report; the CPU (``cpu``), where
we count live tensor bytes ourselves; and an *emulated* device (``emulated``), the CPU tracker
with a capacity that raises a real ``torch.OutOfMemoryError``, the test double of the CUDA one.
Each is registered by name in ``orchestrator.device_kinds`` (``memory.device``); what a trial
plans for is ``target`` (``resolve_target``); after an OOM, ``release``; the tensors a trainer
holds between steps, ``state_tensors``.
"""

from __future__ import annotations

import os

from orchestrator.allocator_conf import ALLOC_CONF_VARIABLES
from orchestrator.device.base import Device, MemoryReading
from orchestrator.device.cpu import CpuDevice
from orchestrator.device.cuda import CudaDevice, gpu_count, gpu_visible
from orchestrator.device.emulated import EmulatedDevice
from orchestrator.device.oom import release
from orchestrator.device.tensor_tracker import state_tensors
from orchestrator.device_kinds import AUTO, accelerator, device_kind

__all__ = ["CpuDevice", "CudaDevice", "Device", "EmulatedDevice", "MemoryReading", "configure_allocator",
           "gpu_count", "gpu_visible", "open_device", "release", "state_tensors"]


def configure_allocator(alloc_conf: str | None) -> None:
    """Set ``PYTORCH_CUDA_ALLOC_CONF`` before CUDA initialises (it is read once, at first use).

    A value the user already exported wins: they may know their model better than our default.
    The ``backend`` is read earlier, when torch is imported: the workers start with it
    (``allocator_conf.import_time_environment``), so it is already set here.
    """
    if alloc_conf and not any(v in os.environ for v in ALLOC_CONF_VARIABLES):
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = alloc_conf


def open_device(kind: str, *, capacity: int | None = None, memory_fraction: float | None = None) -> Device:
    """A registered device kind (``orchestrator.device_kinds``) -> a Device. ``auto`` is the
    accelerator when PyTorch sees a GPU, else the CPU."""
    if kind == AUTO:
        kind = accelerator() if gpu_visible() else "cpu"
    return device_kind(kind).device_class().open(capacity=capacity, memory_fraction=memory_fraction)
