"""A data-parallel group whose ranks never wait in a collective that another rank will not reach.

DDP's hooks all-reduce gradient buckets *during* backward: a rank that runs out of memory in
its backward never posts the buckets the others are waiting for, and the group hangs (pytorch
#44353). Here no collective runs inside a rank's own work. Each optimizer step is:

1. local: the rank's forward/backward passes over its micro-batches (its slice of the step),
   and, at the first step, the bucket buffer the exchange keeps; any error is caught, not raised;
2. :meth:`RankGroup.agree`: one small all-reduce of every rank's outcome (ok / out of memory /
   a DataLoader worker lost to host memory / other error), through a gloo group on the host
   whatever the gradients' backend (``_control_group``). If any rank failed, every rank raises
   the same :class:`GroupOutOfMemory` (or :class:`GroupLostLoaderWorker`, or :class:`GroupFailure`)
   naming the rank, phase and step, and the trial's recovery (release, next reduction or fewer
   loader workers, back to the last checkpoint) runs on every rank in step;
3. only when all succeeded: the gradients are summed bucket by bucket through the buffer (each
   rank weighted its losses by its share of the *whole* step, so the sum is the gradient of one
   process over the whole effective batch);
4. local: the optimizer step (Adam's state is made here, on the first step), then a second
   agreement, for an OOM there.

Evaluation is the same: each rank evaluates its slice of the eval set, agrees, then the sums are
all-reduced. Milestone cadences are counted in steps and epochs only (the config refuses
minutes in a group), so every rank reaches every milestone's collective.

A rank whose process dies cannot agree to anything: its peers' next agreement fails as soon as
the connection closes, or after :data:`COLLECTIVE_TIMEOUT` when it hangs without dying, and the
trial fails and is restarted by Tune from its last checkpoint (``orchestrator.trial.group``).
"""

from __future__ import annotations

import datetime
import pickle
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from orchestrator.device import Device
from orchestrator.device.oom import is_oom
from trainables.data import Shard
from trainables.divergence import Divergence
from trainables.loop import LoopPlan, LoopSettings, Milestone, Trainer, step_seed
from trainables.step import accumulate_gradients, apply_gradients
from trainables.workload import Workload

#: DDP's default ``bucket_cap_mb`` (25 MiB), which our exchange uses too
#: (``orchestrator.memory.parallel`` plans each rank's memory for it).
BUCKET_CAP_BYTES = 25 * 2**20

#: How long a rank waits in a collective for a peer that neither arrives nor dies (a dead peer's
#: closed connection fails the collective at once). Longer than any one step or evaluation.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)

_OK, _OOM, _ERROR, _LOST_WORKER = 0, 1, 2, 3


class GroupOutOfMemory(torch.OutOfMemoryError):
    """Some rank of the group ran out of memory; raised on every rank alike.

    Only its message travels (Ray rebuilds exceptions from ``args``); the rank is parsed back by
    :func:`failed_rank`. ``bytes_allocated``/``bytes_reserved`` are what the failed rank's device
    held, set in the process that raises it.
    """

    bytes_allocated: int | None = None
    bytes_reserved: int | None = None


class GroupFailure(RuntimeError):
    """Some rank of the group failed for a reason other than memory; raised on its peers."""


class GroupLostLoaderWorker(RuntimeError):
    """Some rank lost a DataLoader worker to host memory; raised on every rank alike, so that the
    whole group goes back to its last checkpoint with fewer workers (``orchestrator.trial.host_memory``).
    Its message: ``rank 1: DataLoader worker (pid(s) 4242) exited unexpectedly``."""


@dataclass(frozen=True)
class RankFailure:
    rank: int
    kind: int  # _OOM | _ERROR | _LOST_WORKER
    message: str  # the rank's own exception line
    allocated: int  # bytes the rank's device held when it failed
    reserved: int | None  # and its allocator reserved (a GPU)


def failed_rank(exc: BaseException) -> int | None:
    """The rank a :class:`GroupOutOfMemory` names."""
    text = str(exc)
    if text.startswith("rank ") and " " in text[5:]:
        head = text[5:].split(" ", 1)[0]
        return int(head) if head.isdigit() else None
    return None


