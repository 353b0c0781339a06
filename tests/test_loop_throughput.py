"""The loops ``bench/loop_throughput.py --model lstm`` times train the same thing: the plain
PyTorch TBPTT loop and the trainer make the same losses, step for step (timings stay in bench/)."""

from __future__ import annotations

import torch

from bench.loop_throughput import Tbptt, tbptt_losses


def test_the_benchs_plain_tbptt_loop_and_the_trainer_make_the_same_losses():
    run = Tbptt.of_config(steps=6)  # configs/lstm_tbptt_cpu.yaml's workload, streams and clipping
    assert (run.streams, run.workload.bptt, run.max_grad_norm) == (32, 16, 0.25)
    plain, trainer = tbptt_losses(run)
    assert len(plain) == len(trainer) == 6
    torch.testing.assert_close(trainer, plain, rtol=1e-6, atol=1e-6)
    assert plain[-1] < plain[0]
