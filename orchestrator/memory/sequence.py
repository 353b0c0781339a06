"""What the CUDA caching allocator is asked for during a trial, at any batch size, from a few traces.

Every op of a step runs at any batch size ``b`` in the same order, and every tensor's bytes are
affine in ``b`` (batch-major activations, fixed states: ``memory.fit``). So the allocator's log
of a step (``StorageTracker.record``: each allocation's requested bytes, each free) logged at two
batch sizes is known at every ``b``: the same allocations and frees in the same order, each
allocation ``intercept + slope * b`` bytes. A log at a third batch size checks it.

A trial's sequence is what its process meets, in order (:class:`TrialSequence`):

* the model's states as ``Module.to`` allocates them (children first, parameters before buffers);
* the first train step, which creates the optimizer's state inside its optimizer step, carving
  it out of the blocks the step's activations left cached: the reason the default allocator
  reserves 10-40 % more than it allocates;
* a second train step: what every later step meets (the cache is in its steady state by then);
* for an eval phase, an eval step after them: evaluation runs in the same process as training,
  so it starts from the cache training left.

Each train step is two micro-batches of ``b`` (gradient accumulation, as ``trace`` runs it).
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from functools import lru_cache

from torch import nn

from orchestrator.allocator_conf import AllocatorConfig
from orchestrator.memory.allocator import CachingAllocator, Replay


def states_in_creation_order(model: nn.Module) -> list:
    """Parameters and buffers in the order ``Module.to`` allocates them: each module's children
    first, then its own parameters, then its buffers (a shared tensor is allocated where first met)."""
    states = []
    for child in model.children():
        states += states_in_creation_order(child)
    return states + list(model.parameters(recurse=False)) + list(model.buffers(recurse=False))


@dataclass(frozen=True)
class AffineLog:
    """An allocation log at any batch size: codes ``>= 0`` allocate ``shapes[code]`` bytes
    (``intercept + slope * b``), codes ``< 0`` free allocation ``~code`` of the trial's log."""

    codes: bytes = field(repr=False)  # int32 codes, machine order (a compact pickle)
    shapes: tuple[tuple[int, int], ...] = field(repr=False)
    allocations: int = 0

    def events(self, batch: int) -> list[int]:
        """The log at batch size ``batch``, as ``allocator.replay`` takes it."""
        sizes = [intercept + slope * batch for intercept, slope in self.shapes]
        codes = array("i")
        codes.frombytes(self.codes)
        return [sizes[code] if code >= 0 else code for code in codes]

    def __len__(self) -> int:
        return len(self.codes) // array("i").itemsize


def fit_log(log_1: list[int], log_2: list[int], b1: int, b2: int) -> AffineLog | None:
    """The log at every batch size from the same steps logged at ``b1`` and ``b2``, or None where
    they differ in anything but affine sizes (ops that change with ``b``, a size not affine in it)."""
    if len(log_1) != len(log_2):
        return None
    shapes: dict[tuple[int, int], int] = {}
    codes = array("i")
    allocations = 0
    for e1, e2 in zip(log_1, log_2):
        if e1 < 0 or e2 < 0:
            if e1 != e2:
                return None
            codes.append(e1)
            continue
        slope, rest = divmod(e2 - e1, b2 - b1)
        intercept = e1 - slope * b1
        if rest or slope < 0 or intercept + slope <= 0:
            return None
        codes.append(shapes.setdefault((intercept, slope), len(shapes)))
        allocations += 1
    return AffineLog(codes.tobytes(), tuple(shapes), allocations)


def canonical(log: list[int], cut: int = 0) -> list[int]:
    """``log`` with every run of consecutive frees in one order: the oldest allocation first.

    Frees with no allocation between them happen in an order that can change from run to run
    and from one probe to the next: leaving ``torch.autocast`` frees its weight-cast cache in the
    order of a hash table keyed by the weights' addresses, and the thread's first fill of that
    table (the first probe's first micro-batch) grows it on the way, which can order its entries
    differently from every later fill. Such a run leaves the allocator (and the real one) in the
    same state in any order (freed blocks merge with their free neighbours whatever the order),
    so sorting it loses nothing and makes logs of the same steps equal. ``cut``: a position no
    run is sorted across (where the log is split later: the measured step's start).
    """
    out: list[int] = []
    run: list[int] = []
    for i, event in enumerate(log):
        if event >= 0 or i == cut:
            out += sorted(run, reverse=True)  # ~k descending: k ascending
            run = []
        if event >= 0:
            out.append(event)
        else:
            run.append(event)
    return out + sorted(run, reverse=True)


def without_prefix(events: list[int], start: int, allocations: int) -> list[int]:
    """``events[start:]`` as a log that began there, ``allocations`` allocations in: the frees of
    earlier allocations dropped, the others renumbered (what a log started at ``start`` holds)."""
    return [e if e > 0 else ~(~e - allocations) for e in events[start:] if e > 0 or ~e >= allocations]


@dataclass(frozen=True)
class TrialSequence:
    """A phase's allocation log: the states and train steps at the micro-batch, then (eval phases)
    an eval step at the eval batch."""

    train: AffineLog
    eval: AffineLog | None = None

    def replay(self, config: AllocatorConfig, micro_batch: int, eval_batch: int | None = None,
               capacity: int | None = None) -> Replay:
        """The allocator's peaks over the phase's own step(s) (an eval phase: its eval step, after
        training's), and where it runs out of ``capacity``, if it does."""
        return _replay(self, config, micro_batch, eval_batch if self.eval is not None else None, capacity)

    def describe(self) -> dict:
        return {"allocations": self.train.allocations + (self.eval.allocations if self.eval else 0),
                "events": len(self.train) + (len(self.eval) if self.eval else 0)}


def replay_trial(sequence: TrialSequence, config: AllocatorConfig, micro_batch: int, eval_batch: int | None = None,
                 capacity: int | None = None) -> Replay:
    """:meth:`TrialSequence.replay` without its cache (the planner asks for the same replays often)."""
    allocator = CachingAllocator(config, capacity)
    oom = allocator.run(sequence.train.events(micro_batch))
    if sequence.eval is not None and oom is None:
        allocator.reset_peaks()
        oom = allocator.run(sequence.eval.events(eval_batch if eval_batch is not None else micro_batch))
    return Replay(allocator.peak_allocated, allocator.peak_reserved, oom, allocator.retries)


_replay = lru_cache(maxsize=512)(replay_trial)
