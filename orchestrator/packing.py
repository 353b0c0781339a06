"""``resources.gpu: auto``: ask Ray for the fraction of a GPU a trial's plan needs.

Ray schedules GPUs by count, not memory (ray issues #26929, #37574). A trial that asks for the
fraction of the card its plan needs, rounded up to ``memory.gpu_granularity``, lets small trials
share a GPU while large ones get a whole one; the trial then caps its allocator to that share
(PyTorch's per-process memory fraction, less its CUDA context: ``cuda.allocator_fraction``), so its
growth cannot OOM a neighbour.
Tune evaluates the resources callable once per trial, in the driver, when the trial is created.
"""

from __future__ import annotations

import math
from typing import Any, Callable

from orchestrator.config import SweepSpec
from orchestrator.device import nvml
from orchestrator.errors import UserError


def gpu_fraction(needed_bytes: int, device_total: int, granularity: float) -> float:
    """``needed / total`` rounded up to the granularity, at most one whole GPU."""
    steps = math.ceil(needed_bytes / device_total / granularity - 1e-9)
    return min(max(steps, 1) * granularity, 1.0)


def device_total_bytes(spec: SweepSpec) -> int:
    """The card the driver plans for: NVML's GPU 0 when the driver sees one, else memory.budget."""
    info = nvml.gpu_info(0)
    if info is not None:
        return info.total
    if spec.memory.budget is None:
        raise UserError(
            "resources.gpu: 'auto' needs to know the GPU's memory; this machine has no GPU for NVML "
            "to read, so set memory.budget (e.g. memory.budget: 80GiB)"
        )
    return spec.memory.budget


def auto_gpu_resources(spec: SweepSpec, estimates) -> Callable[[dict[str, Any]], Any]:
    """The ``with_resources`` callable: plan the trial in the driver from the sweep's estimates
    (``orchestrator.estimates``), request its share."""
    from ray.tune import PlacementGroupFactory

    from orchestrator.device.target import resolve_target
    from orchestrator.memory.cache import ProfileCache
    from orchestrator.memory.phases import TrainingLength
    from orchestrator.planner import make_plan
    from trainables.workload import build_workload

    total = device_total_bytes(spec)
    target = resolve_target(spec, card=total)  # as `plan --device-memory` plans for a card of that size

    def resources(config: dict[str, Any]) -> PlacementGroupFactory:
        # A CUDA profile's peak already counts the context, workspaces and fragmentation.
        workload = build_workload(config)
        profiles = ProfileCache(workload, spec.memory, target.kind, known=estimates.known(config, target.kind),
                                length=TrainingLength.of(spec))
        plan = make_plan(workload, spec.memory, spec.effective_batch_size, target.budget, target=target.kind, profiles=profiles)
        share = gpu_fraction(plan.predicted_peak_bytes or total, total, spec.memory.gpu_granularity)
        return PlacementGroupFactory([{"CPU": spec.resources.cpu, "GPU": share}])

    return resources
