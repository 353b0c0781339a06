"""The trace estimator: fake-tensor traces of the real steps, checked against hand counts and real runs."""

from __future__ import annotations

import inspect
import math
import json
import pickle
import re
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from bench.zoo import (
    GRU,
    LSTM,
    NNEncoder,
    NNEncoderMasked,
    NNEncoderMaskedSeqFirst,
    NNEncoderSeqFirst,
    NNTransformer,
    UNet,
)
from orchestrator.contract import COMPILED_MODEL_NOTE
from orchestrator.device import CpuDevice
from orchestrator.memory import Settings, estimate
from orchestrator.memory.cuda_emulation import cuda_autocast_policy
from tests.conftest import assert_traced_as_measured_on_cpu
from tests.workloads import COMPILED_GRAPHS, CompiledMLPWorkload, ScoredWorkload
from trainables.cnn import CNNWorkload
from trainables.mlp import MLPWorkload
from trainables.staged import StagedMLPWorkload
from trainables.workload import LossTypeError, MetricsMismatch, MetricTypeError, Workload

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
    """A loss with a shape that depends on the model's output (masking by its predictions):
    nothing knows those values before the step runs, so it cannot run on fake tensors."""

    def loss(self, model, batch):
        x, y = batch
        logits = model(x)
        keep = torch.nonzero(logits.argmax(-1) >= 0).squeeze(1)
        return F.cross_entropy(logits[keep], y[keep])


class LabelMaskedMLP(MLPWorkload):
    """The same masking by the batch's labels: values of the workload's sample, known to the trace."""

    def loss(self, model, batch):
        x, y = batch
        logits = model(x)
        keep = torch.nonzero(y >= 0).squeeze(1)
        if not bool((y[keep] >= 0).all()):  # a Python check on the data, as models make
            raise ValueError("negative label")
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


class InPlaceResidualMLP(MLPWorkload):
    """``h += f(h)``: ReLU's backward needs the output that the in-place add then changes. Its
    every backward fails, on real tensors as on fake ones."""

    def loss(self, model, batch):
        x, y = batch
        first, last = model[0], model[-1]
        h = first(x).relu()
        h += first(x)
        return F.cross_entropy(last(h), y)


def test_a_backward_that_fails_on_any_tensors_is_the_models_error_not_a_fallback():
    """The ``static`` fallback runs no backward: it would plan the sweep, and every trial would fail."""
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        estimate(InPlaceResidualMLP(), "trace", target="cpu")
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        workload = InPlaceResidualMLP()
        workload.loss(workload.build_model(), workload.train_data()[:4]).backward()


class PerSampleLossMLP(MLPWorkload):
    """``reduction="none"``: a loss per sample, where the loop needs the batch's mean."""

    def loss(self, model, batch):
        x, y = batch
        return F.cross_entropy(model(x), y, reduction="none")


class LossAndMetricsMLP(MLPWorkload):
    """``(loss, metrics)``, as many training steps return: the loop needs the loss alone."""

    def loss(self, model, batch):
        x, y = batch
        logits = model(x)
        return F.cross_entropy(logits, y), {"accuracy": (logits.argmax(-1) == y).float().mean()}


@pytest.mark.parametrize("estimator", ["trace", "static"])
@pytest.mark.parametrize("workload,returned", [(PerSampleLossMLP, "a tensor of shape (2,)"),
                                               (LossAndMetricsMLP, "a tuple of 2")], ids=["per-sample", "tuple"])
def test_a_loss_that_is_not_one_number_is_the_models_error_not_a_fallback(estimator, workload, returned):
    """Fake tensors have shapes: the estimate refuses such a loss (which fails every trial at its
    first step) before any trial starts, where it fell back to ``static`` (which runs no
    backward) and planned the sweep; ``static`` no longer retries it on real CPU tensors either."""
    with pytest.raises(LossTypeError, match=rf"^{workload.__name__}\.loss \(tests/test_memory_trace\.py:\d+\) "
                                            rf"returned {re.escape(returned)}"):
        estimate(workload(), estimator, target="cpu")


class PerSampleEvalMLP(MLPWorkload):
    """Sums of eval metrics per sample: the loop adds one number per name over the eval set."""

    def eval_metrics(self, model, batch, samples):
        x, y = batch
        return {"loss": F.cross_entropy(model(x), y, reduction="none")}


