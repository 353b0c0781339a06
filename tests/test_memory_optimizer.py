"""The optimizer an estimate counts (``orchestrator/memory/optimizer.py``): the one the trial
builds on its device, run by the implementation it runs there (fused, foreach, for-loop)."""

from __future__ import annotations

import pytest
import torch

from orchestrator.memory import estimate
from orchestrator.memory.fake import fake_setup
from orchestrator.memory.optimizer import implementation
from tests.conftest import assert_traced_as_measured_on_cpu
from tests.workloads import DeviceOptimizerWorkload

#: Four layers of 128 x 128 or so: foreach's temporaries (the whole parameter list's at once) are
#: about four times the for-loop's (one layer's at a time), and at small batches the optimizer
#: step is the train phase's peak.
LAYERS = dict(width=128, depth=4)


@pytest.mark.parametrize("target, built", [("cuda", "fused"), ("cpu", "for-loop"), ("emulated", "for-loop")])
def test_the_estimate_builds_the_optimizer_the_target_device_runs(target, built):
    """A workload that takes fused AdamW on CUDA is traced with fused AdamW for a CUDA target, even
    on fake CPU tensors, and with its CPU optimizer for the CPU and the emulated device."""
    workload = DeviceOptimizerWorkload(**LAYERS)
    setup = fake_setup(workload, target)
    assert implementation(setup.optimizer) == built
    device_type = "cuda" if target == "cuda" else "cpu"
    note = f"optimizer AdamW ({built}), as built for a {device_type} device"
    assert note in estimate(workload, "trace", target=target).notes
    assert note in estimate(workload, "static", target=target).notes


def test_a_cuda_target_counts_the_fused_optimizer_it_will_run():
    """The by-device workload's CUDA estimate is the fused optimizer's, byte for byte, not the
    foreach one PyTorch would default to on CUDA (whose temporaries span every parameter)."""
    by_device = estimate(DeviceOptimizerWorkload(**LAYERS), "trace", target="cuda")
    fused = estimate(DeviceOptimizerWorkload(**LAYERS, implementation="fused"), "trace", target="cuda")
    foreach = estimate(DeviceOptimizerWorkload(**LAYERS, implementation="foreach"), "trace", target="cuda")
    for chosen, f, e in zip(by_device.phases, fused.phases, foreach.phases):
        assert chosen.allocated_at(2) == f.allocated_at(2), chosen.name
        assert chosen.optimizer == f.optimizer  # fused keeps its step counters on the device: one block each
    train = by_device.phases[0]
    assert train.kind == "train" and train.allocated_at(2) < foreach.phases[0].allocated_at(2)


@pytest.mark.parametrize("chosen", ["fused", "foreach", "for-loop"])
def test_each_implementation_is_traced_with_the_peak_it_really_has(chosen):
    """On the CPU the trace and torch's own real step, counted by the tensor tracker, agree byte
    for byte for each implementation."""
    assert_traced_as_measured_on_cpu(DeviceOptimizerWorkload(**LAYERS, implementation=chosen))


def test_fused_needs_the_least_and_foreach_the_most_at_the_optimizer_step():
    """At a small batch the step's temporaries decide the train peak: fused allocates none, the
    for-loop one layer's at a time, foreach a copy of the whole parameter list's gradients."""
    peaks = {
        chosen: estimate(DeviceOptimizerWorkload(**LAYERS, implementation=chosen), "trace", target="cpu").phases[0]
        for chosen in ("fused", "for-loop", "foreach")
    }
    at_two = {chosen: phase.allocated_at(2) for chosen, phase in peaks.items()}
    assert at_two["fused"] < at_two["for-loop"] < at_two["foreach"]


def test_implementation_names_how_the_optimizer_steps():
    params = [torch.nn.Parameter(torch.zeros(2))]
    assert implementation(torch.optim.AdamW(params, fused=True)) == "fused"
    assert implementation(torch.optim.AdamW(params, foreach=True)) == "foreach"
    assert implementation(torch.optim.AdamW(params, foreach=False)) == "for-loop"
    assert implementation(torch.optim.SGD(params)) == "for-loop"  # the default on a CPU
    mixed = torch.optim.AdamW([{"params": params, "foreach": True},
                               {"params": [torch.nn.Parameter(torch.zeros(2))], "foreach": False}])
    assert implementation(mixed) == "foreach+for-loop"
    assert implementation(torch.optim.LBFGS(params)) == ""  # no foreach or fused setting: its own step
