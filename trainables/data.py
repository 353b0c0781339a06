"""How a workload's datasets reach the training step: PyTorch DataLoaders over a step-aware sampler.

The sampler is what keeps training reproducible whatever the plan:

* an epoch's order is a permutation drawn from ``(seed, epoch)`` only, so an epoch replayed
  after an OOM, a worker's death or a SLURM requeue visits the samples in the same order;
* the order is cut into optimizer steps of ``effective_batch`` samples (the last partial one is
  dropped), and only then each step into micro-batches of ``micro_batch``: a replan after an OOM
  changes how a step is cut, never which samples form it;
* an epoch can start at any step, so a trial resumes mid-epoch without loading the batches it
  already trained on.

A stateful workload's epoch is ordered instead (``ordered``): the samples are cut into
``effective_batch`` contiguous streams, and step ``s`` takes sample ``s`` of every stream, in
stream order, so row ``j`` of each step continues row ``j`` of the one before (see
``trainables.carry``); micro-batches then cut a step into consecutive streams.

The sampler runs in the training process and hands index lists to the DataLoader, whose
workers (``data.num_workers``) fetch and collate them with the workload's ``collate``. They
fork from the trial's process by default, watched until they run Python
(``trainables.worker_start``); with ``data.multiprocessing_context: forkserver`` or ``spawn`` they
start from a fresh process and get the dataset and ``collate`` pickled, so a dataset that cannot
be pickled and unpickled is named first, with the setting that takes it as it is.

A sample that cannot be loaded is a bug in the workload's data, not something a retry fixes:
:class:`Batches` knows which index list each batch was asked for, fetches those samples again
in this process to find the one that fails (a DataLoader worker's exception arrives as text,
without its frames), and raises :class:`SampleError` naming it. A failure that does not happen
again there (a DataLoader worker killed, say) is not pinned on the data: it is raised as it came.
"""

from __future__ import annotations

import functools
import io
import itertools
import math
import multiprocessing
import pickle
import traceback
import weakref
from multiprocessing.reduction import ForkingPickler
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from orchestrator.config import DataLoading
from orchestrator.users_code import users
from trainables import worker_start
from trainables.workload import Workload, failure_line


class DatasetTooSmall(ValueError):
    """The training set holds fewer samples than one optimizer step needs."""


class SampleError(Exception):
    """A sample (or the batch of them) could not be loaded: ``train_data sample 4000:
    my_data.py:12: ValueError: ...``. Its cause, when the failure was found again in this
    process, is the user's exception with its frames. One message, as Ray rebuilds exceptions
    from their ``args``."""


class Batches:
    """The batches of a DataLoader, counted, so that a batch that fails to load is named by the
    sample indices it was asked for (``phase``: ``train_data`` or ``eval_data``)."""

    def __init__(self, loader: DataLoader, phase: str):
        self.loader, self.phase = loader, phase
        self.iterator = _started(loader, phase)
        self.taken = 0

    def __iter__(self) -> "Batches":
        return self

    def __next__(self) -> Any:
        try:
            batch = next(self.iterator)
        except StopIteration:
            raise
        except (MemoryError, torch.OutOfMemoryError):  # memory, not data: the trial's OOM handling decides
            raise
        except Exception:  # noqa: BLE001 - the workload's dataset or collate: named if found again
            error = self._sample_error()
            if error is None:  # not the data (a DataLoader worker killed, say): as it came
                raise
            raise error  # noqa: B904 - its cause is set: the failure found again
        self.taken += 1
        return batch

    def _sample_error(self) -> SampleError | None:
        """The sample that fails when the failed batch's samples are fetched again here, one by
        one, or its ``collate``; None where neither fails again."""
        indices = next(itertools.islice(iter(self.loader.batch_sampler), self.taken, None), None)
        if indices is None:
            return None
        samples = []
        for index in indices:
            try:
                samples.append(self.loader.dataset[index])
            except Exception as again:  # noqa: BLE001 - the user's dataset
                return _caused(SampleError(f"{self.phase} sample {index}: {failure_line(again)}"), again)
        try:
            self.loader.collate_fn(samples)
        except Exception as again:  # noqa: BLE001 - the user's collate
            return _caused(SampleError(f"collate of {self.phase} samples {_listed(indices)}: {failure_line(again)}"), again)
        return None


