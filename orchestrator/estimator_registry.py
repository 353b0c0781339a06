"""Which memory estimators exist, by name: what ``memory.estimator`` and ``plan --estimator`` accept.

An estimator is one function in ``orchestrator/memory/``,
``(workload, orchestrator.memory.profile.EstimateRequest) -> MemoryProfile``, registered here
by its import path with one line at the bottom of this module. It is not imported here: the
config, which checks the names, sits below the estimators and loads neither torch nor them
(docs/ARCHITECTURE.md, "Layers"); ``orchestrator.memory.estimate`` imports the one a trial
names. A test, or anything else running in the process, may register the function itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Union

#: ``memory.estimator: none``: no estimate, the whole batch at once; OOM retries do the rest.
NO_ESTIMATE = "none"
#: How far below the device's peak an estimator's prediction may be, unless it says otherwise.
DEFAULT_ERROR_BOUND = 0.10


@dataclass(frozen=True)
class Estimator:
    """One registered estimator."""

    name: str
    #: ``"package.module:function"``, imported when first used, or the function itself
    function: Union[str, Callable[..., Any]]
    #: It probes the trial's own device, so only the trial's worker can make its estimate (the
    #: driver makes the others before the trials start, ``orchestrator.estimates``).
    probes_device: bool = False
    #: How far below the device's real peak its predictions may be (a fraction): a trial that
    #: verifies its plan (``memory.verify``) runs its first steps at the plan that fits with every
    #: prediction raised by this much, so an estimate that far too low still cannot run out of memory.
    error_bound: float = DEFAULT_ERROR_BOUND


#: Every estimator, by name, in the order ``plan --estimator`` lists them.
ESTIMATORS: dict[str, Estimator] = {}


def register(name: str, function: Union[str, Callable[..., Any]], *, probes_device: bool = False,
             error_bound: float = DEFAULT_ERROR_BOUND) -> None:
    if name == NO_ESTIMATE or not name.isidentifier():
        raise ValueError(f"an estimator's name must be an identifier other than {NO_ESTIMATE!r}, got {name!r}")
    if not 0 <= error_bound < 10:
        raise ValueError(f"an estimator's error_bound is a fraction >= 0 (0.1: 10 %), got {error_bound!r}")
    ESTIMATORS[name] = Estimator(name, function, probes_device, error_bound)


def names() -> tuple[str, ...]:
    """The registered estimators' names (``none`` is not one: it is the absence of an estimate)."""
    return tuple(ESTIMATORS)


def registered(name: str) -> Estimator:
    """The estimator called ``name``; ValueError naming the registered ones where there is none."""
    if name not in ESTIMATORS:
        raise ValueError(f"estimator: expected one of {', '.join(names())}, got {name!r}")
    return ESTIMATORS[name]


# The bounds: the trace's peaks came within 1 % of an H100's for the models measured so far
# (docs/ARCHITECTURE.md), but kernels it has not met (cuDNN's RNN workspaces, torch.compile) may
# take more; ``static`` counts activations by a heuristic; ``measured`` probed this very device.
register("static", "orchestrator.memory.static:static_profile")
register("trace", "orchestrator.memory.trace:trace_or_fallback")
register("measured", "orchestrator.memory.measured:measured_profile", probes_device=True, error_bound=0.05)
