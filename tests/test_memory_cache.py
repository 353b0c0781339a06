"""``orchestrator.memory.cache``: profiles estimated once per setting, and planned for the stages
of a module-activation schedule that the trial reaches."""

from __future__ import annotations

from orchestrator.config import MemoryPolicy, Stop
from orchestrator.memory import Settings
from orchestrator.memory.cache import ProfileCache
from orchestrator.memory.phases import TrainingLength, phases_of
from orchestrator.planner import make_plan
from orchestrator.units import MiB
from trainables.cnn import CNNWorkload
from trainables.staged import StagedMLPWorkload

# Its wide auxiliary block switches on at the third epoch (epoch 2, counted from 0).
STAGED = StagedMLPWorkload(width=16, aux_width=4096, aux_start_epoch=2)
POLICY = MemoryPolicy(estimator="trace")  # its stage 0 holds no gradient or optimizer state of the block
CNN = CNNWorkload(depth=2, image_size=32, train_samples=256, eval_samples=64)  # supports activation checkpointing


def names(profile) -> list[str]:
    return [p.name for p in profile.phases]


def test_a_stage_that_starts_after_the_last_epoch_is_not_planned_for():
    """A sweep of two epochs, run before the module that switches on at the third: its plan is
    the one that fits without the module, where the module alone would refuse it (post-mortem
    000's short sweep before the late modules). Its profile is estimated whole all the same."""
    whole = ProfileCache(STAGED, POLICY, "emulated")
    assert names(whole.get(Settings())) == ["train", "eval", "train@epoch3", "eval@epoch3"]
    short = ProfileCache(STAGED, POLICY, "emulated", length=TrainingLength(Stop(epochs=2), 64), known=dict(whole.cache))
    assert names(short.get(Settings())) == ["train", "eval"]
    three = TrainingLength(Stop(epochs=3), 64)
    assert names(ProfileCache(STAGED, POLICY, "emulated", length=three, known=dict(whole.cache)).get(Settings())) == names(
        whole.get(Settings()))
    assert short.shareable() == whole.shareable()  # what a worker with another budget may use, unchanged

    budget = 3 * MiB // 2  # the MLP fits; with the 4096-wide block (2 MiB of states), not even at micro-batch 1
    assert make_plan(STAGED, POLICY, 64, budget, target="emulated", profiles=whole).refusal
    planned = make_plan(STAGED, POLICY, 64, budget, target="emulated", profiles=short)
    assert planned.refusal is None and planned.micro_batch * planned.accum_steps == 64


def test_a_budget_of_steps_reaches_the_epochs_its_steps_start():
    """2,048 samples in steps of 128: 16 steps an epoch. Step 33 is the third epoch's first."""
    assert TrainingLength(Stop(steps=32), 128).epochs(STAGED) == 2
    assert TrainingLength(Stop(steps=33), 128).epochs(STAGED) == 3
    assert TrainingLength(Stop(epochs=10, steps=30), 128).epochs(STAGED) == 2  # whichever comes first
    assert TrainingLength(Stop(epochs=2, steps=1000), 128).epochs(STAGED) == 2
    assert TrainingLength(Stop(steps=30), 128).epochs(CNN) is None  # one stage: every epoch alike, no data built


def test_phases_are_those_of_the_stages_a_budget_of_epochs_reaches():
    assert [p.name for p in phases_of(STAGED)] == ["train", "eval", "train@epoch3", "eval@epoch3"]
    assert [p.name for p in phases_of(STAGED, 2)] == ["train", "eval"]
    assert [p.name for p in phases_of(STAGED, 3)] == [p.name for p in phases_of(STAGED)]
    assert [p.epoch for p in phases_of(STAGED)] == [0, 0, 2, 2]


class Untouchable:
    """A worker's device that must not be used: any use of it fails the test."""

    def __getattr__(self, name):
        raise AssertionError(f"the device was used after an OOM ({name})")


def test_an_oom_reductions_new_settings_are_estimated_without_the_device_unless_the_estimator_probes_it():
    """An OOM that turns activation checkpointing on asks for a profile the plan never needed: the
    trace makes it as the driver would, without the device, so the reduced plan still has a
    prediction; ``measured``, which would probe the device, makes none."""
    checkpointing = Settings("fp32", True)
    traced = ProfileCache(CNN, POLICY, "emulated", Untouchable())
    profile = traced.made(checkpointing)
    assert profile is not None and profile.settings == checkpointing and profile.estimator == "trace"
    measured = ProfileCache(CNN, MemoryPolicy(estimator="measured"), "emulated", Untouchable())
    assert measured.made(checkpointing) is None and checkpointing not in measured.cache
