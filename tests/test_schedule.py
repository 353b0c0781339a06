"""Learning-rate schedules: the sweep's warm-up and decay shapes, or the workload's own scheduler."""

import math

import pytest
import torch

from orchestrator.config import LrSchedule
from trainables.mlp import MLPWorkload
from trainables.schedule import build_lr_scheduler, lr_factor, steps_on_metric


def test_warm_up_then_each_decay_shape():
    total = 110
    for decay in ("constant", "linear", "cosine"):
        schedule = LrSchedule(warmup_steps=10, decay=decay, final_lr=0.1)
        assert [lr_factor(schedule, s, total) for s in (0, 5)] == [0.0, 0.5]
        assert lr_factor(schedule, 10, total) == 1.0
    assert lr_factor(LrSchedule(10, "constant"), 109, total) == 1.0
    assert lr_factor(LrSchedule(10, "linear", 0.1), 60, total) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_factor(LrSchedule(10, "cosine", 0.1), 60, total) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_factor(LrSchedule(10, "cosine", 0.1), 35, total) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4)))
    assert lr_factor(LrSchedule(10, "linear", 0.1), total, total) == pytest.approx(0.1)


def test_the_workload_scheduler_wins_and_none_means_a_constant_lr():
    class OwnSchedule(MLPWorkload):
        def build_scheduler(self, optimizer, total_steps):
            return torch.optim.lr_scheduler.StepLR(optimizer, step_size=total_steps // 2)

    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    assert isinstance(build_lr_scheduler(OwnSchedule(), optimizer, 10, None), torch.optim.lr_scheduler.StepLR)
    assert build_lr_scheduler(MLPWorkload(), optimizer, 10, None) is None
    scheduler = build_lr_scheduler(MLPWorkload(), optimizer, 10, LrSchedule(warmup_steps=4))
    lrs = []
    for _ in range(5):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert lrs == pytest.approx([0.0, 0.025, 0.05, 0.075, 0.1])


def test_a_scheduler_whose_step_takes_a_value_steps_on_the_metric():
    optimizer = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    assert steps_on_metric(torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer))
    assert not steps_on_metric(torch.optim.lr_scheduler.StepLR(optimizer, step_size=2))
    assert not steps_on_metric(torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0))
    assert not steps_on_metric(None)
