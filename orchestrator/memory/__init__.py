"""Memory estimation: what a trial needs, per phase, before it runs.

The estimators behind :func:`estimate` are registered by name in
``orchestrator/estimator_registry.py``; each produces a :class:`MemoryProfile`:

* ``static`` (``memory.static``): states counted from the model and optimizer, activations by
  a conservative heuristic from one forward pass on fake tensors. Instant, errs high.
* ``trace`` (``memory.trace``): the real train and eval steps on fake tensors, every op's bytes
  counted, the peak read at every batch size. No GPU needed; on a CPU-only machine CUDA's
  kernels and autocast are emulated for a CUDA target (``memory.cuda_emulation``).
* ``measured`` (``memory.measured``): probe steps on the worker's device, the allocator's
  own statistics (or the CPU tensor tracker).

docs/ARCHITECTURE.md, "How to add an estimator", says how another joins them.
"""

from __future__ import annotations

import importlib
from typing import Callable

from orchestrator.allocator_conf import DEFAULT_ALLOC_CONF
from orchestrator.estimator_registry import registered
from orchestrator.memory.profile import TARGETS, EstimateRequest, EstimationError, MemoryProfile, PhaseProfile, Settings

__all__ = [
    "TARGETS", "EstimateRequest", "EstimationError", "MemoryProfile", "PhaseProfile", "Settings", "estimate",
]


def estimate(
    workload,
    estimator: str,
    settings: Settings = Settings(),
    *,
    target: str,
    fragmentation: float = 0.10,
    allocator_conf: str | None = DEFAULT_ALLOC_CONF,
    device=None,
) -> MemoryProfile:
    """Profile ``workload``'s memory with the estimator registered as ``estimator``, for a device
    of kind ``target``.

    ``target`` is what the trial will run on: ``cuda`` (a profile that budgets reserved memory:
    the caching allocator's, workspaces, the CUDA context), ``cpu`` or ``emulated`` (tensor bytes
    only). ``allocator_conf`` is the trial's ``PYTORCH_CUDA_ALLOC_CONF``: ``trace`` replays its
    allocations through a model of that allocator; ``static`` adds ``fragmentation`` instead.
    ``device`` is the worker's ``orchestrator.device.Device`` where there is one: ``measured``
    probes on it, and ``trace`` falls back to it. Raises :class:`EstimationError` where no
    estimate could be made.
    """
    function = estimator_function(estimator)
    if target not in TARGETS:
        raise ValueError(f"target: expected one of {', '.join(TARGETS)}, got {target!r}")
    return function(workload, EstimateRequest(settings, target, fragmentation, allocator_conf, device))


def estimator_function(name: str) -> Callable[[object, EstimateRequest], MemoryProfile]:
    """The registered estimator's function, imported the first time it is asked for."""
    function = registered(name).function
    if isinstance(function, str):
        module, _, attribute = function.partition(":")
        function = getattr(importlib.import_module(module), attribute)
    return function