@pytest.mark.parametrize("estimator", ["trace", "static"])
def test_eval_metrics_that_are_not_one_number_each_are_the_models_error_before_any_trial(estimator):
    """Without the check, every trial ends at its first evaluation, after an epoch of training."""
    with pytest.raises(MetricTypeError, match=r"^PerSampleEvalMLP\.eval_metrics \(tests/test_memory_trace\.py:\d+\) "
                                              r"returned 'loss' as a tensor of shape \(2,\) for a batch of 2; "):
        estimate(PerSampleEvalMLP(), estimator, target="cpu")


class MisdeclaredScoredMLP(ScoredWorkload):
    """Reports ``accuracy`` and declares it as ``acc``."""

    metrics = ("loss", "acc")


class PerplexityMLP(MLPWorkload):
    """Reports a perplexity computed from its totals: placeholder totals give it its name."""

    metrics = ("perplexity",)

    def summarize_metrics(self, totals, samples):
        return {"perplexity": math.exp(totals["loss"] / samples)}


@pytest.mark.parametrize("estimator", ["trace", "static"])
def test_eval_metrics_other_than_the_declared_ones_are_the_workloads_error_before_any_trial(estimator):
    """Without the check, every trial ends at its first evaluation, after an epoch of training."""
    with pytest.raises(MetricsMismatch, match="report accuracy, loss but MisdeclaredScoredMLP.metrics declares loss, acc"):
        estimate(MisdeclaredScoredMLP(), estimator, target="cpu")
    assert estimate(PerplexityMLP(), estimator, target="cpu").estimator == estimator


def test_checks_on_the_samples_values_are_answered_as_the_real_batch_answers_them():
    traced = estimate(LabelMaskedMLP(), "trace", target="cpu")
    real = estimate(LabelMaskedMLP(), "measured", target="cpu", device=CpuDevice())
    assert traced.estimator == "trace", traced.notes
    for fake, measured in zip(traced.phases, real.phases):
        for b, _ in measured.points:
            assert fake.allocated_at(b) == measured.allocated_at(b), (fake.name, b)


class CheckedActivationsMLP(MLPWorkload):
    """A Python check on the model's activations: no input value tells its answer."""

    def loss(self, model, batch):
        x, y = batch
        logits = model(x)
        if bool(logits.isnan().any()):
            raise FloatingPointError("nan logits")
        return F.cross_entropy(logits, y)


def test_a_check_whose_answer_is_not_knowable_falls_back_naming_the_op_and_the_line():
    profile = estimate(CheckedActivationsMLP(), "trace", target="cpu")
    assert profile.estimator == "static"
    assert profile.notes[0].startswith("trace impossible (aten._local_scalar_dense"), profile.notes[0]
    line = inspect.getsourcelines(CheckedActivationsMLP.loss)[1] + 3  # the isnan check
    assert f"in tests/test_memory_trace.py:{line} (loss)" in profile.notes[0]
def test_a_compiled_model_is_traced_through_its_eager_modules_without_compiling():
    """``build_model`` returning ``torch.compile(model)``: the trace runs the eager modules (dynamo
    never sees the fake tensors: the compiler is given no graph), profiles what eager would, and
    says the compiled graph's memory may differ."""
    compiled = CompiledMLPWorkload(width=16)
    profile = estimate(compiled, "trace", target="cuda")
    assert COMPILED_GRAPHS == []
    assert profile.estimator == "trace" and profile.compiled and COMPILED_MODEL_NOTE in profile.notes
    eager = estimate(MLPWorkload(width=16), "trace", target="cuda")
    assert not eager.compiled and COMPILED_MODEL_NOTE not in eager.notes
    for c, e in zip(profile.phases, eager.phases):
        assert c.allocated_at(64) == e.allocated_at(64) and c.reserved_at(64) == e.reserved_at(64), c.name


def test_stages_and_eval_are_distinct_phases():
    profile = estimate(StagedMLPWorkload(aux_width=256, aux_start_epoch=3), "trace", target="cpu")
    phases = {p.name: p for p in profile.phases}
    assert list(phases) == ["train", "eval", "train@epoch4", "eval@epoch4"]
    assert [p.kind for p in profile.phases] == ["train", "eval", "train", "eval"]
    assert phases["train"].params == phases["train@epoch4"].params  # the aux block exists from the start
    assert phases["train@epoch4"].grads > phases["train"].grads  # but only trains from its 4th epoch (aux_start_epoch counts from 0)
    assert phases["train@epoch4"].optimizer > phases["train"].optimizer
    for b in (1, 32, 512):
        assert phases["train@epoch4"].allocated_at(b) > phases["train"].allocated_at(b)
        assert phases["eval@epoch4"].allocated_at(b) > phases["eval"].allocated_at(b)
    assert profile.peak(32, 32)[1] == "train@epoch4"


