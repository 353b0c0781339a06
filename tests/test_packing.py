"""``resources.gpu: auto`` (``orchestrator/packing.py``): each trial asks Ray for the share of a
GPU its plan needs, the plan ``orchestrator plan`` shows for a card of that size."""

from __future__ import annotations

import json
from argparse import Namespace

import pytest

from orchestrator.config import parse_spec
from orchestrator.device.cuda import allocator_fraction
from orchestrator.device.nvml import DEFAULT_CUDA_CONTEXT_BYTES
from orchestrator.errors import UserError
from orchestrator.estimates import Estimates
from orchestrator.packing import auto_gpu_resources, gpu_fraction
from orchestrator.plan_command import plan_command

RAW = {
    "experiment": "packing_test", "workload": {"name": "mlp", "params": {"depth": 2}},
    "search_space": {"width": {"grid": [64, 16384]}}, "effective_batch_size": 256, "stop": {"epochs": 1},
    "resources": {"gpu": "auto"}, "memory": {"budget": "8GiB", "gpu_granularity": 0.125, "estimator": "trace"},
}


def test_the_share_is_rounded_up_to_the_granularity_and_at_most_one_gpu():
    assert gpu_fraction(1, 80 * 2**30, 0.125) == 0.125  # the smallest share, never none
    assert gpu_fraction(10 * 2**30, 80 * 2**30, 0.125) == 0.125  # exactly one step
    assert gpu_fraction(11 * 2**30, 80 * 2**30, 0.125) == 0.25
    assert gpu_fraction(200 * 2**30, 80 * 2**30, 0.125) == 1.0


def test_trials_that_share_a_card_cap_their_allocators_so_that_with_their_contexts_they_fit_it():
    """PyTorch's cap counts the caching allocator alone; each trial's CUDA context is beside it."""
    total, context = 80 * 2**30, DEFAULT_CUDA_CONTEXT_BYTES
    for share in (0.125, 0.25, 0.5):
        trials = int(1 / share)
        assert trials * (allocator_fraction(share, total) * total + context) == pytest.approx(total)
    assert allocator_fraction(None, total) == 1.0  # a whole card: no cap
    assert allocator_fraction(0.005, total) == 0.0  # a share smaller than a context: the plan refuses it


def test_without_a_gpu_to_read_auto_needs_the_cards_size():
    spec = parse_spec({**RAW, "memory": {"gpu_granularity": 0.125}})
    with pytest.raises(UserError, match=r"^resources\.gpu: 'auto' needs to know the GPU's memory; .* set memory\.budget"):
        auto_gpu_resources(spec, Estimates("cuda", spec.memory))


def test_each_trial_asks_for_the_share_of_the_card_its_plan_fills(tmp_path, capsys):
    """No GPU here: the card is ``memory.budget`` (8 GiB), as ``plan --device-memory 8GiB``
    plans for it; an MLP of 16,384 wide layers (1 GiB of weights each) asks for more of it than a
    narrow one, whose plan is mostly the CUDA context."""
    spec = parse_spec(RAW)
    resources = auto_gpu_resources(spec, Estimates("cuda", spec.memory))  # estimated on demand, as without the driver's
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(json.dumps(RAW))
    assert plan_command(Namespace(config=str(sweep), overrides=[], device_memory="8GiB", estimator=None, json=True)) == 0
    planned = json.loads(capsys.readouterr().out)
    assert planned["target"] == "cuda"
    shares = []
    for trial in planned["trials"]:
        [bundle] = resources(trial["config"]).bundles
        shares.append(bundle["GPU"])
        assert bundle == {"CPU": 1.0, "GPU": gpu_fraction(trial["plan"]["predicted_peak_bytes"], 8 * 2**30, 0.125)}
    assert shares[0] < shares[1], shares
