"""The trace estimator: fake-tensor traces of the real steps, checked against hand counts and real runs."""

from __future__ import annotations

import inspect
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from orchestrator.device import CpuDevice
from orchestrator.memory import Settings, estimate
from orchestrator.memory.cuda_emulation import cuda_autocast_policy
from trainables.cnn import CNNWorkload
from trainables.mlp import MLPWorkload
from trainables.staged import StagedMLPWorkload
from trainables.workload import Workload

F32 = 4


def test_mlp_trace_matches_a_hand_count():
    w = MLPWorkload(in_features=32, width=64, depth=2, classes=8, optimizer="adamw")
    profile = estimate(w, "trace", target="cpu")
    train, evaluate = profile.phases
    n_params = 32 * 64 + 64 + 64 * 64 + 64 + 64 * 8 + 8
    params = F32 * n_params
    adam = 2 * params + F32 * 6  # exp_avg, exp_avg_sq, and a float32 step counter per tensor
    sample_in = F32 * 32 + 8  # one input row and its int64 label: the micro-batch under way
    assert (train.params, train.grads, train.optimizer, train.buffers) == (params, params, adam, 0)
    for b in (1, 7, 64, 1000):
        # eval (no autograd): the input, then a hidden layer's pre-activation and ReLU output at once
        assert evaluate.allocated_at(b) == params + adam + b * (sample_in + 2 * F32 * 64)
    # train, second micro-batch, at the last ReLU's backward: the first micro-batch's gradients, the
    # saved ReLU outputs r1 and r2, the gradient of r2 and the one being made for h2, + 3 loss scalars
    hand = lambda b: params + params + adam + b * (sample_in + 4 * F32 * 64) + 3 * F32  # noqa: E731
    for b in (65, 100, 1000):
        assert train.allocated_at(b) == hand(b)
    for b in (1, 7, 30):  # below that, the optimizer step's temporaries are the peak
        assert train.allocated_at(b) > hand(b)


class NonzeroMLP(MLPWorkload):
    """A loss with a data-dependent shape (boolean masking): cannot run on fake tensors."""

    def loss(self, model, batch):
        x, y = batch
        logits = model(x)
        keep = torch.nonzero(y >= 0).squeeze(1)
        return F.cross_entropy(logits[keep], y[keep])


def test_untraceable_workload_falls_back_with_a_note_naming_the_op_and_the_line():
    static = estimate(NonzeroMLP(), "trace", target="cpu")
    assert static.estimator == "static"
    assert static.notes[0].startswith("trace impossible (aten.nonzero") and "fell back to static" in static.notes[0]
    line = inspect.getsourcelines(NonzeroMLP.loss)[1] + 3  # the torch.nonzero line
    assert f"in tests/test_memory_trace.py:{line} (loss)" in static.notes[0]
    measured = estimate(NonzeroMLP(), "trace", target="cpu", device=CpuDevice())
    assert measured.estimator == "measured" and "fell back to measured" in measured.notes[0]
    assert measured.phases[0].allocated_at(64) <= static.phases[0].allocated_at(64)


def test_stages_and_eval_are_distinct_phases():
    profile = estimate(StagedMLPWorkload(aux_width=256, aux_start_epoch=3), "trace", target="cpu")
    phases = {p.name: p for p in profile.phases}
    assert list(phases) == ["train", "eval", "train@epoch3", "eval@epoch3"]
    assert [p.kind for p in profile.phases] == ["train", "eval", "train", "eval"]
    assert phases["train"].params == phases["train@epoch3"].params  # the aux block exists from the start
    assert phases["train@epoch3"].grads > phases["train"].grads  # but only trains from epoch 3
    assert phases["train@epoch3"].optimizer > phases["train"].optimizer
    for b in (1, 32, 512):
        assert phases["train@epoch3"].allocated_at(b) > phases["train"].allocated_at(b)
        assert phases["eval@epoch3"].allocated_at(b) > phases["eval"].allocated_at(b)
    assert profile.peak(32, 32)[1] == "train@epoch3"


@pytest.mark.parametrize("workload", [MLPWorkload(), CNNWorkload(), StagedMLPWorkload(aux_width=256)], ids=type)
def test_trace_equals_the_real_cpu_peaks(workload):
    """On the CPU both count the same tensors: fake and real steps agree byte for byte."""
    traced = estimate(workload, "trace", target="cpu")
    real = estimate(workload, "measured", target="cpu", device=CpuDevice())
    for fake, measured in zip(traced.phases, real.phases):
        for b, _ in measured.points:
            assert fake.allocated_at(b) == measured.allocated_at(b), (fake.name, b)


def test_activation_checkpointing_shrinks_the_train_phase():
    plain = estimate(CNNWorkload(depth=3), "trace", target="cpu").phases[0]
    ckpt = estimate(CNNWorkload(depth=3), "trace", Settings(activation_checkpointing=True), target="cpu").phases[0]
    assert ckpt.activations_per_sample < plain.activations_per_sample  # the largest block is recomputed