class _Tokens(Workload):
    """Token sequences, 8 long in training and 128 in evaluation (a longer context)."""

    def build_model(self):
        return nn.Sequential(nn.Embedding(64, 32), nn.Linear(32, 64))

    def train_data(self):
        return [torch.ones(8, dtype=torch.long)] * 64

    def eval_data(self):
        return [torch.ones(128, dtype=torch.long)] * 16

    def loss(self, model, batch):
        return model(batch).logsumexp(-1).mean()


class _LongerEval(_Tokens):
    def largest_eval_sample(self):
        return self.eval_data()[0]


def test_the_eval_phases_are_planned_from_the_largest_eval_sample_the_workload_names():
    undeclared = {p.name: p for p in estimate(_Tokens(), "trace", target="cpu").phases}
    declared = {p.name: p for p in estimate(_LongerEval(), "trace", target="cpu").phases}
    assert declared["train"].activations_per_sample == undeclared["train"].activations_per_sample

    def growth(phase):  # what 16 more samples of an eval batch take
        return phase.allocated_at(16) - phase.allocated_at(0)

    # 16 times the tokens a sample: 16 times the eval step's logits.
    assert growth(declared["eval"]) == pytest.approx(16 * growth(undeclared["eval"]), rel=0.1)
    assert _LongerEval.varies_in_size() and not _Tokens.varies_in_size()  # its verification does not grow a plan


@pytest.mark.parametrize("workload", [
    MLPWorkload(), CNNWorkload(), StagedMLPWorkload(aux_width=256),
    # torch.nn's own layers (bench.zoo's library zoo, small): the encoder's eval runs its fused fast path
    NNTransformer(dim=32, seq=16), NNEncoder(seq=16), NNEncoderSeqFirst(seq=16), GRU(seq=4), UNet(image=32),
    # a causal mask the encoder checks by its values, and a padding mask from the data, in both layouts
    NNEncoderMasked(seq=16), NNEncoderMaskedSeqFirst(seq=16), NNEncoderMaskedSeqFirst(seq=16, causal=False),
], ids=type)
def test_trace_equals_the_real_cpu_peaks(workload):
    """On the CPU both count the same tensors: fake and real steps agree byte for byte."""
    assert_traced_as_measured_on_cpu(workload)


def test_the_encoders_nested_tensor_fast_path_is_traced_on_its_layers_path_and_says_so():
    """In eval, batch first, with a padding mask alone, the encoder packs the batch into nested
    tensors, which fake tensors cannot hold: the trace takes the layers' path, which keeps the
    padded positions (a quarter of them here) and, on the CPU, the attention scores the fused
    kernel does not: above the real CPU eval, never under (by 20 % at the measured sizes)."""
    workload = NNEncoderMasked(seq=16, causal=False)
    traced = estimate(workload, "trace", target="cpu")
    real = estimate(workload, "measured", target="cpu", device=CpuDevice())
    assert traced.estimator == "trace" and any("nested tensors" in n for n in traced.notes), traced.notes
    (train, evaluate), (real_train, real_eval) = traced.phases, real.phases
    for b, _ in real_train.points:
        assert train.allocated_at(b) == real_train.allocated_at(b)
    for b, _ in real_eval.points:
        assert real_eval.allocated_at(b) <= evaluate.allocated_at(b) <= 1.3 * real_eval.allocated_at(b), b


@pytest.mark.parametrize("workload_type", [NNEncoderMasked, NNEncoderMaskedSeqFirst], ids=lambda t: t.__name__)
def test_a_masked_encoder_traces_for_a_cuda_target(workload_type):
    profile = estimate(workload_type(seq=16), "trace", Settings("bf16"), target="cuda")
    assert profile.estimator == "trace", profile.notes
    assert not any("math kernel" in n or "not counted" in n for n in profile.notes), profile.notes


def test_lstm_trace_counts_onednn_workspace_as_the_real_cpu_run_does():
    """CPU's LSTM keeps a oneDNN workspace for backward that its fake kernel reports empty (the
    trace was 20-40 % under); the trace asks the real kernel its size. That size is padded, not
    linear in the batch size: exact where trace and measurement probe the same size (2), and
    between the trace's probes (2, 16) the line through them is above the truth, never under."""
    workload = LSTM(seq=16)
    traced = estimate(workload, "trace", target="cpu")
    real = estimate(workload, "measured", target="cpu", device=CpuDevice())
    assert traced.estimator == "trace", traced.notes
    for fake, measured in zip(traced.phases, real.phases):
        assert fake.allocated_at(2) == measured.allocated_at(2), fake.name
        for b, _ in measured.points:
            assert measured.allocated_at(b) <= fake.allocated_at(b) <= 1.01 * measured.allocated_at(b), (fake.name, b)


