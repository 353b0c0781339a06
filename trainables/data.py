"""How a workload's datasets reach the training step: PyTorch DataLoaders over a step-aware sampler.

The sampler is what keeps training reproducible whatever the plan:

* an epoch's order is a permutation drawn from ``(seed, epoch)`` only, so an epoch replayed
  after an OOM, a worker's death or a SLURM requeue visits the samples in the same order;
* the order is cut into optimizer steps of ``effective_batch`` samples (the last partial one is
  dropped), and only then each step into micro-batches of ``micro_batch``: a replan after an OOM
  changes how a step is cut, never which samples form it;
* an epoch can start at any step, so a trial resumes mid-epoch without loading the batches it
  already trained on.

The sampler runs in the training process and hands index lists to the DataLoader, whose
workers (``data.num_workers``) fetch and collate them with the workload's ``collate``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from orchestrator.config import DataLoading
from trainables.workload import Workload


class DatasetTooSmall(ValueError):
    """The training set holds fewer samples than one optimizer step needs."""


@dataclass(frozen=True)
class StepCut:
    """How one optimizer step's ``effective_batch`` samples are cut into micro-batches."""

    effective_batch: int
    micro_batch: int

    @property
    def sizes(self) -> list[int]:
        """Samples per micro-batch: full ones, then the remainder (8 x 3 + 4 for 28 by 8)."""
        full, rest = divmod(self.effective_batch, self.micro_batch)
        return [self.micro_batch] * full + ([rest] if rest else [])


class StepSampler(Sampler[list[int]]):
    """Index lists of the micro-batches of one epoch, from optimizer step ``start_step`` on."""

    def __init__(self, samples: int, cut: StepCut, seed: int):
        self.samples, self.cut, self.seed = samples, cut, seed
        self.epoch, self.start_step = 0, 0

    @property
    def steps_per_epoch(self) -> int:
        return self.samples // self.cut.effective_batch

    def set_position(self, epoch: int, start_step: int) -> None:
        """Where the next iteration starts (read when the DataLoader's iterator is made)."""
        self.epoch, self.start_step = epoch, start_step

    def order(self, epoch: int) -> list[int]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.samples, generator=generator).tolist()

    def __iter__(self) -> Iterator[list[int]]:
        order = self.order(self.epoch)
        effective = self.cut.effective_batch
        for step in range(self.start_step, self.steps_per_epoch):
            indices = order[step * effective : (step + 1) * effective]
            start = 0
            for size in self.cut.sizes:
                yield indices[start : start + size]
                start += size

    def __len__(self) -> int:
        return (self.steps_per_epoch - self.start_step) * len(self.cut.sizes)


def train_loader(
    workload: Workload, dataset: Dataset, cut: StepCut, seed: int, settings: DataLoading, on_gpu: bool
) -> tuple[DataLoader, StepSampler]:
    """The training DataLoader and its sampler (move the sampler with ``set_position``)."""
    if len(dataset) < cut.effective_batch:  # sampling drops the last partial step: no step at all
        raise DatasetTooSmall(
            f"workload {type(workload).__name__}: train_data has {len(dataset)} samples, fewer than one "
            f"optimizer step (effective_batch_size {cut.effective_batch})"
        )
    sampler = StepSampler(len(dataset), cut, seed)
    return _loader(workload, dataset, sampler, settings, on_gpu), sampler


def eval_loader(workload: Workload, dataset: Dataset, batch: int, settings: DataLoading, on_gpu: bool) -> DataLoader:
    """Every eval sample once, in order, ``batch`` at a time (the last batch may be smaller)."""
    if len(dataset) == 0:
        raise DatasetTooSmall(f"workload {type(workload).__name__}: eval_data has no samples")
    indices = list(range(len(dataset)))
    batches = [indices[i : i + batch] for i in range(0, len(indices), batch)]
    return _loader(workload, dataset, batches, settings, on_gpu)


def eval_batch_sizes(samples: int, batch: int) -> list[int]:
    return [min(batch, samples - i * batch) for i in range(math.ceil(samples / batch))]


def _loader(workload: Workload, dataset: Dataset, batch_sampler, settings: DataLoading, on_gpu: bool) -> DataLoader:
    extra = {}
    if settings.num_workers:
        extra = {"persistent_workers": settings.persistent_workers}
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
