"""Plan verification: a trial checks its plan on its device before the estimate can hurt.

No estimate made away from the device is exact for every kernel, so a trial that verifies
(``memory.verify``, the default) does not trust its plan blindly until the first OOM:

1. Its first optimizer steps run at the plan that fits with every phase's prediction raised by
   the estimator's own error bound (``estimator_registry``, ``Plan.error_bound``): an estimate
   that far too low still fits.
2. The device's peak over those steps (:attr:`MemoryReading.peak`: reserved bytes on a GPU,
   tensor bytes on the CPU and the emulated device) is compared with the phase's prediction,
   and the prediction is corrected by measured / predicted (``Plan.corrections``: one point per
   batch size measured; between them the correction is interpolated, so each new measurement
   refines the curve where the plan needs it, as a secant does).
3. The trial re-plans with the correction and, at that optimizer-step boundary, switches to the
   corrected plan the way an OOM recovery does (the newest checkpoint, a new trainer, the
   effective batch unchanged): larger where the estimate was pessimistic, smaller, before any
   OOM, where it was optimistic. The new plan is verified in turn, so the plan a trial settles
   on has had its own peak measured within ``budget x memory.safety_margin``: a micro-batch
   that measured more is never planned again, and when a phase's checks run out above the
   limit the trial goes back to the largest micro-batch measured within it.

A workload whose batches vary in size (it overrides ``largest_sample`` or ``largest_eval_sample``,
which the estimators plan for) is measured on batches that may be smaller than its largest: its measurements may raise a
prediction, never lower it, so its plan shrinks where the estimate was low but does not grow.

Each phase is verified when it first runs: the train phase over its first ``VERIFY_STEPS``
steps, the eval phase at its first evaluation, and each stage of an activation schedule
(``train@epoch3``) over the first steps of its stage; the trial pauses at an optimizer-step
boundary (``Trainer.pause_at``) where a measurement is due and no milestone falls. Every check is
a :class:`~orchestrator.contract.PlanCheck` in the trial's reports (MLflow, the console).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from orchestrator.contract import PlanCheck
from orchestrator.memory.phases import Phase
from orchestrator.planner import Plan
from trainables.loop import Milestone, Trainer

#: Optimizer steps measured before a train phase's prediction is corrected: the first creates the
#: optimizer's state, the second runs with it.
VERIFY_STEPS = 2
#: Checks of one phase, at most: each corrected plan is measured again, until one holds.
MAX_CHECKS = 4


class PlanVerification:
    """What a trial knows of its phases' real peaks, and when it measures the next one.

    ``replan(corrections, micro_cap)`` is the trial's planner with these corrections and at most
    that micro-batch (same budget, same settings, the plan's error bound for the phases not
    measured yet); ``overheads`` what each phase's prediction holds outside what the device's
    reading sees (a GPU's CUDA context and library workspaces; none elsewhere); ``limit`` what a
    plan may fill (budget x margin); ``grows``: False where the measured batches may be smaller
    than the largest the estimate is for.
    """

    def __init__(self, phases: list[Phase], replan: Callable[[dict, int | None], Plan], limit: int,
                 overheads: dict[str, int] | None = None, checks: list[PlanCheck] | None = None,
                 grows: bool = True):
        self.phases = phases
        self.replan = replan
        self.limit = limit
        self.overheads = overheads or {}
        self.grows = grows
        self.checks: list[PlanCheck] = checks if checks is not None else []  # the trial's own list
        self.checked_at: dict[str, tuple[int, int]] = {}  # phase -> the batch sizes it was measured at
        self.window_from = 0  # the optimizer step after which the device's peak was last reset
        self.within: dict[str, int] = {}  # train phase -> the largest micro-batch measured within the limit
        self.above: dict[str, int] = {}  # train phase -> the smallest micro-batch measured above it

    # -- which phase a step belongs to -----------------------------------------------------------
    def _stage(self, epoch: int) -> int:
        """The first epoch (from 0) of the stage that epoch ``epoch`` trains in."""
        return max((p.epoch for p in self.phases if p.epoch <= epoch), default=0)

    def _phase(self, kind: str, stage: int) -> str | None:
        return next((p.name for p in self.phases if p.kind == kind and p.epoch == stage), None)

    def settled(self, name: str, plan: Plan) -> bool:
        """Measured at the plan in force, or checked as often as it may be, or not predicted at all."""
        if not plan.predicted_phases.get(name):
            return True
        at = self.checked_at.get(name)
        sizes = (plan.micro_batch, plan.eval_batch if self._kind(name) == "eval" else 0)
        return at == sizes or sum(c.phase == name for c in self.checks) >= MAX_CHECKS

    # -- the trial's hooks ---------------------------------------------------------------------
    def begin(self, trainer: Trainer, plan: Plan) -> None:
        """A new trainer, whose peak was just reset: the next measurement window starts here."""
        self.window_from = trainer.progress.step
        trainer.pause_at = self._next_pause(trainer, plan)

    def check(self, trainer: Trainer, milestone: Milestone, plan: Plan) -> Plan:
        """The plan to go on with after this milestone or pause: ``plan`` where nothing was
        measured, else re-planned with what was (a switch where its batch sizes differ)."""
        measured = self._measurements(trainer, milestone, plan)
        self.window_from = milestone.progress.step
        if measured:
            plan = self._correct(plan, measured, milestone)
        trainer.pause_at = self._next_pause(trainer, plan)
        return plan

    # -- measuring -------------------------------------------------------------------------------
    def _measurements(self, trainer: Trainer, milestone: Milestone, plan: Plan) -> dict[str, int]:
        """Phase -> peak, for the unsettled phases this milestone measured cleanly."""
        found: dict[str, int] = {}
        steps = trainer.steps_per_epoch
        first, last = self.window_from, milestone.progress.step  # the window's steps: first+1 .. last
        if milestone.train_memory is not None and last > first:
            stage = self._stage(first // steps)
            stage_end = self._stage_end(stage, steps)
            # Enough steps to have made the optimizer's state, unless the stage ends first or
            # the window began after a step that made it (a milestone, a resumed checkpoint).
            whole = last - first >= VERIFY_STEPS or last == stage_end or first > 0
            name = self._phase("train", stage)
            if whole and self._stage((last - 1) // steps) == stage and name and not self.settled(name, plan):
                found[name] = milestone.train_memory.peak
        if milestone.eval_memory is not None:
            progress = milestone.progress
            epoch = progress.epoch - 1 if progress.step_in_epoch == 0 and progress.epoch > 0 else progress.epoch
            name = self._phase("eval", self._stage(epoch))
            if name and not self.settled(name, plan):
                found[name] = milestone.eval_memory.peak
        return found

    def _stage_end(self, stage: int, steps_per_epoch: int) -> int | None:
        """The optimizer step (in all) after which the stage beginning at epoch ``stage`` ends."""
        later = [p.epoch for p in self.phases if p.epoch > stage]
        return min(later) * steps_per_epoch if later else None

    def _next_pause(self, trainer: Trainer, plan: Plan) -> int | None:
        """Where to stop next: after ``VERIFY_STEPS`` steps of a phase to measure (within its
        stage), or at the start of a later stage to measure (a window of its own)."""
        steps, step = trainer.steps_per_epoch, trainer.progress.step
        stage = self._stage(trainer.progress.epoch)
        end = self._stage_end(stage, steps)
        name = self._phase("train", stage)
        if name and not self.settled(name, plan):
            return min(step + VERIFY_STEPS, end) if end is not None else step + VERIFY_STEPS
        while end is not None:  # the next stage whose train phase is still to measure
            later = self._stage(end // steps)
            name = self._phase("train", later)
            if name and not self.settled(name, plan):
                return end
            end = self._stage_end(later, steps)
        return None

    # -- correcting --------------------------------------------------------------------------
    def _correct(self, plan: Plan, measured: dict[str, int], milestone: Milestone) -> Plan:
        corrections, peaks = dict(plan.corrections), dict(plan.measured_phases)
        cap = None
        for name, peak in measured.items():
            peak += self.overheads.get(name, 0)  # the whole of what the prediction counts
            train = self._kind(name) == "train"
            batch = plan.micro_batch if train else plan.eval_batch
            points = {b: f for b, f in corrections.get(name, ())}
            factor = peak / plan.predicted_phases[name]
            points[batch] = factor if self.grows else max(factor, 1.0)
            corrections[name] = tuple(sorted(points.items()))
            peaks[name] = peak
            if train:
                cap = self._micro_cap(name, batch, peak, cap)
        corrected = self.replan(corrections, cap)
        if corrected.refusal:  # not even micro-batch 1 fits as corrected: the OOM reductions take over
            corrected = plan
        new = replace(corrected, corrections=corrections, measured_phases=peaks, reductions=plan.reductions)
        progress = milestone.progress
        for name, peak in measured.items():
            self.checked_at[name] = (plan.micro_batch, plan.eval_batch if self._kind(name) == "eval" else 0)
            self.checks.append(PlanCheck(
                phase=name, epoch=progress.epoch if progress.step_in_epoch == 0 else progress.epoch + 1,
                step=progress.step, predicted_bytes=plan.predicted_phases[name], measured_bytes=peak,
                limit_bytes=self.limit, plan=plan.describe(), new_plan=new.describe(),
            ))
        return new

    def _kind(self, name: str) -> str:
        return next(p.kind for p in self.phases if p.name == name)

    def _micro_cap(self, name: str, micro: int, peak: int, cap: int | None) -> int | None:
        """The largest micro-batch the next plan may take after ``name`` measured ``peak`` at
        ``micro``: below any that measured above the limit; at the last check above it, the
        largest measured within it (where there is one)."""
        if peak <= self.limit:
            self.within[name] = max(self.within.get(name, 0), micro)
        else:
            self.above[name] = min(self.above.get(name, micro), micro)
        bound = self.above[name] - 1 if name in self.above else None
        last = sum(c.phase == name for c in self.checks) + 1 >= MAX_CHECKS
        if last and peak > self.limit and name in self.within:
            bound = self.within[name]
        if bound is None:
            return cap
        return bound if cap is None else min(cap, bound)


def changes_batches(old: Plan, new: Plan) -> bool:
    """Whether the trial must switch trainers to follow ``new`` (the loop reads only these)."""
    return (old.micro_batch, old.accum_steps, old.eval_batch) != (new.micro_batch, new.accum_steps, new.eval_batch)
