"""The planner's rules on hand-made profiles, and one plan checked against a real emulated run."""

from __future__ import annotations

import json

import pytest

from orchestrator.config import MemoryPolicy, Stop
from orchestrator.device import EmulatedDevice
from orchestrator.estimates import ProfileCache
from orchestrator.memory import MemoryProfile, PhaseProfile, Settings
from orchestrator.planner import Plan, make_plan, next_reduction
from trainables.cnn import CNNWorkload
from trainables.loop import LoopPlan, LoopSettings, Trainer
from trainables.mlp import MLPWorkload


def phase(name, kind, fixed, per_sample):
    return PhaseProfile(name, kind, params=fixed, grads=0, optimizer=0, buffers=0,
                        activations_per_sample=per_sample, fixed_other=0)


def profile(settings, *phases):
    return MemoryProfile("trace", settings, "emulated", tuple(phases))


class HandMadeProfiles(ProfileCache):
    """Profiles written by the test, handed to the planner as the driver hands its estimates to a
    trial; records the settings the planner asked for, in order."""

    def __init__(self):
        super().__init__(workload=None, policy=None, target="emulated")
        self.asked: list[Settings] = []

    def get(self, settings: Settings) -> MemoryProfile | None:
        self.asked.append(settings)
        return self.cache[settings]

    def __setitem__(self, settings: Settings, profile: MemoryProfile) -> None:
        self.cache[settings] = profile

    def __getitem__(self, settings: Settings) -> MemoryProfile:
        return self.cache[settings]


@pytest.fixture
def profiles():
    return HandMadeProfiles()


def policy(**kwargs):
    return MemoryPolicy(**{"safety_margin": 1.0, **kwargs})


FP32 = Settings("fp32")
CKPT = Settings("fp32", True)
BF16 = Settings("bf16")
BF16_CKPT = Settings("bf16", True)


def test_largest_micro_batch_that_fits_and_divides(profiles):
    profiles[FP32] = profile(FP32, phase("train", "train", 100, 10), phase("eval", "eval", 100, 1))
    plan = make_plan(MLPWorkload(), policy(), 180, 1000, target="emulated", profiles=profiles)  # 100 + 10m <= 1000: m <= 90
    assert (plan.micro_batch, plan.accum_steps, plan.effective_batch) == (90, 2, 180)
    assert plan.note == ""
    assert plan.predicted_peak_bytes == 1000 and plan.predicted_phase in ("train", "eval")


def test_prefers_a_divisor_within_ten_percent(profiles):
    profiles[FP32] = profile(FP32, phase("train", "train", 100, 10), phase("eval", "eval", 100, 1))
    plan = make_plan(MLPWorkload(), policy(), 170, 1000, target="emulated", profiles=profiles)  # 85 divides 170, 85 >= 0.9 * 90
    assert (plan.micro_batch, plan.accum_steps, plan.note) == (85, 2, "")


def test_non_divisor_when_the_divisor_costs_too_much(profiles):
    profiles[FP32] = profile(FP32, phase("train", "train", 100, 10), phase("eval", "eval", 100, 1))
    plan = make_plan(MLPWorkload(), policy(), 256, 1000, target="emulated", profiles=profiles)  # divisor 64 < 0.9 * 90
    assert (plan.micro_batch, plan.accum_steps) == (90, 3)
    assert "does not divide" in plan.note and "one of 76" in plan.note


def test_safety_margin_shrinks_the_budget(profiles):
    profiles[FP32] = profile(FP32, phase("train", "train", 100, 10), phase("eval", "eval", 100, 1))
    plan = make_plan(MLPWorkload(), policy(safety_margin=0.5), 40, 1000, target="emulated", profiles=profiles)  # m <= 40
    assert plan.micro_batch == 40 and plan.predicted_peak_bytes <= 500


def test_eval_batch_from_the_eval_phase_capped(profiles):
    profiles[FP32] = profile(FP32, phase("train", "train", 100, 10), phase("eval", "eval", 100, 3))
    plan = make_plan(MLPWorkload(eval_samples=10_000), policy(), 32, 1000, target="emulated", profiles=profiles)
    assert plan.eval_batch == 128  # 4 x effective batch, though 300 would fit
    plan = make_plan(MLPWorkload(eval_samples=50), policy(), 32, 1000, target="emulated", profiles=profiles)
    assert plan.eval_batch == 50  # the eval set
    plan = make_plan(MLPWorkload(eval_samples=10_000), policy(), 256, 1000, target="emulated", profiles=profiles)
    assert plan.eval_batch == 300  # its own profile, not the micro-batch


def test_worst_phase_decides(profiles):
    profiles[FP32] = profile(
        FP32, phase("train", "train", 100, 5), phase("eval", "eval", 100, 1),
        phase("train@epoch2", "train", 300, 10), phase("eval@epoch2", "eval", 100, 1),
    )
    plan = make_plan(MLPWorkload(), policy(), 100, 1000, target="emulated", profiles=profiles)
    assert plan.micro_batch == 70 and plan.predicted_phase == "train@epoch2"
    assert set(plan.predicted_phases) == {"train", "eval", "train@epoch2", "eval@epoch2"}


