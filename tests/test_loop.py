"""The training loop: accumulation equals the full batch, a resumed trainer equals an uninterrupted
one (mid-epoch too), budgets in epochs and steps, evaluation and checkpoint cadences, eval metrics,
clipping on the accumulated gradient, and the memory it reports."""

import copy
import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from orchestrator.config import DataLoading, Every, LrSchedule, Stop
from orchestrator.device import CpuDevice
from orchestrator.device.emulated import EmulatedDevice
from tests.workloads import DeviceOptimizerWorkload, PlateauWorkload
from trainables.cnn import CNNWorkload
from trainables.loop import LoopPlan, LoopSettings, MetricsMismatch, Progress, Trainer
from trainables.mlp import MLPWorkload
from trainables.workload import LossTypeError


def weights(trainer):
    return [p.detach().clone() for p in trainer.model.parameters()]


def train(workload, plan, settings, seed=0, state=None):
    """A trainer run to the end of its budget on the CPU (optionally resumed from ``state``)."""
    device = CpuDevice()
    with device.measuring():
        trainer = Trainer(workload, device, plan, settings, seed=seed)
        if state is not None:
            trainer.load_state_dict(state)
        milestones = list(trainer.run())
    return trainer, milestones


def epochs(n, **extra):
    return LoopSettings(Stop(epochs=n), **extra)


