"""``orchestrator plan``: every trial's memory, phase by phase, and its plan, before anything runs.

For every trial configuration of the sweep (random search: the sampled ones) it estimates the
memory profile, prints the breakdown and the predicted peak of each phase at the planned batch
sizes (allocated, and reserved as it would be within the plan's limit: the budget times the
safety margin; for a CUDA target, "reserved by" says whether the allocator model gave it or a
flat factor did, and the plan's note says why), marks the worst phase, and shows the plan (micro-batch x accumulation, eval
batch, precision, checkpointing) with its peak against that limit, or why the trial would be
refused. ``static`` and ``trace`` need no GPU: ``--device-memory 24GiB`` plans for a card of
that size from any machine.

A data-parallel trial (``resources.workers``) is planned per rank (``planner.plan_for_ranks``):
the table is one rank's (every rank holds the whole model), and the plan lists each rank's
budget, the gradient exchange's bucket and its peak against its limit.

Trials with the same memory signature (``orchestrator.estimates``: they differ only in ``lr``,
``seed`` or what the workload declares memory-neutral) are estimated once, distinct ones in
parallel processes where there are cores to spare (``estimate_trials``), and share their rows
and their plan line (a random search of hundreds of learning rates is a few groups, each naming
its trials); ``--json`` has every trial.
A refused trial is a plan outcome, not an error of the command: the exit status is 0 with the
refusals shown (and counted in the summary). A trial that could not be estimated at all (its
model's library is not installed here, say) is shown with its error and the others still
planned; the exit status is then 1. User mistakes exit 2.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace

from orchestrator.device_kinds import device_kind
from orchestrator.errors import UserError
from orchestrator.estimator_registry import NO_ESTIMATE
from orchestrator.estimator_registry import names as estimator_names
from orchestrator.table import format_table, value_text
from orchestrator.units import size_flag


def plan_command(args) -> int:
    from orchestrator.config import load_spec
    from orchestrator.estimates import describe_signature, estimate_trials, memory_signature
    from orchestrator.memory.cache import ProfileCache
    from orchestrator.memory.phases import TrainingLength
    from orchestrator.memory.failure import summary
    from orchestrator.preflight import check_workloads
    from orchestrator.space import trial_configs
    from trainables.workload import build_workload

    spec = load_spec(args.config, list(args.overrides or []))
    policy = spec.memory if not args.estimator else replace(spec.memory, estimator=args.estimator)
    if policy.estimator == NO_ESTIMATE:
        raise UserError(f"memory.estimator is 'none': there is nothing to plan; pass --estimator {'|'.join(estimator_names())}")
    planned = planning_target(spec, args.device_memory)
    host_memory = size_flag("--host-memory", getattr(args, "host_memory", None))  # a typo, before minutes of tracing
    target, budget = planned.kind, planned.budget
    configs = trial_configs(spec)
    # Data for one step and an eval set, as `run` checks: one line, not an estimator's crash. A model
    # that does not build here is shown as its trials' error, the others still planned.
    check_workloads(spec, build_models=False)

    done = [0]

    def progress(signature: str, trials: list[int], seconds: float) -> None:
        done[0] += 1
        print(f"[{done[0]}] {describe_signature(signature, spec.search_space)} (trials {trial_list(trials)}): "
              f"{policy.estimator} {seconds:.1f}s",
              file=sys.stderr, flush=True)

    rank_budgets = _rank_budgets(spec, planned, args.device_memory is not None)
    rank_batch = spec.effective_batch_size // spec.resources.workers
    length = TrainingLength.of(spec)
    estimates = estimate_trials(configs, policy, target, budget, rank_batch, on_done=progress, length=length)
    results, caches, plans = [], {}, {}
    host = _HostMemory(spec, planned, host_memory, len(configs))
    for index, config in enumerate(configs):
        signature = memory_signature(config, policy, target)
        if signature in estimates.errors:  # e.g. a model whose library is not installed here: show it, go on
            results.append({"trial": index, "signature": signature, "config": config, "error": estimates.errors[signature]})
            continue
        workload = build_workload(config)
        if signature not in caches:  # the measured estimator probes here, once per signature too
            caches[signature] = ProfileCache(workload, policy, target, known=estimates.by_signature.get(signature),
                                             length=length)
        try:
            # Trials of one signature differ in memory-neutral parameters alone: one plan serves them
            # all (planning counts the eval set, which builds it: 10,000 trials took 13 s of it).
            if signature not in plans:
                plans[signature] = _plan(workload, policy, spec.effective_batch_size, budget, rank_budgets, target,
                                         caches[signature])
            plan, profile = plans[signature]
        except UserError:
            raise
        except Exception as exc:  # noqa: BLE001 - shown with the trial (op and line), the others still planned
            results.append({"trial": index, "signature": signature, "config": config, "error": summary(exc)})
            continue
        results.append({"trial": index, "signature": signature, "config": config, "plan": plan, "profile": profile,
                        "host": None if plan.refusal else host.plan(workload, signature, plan.micro_batch)})

    swept = host.for_run(planned)
    if args.json:
        print(json.dumps({**_as_json(spec, policy, target, budget, results), "run_host_memory": _run_host_json(swept)},
                         indent=2, default=str))
    else:
        print(_as_text(policy, target, budget, results))
        if swept is not None:
            print(_run_host_text(swept))
    return 1 if any("error" in r for r in results) else 0


def _plan(workload, policy, effective_batch: int, budget: int | None, rank_budgets: list[int | None] | None,
          target: str, profiles):
    """A trial's plan and the profile it was made from: a data-parallel group's where the trial has ranks."""
    from orchestrator.planner import plan_for_ranks, plan_with_profile

    if rank_budgets is None:
        return plan_with_profile(workload, policy, effective_batch, budget, target=target, profiles=profiles)
    plan = plan_for_ranks(workload, policy, effective_batch, rank_budgets, target=target, profiles=profiles)
    return plan, profiles.get(plan.settings)


def planning_target(spec, device_memory: str | None):
    """What to plan for (an ``orchestrator.device.target.Target``): the device kind, and the bytes
    a trial may use (None: unbounded), by the rule a trial follows. A GPU whose size neither the
    config nor ``--device-memory`` gives is this machine's GPU 0, as NVML sees its free memory."""
    from orchestrator.device.target import resolve_target

    card = _device_memory(device_memory)
    target = resolve_target(spec, card=card)
    if target.budget is not None or card is not None or not device_kind(target.device).accelerator:
        return target
    from orchestrator.device import nvml
    info = nvml.gpu_info(0)
    if info is None:
        raise UserError(
            "the sweep runs on GPUs but this machine has none for NVML to read: pass --device-memory "
            "(e.g. --device-memory 24GiB) or set memory.budget"
        )
    return resolve_target(spec, measured=info.free)