def _started(loader: DataLoader, phase: str) -> Iterator:
    """The loader's iterator, its workers started. Workers that do not fork from the trial's
    process unpickle the dataset and ``collate`` as they start, where a failure is only a
    traceback on stderr and a worker gone: so they are pickled and unpickled here first, once per
    loader, and a failure is the workload's error, with its line. So is a dataset of more tensors
    than a fork server passes to a worker (a file descriptor each, at most 251)."""
    method = loader.multiprocessing_context.get_start_method() if loader.num_workers else "fork"
    if method != "fork" and loader not in _ROUND_TRIPPED:
        try:
            _round_trip((loader.dataset, loader.collate_fn))
        except Exception as exc:  # noqa: BLE001 - the user's dataset or collate, pickled
            raise _caused(SampleError(
                f"{phase}: data.multiprocessing_context {method} pickles the dataset and the workload's collate for "
                f"each DataLoader worker, and they cannot be pickled and unpickled ({_pickling_failure(exc)}); "
                f"define their classes and functions at a module's top level and open files in the worker, or set "
                f"data.multiprocessing_context: fork"), exc)
        _ROUND_TRIPPED.add(loader)
    try:
        return worker_start.start(loader)
    except ValueError as exc:
        if method != "forkserver" or str(exc) != "too many fds":
            raise
        raise _caused(SampleError(
            f"{phase}: data.multiprocessing_context forkserver sends each tensor of the dataset to a DataLoader "
            f"worker as a file descriptor, and this one holds more than it passes (ValueError: too many fds); keep "
            f"the samples in fewer, larger tensors, or set data.multiprocessing_context: fork"), exc)


#: Loaders whose dataset and collate were seen to pickle and unpickle in this process.
_ROUND_TRIPPED: weakref.WeakSet[DataLoader] = weakref.WeakSet()


class _TensorsAside(ForkingPickler):
    """Pickles as a worker's start does, tensors left out: they reach a worker through shared
    memory, and copying their bytes here would double the dataset for nothing."""

    def __init__(self, file, tensors: list):
        super().__init__(file, pickle.HIGHEST_PROTOCOL)
        self.tensors = tensors

    def persistent_id(self, obj: Any) -> int | None:
        if isinstance(obj, torch.Tensor):
            self.tensors.append(obj)
            return len(self.tensors) - 1
        return None


class _TensorsBack(pickle.Unpickler):
    def __init__(self, file, tensors: list):
        super().__init__(file)
        self.tensors = tensors

    def persistent_load(self, pid: int) -> torch.Tensor:
        return self.tensors[pid]


def _pickling_failure(exc: Exception) -> str:
    """``FILE:LINE: Type: what`` at the user's line (their ``__getstate__``, say), else
    ``Type: what``: pickle's own frames are no place to look."""
    if any(users(frame.filename) for frame in traceback.extract_tb(exc.__traceback__)):
        return failure_line(exc)
    return " ".join(f"{type(exc).__name__}: {exc}".split())


def _round_trip(obj: Any) -> None:
    tensors: list = []
    buffer = io.BytesIO()
    _TensorsAside(buffer, tensors).dump(obj)
    buffer.seek(0)
    _TensorsBack(buffer, tensors).load()


def _caused(error: SampleError, cause: BaseException) -> SampleError:
    error.__cause__ = cause
    return error


def _listed(indices: list[int], shown: int = 8) -> str:
    return ", ".join(map(str, indices[:shown])) + (f", ... ({len(indices)} in all)" if len(indices) > shown else "")


@dataclass(frozen=True)
class StepCut:
    """How one optimizer step's ``effective_batch`` samples are cut into micro-batches."""

    effective_batch: int
    micro_batch: int

    @functools.cached_property  # read at every optimizer step
    def sizes(self) -> tuple[int, ...]:
        """Samples per micro-batch: full ones, then the remainder (8 x 3 + 4 for 28 by 8)."""
        full, rest = divmod(self.effective_batch, self.micro_batch)
        return (self.micro_batch,) * full + ((rest,) if rest else ())


@dataclass(frozen=True)
class Shard:
    """Rank ``rank`` of ``ranks`` in a data-parallel group: it computes the ``rank``-th contiguous
    slice of every optimizer step's samples (and of the eval set's batches)."""

    rank: int = 0
    ranks: int = 1


def whole_steps(samples: int, step_samples: int) -> int:
    """The optimizer steps an epoch of ``samples`` makes, ``step_samples`` (the effective batch)
    each: whole steps only, so every step has the same samples (the sampler's and the pre-flight's)."""
    return samples // step_samples


