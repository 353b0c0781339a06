"""A new device is one module plus one registration line: a toy device registered from this test is
accepted by the config, planned for by ``plan``'s rule, opened by a trial and trained on."""

import contextlib
from typing import ClassVar

import pytest

from orchestrator.config import parse_spec
from orchestrator.device import CpuDevice, MemoryReading
from orchestrator.device.emulated import CapacityTracker
from orchestrator.device_kinds import KINDS, DeviceKind, device_names, register_device
from orchestrator.errors import ConfigError
from orchestrator.plan_command import planning_target
from orchestrator.planner import make_plan
from orchestrator.trial.node import NodeInfo
from orchestrator.trial.run import open_trial_device, trial_target
from trainables.loop import LoopSettings, Trainer
from trainables.workload import build_workload

MiB = 2**20
SWEEP = {
    "experiment": "toy", "workload": {"name": "mlp", "params": {"width": 16, "train_samples": 96, "eval_samples": 32}},
    "search_space": {"lr": 0.01}, "effective_batch_size": 32, "stop": {"epochs": 1}, "resources": {"cpu": 1},
}


class CappedCpu(CpuDevice):
    """The toy device: the CPU with a capacity from ``memory.capacity``, every step counted against
    it. Its plans count as the emulated device's (its ``target``)."""

    target = "emulated"
    opened: ClassVar[list[CpuDevice]] = []

    @classmethod
    def open(cls, *, capacity=None, memory_fraction=None):
        device = cls(CapacityTracker(capacity))
        cls.opened.append(device)
        return device

    def capacity(self):
        return self.tracker.capacity

    def step(self, phase, state):
        return contextlib.nullcontext()  # every step measured, as on a card


@pytest.fixture
def toy():
    kind = register_device(DeviceKind("toy", CappedCpu, sized_by_config=True))  # the one registration line
    yield kind
    del KINDS["toy"]


def spec(**memory):
    return parse_spec({**SWEEP, "memory": memory})


def test_an_unregistered_device_is_one_line_naming_the_kinds():
    with pytest.raises(ConfigError, match=r"^memory.device: expected one of auto, cuda, cpu, emulated, got 'toy'$"):
        spec(device="toy")


def test_a_registered_device_is_planned_for_opened_and_trained_on(toy):
    assert device_names() == ("auto", "cuda", "cpu", "emulated", "toy")
    with pytest.raises(ConfigError, match="memory.capacity: memory.device 'toy' needs a capacity"):
        spec(device="toy")
    swept = spec(device="toy", capacity="6MiB", budget="4MiB", estimator="static")

    planned = planning_target(swept, None)  # what `orchestrator plan` plans for
    assert (planned.device, planned.kind, planned.budget) == ("toy", "emulated", 4 * MiB)
    workload = build_workload({"workload": "mlp", **SWEEP["workload"]["params"]})
    plan = make_plan(workload, swept.memory, swept.effective_batch_size, planned.budget, target=planned.kind)
    assert plan.refusal is None and plan.budget_bytes == 4 * MiB

    device = open_trial_device(swept, NodeInfo("id", "node", {}))  # what a trial opens
    assert CappedCpu.opened == [device] and device.capacity() == 6 * MiB
    target = trial_target(swept, device)
    assert (target.kind, target.budget) == (planned.kind, planned.budget)

    with device.measuring():
        trainer = Trainer(workload, device, plan, LoopSettings.of(swept), seed=0)
        milestones = list(trainer.run())
    assert milestones[-1].final and milestones[-1].progress.epoch == 1
    reading = milestones[-1].memory
    assert isinstance(reading, MemoryReading) and 0 < reading.peak_allocated <= device.capacity()
