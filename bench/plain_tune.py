"""What the sweep benchmarks share: the plain Ray Tune trainable they compare the orchestrator
against, and how each variant is started (a fresh process, in a fresh folder, with the same
environment), so that ``sweep_overhead.py`` and ``sweep_scale.py`` measure the same baseline.

The trainable is the loop a Tune user writes by hand: the demo MLP (``trainables/mlp.py``), a
``DataLoader``, the workload's own optimizer, an evaluation and a ``tune.report`` per epoch, no
checkpoints, no MLflow. Ray's workers import it from here (``PYTHONPATH`` holds the repository).
"""

from __future__ import annotations

import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def train_plain(config: dict) -> None:
    """One trial: ``config`` has ``lr``, ``width``, ``samples``, ``epochs`` (and ``batch``, 32 by default)."""
    from ray import tune

    for epoch, eval_loss in train_epochs(config):
        tune.report({"epoch": epoch, "eval_loss": eval_loss})


def train_epochs(config: dict):
    """The training loop, yielding ``(epoch, eval_loss)`` after each epoch's evaluation."""
    import torch
    from torch.utils.data import DataLoader

    from trainables.mlp import MLPWorkload

    workload = MLPWorkload(width=config["width"], lr=config["lr"], train_samples=config["samples"])
    torch.manual_seed(0)
    model = workload.build_model()
    optimizer = workload.build_optimizer(model)  # the trial's own (AdamW at lr), not a cheaper one
    train = DataLoader(workload.train_data(), batch_size=config.get("batch", 32), shuffle=True, drop_last=True)
    evaluate = DataLoader(workload.eval_data(), batch_size=64)
    for epoch in range(1, config["epochs"] + 1):
        model.train()
        for batch in train:
            loss = workload.loss(model, batch)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        model.eval()
        with torch.no_grad():
            eval_loss = sum(workload.loss(model, b).item() * len(b[0]) for b in evaluate) / len(evaluate.dataset)
        yield epoch, eval_loss


def training_seconds(config: dict, repeats: int = 3) -> float:
    """The fastest of ``repeats`` runs of one trial's training on one thread (as a one-CPU Ray
    worker runs it), outside Ray: what a trial costs when nothing but training is paid for."""
    import torch

    torch.set_num_threads(1)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in train_epochs(config):
            pass
        best = min(best, time.perf_counter() - started)
    return best


def bench_env() -> dict[str, str]:
    """The environment every variant runs in: no usage stats or telemetry, the repository
    importable (by Ray's workers too) ahead of any ``PYTHONPATH`` given (a profiling probe's), and
    no Ray cluster to attach to."""
    path = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
    return {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "MLFLOW_DISABLE_TELEMETRY": "true",
            "PYTHONPATH": path, "RAY_ADDRESS": ""}


def installed(command: str) -> str:
    """The path of a console script of the virtual environment this benchmark runs in."""
    return os.path.join(os.path.dirname(sys.executable), command)