def _device_memory(text: str | None) -> int | None:
    return size_flag("--device-memory", text)


def _rank_budgets(spec, planned, card: bool) -> list[int | None] | None:
    """Each rank's budget in a data-parallel trial (None for a one-process trial), as each rank
    resolves it: a device sized by the config has each rank's own capacity where the config
    gives one per rank; every other (and ``--device-memory``'s card) is the same for every rank."""
    from orchestrator.device.target import resolve_target

    workers = spec.resources.workers
    if workers == 1:
        return None
    if not card and device_kind(planned.device).sized_by_config:
        return [resolve_target(spec, rank=rank).budget for rank in range(workers)]
    return [planned.budget] * workers


def _rank_lines(plan) -> list[str]:
    """Each rank of a group: its budget, the exchange's bucket, its predicted peak against its limit."""
    if plan.ranks == 1 or plan.refusal:
        return []
    lines = []
    held = plan.predicted_peak_bytes  # a rank's, the exchange's bucket included
    order = sorted(range(plan.ranks), key=lambda r: plan.rank_budgets[r] if plan.rank_budgets[r] is not None else 2**63)
    for rank in order:  # the tightest rank first: it decides the group's plan
        budget = plan.rank_budgets[rank]
        limit = None if budget is None or plan.safety_margin is None else int(budget * plan.safety_margin)
        against = "" if limit is None or held is None else f" of {_size(limit)} ({held / limit:.0%})"
        lines.append(f"  rank {rank}: budget {_size(budget)}, exchange bucket {_size(plan.exchange_bytes)}, "
                     f"peak {_size(held)}{against}")
    return lines


def _size(n: int | None) -> str:
    from orchestrator.planner import format_bytes

    return "-" if n is None else format_bytes(n)


def _limit(plan) -> int | None:
    """What the plan was allowed to fill: the budget times the safety margin."""
    if plan.budget_bytes is None or plan.safety_margin is None:
        return None
    return int(plan.budget_bytes * plan.safety_margin)


