"""A data-parallel trial (``resources.workers: N``): N ranks, one trial, one story.

Rank 0 is the trial itself, the Tune actor running :class:`GroupTrialRun`; it starts ranks
1..N-1 as :class:`RankActor` s in the other bundles of the trial's placement group (one bundle
per rank, ``runner._trainable``), so they land on this node or on others, as Ray places them,
inside a SLURM allocation too. Every rank runs the same story as a single-process trial
(``orchestrator.trial.run.TrialRun``: plan, train, on OOM release / shrink / resume from the last
checkpoint) with a :class:`~trainables.distributed.DistributedTrainer`, whose agreements make the
OOM of any one rank an OOM of the whole group at the same step, so the recovery runs in step.

* Planning: every rank sends its budget (its own device's); rank 0 plans the group
  (``planner.plan_for_ranks``) and sends the plan; a restarted trial's plan comes from its
  checkpoint, which rank 0 sends to the other ranks through Ray's object store.
* Checkpoints: ranks hold identical state after every step; each keeps its own newest copy
  for an in-process recovery, and rank 0 reports it to Tune.
* A rank's process dies: the others' next collective fails (a closed connection, at once), rank
  0 finds which actor died and fails the trial with ``ActorDiedError`` in its error, and Tune
  restarts it from the last checkpoint with the plan stored there (and one reduction more when
  the group was recovering from an OOM: the evidence rank 0 wrote). The restarted rank 0 starts
  new rank actors; the old ones die with the old trial actor that owned them.

Why not Ray Train's ``TorchTrainer`` inside the Tune trial: it owns the worker group's failure
handling and restarts (its own ``FailureConfig``), checkpoints through ``ray.train.report`` and
a second storage layer, and a trial would become a driver of a nested run; our recovery
(agreement, shrink, in-process resume) and our Tune-level retries (``orchestrator.retry``) would
have to be rebuilt on top of its. A placement group and ``torch.distributed`` are all this needs.
"""

from __future__ import annotations

import os
import socket
from dataclasses import replace
from typing import Any

import ray

from orchestrator.config import SweepSpec
from orchestrator.contract import STATE_FILE, HostMemoryEvent, OomEvent
from orchestrator.device import Device, gpu_visible
from orchestrator.device.oom import is_oom
from orchestrator.device.target import resolve_target
from orchestrator.device.torch_internals import loader_worker_deaths_found_at_fetch
from orchestrator.device_kinds import device_kind
from orchestrator.estimates import Estimates
from orchestrator.memory.cache import ProfileCache
from orchestrator.planner import Plan, plan_for_ranks
from orchestrator.trial.errors import HostMemoryExhausted, OomRetriesExhausted
from orchestrator.trial.host_memory import host_memory_failure
from orchestrator.trial.node import NodeInfo
from orchestrator.trial.run import TrialRun
from orchestrator.trial.worker_exit import exit_requests_survive_finalisers
from orchestrator.trial_report import RankPeak, TrialReport
from trainables.distributed import DistributedTrainer, GroupFailure, GroupOutOfMemory, RankGroup, failed_rank
from trainables.divergence import Divergence
from trainables.loop import Milestone, Trainer

#: How long rank 0 waits, after its group failed, for Ray to say which rank's actor died.
DEATH_NOTICE_S = 10.0


class RankDiedError(RuntimeError):
    """A rank's process died; the message carries Ray's ``ActorDiedError`` text for the retry scheduler."""


