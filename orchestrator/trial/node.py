"""Which node of the cluster a trial runs on, what that node declares about its device, and a
trial's moves from a lost node to another.

On a cluster of several machines every trial attempt runs on one node, and after a node is lost
(preemption, hardware, a SLURM node failure) Tune restarts its trials from their last
checkpoints on nodes that survive. A person reading the results needs to know where each trial
ran and which ones moved, and why; Tune's ``node_ip``/``hostname`` cannot tell nodes apart when
several share a machine (or an IP behind NAT), so nodes are named by the name given to
``ray start --node-name`` (Ray's default: the node's IP) and a trial attempt's node is found by
Ray's node id. Ids do not survive a restart of Ray; names do, so a move is a change of name.

A node can declare the memory of its emulated device with the Ray node label
:data:`CAPACITY_LABEL` (``ray start --labels orchestrator/emulated-capacity=48MiB``), the way a
real node's GPU size comes with the node rather than with the sweep: ``memory.capacity`` is the
size where a node declares none. Labels are Ray's own place for what a node is (its
accelerator, its zone), visible in ``ray.nodes()`` and the dashboard, and they do not take part
in resource accounting as a custom resource would.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from orchestrator.units import parse_bytes

#: The Ray node label with which a node declares the capacity of its emulated device.
CAPACITY_LABEL = "orchestrator/emulated-capacity"


@dataclass(frozen=True)
class NodeInfo:
    """The node a trial attempt runs on."""

    node_id: str
    name: str
    labels: dict[str, str]

    def capacity(self, default: int | None) -> int | None:
        """The emulated device's bytes on this node: its label, else ``default`` (``memory.capacity``)."""
        declared = self.labels.get(CAPACITY_LABEL)
        if declared is None:
            return default
        try:
            return parse_bytes(declared)
        except ValueError as exc:
            raise ValueError(f"node {self.name}: label {CAPACITY_LABEL}={declared!r}: {exc}") from None


def current_node() -> NodeInfo:
    """This process's node (inside a Ray worker or driver)."""
    import ray

    context = ray.get_runtime_context()
    node_id = context.get_node_id()
    labels = dict(context.get_node_labels() or {})
    return NodeInfo(node_id, _node_name(node_id), labels)


#: Node names by node id, looked up once per process: a reused worker starts every trial of a
#: sweep on the same node, and ``ray.nodes()`` asks Ray's head for every node of the cluster.
_NAMES: dict[str, str] = {}


def _node_name(node_id: str) -> str:
    """The name the node was started with (an id is new each time a node starts, so a name
    found for it stays right); its id's first characters where Ray does not list it (yet)."""
    if node_id not in _NAMES:
        import ray

        name = next((n.get("NodeName") for n in ray.nodes() if n.get("NodeID") == node_id), None)
        if name is None:
            return node_id[:8]
        _NAMES[node_id] = name
    return _NAMES[node_id]


def left_its_node(saved: dict[str, Any], node: NodeInfo) -> bool:
    """Whether a trial resuming on ``node`` from a checkpoint ``saved`` (with the ``node_id`` and
    ``node_name`` it was made on) left that node.

    Ray gives a node a new id each time it starts, so after a sweep is resumed on a restarted Ray
    (``--resume`` on one machine, a requeued SLURM job on the same nodes) every id differs while
    the trials are where they were: a node is the same node when its name is. Checkpoints that
    carry no name compare ids.
    """
    if "node_name" in saved:
        return saved["node_name"] != node.name
    return saved.get("node_id", node.node_id) != node.node_id


#: How long a trial that resumed elsewhere after its node stopped answering waits for Ray's
#: verdict on that node (Ray declares a node dead after missed health checks, ~15 s by default).
VERDICT_WAIT_S = 45.0


def node_alive(node_id: str) -> bool:
    import ray

    return any(n.get("NodeID") == node_id and n.get("Alive") for n in ray.nodes())


def restart_reason(kind: str | None, node_id: str, node_name: str, wait_s: float = VERDICT_WAIT_S) -> str:
    """Why a trial left ``node_name``, in words, from the kind of failure the scheduler saw
    (``orchestrator.failures.classify``) and, when the node only stopped answering, from Ray's
    verdict on it: a node that Ray declares dead was lost; one still alive had its worker die."""
    import time

    if kind == "node_unreachable":
        deadline = time.monotonic() + wait_s
        while node_alive(node_id) and time.monotonic() < deadline:
            time.sleep(1)
        kind = "worker_died" if node_alive(node_id) else "node_died"
    if kind == "node_died":
        return f"node {node_name} lost"
    if kind == "worker_died":
        return f"its worker died on node {node_name}"
    return "restarted on another node"
