"""Memory estimation: what a trial needs, per phase, before it runs.

Three estimators behind :func:`estimate`, each producing a :class:`MemoryProfile`:

* ``static`` (``memory.static``): states counted from the model and optimizer, activations by
  a conservative heuristic from one forward pass on fake tensors. Instant, errs high.
* ``trace`` (``memory.trace``): the real train and eval steps on fake tensors, every op's bytes
  counted, the peak read at every batch size. No GPU needed; on a CPU-only machine CUDA's
  kernels and autocast are emulated for a CUDA target (``memory.cuda_emulation``).
* ``measured`` (``memory.measured``): probe steps on the worker's device, the allocator's
  own statistics (or the CPU tensor tracker).
"""

from __future__ import annotations

from dataclasses import replace

from orchestrator.allocator_conf import DEFAULT_ALLOC_CONF, parse_alloc_conf
from orchestrator.memory.failure import summary
from orchestrator.memory.fake import Untraceable
from orchestrator.memory.measured import MeasurementFailed, measured_profile
from orchestrator.memory.profile import ESTIMATORS, TARGETS, MemoryProfile, PhaseProfile, Settings
from orchestrator.memory.static import static_profile
from orchestrator.memory.trace import trace_profile

__all__ = [
    "ESTIMATORS", "TARGETS", "EstimationError", "MemoryProfile", "PhaseProfile", "Settings", "estimate",
]


class EstimationError(Exception):
    """No estimate could be made (e.g. not even the smallest probe fit on the device)."""


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
    """Profile ``workload``'s memory with ``estimator`` for a device of kind ``target``.

    ``target`` is what the trial will run on: ``cuda`` (a profile that budgets reserved memory:
    the caching allocator's, workspaces, the CUDA context), ``cpu`` or ``emulated`` (tensor bytes
    only). ``allocator_conf`` is the trial's ``PYTORCH_CUDA_ALLOC_CONF``: ``trace`` replays its
    allocations through a model of that allocator; ``static`` adds ``fragmentation`` instead.
    ``device`` is the worker's ``orchestrator.device.Device`` where there is one: ``measured``
    probes on it, and ``trace`` falls back to it. A workload ``trace`` cannot run falls back to
    ``measured`` (with a device) or ``static``, with a note saying why; it never raises for that.
    """
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator: expected one of {', '.join(ESTIMATORS)}, got {estimator!r}")
    if target not in TARGETS:
        raise ValueError(f"target: expected one of {', '.join(TARGETS)}, got {target!r}")
    if estimator == "static":
        return static_profile(workload, settings, target=target, fragmentation=fragmentation)
    if estimator == "measured":
        try:
            return measured_profile(workload, settings, target=target, fragmentation=fragmentation, device=device)
        except MeasurementFailed as exc:
            raise EstimationError(str(exc)) from exc
    allocator = parse_alloc_conf(allocator_conf)
    try:
        return trace_profile(workload, settings, target=target, fragmentation=fragmentation, allocator=allocator)
    except Untraceable as exc:
        reason = str(exc)
    except Exception as exc:  # a model fake tensors trip over in some other way: still plan, say why
        reason = summary(exc)
    fallback = "measured" if device is not None else "static"
    profile = estimate(workload, fallback, settings, target=target, fragmentation=fragmentation, device=device,
                       allocator_conf=allocator_conf)
    return replace(profile, notes=(f"trace impossible ({reason}); fell back to {fallback}", *profile.notes))
