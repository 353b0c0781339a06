"""Divergence: the first optimizer step whose loss (or gradient norm) is not finite.

A loss that turns NaN or infinite never comes back: every step after it trains on NaN weights,
and a trial that goes on reports NaN losses until its budget is spent and then looks finished.
The loop therefore watches every step's loss, and the gradient norm where clipping computes it
(``max_grad_norm``), and ends the trial at the first that is not finite (``on_nan`` in the
sweep's YAML says what the trial's end then means).

Watching must not make a GPU wait for the host at every step (the loop reads its losses only at
milestones): :class:`NonFiniteWatch` keeps, on the device, the first bad step and the last finite
loss before it, updated by a few tensor operations queued behind the step's own. The host reads
them at each milestone, where the loop reads its losses anyway (so on a GPU, the steps between
the bad one and the next milestone still run, and the trial reports the bad step all the same).
On the CPU, where reading a tensor waits for nothing, the watch reads each step's loss and
gradient norm at once instead (two reads: about 1 us a step; the dozen queued operations: 40 us),
and the loop asks it after every step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Divergence:
    """Where training diverged: ``step`` counts optimizer steps from 1, as the tables do."""

    step: int
    epoch: int  # the epoch the step belongs to, from 1
    what: str  # "loss" | "gradient norm": which was not finite
    last_finite_loss: float | None  # the mean loss of the step before (None: no finite step before it)

    def describe(self) -> str:
        """``loss not finite at step 37 (epoch 2); last finite loss 0.4123``."""
        last = "none" if self.last_finite_loss is None else f"{self.last_finite_loss:.4g}"
        return f"{self.what} not finite at step {self.step} (epoch {self.epoch}); last finite loss {last}"


class TrainingDiverged(Exception):
    """Raised by the loop at the milestone (or step) that found a :class:`Divergence`."""

    def __init__(self, divergence: Divergence):
        super().__init__(divergence.describe())
        self.divergence = divergence


class NonFiniteWatch:
    """The first non-finite step of a trainer, kept on its device without waiting for it."""

    def __init__(self, device: torch.device):
        self.reads_free = device.type == "cpu"  # reading a CPU tensor waits for nothing
        self._read: Divergence | None = None  # where reads are free: found at the step's own observe
        self._read_last: float | None = None  # ... and the last finite loss so far
        self._first = torch.full((), -1, dtype=torch.int64, device=device)  # the bad step (from 1), -1: none
        self._epoch = torch.zeros((), dtype=torch.int64, device=device)
        self._loss_bad = torch.zeros((), dtype=torch.bool, device=device)  # else the gradient norm was
        self._last = torch.full((), math.nan, device=device)  # the last finite loss before it
        self._seen_finite = torch.zeros((), dtype=torch.bool, device=device)

    def observe(self, step: int, epoch: int, loss: torch.Tensor, grad_norm: torch.Tensor | None = None) -> None:
        """Step ``step`` (from 1, of epoch ``epoch`` from 1) had mean loss ``loss`` and, where clipping
        computed one, gradient norm ``grad_norm``: queued device operations, no read (where reads
        are free: two reads)."""
        if self.reads_free:
            self._observe_read(step, epoch, loss, grad_norm)
            return
        loss_ok = torch.isfinite(loss)
        ok = loss_ok if grad_norm is None else loss_ok & torch.isfinite(grad_norm)
        watching = self._first < 0
        new = watching & ~ok
        self._first = torch.where(new, step, self._first)
        self._epoch = torch.where(new, epoch, self._epoch)
        self._loss_bad = torch.where(new, ~loss_ok, self._loss_bad)
        keep = watching & loss_ok
        self._last = torch.where(keep, loss.float(), self._last)
        self._seen_finite = self._seen_finite | keep

    def _observe_read(self, step: int, epoch: int, loss: torch.Tensor, grad_norm: torch.Tensor | None) -> None:
        """``observe`` by reading: the same first bad step and last finite loss (the bad step's own
        loss where only its gradient norm was not finite, as the queued operations keep it)."""
        if self._read is not None:
            return
        value = loss.item()
        if not math.isfinite(value):
            self._read = Divergence(step, epoch, "loss", self._read_last)
            return
        self._read_last = value
        if grad_norm is not None and not math.isfinite(grad_norm.item()):
            self._read = Divergence(step, epoch, "gradient norm", value)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """What it keeps between steps (replaced by every queued ``observe``), for a device that counts them."""
        return self._first, self._epoch, self._loss_bad, self._last, self._seen_finite

    def found(self) -> Divergence | None:
        """The divergence seen so far, if any (reads the device: call it where a wait costs nothing)."""
        if self.reads_free:
            return self._read
        first = int(self._first.item())
        if first < 0:
            return None
        last = float(self._last.item()) if bool(self._seen_finite.item()) else None
        return Divergence(first, int(self._epoch.item()), "loss" if bool(self._loss_bad.item()) else "gradient norm", last)
