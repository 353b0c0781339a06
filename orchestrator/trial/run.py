"""One trial in its Ray worker: planned for its memory, surviving its OOMs.

Read :meth:`TrialRun.run` top to bottom for the story of a trial: open the device, take the
plan (from the last checkpoint when resuming, else from the estimator), train, and report at
every milestone of the loop (an evaluation, a checkpoint, the end); when a step runs out of
memory, record the event, release the failed attempt, shrink the plan, go back to the last
checkpoint and carry on. The effective batch never changes, so neither does the
optimisation; only how it is cut into micro-batches does. A trial that verifies its plan
(``orchestrator.trial.verify``) switches plans the same way, at an optimizer-step boundary, once
its first steps have measured what the estimate predicted.
"""

from __future__ import annotations

import os
import time
from dataclasses import replace
from typing import Any

from orchestrator.config import SweepSpec
from orchestrator.contract import (
    GAVE_UP,
    OOM_SHRINKS_KEY,
    RESTART_REASON_KEY,
    STATE_FILE,
    TRIAL_LOG_FILE,
    HostMemoryEvent,
    Move,
    OomEvent,
    PlanCheck,
)
from orchestrator.device import Device, MemoryReading, configure_allocator, gpu_visible, nvml, open_device, release
from orchestrator.device.oom import bytes_requested, is_oom
from orchestrator.device.target import Target, resolve_target
from orchestrator.device_kinds import device_kind
from orchestrator.estimates import Estimates
from orchestrator.estimator_registry import ESTIMATORS
from orchestrator.memory.cache import ProfileCache
from orchestrator.memory.phases import TrainingLength, phases_of
from orchestrator.planner import Plan, make_plan, next_reduction, predicted
from orchestrator.ray_internals import trial_storage_folder
from orchestrator.trial.checkpoint import LocalCheckpoints, hand_over_due
from orchestrator.trial.errors import DataError, HostMemoryExhausted, OomRetriesExhausted
from orchestrator.trial.evidence import clear_oom_evidence, write_gave_up_events, write_oom_evidence
from orchestrator.trial.host_memory import fewer_workers, host_memory_failure
from orchestrator.trial.metrics import TrialMetrics
from orchestrator.trial.node import NodeInfo, current_node, left_its_node, restart_reason
from orchestrator.trial.reuse import HISTORY
from orchestrator.trial.storage import StorageUnavailable, report_with_retries, wait_to_be_stopped
from orchestrator.trial.verify import PlanVerification, changes_batches
from orchestrator.trial_report import TrialReport
from orchestrator.units import human
from trainables.data import SampleError
from trainables.divergence import Divergence, TrainingDiverged
from trainables.loop import LoopSettings, Milestone, Trainer
from trainables.workload import build_workload