class StepSampler(Sampler[list[int]]):
    """Index lists of the micro-batches of one epoch, from optimizer step ``start_step`` on.

    ``cut`` is this rank's share of a step; in a group of ``shard.ranks`` a step takes
    ``cut.effective_batch x ranks`` samples of the epoch's order, and this rank the
    ``shard.rank``-th slice of them, so together the ranks see what one process would.
    """

    def __init__(self, samples: int, cut: StepCut, seed: int, shard: Shard = Shard(), ordered: bool = False):
        self.samples, self.cut, self.seed, self.shard, self.ordered = samples, cut, seed, shard, ordered
        self.epoch, self.start_step = 0, 0

    @property
    def step_samples(self) -> int:
        return self.cut.effective_batch * self.shard.ranks

    @property
    def steps_per_epoch(self) -> int:
        return whole_steps(self.samples, self.step_samples)

    def set_position(self, epoch: int, start_step: int) -> None:
        """Where the next iteration starts (read when the DataLoader's iterator is made)."""
        self.epoch, self.start_step = epoch, start_step

    def order(self, epoch: int) -> list[int]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.samples, generator=generator).tolist()

    def _step_indices(self, order: list[int] | None, step: int) -> list[int]:
        """This rank's samples of optimizer step ``step`` of the epoch, in row order: a slice of
        the epoch's order, or (``ordered``) sample ``step`` of each of this rank's streams."""
        share = self.cut.effective_batch
        first = self.shard.rank * share
        if self.ordered:
            steps = self.steps_per_epoch  # read once: a property, per index of every step
            return [stream * steps + step for stream in range(first, first + share)]
        first += step * self.step_samples
        return order[first : first + share]

    def __iter__(self) -> Iterator[list[int]]:
        order = None if self.ordered else self.order(self.epoch)
        for step in range(self.start_step, self.steps_per_epoch):
            indices = self._step_indices(order, step)
            start = 0
            for size in self.cut.sizes:
                yield indices[start : start + size]
                start += size

    def __len__(self) -> int:
        return (self.steps_per_epoch - self.start_step) * len(self.cut.sizes)


def train_loader(
    workload: Workload, dataset: Dataset, cut: StepCut, seed: int, settings: DataLoading, on_gpu: bool,
    shard: Shard = Shard(),
) -> tuple[DataLoader, StepSampler]:
    """The training DataLoader and its sampler (move the sampler with ``set_position``); ordered
    streams for a stateful workload."""
    step = cut.effective_batch * shard.ranks
    if len(dataset) < step:  # sampling drops the last partial step: no step at all
        raise DatasetTooSmall(
            f"workload {type(workload).__name__}: train_data has {len(dataset)} samples, fewer than one "
            f"optimizer step (effective_batch_size {step})"
        )
    sampler = StepSampler(len(dataset), cut, seed, shard, ordered=workload.stateful)
    return _loader(workload, dataset, sampler, settings, on_gpu), sampler


def eval_loader(
    workload: Workload, dataset: Dataset, batch: int, settings: DataLoading, on_gpu: bool, shard: Shard = Shard()
) -> DataLoader:
    """Every eval sample once, in order, ``batch`` at a time (the last batch may be smaller); in a
    group, this rank's contiguous slice of the eval set."""
    if len(dataset) == 0:
        raise DatasetTooSmall(f"workload {type(workload).__name__}: eval_data has no samples")
    first, last = eval_slice(len(dataset), shard)
    if first == last:
        raise DatasetTooSmall(
            f"workload {type(workload).__name__}: eval_data has {len(dataset)} samples, fewer than the "
            f"{shard.ranks} ranks that share it"
        )
    indices = list(range(first, last))
    batches = [indices[i : i + batch] for i in range(0, len(indices), batch)]
    return _loader(workload, dataset, batches, settings, on_gpu)


def eval_slice(samples: int, shard: Shard) -> tuple[int, int]:
    """The eval samples ``[first, last)`` rank ``shard.rank`` evaluates: near-equal contiguous slices."""
    return samples * shard.rank // shard.ranks, samples * (shard.rank + 1) // shard.ranks


def eval_batch_sizes(samples: int, batch: int) -> list[int]:
    return [min(batch, samples - i * batch) for i in range(math.ceil(samples / batch))]


def _loader(workload: Workload, dataset: Dataset, batch_sampler, settings: DataLoading, on_gpu: bool) -> DataLoader:
    extra = {}
    if settings.num_workers:
        extra = {"persistent_workers": settings.persistent_workers,
                 "multiprocessing_context": _start_method(settings, workload)}
        if settings.multiprocessing_context == "fork":
            extra["worker_init_fn"] = worker_start.WorkerStarts(settings.num_workers)
        if settings.prefetch_factor is not None:
            extra["prefetch_factor"] = settings.prefetch_factor
    return DataLoader(
        dataset,
        batch_sampler=batch_sampler,
        collate_fn=workload.collate,
        num_workers=settings.num_workers,
        generator=torch.Generator(),  # seeds the workers; the trainer reseeds it per epoch
        # Pinned host memory only speeds up copies to a GPU; elsewhere it is wasted work.
        pin_memory=on_gpu and settings.pin_memory is not False,
        **extra,
    )


def _start_method(settings: DataLoading, workload: Workload) -> multiprocessing.context.BaseContext:
    """How the loader's workers start. A process's fork server starts with its first loader and
    serves every later one, the next trial's in a reused worker too: it imports torch and the
    workload's module first, so that a worker forked from it starts without importing them again
    (a fraction of a second against a fork's milliseconds, per epoch unless persistent)."""
    context = multiprocessing.get_context(settings.multiprocessing_context)
    if settings.multiprocessing_context == "forkserver":
        context.set_forkserver_preload(["__main__", "torch", type(workload).__module__])
    return context
