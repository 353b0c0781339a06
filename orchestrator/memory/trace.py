"""The ``trace`` estimator: run the real train and eval steps on fake tensors and count bytes.

The workload's real ``train_step``/``eval_step`` (``trainables.step``: what the loop runs)
execute on fake tensors (``memory.fake``) while a ``StorageTracker`` records the bytes alive
after every op. Per stage of the activation schedule:

* a warm-up train step, so the optimizer's state exists as it does from step 2 on;
* at each probe batch size ``b``, a train step of two micro-batches of ``b`` (the second runs
  with the first's gradients alive, as under gradient accumulation) and an eval step of ``b``.

The first two probes give every op's bytes as a line in ``b`` and so the step's peak at every
batch size (``memory.fit``); the third checks that prediction. When it disagrees (a tensor
whose size is not affine in ``b``, such as a b x b similarity matrix, or ops that change with
``b``), the profile follows the three probes instead and says so. Fake tensors cost the same at
any batch size, so the probes can be far apart.

For a CUDA target the trace also logs what the caching allocator is asked for, in order
(``memory.sequence``): at the first two probes the train phase starts as a fresh process does,
with the model's states and a first step that creates the optimizer's state, and the log at
every batch size comes from those two; the third probe's log checks it. Each phase's profile
then replays its log through the allocator model (``memory.allocator``) for reserved memory;
where the log is not affine in ``b`` it falls back to the flat ``fragmentation`` and says so.

A workload the trace cannot run falls back to ``measured`` (where the worker's device is there)
or ``static``, with a note saying why (:func:`trace_or_fallback`, the registered estimator).
"""

from __future__ import annotations

import contextlib
import gc
from dataclasses import replace

from orchestrator.allocator_conf import parse_alloc_conf
from orchestrator.allocator_conf import AllocatorConfig
from orchestrator.memory.failure import fails_on_any_tensors, makes_nested_tensors, summary
from orchestrator.memory.fake import FakeSetup, Untraceable, describe, fake_setup, running
from orchestrator.memory.fit import envelope_points, event_lines, line_through
from orchestrator.memory.measured import measured_profile
from orchestrator.memory.phases import Phase, enter_phase, phases_of
from orchestrator.memory.profile import (
    FALLBACK_NOTE, LOGS_DIFFER, NOT_MODELLED, EstimateRequest, MemoryProfile, PhaseProfile, Settings, overheads,
)
from orchestrator.memory.sequence import TrialSequence, canonical, fit_log, states_in_creation_order, without_prefix
from orchestrator.memory.static import static_profile
from trainables.carry import Carry
from trainables.step import eval_step, train_step
from trainables.workload import Workload, check_metric_names

PROBE_BATCHES = (2, 16, 128)
MICRO_BATCHES_PER_STEP = 2
#: How far the third probe may be from the envelope's prediction, besides the allocator's
#: rounding (up to one block per live tensor), which makes sizes not exactly affine in ``b``.
TOLERANCE = 1e-3
NESTED_FAST_PATH_NOTE = (
    "torch's fused transformer path (eval with a padding mask: nested tensors) cannot run on fake tensors; "
    "traced the layers' own path, which also counts the padded positions (the real CPU eval may use less)"
)


def trace_or_fallback(workload: Workload, request: EstimateRequest) -> MemoryProfile:
    """The ``trace`` estimator: :func:`trace_profile`, or where the workload cannot be traced the
    ``measured`` profile (with the worker's device) or the ``static`` one, noting why. A model
    that cannot run on fake tensors is still planned; it never raises for that."""
    allocator = parse_alloc_conf(request.allocator_conf)
    try:
        return trace_profile(workload, request.settings, target=request.target, fragmentation=request.fragmentation,
                             allocator=allocator)
    except Untraceable as exc:
        reason = str(exc)
    except Exception as exc:  # a model fake tensors trip over in some other way: still plan, say why
        if fails_on_any_tensors(exc):
            raise
        reason = summary(exc)
    fallback, profile = (
        ("measured", measured_profile(workload, request)) if request.device is not None
        else ("static", static_profile(workload, request))
    )
    return replace(profile, notes=(f"{FALLBACK_NOTE} ({reason}); fell back to {fallback}", *profile.notes))


