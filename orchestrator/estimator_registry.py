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


@dataclass(frozen=True)
class Estimator:
    """One registered estimator."""

    name: str
    #: ``"package.module:function"``, imported when first used, or the function itself
    function: Union[str, Callable[..., Any]]
    #: It probes the trial's own device, so only the trial's worker can make its estimate (the
    #: driver makes the others before the trials start, ``orchestrator.estimates``).
    probes_device: bool = False


#: Every estimator, by name, in the order ``plan --estimator`` lists them.
ESTIMATORS: dict[str, Estimator] = {}


def register(name: str, function: Union[str, Callable[..., Any]], *, probes_device: bool = False) -> None:
    if name == NO_ESTIMATE or not name.isidentifier():
        raise ValueError(f"an estimator's name must be an identifier other than {NO_ESTIMATE!r}, got {name!r}")
    ESTIMATORS[name] = Estimator(name, function, probes_device)


def names() -> tuple[str, ...]:
    """The registered estimators' names (``none`` is not one: it is the absence of an estimate)."""
    return tuple(ESTIMATORS)


def registered(name: str) -> Estimator:
    """The estimator called ``name``; ValueError naming the registered ones where there is none."""
    if name not in ESTIMATORS:
        raise ValueError(f"estimator: expected one of {', '.join(names())}, got {name!r}")
    return ESTIMATORS[name]


register("static", "orchestrator.memory.static:static_profile")
register("trace", "orchestrator.memory.trace:trace_or_fallback")
register("measured", "orchestrator.memory.measured:measured_profile", probes_device=True)
