"""One optimizer step and one eval step, shared by the training loop and the memory estimators.

The estimators trace and probe exactly these functions, so what is estimated is what trains.
"""

from __future__ import annotations

import contextlib
from typing import Sequence

import torch
from torch import nn

from trainables.workload import Batch, Workload, to_device

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(precision: str, device: torch.device):
    """Mixed precision for ``bf16``/``fp16``; a no-op for ``fp32``."""
    dtype = PRECISIONS[precision]
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def make_grad_scaler(precision: str, device: torch.device) -> torch.amp.GradScaler | None:
    """fp16 needs loss scaling to keep small gradients; bf16 and fp32 do not."""
    if precision == "fp16" and device.type == "cuda":
        return torch.amp.GradScaler("cuda")
    return None


def train_step(
    workload: Workload,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: Sequence[Batch],
    device: torch.device,
    precision: str = "fp32",
    scaler: torch.amp.GradScaler | None = None,
) -> torch.Tensor:
    """Accumulate gradients over ``micro_batches`` and take one optimizer step.

    Each micro-batch's mean loss is weighted by its share of the samples, so the summed gradient
    is the gradient of the mean loss over the whole effective batch: micro-batch 8 x 4 updates
    the weights as micro-batch 32 x 1 does. Returns that mean loss as a detached tensor (no
    ``.item()`` here: the estimators run this step on fake tensors, which have no values).
    """
    sizes = [_batch_size(b) for b in micro_batches]
    total = sum(sizes)
    mean_loss = torch.zeros((), device=device)
    for batch, size in zip(micro_batches, sizes):
        batch = to_device(batch, device)
        with autocast(precision, device):
            loss = workload.loss(model, batch) * (size / total)
        (scaler.scale(loss) if scaler else loss).backward()
        mean_loss += loss.detach().float()
        del loss, batch  # the next micro-batch must not find this one's graph still alive
    if scaler:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return mean_loss


@torch.no_grad()
def eval_step(
    workload: Workload, model: nn.Module, batch: Batch, device: torch.device, precision: str = "fp32"
) -> torch.Tensor:
    """Sum of the per-sample loss over ``batch`` as a tensor (the caller divides by the sample count)."""
    batch = to_device(batch, device)
    with autocast(precision, device):
        loss = workload.loss(model, batch)
    return loss.float() * _batch_size(batch)


def _batch_size(batch: Batch) -> int:
    leaf = batch
    while not isinstance(leaf, torch.Tensor):
        leaf = next(iter(leaf.values())) if isinstance(leaf, dict) else leaf[0]
    return leaf.shape[0]
