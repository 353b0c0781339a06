"""One rule for what a trial plans for: ``plan`` (and ``run`` before the Tuner starts) resolve the
same device kind and budget as a trial, and as every rank of a data-parallel group, opening its
device."""

import pytest

from orchestrator.config import parse_spec
from orchestrator.device import CpuDevice, EmulatedDevice
from orchestrator.device.target import resolve_target, trains_on
from orchestrator.plan_command import _rank_budgets, planning_target
from orchestrator.trial.node import CAPACITY_LABEL, NodeInfo
from orchestrator.trial.run import open_trial_device, trial_target

MiB = 2**20
SWEEP = {
    "experiment": "target", "workload": {"name": "mlp", "params": {"width": 16}}, "search_space": {"lr": 0.01},
    "effective_batch_size": 32, "stop": {"epochs": 1},
}
NODE = NodeInfo("id", "node", {})


def spec(memory=None, **resources):
    return parse_spec({**SWEEP, "memory": memory or {}, "resources": resources or {"cpu": 1}})


def trial(spec, rank=None, node=NODE):
    """What a trial (a rank of a group) resolves: the device it opens, and its target."""
    device = open_trial_device(spec, node, rank=rank)
    return device, trial_target(spec, device, rank=rank)


def test_the_planning_target_follows_the_trials_device():
    assert resolve_target(spec()).kind == "cpu"
    assert resolve_target(spec(gpu=0.5)).kind == "cuda"
    assert resolve_target(spec({"device": "emulated", "capacity": "1GiB"}, gpu=1)).kind == "emulated"


@pytest.mark.parametrize("memory, kind, budget", [
    ({"device": "emulated", "capacity": "8MiB", "budget": "6MiB"}, "emulated", 6 * MiB),  # the budget is smaller
    ({"device": "emulated", "capacity": "8MiB", "budget": "24MiB"}, "emulated", 8 * MiB),  # the device is smaller
    ({"device": "emulated", "capacity": "8MiB"}, "emulated", 8 * MiB),
    ({"device": "cpu", "budget": "6MiB"}, "cpu", 6 * MiB),
    ({"device": "cpu"}, "cpu", None),
    ({}, "cpu", None),  # auto with resources.gpu: 0
])
def test_plan_and_a_trial_agree_on_target_and_budget(memory, kind, budget):
    swept = spec(memory)
    planned = planning_target(swept, None)
    device, target = trial(swept)
    assert (planned.kind, planned.budget) == (target.kind, target.budget) == (device.target, budget) == (kind, budget)
    assert run_target(swept) == (kind, budget)


def run_target(swept):
    """What ``run`` estimates for before the Tuner starts (``runner.estimate_before_start``)."""
    planned = resolve_target(swept)
    return planned.kind, planned.budget


def test_resources_gpu_0_plans_for_the_cpu_even_where_a_gpu_is_visible():
    swept = spec({"budget": "6MiB"}, gpu=0)
    assert resolve_target(swept, gpu_here=True) == resolve_target(swept) == resolve_target(swept, gpu_here=False)
    assert resolve_target(swept, gpu_here=True).kind == "cpu"
    # A trial that asks for a GPU plans for one; a worker that sees none trains on its CPU.
    gpu = spec({"budget": "6MiB"}, gpu=1)
    assert resolve_target(gpu).kind == resolve_target(gpu, gpu_here=True).kind == "cuda"
    assert resolve_target(gpu, gpu_here=False).kind == "cpu"


def test_a_gpus_budget_is_the_smaller_of_the_configs_and_the_cards():
    swept = spec({"device": "cuda", "budget": "8GiB"}, gpu=1)
    assert planning_target(swept, None).budget == 8 * 2**30  # no NVML needed where the config says
    # A trial on a 24 GiB card with 20 GiB free, and on a 6 GiB card.
    assert resolve_target(swept, measured=20 * 2**30, gpu_here=True).budget == 8 * 2**30
    assert resolve_target(swept, measured=6 * 2**30, gpu_here=True).budget == 6 * 2**30
    # plan --device-memory: a card of that size, the config's budget within it, as on a trial.
    card = planning_target(swept, "6GiB")
    assert (card.kind, card.budget) == ("cuda", 6 * 2**30)
    assert planning_target(swept, "24GiB").budget == 8 * 2**30
    assert planning_target(spec({"device": "emulated", "capacity": "8MiB"}), "4MiB").kind == "emulated"


def test_every_rank_of_a_group_resolves_its_own_capacity_as_plan_does():
    swept = spec({"device": "emulated", "capacity": ["64MiB", "8MiB"], "budget": "32MiB"}, workers=2, cpu=1)
    planned = planning_target(swept, None)
    ranks = [trial(swept, rank) for rank in range(2)]
    assert _rank_budgets(swept, planned, card=False) == [t.budget for _, t in ranks] == [32 * MiB, 8 * MiB]
    assert planned.budget == 8 * MiB  # one rank's view: the smallest card
    assert all(isinstance(device, EmulatedDevice) for device, _ in ranks)


def test_a_node_that_declares_its_emulated_capacity_gives_its_trials_that_budget():
    swept = spec({"device": "emulated", "capacity": "8MiB", "budget": "24MiB"})
    device, target = trial(swept, node=NodeInfo("id", "big", {CAPACITY_LABEL: "16MiB"}))
    assert device.capacity() == 16 * MiB and target.budget == 16 * MiB
    device, target = trial(spec({"device": "cpu"}))
    assert isinstance(device, CpuDevice) and target.capacity is None


@pytest.mark.integration
def test_a_trial_of_a_sweep_plans_on_the_budget_plan_shows(tmp_path, local_ray, capsys):
    """The case that disagreed: memory.budget above memory.capacity. `plan` showed the budget,
    the trial used the device's capacity; both use the smaller now."""
    import json
    from argparse import Namespace

    import yaml

    from orchestrator.plan_command import plan_command
    from orchestrator.runner import run_sweep
    from tests.conftest import trial_results

    raw = {**SWEEP, "memory": {"device": "emulated", "capacity": "8MiB", "budget": "24MiB", "estimator": "static"},
           "resources": {"cpu": 1}}
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(raw))
    args = Namespace(config=str(path), overrides=[], device_memory=None, estimator=None, json=True)
    assert plan_command(args) == 0
    shown = json.loads(capsys.readouterr().out)
    outcome = run_sweep(parse_spec(raw), tracking_uri=f"sqlite:///{tmp_path}/mlflow.db", storage_path=str(tmp_path / "results"))
    assert outcome.ok
    [reports] = trial_results(f"{outcome.experiment_path}/*/result.json").values()
    assert (shown["target"], shown["budget_bytes"]) == ("emulated", 8 * MiB)
    assert {r["budget_bytes"] for r in reports} == {shown["budget_bytes"]}


@pytest.mark.parametrize("memory, resources, device_type", [
    ({}, {"cpu": 1}, "cpu"),
    ({"device": "emulated", "capacity": "8MiB"}, {"cpu": 1, "gpu": 1}, "cpu"),
    ({}, {"cpu": 1, "gpu": 1}, "cuda"),
])
def test_what_a_workload_is_told_it_trains_on_follows_the_target(memory, resources, device_type):
    """The torch device type an estimate builds the optimizer for (from the target's kind) is the
    one the trial's device has, and the one ``plan`` plans for (from the target's device)."""
    target = resolve_target(spec(memory, **resources))
    assert trains_on(target.kind) == trains_on(target.device) == device_type
    if device_type == "cpu":  # a device this machine can open
        device, _ = trial(spec(memory, **resources))
        assert device.torch_device.type == device.torch_type == device_type