class _GroupRank:
    """What every rank of a group does differently from a single-process trial."""

    rank: int
    ranks: int
    group: RankGroup
    policy: Any
    device: Device
    node: NodeInfo

    def _gpu_share(self) -> float | None:
        return None  # a rank has a whole GPU (the config refuses fractions in a group)

    def _new_trainer(self) -> Trainer:
        """Built on every rank, then agreed on: a rank whose model fails to build (or to fit) fails
        the group's attempt on every rank, as it fails a single process's, instead of leaving the
        others in their first step's collective."""
        seed = self.config.get("seed", self.spec.seed)
        trainer = failure = None
        try:
            trainer = DistributedTrainer(self.workload, self.device, self.plan, self.loop_settings, seed, self.group)
            if self.checkpoints.newest is not None:
                trainer.load_state_dict(self.checkpoints.load(map_location=self.device.torch_device)["trainer"])
        except Exception as exc:  # noqa: BLE001 - agreed on, then raised on every rank
            failure = exc
        self.group.agree(failure, "setup", 0)
        return trainer

    def _verifies(self, plan: Plan) -> bool:
        """Not yet in a group: its ranks would have to agree on each pause and switch, as they
        agree on an OOM; a group trusts its plan until an OOM (``memory.verify`` aside)."""
        return False

    def _oom_event(self, trainer: Trainer, exc: BaseException) -> OomEvent:
        event = replace(super()._oom_event(trainer, exc), rank=failed_rank(exc))
        if not isinstance(exc, GroupOutOfMemory):
            return event
        # What the rank that failed held, not this one.
        return replace(event, bytes_allocated=exc.bytes_allocated, bytes_reserved=exc.bytes_reserved)



class GroupTrialRun(_GroupRank, TrialRun):
    """Rank 0: the trial Tune sees. It starts the other ranks, plans the group and reports."""

    def __init__(self, config: dict[str, Any], spec: SweepSpec, estimates: Estimates | None = None):
        self.rank, self.ranks = 0, spec.resources.workers
        super().__init__(config, spec, estimates)

    def run(self) -> None:
        from ray import tune

        address = f"tcp://{ray.util.get_node_ip_address()}:{_free_port()}"
        checkpoint = tune.get_checkpoint()
        state = None
        if checkpoint is not None:
            with checkpoint.as_directory() as folder, open(os.path.join(folder, STATE_FILE), "rb") as f:
                state = ray.put(f.read())
        actors, runs = self._start_ranks(address, state)
        try:
            self.group = RankGroup(0, self.ranks, address, self.device, lost_worker=host_memory_failure)
            super().run()
        except Exception as exc:
            if isinstance(exc, (GroupFailure, OomRetriesExhausted, HostMemoryExhausted)) or is_oom(exc):
                raise  # agreed by every rank: this error is the group's
            # The group broke without an agreement: a rank died, or failed where no rank waits for
            # it (its group closed, so this rank's collective failed at once). Say which.
            culprit = _failed_rank(runs)
            if culprit is None:
                raise
            rank, died, line = culprit
            if died:
                raise RankDiedError(f"rank {rank} of the trial's group died ({line}); the group stopped at: {exc}") from None
            raise GroupFailure(f"rank {rank} failed: {line}") from None
        else:
            ray.get(runs, timeout=DEATH_NOTICE_S * 6)  # they finished with rank 0; a rank's error surfaces here
        finally:
            if hasattr(self, "group"):
                self.group.close()
            # A rank that failed with the group (an agreed error) is ending too: let it remove its
            # scratch folder, which no later attempt of a failed trial would, before its process goes.
            ray.wait(runs, num_returns=len(runs), timeout=DEATH_NOTICE_S)
            for actor in actors:
                ray.kill(actor)

    def _start_ranks(self, address: str, state) -> tuple[list, list]:
        from ray.util import get_current_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        group = get_current_placement_group()
        resources = self.spec.resources
        actors, runs = [], []
        for rank in range(1, self.ranks):
            actor = RankActor.options(
                num_cpus=resources.cpu, num_gpus=float(resources.gpu),
                scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=rank),
            ).remote()
            actors.append(actor)
            runs.append(actor.run.remote(self.config, self.spec, self.context.get_trial_id(), address, rank, self.ranks, state))
        return actors, runs

    def _starting_plan(self) -> Plan:
        self.rank_budgets = self.group.all_gather(self._budget())
        try:
            plan = super()._starting_plan()
        except Exception as exc:
            self.group.broadcast(f"{type(exc).__name__}: {exc}")
            raise
        self.group.broadcast({"plan": plan.to_dict(), "events": [e.to_dict() for e in self.events],
                              "applied_shrinks": self.applied_shrinks,
                              "host_memory_events": [e.to_dict() for e in self.host_events]})
        return plan

    def _plan_from_estimates(self, profiles: ProfileCache) -> Plan:
        return plan_for_ranks(self.workload, self.policy, self.spec.effective_batch_size, self.rank_budgets,
                              target=self.device.target, device=self.device, profiles=profiles)

    def _milestone_report(self, milestone: Milestone) -> TrialReport:
        """The group's memory is its worst rank's (``peak_allocated_bytes`` ...), and each rank's too."""
        peaks = tuple(RankPeak(r.peak_allocated, r.peak_reserved) for r in milestone.rank_memory)
        return replace(super()._milestone_report(milestone), rank_peaks=peaks)


