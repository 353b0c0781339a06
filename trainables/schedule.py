"""The learning rate over a trial's optimizer steps: the workload's own scheduler, or the sweep's.

A sweep's ``schedule: {warmup_steps, decay, final_lr}`` is a linear warm-up from 0 followed by a
constant, linear or cosine decay to ``final_lr x lr`` at the last step: the shapes of
``transformers``' ``get_*_schedule_with_warmup``, so a learning rate tuned with them means the
same here. Either way the scheduler steps once per optimizer step and is checkpointed with the
trial, so a resumed trial continues its schedule where it stopped.

A scheduler whose ``step`` takes a value (``ReduceLROnPlateau(optimizer, factor=0.25)``: divide the
learning rate by 4 when the metric stops improving) steps on the sweep's ``metric`` instead, once
after each evaluation. It too is checkpointed with the trial, after the step of the evaluation the
checkpoint follows, so an OOM replay, which resumes from that checkpoint and re-evaluates what
it replays, steps it once per evaluation as an uninterrupted trial would.
"""

from __future__ import annotations

import inspect
import math

import torch

from orchestrator.config import LrSchedule
from trainables.workload import Workload


def lr_factor(schedule: LrSchedule, step: int, total_steps: int) -> float:
    """The multiple of the base learning rate for optimizer step ``step`` (0-based)."""
    if step < schedule.warmup_steps:
        return step / schedule.warmup_steps
    if schedule.decay == "constant":
        return 1.0
    progress = min((step - schedule.warmup_steps) / max(total_steps - schedule.warmup_steps, 1), 1.0)
    shape = 1.0 - progress if schedule.decay == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return schedule.final_lr + (1.0 - schedule.final_lr) * shape


def build_lr_scheduler(
    workload: Workload, optimizer: torch.optim.Optimizer, total_steps: int, schedule: LrSchedule | None
) -> torch.optim.lr_scheduler.LRScheduler | None:
    """The workload's ``build_scheduler``, else the sweep's schedule, else None (a constant lr)."""
    own = workload.build_scheduler(optimizer, total_steps)
    if own is not None or schedule is None:
        return own
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(schedule, step, total_steps))


def steps_on_metric(scheduler: object | None) -> bool:
    """Whether ``scheduler.step`` needs a value: the first parameter has no default, as
    ``ReduceLROnPlateau.step(metrics)``'s has not (``LRScheduler.step(epoch=None)``'s has)."""
    if scheduler is None:
        return False
    params = list(inspect.signature(scheduler.step).parameters.values())
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return bool(params) and params[0].kind in positional and params[0].default is inspect.Parameter.empty
