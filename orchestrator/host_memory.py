"""A trial's host memory, planned as its device memory is: what it holds, against what a node has.

A trial's device memory is planned (``orchestrator.planner``); its host memory is where the
sweeps of the seeds' post-mortems ran out. A trial holds on its host:

* its datasets as the DataLoader workers hold them: tensors once (a worker shares their pages,
  through shared memory when it gets the dataset pickled), NumPy arrays once with forked workers
  (who share their pages, which nobody writes) and once per process with workers that get them
  pickled (``data.multiprocessing_context``: forkserver, spawn), the Python objects in them once
  per process (a pickled copy each, or the pages a forked worker's reference counts write to:
  over an epoch, all of them);
* the interpreters its loader starts besides forked children: a fork server's (one), or each
  spawned worker's (each imports torch afresh);
* the batches loaded ahead: ``num_workers * prefetch_factor`` collated micro-batches (one, in
  the trial's own process, without workers), and as many pinned copies when they go to a GPU;
* its model and optimizer state, once more, as a checkpoint copies them to the host.

A node runs several trial processes at once (one per bundle of ``resources`` it holds, as
``orchestrator.node_memory`` counts them), so the plan is for all of them: when they do not fit
the node's available memory, fewer batches are loaded ahead (``prefetch_factor`` down to 1),
then fewer workers (halved, down to none), the same for every trial; when even that does not
fit, the sweep is refused. Pure arithmetic: the measurements are the caller's
(``trainables.footprint``), and so is the node (this machine's:
``orchestrator.available_memory``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from orchestrator.config import DataLoading
from orchestrator.units import human
from trainables.footprint import DataFootprint

#: DataLoader's own ``prefetch_factor`` when a sweep leaves it unset.
DEFAULT_PREFETCH = 2
#: The private memory of a Python process that has imported torch: what a spawned loader worker
#: or a fork server holds beyond a forked worker (which shares its parent's pages). Measured with
#: torch 2.13's CPU build (``/proc/PID/smaps_rollup``): 146 MiB a spawned worker, 145 MiB a fork
#: server, 11 MiB a worker forked from either (not counted, as a forked worker's is not).
INTERPRETER_BYTES = 150 << 20


@dataclass(frozen=True)
class HostPlan:
    """The loader settings every trial on a node runs with, and what they hold."""

    data: DataLoading
    parts: dict[str, int]  # what one trial holds, by part
    trials_at_once: int
    available_bytes: int
    changes: tuple[str, ...] = ()  # ("data.num_workers 8->2", "data.prefetch_factor 4->1") when the settings were cut
    refusal: str | None = None

    @property
    def trial_bytes(self) -> int:
        return sum(self.parts.values())

    @property
    def reduced(self) -> str:
        return ", ".join(self.changes)

    @property
    def parts_text(self) -> str:
        """What one trial holds, by part: ``datasets 3.8 MiB, batches ahead 512.0 KiB``."""
        return ", ".join(f"{name} {human(n)}" for name, n in self.parts.items() if n)

    def describe(self) -> str:
        line = (f"host memory {human(self.trial_bytes)} a trial ({self.parts_text}); {self.trials_at_once} at once: "
                f"{human(self.trial_bytes * self.trials_at_once)} of {human(self.available_bytes)} available")
        if self.refusal:
            return f"{line}; refused: {self.refusal}"
        return f"{line}; {self.reduced}" if self.reduced else line


def trial_parts(footprint: DataFootprint, data: DataLoading, pinned: bool) -> dict[str, int]:
    """What one trial holds on its host with these loader settings."""
    workers = data.num_workers
    ahead = workers * (data.prefetch_factor or DEFAULT_PREFETCH) if workers else 1
    arrays_held = 1 if data.multiprocessing_context == "fork" else 1 + workers
    interpreters = {"fork": 0, "forkserver": 1 if workers else 0, "spawn": workers}[data.multiprocessing_context]
    return {
        "datasets": footprint.tensor_bytes + footprint.array_bytes * arrays_held + footprint.copied_bytes * (1 + workers),
        "loader interpreters": interpreters * INTERPRETER_BYTES,
        "batches ahead": ahead * footprint.batch_bytes,
        "pinned": ahead * footprint.batch_bytes if pinned else 0,
        "checkpoint copy": footprint.state_bytes,
    }


def plan_host_memory(footprint: DataFootprint, data: DataLoading, *, pinned: bool, trials_at_once: int,
                     available_bytes: int) -> HostPlan:
    """The sweep's loader settings cut until ``trials_at_once`` trials fit ``available_bytes``:
    ``prefetch_factor`` first (down to 1), then ``num_workers`` (halved, to none)."""
    trials_at_once = max(trials_at_once, 1)
    settings = data
    while True:
        parts = trial_parts(footprint, settings, pinned)
        if sum(parts.values()) * trials_at_once <= available_bytes:
            return HostPlan(settings, parts, trials_at_once, available_bytes, _changes(data, settings))
        smaller = _smaller(settings)
        if smaller is None:
            refusal = (f"{trials_at_once} trial(s) at once need {human(sum(parts.values()) * trials_at_once)} of host memory "
                       f"even loading in their own processes, and the node has {human(available_bytes)} available; run fewer "
                       "at once (more resources.cpu per trial) or use smaller datasets")
            return HostPlan(settings, parts, trials_at_once, available_bytes, _changes(data, settings), refusal)
        settings = smaller


def _smaller(data: DataLoading) -> DataLoading | None:
    if data.num_workers and (data.prefetch_factor or DEFAULT_PREFETCH) > 1:
        return replace(data, prefetch_factor=1)
    if data.num_workers > 1:
        return replace(data, num_workers=data.num_workers // 2)
    if data.num_workers == 1:
        return replace(data, num_workers=0, prefetch_factor=None, persistent_workers=False)
    return None


def _changes(before: DataLoading, after: DataLoading) -> tuple[str, ...]:
    changes = []
    if after.num_workers != before.num_workers:
        changes.append(f"data.num_workers {before.num_workers}->{after.num_workers}")
    prefetch_before = before.prefetch_factor or (DEFAULT_PREFETCH if before.num_workers else None)
    if after.num_workers and (after.prefetch_factor or DEFAULT_PREFETCH) != prefetch_before:
        changes.append(f"data.prefetch_factor {prefetch_before}->{after.prefetch_factor}")
    return tuple(changes)
