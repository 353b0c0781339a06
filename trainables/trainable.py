"""The Ray Tune trainable: one trial, planned for its memory, surviving its OOMs.

Read :meth:`TrialRun.run` top to bottom for the story of a trial: open the device, take the
plan (from the last checkpoint when resuming, else from the estimator), train epoch by epoch,
checkpoint and report after each, and when a step runs out of memory record the event, shrink
the plan, go back to the last checkpoint and carry on. The effective batch never changes, so
neither does the optimisation; only how it is cut into micro-batches does.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any

import torch

from orchestrator import nvml
from orchestrator.config import SweepSpec
from orchestrator.device import CudaDevice, Device, configure_allocator, open_device
from orchestrator.failures import NotRetriedError
from orchestrator.oom import OomEvent, OomRetriesExhausted, bytes_requested, is_oom, release_memory
from orchestrator.planner import Plan, make_plan, next_reduction
from trainables.loop import EpochResult, Trainer
from trainables.workload import build_workload

#: Config key the OOM-aware scheduler sets when Tune restarts a trial after its worker died of
#: an OOM: the number of reductions the restarted trial must apply on top of its checkpoint's plan.
OOM_SHRINKS_KEY = "_oom_shrinks"
#: Set by the scheduler after this trial gave up on OOMs, so that the restart Tune insists on
#: fails at once instead of training into the same OOM again.
OOM_GAVE_UP_KEY = "_oom_gave_up"
#: How often the trial failed for a reason other than memory (counted by the scheduler).
OTHER_FAILURES_KEY = "_other_failures"
#: Set by the scheduler, with the error's line, when such failures exceed the sweep's
#: ``max_failures``: the restart fails at once instead of running into the same bug again.
NOT_RETRIED_KEY = "_not_retried"
STATE_FILE = "state.pt"


def train_trial(config: dict[str, Any], spec: SweepSpec) -> None:
    """Tune entry point (wrapped with ``tune.with_parameters(train_trial, spec=spec)``)."""
    if config.get(OOM_GAVE_UP_KEY):
        raise OomRetriesExhausted(config[OOM_GAVE_UP_KEY])
    if config.get(NOT_RETRIED_KEY):
        raise NotRetriedError(
            f"{config[NOT_RETRIED_KEY]} (failed {config.get(OTHER_FAILURES_KEY, 1)} time(s); errors other "
            f"than out-of-memory are retried at most max_failures={spec.max_failures} time(s))"
        )
    TrialRun(config, spec).run()


class TrialRun:
    def __init__(self, config: dict[str, Any], spec: SweepSpec):
        from ray import tune

        from orchestrator.metrics import TrialMetrics

        self.config = config
        self.spec = spec
        self.policy = spec.memory
        configure_allocator(self.policy.allocator_conf)  # before anything touches CUDA
        self.workload = build_workload(config)
        self.checkpointable = type(self.workload).supports_activation_checkpointing
        self.context = tune.get_context()
        self.metrics = TrialMetrics(spec.experiment, self.context.get_trial_id(), config["workload"])
        # NVML's free memory before this process creates its CUDA context: plans count the
        # context themselves, so the budget must not have it taken out already.
        self.gpu_free_before_context = self._gpu_free() if torch.cuda.is_available() else None
        self.device = self._open_device()
        self.scratch = tempfile.mkdtemp(prefix="trial-state-")
        self.last_state: str | None = None  # path of the newest checkpointed state
        self.events: list[OomEvent] = []
        self.applied_shrinks = 0  # Tune-level shrinks (OOM_SHRINKS_KEY) already in self.plan

    # -- the story ---------------------------------------------------------------------------
    def run(self) -> None:
        self.plan = self._starting_plan()
        if self.plan.refusal:
            self._report_refusal()
            return
        trainer = self._new_trainer()
        while trainer.epoch < self.spec.epochs:
            try:
                result = trainer.run_epoch()
            except Exception as exc:
                if not is_oom(exc):
                    raise
                trainer = self._recover_from_oom(trainer, exc)
                continue
            self._checkpoint_and_report(trainer, result)
        shutil.rmtree(self.scratch, ignore_errors=True)

    def _starting_plan(self) -> Plan:
        """The plan in the last checkpoint when resuming (so reductions stick), else a new one."""
        from ray import tune

        checkpoint = tune.get_checkpoint()
        if checkpoint is None:
            plan = make_plan(
                self.workload, self.policy, self.spec.effective_batch_size, self._budget(),
                target=self.device.target, device=self.device,
            )
        else:
            with checkpoint.as_directory() as folder:
                shutil.copy(os.path.join(folder, STATE_FILE), os.path.join(self.scratch, STATE_FILE))
            self.last_state = os.path.join(self.scratch, STATE_FILE)
            saved = torch.load(self.last_state, map_location="cpu", weights_only=False)
            plan = Plan.from_dict(saved["plan"])
            self.events = [OomEvent.from_dict(e) for e in saved["oom_events"]]
            self.applied_shrinks = saved["applied_shrinks"]
        # A worker that died of an OOM cannot shrink its own plan; the scheduler asked for it.
        requested = self.config.get(OOM_SHRINKS_KEY, 0)
        while self.applied_shrinks < requested:
            smaller = next_reduction(plan, self.policy, "train", workload_supports_checkpointing=self.checkpointable)
            if smaller is None:
                raise OomRetriesExhausted.from_events(self.events, "the worker died of OOM and no smaller plan is left")
            plan, self.applied_shrinks = smaller, self.applied_shrinks + 1
        return plan

    def _new_trainer(self) -> Trainer:
        trainer = Trainer(self.workload, self.device, self.plan, seed=self.config.get("seed", self.spec.seed))
        if self.last_state is not None:
            trainer.load_state_dict(torch.load(self.last_state, map_location=self.device.torch_device, weights_only=False)["trainer"])
        return trainer

    def _recover_from_oom(self, trainer: Trainer, exc: BaseException) -> Trainer:
        """Record the OOM, free the failed step, shrink the plan, resume from the last checkpoint."""
        event = OomEvent(
            phase=trainer.phase, epoch=trainer.epoch, step=trainer.step,
            micro_batch=self.plan.micro_batch, eval_batch=self.plan.eval_batch,
            bytes_requested=bytes_requested(str(exc)),
            bytes_allocated=self.device.allocated(), bytes_reserved=self.device.reserved(),
            message=str(exc).splitlines()[0][:500],
        )
        del trainer
        exc.__traceback__ = None  # the traceback pins the failed step's tensors
        release_memory()
        self.metrics.record_oom(event.phase)
        smaller = next_reduction(self.plan, self.policy, event.phase, workload_supports_checkpointing=self.checkpointable)
        if smaller is None or len(self.events) >= self.policy.max_oom_retries:
            reason = "no smaller plan is left" if smaller is None else f"memory.max_oom_retries={self.policy.max_oom_retries} reached"
            self.events.append(OomEvent(**{**event.to_dict(), "action": "gave up"}))
            raise OomRetriesExhausted.from_events(self.events, f"out of memory in {event.phase} and {reason}")
        self.events.append(OomEvent(**{**event.to_dict(), "action": _describe_change(self.plan, smaller)}))
        self.plan = smaller
        return self._new_trainer()

    def _checkpoint_and_report(self, trainer: Trainer, result: EpochResult) -> None:
        from ray import tune

        self.last_state = os.path.join(self.scratch, STATE_FILE)
        torch.save(
            {
                "trainer": trainer.state_dict(), "plan": self.plan.to_dict(),
                "oom_events": [e.to_dict() for e in self.events], "applied_shrinks": self.applied_shrinks,
            },
            self.last_state,
        )
        folder = tempfile.mkdtemp(prefix="checkpoint-")
        shutil.copy(self.last_state, folder)
        metrics = self._epoch_metrics(result)
        self.metrics.record_epoch(metrics)
        tune.report(metrics, checkpoint=tune.Checkpoint.from_directory(folder))

    def _report_refusal(self) -> None:
        """A refused trial reports once, with its reason, and ends without training."""
        from ray import tune

        nan = float("nan")
        tune.report({**self._plan_metrics(), "epoch": 0, "refused": 1, "refusal": self.plan.refusal,
                     "train_loss": nan, "eval_loss": nan, self.spec.metric: nan})

    # -- what a report holds -----------------------------------------------------------------
    def _plan_metrics(self) -> dict[str, Any]:
        plan = self.plan
        metrics: dict[str, Any] = {
            "plan": plan.to_dict(),
            "micro_batch": plan.micro_batch, "accum_steps": plan.accum_steps,
            "effective_batch": plan.effective_batch, "eval_batch": plan.eval_batch,
            "activation_checkpointing": int(plan.activation_checkpointing), "precision": plan.precision,
            "plan_reductions": plan.reductions, "estimator": plan.estimator,
            "oom_retries": len(self.events), "oom_events": [e.to_dict() for e in self.events],
        }
        if plan.budget_bytes is not None:
            metrics["budget_bytes"] = plan.budget_bytes
        if plan.predicted_peak_bytes is not None:
            metrics["predicted_peak_bytes"] = plan.predicted_peak_bytes
            metrics["predicted_phase"] = plan.predicted_phase
        if isinstance(self.device, CudaDevice):
            info = nvml.gpu_info(self.device.torch_device.index or 0)
            if info:
                metrics["gpu_name"], metrics["gpu_total_bytes"] = info.name, info.total
        return metrics

    def _epoch_metrics(self, result: EpochResult) -> dict[str, Any]:
        memory = result.memory
        metrics = {
            **self._plan_metrics(),
            "epoch": result.epoch, "train_loss": result.train_loss, "eval_loss": result.eval_loss,
            "memory_source": memory.source, "peak_allocated_bytes": memory.peak_allocated,
        }
        if memory.peak_reserved is not None:
            metrics["peak_reserved_bytes"] = memory.peak_reserved
            metrics["fragmentation"] = memory.fragmentation
        if memory.device_used is not None:
            metrics["device_used_bytes"] = memory.device_used
        predicted = self.plan.predicted_peak_bytes
        if predicted:
            # The plan budgets reserved bytes on a GPU; on the CPU only tensor bytes exist.
            measured = memory.peak_reserved if memory.peak_reserved is not None else memory.peak_allocated
            metrics["prediction_error"] = (measured - predicted) / predicted
        return metrics

    # -- device and budget -------------------------------------------------------------------
    def _gpu_share(self) -> float | None:
        """The fraction of one GPU Ray gave this trial, when it is a fraction."""
        gpus = self.context.get_trial_resources().required_resources.get("GPU", 0)
        return gpus if 0 < gpus < 1 else None

    def _open_device(self) -> Device:
        kind = self.policy.device
        if kind == "auto":
            kind = "cuda" if torch.cuda.is_available() else "cpu"
        # A shared GPU's allocator is capped to the trial's share: its growth can't OOM a neighbour.
        return open_device(kind, capacity=self.policy.capacity, memory_fraction=self._gpu_share() if kind == "cuda" else None)

    def _gpu_free(self) -> int | None:
        info = nvml.gpu_info(0)
        return info.free if info else None

    def _budget(self) -> int | None:
        """Bytes the plan may fill (before the safety margin): the config's, else the device's.

        On a GPU that is the memory free before this trial started (or its share of the card,
        when it shares one); the plan's profile counts the CUDA context inside that.
        """
        capacity = self.device.capacity()
        if isinstance(self.device, CudaDevice):
            if self._gpu_share() is None and self.gpu_free_before_context is not None:
                available = min(self.gpu_free_before_context, capacity)
            else:
                available = capacity  # the card, or this trial's capped share of it
            return min(self.policy.budget, available) if self.policy.budget else available
        if capacity is None:
            return self.policy.budget  # the CPU: unbounded unless the config says otherwise
        return min(self.policy.budget, capacity) if self.policy.budget else capacity


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