def test_checkpointing_then_lower_precision_when_nothing_fits(profiles):
    profiles[FP32] = profile(FP32, phase("train", "train", 2000, 10), phase("eval", "eval", 100, 1))
    profiles[CKPT] = profile(CKPT, phase("train", "train", 990, 1), phase("eval", "eval", 100, 1))
    plan = make_plan(CNNWorkload(), policy(), 64, 1000, target="emulated", profiles=profiles)
    assert plan.activation_checkpointing and plan.precision == "fp32" and plan.micro_batch == 10
    assert profiles.asked == [FP32, CKPT]  # the lower precision was never estimated

    profiles[CKPT] = profile(CKPT, phase("train", "train", 2000, 1), phase("eval", "eval", 100, 1))
    profiles[BF16] = profile(BF16, phase("train", "train", 900, 1), phase("eval", "eval", 100, 1))
    plan = make_plan(CNNWorkload(), policy(), 64, 1000, target="emulated", profiles=profiles)
    assert (plan.precision, plan.activation_checkpointing, plan.micro_batch) == ("bf16", False, 64)


def test_refusal_says_what_it_needs_and_what_would_fit(profiles):
    profiles[FP32] = profile(FP32, phase("train", "train", 2 * 2**30, 2**20), phase("eval", "eval", 100, 1))
    profiles[BF16] = profile(BF16, phase("train", "train", 2 * 2**30, 2**20), phase("eval", "eval", 100, 1))
    profiles[CKPT] = profile(CKPT, phase("train", "train", 2**29, 1), phase("eval", "eval", 100, 1))
    plan = make_plan(CNNWorkload(), policy(allow_activation_checkpointing=False), 64, 2**30, target="emulated",
                     profiles=profiles)
    assert plan.refusal.startswith("needs 2.00G at micro-batch 1 in train (params 2.00G, activations/sample 1.0MiB")
    assert "budget 1.00G" in plan.refusal
    assert "would fit with activation checkpointing (which the memory policy does not allow)" in plan.refusal
    assert plan.describe().startswith("refused")

    profiles[CKPT] = profiles[BF16_CKPT] = profiles[FP32]
    plan = make_plan(CNNWorkload(), policy(), 64, 2**30, target="emulated", profiles=profiles)
    assert plan.refusal.endswith("would not fit even with activation checkpointing and bf16")


def test_no_estimator_and_unbounded_budget(profiles):
    plan = make_plan(MLPWorkload(), policy(estimator="none"), 64, 1000, target="emulated", profiles=profiles)
    assert (plan.micro_batch, plan.eval_batch, plan.estimator, plan.predicted_peak_bytes) == (64, 64, "none", None)
    profiles[FP32] = profile(FP32, phase("train", "train", 100, 10), phase("eval", "eval", 100, 1))
    plan = make_plan(MLPWorkload(), policy(), 64, None, target="cpu", profiles=profiles)
    assert (plan.micro_batch, plan.accum_steps, plan.budget_bytes) == (64, 1, None)
    assert plan.predicted_peak_bytes == 100 + 10 * 64


def test_plan_round_trips_through_json(profiles):
    profiles[FP32] = profile(FP32, phase("train", "train", 100, 10), phase("eval", "eval", 100, 1))
    plan = make_plan(MLPWorkload(), policy(), 256, 1000, target="emulated", profiles=profiles)
    assert Plan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan


def test_reductions_keep_the_effective_batch():
    p = policy(lower_precision="bf16")
    plan = Plan(8, 4, 32, 64, False, "fp32", "trace", 1000, 900, "train", {"train": 900})
    steps = []
    while plan is not None:
        steps.append((plan.micro_batch, plan.accum_steps, plan.activation_checkpointing, plan.precision, plan.reductions))
        assert plan.effective_batch == 32
        plan = next_reduction(plan, p, "train", workload_supports_checkpointing=True)
    assert steps == [
        (8, 4, False, "fp32", 0), (4, 8, False, "fp32", 1), (2, 16, False, "fp32", 2), (1, 32, False, "fp32", 3),
        (1, 32, True, "fp32", 4), (1, 32, True, "bf16", 5),
    ]


def test_reductions_are_pure_and_clear_stale_predictions():
    plan = Plan(8, 4, 32, 64, False, "fp32", "trace", 1000, 900, "train", {"train": 900})
    reduced = next_reduction(plan, policy(), "train")
    assert plan.micro_batch == 8  # unchanged
    assert reduced.predicted_peak_bytes is None and reduced.predicted_phases == {}
    assert "micro-batch 8 -> 4" in reduced.note
    one = Plan(1, 32, 32, 64, False, "bf16", "trace", 1000, None, None)
    assert next_reduction(one, policy(lower_precision="bf16"), "train", workload_supports_checkpointing=False) is None


def test_eval_reductions_touch_only_the_eval_batch():
    plan = Plan(8, 4, 32, 3, False, "fp32", "trace", 1000, None, None)
    first = next_reduction(plan, policy(), "eval")
    assert (first.eval_batch, first.micro_batch, first.reductions) == (1, 8, 1)
    assert next_reduction(first, policy(), "eval") is None


def test_a_traced_plan_runs_on_the_emulated_device_without_oom():
    """The trace is exact on the CPU tracker, so its plan fits the emulated device it was made for."""
    workload = CNNWorkload(train_samples=128, eval_samples=64)
    capacity = 3 * 2**20
    plan = make_plan(workload, policy(safety_margin=0.95), 64, capacity, target="emulated")
    assert plan.refusal is None and plan.accum_steps > 1
    device = EmulatedDevice(capacity)
    with device.measuring():  # counted from the model's construction on, as in a trial
        trainer = Trainer(workload, device, LoopPlan(plan.micro_batch, 64, plan.eval_batch), LoopSettings(Stop(epochs=1)))
        (milestone,) = trainer.run()  # no OutOfMemoryError
    # the loop's own bookkeeping (its running loss) is the only difference
    assert milestone.memory.peak_allocated == pytest.approx(plan.predicted_peak_bytes, rel=1e-3)