class RankRun(_GroupRank, TrialRun):
    """Rank 1..N-1: trains as rank 0 does; keeps its own checkpoints; reports nothing to Tune."""

    def __init__(self, config: dict[str, Any], spec: SweepSpec, trial_id: str, group_address: str, rank: int,
                 ranks: int, state: bytes | None):
        self.rank, self.ranks = rank, ranks
        try:
            self._set_up(config, spec, estimates=None, context=None, scratch=f"{trial_id}-rank{rank}",
                         metrics=None, evidence_folder=None, estimated_by="rank 0")
        except Exception:
            # Rank 0 waits for this rank to join the group: join and leave, so it stops at once.
            RankGroup.join_and_leave(rank, ranks, group_address, _backend(spec, rank))
            raise
        if state is not None:
            self.checkpoints.adopt(data=state)
        self.group = RankGroup(rank, ranks, group_address, self.device, lost_worker=host_memory_failure)

    def run(self) -> None:
        try:
            super().run()
        finally:
            self.group.close()

    def _starting_plan(self) -> Plan:
        self.group.all_gather(self._budget())
        sent = self.group.broadcast(None)
        if isinstance(sent, str):
            raise GroupFailure(f"rank 0 could not plan the group: {sent}")
        self.events = [OomEvent.from_dict(e) for e in sent["events"]]
        self.applied_shrinks = sent["applied_shrinks"]
        for event in sent["host_memory_events"]:  # a restarted group's ranks load with rank 0's fewer workers
            self._record_host_event(HostMemoryEvent.from_dict(event))
        return Plan.from_dict(sent["plan"])

    def _report(self, trainer: Trainer, milestone: Milestone) -> None:
        if not milestone.checkpoint:
            return
        self.checkpoints.save(self._state(trainer))

    def _report_refusal(self) -> None:
        return None  # rank 0 reports it

    def _report_divergence(self, divergence: Divergence) -> None:
        return None  # rank 0 reports it

    def _remember_cuda_context(self) -> None:
        return None  # a rank's process serves one trial


@ray.remote(max_restarts=0, max_task_retries=0)
class RankActor:
    """One rank's process; Ray places it in its bundle of the trial's placement group."""

    def run(self, config, spec, trial_id, address, rank, ranks, state) -> None:
        exit_requests_survive_finalisers()
        # Ray runs this on the process's main thread: a lost loader worker must reach the rank at
        # its next fetch, inside the group's agreement, not wherever torch's SIGCHLD handler finds it.
        loader_worker_deaths_found_at_fetch()
        RankRun(config, spec, trial_id, address, rank, ranks, state).run()


def _failed_rank(runs: list) -> tuple[int, bool, str] | None:
    """The first rank whose actor died or raised: (rank, died, Ray's or its own exception line)."""
    from ray.exceptions import RayActorError, RayTaskError

    for rank, run in enumerate(runs, start=1):
        ready, _ = ray.wait([run], timeout=DEATH_NOTICE_S)
        if not ready:
            continue
        try:
            ray.get(run)
        except RayActorError as exc:
            return rank, True, f"ActorDiedError: {str(exc).strip().splitlines()[0]}"
        except RayTaskError as exc:
            cause = exc.cause if exc.cause is not None else exc
            lines = str(cause).strip().splitlines()
            return rank, False, f"{type(cause).__name__}: {lines[0] if lines else ''}"
    return None


def _backend(spec: SweepSpec, rank: int) -> str:
    """The group's backend as ``_open_device`` would choose it, without opening a device."""
    device = resolve_target(spec, rank=rank, gpu_here=gpu_visible()).device
    return device_kind(device).device_class().collective_backend


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]
