"""A stateful workload's carried state: micro-batches get their own rows, put back detached."""

from collections import namedtuple

import pytest
import torch

from trainables.carry import Carry, StateShapeError, merge_rows, split_rows, stateful_loss
from trainables.examples.lstm_lm import LSTMLanguageModelWorkload

Hidden = namedtuple("Hidden", "h c")


def test_split_gives_each_micro_batch_its_rows_and_merge_puts_them_back():
    h = torch.arange(2 * 7 * 3.0).reshape(2, 7, 3)
    parts = split_rows(Hidden(h, -h), [3, 3, 1], dim=1)
    assert [p.h.shape[1] for p in parts] == [3, 3, 1]
    assert torch.equal(parts[1].c, -h[:, 3:6])
    merged = merge_rows(parts, dim=1)
    assert isinstance(merged, Hidden) and torch.equal(merged.h, h) and torch.equal(merged.c, -h)
    flat = split_rows({"a": [h[0]]}, [4, 3], dim=0)
    assert torch.equal(merge_rows(flat, dim=0)["a"][0], h[0])


def test_merged_states_are_detached():
    h = torch.zeros(1, 4, 2, requires_grad=True)
    parts = [p * 2 for p in split_rows(h, [2, 2], dim=1)]
    merged = merge_rows(parts, dim=1)
    assert not merged.requires_grad and merged.grad_fn is None


def test_a_re_cut_splits_the_same_rows():
    """An OOM's smaller micro-batch: each stream keeps its own row of the state."""
    h = torch.randn(2, 8, 3)
    whole = merge_rows(split_rows(h, [4, 4], dim=1), dim=1)
    assert torch.equal(merge_rows(split_rows(whole, [2, 2, 2, 2], dim=1), dim=1), h)
    assert torch.equal(split_rows(h, [2] * 4, dim=1)[3], split_rows(h, [4, 4], dim=1)[1][:, 2:])


def test_the_initial_state_is_checked_for_its_rows():
    workload = LSTMLanguageModelWorkload(layers=2, hidden=5)
    carry = Carry.initial(workload, 6, torch.device("cpu"))
    assert [t.shape for t in carry.state] == [(2, 6, 5)] * 2
    with pytest.raises(StateShapeError, match=r"initial_state\(6\).*\(6, 5\).*6 rows.*state_dim 2"):
        Carry(carry.state[0][0], 2).check(6, "LSTMLanguageModelWorkload.initial_state(6)")


def test_a_stateful_loss_must_return_the_state():
    class Forgetful(LSTMLanguageModelWorkload):
        def loss(self, model, batch, state):
            return super().loss(model, batch, state)[0]

    workload = Forgetful(vocab=8, hidden=4, layers=1)
    model = workload.build_model()
    batch = (torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(TypeError, match="returns \\(loss, state\\)"):
        stateful_loss(workload, model, batch, workload.initial_state(2))
