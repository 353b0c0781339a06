"""The host-memory plan (``orchestrator.host_memory``) for the nodes a sweep runs on: what
``run`` applies before any trial starts, and how many trial processes ``plan`` counts on a node.

Every trial of a sweep loads its data with the same ``data`` settings, so ``run`` cuts them
once, for the node that needs it most, and every trial gets the cut settings; when even loading
in the trials' own processes does not fit, the sweep is refused before a trial starts. What the
plan takes as given, so that it errs on the side of holding less:

* a node runs as many trial processes at once as it holds bundles of one trial's ``resources``
  (``capacity.bundles_held``, the rule the schedulability check uses; with ``gpu: auto``, the
  smallest share a trial may ask for); a data-parallel trial's rank is one such process, and
  each rank loads the whole dataset;
* every one of them holds what the sweep's largest trial holds (each part the largest of the
  sweep's distinct configs, measured by ``trainables.footprint``): a node that runs a mix of
  trials holds less;
* the batches loaded ahead are counted at the rank's whole share of the effective batch (the
  largest micro-batch a plan can choose; each trial plans its own on its worker), and the
  optimizer's state as Adam keeps it (two moments per parameter);
* a node's available memory is ``--host-memory`` where given; else, for the embedded local
  Ray, this machine's (``orchestrator.available_memory``: ``MemAvailable``, or what its cgroup's
  limit leaves where less); on a cluster, the ``memory`` Ray gave each node for tasks and actors
  when it started (its available memory less the object store).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from orchestrator.available_memory import available_host_memory
from orchestrator.capacity import bundles_held, trial_request
from orchestrator.config import SweepSpec
from orchestrator.device_kinds import device_kind
from orchestrator.errors import UserError
from orchestrator.host_memory import HostPlan, plan_host_memory
from orchestrator.units import human


@dataclass(frozen=True)
class NodeMemory:
    """A node the sweep's trials may run on: its name, its Ray resources, its available memory."""

    name: str  # "this machine", or "node 10.0.0.3"
    resources: dict[str, float]
    available_bytes: int


def processes_at_once(spec: SweepSpec, resources: dict[str, float], trials: int | None = None) -> int:
    """How many trial processes a node of ``resources`` runs at once: one per bundle of a trial's
    request it holds, and no more than the sweep's ``trials`` have ranks (at least one)."""
    held = bundles_held(trial_request(spec), resources)
    if trials is not None:
        held = min(held, trials * spec.resources.workers)
    return max(held, 1)


def pins_host_memory(spec: SweepSpec, device: str) -> bool:
    """Whether the trials' loaders pin their batches: on an accelerator, unless ``data.pin_memory: false``."""
    return device_kind(device).accelerator and spec.data.pin_memory is not False


def local_nodes(resources: dict[str, float], host_memory: int | None) -> list[NodeMemory]:
    """This machine as the embedded local Ray will have it; none when its memory cannot be read."""
    available = host_memory if host_memory is not None else available_host_memory()
    return [] if available is None else [NodeMemory("this machine", resources, available)]


def cluster_nodes(nodes: list[dict[str, float]], host_memory: int | None) -> list[NodeMemory]:
    """A cluster's alive nodes (``capacity.alive_nodes``), each with the memory Ray gave it."""
    found = []
    for resources in nodes:
        address = next((key[len("node:"):] for key in resources if key.startswith("node:") and key != "node:__internal_head__"), "?")
        available = host_memory if host_memory is not None else resources.get("memory")
        if available:
            found.append(NodeMemory(f"node {address}", resources, int(available)))
    return found


def sweep_footprint(spec: SweepSpec, configs: list[dict]):
    """What the largest of the trials of ``configs`` holds on its host, part by part
    (``trainables.footprint``), with its batches at the rank's whole share of the effective batch."""
    from trainables.footprint import DataFootprint, data_footprint
    from trainables.workload import build_workload

    rank_batch = spec.effective_batch_size // spec.resources.workers
    measured = [data_footprint(build_workload(config), rank_batch) for config in configs]
    return DataFootprint(**{f.name: max(getattr(m, f.name) for m in measured) for f in fields(DataFootprint)})


def tightest_plan(spec: SweepSpec, footprint, nodes: list[NodeMemory], pinned: bool,
                  trials: int | None = None) -> tuple[NodeMemory, HostPlan] | None:
    """The node whose plan cuts the loader settings most (a refusal first), with that plan; None
    without a node that can run a trial. ``trials``: how many the sweep has."""
    request = trial_request(spec)
    plans = [(node, plan_host_memory(footprint, spec.data, pinned=pinned, available_bytes=node.available_bytes,
                                     trials_at_once=processes_at_once(spec, node.resources, trials)))
             for node in nodes if bundles_held(request, node.resources) > 0]
    if not plans:
        return None
    return min(plans, key=lambda p: (p[1].refusal is None, p[1].data.num_workers, p[1].data.prefetch_factor or 0))


def sweep_host_plan(spec: SweepSpec, nodes: list[NodeMemory], device: str) -> tuple[NodeMemory, HostPlan] | str | None:
    """The plan ``run`` applies: the tightest node's, for the sweep's largest trial (the line
    why, where the trials' data and state could not be measured; None without a node to plan for)."""
    from orchestrator.preflight import distinct_configs

    if not nodes:
        return None
    try:
        footprint = sweep_footprint(spec, distinct_configs(spec))
    except Exception as exc:  # noqa: BLE001 - e.g. a model that does not build on ``meta``: its trials still run
        from orchestrator.memory.failure import summary

        return f"not planned, the trials' data and model state could not be measured ({summary(exc)})"
    return tightest_plan(spec, footprint, nodes, pins_host_memory(spec, device), spec.trial_count())


def fit_host_memory(spec: SweepSpec, nodes: list[NodeMemory], device: str) -> tuple[SweepSpec, list[str]]:
    """The spec the trials run with: ``data`` cut so that the nodes hold the trials they run at
    once, and the cuts, one printed line each (MLflow records them with the sweep); a
    :class:`UserError` when even no loader workers fit."""
    found = sweep_host_plan(spec, nodes, device)
    if isinstance(found, str):
        print(f"host memory: {found}", flush=True)
    if not isinstance(found, tuple):
        return spec, []
    node, plan = found
    if plan.refusal:
        raise UserError(f"host memory: {node.name}: {plan.refusal}; or, where more is available than measured, "
                        "say how much with --host-memory SIZE")
    held = (f"so that the {plan.trials_at_once} trial process(es) {node.name} runs at once fit in its "
            f"{human(plan.available_bytes)} available (each holds up to {human(plan.trial_bytes)}: {plan.parts_text}); "
            "`orchestrator plan` shows each trial's")
    cuts = [f"{change}, {held}" for change in plan.changes]
    for cut in cuts:
        print(f"host memory: {cut}", flush=True)
    return (replace(spec, data=plan.data) if cuts else spec), cuts