def _as_text(policy, target: str, budget: int | None, results: list[dict]) -> str:
    headers = ["trial", "workload", "phase", "params", "grads", "optim", "act/sample", "fixed", "ctx", "alloc@b",
               "peak@b", *(["reserved by"] if target == "cuda" else []), "worst"]
    rows, plans, notes = [], [], []
    for group in _alike(results):
        r, trials = group[0], [g["trial"] for g in group]
        searched = " ".join(f"{k}={value_text(v)}" for k, v in r["config"].items()
                            if k != "workload" and all(g["config"].get(k) == v for g in group))
        config = f"{r['config']['workload']}{' ' + searched if searched else ''}"
        what = (f"trial {r['trial']} ({config})" if len(group) == 1 else
                f"trials {trial_list(trials)} ({f'{len(group)} in all; ' if len(group) > 8 else ''}{config})")
        if "error" in r:
            plans.append(f"{what}: could not be estimated: {r['error']}")
            continue
        plan, profile = r["plan"], r["profile"]
        limit = None if plan.refusal else _limit(plan)
        for phase in profile.phases:
            b = plan.micro_batch if phase.kind == "train" else plan.eval_batch
            peak = phase.reserved_at(b, micro_batch=plan.micro_batch, limit=limit)
            if phase.sequence is not None:
                allocated = phase.replay(b, plan.micro_batch, limit).peak_allocated
            else:
                allocated = phase.allocated_at(b)
            # on CUDA, whether the allocator model gave reserved memory or a flat factor did
            reserved_by = "allocator model" if phase.sequence is not None else f"x {1 + phase.fragmentation:.3g}"
            worst = "yes" if phase.name == plan.predicted_phase else ""  # the phase the plan was made for
            rows.append([
                trial_list(trials, shown=3) + (f" ({len(trials)})" if len(trials) > 3 else ""), r["config"]["workload"], phase.name, _size(phase.params), _size(phase.grads),
                _size(phase.optimizer), _size(phase.activations_per_sample), _size(phase.buffers + phase.fixed_other),
                _size(phase.context + phase.workspace), _size(allocated), f"{_size(peak)}@{b}",
                *([reserved_by] if target == "cuda" else []), worst,
            ])
        gap = profile.allocator_model_gap()
        notes.extend([gap] if gap and gap not in notes and gap not in plan.note else [])
        fill = ""
        if limit is not None and plan.predicted_peak_bytes is not None:
            fill = (f"; peak {_size(plan.predicted_peak_bytes)} of {_size(limit)} "
                    f"({_size(plan.budget_bytes)} x safety margin {plan.safety_margin:g})")
        plans.append(f"{what}: {plan.describe()}"
                     + (f" [{profile.settings.describe()} profile]" if plan.refusal else "")
                     + fill + (f"; {plan.note}" if plan.note else ""))
        plans.extend(_rank_lines(plan))
        if r.get("host") is not None:
            plans.append(f"  {r['host'].describe()}")
        notes.extend(n for n in profile.notes if n not in notes)
    budget_text = "unbounded" if budget is None else _size(budget)
    margin = f" x safety margin {policy.safety_margin:g}" if budget is not None else ""
    refused = sum(1 for r in results if "plan" in r and r["plan"].refusal)
    errors = sum(1 for r in results if "error" in r)
    host_refused = sum(1 for r in results if r.get("host") is not None and r["host"].refusal)
    lines = [
        f"target {target}, budget {budget_text}{margin}, estimator {policy.estimator}; alloc@b and peak@b are "
        "allocated and reserved memory at the planned batch (micro-batch for train, eval batch for eval)",
        "",
        *([format_table(headers, rows), ""] if rows else []),  # no header over nothing: every estimate failed
        *plans,
        "",
        f"{len(results)} trials, {refused} refused" + (" for device memory" if host_refused else "")
        + (f", {host_refused} for host memory" if host_refused else "")
        + (f", {errors} could not be estimated" if errors else ""),
        *(f"note: {n}" for n in notes),
    ]
    return "\n".join(lines)


def trial_list(trials: list[int], shown: int = 8) -> str:
    """``0, 1, 8, ...``: the first ``shown`` trial numbers."""
    return ", ".join(map(str, trials[:shown])) + (", ..." if len(trials) > shown else "")