def trace_profile(
    workload: Workload,
    settings: Settings,
    *,
    target: str,
    fragmentation: float,
    allocator: AllocatorConfig | None = None,
    probes: tuple[int, int, int] = PROBE_BATCHES,
    trace_on: str | None = None,
) -> MemoryProfile:
    """Trace every phase of ``workload`` and fit one profile per phase.

    ``allocator`` is the CUDA caching allocator's configuration for a CUDA target (default:
    PyTorch's defaults); ``trace_on`` forces the fake device (see ``memory.fake.fake_setup``).
    Raises ``memory.fake.Untraceable`` when the workload cannot run on fake tensors.
    """
    phases = phases_of(workload)
    logged = target == "cuda"
    setup = fake_setup(workload, target, trace_on)
    try:
        with running(setup) as emulation_notes:
            runs, logs = _trace(setup, workload, settings, phases, probes, logged)
    except Exception as exc:
        if not makes_nested_tensors(exc):
            raise
        # torch's fused transformer path (eval, a padding mask) packs the batch into nested
        # tensors, which fake tensors cannot hold: trace the layers' Python path instead.
        setup = fake_setup(workload, target, trace_on)
        with running(setup, fast_path=False) as emulation_notes:
            runs, logs = _trace(setup, workload, settings, phases, probes, logged)
        emulation_notes.append(NESTED_FAST_PATH_NOTE)
    notes = [f"traced on {describe(setup)} at batch sizes {', '.join(map(str, probes))}", *setup.notes, *emulation_notes]
    if settings.precision == "fp16" and setup.device.type == "cpu":
        notes.append("fp16 loss scaling not traced (GradScaler needs CUDA); it adds a few scalars")
    extra = overheads(target, fragmentation)
    sequences = _sequences(phases, logs, probes) if logged else {}
    allocator = allocator or AllocatorConfig()
    if logged and not allocator.modelled:
        notes.append(f"backend:{allocator.backend} {NOT_MODELLED}: reserved = allocated x (1 + {fragmentation:g})")
    profiles = []
    for phase in phases:
        modelled = {}
        if logged and allocator.modelled and sequences[phase.name] is not None:
            modelled = {"sequence": sequences[phase.name], "allocator": allocator, "fragmentation": 0.0}
        elif logged and allocator.modelled:
            notes.append(f"{phase.name}: {LOGS_DIFFER}; "
                         f"reserved = allocated x (1 + {fragmentation:g}) instead of the allocator model")
        profile, note = _fit(phase, runs[phase.name], probes, {**extra, **modelled})
        profiles.append(profile)
        if note:
            notes.append(note)
    if logged and allocator.modelled and any(p.sequence is not None for p in profiles):
        notes.append(f"reserved memory from a model of the CUDA caching allocator ({allocator.describe()})")
    return MemoryProfile("trace", settings, target, tuple(profiles), tuple(notes), compiled=setup.compiled)


class _Run:
    """One traced step: the bytes alive after each op, and the states at its end."""

    def __init__(self, events: list[int], rounding: int, params: int, grads: int, optimizer: int, buffers: int):
        self.events, self.rounding = events, rounding  # rounding: the most bytes block rounding can add
        self.params, self.grads, self.optimizer, self.buffers = params, grads, optimizer, buffers

    @property
    def peak(self) -> int:
        return max(self.events, default=0)


def _trace(setup: FakeSetup, workload, settings, phases, probes, logged: bool):
    """Every phase at every probe: its runs, and (``logged``) its allocation logs per probe.

    A train phase's log at the first two probes opens with the model's states and a first step
    from an empty optimizer state; at the third it starts at the second step (enough to check
    the other two). An eval phase's log is its eval step alone, with the frees of allocations
    made before it left out (the train log it follows keeps them).
    """
    model, optimizer, device = setup.model, setup.optimizer, setup.device
    tracker = setup.tracker()
    grads = {"bytes": 0}

    def count_grads(optimizer, args, kwargs):
        grads["bytes"] = sum(tracker.size_of(p.grad) for g in optimizer.param_groups for p in g["params"] if p.grad is not None)

    optimizer.register_step_pre_hook(count_grads)

    def train(size: int, micro_batches: int) -> None:
        batches = (setup.batch(size) for _ in range(micro_batches))  # taken one at a time, as in the loop
        carry = Carry.initial(workload, size * micro_batches, device) if workload.stateful else None  # the step's rows
        train_step(workload, model, optimizer, batches, [size] * micro_batches, device, settings.precision, carry=carry)

    runs: dict[str, dict[int, _Run]] = {p.name: {} for p in phases}
    logs: dict[str, dict[int, tuple[list[int], int, int]]] = {p.name: {} for p in phases}
    with tracker, gc_paused(logged):
        for phase in phases:
            enter_phase(workload, model, phase, settings)
            if phase.kind == "train" and not logged:
                train(probes[0], 1)  # warm-up: the optimizer's state exists from step 2 on
            for b in probes:
                if logged and phase.kind == "train" and b in probes[:2]:
                    optimizer.state.clear()  # as in a fresh process: the first step creates it
                    gc.collect()
                    log = tracker.record(states_in_creation_order(model))
                    train(b, MICRO_BATCHES_PER_STEP)
                elif logged:
                    gc.collect()
                    log = tracker.record()
                if logged:
                    second = (len(log), sum(1 for e in log if e > 0))  # where the measured step starts
                tracker.events = []
                tracker.reset_peak()
                grads["bytes"] = 0
                if phase.kind == "train":
                    train(b, MICRO_BATCHES_PER_STEP)
                else:
                    sums = eval_step(workload, model, setup.batch(b, "eval"), b, device, settings.precision)
                    check_metric_names(workload, sums, b)
                    del sums
                runs[phase.name][b] = _Run(
                    tracker.events, (tracker.round_to - 1) * tracker.most_live, setup.params_bytes(tracker), grads["bytes"],
                    setup.optimizer_bytes(tracker), setup.buffers_bytes(tracker),
                )
                tracker.events = None
                if logged:
                    logs[phase.name][b] = (canonical(tracker.stop_recording(), second[0]), *second)
    return runs, logs


