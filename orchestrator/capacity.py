"""Whether the cluster can ever run a trial: a request that no node can hold keeps every trial
PENDING, and Tune waits for it forever.

A trial runs on one node, so the question is whether some alive node has at least the trial's
CPUs and GPUs in total; a data-parallel trial (``resources.workers``) is one bundle per worker,
which may spread over nodes, so there the question is whether the nodes hold that many bundles (what is free changes as trials finish; what a node has does not). On a
fixed cluster (this machine, a SLURM allocation) the answer before the sweep starts is final,
and ``run`` stops there with one line. An autoscaling cluster adds nodes for pending work, which
Tune's pending trials create, so there the sweep starts and :class:`WaitForNodes` stops it after
``resources.wait_minutes`` if no node that fits has joined by then, with the reason.
"""

from __future__ import annotations

import logging
import time

from ray import tune

from orchestrator.config import SweepSpec
from orchestrator.cores import usable_cores
from orchestrator.errors import UserError
from orchestrator.outcome import current_record

logger = logging.getLogger(__name__)

#: How often the wait looks at the cluster's nodes (Tune asks a stopper at every step).
POLL_S = 5.0


def trial_request(spec: SweepSpec) -> dict[str, float]:
    """What one trial asks Ray for. ``gpu: auto`` asks for a share of one GPU, so any GPU will do."""
    gpu = spec.memory.gpu_granularity if spec.resources.gpu == "auto" else float(spec.resources.gpu)
    return {"CPU": float(spec.resources.cpu), "GPU": gpu}


def fits(request: dict[str, float], node: dict[str, float]) -> bool:
    return all(node.get(kind, 0.0) >= amount for kind, amount in request.items() if amount > 0)


def unschedulable_reason(request: dict[str, float], nodes: list[dict[str, float]]) -> str | None:
    """Why no node can hold ``request``, or None when one can."""
    if any(fits(request, node) for node in nodes):
        return None
    asked = ", ".join(f"{kind} {amount:g}" for kind, amount in request.items() if amount > 0)
    if not nodes:
        return f"a trial needs {asked} on one node, and the cluster has no alive node"
    largest = max(nodes, key=lambda n: (n.get("GPU", 0.0), n.get("CPU", 0.0)))
    has = ", ".join(f"{kind} {largest.get(kind, 0.0):g}" for kind in request)
    return f"a trial needs {asked} on one node, and no node of the cluster has that (the largest of {len(nodes)}: {has})"


def bundles_held(request: dict[str, float], node: dict[str, float]) -> int:
    """How many bundles of ``request`` one node holds in total."""
    wanted = [(kind, amount) for kind, amount in request.items() if amount > 0]
    if not wanted:
        return 2**31
    return min(int(node.get(kind, 0.0) // amount) for kind, amount in wanted)


def group_unschedulable_reason(request: dict[str, float], workers: int, nodes: list[dict[str, float]]) -> str | None:
    """Why the nodes cannot hold ``workers`` bundles of ``request`` at once, or None when they can."""
    if workers == 1:
        return unschedulable_reason(request, nodes)
    held = sum(bundles_held(request, node) for node in nodes)
    if held >= workers:
        return None
    asked = ", ".join(f"{kind} {amount:g}" for kind, amount in request.items() if amount > 0)
    return (f"a trial needs {workers} workers of {asked} each, and the cluster's {len(nodes)} node(s) hold "
            f"{held} such worker(s) at most; use resources.workers: {held}" if held else
            f"a trial needs {workers} workers of {asked} each, and no node of the cluster holds one")


def local_node(num_cpus: float | None, num_gpus: float | None) -> dict[str, float]:
    """What the embedded local Ray ``run`` starts will have: the flags, else the CPUs this process
    may use (``orchestrator.cores``: ``run`` gives Ray that count) and the GPUs PyTorch sees (as
    Ray detects them)."""
    if num_gpus is None:
        from orchestrator.device import gpu_count

        num_gpus = gpu_count()
    return {"CPU": float(num_cpus if num_cpus is not None else usable_cores()), "GPU": float(num_gpus)}


def check_local_node(request: dict[str, float], workers: int, node: dict[str, float]) -> None:
    """Before an embedded local Ray starts: a trial it could never hold is one line, not a wait."""
    reason = group_unschedulable_reason(request, workers, [node])
    if reason is not None:
        raise UserError(f"resources: {reason}; ask for less (resources.workers, resources.cpu, resources.gpu) "
                        "or give the local Ray more (--num-cpus, --num-gpus)")


def alive_nodes() -> list[dict[str, float]]:
    """Every alive node's total resources (Ray's ``ray.nodes()``)."""
    import ray

    return [dict(node["Resources"]) for node in ray.nodes() if node.get("Alive")]


def check_schedulable(request: dict[str, float], wait_minutes: float, workers: int = 1) -> "WaitForNodes | None":
    """Fail now when no node can hold a trial and waiting is not asked for; else the stopper that
    waits (None when a node already fits)."""
    reason = group_unschedulable_reason(request, workers, alive_nodes())
    if reason is None:
        return None
    if wait_minutes <= 0:
        raise UserError(
            f"resources: {reason}; ask for less (resources.cpu, resources.gpu), give the local Ray more "
            "(--num-cpus, --num-gpus), or on an autoscaling cluster set resources.wait_minutes"
        )
    print(f"Waiting up to {wait_minutes:g} min for a node that can run a trial: {reason}", flush=True)
    return WaitForNodes(request, wait_minutes * 60, workers)


class WaitForNodes(tune.Stopper):
    """Stops the sweep when, ``wait_s`` after it started, still no node can hold one trial.

    Once such a node has joined it never stops anything: the trials then run, or wait their
    turn, as on any cluster.
    """

    def __init__(self, request: dict[str, float], wait_s: float, workers: int = 1):
        self.request = request
        self.workers = workers
        self.wait_s = wait_s
        self._deadline: float | None = None
        self._next_look = 0.0
        self._satisfied = False
        self._reason: str | None = None

    def __call__(self, trial_id, result) -> bool:
        return False

    def stop_all(self) -> bool:
        if self._satisfied or self._reason:
            return bool(self._reason)
        now = time.monotonic()
        if self._deadline is None:  # first asked when the sweep starts (or resumes)
            self._deadline = now + self.wait_s
        if now < self._next_look:
            return False
        self._next_look = now + POLL_S
        reason = group_unschedulable_reason(self.request, self.workers, alive_nodes())
        if reason is None:
            self._satisfied = True
            logger.info("a node that can run a trial has joined the cluster")
            return False
        if now < self._deadline:
            return False
        self._reason = f"{reason}, after waiting {self.wait_s / 60:g} min (resources.wait_minutes)"
        record = current_record()
        if record is not None:
            record.stop_reason = self._reason
        logger.error("stopping the sweep: %s", self._reason)
        return True

    def __getstate__(self) -> dict:
        """A resumed sweep waits afresh."""
        return {**self.__dict__, "_deadline": None, "_next_look": 0.0, "_satisfied": False, "_reason": None}
