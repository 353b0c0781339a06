"""A workload's memory profiles by planner settings, estimated once each.

The planner asks for the profile of each setting it considers (full precision, then with
activation checkpointing, then lower precision); each is estimated the first time it is asked
for. The driver fills one per memory signature before the trials start
(``orchestrator.estimates``) and hands the trials what it made (``known``), so a trial
estimates only what the driver could not.
"""

from __future__ import annotations

from dataclasses import replace

from orchestrator.allocator_conf import effective_allocator_conf
from orchestrator.config import MemoryPolicy
from orchestrator.estimator_registry import ESTIMATORS
from orchestrator.memory import EstimationError, MemoryProfile, Settings, estimate
from orchestrator.memory.phases import TrainingLength, phases_of


class ProfileCache:
    """Profiles of one workload by planner settings, estimated when first asked for.

    ``known`` holds profiles made elsewhere (the driver's); a setting that is not there is
    estimated here. ``None`` marks a setting whose estimation failed, with the reason in ``errors``.

    ``length``: how far the trial trains (``memory.phases.TrainingLength``; ``epochs``, the epochs
    it starts, None for all): the phases of a stage of the workload's module-activation schedule
    that starts later are left out of what :meth:`get` gives the planner. A sweep of two epochs, run before
    a module is switched on at the third, is not planned (or refused) for that module. They are
    still estimated, and kept whole, so profiles made for one budget serve another.
    """

    def __init__(self, workload, policy: MemoryPolicy, target: str, device=None,
                 known: dict[Settings, MemoryProfile | None] | None = None, length: TrainingLength | None = None):
        self.workload, self.policy, self.target, self.device = workload, policy, target, device
        self.cache: dict[Settings, MemoryProfile | None] = dict(known or {})
        self.errors: dict[Settings, str] = {}
        self.epochs = length.epochs(workload) if length is not None else None

    def get(self, settings: Settings) -> MemoryProfile | None:
        """The profile of ``settings``, its phases those of the stages the trial reaches."""
        profile = self._whole(settings)
        if profile is None or self.epochs is None:
            return profile
        names = {phase.name for phase in phases_of(self.workload, self.epochs)}
        reached = tuple(p for p in profile.phases if p.name in names)
        return profile if len(reached) == len(profile.phases) else replace(profile, phases=reached)

    def made(self, settings: Settings) -> MemoryProfile | None:
        """:meth:`get` where ``settings`` was estimated already or can be without the device, else
        None: a trial re-predicting after an OOM does not start an estimate on its device. An OOM
        that turns on activation checkpointing or the lower precision asks for settings the plan
        never needed, which an estimator that does not probe the device (``trace``, ``static``)
        makes here as the driver would, without the device (a trace that cannot run falls back
        to ``static``, not to ``measured``)."""
        estimator = ESTIMATORS.get(self.policy.estimator)
        if settings not in self.cache and estimator is not None and not estimator.probes_device:
            self._estimate(settings, device=None)
        return self.get(settings) if self.cache.get(settings) is not None else None

    def _whole(self, settings: Settings) -> MemoryProfile | None:
        if settings not in self.cache:
            self._estimate(settings, self.device)
        return self.cache[settings]

    def _estimate(self, settings: Settings, device) -> None:
        try:
            self.cache[settings] = estimate(
                self.workload, self.policy.estimator, settings, target=self.target,
                fragmentation=self.policy.fragmentation, device=device,
                allocator_conf=effective_allocator_conf(self.policy.allocator_conf),
            )
        except EstimationError as exc:
            self.cache[settings] = None
            self.errors[settings] = str(exc)

    def shareable(self) -> dict[Settings, MemoryProfile]:
        """The profiles a worker of the same target can use as they are: made by the configured
        estimator itself (a fallback made here without a device is not what the worker would make)."""
        return {s: p for s, p in self.cache.items() if p is not None and p.estimator == self.policy.estimator}