@contextlib.contextmanager
def gc_paused(paused: bool = True):
    """No automatic garbage collection while allocation logs are taken: a collection frees what
    reference cycles hold whenever Python's allocation counters say so, which would move frees
    between probes; the logs collect explicitly before each probe instead.

    What exists before the trace (the model, the imported libraries) is frozen out of those
    collections: a full collection walks every object of the process (0.4 s a time with
    transformers imported), while the cycles a probe leaves are all made during the trace.
    """
    enabled = gc.isenabled()
    if paused:
        gc.disable()
        gc.freeze()
    try:
        yield
    finally:
        if paused:
            gc.unfreeze()
        if enabled:
            gc.enable()


def _sequences(phases: list[Phase], logs: dict, probes) -> dict[str, TrialSequence | None]:
    """Each phase's allocation sequence at every batch size, or None where the logs are not affine.

    An eval phase's follows its stage's train phase: the train log, then the eval step's log with
    its allocations numbered after the train log's.
    """
    b1, b2, b3 = probes
    out: dict[str, TrialSequence | None] = {}
    train: TrialSequence | None = None
    for phase in phases:
        (log_1, start, before), (log_2, start_2, before_2), (log_3, _, _) = (logs[phase.name][b] for b in probes)
        if phase.kind == "train":
            fitted = fit_log(log_1, log_2, b1, b2)
            ok = fitted is not None and (start, before) == (start_2, before_2)
            train = TrialSequence(fitted) if ok and without_prefix(fitted.events(b3), start, before) == log_3 else None
            out[phase.name] = train
            continue
        if train is None:
            out[phase.name] = None
            continue
        offset = train.train.allocations
        shifted = [[e if e > 0 else ~(~e + offset) for e in log] for log in (log_1, log_2, log_3)]
        fitted = fit_log(shifted[0], shifted[1], b1, b2)
        ok = fitted is not None and fitted.events(b3) == shifted[2]
        out[phase.name] = TrialSequence(train.train, fitted) if ok else None
    return out


def _fit(phase: Phase, runs: dict[int, _Run], probes, extra: dict) -> tuple[PhaseProfile, str | None]:
    """The phase's profile from its runs, and a note when the envelope did not hold."""
    b1, b2, b3 = probes
    note = None
    points = None
    if len(runs[b1].events) == len(runs[b2].events) == len(runs[b3].events):
        points = envelope_points(event_lines(runs[b1].events, runs[b2].events, b1, b2))
        predicted = PhaseProfile(phase.name, phase.kind, 0, 0, 0, 0, 0, 0, points=points).allocated_at(b3)
        if abs(predicted - runs[b3].peak) > TOLERANCE * runs[b3].peak + runs[b3].rounding:
            points = None
    if points is None:
        points = tuple((b, runs[b].peak) for b in probes)
        note = (
            f"{phase.name}: memory is not a fixed part plus a per-sample part (a tensor not linear in the batch "
            f"size, or ops that change with it); the profile follows the probes {probes} and may under-estimate "
            f"beyond b={b3}"
        )
    slope, intercept = line_through(points)
    last = runs[b3]
    return PhaseProfile.from_line(
        phase, params=last.params, grads=last.grads, optimizer=last.optimizer, buffers=last.buffers,
        slope=slope, intercept=intercept, points=points, **extra,
    ), note