def test_activation_checkpointing_shrinks_the_train_phase():
    plain = estimate(CNNWorkload(depth=3), "trace", target="cpu").phases[0]
    ckpt = estimate(CNNWorkload(depth=3), "trace", Settings(activation_checkpointing=True), target="cpu").phases[0]
    assert ckpt.activations_per_sample < plain.activations_per_sample  # the largest block is recomputed


def test_bf16_halves_what_autocast_casts():
    fp32 = estimate(CNNWorkload(), "trace", target="cpu").phases[1]
    bf16 = estimate(CNNWorkload(), "trace", Settings("bf16"), target="cpu").phases[1]
    assert bf16.activations_per_sample < 0.75 * fp32.activations_per_sample
    assert bf16.params == fp32.params  # parameters stay fp32 under autocast


MiB = 2**20


@pytest.mark.parametrize("allocator_conf", ["", "expandable_segments:True"])
def test_cuda_target_budgets_what_the_caching_allocator_reserves(allocator_conf):
    profile = estimate(MLPWorkload(), "trace", target="cuda", fragmentation=0.25, allocator_conf=allocator_conf)
    train, evaluate = profile.phases
    assert train.params % 512 == 0  # the allocator's 512-byte blocks
    assert train.context > 0 and train.workspace > 0
    assert train.allocator.expandable_segments == (allocator_conf != "") and train.sequence is not None
    # Every request of this MLP is at most 1 MiB (the largest, a 64 x 64 fp32 activation at b = 64, is
    # 16 KiB), so all come from the small pool; the trial's peak is 0.2 MB: one 2 MiB segment (or
    # page) holds it. The flat 25 % is not used.
    assert train.reserved_at(64) == 2 * MiB + train.context + train.workspace
    # The replay covers the first step and a second one; the second (with the optimizer's state from
    # the start) is the traced peak, which the profile holds exactly at the probe sizes (up to the
    # envelope's rounding to whole bytes).
    for b in (2, 16):
        assert abs(train.replay(b).peak_allocated - train.allocated_at(b)) <= 1
    cpu = estimate(MLPWorkload(), "trace", target="cpu").phases[0]
    assert cpu.sequence is None and cpu.reserved_at(64) == cpu.allocated_at(64)  # tensor bytes, nothing else


def test_a_modelled_profile_pickles_compactly_and_summarises_without_its_log():
    profile = estimate(CNNWorkload(), "trace", target="cuda", allocator_conf="")
    copy = pickle.loads(pickle.dumps(profile))
    assert copy == profile and copy.phases[0].reserved_at(64) == profile.phases[0].reserved_at(64)
    assert len(pickle.dumps(profile)) < 20_000  # sent from the driver to every trial
    summary = json.loads(json.dumps(profile.to_dict()))
    train = summary["phases"][0]
    assert train["allocator"] == "default" and set(train["sequence"]) == {"allocations", "events"}
    assert "codes" not in json.dumps(summary)


def test_eval_runs_in_the_cache_training_left():
    """Without memory pressure the allocator never gives segments back, so the eval phase,
    replayed after training at the micro-batch, reserves at least what training did."""
    train, evaluate = estimate(CNNWorkload(), "trace", target="cuda", allocator_conf="").phases
    assert train.reserved_at(512) > 20 * MiB  # activations of the large pool
    assert evaluate.reserved_at(8, micro_batch=512) >= train.reserved_at(512)
    assert evaluate.reserved_at(8, micro_batch=8) < train.reserved_at(512)


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


def _seq_growth(workload_type, target: str, **params) -> list[float]:
    """Per-sample activation bytes at sequence 128 over those at 64, per phase: 2 when memory
    is linear in the sequence, more when a (b, heads, s, s) score matrix is counted."""
    short, long = (estimate(workload_type(seq=s, **params), "trace", Settings("bf16"), target=target) for s in (64, 128))
    assert short.estimator == long.estimator == "trace", short.notes
    assert not any("math kernel" in n for n in short.notes), short.notes
    return [b.activations_per_sample / a.activations_per_sample for a, b in zip(short.phases, long.phases)]


@pytest.mark.parametrize("workload_type", [NNEncoder, NNEncoderSeqFirst, NNTransformer], ids=lambda t: t.__name__)
def test_torch_attention_layers_keep_no_score_matrix_for_a_cuda_target(workload_type):
    """``nn.MultiheadAttention`` calls attention from inside torch's own Python function (and,
    in eval, a fused fast path): the emulation still gives it CUDA's fused kernels, in train
    (dropout) and eval. A decoder's input is one token shorter: 127/63 = 2.016."""
    assert max(_seq_growth(workload_type, "cuda")) < 2.02


