"""Actor reuse: one Tune worker runs trial after trial.

Starting a worker costs seconds (a Ray actor, ``import torch``, the user's module, and on the
CPU the tensor tracker's first dispatch mode importing ``torch._dynamo``), which is most of a
short trial, and a hyper-parameter search is mostly short trials. Tune's ``reuse_actors`` hands a
finished trial's worker to the next trial that asks for the same resources; it never reuses the
worker of a trial that failed (its actor is stopped, not cached).

What a trial sets for itself, so that it does not matter which trials its worker ran before:
its device (with its GPU share as the per-process memory fraction, or the whole card), peak
statistics reset at its start, and its GPU budget: the previous trial's cached blocks go back
to the device first (``orchestrator.device.release``), and the budget is what is free then plus this
process's own CUDA context, which the plan counts itself. A trial that recovered from an OOM
leaves nothing cached behind it either; tensors that outlive a trial (a workload's module-level
cache) stay allocated and shrink the next trial's budget instead of overflowing it.
Each trial reports what the one before it still held on the device when it started
(``left_behind_bytes``, after collecting reference cycles where something was still held: 0
unless something outlived its trial), so a leak shows in the trial that pays for it.

Tune 2.60 offers no way for a worker to decline reuse: a ``reset_config`` that returns False
fails the trial it was handed (``TuneController._on_trial_reset``), so the worker makes itself
fit for the next trial rather than refusing it.

The allocator configuration is read once per process, at CUDA's first use; it is a sweep-wide
setting (``memory.allocator_conf``) and Tune never shares a worker between sweeps, so it cannot
change under a reused worker. A workload's module is imported once per worker: module-level
state (caches, counters, a global RNG seeded at import) is shared by the trials a worker runs.
Everything a trial needs belongs in the workload instance, or ``reuse: false`` in the sweep file
gives every trial a fresh process.

Reuse also moves trials: Tune hands a pending trial to a worker that has just finished rather
than wait for the worker it was starting for it, on whatever node (it cancels that start). Short
trials on a cluster can therefore all run on the nodes whose workers started first.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import Any

from orchestrator.device.torch_internals import clear_cublas_workspaces


@dataclass
class WorkerHistory:
    """What this worker process keeps from the trials it ran."""

    #: GPU memory this process holds outside PyTorch's allocator (its CUDA context), measured
    #: when its first trial ends
    cuda_context_bytes: int | None = None
    #: The device (``orchestrator.device.Device``) of the last trial this worker ran: its counter
    #: (the CPU's tensor tracker, CUDA's allocator) says what that trial still holds
    last_device: Any = None

    def left_behind(self) -> int | None:
        """Bytes the trial this worker ran last still holds on its device, read when the next one
        starts (None in a fresh worker): 0 unless something outlived its trial (a workload's
        module-level cache, a reference a library kept). Where something is still held,
        reference cycles are collected before it is counted, as the next trial's first
        allocation that needs the memory would make CUDA's allocator wait for them too; where
        nothing is, there is nothing a collection could free on the device, and a full one costs
        a worker that imported torch a few hundred milliseconds (a quarter of a one-second trial)."""
        if self.last_device is None:
            return None
        clear_cublas_workspaces()  # the process's, not the trial's: allocated() would count them
        held = self.last_device.allocated()
        if held:
            gc.collect()
            held = self.last_device.allocated()
        return held

    def gpu_free_before_context(self, free_now: int | None) -> int | None:
        """NVML's free memory as the plan counts it (before this process's CUDA context).

        The first trial reads it before creating the context; a reused worker's context (and
        the library workspaces it keeps) is already there, so what it took is added back.
        """
        if free_now is None or self.cuda_context_bytes is None:
            return free_now
        return free_now + self.cuda_context_bytes


#: This process's history; a Tune worker runs one trial at a time.
HISTORY = WorkerHistory()
