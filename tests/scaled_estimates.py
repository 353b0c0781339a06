"""A user's module that registers estimators beside its workload: the real ``trace``, its every
byte scaled 20 % down (``trace_low``, which says it may be 30 % low: its error bound; and
``trace_low_tight``, which claims 20 %, less than the 25 % the device needs over it) or 20 % up
(``trace_high``, the default bound). Importing the workload registers them, in the driver, its estimate processes
and every trial's worker; ``tests/test_verify.py`` copies this file into a user's package."""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

from orchestrator.estimator_registry import register
from orchestrator.memory import EstimateRequest, MemoryProfile, estimate
from trainables.mlp import MLPWorkload

LOW, HIGH = 0.8, 1.2


def scaled_trace(factor: float, name: str, workload, request: EstimateRequest) -> MemoryProfile:
    """The trace's profile with every byte of every phase times ``factor``."""
    profile = estimate(workload, "trace", request.settings, target=request.target,
                       fragmentation=request.fragmentation, allocator_conf=request.allocator_conf, device=request.device)

    def scale(n: int) -> int:
        return round(n * factor)

    phases = tuple(
        dataclasses.replace(
            p, params=scale(p.params), grads=scale(p.grads), optimizer=scale(p.optimizer), buffers=scale(p.buffers),
            activations_per_sample=scale(p.activations_per_sample), fixed_other=scale(p.fixed_other),
            step_floor=scale(p.step_floor), points=tuple((b, scale(m)) for b, m in p.points),
        )
        for p in profile.phases
    )
    return dataclasses.replace(profile, estimator=name, phases=phases)


register("trace_low", functools.partial(scaled_trace, LOW, "trace_low"), error_bound=0.3)
register("trace_low_tight", functools.partial(scaled_trace, LOW, "trace_low_tight"), error_bound=0.2)
register("trace_high", functools.partial(scaled_trace, HIGH, "trace_high"))


@dataclasses.dataclass
class DeepMLP(MLPWorkload):
    """A narrow, deep MLP: its activations, not its weights, fill the device, so the batch size matters."""

    width: int = 128
    depth: int = 4
    optimizer: Literal["sgd", "adam", "adamw"] = "sgd"
