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
"""

from __future__ import annotations

from orchestrator.memory.fake import FakeSetup, describe, fake_setup, running
from orchestrator.memory.fit import envelope_points, event_lines, line_through
from orchestrator.memory.phases import Phase, enter_phase, phases_of
from orchestrator.memory.profile import MemoryProfile, PhaseProfile, Settings, overheads
from trainables.step import eval_step, train_step
from trainables.workload import Workload

PROBE_BATCHES = (2, 16, 128)
MICRO_BATCHES_PER_STEP = 2
#: How far the third probe may be from the envelope's prediction, besides the allocator's
#: rounding (up to one block per live tensor), which makes sizes not exactly affine in ``b``.
TOLERANCE = 1e-3


def trace_profile(
    workload: Workload,
    settings: Settings,
    *,
    target: str,
    fragmentation: float,
    probes: tuple[int, int, int] = PROBE_BATCHES,
    trace_on: str | None = None,
) -> MemoryProfile:
    """Trace every phase of ``workload`` and fit one profile per phase.

    ``trace_on`` forces the fake device (see ``memory.fake.fake_setup``). Raises
    ``memory.fake.Untraceable`` when the workload cannot run on fake tensors.
    """
    setup = fake_setup(workload, target, trace_on)
    phases = phases_of(workload)
    with running(setup) as emulation_notes:
        runs = _trace(setup, workload, settings, phases, probes)
    notes = [f"traced on {describe(setup)} at batch sizes {', '.join(map(str, probes))}", *emulation_notes]
    if settings.precision == "fp16" and setup.device.type == "cpu":
        notes.append("fp16 loss scaling not traced (GradScaler needs CUDA); it adds a few scalars")
    extra = overheads(target, fragmentation)
    profiles = []
    for phase in phases:
        profile, note = _fit(phase, runs[phase.name], probes, extra)
        profiles.append(profile)
        if note:
            notes.append(note)
    return MemoryProfile("trace", settings, target, tuple(profiles), tuple(notes))


class _Run:
    """One traced step: the bytes alive after each op, and the states at its end."""

    def __init__(self, events: list[int], rounding: int, params: int, grads: int, optimizer: int, buffers: int):
        self.events, self.rounding = events, rounding  # rounding: the most bytes block rounding can add
        self.params, self.grads, self.optimizer, self.buffers = params, grads, optimizer, buffers

    @property
    def peak(self) -> int:
        return max(self.events, default=0)


def _trace(setup: FakeSetup, workload, settings, phases, probes) -> dict[str, dict[int, _Run]]:
    model, optimizer, device = setup.model, setup.optimizer, setup.device
    tracker = setup.tracker()
    grads = {"bytes": 0}

    def count_grads(optimizer, args, kwargs):
        grads["bytes"] = sum(tracker.size_of(p.grad) for g in optimizer.param_groups for p in g["params"] if p.grad is not None)

    optimizer.register_step_pre_hook(count_grads)

    def train(size: int, micro_batches: int) -> None:
        batches = (setup.batch(size) for _ in range(micro_batches))  # taken one at a time, as in the loop
        train_step(workload, model, optimizer, batches, [size] * micro_batches, device, settings.precision)

    runs: dict[str, dict[int, _Run]] = {p.name: {} for p in phases}
    with tracker:
        for phase in phases:
            enter_phase(workload, model, phase, settings)
            if phase.kind == "train":
                train(probes[0], 1)
            for b in probes:
                tracker.events = []
                tracker.reset_peak()
                grads["bytes"] = 0
                if phase.kind == "train":
                    train(b, MICRO_BATCHES_PER_STEP)
                else:
                    eval_step(workload, model, setup.batch(b), b, device, settings.precision)
                runs[phase.name][b] = _Run(
                    tracker.events, (tracker.round_to - 1) * tracker.most_live, setup.params_bytes(tracker), grads["bytes"],
                    setup.optimizer_bytes(tracker), setup.buffers_bytes(tracker),
                )
                tracker.events = None
    return runs


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
