"""The static estimator: exact state counts for known models, and never under the trace."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from orchestrator.contract import COMPILED_MODEL_NOTE
from orchestrator.memory import Settings, estimate
from tests.workloads import COMPILED_GRAPHS, CompiledMLPWorkload
from trainables.cnn import CNNWorkload
from trainables.mlp import MLPWorkload
from trainables.staged import StagedMLPWorkload
from trainables.workload import Workload

F32 = 4
MLP_PARAMS = 32 * 64 + 64 + 64 * 64 + 64 + 64 * 8 + 8  # in 32 -> 64 -> 64 -> 8
MLP_TENSORS = 6


@pytest.mark.parametrize(
    "optimizer, state",
    [
        ("sgd", F32 * MLP_PARAMS),  # momentum buffer
        ("adam", 2 * F32 * MLP_PARAMS + F32 * MLP_TENSORS),  # exp_avg, exp_avg_sq, step
        ("adamw", 2 * F32 * MLP_PARAMS + F32 * MLP_TENSORS),
    ],
)
def test_states_are_counted_exactly(optimizer, state):
    train, evaluate = estimate(MLPWorkload(optimizer=optimizer), "static", target="cpu").phases
    assert (train.params, train.grads, train.optimizer, train.buffers) == (F32 * MLP_PARAMS, F32 * MLP_PARAMS, state, 0)
    assert (evaluate.grads, evaluate.optimizer) == (0, state)  # the optimizer's state stays through eval


def test_buffers_and_bf16_parameters():
    cnn = CNNWorkload(width=16, depth=2, channels=3, classes=8)
    train = estimate(cnn, "static", Settings("bf16"), target="cpu").phases[0]
    batchnorm = lambda c: 2 * F32 * c + 8  # noqa: E731  running mean and var, an int64 counter
    assert train.buffers == batchnorm(16) + batchnorm(32)
    conv = lambda cin, cout: cout * cin * 9 + cout + 2 * cout  # noqa: E731  + BatchNorm's weight and bias
    assert train.params == F32 * (conv(3, 16) + conv(16, 32) + 32 * 8 + 8)  # fp32 under autocast


class Embedder(Workload):
    """An embedding table dominates: its gradient is dense, so it counts in full."""

    def build_model(self):
        return nn.Sequential(nn.Embedding(10_000, 32), nn.Flatten(), nn.Linear(32 * 4, 2))

    def train_data(self):
        return TensorDataset(torch.randint(0, 10_000, (8, 4)), torch.randint(0, 2, (8,)))

    eval_data = train_data

    def loss(self, model, batch):
        x, y = batch
        return F.cross_entropy(model(x), y)


def test_embeddings_and_their_dense_gradients():
    train = estimate(Embedder(optimizer="sgd"), "static", target="cpu").phases[0]
    params = F32 * (10_000 * 32 + 32 * 4 * 2 + 2)
    assert (train.params, train.grads, train.optimizer) == (params, params, params)


@pytest.mark.parametrize("target, precision", [("cpu", "fp32"), ("cuda", "bf16")])
@pytest.mark.parametrize("workload", [MLPWorkload(), CNNWorkload(), StagedMLPWorkload(aux_width=256)], ids=type)
def test_static_is_never_under_the_trace(workload, target, precision):
    static = estimate(workload, "static", Settings(precision), target=target)
    traced = estimate(workload, "trace", Settings(precision), target=target)
    for s, t in zip(static.phases, traced.phases):
        assert s.name == t.name
        for b in (1, 2, 16, 128, 1024):
            assert s.allocated_at(b) >= t.allocated_at(b), (s.name, b)


def test_cuda_target_adds_context_workspace_and_fragmentation():
    train = estimate(MLPWorkload(), "static", target="cuda", fragmentation=0.1).phases[0]
    assert train.context >= 500 * 2**20 and train.workspace > 0
    assert train.reserved_at(8) == -(-train.allocated_at(8) * 11 // 10) + train.context + train.workspace


class Masked(MLPWorkload):
    def loss(self, model, batch):
        x, y = batch
        logits = model(x)
        keep = logits.argmax(-1) >= 0  # from the model's output: no value before the step runs
        return F.cross_entropy(logits[keep], y[keep])  # boolean mask: a data-dependent shape


def test_forward_runs_on_real_tensors_when_fake_ones_cannot():
    profile = estimate(Masked(), "static", target="cpu")
    assert any("fake tensors failed" in n for n in profile.notes)
    assert profile.phases[0].params == F32 * MLP_PARAMS
    assert profile.phases[0].allocated_at(64) >= estimate(Masked(), "measured", target="cpu").phases[0].allocated_at(64)


def test_a_model_too_large_for_this_machine_is_not_built_for_real(monkeypatch):
    """The real-tensor fallback would build the model: it refuses when its states would not fit."""
    import orchestrator.memory.static as static

    monkeypatch.setattr(static, "available_host_memory", lambda: 4 * F32 * MLP_PARAMS)  # states need 4x, half is allowed
    built = []
    monkeypatch.setattr(Masked, "build_model", lambda self: built.append(1) or MLPWorkload.build_model(self))
    with pytest.raises(static.TooLargeForRealTensors, match=r"aten\.nonzero.*test_memory_static.py:\d+ \(loss\).*too large to run on real CPU tensors"):
        estimate(Masked(), "static", target="cpu")
    assert len(built) == 2  # on fake tensors, then for its size: never a third time, for real


def test_a_compiled_model_is_counted_from_its_eager_modules_with_a_note():
    profile = estimate(CompiledMLPWorkload(width=16), "static", target="cpu")
    assert COMPILED_GRAPHS == [] and profile.compiled and COMPILED_MODEL_NOTE in profile.notes
    eager = estimate(MLPWorkload(width=16), "static", target="cpu")
    assert [p.allocated_at(8) for p in profile.phases] == [p.allocated_at(8) for p in eager.phases]
