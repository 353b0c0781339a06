"""Out-of-memory failures on a device: recognise one, read what it asked for, free what it held.

Every OOM then becomes an :class:`orchestrator.contract.OomEvent` that travels with the trial
(``orchestrator.trial``): an OOM is never silent.
"""

from __future__ import annotations

import gc
import re

import torch

from orchestrator.contract import OOM_MESSAGES
from orchestrator.device.torch_internals import clear_cublas_workspaces

_TRIED = re.compile(r"Tried to allocate ([0-9.]+) ?(B|KiB|MiB|GiB|TiB)")
_UNIT = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


def is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or (
        isinstance(exc, RuntimeError) and bool(OOM_MESSAGES.search(str(exc)))
    )


def bytes_requested(message: str) -> int | None:
    """The size in "Tried to allocate 6.36 GiB", as PyTorch (and our emulated device) word it."""
    match = _TRIED.search(message)
    return int(float(match.group(1)) * _UNIT[match.group(2)]) if match else None


def release(collect: bool = True) -> None:
    """After an OOM (or a probe, or before a reused worker's next trial) only: drop the failed
    work's garbage and hand the allocator's cached blocks back to the device.

    The one place that frees memory this way. ``empty_cache`` belongs here, once per OOM, and
    never in the training loop (one team made their epochs 3x slower by calling it every 10
    batches); it does nothing where CUDA was never initialised. ``collect=False`` skips the
    garbage collection where no tensor is left for it to free (a reused worker whose last trial
    left nothing allocated): a full collection costs a process that imported torch a few
    hundred milliseconds.
    """
    if collect:
        gc.collect()
    if torch.cuda.is_initialized():
        clear_cublas_workspaces()  # made again at cuBLAS's next call; empty_cache cannot free them in use
        torch.cuda.empty_cache()
