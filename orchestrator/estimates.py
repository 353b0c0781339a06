"""One memory estimate per memory signature, made before the trials start.

Trials whose workload, memory-relevant hyper-parameters, estimator, precision policy, allocator
configuration and target are the same have the same memory: a sweep of one model over 8
learning rates and 2 widths needs two estimates, not sixteen. The driver makes them before the
Tuner starts (while Ray starts) and hands them to the trials, so a trial never spends its start-up
on an estimate it could have been given; ``orchestrator plan`` shares the same code.

Several signatures are estimated in parallel processes where there are cores to spare (the ones
this process may use: ``orchestrator.cores``, its affinity and CPU quota): a spawned
process spends some 5 s of a core importing torch and making its first trace before its first
estimate, while the driver has torch imported already. So one core stays the driver's (it is
starting Ray meanwhile), and on two cores the driver's own thread makes every estimate: the demo
sweep's four took 4-5 s there against 9-13 s in two processes, with or without Ray starting beside.
A trace that runs on a GPU is always a spawned process's: it makes its process a CUDA context,
which in the driver would hold GPU memory for the whole sweep.

A trial re-estimates on its worker only where the driver could not stand in for it: its device
is not the one the driver planned for (a CPU-only worker in a GPU sweep), the estimator
probes the worker's device (``measured``; ``probes_device`` in its registration), or the driver's trace fell back to ``static``
(the worker can fall back to ``measured`` instead).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import threading
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

from orchestrator import spawned
from orchestrator.config import MemoryPolicy
from orchestrator.cores import usable_cores
from orchestrator.estimator_registry import NO_ESTIMATE, registered
from orchestrator.memory import MemoryProfile, Settings
from orchestrator.memory.cache import ProfileCache
from orchestrator.memory.fake import trace_device
from orchestrator.memory.phases import TrainingLength
from orchestrator.table import value_text


def memory_signature(config: dict[str, Any], policy: MemoryPolicy, target: str) -> str:
    """What a trial's memory depends on, as a string: equal strings, equal memory.

    The workload's hyper-parameters count except those it declares memory-neutral
    (``Workload.memory_neutral``: ``lr`` and ``seed`` by default). The allocator configuration
    is the one the trial's process runs with (an exported ``PYTORCH_CUDA_ALLOC_CONF`` wins over
    ``memory.allocator_conf``): the trace replays its allocations through a model of it.
    """
    from orchestrator.allocator_conf import effective_allocator_conf
    from trainables.workload import resolve_workload

    cls = resolve_workload(config["workload"])
    names = set(cls.parameter_names()) - set(cls.memory_neutral)
    return json.dumps({
        "workload": config["workload"],
        "params": {k: v for k, v in sorted(config.items()) if k in names},
        "estimator": policy.estimator, "precision": policy.precision, "lower_precision": policy.lower_precision,
        "checkpointing": policy.allow_activation_checkpointing, "fragmentation": policy.fragmentation,
        "allocator_conf": effective_allocator_conf(policy.allocator_conf), "target": target,
    }, sort_keys=True, default=str)


@dataclass
class Estimates:
    """The driver's profiles by memory signature, for one target; what trials are handed."""

    target: str
    policy: MemoryPolicy
    by_signature: dict[str, dict[Settings, MemoryProfile]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)  # signature -> why it could not be estimated
    #: signature -> why the configured estimator could not run here (``trace impossible (...)``):
    #: its fallback is not handed to the trials, which estimate on their own device instead.
    fell_back: dict[str, str] = field(default_factory=dict)

    def known(self, config: dict[str, Any], target: str) -> dict[Settings, MemoryProfile]:
        """The profiles for a trial of ``config`` on a device of kind ``target`` (empty if none fit)."""
        if target != self.target:
            return {}
        return self.by_signature.get(memory_signature(config, self.policy, target), {})


def estimate_trials(
    configs: list[dict[str, Any]], policy: MemoryPolicy, target: str, budget: int | None,
    effective_batch: int, *, processes: int | None = None,
    on_done: Callable[[str, list[int], float], None] | None = None, stop: threading.Event | None = None,
    length: TrainingLength | None = None,
) -> Estimates:
    """Estimate each distinct memory signature of ``configs`` once, in up to ``processes``
    parallel processes (by default one fewer than the usable cores; one means this thread, except
    where the trace runs on a GPU: then one spawned process).

    Each signature is planned as its trials will be (``budget`` is the driver's best knowledge:
    None where only the worker can tell), so the profiles the plan needs are the ones made.
    ``on_done(signature, trial indices, seconds)`` reports progress. A signature whose estimate
    raised is recorded in ``errors`` (the worker will meet the same error and report it).
    Once ``stop`` is set (the command was interrupted), no further signature is estimated.
    ``length``: how far the trials train, which stages of a module-activation schedule they reach
    (``memory.cache.ProfileCache``).
    """
    estimates = Estimates(target, policy)
    if policy.estimator == NO_ESTIMATE or registered(policy.estimator).probes_device:
        return estimates  # nothing to estimate, or only the worker's device can
    groups: dict[str, list[int]] = {}
    for index, config in enumerate(configs):
        groups.setdefault(memory_signature(config, policy, target), []).append(index)
    jobs = [(configs[indices[0]], policy, target, budget, effective_batch, length) for indices in groups.values()]
    workers = min(len(jobs), processes or usable_cores() - 1)
    if workers <= 1 and trace_device(target) == "cpu":
        results = map(_estimate_one, jobs)
        pool = None
    else:
        # spawn, not fork: the driver may run Ray's threads; the children get our sys.path.
        # A trace on a GPU makes its process a CUDA context: never the driver's, which would
        # hold GPU memory the trials plan with for the whole sweep.
        pool = ProcessPoolExecutor(max(workers, 1), mp_context=multiprocessing.get_context("spawn"),
                                   initializer=spawned.start, initargs=(os.getpid(),))
        results = pool.map(_estimate_one, jobs)
    try:
        for (signature, indices), (profiles, error, fallback, seconds) in zip(groups.items(), results):
            if error is None:
                estimates.by_signature[signature] = profiles
            else:
                estimates.errors[signature] = error
            if fallback:
                estimates.fell_back[signature] = fallback
            if on_done is not None:
                on_done(signature, indices, seconds)
            if stop is not None and stop.is_set():
                break
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)
    return estimates


def _estimate_one(job) -> tuple[dict[Settings, MemoryProfile], str | None, str | None, float]:
    """In a worker process: plan one signature's first trial; its profiles, or the error's line;
    and why the configured estimator fell back, where it did."""
    import time

    from orchestrator.memory.failure import summary
    from orchestrator.planner import make_plan
    from trainables.workload import build_workload, install_advice

    config, policy, target, budget, effective_batch, length = job
    started = time.perf_counter()
    try:
        cache = ProfileCache(build_workload(config), policy, target, length=length)
        make_plan(cache.workload, policy, effective_batch, budget, target=target, profiles=cache)
    except Exception as exc:  # noqa: BLE001 - a user's model failing: reported (op and line), the sweep decides
        return {}, summary(exc) + install_advice(exc), None, time.perf_counter() - started
    fallback = next((p.fallback for p in cache.cache.values() if p is not None and p.fallback), None)
    return cache.shareable(), None, fallback, time.perf_counter() - started


def describe_signature(signature: str, keys) -> str:
    """'mlp width=16' from a signature, showing the parameters in ``keys`` (those a sweep searches)."""
    data = json.loads(signature)
    params = " ".join(f"{k}={value_text(v)}" for k, v in data["params"].items() if k in keys)
    return f"{data['workload']} {params}".strip()
