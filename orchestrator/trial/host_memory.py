"""A DataLoader worker lost to host memory: recorded, and the trial goes on with fewer workers.

Each DataLoader worker is a process of its own, holding its own copy of whatever of the dataset
it touched, its prefetched batches and (on a GPU) pinned buffers. When a node's host memory runs
out, the kernel's OOM killer picks the largest process, often such a worker, and torch reports
``DataLoader worker (pid(s) ...) exited unexpectedly`` (or ``... is killed by signal``); a worker
bounded in its address space raises a ``MemoryError`` instead. Neither is a bug in the trial,
nor a reason to fail it: like a GPU OOM, it is an event (:class:`~orchestrator.contract.HostMemoryEvent`,
in the checkpoint, the reports, the console and MLflow), and the trial goes back to its last
checkpoint with half the loader workers (none, at the last), so it holds less host memory.

In a data-parallel group the rank that lost the worker passes it to the group's agreement
(``trainables.distributed``), and every rank raises the same :class:`GroupLostLoaderWorker`, so
the whole group goes back to the checkpoint with fewer workers, in step; rank 0 reports it.

The optimisation does not change: the sampler runs in the trial's process and decides which
samples form each step whatever the number of workers (``trainables.data``), and DataLoader
hands batches over in the sampler's order.
"""

from __future__ import annotations

from dataclasses import replace

from orchestrator.config import DataLoading
from trainables.distributed import GroupLostLoaderWorker

#: How torch names a DataLoader worker that is gone: its timeout check, and its SIGCHLD handler.
_WORKER_DIED = ("DataLoader worker (pid",)
_WORKER_OUT_OF_MEMORY = "Caught MemoryError in DataLoader worker"
#: Where a batch is taken from the loader workers; an error raised through it came from them.
_LOADER_FILE = "torch/utils/data/dataloader.py"


def host_memory_failure(exc: BaseException) -> str | None:
    """The failure's line when it is a DataLoader worker lost to host memory, else None."""
    text = str(exc)
    first = text.strip().splitlines()[0] if text.strip() else ""
    if isinstance(exc, GroupLostLoaderWorker):  # a rank's, agreed on by the group: "rank 1: DataLoader worker ..."
        return first
    if isinstance(exc, RuntimeError) and first.startswith(_WORKER_DIED):
        return first.rstrip(". ")
    if isinstance(exc, (ConnectionError, EOFError)) and _raised_reading_a_loader_worker(exc):
        # A worker killed while the trial took a batch from it: the batch's shared memory is
        # handed over through a connection to that worker, which its death cut.
        return f"a DataLoader worker's connection was cut ({type(exc).__name__}: {first or 'end of file'})"
    if isinstance(exc, MemoryError) and _WORKER_OUT_OF_MEMORY in first:
        return first.rstrip(". ")
    return None  # a MemoryError of the trial's own process is the device's OOM on a CPU (device.oom)


def _raised_reading_a_loader_worker(exc: BaseException) -> bool:
    frames, tb = [], exc.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame.f_code.co_filename.replace("\\", "/"))
        tb = tb.tb_next
    return any(f.endswith(_LOADER_FILE) for f in frames)


def fewer_workers(data: DataLoading) -> DataLoading | None:
    """Half the loader workers (none, from one); None when the trial already loads in its own process."""
    if data.num_workers == 0:
        return None
    workers = data.num_workers // 2
    if workers == 0:  # the settings of workers mean nothing without them (config.DataLoading)
        return replace(data, num_workers=0, prefetch_factor=None, persistent_workers=False)
    return replace(data, num_workers=workers)