def test_bf16_halves_what_autocast_casts():
    fp32 = estimate(CNNWorkload(), "trace", target="cpu").phases[1]
    bf16 = estimate(CNNWorkload(), "trace", Settings("bf16"), target="cpu").phases[1]
    assert bf16.activations_per_sample < 0.75 * fp32.activations_per_sample
    assert bf16.params == fp32.params  # parameters stay fp32 under autocast


def test_cuda_target_budgets_reserved_memory():
    profile = estimate(MLPWorkload(), "trace", target="cuda", fragmentation=0.25)
    train = profile.phases[0]
    assert train.params % 512 == 0  # the allocator's 512-byte blocks
    assert train.context > 0 and train.workspace > 0 and train.fragmentation == 0.25
    assert train.reserved_at(64) == -(-train.allocated_at(64) * 125 // 100) + train.context + train.workspace
    cpu = estimate(MLPWorkload(), "trace", target="cpu").phases[0]
    assert cpu.reserved_at(64) == cpu.allocated_at(64)  # the CPU counts tensor bytes, nothing else


# -- CUDA emulation for a transformer -----------------------------------------------------


class Attention(nn.Module):
    def __init__(self, dim=64, heads=4):
        super().__init__()
        self.heads, self.qkv, self.out = heads, nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=0.1 if self.training else 0.0)
        return x + F.dropout(self.out(y.transpose(1, 2).reshape(b, s, d)), 0.1, self.training)


class TinyLM(Workload):
    seq, vocab, layers, heads = 128, 256, 2, 4

    def build_model(self):
        return nn.Sequential(nn.Embedding(self.vocab, 64), *[Attention() for _ in range(self.layers)], nn.Linear(64, self.vocab))

    def train_data(self):
        return TensorDataset(torch.randint(0, self.vocab, (8, self.seq)))

    eval_data = train_data

    def loss(self, model, batch):
        (ids,) = batch
        return F.cross_entropy(model(ids).float().flatten(0, 1), ids.flatten())


def test_cuda_target_does_not_count_the_cpu_attention_score_matrix():
    cpu = estimate(TinyLM(), "trace", Settings("bf16"), target="cpu").phases[0]
    cuda = estimate(TinyLM(), "trace", Settings("bf16"), target="cuda").phases[0]
    scores = TinyLM.heads * TinyLM.seq**2 * 2  # bf16 (b, heads, s, s), per sample and layer
    assert cpu.activations_per_sample - cuda.activations_per_sample >= TinyLM.layers * scores


def test_cuda_autocast_policy_is_scoped_to_the_trace():
    x = torch.randn(4, 8)
    with cuda_autocast_policy(), torch.autocast("cpu", torch.bfloat16):
        assert F.softmax(x @ x.T, -1).dtype == torch.float32  # CUDA: softmax in fp32
    with torch.autocast("cpu", torch.bfloat16):
        assert F.softmax(x @ x.T, -1).dtype == torch.bfloat16  # CPU's own policy again


def test_cuda_autocast_policy_matches_cuda_autocast():
    """CUDA's own autocast kernels run on fake cuda tensors without a GPU (forward, no autograd).

    In a subprocess: any autograd on fake cuda tensors aborts the process (FACTS.md).
    """
    script = textwrap.dedent("""
        import torch, torch.nn.functional as F
        from torch._subclasses.fake_tensor import FakeTensorMode
        from orchestrator.memory.cuda_emulation import cuda_autocast_policy

        def ops(x, w, wn, y):
            h = F.linear(x, w)
            return [h, F.softmax(h, -1), F.log_softmax(h, -1), F.layer_norm(h, (16,), wn), F.rms_norm(h, (16,), wn),
                    h.sum(), h.sum(1), h.exp(), F.cross_entropy(h, y), F.gelu(h), torch.einsum("ij,kj->ik", x, w),
                    torch.cat([h, x], 1), torch.addcmul(h, h, x), h.norm(), F.mse_loss(h, h),
                    F.binary_cross_entropy_with_logits(h, h)]

        with FakeTensorMode():
            args = [torch.empty(4, 16, device="cuda"), torch.empty(16, 16, device="cuda"),
                    torch.empty(16, device="cuda"), torch.zeros(4, dtype=torch.long, device="cuda")]
            torch.set_autocast_enabled("cuda", True)
            torch.set_autocast_dtype("cuda", torch.bfloat16)
            cuda = [t.dtype for t in ops(*args)]
            torch.set_autocast_enabled("cuda", False)
        args = [torch.randn(4, 16), torch.randn(16, 16), torch.randn(16), torch.zeros(4, dtype=torch.long)]
        with cuda_autocast_policy(), torch.autocast("cpu", torch.bfloat16):
            emulated = [t.dtype for t in ops(*args)]
        with torch.autocast("cpu", torch.bfloat16):
            cpu = [t.dtype for t in ops(*args)]
        print(cuda == emulated, cuda != cpu)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["True", "True"], out.stderr[-2000:]