class RankGroup:
    """This process's membership of the trial's process group: its rank and the collectives.

    ``lost_worker``: the trial's recognition of a DataLoader worker lost to host memory (its line,
    else None), so that one rank's is agreed on as the group's instead of as a bug.
    """

    def __init__(self, rank: int, ranks: int, address: str, device: Device,
                 lost_worker: Callable[[BaseException], str | None] | None = None):
        self.rank, self.ranks, self.device = rank, ranks, device
        self.lost_worker = lost_worker
        self.backend = device.collective_backend
        dist.init_process_group(self.backend, init_method=address, rank=rank, world_size=ranks,
                                timeout=COLLECTIVE_TIMEOUT)
        try:
            self.control = _control_group()
        except BaseException:  # no group left for a reused worker's next trial to trip over
            dist.destroy_process_group()
            raise

    @staticmethod
    def join_and_leave(rank: int, ranks: int, address: str, backend: str) -> None:
        """For a rank that failed before it could take part: the others stop at their next
        collective (the closed connections) instead of waiting for it to join."""
        dist.init_process_group(backend, init_method=address, rank=rank, world_size=ranks, timeout=COLLECTIVE_TIMEOUT)
        _control_group()  # every rank makes it, or the others wait in theirs
        dist.destroy_process_group()

    @property
    def shard(self) -> Shard:
        return Shard(self.rank, self.ranks)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    # -- agreement -------------------------------------------------------------------------
    def agree(self, failure: BaseException | None, phase: str, position: int) -> None:
        """Every rank calls this at the same point; it returns only when no rank failed.

        The rank that failed passes its exception (it is not raised here: its frames hold the
        failed step's tensors, and what is raised must not keep them alive).
        """
        lost = self.lost_worker(failure) if failure is not None and self.lost_worker is not None else None
        kind = _OK if failure is None else _LOST_WORKER if lost else _OOM if is_oom(failure) else _ERROR
        with self.device.host():
            outcome = torch.zeros(self.ranks, dtype=torch.int64)
            outcome[self.rank] = kind
            dist.all_reduce(outcome, group=self.control)
            kinds = outcome.tolist()
        if not any(kinds):
            return
        mine = None if failure is None else RankFailure(self.rank, kind, lost or _exception_line(failure),
                                                        self.device.allocated(), self.device.reserved())
        del failure
        failures = [f for f in self.all_gather(mine) if f is not None]
        first_error = next((f for f in failures if f.kind == _ERROR), None)
        where = _where(phase, position)
        if first_error is not None:
            raise GroupFailure(f"rank {first_error.rank} failed in {where}: {first_error.message}")
        lost_worker = next((f for f in failures if f.kind == _LOST_WORKER), None)
        if lost_worker is not None:  # back to the checkpoint with fewer workers; an OOM elsewhere recurs if real
            raise GroupLostLoaderWorker(f"rank {lost_worker.rank}: {lost_worker.message}")
        first = failures[0]
        others = [f.rank for f in failures[1:]]
        also = f" (and rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))})" if others else ""
        error = GroupOutOfMemory(f"rank {first.rank} ran out of memory in {where}{also}: {first.message}")
        error.bytes_allocated, error.bytes_reserved = first.allocated, first.reserved
        raise error

    def all_gather(self, value) -> list:
        """Every rank's (small, picklable) ``value``, by rank."""
        with self.device.host():
            data = torch.frombuffer(bytearray(pickle.dumps(value)), dtype=torch.uint8)
            size = torch.tensor([data.numel()], dtype=torch.int64)
            sizes = [torch.zeros_like(size) for _ in range(self.ranks)]
            dist.all_gather(sizes, size, group=self.control)
            longest = max(int(s.item()) for s in sizes)
            padded = torch.zeros(longest, dtype=torch.uint8)
            padded[: data.numel()] = data
            gathered = [torch.zeros_like(padded) for _ in range(self.ranks)]
            dist.all_gather(gathered, padded, group=self.control)
            return [pickle.loads(g[: int(n.item())].numpy().tobytes()) for g, n in zip(gathered, sizes)]

    def broadcast(self, value, source: int = 0):
        """Rank ``source``'s ``value``, on every rank."""
        return self.all_gather(value if self.rank == source else None)[source]

    def sum(self, values: list[float]) -> list[float]:
        with self.device.host():
            t = torch.tensor(values, dtype=torch.float64)
            dist.all_reduce(t, group=self.control)
            return t.tolist()

    # -- gradients -------------------------------------------------------------------------
    def bucket(self, model: torch.nn.Module) -> torch.Tensor:
        """The exchange's buffer: one bucket, or every gradient when they are smaller. Made in the
        rank's own work (it is device memory, and may be what runs out) and kept, as DDP keeps
        its buckets (``memory.parallel``)."""
        elements = sum(p.numel() for p in model.parameters() if p.requires_grad)
        return torch.empty(min(elements, BUCKET_CAP_BYTES // 4), dtype=torch.float32, device=self.device.torch_device)

    @staticmethod
    def fill_missing_gradients(model: torch.nn.Module) -> None:
        """A parameter this rank's batch did not reach gets a zero gradient, so every rank sends
        the same layout."""
        for p in model.parameters():
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)

    def sum_gradients(self, model: torch.nn.Module, bucket: torch.Tensor) -> None:
        """Sum every parameter's gradient over the ranks, ``bucket`` at a time (no new tensors)."""
        pending: list[tuple[torch.Tensor, int, int, int]] = []  # (flat grad, its offset, bucket offset, length)
        used = 0
        with self.device.host():
            for p in model.parameters():
                if not p.requires_grad:
                    continue
                flat = p.grad.view(-1)
                start = 0
                while start < flat.numel():
                    n = min(flat.numel() - start, bucket.numel() - used)
                    bucket[used : used + n].copy_(flat[start : start + n])
                    pending.append((flat, start, used, n))
                    used, start = used + n, start + n
                    if used == bucket.numel():
                        self._flush(bucket, used, pending)
                        pending, used = [], 0
            if used:
                self._flush(bucket, used, pending)

    @staticmethod
    def _flush(bucket: torch.Tensor, used: int, pending) -> None:
        dist.all_reduce(bucket[:used])
        for flat, start, at, n in pending:
            flat[start : start + n].copy_(bucket[at : at + n])


def _control_group():
    """The group's agreements, gathers and sums go through gloo, on the host, whatever the
    backend of the gradients: a peer that died closes gloo's connections, and the collective
    fails at once where NCCL's would wait for its watchdog (``COLLECTIVE_TIMEOUT``) and then end
    the process without a Python error, so no rank could say which one failed. Made by every
    rank right after the group is, the CPU's gloo groups too, so that one path runs everywhere."""
    return dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT)