class TrialRun:
    rank: int | None = None  # a rank of a data-parallel group sets its own

    def __init__(self, config: dict[str, Any], spec: SweepSpec, estimates: Estimates | None = None):
        """The trial Tune runs in this worker: its id, metrics and folder on the storage are Tune's."""
        from ray import tune

        context = tune.get_context()
        trial_id = context.get_trial_id()
        self._set_up(config, spec, estimates=estimates, context=context, scratch=trial_id,
                     metrics=TrialMetrics(spec.experiment, trial_id, config["workload"]),
                     evidence_folder=trial_storage_folder(), estimated_by="checkpoint")

    def _set_up(self, config: dict[str, Any], spec: SweepSpec, *, estimates: Estimates | None, context: Any,
                scratch: str, metrics: TrialMetrics | None, evidence_folder: str | None, estimated_by: str) -> None:
        """Everything a trial's story reads, set in this one place for a trial and for each other
        rank of a data-parallel group (``orchestrator.trial.group.RankRun``), so a rank never lacks
        what a trial has. What differs is passed in: a trial's comes from Tune; a rank has no Tune
        context, no metrics or evidence of its own (rank 0 keeps the group's) and its own scratch folder."""
        self.config = config
        self.spec = spec
        self.estimates = estimates
        self.context = context
        self.policy = spec.memory
        self.loop_settings = LoopSettings.of(spec)
        configure_allocator(self.policy.allocator_conf)  # before anything touches CUDA
        self.left_behind = HISTORY.left_behind()  # before this trial allocates anything
        self.workload = build_workload(config)
        self.checkpointable = type(self.workload).supports_activation_checkpointing
        self.metrics = metrics
        self.node = current_node()  # checkpoints record it; an emulated device reads its capacity
        self.moves: list[Move] = []  # every time this trial resumed on another node, oldest first (rank 0's)
        self.gpu_free_before_context = self._gpu_free_before_context()
        self.device = self._open_device()
        self.checkpoints = LocalCheckpoints(scratch)
        self.handed_over_at = time.monotonic()  # when Tune last got a checkpoint (or the attempt began)
        self.events: list[OomEvent] = []
        self.host_events: list[HostMemoryEvent] = []  # DataLoader workers lost (orchestrator.trial.host_memory)
        self.evidence_folder = evidence_folder  # where an OOM being recovered from is written down
        self.evidence_written = False
        self.applied_shrinks = 0  # Tune-level shrinks (OOM_SHRINKS_KEY) already in self.plan
        self.estimated_by = estimated_by  # where the plan's profile was made: driver | worker | none | checkpoint | rank 0
        self.plan_checks: list[PlanCheck] = []  # the plan verified on the device, phase by phase
        self.verification: PlanVerification | None = None  # while it has phases to verify
        self.profiles: ProfileCache | None = None  # made on first need
        self.unreported: MemoryReading | None = None  # the peak of pauses since the last report

    # -- the story ---------------------------------------------------------------------------
    def run(self) -> None:
        try:
            self.plan = self._starting_plan()
            if self.plan.refusal:
                self._report_refusal()
                return
            self.verification = self._verification()
            with self.device.measuring():  # the emulated device counts every byte from here on
                self.device.reset_peak()  # not the peak of the trial this worker ran before
                self._train()
        finally:
            self.checkpoints.remove()
            self._remember_cuda_context()
            HISTORY.last_device = self.device

    def _train(self) -> None:
        """Train to the end; after an OOM, release the attempt, shrink the plan, resume; after a
        verification that corrected the plan, the same from the step where it stopped."""
        while True:
            trainer = self._new_trainer()
            event = None
            try:
                if not self._train_until_switch(trainer):
                    return
            except SampleError as exc:
                raise self._data_error(trainer, exc) from None
            except TrainingDiverged as exc:
                self._report_divergence(exc.divergence)
                return
            except StorageUnavailable as exc:
                self._report_storage_fault(trainer, exc)
                return
            except Exception as exc:
                lost_worker = host_memory_failure(exc)
                if lost_worker is not None:
                    event = self._host_memory_event(trainer, lost_worker)
                elif not is_oom(exc):
                    raise
                else:
                    event = self._oom_event(trainer, exc)
                    write_oom_evidence(self.evidence_folder, event)  # should the recovery kill the worker
                    self.evidence_written = True
            # Out of the except block: the exception and the frames of the failed step are gone,
            # so dropping the trainer frees its weights and optimizer state before the next is built
            # (and its loaders' iterators before the next loaders fork their workers).
            del trainer
            release()
            if isinstance(event, HostMemoryEvent):
                self._fewer_loader_workers(event)  # from the last checkpoint, with the new trainer's loaders
                continue
            self.device.reset_peak()  # the next report's peak covers the recovery, not the failed step
            if event is not None:
                self.verification = None  # an OOM measured the plan: its reductions take over
                self._shrink(event)

    def _train_until_switch(self, trainer: Trainer) -> bool:
        """Train under the plan in force: False once trained to the end, True where a
        verification changed the plan's batch sizes (its step saved as the newest checkpoint)."""
        if self.verification is not None:
            self.verification.begin(trainer, self.plan)
        for milestone in trainer.run():
            before = self.plan
            if self.verification is not None and not milestone.final:  # nothing is left to switch for
                self.plan = self.verification.check(trainer, milestone, self.plan)
            if milestone.pause:
                self.unreported = milestone.memory if self.unreported is None else self.unreported.merged(milestone.memory)
            else:
                self._report(trainer, milestone)
            if changes_batches(before, self.plan):
                if not milestone.checkpoint:
                    self.checkpoints.save(self._state(trainer))
                return True
        return False

    def _starting_plan(self) -> Plan:
        """The plan in the last checkpoint when resuming (so reductions stick), else a new one."""
        from ray import tune

        checkpoint = tune.get_checkpoint()
        if checkpoint is None:
            plan = self._verified_start(self._plan_from_estimates(self._profiles()))
        else:
            with checkpoint.as_directory() as folder:
                self.checkpoints.adopt(os.path.join(folder, STATE_FILE))
            saved = self.checkpoints.load(map_location="cpu")
            plan = Plan.from_dict(saved["plan"])
            self.events = [OomEvent.from_dict(e) for e in saved["oom_events"]]
            self.applied_shrinks = saved["applied_shrinks"]
            self.plan_checks = [PlanCheck.from_dict(c) for c in saved.get("plan_checks", [])]
            self.moves = [Move.from_dict(m) for m in saved.get("moves", [])]
            for event in saved.get("host_memory_events", []):
                self._record_host_event(HostMemoryEvent.from_dict(event))
            if saved.get("node_id", self.node.node_id) != self.node.node_id:  # Ray restarted, or another node
                plan = self._resumed_elsewhere(plan, saved)
        # A worker that died of an OOM cannot shrink its own plan; the scheduler asked for it.
        requested = self.config.get(OOM_SHRINKS_KEY, 0)
        while self.applied_shrinks < requested:
            smaller = next_reduction(plan, self.policy, "train", workload_supports_checkpointing=self.checkpointable)
            if smaller is None:
                raise OomRetriesExhausted.from_events(self.events, "the worker died of OOM and no smaller plan is left")
            plan, self.applied_shrinks = self._predicted(smaller), self.applied_shrinks + 1
        return plan

    def _profiles(self) -> ProfileCache:
        """The trial's memory profiles: the driver's estimate where it made one for this device."""
        if self.profiles is None:
            target = self.device.target
            known = self.estimates.known(self.config, target) if self.estimates else None
            self.estimated_by = "none" if self.policy.estimator == "none" else "driver" if known else "worker"
            self.profiles = ProfileCache(self.workload, self.policy, target, self.device, known=known,
                                         length=TrainingLength.of(self.spec))
        return self.profiles

    # -- plan verification (orchestrator.trial.verify) -------------------------------------------
    def _verifies(self, plan: Plan) -> bool:
        """Whether this trial checks ``plan`` on its device: ``memory.verify`` and the workload's
        ``verify_plan``, and an estimate against a budget to check (not ``estimator: none``, not
        an unbounded CPU), of a plan no OOM reduced (the OOM measured it: verifying could grow it back)."""
        wanted = self.policy.verify and type(self.workload).verify_plan
        checkable = plan.refusal is None and plan.budget_bytes is not None and bool(plan.predicted_phases)
        return wanted and checkable and plan.reductions == 0

    def _verified_start(self, plan: Plan) -> Plan:
        """The plan of the first steps of a verifying trial: with the settings ``plan`` chose, the
        largest batches that fit with every prediction raised by the estimator's error bound
        (``plan`` itself where nothing does: the verification then shrinks it, if need be)."""
        # The estimator whose profile the plan used (a trace that fell back names the fallback).
        estimator = ESTIMATORS.get(plan.estimator) or ESTIMATORS.get(self.policy.estimator)
        if not self._verifies(plan) or estimator is None:
            return plan
        safe = make_plan(
            self.workload, self.policy, self.spec.effective_batch_size, plan.budget_bytes, target=self.device.target,
            device=self.device, profiles=self._profiles(), settings=plan.settings, error_bound=estimator.error_bound,
        )
        return plan if safe.refusal else safe

    def _verification(self) -> PlanVerification | None:
        """What verifies the plan on the device, where this trial does (``memory.verify``)."""
        if not self._verifies(self.plan):
            return None
        profile = self._profiles().get(self.plan.settings)
        overheads = {p.name: p.overhead for p in profile.phases} if profile is not None else {}
        limit = int(self.plan.budget_bytes * self.policy.safety_margin)
        fixed_size = not type(self.workload).varies_in_size()  # else a step's batch may be a small one
        reached = phases_of(self.workload, self._profiles().epochs)
        return PlanVerification(reached, self._corrected_plan, limit, overheads, self.plan_checks, grows=fixed_size)

    def _corrected_plan(self, corrections: dict, micro_cap: int | None) -> Plan:
        """The plan in force's settings and budget, planned with the verification's corrections.

        Planned mid-training, as host work (``Device.host``): the planner builds the workload's
        eval set to count it, which an emulated device would otherwise count as its own memory
        (a dataset's bytes in the pause's step, where the trial then ran out of memory).
        """
        with self.device.host():
            return make_plan(
                self.workload, self.policy, self.spec.effective_batch_size, self.plan.budget_bytes,
                target=self.device.target, device=self.device, profiles=self._profiles(), settings=self.plan.settings,
                corrections=corrections, error_bound=self.plan.error_bound, micro_cap=micro_cap,
            )

    def _plan_from_estimates(self, profiles: ProfileCache) -> Plan:
        return make_plan(
            self.workload, self.policy, self.spec.effective_batch_size, self._budget(),
            target=self.device.target, device=self.device, profiles=profiles,
        )

    def _resumed_elsewhere(self, plan: Plan, saved: dict) -> Plan:
        """The checkpoint was made by another Ray node: re-plan when this node's budget is smaller
        than the one the plan was made for (the effective batch stays), and record a move when the
        trial left its node (``left_its_node``: a restarted node keeps its name, not its id)."""
        budget = self._budget()
        replanned = ""
        if plan.budget_bytes is not None and budget is not None and budget < plan.budget_bytes:
            smaller = self._plan_from_estimates(self._profiles())
            if smaller.refusal:
                raise OomRetriesExhausted.from_events(
                    self.events, f"resumed on node {self.node.name}, where nothing fits: {smaller.refusal}")
            replanned = f"{plan.describe()} -> {smaller.describe()} (budget {human(plan.budget_bytes)} -> {human(budget)})"
            plan = smaller  # shrinks the scheduler asked for still apply on top (OOM_SHRINKS_KEY)
        if not (replanned or left_its_node(saved, self.node)):
            return plan
        self.moves.append(Move(
            from_node=saved.get("node_name", "?"), to_node=self.node.name, epoch=saved["trainer"]["progress"]["epoch"],
            reason=restart_reason(self.config.get(RESTART_REASON_KEY), saved["node_id"], saved.get("node_name", "?")),
            replanned=replanned,
        ))
        return plan

    def _new_trainer(self) -> Trainer:
        seed = self.config.get("seed", self.spec.seed)
        trainer = Trainer(self.workload, self.device, self.plan, self.loop_settings, seed=seed)
        if self.checkpoints.newest is not None:
            trainer.load_state_dict(self.checkpoints.load(map_location=self.device.torch_device)["trainer"])
        return trainer

    def _oom_event(self, trainer: Trainer, exc: BaseException) -> OomEvent:
        """Where it happened, counted from 1 as the tables count: the progress holds the steps and
        epochs finished, so a train step that runs out is the next one, an evaluation follows the
        last finished step and, at an epoch's end, belongs to the epoch just finished."""
        progress, evaluating = trainer.progress, trainer.phase == "eval"
        in_finished_epoch = evaluating and progress.step_in_epoch == 0 and progress.epoch > 0
        return OomEvent(
            phase=trainer.phase, epoch=progress.epoch if in_finished_epoch else progress.epoch + 1,
            step=progress.step if evaluating else progress.step + 1,
            eval_batch_number=trainer.position + 1 if evaluating else None,
            micro_batch=self.plan.micro_batch, eval_batch=self.plan.eval_batch,
            bytes_requested=bytes_requested(str(exc)),
            bytes_allocated=self.device.allocated(), bytes_reserved=self.device.reserved(),
            message=str(exc).splitlines()[0][:500], predicted_peak_bytes=self.plan.predicted_peak_bytes,
        )

    def _host_memory_event(self, trainer: Trainer, line: str) -> HostMemoryEvent:
        progress = trainer.progress
        return HostMemoryEvent(phase=trainer.phase, epoch=progress.epoch + 1,
                               step=progress.step + (trainer.phase == "train"),
                               num_workers=self.loop_settings.data.num_workers, message=line[:500])

    def _fewer_loader_workers(self, event: HostMemoryEvent) -> None:
        """A DataLoader worker was lost to host memory: back to the last checkpoint with half the
        workers, or give up in one line when the trial already loads in its own process."""
        data = self.loop_settings.data
        smaller = fewer_workers(data)
        event = replace(event, action=GAVE_UP if smaller is None else
                        f"data.num_workers {data.num_workers}->{smaller.num_workers}")
        if smaller is None:
            self.host_events.append(event)
            raise HostMemoryExhausted(f"{event.describe()}: the trial's own process ran out of host memory loading its data")
        self._record_host_event(event)

    def _record_host_event(self, event: HostMemoryEvent) -> None:
        """Keep the event and the fewer workers it left (replayed from a checkpoint's events)."""
        self.host_events.append(event)
        smaller = fewer_workers(self.loop_settings.data)
        if event.action != GAVE_UP and smaller is not None:
            self.loop_settings = replace(self.loop_settings, data=smaller)

    def _shrink(self, event: OomEvent) -> None:
        """Move the plan to its next reduction, or give up with every event in the error."""
        smaller = next_reduction(self.plan, self.policy, event.phase, workload_supports_checkpointing=self.checkpointable)
        if smaller is None or len(self.events) >= self.policy.max_oom_retries:
            reason = "no smaller plan is left" if smaller is None else f"memory.max_oom_retries={self.policy.max_oom_retries} reached"
            self.events.append(OomEvent(**{**event.to_dict(), "action": GAVE_UP}))
            write_gave_up_events(self.evidence_folder, self.events)  # no report carries them: MLflow gets them from there
            raise OomRetriesExhausted.from_events(self.events, f"out of memory in {event.phase} and {reason}")
        self.events.append(OomEvent(**{**event.to_dict(), "action": _describe_change(self.plan, smaller)}))
        self.plan = self._predicted(smaller)

    def _predicted(self, reduced: Plan) -> Plan:
        """An OOM's reduction with its predictions at its smaller batches, where the profile of
        its settings was made already or can be without the device (``ProfileCache.made``: none
        is estimated on the device after an OOM; the plan then says no estimate). Host work
        (``Device.host``): an estimate's model and fake tensors are not the device's memory."""
        if reduced.estimator == "none":
            return reduced
        with self.device.host():
            profile = self._profiles().made(reduced.settings)
        return predicted(reduced, profile) if profile is not None else reduced

    def _report(self, trainer: Trainer, milestone: Milestone) -> None:
        """Report the milestone to Tune, with a checkpoint when one is due.

        Every checkpoint of the loop is saved here, for an in-process OOM retry to resume from;
        Tune gets it when :func:`~orchestrator.trial.checkpoint.hand_over_due` says so, and
        copies it to the sweep's storage before ``report`` returns.
        """
        from ray import tune

        report = self._milestone_report(milestone)
        self.metrics.record_result(report)
        if self.evidence_written:  # recovered: a later death is not this OOM's
            clear_oom_evidence(self.evidence_folder)
            self.evidence_written = False
        if milestone.checkpoint:
            folder = self.checkpoints.save(self._state(trainer))
        if not milestone.checkpoint or not hand_over_due(self.spec.checkpoint.every is not None, milestone.final,
                                                         time.monotonic() - self.handed_over_at):
            tune.report(report.to_metrics())
            return
        report_with_retries(lambda: tune.report(report.to_metrics(), checkpoint=tune.Checkpoint.from_directory(folder)),
                            where=self.evidence_folder)  # the trial's folder on the storage
        self.handed_over_at = time.monotonic()

    def _state(self, trainer: Trainer) -> dict:
        """Everything needed to continue exactly here."""
        return {
            "trainer": trainer.state_dict(), "plan": self.plan.to_dict(),
            "oom_events": [e.to_dict() for e in self.events], "applied_shrinks": self.applied_shrinks,
            "plan_checks": [c.to_dict() for c in self.plan_checks],
            "node_id": self.node.node_id, "node_name": self.node.name, "moves": [m.to_dict() for m in self.moves],
            "host_memory_events": [e.to_dict() for e in self.host_events],
        }

    def _data_error(self, trainer: Trainer, exc: SampleError) -> DataError:
        """A sample that cannot be loaded ends the trial, once: the full traceback goes to the
        trial's log file, a report tells the driver not to retry (``TrialReport.data_error``), and the
        error is one line that names the sample, where the trial was, and that file."""
        import traceback

        from ray import tune

        progress = trainer.progress
        where = (f"epoch {progress.epoch + 1}, step {progress.step + 1}" if trainer.phase == "train"
                 else f"evaluating after step {progress.step}")
        line = f"{exc} ({where})"
        log = None
        if self.evidence_folder is not None:
            try:
                os.makedirs(self.evidence_folder, exist_ok=True)
                log = os.path.join(self.evidence_folder, TRIAL_LOG_FILE)
                with open(log, "a") as f:
                    f.write(line + "\n" + "".join(traceback.format_exception(exc)) + "\n")
            except OSError:
                log = None
        line += "; not retried (a data error)" + (f"; traceback in {log}" if log else "")
        tune.report(replace(self._plan_report(), epoch=progress.epoch, step=progress.step, data_error=line).to_metrics())
        return DataError(line)

    def _report_divergence(self, divergence: Divergence) -> None:
        """A diverged trial ends at its bad step, without a retry: its last report says where, in one
        line, and gives the searcher and the scheduler the worst value of the sweep's metric."""
        from ray import tune

        worst = float("inf") if self.spec.mode == "min" else float("-inf")
        line = f"{divergence.describe()}; not retried (on_nan: {self.spec.on_nan})"
        report = replace(self._plan_report(), epoch=divergence.epoch - 1, step=divergence.step, training_done=True,
                         measurements={self.spec.metric: worst}, diverged=line, diverged_at_step=divergence.step)
        tune.report(self._measured(report, self.device.reading()).to_metrics())  # the steps since the last report

    def _report_storage_fault(self, trainer: Trainer, fault: StorageUnavailable) -> None:
        """The storage did not take the checkpoint: say so, without one, and wait for the driver
        to stop the sweep (``orchestrator.trial.storage``); this trial resumes from its last."""
        from ray import tune

        progress = trainer.progress
        tune.report(replace(self._plan_report(), epoch=progress.epoch, step=progress.step,
                            storage_fault=str(fault)).to_metrics())
        wait_to_be_stopped(fault)

    def _report_refusal(self) -> None:
        """A refused trial reports once, with its reason, and ends without training."""
        from ray import tune

        nan = float("nan")
        report = replace(self._plan_report(), epoch=0, step=0, refusal=self.plan.refusal, train_loss=nan,
                         measurements={self.spec.metric: nan})
        tune.report(report.to_metrics())

    # -- what a report holds -----------------------------------------------------------------
    def _plan_report(self) -> TrialReport:
        plan = self.plan
        gpu = self.device.card()
        return TrialReport(
            plan=plan.to_dict(),
            micro_batch=plan.micro_batch, accum_steps=plan.accum_steps,
            effective_batch=plan.effective_batch, eval_batch=plan.eval_batch,
            activation_checkpointing=plan.activation_checkpointing, precision=plan.precision,
            plan_reductions=plan.reductions, estimator=plan.estimator, estimated_by=self.estimated_by,
            budget_bytes=plan.budget_bytes, predicted_peak_bytes=plan.predicted_peak_bytes,
            predicted_phase=plan.predicted_phase if plan.predicted_peak_bytes is not None else None,
            # Events recovered in this process, plus workers that died of memory (restarted by Tune).
            oom_retries=len(self.events) + self.applied_shrinks, oom_events=tuple(self.events),
            host_memory_events=tuple(self.host_events),
            node_id=self.node.node_id, node_name=self.node.name, moves=tuple(self.moves),
            plan_checks=tuple(self.plan_checks), gpu_name=gpu.name if gpu else None, gpu_total_bytes=gpu.total if gpu else None,
            left_behind_bytes=self.left_behind,
        )

    def _milestone_report(self, milestone: Milestone) -> TrialReport:
        progress = milestone.progress
        report = replace(
            self._plan_report(), measurements=dict(milestone.eval),
            epoch=progress.epoch, step=progress.step, training_done=milestone.final,
            train_loss=milestone.train_loss, learning_rate=milestone.learning_rate,
            steps_per_second=milestone.speed.steps_per_second if milestone.speed else None,
            samples_per_second=milestone.speed.samples_per_second if milestone.speed else None,
        )
        return self._measured(report, milestone.memory)

    def _measured(self, report: TrialReport, memory: MemoryReading) -> TrialReport:
        """``report`` with the peak of its window, ``memory``, and the error of the plan's prediction."""
        if self.unreported is not None:  # the pauses since the last report are part of its window
            memory, self.unreported = self.unreported.merged(memory), None
        report = replace(
            report, memory_source=memory.source,
            peak_allocated_bytes=memory.peak_allocated, peak_reserved_bytes=memory.peak_reserved,
            fragmentation=memory.fragmentation if memory.peak_reserved is not None else None,
            device_used_bytes=memory.device_used,
        )
        predicted = self.plan.predicted_peak_bytes
        if predicted:
            report = replace(report, prediction_error=(report.measured_peak - predicted) / predicted)
        return report

    # -- device and budget -------------------------------------------------------------------
    def _gpu_share(self) -> float | None:
        """The fraction of one GPU Ray gave this trial, when it is a fraction."""
        gpus = self.context.get_trial_resources().required_resources.get("GPU", 0)
        return gpus if 0 < gpus < 1 else None

    def _open_device(self) -> Device:
        return open_trial_device(self.spec, self.node, rank=self.rank, gpu_share=self._gpu_share())

    def _gpu_free_before_context(self) -> int | None:
        """NVML's free memory before this process creates its CUDA context (None without a GPU):
        plans count the context themselves, so the budget must not have it taken out already. A
        reused worker gives the previous trial's cached blocks back first (collecting garbage
        only where that trial left tensors allocated: ``left_behind``, read before this)."""
        if not gpu_visible():
            return None
        release(collect=bool(self.left_behind))
        return HISTORY.gpu_free_before_context(self._gpu_free())

    def _gpu_free(self) -> int | None:
        info = nvml.gpu_info(0)
        return info.free if info else None

    def _remember_cuda_context(self) -> None:
        """What this process holds on the GPU outside PyTorch's allocator, for the budget of
        the next trial it runs (``orchestrator.trial.reuse``)."""
        if self.device.card() is None or HISTORY.cuda_context_bytes is not None:
            return
        free = self._gpu_free()
        if free is not None and self.gpu_free_before_context is not None:
            held = self.gpu_free_before_context - free - self.device.reserved()
            HISTORY.cuda_context_bytes = max(held, 0)

    def _budget(self) -> int | None:
        """Bytes the plan may fill (before the safety margin): the config's, within the device's."""
        target = trial_target(self.spec, self.device, rank=self.rank, free_before_context=self.gpu_free_before_context)
        return target.budget


