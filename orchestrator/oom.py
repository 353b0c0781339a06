"""Out-of-memory failures as data: recognise them, record them, free what they held.

Every OOM becomes an :class:`OomEvent` (phase, epoch, step, batch sizes, bytes asked and in use)
that travels with the trial: in its checkpoints, its reports, MLflow and, when retries run out,
its error. An OOM is never silent.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import os
import re
from dataclasses import dataclass

import torch

#: Messages of allocation failures that do not come as ``torch.OutOfMemoryError``
#: (cuBLAS/cuDNN workspaces, the CUDA driver itself).
OOM_MESSAGES = re.compile(
    r"out of memory|CUBLAS_STATUS_ALLOC_FAILED|CUDNN_STATUS_ALLOC_FAILED|cudaErrorMemoryAllocation",
    re.IGNORECASE,
)
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


@dataclass(frozen=True)
class OomEvent:
    phase: str  # "train" | "eval"
    epoch: int  # 0-based epoch in which it happened
    step: int  # optimizer step (train) or eval batch index within that epoch
    micro_batch: int
    eval_batch: int
    bytes_requested: int | None
    bytes_allocated: int
    bytes_reserved: int | None
    message: str
    action: str = ""  # what was done about it: the reduction applied, or "gave up"
    rank: int | None = None  # in a data-parallel trial, the rank that ran out (the lowest, when several did)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "OomEvent":
        return cls(**data)


def release_memory() -> None:
    """After an OOM only: drop the failed step's garbage and hand cached blocks back to the device.

    ``empty_cache`` belongs here, once per OOM, and never in the training loop (one team made
    their epochs 3x slower by calling it every 10 batches).
    """
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class OomRetriesExhausted(RuntimeError):
    """The trial ran out of memory more often than ``memory.max_oom_retries`` allows.

    Its message lists every OOM event. It takes only that message so Ray can pickle it across
    processes (exceptions are rebuilt from their ``args``).
    """

    @classmethod
    def from_events(cls, events: list[OomEvent], reason: str) -> "OomRetriesExhausted":
        lines = [f"{reason}; {len(events)} OOM event(s):"]
        lines += [
            f"  epoch {e.epoch} {e.phase} step {e.step}{'' if e.rank is None else f' on rank {e.rank}'}: micro-batch {e.micro_batch}, eval batch "
            f"{e.eval_batch}, asked {e.bytes_requested} B with {e.bytes_allocated} B allocated -> {e.action}"
            for e in events
        ]
        return cls("\n".join(lines))


class PlanRefused(RuntimeError):
    """Not even micro-batch 1 fits the budget: the trial is refused before it starts."""


#: In the trial's folder on the storage path: the OOM event a trial is recovering from. Written
#: when the trial catches an OOM, before it releases the failed attempt and builds the next, and
#: removed once the recovery reports; a worker that dies in between (a CUDA context an OOM left
#: unusable) leaves it behind, which is how the driver knows that death was about memory.
OOM_EVIDENCE_FILE = "oom_before_death.json"


def storage_trial_folder() -> str | None:
    """This trial's folder on the storage path, from inside the trial; None where it is not a
    local (or shared) filesystem path the driver can read too."""
    import pyarrow.fs
    from ray import tune

    try:
        storage = tune.get_context().get_storage()
        if not isinstance(storage.storage_filesystem, pyarrow.fs.LocalFileSystem):
            return None
        return storage.trial_fs_path
    except Exception:  # noqa: BLE001 - evidence is best effort: without it a death keeps its plan
        return None


def write_oom_evidence(folder: str | None, event: OomEvent) -> None:
    if folder is None:
        return
    try:
        os.makedirs(folder, exist_ok=True)
        partial = os.path.join(folder, OOM_EVIDENCE_FILE + ".partial")
        with open(partial, "w") as f:
            json.dump(event.to_dict(), f)
        os.replace(partial, os.path.join(folder, OOM_EVIDENCE_FILE))
    except OSError:
        pass


def clear_oom_evidence(folder: str | None) -> None:
    if folder is not None:
        with contextlib.suppress(OSError):
            os.remove(os.path.join(folder, OOM_EVIDENCE_FILE))


def take_oom_evidence(folder: str | None) -> dict | None:
    """The OOM event a dead trial left behind, removed as it is read (a later death needs its own)."""
    if not folder:
        return None
    path = os.path.join(folder, OOM_EVIDENCE_FILE)
    try:
        with open(path) as f:
            event = json.load(f)
        os.remove(path)
        return event
    except (OSError, ValueError):
        return None