def _where(phase: str, position: int) -> str:
    """``train step 8``: where the group failed, counted from 1 as the console's OOM lines count
    (``position`` is the loop's: the optimizer steps finished, or the eval batch's index)."""
    if phase == "train":
        return f"train step {position + 1}"
    if phase == "eval":
        return f"eval batch {position + 1}"
    return phase


class DistributedTrainer(Trainer):
    """The loop's :class:`Trainer` as one rank of a group: its slice of each step and of the eval
    set, the exchange between backward and the optimizer step, an agreement after each local part."""

    def __init__(self, workload: Workload, device: Device, plan: LoopPlan, settings: LoopSettings, seed: int,
                 group: RankGroup):
        if workload.stateful:  # each rank's streams would need their own checkpointed state
            raise ValueError(f"workload {type(workload).__name__} is stateful: it trains in one process (resources.workers: 1)")
        self.group = group
        self.bucket: torch.Tensor | None = None
        super().__init__(workload, device, plan, settings, seed=seed, shard=group.shard)

    def _train_step(self, batches) -> None:
        self.phase, self.position = "train", self.progress.step
        self.device.seed(step_seed(self.seed, self.progress.step) + self.group.rank * 2**42)
        sizes = self.cut.sizes
        with self.device.step("train", self.state_tensors):
            self._group_step(batches, sizes)

    def _group_step(self, batches, sizes: tuple[int, ...]) -> None:
        failure = loss = grad_norm = None
        try:
            if self.bucket is None:
                self.bucket = self.group.bucket(self.model)
            loss = accumulate_gradients(
                self.workload, self.model, self._take(batches, len(sizes)), sizes, self.device.torch_device,
                self.plan.precision, self.scaler, total=self.plan.effective_batch,
            )
            self.group.fill_missing_gradients(self.model)
        except Exception as exc:  # noqa: BLE001 - every failure is agreed on, then raised on every rank
            failure = exc
        self.group.agree(failure, "train", self.position)
        self.group.sum_gradients(self.model, self.bucket)
        try:
            grad_norm = apply_gradients(self.model, self.optimizer, self.scaler, self.settings.max_grad_norm)
        except Exception as exc:  # noqa: BLE001
            failure = exc
        self.group.agree(failure, "train", self.position)
        self._advance(loss, grad_norm)

    def state_tensors(self):
        yield from super().state_tensors()
        if self.bucket is not None:
            yield self.bucket

    def _eval_totals(self) -> dict[str, float]:
        failure, totals = None, {}
        try:
            totals = super()._eval_totals()
        except Exception as exc:  # noqa: BLE001
            failure = exc
        self.group.agree(failure, "eval", self.position)
        names = sorted(totals)
        return dict(zip(names, self.group.sum([totals[n] for n in names])))

    def _train_loss_sum(self) -> float:
        return self.group.sum([self._loss_sum.item()])[0]  # each rank's loss is its share of the mean

    def _divergence(self) -> Divergence | None:
        """The group's: the earliest bad step of any rank, agreed at a milestone (every rank reaches
        it), so all ranks stop together. Each rank's loss is its share of the step's mean: the last
        finite loss is their sum where every rank found the same step, else unknown."""
        found = self.group.all_gather(super()._divergence())
        bad = [d for d in found if d is not None]
        if not bad:
            return None
        first = min(bad, key=lambda d: d.step)
        same = len(bad) == len(found) and all(d.step == first.step and d.last_finite_loss is not None for d in bad)
        return replace(first, last_finite_loss=sum(d.last_finite_loss for d in bad) if same else None)

    def _milestone_due(self) -> Milestone | None:
        milestone = super()._milestone_due()
        if milestone is None:
            return None
        readings = tuple(self.group.all_gather(milestone.memory))
        worst = max(readings, key=lambda r: r.peak_reserved if r.peak_reserved is not None else r.peak_allocated)
        return replace(milestone, memory=worst, rank_memory=readings)


def _exception_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:500]
