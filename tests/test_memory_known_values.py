"""Known values on fake tensors: a check on a value the real input would give is answered as the
real input answers it; a value that is not knowable still fails as fake tensors do."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from orchestrator.device.torch_internals import DataDependentOutputException, FakeTensorMode
from orchestrator.memory.known_values import KnownValues


@pytest.fixture
def fake():
    """A fake mode with known values on top, and the values."""
    mode, values = FakeTensorMode(allow_non_fake_inputs=True), KnownValues()
    with mode, values:
        yield values


def test_a_causal_mask_made_from_sizes_is_detected_as_causal(fake):
    mask = nn.Transformer.generate_square_subsequent_mask(8)
    causal = nn.Transformer.generate_square_subsequent_mask(8)
    assert bool((mask == causal).all())
    assert not bool((mask.transpose(0, 1) == causal).all())
    assert mask.sum().item() == float("-inf")


PADDING = torch.tensor([[False, False, True], [False, True, True]])  # real: made outside the fake mode


def test_a_value_from_the_host_is_known_through_the_ops_on_it(fake):
    real = PADDING
    host = torch.empty(2, 3, dtype=torch.bool, device="meta")
    fake.know(host, real)
    on_device = host.to("cpu")
    assert (~on_device).sum().item() == 3
    kept = torch.nonzero(~on_device)  # an output shape that depends on the values
    assert kept.shape == (3, 2) and kept.tolist() == [[0, 0], [0, 1], [1, 0]]


def test_a_value_computed_from_weights_or_random_numbers_is_not_known():
    mode, values = FakeTensorMode(allow_non_fake_inputs=True), KnownValues()
    with mode:
        weight = nn.Linear(4, 4).weight  # made outside the values' mode, as the trace's model is
    with mode, values:
        with pytest.raises(DataDependentOutputException):
            bool((weight > 0).any())
        with pytest.raises(DataDependentOutputException):
            torch.rand(3).sum().item()


def test_writing_an_unknown_value_into_a_known_tensor_forgets_its_value_and_its_views(fake):
    known = torch.zeros(4)
    view = known[:2]
    assert view.sum().item() == 0
    unknown = torch.rand(2)
    known[2:].copy_(unknown)
    for t in (known, view):
        with pytest.raises(DataDependentOutputException):
            t.sum().item()


def test_a_value_goes_with_its_tensor_and_a_write_forgets_only_the_storage_written(fake):
    before = len(fake)
    kept, other = torch.zeros(4), torch.ones(3)
    views = [kept[:2], kept[2:]]
    assert len(fake) == before + 4
    for _ in range(100):  # made and dropped: nothing of them stays
        assert (torch.arange(5) * 2).sum().item() == 20
    assert len(fake) == before + 4
    kept.copy_(torch.rand(4))
    assert len(fake) == before + 1  # kept and its views forgotten, other still known
    assert other.sum().item() == 3
    del kept, views, other
    assert len(fake) == before


def test_large_tensors_carry_no_value():
    mode, values = FakeTensorMode(allow_non_fake_inputs=True), KnownValues(limit=10)
    with mode, values:
        small, large = torch.zeros(10), torch.zeros(11)
        assert small.sum().item() == 0
        with pytest.raises(DataDependentOutputException):
            large.sum().item()