def open_trial_device(spec: SweepSpec, node: NodeInfo, *, rank: int | None = None,
                      gpu_share: float | None = None) -> Device:
    """The device a trial (its rank ``rank`` in a group) trains on, of the kind
    ``resolve_target`` picks in a process that may or may not see a GPU. An emulated device is
    as large as its node declares (a label), else as ``memory.capacity`` says; a GPU shared by
    fractions is capped to the trial's share (``gpu_share``)."""
    target = resolve_target(spec, rank=rank, gpu_here=gpu_visible())
    capacity = node.capacity(target.capacity) if device_kind(target.device).sized_by_config else None
    return open_device(target.device, capacity=capacity, memory_fraction=gpu_share)


def trial_target(spec: SweepSpec, device: Device, *, rank: int | None = None,
                 free_before_context: int | None = None) -> Target:
    """The target of a trial whose device is open: on a GPU, its capacity is the memory free
    before this trial started (or its share of the card, when it shares one); the plan's
    profile counts the CUDA context inside that."""
    return resolve_target(spec, rank=rank, measured=device.available(free_before_context), gpu_here=gpu_visible())


def _describe_change(old: Plan, new: Plan) -> str:
    changes = []
    if new.micro_batch != old.micro_batch:
        changes.append(f"micro-batch {old.micro_batch}->{new.micro_batch} (accumulation {old.accum_steps}->{new.accum_steps})")
    if new.eval_batch != old.eval_batch:
        changes.append(f"eval batch {old.eval_batch}->{new.eval_batch}")
    if new.activation_checkpointing != old.activation_checkpointing:
        changes.append("activation checkpointing on")
    if new.precision != old.precision:
        changes.append(f"precision {old.precision}->{new.precision}")
    return ", ".join(changes) or "retry"

