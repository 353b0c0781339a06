"""The training loop: accumulation equals the full batch, resume equals no interruption,
and the peak memory it reports is the tracker's."""

import math

import torch

from orchestrator.device import CpuDevice
from trainables.cnn import CNNWorkload
from trainables.loop import LoopPlan, Trainer
from trainables.mlp import MLPWorkload


def _weights(trainer):
    return [p.detach().clone() for p in trainer.model.parameters()]


def _train(workload, plan, epochs, seed=0):
    trainer = Trainer(workload, CpuDevice(), plan, seed=seed)
    results = [trainer.run_epoch() for _ in range(epochs)]
    return trainer, results


def test_micro_batch_8_x_4_makes_the_same_updates_as_32_x_1():
    workload = MLPWorkload(width=32, lr=0.01, train_samples=256, eval_samples=64)
    full, _ = _train(workload, LoopPlan(micro_batch=32, effective_batch=32, eval_batch=64), epochs=2)
    accumulated, _ = _train(workload, LoopPlan(micro_batch=8, effective_batch=32, eval_batch=16), epochs=2)
    for a, b in zip(_weights(full), _weights(accumulated)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_uneven_micro_batches_keep_the_effective_batch_update():
    workload = MLPWorkload(width=16, lr=0.01, train_samples=120, eval_samples=30)
    full, _ = _train(workload, LoopPlan(micro_batch=24, effective_batch=24, eval_batch=30), epochs=1)
    uneven, _ = _train(workload, LoopPlan(micro_batch=10, effective_batch=24, eval_batch=7), epochs=1)  # 10+10+4
    for a, b in zip(_weights(full), _weights(uneven)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_resume_from_a_checkpoint_equals_an_uninterrupted_run():
    workload = CNNWorkload(width=8, train_samples=128, eval_samples=32)
    plan = LoopPlan(micro_batch=16, effective_batch=32, eval_batch=32)
    straight, straight_results = _train(workload, plan, epochs=3)

    first, _ = _train(workload, plan, epochs=2)
    state = first.state_dict()
    resumed = Trainer(workload, CpuDevice(), plan, seed=0)
    resumed.load_state_dict(state)
    last = resumed.run_epoch()

    assert last.epoch == 3
    assert last.eval_loss == straight_results[-1].eval_loss
    for a, b in zip(_weights(straight), _weights(resumed)):
        torch.testing.assert_close(a, b)


def test_loss_goes_down_on_the_synthetic_data():
    for workload in (MLPWorkload(lr=0.01), CNNWorkload(lr=0.01)):
        _, results = _train(workload, LoopPlan(micro_batch=64, effective_batch=64, eval_batch=128), epochs=3)
        chance = math.log(workload.classes)  # the loss of a model that learned nothing
        assert results[-1].eval_loss < 0.6 * chance, (workload, [r.eval_loss for r in results])
        assert results[-1].train_loss < results[0].train_loss


def test_cpu_peak_counts_parameters_gradients_optimizer_state_and_activations():
    workload = MLPWorkload(width=256, depth=1, in_features=256, classes=8, optimizer="adamw",
                           train_samples=64, eval_samples=64)
    trainer, results = _train(workload, LoopPlan(micro_batch=64, effective_batch=64, eval_batch=64), epochs=1)
    params = sum(p.numel() * 4 for p in trainer.model.parameters())
    reading = results[0].memory
    assert reading.source == "cpu_tensor_tracker" and reading.peak_reserved is None
    # weights + grads + two AdamW moments, plus the batch and its activations on top
    assert reading.peak_allocated > 4 * params
    assert reading.peak_allocated < 4 * params + 64 * (256 + 256 + 256 + 8) * 4 * 4
