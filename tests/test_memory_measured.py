"""The measured estimator on the CPU tensor tracker and the emulated device (its CUDA path needs a GPU)."""

from __future__ import annotations

import pytest
import torch

from orchestrator.device import CpuDevice, EmulatedDevice
from orchestrator.memory import EstimationError, estimate
from orchestrator.memory.measured import FIRST_PROBE, VISIBLE_GROWTH
from trainables.mlp import MLPWorkload
from trainables.staged import StagedMLPWorkload


def test_probes_double_until_the_slope_is_visible():
    profile = estimate(MLPWorkload(), "measured", target="cpu", device=CpuDevice())
    train = profile.phases[0]
    sizes = [b for b, _ in train.points]
    assert sizes[0] == FIRST_PROBE and all(b2 == 2 * b1 for b1, b2 in zip(sizes, sizes[1:]))
    assert train.points[-1][1] >= (1 + VISIBLE_GROWTH) * train.points[0][1]  # activations now show
    assert train.points[-2][1] < (1 + VISIBLE_GROWTH) * train.points[0][1]  # and not one probe more
    assert profile.notes[0].startswith("measured on cpu_tensor_tracker at batch sizes 2, 4")
    # the optimizer step is its own window: its peak is a floor, not a point on the line
    assert train.step_floor > train.points[0][1]
    assert train.allocated_at(1) == train.step_floor


def test_every_stage_and_eval_are_probed():
    profile = estimate(StagedMLPWorkload(aux_width=512), "measured", target="cpu", device=CpuDevice())
    assert [p.name for p in profile.phases] == ["train", "eval", "train@epoch3", "eval@epoch3"]
    sizes = {p.name: [b for b, _ in p.points] for p in profile.phases}
    assert len({tuple(s) for s in sizes.values()}) == 1  # the same probe sizes for every phase
    assert profile.phases[2].allocated_at(64) > profile.phases[0].allocated_at(64)


def test_an_out_of_memory_error_ends_a_phase_s_probing():
    """Probe sizes come from stage 0; the aux block's stage runs out of memory at the larger ones."""
    workload = StagedMLPWorkload(aux_width=1024)
    epoch2 = estimate(workload, "trace", target="emulated").phases[2]
    capacity = epoch2.allocated_at(200)
    profile = estimate(workload, "measured", target="emulated", device=EmulatedDevice(capacity))
    sizes = {p.name: [b for b, _ in p.points] for p in profile.phases}
    assert sizes["train"][-1] > 200 and sizes["train@epoch3"][-1] < 200
    assert any(n.startswith("train@epoch3: probing stopped by an out-of-memory error") for n in profile.notes)
    assert profile.phases[2].allocated_at(128) == epoch2.allocated_at(128)
    with pytest.raises(EstimationError, match="fewer than two probe batch sizes fit"):  # a byte short of micro-batch 1
        estimate(workload, "measured", target="emulated", device=EmulatedDevice(epoch2.allocated_at(1) - 1))


def test_probing_leaves_the_device_as_it_found_it():
    device = CpuDevice()
    estimate(MLPWorkload(), "measured", target="cpu", device=device)
    assert device.allocated() == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the allocator's statistics need a GPU")
def test_fragmentation_is_measured_on_cuda():
    from orchestrator.device import CudaDevice

    profile = estimate(MLPWorkload(), "measured", target="cuda", device=CudaDevice())
    train = profile.phases[0]
    assert train.fragmentation >= 0 and train.context > 0