def test_a_cpu_target_counts_the_cpu_attention_score_matrix():
    assert _seq_growth(NNEncoder, "cpu")[0] > 2.5  # CPU's math path (dropout): the scores are there


class PositionalAttention(nn.Module):
    def __init__(self, dim=64, heads=4):
        super().__init__()
        self.heads, self.qkv = heads, nn.Linear(dim, 3 * dim)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, None, 0.1 if self.training else 0.0, True)  # dropout, causal


class PositionalAttentionWorkload(Workload):
    def __init__(self, seq: int):
        super().__init__()
        self.seq = seq

    def build_model(self):
        return PositionalAttention()

    def train_data(self):
        return TensorDataset(torch.randn(4, self.seq, 64))

    eval_data = train_data

    def loss(self, model, batch):
        (x,) = batch
        return model(x).float().pow(2).mean()


def test_attention_with_dropout_given_positionally_is_emulated():
    assert max(_seq_growth(PositionalAttentionWorkload, "cuda")) <= 2.0


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
        from orchestrator.device.torch_internals import FakeTensorMode
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


ENCODER = '''
# my_models/encoder.py
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from trainables.workload import Workload


class Classifier(nn.Module):
    def __init__(self, layers: int):
        super().__init__()
        layer = nn.TransformerEncoderLayer(32, 4, 128, 0.1, batch_first=True)
        self.body = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(32, 10)

    def forward(self, x):
        return self.head(self.body(x).mean(1))


@dataclass
class Encoder(Workload):
    layers: int = 48

    def build_model(self):
        return Classifier(self.layers)

    def _data(self):
        return TensorDataset(torch.randn(4096, 16, 32), torch.randint(0, 10, (4096,)))

    def train_data(self):
        return self._data()

    def eval_data(self):
        return self._data()

    def loss(self, model, batch):
        x, y = batch
        return F.cross_entropy(model(x), y)
'''


@pytest.mark.integration  # five processes of the installed command at once
def test_the_same_sweep_plans_the_same_in_every_process_at_once(tmp_path):
    """Planning one model over and over, each time in a fresh process as a user does, several at
    once on a machine's few cores, gives one plan, made with the allocator model every time. A
    transformer encoder in bf16 with AdamW and many layers: leaving autocast frees its weight-cast
    cache in the order of a hash table keyed by the weights' addresses, which differ per process;
    before the log was made canonical, about half of such processes (6 of 10 tried) planned with
    the flat fragmentation instead, so five all agreeing by chance was under 10 %. (With 24 layers
    only 1 process in 6 did: the layers are what makes the difference likely; each process traces
    for about a minute of one core, which is why there are five and not more. The canonical log
    itself is checked exactly in ``tests/test_memory_sequence.py``.)"""
    from tests.conftest import command_env, installed_command

    (tmp_path / "my_models").mkdir()
    (tmp_path / "my_models" / "encoder.py").write_text(ENCODER.lstrip())
    (tmp_path / "sweep.yaml").write_text(textwrap.dedent("""
        experiment: encoder
        workload: {name: "my_models.encoder:Encoder"}
        search_space: {lr: {grid: [0.001]}}
        effective_batch_size: 4096
        stop: {epochs: 1}
        memory: {estimator: trace, precision: bf16}
    """))
    runs = [subprocess.Popen([installed_command(), "plan", "sweep.yaml", "--device-memory", "1200MiB", "--json"],
                             cwd=tmp_path, env=command_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for _ in range(5)]
    try:
        outputs = [run.communicate(timeout=1200) for run in runs]
    finally:
        for run in runs:
            run.kill()
            run.wait()
    plans, notes = set(), set()
    for run, (out, err) in zip(runs, outputs):
        assert run.returncode == 0, err[-2000:]
        [trial] = json.loads(out)["trials"]
        plan = trial["plan"]
        plans.add((plan["micro_batch"], plan["accum_steps"], plan["eval_batch"], plan["predicted_peak_bytes"], plan["note"]))
        notes.update(trial["profile"]["notes"])
        assert all(phase["sequence"] is not None for phase in trial["profile"]["phases"]), trial["profile"]["notes"]
    assert len(plans) == 1, plans
    assert "not the allocator model" not in plans.pop()[-1]
    assert not any("allocations change" in n for n in notes), notes
