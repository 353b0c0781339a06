"""A new estimator is one function and one registration line (docs/ARCHITECTURE.md, "How to add an
estimator"): a toy one, registered from this test, is accepted by the sweep file and `plan`,
estimated by the driver and planned with."""

from __future__ import annotations

import json
from argparse import Namespace

import pytest

from orchestrator import estimator_registry
from orchestrator.config import load_spec
from orchestrator.errors import ConfigError
from orchestrator.estimates import estimate_trials
from orchestrator.memory import EstimateRequest, MemoryProfile, PhaseProfile, estimate
from orchestrator.memory.phases import phases_of
from orchestrator.plan_command import plan_command
from orchestrator.planner import make_plan
from orchestrator.space import trial_configs
from trainables.workload import build_workload

MiB = 2**20

SWEEP = """
experiment: registry_test
workload: {{name: mlp}}
search_space: {{lr: {{grid: [0.001, 0.01]}}}}
effective_batch_size: 32
stop: {{epochs: 1}}
resources: {{cpu: 1}}
memory: {{device: emulated, capacity: {capacity}, estimator: {estimator}, safety_margin: 1.0}}
"""


def flat_guess(workload, request: EstimateRequest) -> MemoryProfile:
    """A toy estimator: 4 MiB of states and 1 MiB per sample in every phase of the workload."""
    phases = tuple(
        PhaseProfile(p.name, p.kind, params=4 * MiB, grads=0, optimizer=0, buffers=0, activations_per_sample=MiB,
                     fixed_other=0, fragmentation=0.0)
        for p in phases_of(workload)
    )
    return MemoryProfile("flat", request.settings, request.target, phases, ("a flat guess",))


@pytest.fixture
def registry(monkeypatch):
    """The registry as it is, with this test's registrations undone after it."""
    monkeypatch.setattr(estimator_registry, "ESTIMATORS", dict(estimator_registry.ESTIMATORS))
    return estimator_registry


@pytest.fixture
def sweep(tmp_path):
    def write(estimator="flat", capacity="16MiB"):
        path = tmp_path / "sweep.yaml"
        path.write_text(SWEEP.format(estimator=estimator, capacity=capacity))
        return str(path)

    return write


def test_a_registered_estimator_is_configured_estimated_and_planned_with(registry, sweep):
    registry.register("flat", flat_guess)
    spec = load_spec(sweep())
    assert spec.memory.estimator == "flat"

    workload = build_workload(trial_configs(spec)[0])
    assert estimate(workload, "flat", target="emulated").notes == ("a flat guess",)
    plan = make_plan(workload, spec.memory, 32, 16 * MiB, target="emulated")
    assert plan.estimator == "flat" and plan.refusal is None
    # 4 MiB + 12 x 1 MiB fill 16 MiB: 32 samples take three passes, 11 + 11 + 10, and eval 12 at once.
    assert (plan.micro_batch, plan.eval_batch, plan.predicted_peak_bytes) == (11, 12, 16 * MiB)

    estimates = estimate_trials(trial_configs(spec), spec.memory, "emulated", 16 * MiB, 32, processes=1)
    assert not estimates.errors and len(estimates.by_signature) == 1  # lr is memory-neutral: one estimate
    [profiles] = estimates.by_signature.values()
    assert {p.estimator for p in profiles.values()} == {"flat"}


def test_plan_takes_a_registered_estimator_by_name(registry, sweep, capsys):
    registry.register("flat", flat_guess)
    args = Namespace(config=sweep(estimator="trace"), overrides=[], device_memory=None, estimator="flat", json=True)
    assert plan_command(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["estimator"] == "flat" and {t["plan"]["estimator"] for t in report["trials"]} == {"flat"}


def test_the_sweep_file_names_the_registered_estimators(registry, sweep):
    with pytest.raises(ConfigError, match="memory.estimator: expected one of static, trace, measured, none, got 'flat'"):
        load_spec(sweep())
    registry.register("flat", "tests.test_estimator_registry:flat_guess")  # by import path, as the built-in ones
    assert load_spec(sweep()).memory.estimator == "flat"
    with pytest.raises(ValueError, match="an estimator's name must be an identifier other than 'none'"):
        registry.register("none", flat_guess)
