"""The phases of a trial that each get a profile, and how a model is put into one.

A trial's memory is the worst over its phases: the train step (micro-batch) and the eval step
(its own batch size, no gradients), at every stage of the workload's module-activation
schedule, because a module that switches on at epoch 3 changes both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import nn

from orchestrator.config import Stop, SweepSpec
from orchestrator.memory.profile import Settings
from trainables.data import whole_steps
from trainables.workload import Workload


@dataclass(frozen=True)
class Phase:
    name: str  # "train", "eval", "train@epoch3", "eval@epoch3": epochs counted from 1, as a person reads them
    kind: str  # "train" | "eval"
    epoch: int  # first epoch of the stage the phase belongs to, from 0 (the workload's ``set_epoch``)


@dataclass(frozen=True)
class TrainingLength:
    """How far a trial trains, which decides the stages of a module-activation schedule it reaches:
    a sweep stopped at step 30 of 16-step epochs never meets a module that switches on at epoch 3,
    and is neither planned nor refused for it."""

    stop: Stop
    effective_batch: int  # the samples of one optimizer step, all ranks together

    @classmethod
    def of(cls, spec: SweepSpec) -> TrainingLength:
        return cls(spec.stop, spec.effective_batch_size)

    def epochs(self, workload: Workload) -> int | None:
        """The epochs a trial of ``workload`` starts (None: every stage). ``stop.steps`` needs the
        epoch's steps, so the training set is built, only for a workload with stages to skip."""
        if self.stop.steps is None or len(workload.stage_epochs()) < 2:
            return self.stop.epochs
        steps_per_epoch = max(whole_steps(len(workload.train_data()), self.effective_batch), 1)  # the pre-flight refuses 0
        return math.ceil(self.stop.last_step(steps_per_epoch) / steps_per_epoch)


def phases_of(workload: Workload, epochs: int | None = None) -> list[Phase]:
    """Train and eval phases of every stage, stage by stage in epoch order (as training meets them);
    of the stages that start within ``epochs`` where it is given (``TrainingLength.epochs``)."""
    phases = []
    for epoch in workload.stage_epochs():
        if epochs is not None and epoch >= epochs:
            break
        suffix = "" if epoch == 0 else f"@epoch{epoch + 1}"
        phases.append(Phase(f"train{suffix}", "train", epoch))
        phases.append(Phase(f"eval{suffix}", "eval", epoch))
    return phases


def enter_phase(workload: Workload, model: nn.Module, phase: Phase, settings: Settings) -> None:
    """Put ``model`` in the state the training loop has it in during ``phase``."""
    workload.set_epoch(model, phase.epoch)
    if workload.supports_activation_checkpointing:
        workload.set_activation_checkpointing(model, settings.activation_checkpointing)
    model.train(phase.kind == "train")
