"""One optimizer step and one eval step, shared by the training loop and the memory estimators.

The estimators trace and probe exactly these functions, so what is estimated is what trains.
"""

from __future__ import annotations

import contextlib
from typing import Iterable, Sequence

import torch
from torch import nn

from orchestrator.device import Device
from trainables.carry import Carry, merge_rows, stateful_loss
from trainables.workload import Batch, Workload, map_tensors, metric_sums, one_number, to_device

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(precision: str, device: torch.device):
    """Mixed precision for ``bf16``/``fp16``; a no-op for ``fp32``."""
    dtype = PRECISIONS[precision]
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def make_grad_scaler(precision: str, device: Device, init_scale: float = 2.0**16) -> torch.amp.GradScaler | None:
    """fp16 needs loss scaling to keep small gradients (where the device says so); bf16 and fp32 do not.
    ``init_scale``: torch's default, under which the first steps often overflow and are skipped."""
    if precision == "fp16" and device.scales_fp16_loss:
        return torch.amp.GradScaler(device.torch_device.type, init_scale=init_scale)
    return None


def train_step(
    workload: Workload,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: Iterable[Batch],
    sizes: Sequence[int],
    device: torch.device,
    precision: str = "fp32",
    scaler: torch.amp.GradScaler | None = None,
    max_grad_norm: float | None = None,
    carry: Carry | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Accumulate gradients over ``micro_batches`` (of ``sizes`` samples) and take one optimizer step.

    Returns the mean loss as a detached tensor (no ``.item()`` here: the estimators run this
    step on fake tensors, which have no values, and a GPU should not wait for the host), and
    the gradient norm where clipping computed one (see :func:`apply_gradients`).
    ``carry``: a stateful workload's state, replaced by the step's (see ``accumulate_gradients``).
    """
    mean_loss = accumulate_gradients(workload, model, micro_batches, sizes, device, precision, scaler, carry=carry)
    grad_norm = apply_gradients(model, optimizer, scaler, max_grad_norm)
    return mean_loss, grad_norm


def accumulate_gradients(
    workload: Workload,
    model: nn.Module,
    micro_batches: Iterable[Batch],
    sizes: Sequence[int],
    device: torch.device,
    precision: str = "fp32",
    scaler: torch.amp.GradScaler | None = None,
    total: int | None = None,
    carry: Carry | None = None,
) -> torch.Tensor:
    """The backward passes of one step: the parameters' ``.grad`` sum each micro-batch's gradient.

    Each micro-batch's mean loss is weighted by its share of the step's ``total`` samples (these
    ``sizes``, or the whole group's step when ranks share it), so the summed gradient is the
    gradient of the mean loss over the whole effective batch: micro-batch 8 x 4 updates the
    weights as micro-batch 32 x 1 does. ``micro_batches`` is consumed one at a time, and each
    is dropped before the next is taken, as memory allows only one micro-batch's activations.
    Returns this rank's share of the mean loss.

    A stateful workload's ``carry`` holds the state of the step's rows: each micro-batch gets
    its own rows of it (``trainables.carry``), and once every micro-batch has run, ``carry``
    holds their new states, detached (not before: a step that fails leaves it as it was).
    """
    total = total or sum(sizes)
    mean_loss = None
    states = carry.split(sizes) if carry is not None else None
    new_states = []
    # Not enumerate(): its cached result tuple would hold the previous micro-batch while the next is fetched.
    for size, batch in zip(sizes, micro_batches):  # sizes first: no micro-batch is fetched past the last
        batch = to_device(batch, device)
        with autocast(precision, device):
            if states is None:
                loss = one_number(workload, workload.loss(model, batch), size)
            else:
                loss, state = stateful_loss(workload, model, batch, states.pop(0))  # its rows, then held by its graph only
                new_states.append(map_tensors(torch.Tensor.detach, state))  # no graph kept past backward
                del state
            if size != total:  # a share of the step (x 1.0 would change no bit: one op and its backward less)
                loss = loss * (size / total)
        (scaler.scale(loss) if scaler else loss).backward()
        part = loss.detach().float()
        mean_loss = part if mean_loss is None else mean_loss + part  # as 0 + a + b would, bit for bit
        del loss, batch, part  # the next micro-batch must not find this one's graph still alive
    if carry is not None:
        carry.state = merge_rows(new_states, carry.dim)
    return mean_loss if mean_loss is not None else torch.zeros((), device=device)


def apply_gradients(
    model: nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None = None,
    max_grad_norm: float | None = None,
) -> torch.Tensor | None:
    """The optimizer step on the accumulated gradient, clipped once (unscaled first under fp16).

    Returns the gradient norm clipping computed, for the loop's divergence watch
    (``trainables.divergence``); None without clipping, and under fp16 loss scaling, where an
    infinite norm is the scaler's to handle (it skips the step and lowers its scale).
    """
    grad_norm = None
    if max_grad_norm is not None:
        if scaler:
            scaler.unscale_(optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    if scaler:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return None if scaler else grad_norm


@torch.no_grad()
def eval_step(
    workload: Workload, model: nn.Module, batch: Batch, samples: int, device: torch.device, precision: str = "fp32"
) -> dict[str, torch.Tensor]:
    """The workload's eval sums over ``batch`` (``samples`` samples), as float tensors on ``device``."""
    batch = to_device(batch, device)
    with autocast(precision, device):
        sums = metric_sums(workload, workload.eval_metrics(model, batch, samples), samples)
    return {name: torch.as_tensor(value, device=device).detach().float() for name, value in sums.items()}
