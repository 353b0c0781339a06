"""The one training loop every workload runs: optimizer steps of accumulated micro-batches.

It knows nothing about Ray. A :class:`Trainer` trains a workload under a plan on a device and
yields a :class:`Milestone` whenever something is due: an evaluation (every N epochs, steps or
minutes), a checkpoint (at every evaluation, or on its own cadence), the end of the budget
(``stop.epochs`` or ``stop.steps``, whichever comes first). Its full state (weights,
optimizer, learning-rate scheduler, grad scaler, position in the epoch, the running train
loss) saves and loads, which is all Tune's checkpointing and the OOM retry need: a trial
resumes mid-epoch, at the step after its last checkpoint.

Replaying is exact where the model allows: the data order of an epoch depends only on
``(seed, epoch)`` (``trainables.data``), and the random state of an optimizer step (dropout,
augmentation in the main process) only on ``(seed, step)``, so a step replayed after an OOM
with smaller micro-batches sees the same samples and, for models without randomness in the
forward pass, makes the same update.

A stateful workload's state (``trainables.carry``) is the trainer's too: made from
``initial_state`` at the start of every epoch, carried from step to step, in every checkpoint,
and cut by the current plan's micro-batches, so a resume (after an OOM with a smaller
micro-batch too) continues its streams with the same state.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Iterator

import torch
from torch.utils.data import Subset

from orchestrator.config import DataLoading, Every, LrSchedule, Stop, SweepSpec
from orchestrator.device import Device, MemoryReading, state_tensors
from trainables.carry import Carry, leaves
from trainables.data import Batches, Shard, StepCut, eval_batch_sizes, eval_loader, eval_slice, train_loader
from trainables.divergence import Divergence, NonFiniteWatch, TrainingDiverged
from trainables.schedule import build_lr_scheduler, steps_on_metric
from trainables.step import eval_step, make_grad_scaler, train_step
from trainables.workload import MetricsMismatch, Workload, optimizer_for, reported_metrics, to_device


@dataclass(frozen=True)
class LoopPlan:
    """The part of a plan the loop obeys (the planner's ``Plan`` has these fields and more)."""

    micro_batch: int
    effective_batch: int
    eval_batch: int
    activation_checkpointing: bool = False
    precision: str = "fp32"


@dataclass(frozen=True)
class LoopSettings:
    """What every trial of a sweep trains for and how: from the sweep's YAML."""

    stop: Stop
    eval_every: Every = Every("epochs", 1)
    checkpoint_every: Every | None = None  # None: at every evaluation
    data: DataLoading = DataLoading()
    schedule: LrSchedule | None = None
    max_grad_norm: float | None = None
    metric: str = "eval_loss"  # the sweep's: what a scheduler that steps on a metric is given
    mode: str = "min"  # the sweep's: whether that metric improves downwards or upwards
    on_nan: str = "stop"  # "continue": no divergence watch (trainables.divergence)

    @classmethod
    def of(cls, spec: SweepSpec) -> LoopSettings:
        return cls(spec.stop, spec.eval_every, spec.checkpoint.every, spec.data, spec.schedule, spec.max_grad_norm,
                   spec.metric, spec.mode, spec.on_nan)


@dataclass(frozen=True)
class Progress:
    """Where training is; saved in every checkpoint."""

    epoch: int = 0  # epochs finished
    step_in_epoch: int = 0  # optimizer steps done in the epoch under way
    step: int = 0  # optimizer steps done in all


@dataclass(frozen=True)
class Milestone:
    """A point where the trial reports: an evaluation, a checkpoint, the end of training."""

    progress: Progress
    train_loss: float | None  # mean over the optimizer steps since the previous milestone
    eval: dict[str, float]  # eval_loss, eval_<metric>, ...; empty where no evaluation was due
    checkpoint: bool  # whether the trial should checkpoint here
    final: bool  # the budget is spent
    memory: MemoryReading  # peak since the previous milestone (the worst rank's, in a group)
    rank_memory: tuple[MemoryReading, ...] = ()  # in a data-parallel group: each rank's, by rank
    learning_rate: float | None = None  # the first parameter group's, at the milestone
    speed: Speed | None = None  # of the training since the previous milestone; None when it made no step
    #: The peaks of its parts: the train steps since the previous milestone (or pause), and the
    #: evaluation where one was due; what a trial verifying its plan compares with its predictions.
    train_memory: MemoryReading | None = None
    eval_memory: MemoryReading | None = None
    #: A pause the trial asked for (``Trainer.pause_at``): no evaluation, no checkpoint, nothing to
    #: report; the train steps' peak since the previous milestone or pause, which it then resets.
    pause: bool = False


@dataclass(frozen=True)
class Speed:
    """How fast training went between two milestones: the wall time of its optimizer steps, from
    the end of the previous milestone (its evaluation, checkpoint and report left out) to the
    moment this one fell due."""

    steps_per_second: float
    samples_per_second: float  # effective batches: the whole group's samples, in a group


class Trainer:
    """Trains ``workload`` on ``device`` under ``plan``; ``phase`` and ``position`` say where it is.

    ``shard`` is this process's rank in a data-parallel group (``trainables.distributed``): it
    then computes its slice of every step and of the eval set; one process is the group of one.
    """

    def __init__(self, workload: Workload, device: Device, plan: LoopPlan, settings: LoopSettings, seed: int = 0,
                 shard: Shard = Shard()):
        self.workload, self.device, self.plan, self.settings, self.seed = workload, device, plan, settings, seed
        self.shard = shard
        torch.manual_seed(seed)
        self.model = workload.build_model().to(device.torch_device)
        workload.set_activation_checkpointing(self.model, plan.activation_checkpointing)
        self.optimizer = optimizer_for(workload, self.model, device.torch_device.type)
        self.scaler = make_grad_scaler(plan.precision, device)
        on_gpu = device.pins_host_memory
        self.cut = StepCut(plan.effective_batch // shard.ranks, plan.micro_batch)
        with device.host():
            train_data, eval_data = workload.train_data(), workload.eval_data()
            self.train_loader, self.sampler = train_loader(workload, train_data, self.cut, seed, settings.data, on_gpu, shard)
            eval_data = _at_most(eval_data, settings.eval_every.max_batches, plan.effective_batch)
            self.eval_loader = eval_loader(workload, eval_data, plan.eval_batch, settings.data, on_gpu, shard)
        self.eval_samples = len(eval_data)
        first, last = eval_slice(self.eval_samples, shard)
        self.shard_eval_samples = last - first
        self.steps_per_epoch = self.sampler.steps_per_epoch
        self.total_steps = settings.stop.last_step(self.steps_per_epoch)
        self.scheduler = build_lr_scheduler(workload, self.optimizer, self.total_steps, settings.schedule)
        self.scheduler_on_metric = steps_on_metric(self.scheduler)
        self._check_scheduler_mode()
        self.carry: Carry | None = self._initial_carry()
        self.progress = Progress()
        self.phase, self.position = "train", 0  # for OOM events: optimizer step, or eval batch index
        self._loss_sum = torch.zeros((), device=device.torch_device)
        self._loss_steps = 0
        self._watch = NonFiniteWatch(device.torch_device) if settings.on_nan != "continue" else None
        self._last_eval = self._last_checkpoint = self._window_start = time.monotonic()
        #: After this many optimizer steps in all, ``run`` yields a pause (``Milestone.pause``) unless
        #: a milestone falls due there: an optimizer-step boundary where the trial may change its plan.
        self.pause_at: int | None = None

    def _initial_carry(self) -> Carry | None:
        """A stateful workload's state for this process's streams (the rows of its share of a step)."""
        if not self.workload.stateful:
            return None
        return Carry.initial(self.workload, self.cut.effective_batch, self.device.torch_device)  # counted as state_tensors

    @property
    def done(self) -> bool:
        return self.progress.step >= self.total_steps

    # -- the story ---------------------------------------------------------------------------
    def run(self) -> Iterator[Milestone]:
        """Train until the budget is spent, yielding at every milestone on the way; raises
        :class:`~trainables.divergence.TrainingDiverged` once a step's loss is not finite."""
        while not self.done:
            self.workload.set_epoch(self.model, self.progress.epoch)
            # Training mode for the epoch's steps (``evaluate`` restores it after eval), set here
            # and not at every step: the call walks every submodule (13 us a step of a 2-layer LSTM).
            self.model.train()
            if self.progress.step_in_epoch == 0 and self.carry is not None:
                self.carry = self._initial_carry()  # every epoch's streams start afresh
            batches = self._epoch_batches()
            epoch = self.progress.epoch
            while self.progress.epoch == epoch and not self.done:
                self._train_step(batches)
                if self._watch is not None and self._watch.reads_free and self.shard.ranks == 1:
                    self._check_divergence()  # a group's ranks decide together, at milestones
                milestone = self._milestone_due()
                if milestone is not None:
                    yield milestone
                    self._window_start = time.monotonic()  # the report and checkpoint are not training
                elif self.pause_at is not None and self.progress.step >= self.pause_at:
                    yield self._pause()
            del batches  # the epoch's iterator (and its worker processes, unless persistent)

    def _epoch_batches(self):
        """The DataLoader's iterator over this epoch's micro-batches, from the current step on."""
        self.sampler.set_position(self.progress.epoch, self.progress.step_in_epoch)
        self.train_loader.generator.manual_seed(step_seed(self.seed, self.progress.step))  # workers' seeds
        with self.device.host():
            return Batches(self.train_loader, "train_data")

    def _train_step(self, batches) -> None:
        self.phase, self.position = "train", self.progress.step
        self.device.seed(step_seed(self.seed, self.progress.step))
        sizes = self.cut.sizes
        with self.device.step("train", self.state_tensors):
            loss, grad_norm = train_step(
                self.workload, self.model, self.optimizer, self._take(batches, len(sizes)), sizes,
                self.device.torch_device, self.plan.precision, self.scaler, self.settings.max_grad_norm,
                carry=self.carry,
            )
            self._advance(loss, grad_norm)

    def _advance(self, loss: torch.Tensor, grad_norm: torch.Tensor | None = None) -> None:
        """After an optimizer step: the learning rate, the running loss, the divergence watch, the position."""
        if self.scheduler is not None and not self.scheduler_on_metric:
            self.scheduler.step()
        self._loss_sum += loss
        self._loss_steps += 1
        p = self.progress
        if self._watch is not None:
            self._watch.observe(p.step + 1, p.epoch + 1, loss, grad_norm)
        if p.step_in_epoch + 1 == self.steps_per_epoch:
            self.progress = Progress(p.epoch + 1, 0, p.step + 1)
        else:
            self.progress = Progress(p.epoch, p.step_in_epoch + 1, p.step + 1)

    def _take(self, batches, count: int):
        """``count`` micro-batches, each fetched on the host and admitted to the device when the
        step asks for it (and held by nothing here once the step drops it)."""
        for _ in range(count):
            yield self.device.admit(self._fetch(batches))

    def _fetch(self, batches):
        with self.device.host():
            return next(batches)

    def _milestone_due(self) -> Milestone | None:
        now = time.monotonic()
        epoch_ended = self.progress.step_in_epoch == 0
        evaluate = self.done or _due(self.settings.eval_every, self.progress, epoch_ended, now - self._last_eval)
        every = self.settings.checkpoint_every
        checkpoint = self.done or (evaluate if every is None else _due(every, self.progress, epoch_ended, now - self._last_checkpoint))
        if not (evaluate or checkpoint):
            return None
        if self._watch is not None:  # before evaluating or saving weights that may be NaN
            self._check_divergence()
        train_loss = self._train_loss_sum() / self._loss_steps if self._loss_steps else None  # waits for the steps
        speed = self._speed(time.monotonic() - self._window_start)
        train_memory = self.device.reading()
        metrics, eval_memory = {}, None
        if evaluate:
            self.device.reset_peak()
            metrics = self.evaluate()
            eval_memory = self.device.reading()
            self._last_eval = time.monotonic()
            self._step_on_metric({**metrics, "train_loss": train_loss})
        if checkpoint:
            self._last_checkpoint = time.monotonic()
        self._loss_sum.zero_()
        self._loss_steps = 0
        self.device.reset_peak()
        learning_rate = float(self.optimizer.param_groups[0]["lr"])
        memory = train_memory if eval_memory is None else train_memory.merged(eval_memory)
        return Milestone(self.progress, train_loss, metrics, checkpoint, self.done, memory,
                         learning_rate=learning_rate, speed=speed, train_memory=train_memory, eval_memory=eval_memory)

    def _pause(self) -> Milestone:
        """The pause ``pause_at`` asked for: the train steps' peak since the previous milestone or pause."""
        self.pause_at = None
        memory = self.device.reading()
        self.device.reset_peak()
        return Milestone(self.progress, None, {}, False, False, memory, train_memory=memory, pause=True)

    def _speed(self, seconds: float) -> Speed | None:
        if not self._loss_steps or seconds <= 0:
            return None
        steps_per_second = self._loss_steps / seconds
        return Speed(steps_per_second, steps_per_second * self.plan.effective_batch)

    def _check_scheduler_mode(self) -> None:
        """A plateau scheduler left at ``mode="min"`` on a metric the sweep maximizes would cut the
        learning rate while the metric improves: refused, in one line, before the first step."""
        mode = getattr(self.scheduler, "mode", None)
        if self.scheduler_on_metric and mode in ("min", "max") and mode != self.settings.mode:
            raise ValueError(
                f"{type(self.workload).__name__}.build_scheduler: {type(self.scheduler).__name__} has mode={mode!r} "
                f"but the sweep's metric {self.settings.metric} has mode: {self.settings.mode}; give it mode={self.settings.mode!r}"
            )

    def _step_on_metric(self, values: dict[str, float | None]) -> None:
        """Step a scheduler that steps on a metric (``ReduceLROnPlateau``) with the sweep's metric,
        before the milestone's checkpoint, which therefore holds the state after this step."""
        if not self.scheduler_on_metric:
            return
        value = values.get(self.settings.metric)
        if value is None:
            raise MetricsMismatch(
                f"{type(self.scheduler).__name__} steps on the sweep's metric {self.settings.metric!r}, "
                f"which this evaluation did not report (it reported: {', '.join(k for k, v in values.items() if v is not None)})"
            )
        self.scheduler.step(value)

    def _check_divergence(self) -> None:
        """Raise :class:`TrainingDiverged` if a step so far was not finite (reads the device)."""
        divergence = self._divergence()
        if divergence is not None:
            raise TrainingDiverged(divergence)

    def _divergence(self) -> Divergence | None:
        return self._watch.found() if self._watch is not None else None

    def _train_loss_sum(self) -> float:
        """The summed mean losses of the steps since the last milestone."""
        return self._loss_sum.item()

    def evaluate(self) -> dict[str, float]:
        """The workload's eval metrics over the eval set (its first samples, under
        ``eval_every.max_batches``), as ``eval_<name>``."""
        self.model.eval()
        self.phase = "eval"
        self.device.seed(step_seed(self.seed, self.progress.step) + 2**40)
        totals = self._eval_totals()
        self.model.train()
        reported = reported_metrics(self.workload, totals, self.eval_samples)
        return {f"eval_{name}": float(value) for name, value in reported.items()}

    def _eval_totals(self) -> dict[str, float]:
        """The workload's eval sums over this process's eval samples."""
        totals: dict[str, torch.Tensor] = {}
        with self.device.host():
            batches = Batches(self.eval_loader, "eval_data")

        def state():  # the running totals outlive each batch too (none yet at the first)
            yield from self.state_tensors()
            yield from totals.values()

        for self.position, samples in enumerate(eval_batch_sizes(self.shard_eval_samples, self.plan.eval_batch)):
            with self.device.step("eval", state):
                sums = eval_step(
                    self.workload, self.model, self.device.admit(self._fetch(batches)), samples,
                    self.device.torch_device, self.plan.precision,
                )
            _add_sums(totals, sums)
            del sums  # not alive through the next batch: each holds the running totals only
        del batches
        return {k: v.item() for k, v in totals.items()}

    def state_tensors(self):
        """Tensors that exist between steps: what a device holds for this trainer at rest (the
        running loss and the divergence watch too: a few bytes, but a device that measures some
        steps only would miss them where an unmeasured step made them)."""
        yield from state_tensors(self.model, self.optimizer)
        if self.carry is not None:
            yield from leaves(self.carry.state)
        yield self._loss_sum
        if self._watch is not None:
            yield from self._watch.tensors()

    # -- checkpoints -----------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Everything needed to continue exactly here."""
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "scaler": self.scaler.state_dict() if self.scaler else None,
            "progress": asdict(self.progress),
            "loss_sum": self._loss_sum.item(),
            "loss_steps": self._loss_steps,
            "carry": self.carry.state if self.carry is not None else None,
        }

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        if self.scaler and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        self.progress = Progress(**state["progress"])
        self._loss_sum.fill_(state["loss_sum"])
        self._loss_steps = state["loss_steps"]
        if self.carry is not None:
            self.carry = Carry(to_device(state["carry"], self.device.torch_device), self.workload.state_dim)
            self.carry.check(self.cut.effective_batch, "the checkpoint's carried state")


def _at_most(dataset, max_batches: int | None, batch: int):
    """The first ``max_batches x batch`` samples of ``dataset`` (all of it when None or shorter),
    under the indices they have in it, so a sample that fails to load is named as in the whole set."""
    if max_batches is None or max_batches * batch >= len(dataset):
        return dataset
    return Subset(dataset, range(max_batches * batch))


def _add_sums(totals: dict[str, torch.Tensor], sums: dict[str, torch.Tensor]) -> None:
    for name, value in sums.items():
        totals[name] = totals[name] + value if name in totals else value


def step_seed(seed: int, step: int) -> int:
    """The random seed of optimizer step ``step``: the same whenever the step is replayed."""
    return seed * 1_000_003 + step


def _due(every: Every, progress: Progress, epoch_ended: bool, seconds_since: float) -> bool:
    if every.unit == "epochs":
        return epoch_ended and progress.epoch % every.count == 0
    if every.unit == "steps":
        return progress.step % every.count == 0
    return seconds_since >= every.count * 60
