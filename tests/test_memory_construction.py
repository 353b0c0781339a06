"""Building a model for a trace: host arithmetic runs, large tensors take no memory, ties stay."""

from __future__ import annotations

import resource

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from orchestrator.device.torch_internals import FakeTensor, FakeTensorMode
from orchestrator.memory import Settings, estimate
from orchestrator.memory.construction import build_fake
from trainables.workload import Workload

VOCAB, DIM = 2**18, 2**12  # a 4 GiB fp32 embedding (a regression would allocate it, not kill the machine)


class HostArithmetic(nn.Module):
    """What constructors compute on the host: a drop-path schedule (timm), a scalar, an index
    table (Swin's relative positions); and a huge tied embedding."""

    def __init__(self, vocab: int, dim: int, depth: int = 4):
        super().__init__()
        self.rates = torch.linspace(0, 0.1, depth).tolist()
        self.scale = torch.tensor(float(dim)).rsqrt().item()
        self.register_buffer("order", torch.arange(dim).flip(0).clone())
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(nn.Linear(dim, dim) for _ in range(depth))
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        x = self.embed(ids) * self.scale
        for block, rate in zip(self.blocks, self.rates):
            x = x + F.dropout(block(x), rate, self.training)
        return self.head(x[..., self.order])


def test_a_large_model_is_built_fake_with_its_host_arithmetic_and_ties():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    model = build_fake(lambda: HostArithmetic(VOCAB, DIM), FakeTensorMode(allow_non_fake_inputs=True), torch.device("cpu"))
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    assert grown < 2**30  # the 4 GiB embedding was never allocated
    assert model.rates == pytest.approx([0.0, 0.1 / 3, 0.2 / 3, 0.1]) and model.scale == DIM**-0.5
    assert model.head.weight is model.embed.weight  # tied: one parameter, one optimizer state
    assert len(list(model.parameters())) == 1 + 2 * 4
    for tensor in (*model.parameters(), *model.buffers()):
        assert isinstance(tensor, FakeTensor) and tensor.device.type == "cpu"
    assert isinstance(model.embed.weight, nn.Parameter) and model.embed.weight.shape == (VOCAB, DIM)
    assert not model.order.requires_grad


class HugeLM(Workload):
    def build_model(self):
        return HostArithmetic(VOCAB, DIM)

    def train_data(self):
        return TensorDataset(torch.zeros(4, 8, dtype=torch.long))

    eval_data = train_data

    def loss(self, model, batch):
        (ids,) = batch
        return F.cross_entropy(model(ids).flatten(0, 1), ids.flatten())


def test_a_large_model_traces_with_its_states_counted():
    profile = estimate(HugeLM(optimizer="adamw"), "trace", Settings("bf16"), target="cuda")
    assert profile.estimator == "trace", profile.notes
    train = profile.phases[0]
    params = 4 * (VOCAB * DIM + 4 * (DIM * DIM + DIM))
    assert train.params == params and train.grads == params
    assert train.optimizer >= 2 * params  # AdamW's two moments (and its step counters)
