"""The optimizer an estimate counts: the one the trial will build on its device, run as it will run there.

A workload may pick its optimizer by device (``fused=True`` AdamW on CUDA, a per-parameter loop
elsewhere: ``Workload.build_optimizer``'s ``device_type``), and PyTorch picks the implementation
of one left to its default by device too (foreach on CUDA). The three keep different memory at
the optimizer step: *fused* updates every parameter in place in one kernel and allocates nothing
(its ``step`` counters live on the device, one per parameter); *foreach* allocates temporaries the
size of the whole parameter list (a gradient-sized copy at once, per op); the *for-loop* allocates
one parameter's temporaries at a time. So the estimators build the optimizer for the torch
device type the trial trains on (``orchestrator.device.target.trains_on``), even when the trace
runs on fake CPU tensors, and the profile's notes name what they counted.
"""

from __future__ import annotations

import torch
from torch import nn

from orchestrator.device.target import trains_on
from trainables.workload import Workload, optimizer_for


def build_for_target(workload: Workload, model: nn.Module, target: str) -> torch.optim.Optimizer:
    """``workload``'s optimizer of ``model`` as a trial of ``target`` (cuda | cpu | emulated) builds it.

    On fake tensors PyTorch's default would pick the per-parameter loop for a CUDA target (fake
    parameters are not plain CUDA tensors), where a real CUDA model gets foreach: a group left
    to the default (``foreach=None``, not fused) is set to foreach, as on CUDA.
    """
    optimizer = optimizer_for(workload, model, trains_on(target))
    if target == "cuda":
        for group in optimizer.param_groups:
            if group.get("foreach", False) is None and not group.get("fused"):
                group["foreach"] = True
    return optimizer


def implementation(optimizer: torch.optim.Optimizer) -> str:
    """``fused``, ``foreach`` or ``for-loop``: how ``optimizer`` steps (its groups' settings; a
    group left to the default on a CPU steps by the loop). Mixed groups are listed in order; an
    optimizer whose groups have neither setting (not one of torch's) has its own way: ``""``."""
    kinds = []
    for group in optimizer.param_groups:
        if "fused" not in group and "foreach" not in group:
            continue
        kind = "fused" if group.get("fused") else "foreach" if group.get("foreach") else "for-loop"
        kinds.extend([kind] if kind not in kinds else [])
    return "+".join(kinds)


def describe(optimizer: torch.optim.Optimizer, target: str) -> str:
    """The profile's note: which optimizer was counted, and for which device."""
    how = implementation(optimizer)
    return f"optimizer {type(optimizer).__name__}{f' ({how})' if how else ''}, as built for a {trains_on(target)} device"