def test_micro_batch_8_x_4_makes_the_same_updates_as_32_x_1():
    workload = MLPWorkload(width=32, lr=0.01, train_samples=256, eval_samples=64)
    full, _ = train(workload, LoopPlan(micro_batch=32, effective_batch=32, eval_batch=64), epochs(2))
    accumulated, _ = train(workload, LoopPlan(micro_batch=8, effective_batch=32, eval_batch=16), epochs(2))
    for a, b in zip(weights(full), weights(accumulated)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_uneven_micro_batches_keep_the_effective_batch_update():
    workload = MLPWorkload(width=16, lr=0.01, train_samples=120, eval_samples=30)
    full, _ = train(workload, LoopPlan(micro_batch=24, effective_batch=24, eval_batch=30), epochs(1))
    uneven, _ = train(workload, LoopPlan(micro_batch=10, effective_batch=24, eval_batch=7), epochs(1))  # 10+10+4
    for a, b in zip(weights(full), weights(uneven)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_clipping_acts_on_the_accumulated_gradient():
    workload = MLPWorkload(width=32, lr=0.05, optimizer="sgd", train_samples=256, eval_samples=64)
    clipped = epochs(1, max_grad_norm=0.05)
    full, _ = train(workload, LoopPlan(32, 32, 64), clipped)
    accumulated, _ = train(workload, LoopPlan(8, 32, 64), clipped)
    unclipped, _ = train(workload, LoopPlan(32, 32, 64), epochs(1))
    for a, b in zip(weights(full), weights(accumulated)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert any(not torch.allclose(a, b) for a, b in zip(weights(full), weights(unclipped)))


def test_a_mid_epoch_checkpoint_resumes_as_if_never_interrupted():
    """Dropout included: a step's randomness depends on (seed, step), not on where training resumed."""
    workload = CNNWorkload(width=8, train_samples=256, eval_samples=32)
    plan = LoopPlan(micro_batch=16, effective_batch=32, eval_batch=32)
    settings = LoopSettings(Stop(epochs=2), eval_every=Every("steps", 3), schedule=LrSchedule(2, "cosine"))
    straight, straight_milestones = train(workload, plan, settings)

    device = CpuDevice()
    first = Trainer(workload, device, plan, settings)
    run = first.run()
    next(run)
    middle = next(run)  # step 6 of 8 per epoch: inside the first epoch
    assert middle.progress == Progress(epoch=0, step_in_epoch=6, step=6)
    state = first.state_dict()
    resumed, resumed_milestones = train(workload, plan, settings, state=state)

    assert [m.progress.step for m in resumed_milestones] == [9, 12, 15, 16]
    assert resumed_milestones[-1].eval == straight_milestones[-1].eval
    for a, b in zip(weights(straight), weights(resumed)):
        torch.testing.assert_close(a, b)
    assert resumed.scheduler.get_last_lr() == straight.scheduler.get_last_lr()


def test_a_step_budget_ends_mid_epoch_and_evaluates_at_its_cadence():
    workload = MLPWorkload(width=16, train_samples=256, eval_samples=64)  # 8 steps per epoch
    settings = LoopSettings(Stop(epochs=5, steps=13), eval_every=Every("steps", 5), checkpoint_every=Every("steps", 2))
    trainer, milestones = train(workload, LoopPlan(32, 32, 64), settings)
    assert trainer.total_steps == 13 and trainer.progress == Progress(epoch=1, step_in_epoch=5, step=13)
    seen = [(m.progress.step, bool(m.eval), m.checkpoint, m.final) for m in milestones]
    assert seen == [(2, False, True, False), (4, False, True, False), (5, True, False, False),
                    (6, False, True, False), (8, False, True, False), (10, True, True, False),
                    (12, False, True, False), (13, True, True, True)]
    assert all(m.train_loss is not None for m in milestones)


def test_eval_every_epochs_and_the_epoch_budget():
    workload = MLPWorkload(width=16, train_samples=128, eval_samples=64)
    trainer, milestones = train(workload, LoopPlan(32, 32, 64), epochs(4, eval_every=Every("epochs", 2)))
    assert [(m.progress.epoch, m.progress.step, m.checkpoint) for m in milestones] == [(2, 8, True), (4, 16, True)]
    assert trainer.done and set(milestones[-1].eval) == {"eval_loss"}


@dataclasses.dataclass
class Scored(MLPWorkload):
    metrics = ("loss", "accuracy")

    def eval_metrics(self, model, batch, samples):
        x, y = batch
        logits = model(x)
        return {"loss": F.cross_entropy(logits, y, reduction="sum"), "accuracy": (logits.argmax(-1) == y).sum()}


def test_eval_metrics_are_summed_over_the_eval_set_and_averaged():
    workload = Scored(width=32, lr=0.01, train_samples=512, eval_samples=100)
    trainer, milestones = train(workload, LoopPlan(64, 64, 32), epochs(3))  # eval batches 32+32+32+4
    last = milestones[-1].eval
    assert set(last) == {"eval_loss", "eval_accuracy"}
    x, y = workload.eval_data().tensors
    with torch.no_grad():
        logits = trainer.model(x)
    assert last["eval_accuracy"] == pytest.approx((logits.argmax(-1) == y).float().mean().item())
    assert last["eval_loss"] == pytest.approx(F.cross_entropy(logits, y).item(), rel=1e-5)
    assert last["eval_accuracy"] > 0.5  # it learned something


def test_eval_every_max_batches_evaluates_the_first_batches_of_the_effective_batch_whatever_the_eval_batch():
    workload = Scored(width=32, lr=0.01, train_samples=128, eval_samples=100)
    capped = epochs(1, eval_every=Every("epochs", 1, max_batches=2))  # 2 x 32: the first 64 eval samples
    trainer, (milestone,) = train(workload, LoopPlan(32, 32, 64), capped)
    _, (smaller,) = train(workload, LoopPlan(32, 32, 16), capped)  # an OOM's smaller eval batch: the same samples
    x, y = workload.eval_data().tensors
    with torch.no_grad():
        logits = trainer.model(x[:64])
    assert milestone.eval["eval_accuracy"] == pytest.approx((logits.argmax(-1) == y[:64]).float().mean().item())
    assert milestone.eval["eval_loss"] == pytest.approx(F.cross_entropy(logits, y[:64]).item(), rel=1e-5)
    assert smaller.eval == pytest.approx(milestone.eval, rel=1e-5)
    _, (whole,) = train(workload, LoopPlan(32, 32, 64), epochs(1, eval_every=Every("epochs", 1, max_batches=4)))
    _, (default,) = train(workload, LoopPlan(32, 32, 64), epochs(1))
    assert whole.eval == default.eval  # 4 x 32 > 100 samples: the whole eval set


def test_each_milestone_carries_the_learning_rate_and_the_training_speed():
    workload = MLPWorkload(width=16, train_samples=128, eval_samples=32)
    settings = epochs(1, eval_every=Every("steps", 2), schedule=LrSchedule(warmup_steps=4))
    _, milestones = train(workload, LoopPlan(16, 32, 32), settings)  # 4 steps of 32
    assert [m.learning_rate for m in milestones] == pytest.approx([0.5e-3, 1e-3])  # after steps 2 and 4
    for m in milestones:
        assert m.speed.steps_per_second > 0
        assert m.speed.samples_per_second == pytest.approx(32 * m.speed.steps_per_second)


def test_reduce_lr_on_plateau_divides_the_lr_once_the_eval_loss_stops_improving():
    trainer, milestones = train(PlateauWorkload(), LoopPlan(8, 8, 8), epochs(2, eval_every=Every("steps", 1)))
    assert [m.eval["eval_loss"] for m in milestones] == [0.75, 0.5, 0.25, 0.0, 0.0, 0.0]
    # Per evaluation, not per optimizer step: steps 1-4 improve, 5 and 6 do not (patience 0, factor 1/4).
    assert [m.learning_rate for m in milestones] == [0.25, 0.25, 0.25, 0.25, 0.0625, 0.015625]
    assert trainer.scheduler.last_epoch == 6


def test_a_plateau_scheduler_steps_on_the_sweeps_metric():
    _, milestones = train(PlateauWorkload(), LoopPlan(8, 8, 8), epochs(2, eval_every=Every("steps", 1), metric="train_loss"))
    # The training loss of step n is the eval loss of step n - 1: improving through step 5.
    assert [m.learning_rate for m in milestones] == [0.25] * 5 + [0.0625]
    with pytest.raises(MetricsMismatch, match="ReduceLROnPlateau steps on the sweep's metric 'eval_accuracy'"):
        train(PlateauWorkload(), LoopPlan(8, 8, 8), epochs(1, metric="eval_accuracy"))


def test_a_plateau_scheduler_against_the_sweeps_mode_is_refused():
    with pytest.raises(ValueError, match="ReduceLROnPlateau has mode='min' but the sweep's metric eval_loss has mode: max"):
        train(PlateauWorkload(), LoopPlan(8, 8, 8), epochs(1, mode="max"))


def test_a_plateau_scheduler_resumes_mid_epoch_with_its_state():
    settings = epochs(2, eval_every=Every("steps", 1))
    plan = LoopPlan(8, 8, 8)
    straight, straight_milestones = train(PlateauWorkload(), plan, settings)
    first = Trainer(PlateauWorkload(), CpuDevice(), plan, settings)
    run = first.run()
    for _ in range(4):
        middle = next(run)
    assert middle.progress == Progress(epoch=1, step_in_epoch=1, step=4)
    resumed, resumed_milestones = train(PlateauWorkload(), plan, settings, state=first.state_dict())
    assert resumed.scheduler.state_dict() == straight.scheduler.state_dict()
    assert [m.learning_rate for m in resumed_milestones] == [m.learning_rate for m in straight_milestones[4:]]


def train_recovering_from_ooms(workload, plan, settings, capacity):
    """As a trial does (``orchestrator.trial.run``): after an OOM, a new trainer with half the
    micro-batch resumes from the last checkpoint. Every milestone reported, replays included."""
    device, state, reported, ooms = EmulatedDevice(capacity), None, [], 0
    with device.measuring():
        while True:
            trainer = Trainer(workload, device, plan, settings)
            if state is not None:
                trainer.load_state_dict(state)
            try:
                for milestone in trainer.run():
                    reported.append(milestone)
                    if milestone.checkpoint:
                        state = copy.deepcopy(trainer.state_dict())
                return trainer, reported, ooms
            except torch.OutOfMemoryError:
                ooms += 1
                plan = dataclasses.replace(plan, micro_batch=plan.micro_batch // 2)


def test_an_oom_replay_steps_a_plateau_scheduler_once_per_evaluation():
    """Checkpoints every 2 steps, an evaluation every step: the OOM at step 4 resumes from step 2's
    checkpoint and evaluates step 3 again, which steps the scheduler it restored, not the one
    that had already stepped on step 3."""
    settings = epochs(2, eval_every=Every("steps", 1), checkpoint_every=Every("steps", 2))
    plan = LoopPlan(8, 8, 8)
    straight, straight_milestones = train(PlateauWorkload(views=64), plan, settings)
    replayed, reported, ooms = train_recovering_from_ooms(PlateauWorkload(views=64), plan, settings, 100_000)
    assert ooms == 1 and replayed.plan.micro_batch == 4
    assert [m.progress.step for m in reported] == [1, 2, 3, 3, 4, 5, 6]  # step 3 evaluated twice
    assert replayed.scheduler.state_dict() == straight.scheduler.state_dict()
    assert replayed.scheduler.last_epoch == 6  # one step per evaluation of the finished history
    assert [m.learning_rate for m in reported[3:]] == [m.learning_rate for m in straight_milestones[2:]]


def test_undeclared_eval_metrics_are_refused_by_name():
    class Undeclared(Scored):
        metrics = ("loss",)

    with pytest.raises(MetricsMismatch, match="Undeclared.eval_metrics/summarize_metrics report accuracy, loss"):
        train(Undeclared(train_samples=64, eval_samples=16), LoopPlan(32, 32, 16), epochs(1))


def test_a_loss_that_is_not_one_number_stops_the_first_step_saying_so():
    """A trial that trains without an estimate (``memory.estimator: none``) meets at its first step
    the refusal the estimators give before a sweep starts, not autograd's message."""
    class LossAndMetrics(MLPWorkload):
        def loss(self, model, batch):
            return super().loss(model, batch), {"accuracy": 0.5}

    with pytest.raises(LossTypeError, match=r"LossAndMetrics\.loss \(tests/test_loop\.py:\d+\) returned a tuple of 2"):
        train(LossAndMetrics(train_samples=64, eval_samples=16), LoopPlan(32, 32, 16), epochs(1))


def test_worker_processes_feed_the_same_steps():
    workload = MLPWorkload(width=16, lr=0.01, train_samples=256, eval_samples=64)
    inline, _ = train(workload, LoopPlan(16, 32, 64), epochs(2))
    workers, _ = train(workload, LoopPlan(16, 32, 64), epochs(2, data=DataLoading(num_workers=2, persistent_workers=True)))
    for a, b in zip(weights(inline), weights(workers)):
        torch.testing.assert_close(a, b)


def test_loss_goes_down_on_the_synthetic_data():
    for workload in (MLPWorkload(lr=0.01), CNNWorkload(lr=0.01)):
        _, milestones = train(workload, LoopPlan(64, 64, 128), epochs(3))
        chance = math.log(workload.classes)  # the loss of a model that learned nothing
        assert milestones[-1].eval["eval_loss"] < 0.6 * chance, (workload, [m.eval for m in milestones])
        assert milestones[-1].train_loss < milestones[0].train_loss


def test_cpu_peak_counts_parameters_gradients_optimizer_state_and_activations():
    workload = MLPWorkload(width=256, depth=1, in_features=256, classes=8, optimizer="adamw",
                           train_samples=64, eval_samples=64)
    trainer, milestones = train(workload, LoopPlan(64, 64, 64), epochs(1))
    params = sum(p.numel() * 4 for p in trainer.model.parameters())
    reading = milestones[0].memory
    assert reading.source == "cpu_tensor_tracker" and reading.peak_reserved is None
    # weights + grads + two AdamW moments, plus one micro-batch and its activations on top
    assert reading.peak_allocated > 4 * params
    assert reading.peak_allocated < 4 * params + 64 * (256 + 256 + 256 + 8) * 4 * 4


def test_the_dataset_is_host_memory_and_a_batch_is_device_memory_while_in_use():
    """On the CPU the tracker counts what a GPU would hold: not the dataset the loader reads."""
    small = MLPWorkload(width=16, in_features=64, train_samples=64, eval_samples=64)
    large = dataclasses.replace(small, train_samples=64 * 64)  # 64x the data, one step per epoch either way
    settings = LoopSettings(Stop(steps=1))
    _, (a,) = train(small, LoopPlan(64, 64, 64), settings)
    _, (b,) = train(large, LoopPlan(64, 64, 64), settings)
    assert a.memory.peak_allocated == b.memory.peak_allocated


@dataclasses.dataclass
class WatchedMLP(MLPWorkload):
    """Records, per micro-batch (train) and eval batch, whether a tensor tracker was watching it."""

    watched: list = dataclasses.field(default_factory=list)  # (model.training, watched), in order

    def loss(self, model, batch):
        from torch.utils._python_dispatch import _get_current_dispatch_mode

        self.watched.append((model.training, _get_current_dispatch_mode() is not None))
        return super().loss(model, batch)

    def measured(self, training: bool, per_step: int = 1) -> list[int]:
        """The steps (or eval batches), from 1, that the tracker watched."""
        calls = [w for t, w in self.watched if t == training]
        return [i // per_step + 1 for i in range(0, len(calls), per_step) if calls[i]]


def test_the_cpu_measures_a_windows_first_step_a_second_where_the_first_made_state_then_one_a_second(monkeypatch):
    """Counting every op costs a small model 2-3x its step time; sampled steps peak as the rest.
    The first step of a trainer creates the optimizer's state: its window measures the step
    after it too; later windows measure one train step. Each phase's peaks are the ones
    measuring every step finds."""
    from orchestrator.device import cpu

    workload = WatchedMLP(width=64, train_samples=64 * 32, eval_samples=192)
    settings = epochs(3)  # a report window per epoch, 32 steps each; an evaluation of three batches
    # Sampled once an hour, so how fast a loaded machine runs the steps does not change the count.
    monkeypatch.setattr(cpu, "CPU_SAMPLE_EVERY_S", 3600.0)
    _, sampled = train(workload, LoopPlan(32, 64, 64), settings)  # two micro-batches a step
    assert workload.measured(True, per_step=2) == [1, 2, 33, 65]
    # Eval batches: the first two of each evaluation, as the first finds no running total of the eval sums yet.
    assert workload.measured(False) == [1, 2, 4, 5, 7, 8]

    monkeypatch.setattr(cpu, "CPU_SAMPLE_EVERY_S", 0.0)  # every step measured
    everything = WatchedMLP(width=64, train_samples=64 * 32, eval_samples=192)
    _, full = train(everything, LoopPlan(32, 64, 64), settings)
    assert all(w for _, w in everything.watched)
    for a, b in zip(sampled, full, strict=True):
        assert (a.train_memory, a.eval_memory, a.memory) == (b.train_memory, b.eval_memory, b.memory)


def test_a_new_trainer_on_the_cpu_measures_two_steps_unless_it_resumes_with_the_optimizers_state(monkeypatch):
    """After an OOM or a switch of plan a trial builds a new trainer on the same device: a fresh
    optimizer makes its state again (two steps measured); one loaded from a checkpoint has it (one)."""
    from orchestrator.device import cpu

    monkeypatch.setattr(cpu, "CPU_SAMPLE_EVERY_S", 3600.0)
    settings, plan = epochs(1), LoopPlan(64, 64, 64)
    device = CpuDevice()
    with device.measuring():
        first = WatchedMLP(width=64, train_samples=64 * 8, eval_samples=64)
        trained = Trainer(first, device, plan, settings)
        list(trained.run())
        resumed_workload, fresh_workload = (WatchedMLP(width=64, train_samples=64 * 8, eval_samples=64) for _ in "ab")
        resumed = Trainer(resumed_workload, device, plan, epochs(2))
        resumed.load_state_dict(trained.state_dict())
        device.reset_peak()
        list(resumed.run())
        device.reset_peak()
        list(Trainer(fresh_workload, device, plan, settings).run())
    assert first.measured(True) == [1, 2]
    assert resumed_workload.measured(True) == [1]  # its epoch 2's first step: the state was loaded
    assert fresh_workload.measured(True) == [1, 2]


def test_the_cpu_leaves_its_tracker_aside_between_unsampled_steps_and_puts_it_back_for_anything_else(monkeypatch):
    """A run of unsampled steps does not push and pop the tracker around each one; a sampled
    step, a reading, a step that fails and the end of ``measuring`` each find it back in place."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    from orchestrator.device import cpu

    monkeypatch.setattr(cpu, "CPU_SAMPLE_EVERY_S", 3600.0)
    device = CpuDevice()

    def step(expect_watched: bool) -> None:
        with device.step("train", tuple):
            assert (_get_current_dispatch_mode() is device.tracker) is expect_watched

    with device.measuring():
        step(True), step(True)  # a trainer's first two steps are sampled (the first finds no settled state)
        step(False)
        assert _get_current_dispatch_mode() is None  # left aside until something other than a step
        step(False)
        kept = torch.ones(1024)  # made while aside: counted by the state it leaves at a sampled step
        assert device.reading().peak_allocated == 0
        assert _get_current_dispatch_mode() is device.tracker  # the reading put it back
        step(False)
        with pytest.raises(RuntimeError, match="the step failed"), device.step("train", tuple):
            raise RuntimeError("the step failed")
        assert _get_current_dispatch_mode() is device.tracker  # its error is handled under the tracker
        step(False)
        device.reset_peak()
        step(True)  # a new window's first step
        device.track([kept])
        assert device.allocated() == kept.nbytes
        step(False)
    assert _get_current_dispatch_mode() is None  # the end of measuring put it back and popped it
    with device.measuring():
        assert _get_current_dispatch_mode() is device.tracker


# -- divergence ------------------------------------------------------------------------------


def test_a_nan_loss_ends_training_at_its_step_with_the_last_finite_loss():
    from tests.workloads import NanLossWorkload
    from trainables.divergence import TrainingDiverged

    workload = NanLossWorkload(width=16, train_samples=256, eval_samples=32, nan_at_step=5)
    settings = LoopSettings(Stop(epochs=3), eval_every=Every("steps", 2))
    trainer = Trainer(workload, CpuDevice(), LoopPlan(micro_batch=8, effective_batch=32, eval_batch=32), settings)
    losses, reached = [], []
    original = trainer._advance

    def advance(loss, grad_norm=None):
        losses.append(float(loss))
        original(loss, grad_norm)

    trainer._advance = advance
    with pytest.raises(TrainingDiverged) as diverged:
        for milestone in trainer.run():
            reached.append(milestone.progress.step)
    d = diverged.value.divergence
    assert (d.step, d.epoch, d.what) == (5, 1, "loss")
    assert d.last_finite_loss == pytest.approx(losses[3]) and math.isnan(losses[4])
    assert reached == [2, 4] and trainer.progress.step == 5  # on the CPU: stopped at the bad step itself
    assert "loss not finite at step 5 (epoch 1); last finite loss" in str(diverged.value)


def test_an_infinite_clipped_gradient_norm_is_divergence_too():
    from tests.workloads import NanLossWorkload
    from trainables.divergence import TrainingDiverged

    workload = NanLossWorkload(width=16, train_samples=256, eval_samples=32, nan_at_step=2, infinite_gradient=True)
    plan = LoopPlan(micro_batch=32, effective_batch=32, eval_batch=32)
    with pytest.raises(TrainingDiverged) as diverged:
        train(workload, plan, epochs(1, max_grad_norm=1.0))
    d = diverged.value.divergence
    assert (d.step, d.what) == (2, "gradient norm") and math.isfinite(d.last_finite_loss)


def test_on_nan_continue_trains_on_through_nan_losses():
    from tests.workloads import NanLossWorkload

    workload = NanLossWorkload(width=16, train_samples=256, eval_samples=32, nan_at_step=2)
    trainer, milestones = train(workload, LoopPlan(32, 32, 32), epochs(2, on_nan="continue"))
    assert trainer.done and [m.progress.epoch for m in milestones] == [1, 2]
    assert math.isnan(milestones[-1].train_loss)


def test_where_reading_the_watch_would_wait_it_is_read_at_milestones_and_names_the_first_bad_step():
    """On an accelerator the loop reads the watch only at milestones, where it reads its losses
    anyway: the steps up to the milestone run, and the bad step is still the one reported."""
    from tests.workloads import NanLossWorkload
    from trainables.divergence import TrainingDiverged

    workload = NanLossWorkload(width=16, train_samples=256, eval_samples=32, nan_at_step=5)
    settings = LoopSettings(Stop(epochs=3), eval_every=Every("steps", 4))
    trainer = Trainer(workload, CpuDevice(), LoopPlan(32, 32, 32), settings)
    trainer._watch.reads_free = False  # as on a GPU
    with pytest.raises(TrainingDiverged) as diverged:
        list(trainer.run())
    assert trainer.progress.step == 8 and diverged.value.divergence.step == 5


def test_a_workload_that_picks_its_optimizer_by_device_is_told_the_trials():
    """The trainer tells ``build_optimizer`` the device type it trains on: the CPU's loop here
    (on a GPU, the same workload takes fused AdamW: ``tests/test_memory_optimizer.py``)."""
    trainer = Trainer(DeviceOptimizerWorkload(width=8), CpuDevice(), LoopPlan(8, 8, 8), epochs(1))
    group = trainer.optimizer.param_groups[0]
    assert not group["fused"] and group["foreach"] is False
