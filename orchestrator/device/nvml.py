"""What NVML says about a GPU: name, total, free and used memory, and the CUDA context's cost.

NVML sees the whole device (every process, the context, other tenants), which PyTorch's
allocator statistics cannot. On a machine without an NVIDIA driver every query returns None.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass


@dataclass(frozen=True)
class GpuInfo:
    index: int
    name: str
    total: int
    free: int
    used: int


@functools.lru_cache(maxsize=1)
def _init() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
        return True
    except Exception:  # NVMLError_LibraryNotFound / DriverNotLoaded on machines with no GPU
        return False


def gpu_info(index: int = 0) -> GpuInfo | None:
    """Memory of GPU ``index`` as this process sees it (``CUDA_VISIBLE_DEVICES`` applied)."""
    if not _init():
        return None
    import os

    import pynvml

    try:
        handle = _handle(pynvml, visible_device(index, os.environ.get("CUDA_VISIBLE_DEVICES")))
        if handle is None:
            return None
        mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
        name = pynvml.nvmlDeviceGetName(handle)
    except Exception:
        return None
    return GpuInfo(index, _text(name), mem.total, mem.free, mem.used)


def visible_device(index: int, visible: str | None) -> int | str:
    """Which GPU this process's ``index`` is: NVML's index, or the UUID (or the unique start of
    one, which CUDA accepts) that ``CUDA_VISIBLE_DEVICES`` names it by. Ray writes indices; a
    scheduler or a user may write ``GPU-8932f937-...`` or ``MIG-...``."""
    ids = [v.strip() for v in (visible or "").split(",") if v.strip()]
    if index >= len(ids):
        return index
    return int(ids[index]) if ids[index].isdigit() else ids[index]


def _handle(pynvml, device: int | str):
    """NVML's handle of ``device`` (:func:`visible_device`); None for one it cannot name here
    (a MIG instance, whose memory is not its card's)."""
    if isinstance(device, int):
        return pynvml.nvmlDeviceGetHandleByIndex(device)
    if not device.startswith("GPU-"):
        return None
    for i in range(pynvml.nvmlDeviceGetCount()):
        handle = pynvml.nvmlDeviceGetHandleByIndex(i)
        if _text(pynvml.nvmlDeviceGetUUID(handle)).startswith(device):
            return handle
    return None


def _text(value: str | bytes) -> str:
    """An NVML string: ``bytes`` from older pynvml, ``str`` from newer."""
    return value.decode() if isinstance(value, bytes) else value


#: The CUDA context and library workspaces outside PyTorch's allocator (FACTS.md: ~0.5-0.6 GB
#: context, ~65 MiB cuBLAS); used where it cannot be measured.
DEFAULT_CUDA_CONTEXT_BYTES = 600 * 2**20


@functools.lru_cache(maxsize=None)
def cuda_context_bytes(index: int = 0) -> int:
    """Measured cost of this process's CUDA context: NVML used minus what the allocator reserved.

    Falls back to :data:`DEFAULT_CUDA_CONTEXT_BYTES` when there is no GPU to measure.
    """
    try:
        import torch

        if not torch.cuda.is_available():
            return DEFAULT_CUDA_CONTEXT_BYTES
        before = gpu_info(index)
        torch.cuda.init()
        torch.empty(1, device=f"cuda:{index}")
        after = gpu_info(index)
        if before is None or after is None:
            return DEFAULT_CUDA_CONTEXT_BYTES
        measured = after.used - before.used - torch.cuda.memory_reserved(index)
        return measured if measured > 0 else DEFAULT_CUDA_CONTEXT_BYTES
    except Exception:
        return DEFAULT_CUDA_CONTEXT_BYTES
