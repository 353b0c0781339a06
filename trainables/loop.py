"""The one training loop every workload runs: epochs of accumulated micro-batches, then eval.

It knows nothing about Ray: a :class:`Trainer` runs epochs under a plan on a device and can
save and load its full state, which is all that Tune's checkpointing and the OOM retry need.
The data order of an epoch depends only on the seed and the epoch number, and so does the
dropout RNG, so an epoch replayed after an OOM (with smaller micro-batches) makes the same
updates as the one that failed would have.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from orchestrator.device import Device, MemoryReading
from trainables.step import eval_step, make_grad_scaler, train_step
from trainables.workload import Workload


@dataclass(frozen=True)
class EpochResult:
    epoch: int  # epochs finished, 1-based
    train_loss: float
    eval_loss: float
    memory: MemoryReading


@dataclass(frozen=True)
class LoopPlan:
    """The part of a plan the loop obeys (the planner's ``Plan`` has these fields and more)."""

    micro_batch: int
    effective_batch: int
    eval_batch: int
    activation_checkpointing: bool = False
    precision: str = "fp32"


class Trainer:
    """Trains ``workload`` on ``device`` under ``plan``; ``phase`` and ``step`` say where it is."""

    def __init__(self, workload: Workload, device: Device, plan: LoopPlan, seed: int = 0):
        self.workload = workload
        self.device = device
        self.plan = plan
        self.seed = seed
        torch.manual_seed(seed)
        self.model = workload.build_model().to(device.torch_device)
        workload.set_activation_checkpointing(self.model, plan.activation_checkpointing)
        self.optimizer = workload.build_optimizer(self.model)
        self.scaler = make_grad_scaler(plan.precision, device.torch_device)
        self.train_data = workload.train_data()
        self.eval_data = workload.eval_data()
        self.epoch = 0  # epochs finished
        self.phase = "train"
        self.step = 0

    @property
    def steps_per_epoch(self) -> int:
        return max(len(self.train_data) // self.plan.effective_batch, 1)

    def run_epoch(self) -> EpochResult:
        """One epoch of training and one eval pass, with the peak memory of both."""
        self.workload.set_epoch(self.model, self.epoch)
        # The data order is host-side bookkeeping (on a GPU it never leaves the CPU), so it is
        # drawn before the measured window opens.
        order = torch.randperm(len(self.train_data), generator=torch.Generator().manual_seed(self.seed + self.epoch)).tolist()
        self.device.track(self._state_tensors())
        self.device.reset_peak()
        with self.device.measuring():
            train_loss = self._train_epoch(order)
            eval_loss = self._evaluate()
        self.epoch += 1
        return EpochResult(self.epoch, train_loss, eval_loss, self.device.reading())

    def _train_epoch(self, order: list[int]) -> float:
        self.model.train()
        self.phase = "train"
        torch.manual_seed(self.seed * 100_003 + self.epoch)  # dropout etc.: same on a replayed epoch
        effective, micro = self.plan.effective_batch, self.plan.micro_batch
        losses = []
        for self.step in range(self.steps_per_epoch):
            indices = order[self.step * effective : (self.step + 1) * effective]
            micro_batches = [self._collate(self.train_data, indices[i : i + micro]) for i in range(0, len(indices), micro)]
            loss = train_step(
                self.workload, self.model, self.optimizer, micro_batches,
                self.device.torch_device, self.plan.precision, self.scaler,
            )
            losses.append(loss)
        return torch.stack(losses).mean().item()

    def _evaluate(self) -> float:
        self.model.eval()
        self.phase = "eval"
        total, count = 0.0, len(self.eval_data)
        batch = self.plan.eval_batch
        for self.step in range(math.ceil(count / batch)):
            indices = list(range(self.step * batch, min((self.step + 1) * batch, count)))
            total += eval_step(
                self.workload, self.model, self._collate(self.eval_data, indices), self.device.torch_device, self.plan.precision
            ).item()
        return total / count

    def _collate(self, dataset, indices):
        from torch.utils.data import TensorDataset

        if isinstance(dataset, TensorDataset):  # a gather, not views of the dataset's storage
            index = torch.as_tensor(indices, dtype=torch.long)
            return tuple(t[index] for t in dataset.tensors)
        return self.workload.collate([dataset[i] for i in indices])

    def _state_tensors(self):
        yield from self.model.parameters()
        yield from self.model.buffers()
        for p in self.model.parameters():
            if p.grad is not None:
                yield p.grad
        for state in self.optimizer.state.values():
            yield from (v for v in state.values() if isinstance(v, torch.Tensor))

    # -- checkpoints -----------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Everything needed to continue exactly here: weights, optimizer, RNG, epoch."""
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler else None,
            "rng": torch.get_rng_state(),
            "epoch": self.epoch,
        }

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scaler and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        torch.set_rng_state(state["rng"])
        self.epoch = state["epoch"]