def _alike(results: list[dict]) -> list[list[dict]]:
    """The trials whose rows and plan lines would be the same, in trial order: one memory
    signature, one plan (or error) and one host-memory line. A random search of hundreds of
    learning rates is then a few groups, not hundreds of identical rows."""
    groups: dict[tuple, list[dict]] = {}
    for r in results:
        if "error" in r:
            key = (r["signature"], r["error"])
        else:
            key = (r["signature"], r["plan"].describe(), r["plan"].note, r["host"].describe() if r.get("host") else None)
        groups.setdefault(key, []).append(r)
    return list(groups.values())


def _as_json(spec, policy, target: str, budget: int | None, results: list[dict]) -> dict:
    return {
        "experiment": spec.experiment,
        "target": target,
        "budget_bytes": budget,
        "safety_margin": policy.safety_margin,
        "estimator": policy.estimator,
        "effective_batch": spec.effective_batch_size,
        "trials": [
            {"trial": r["trial"], "config": r["config"], "error": r["error"]} if "error" in r else {
                "trial": r["trial"],
                "config": r["config"],
                "plan": r["plan"].to_dict(),
                "limit_bytes": _limit(r["plan"]),
                "worst_phase": r["plan"].predicted_phase,
                "profile": r["profile"].to_dict() if r["profile"] else None,
                "host_memory": _host_json(r.get("host")),
            }
            for r in results
        ],
    }


class _HostMemory:
    """Each trial's host memory against this machine's, for the trials it would run at once
    (``orchestrator.host_memory``); the data measured once per memory signature and micro-batch."""

    def __init__(self, spec, target, available: int | None = None, trials: int | None = None):
        from orchestrator.available_memory import available_host_memory
        from orchestrator.capacity import local_node
        from orchestrator.node_memory import pins_host_memory, processes_at_once

        self.spec = spec
        self.available = available if available is not None else available_host_memory()
        self.at_once = processes_at_once(spec, local_node(None, None), trials)
        self.pinned = pins_host_memory(spec, target.device)
        self.footprints = {}

    def plan(self, workload, signature, micro_batch: int):
        from orchestrator.host_memory import plan_host_memory
        from trainables.footprint import data_footprint

        if self.available is None:
            return None
        key = (signature, micro_batch)
        if key not in self.footprints:
            try:
                self.footprints[key] = data_footprint(workload, micro_batch)
            except Exception:  # noqa: BLE001 - a model that does not build on ``meta``, say: `run:`'s line says why
                self.footprints[key] = None
        if self.footprints[key] is None:
            return None
        return plan_host_memory(self.footprints[key], self.spec.data, pinned=self.pinned, trials_at_once=self.at_once,
                                available_bytes=self.available)

    def for_run(self, target):
        """The plan ``run`` would apply on this machine (``node_memory.sweep_host_plan``)."""
        from orchestrator.capacity import local_node
        from orchestrator.node_memory import local_nodes, sweep_host_plan
        from orchestrator.table import value_text

        swept = sweep_host_plan(self.spec, local_nodes(local_node(None, None), self.available), target.device)
        if swept is None and self.available is not None:  # a trial wants a GPU this machine lacks, say
            resources = self.spec.resources
            return (f"not planned here: this machine holds no trial (resources: cpu {value_text(resources.cpu)}, gpu {value_text(resources.gpu)}); "
                    "`run` plans it for the nodes the sweep runs on")
        return swept


def _run_host_text(swept) -> str:
    """What ``run`` does with the data settings (``orchestrator.node_memory``)."""
    if isinstance(swept, str):
        return f"run: host memory {swept}"
    _, plan = swept
    return (f"run (every trial as the largest, its batches at the whole rank batch): {plan.describe()}"
            + ("" if plan.changes or plan.refusal else "; data settings kept"))


def _run_host_json(swept) -> dict | None:
    if swept is None or isinstance(swept, str):
        return None if swept is None else {"error": swept}
    return _host_json(swept[1])


def _host_json(host) -> dict | None:
    if host is None:
        return None
    return {"trial_bytes": host.trial_bytes, "parts": host.parts, "trials_at_once": host.trials_at_once,
            "available_bytes": host.available_bytes, "num_workers": host.data.num_workers,
            "prefetch_factor": host.data.prefetch_factor, "reduced": host.reduced, "refusal": host.refusal}
