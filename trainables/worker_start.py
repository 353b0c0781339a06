"""DataLoader workers forked from a trial's process, watched until they run Python.

A trial runs in a Ray worker, a process with threads of its own (Ray's core worker, gloo's,
OpenMP's). ``fork`` copies only the thread that calls it: a lock another thread held at that
instant stays held in the child, and a child that needs it blocks before it runs a line of
Python. The DataLoader cannot tell: the worker is alive, so it waits for its first batch forever.
This project's CI met it: a data-parallel rank's eval loader, in about one sweep of twenty.

Forking is still what the loader does by default (``data.multiprocessing_context: fork``): the
workers share the dataset's pages and nothing is pickled, which datasets of many small tensors
need (sending each to a fork server's worker takes a file descriptor per tensor). So each forked
worker says it started, from the loader's ``worker_init_fn``; workers that have not said so
within :data:`START_TIMEOUT_S` are killed and the loader's workers are started again.
``forkserver`` and ``spawn`` start from a fresh process instead, and are not watched.

The DataLoader keeps its workers private: what this module reads and stops of them goes through
``orchestrator.device.torch_internals``, as every private torch API does.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import time
from typing import Iterator

from torch.utils.data import DataLoader

from orchestrator.device.torch_internals import (
    loader_keeps_workers,
    loader_worker_processes,
    shut_down_loader_workers,
    unwatch_loader_workers,
)

logger = logging.getLogger(__name__)

#: Seconds a forked worker may take to run its first line of Python. A healthy one takes
#: milliseconds; a machine whose cores are all busy can stretch that to seconds.
START_TIMEOUT_S = 60.0
#: Times the workers are started before the loader gives up.
START_ATTEMPTS = 3


class WorkersDidNotStart(RuntimeError):
    """Forked DataLoader workers that never ran Python, on every attempt."""


class WorkerStarts:
    """A loader's ``worker_init_fn`` when its workers fork: worker ``i`` writes its pid in slot
    ``i`` of memory it shares with the trial's process, once it runs Python."""

    def __init__(self, num_workers: int):
        self.pids = multiprocessing.get_context("fork").Array("q", num_workers, lock=False)

    def __call__(self, worker_id: int) -> None:
        self.pids[worker_id] = os.getpid()


def start(loader: DataLoader, timeout_s: float | None = None) -> Iterator:
    """``iter(loader)``, with its forked workers seen to run Python; workers that do not in
    ``timeout_s`` are killed and all started again, at most :data:`START_ATTEMPTS` times, from
    the same seeds (``iter`` draws the workers' base seed from the loader's generator)."""
    starts = loader.worker_init_fn
    if not isinstance(starts, WorkerStarts):
        return iter(loader)
    timeout_s = START_TIMEOUT_S if timeout_s is None else timeout_s
    seeds = loader.generator.get_state() if loader.generator is not None else None
    for attempt in range(1, START_ATTEMPTS + 1):
        if not loader_keeps_workers(loader):  # new workers: a recycled pid is not one
            starts.pids[:] = [0] * len(starts.pids)
        iterator = iter(loader)
        stuck = _not_started(loader_worker_processes(iterator), starts, time.monotonic() + timeout_s)
        if not stuck:
            return iterator
        logger.warning("%d DataLoader worker(s) forked from this process did not start in %g s (attempt %d of %d): "
                       "killed, starting the workers again", len(stuck), timeout_s, attempt, START_ATTEMPTS)
        _stop(loader, iterator, stuck)
        if seeds is not None:
            loader.generator.set_state(seeds)
    raise WorkersDidNotStart(
        f"{len(stuck)} DataLoader worker(s) forked from the trial's process did not start in {timeout_s:g} s, "
        f"{START_ATTEMPTS} times: set data.multiprocessing_context: forkserver")


def _not_started(workers: list, starts: WorkerStarts, deadline: float) -> list:
    """The workers that have not run Python by ``deadline`` (persistent ones started before)."""
    while True:
        stuck = [w for i, w in enumerate(workers) if starts.pids[i] != w.pid and w.is_alive()]
        if not stuck or time.monotonic() >= deadline:
            return stuck
        time.sleep(0.005)


def _stop(loader: DataLoader, iterator, stuck: list) -> None:
    """Kill the stuck workers and shut the others down as the DataLoader does. Their pids leave
    the DataLoader's SIGCHLD watch first: it would raise in whatever the main thread runs."""
    unwatch_loader_workers(iterator)
    for worker in stuck:  # blocked before Python: only SIGKILL ends it
        os.kill(worker.pid, signal.SIGKILL)
    shut_down_loader_workers(loader, iterator)  # persistent workers too: the next iter() starts new ones
