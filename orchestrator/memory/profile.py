"""What an estimator produces: bytes needed at micro-batch ``b`` in each phase of a trial.

A trial's memory is the worst over its phases (the train step, the eval step with its own batch
size, and the train/eval steps of each stage of a staggered module-activation schedule), so a
profile is a tuple of :class:`PhaseProfile` and the planner asks for the worst of them.

Each phase is a model of *allocated* (tensor) bytes as a function of the batch size, carrying
the breakdown a person needs to see what dominates: ``states + fixed_other + per_sample * b``,
or, where the estimator observed that memory is not linear in ``b``, a piecewise-linear curve
through the observed points. What a plan must budget is *reserved* memory: what the CUDA
caching allocator holds, the library workspaces the tensors never show, and the CUDA context.
Those are zero for the ``cpu`` and ``emulated`` targets, which count tensor bytes only (see
``orchestrator.device``). Where the estimator logged the order of allocations (``trace`` on a
CUDA target: ``memory.sequence``), the allocator's reserved bytes come from replaying that log
through a model of the allocator (``memory.allocator``), which also says whether a batch size
fits a budget when the allocator has to free its cache on the way; elsewhere they are allocated
x (1 + ``fragmentation``), the flat factor ``static`` assumes and ``measured`` measures.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from orchestrator.allocator_conf import DEFAULT_ALLOC_CONF
from orchestrator.allocator_conf import AllocatorConfig
from orchestrator.memory.allocator import Replay
from orchestrator.memory.sequence import TrialSequence

if TYPE_CHECKING:
    from orchestrator.device import Device

TARGETS = ("cuda", "cpu", "emulated")
PRECISIONS = ("fp32", "bf16", "fp16")

#: cuBLAS handles' workspace (~65 MiB measured, FACTS.md) plus an allowance for cuDNN's
#: convolution workspaces: allocations a fake-tensor trace or an analytic count cannot see.
CUDA_WORKSPACE_BYTES = 256 * 2**20
#: cuBLAS's workspaces on an H100 (two handles' 32 MiB): a fake-tensor trace cannot see them.
#: The caching allocator makes them, so a reading on the GPU counts them; the measured estimator
#: and the verification add them to such readings all the same (64 MiB on the safe side; to
#: look at on the first GPU run, bench/RESULTS.md).
CUBLAS_WORKSPACE_BYTES = 64 * 2**20


@dataclass(frozen=True)
class Settings:
    """The knobs the planner can turn that change a trial's memory."""

    precision: str = "fp32"  # "fp32" | "bf16" | "fp16" (autocast; parameters stay fp32)
    activation_checkpointing: bool = False

    def __post_init__(self):
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision: expected one of {', '.join(PRECISIONS)}, got {self.precision!r}")

    def describe(self) -> str:
        return self.precision + (" +ckpt" if self.activation_checkpointing else "")


@dataclass(frozen=True)
class EstimateRequest:
    """What every estimator is asked (``orchestrator/estimator_registry.py``): the profile of a
    trial under ``settings`` on a device of kind ``target``; each reads what it needs."""

    settings: Settings
    target: str  # cuda | cpu | emulated
    fragmentation: float = 0.10  # where reserved memory is not modelled: allocated x (1 + this)
    allocator_conf: str | None = DEFAULT_ALLOC_CONF  # the trial's PYTORCH_CUDA_ALLOC_CONF
    device: Device | None = None  # the worker's own device where there is one (to probe, or fall back to)


class EstimationError(Exception):
    """No estimate could be made (e.g. not even the smallest probe fit on the device)."""


#: The trace's note where a phase's allocation logs at the probe batch sizes did not line up.
LOGS_DIFFER = "the allocations change with the batch size beyond their sizes"
#: The trace's note where the allocator configuration is one the model does not cover.
NOT_MODELLED = "is not modelled"


@dataclass(frozen=True)
class PhaseProfile:
    """Peak memory of one phase as a function of its batch size, with its breakdown.

    ``kind`` says which batch size applies (``train``: the micro-batch, ``eval``: the eval
    batch). The breakdown fields are bytes: ``params``/``grads``/``optimizer``/``buffers`` are
    the model's states; ``activations_per_sample`` is the slope in ``b``; ``fixed_other`` is
    what the peak holds beyond the states at ``b = 0`` (autocast weight copies, workspaces of
    ops, optimizer temporaries; negative when the states never all coexist at the peak, e.g.
    gradients freed by ``zero_grad(set_to_none=True)`` before the next forward).
    ``step_floor`` is the peak of the optimizer step, which holds no activations: allocated
    memory never falls below it whatever the batch size. ``points`` are observed
    ``(batch, allocated bytes)`` pairs; with two or more, :meth:`allocated_at` follows them
    piecewise-linearly (extending the outer segments), so a curve that is not a line (flat at
    tiny batches, say) is not extrapolated from its flat part.

    A train phase is a step of two micro-batches of ``b`` (gradient accumulation: the second
    runs with the first's gradients alive), each taken by the step when it needs it and
    dropped before the next: ``b`` samples of input at a time, on every target.

    ``sequence`` and ``allocator`` (both or neither): the phase's allocation log at any batch
    size and the caching allocator's configuration; with them reserved memory is replayed,
    and ``fragmentation`` is not used. An eval phase's log follows training at the micro-batch,
    so its methods take the micro-batch too (default: the eval batch).
    """

    name: str
    kind: str
    params: int
    grads: int
    optimizer: int
    buffers: int
    activations_per_sample: int
    fixed_other: int
    context: int = 0
    workspace: int = 0
    fragmentation: float = 0.0
    step_floor: int = 0
    points: tuple[tuple[int, int], ...] = ()
    sequence: TrialSequence | None = None
    allocator: AllocatorConfig | None = None

    def __post_init__(self):
        if self.kind not in ("train", "eval"):
            raise ValueError(f"phase kind: expected train or eval, got {self.kind!r}")
        if (self.sequence is None) != (self.allocator is None):
            raise ValueError("a phase's allocation sequence and allocator configuration come together")

    @classmethod
    def from_line(cls, phase, *, params: int, grads: int, optimizer: int, buffers: int,
                  slope: int, intercept: int, **rest) -> PhaseProfile:
        """A phase (anything with ``name`` and ``kind``) whose allocated bytes follow
        ``intercept + slope * b``, split into the model's states and what the peak holds beyond them."""
        return cls(
            name=phase.name, kind=phase.kind, params=params, grads=grads, optimizer=optimizer, buffers=buffers,
            activations_per_sample=slope, fixed_other=intercept - (params + grads + optimizer + buffers), **rest,
        )

    @property
    def states(self) -> int:
        return self.params + self.grads + self.optimizer + self.buffers

    @property
    def fixed(self) -> int:
        """Allocated bytes at ``b = 0`` on the extrapolation line."""
        return self.states + self.fixed_other

    def allocated_at(self, batch: int) -> int:
        """Predicted peak allocated (tensor) bytes at batch size ``batch``."""
        if len(self.points) >= 2:
            # the segment that contains ``batch``; the outer segments extend beyond the points
            for (b0, m0), (b1, m1) in zip(self.points, self.points[1:]):
                if batch <= b1:
                    break
            curve = m0 + math.ceil((m1 - m0) * (batch - b0) / (b1 - b0))
        else:
            curve = self.fixed + self.activations_per_sample * batch
        return max(curve, self.step_floor, 0)

    @property
    def overhead(self) -> int:
        """Bytes outside the caching allocator: library workspaces and the CUDA context."""
        return self.workspace + self.context

    def replay(self, batch: int, micro_batch: int | None = None, limit: int | None = None) -> Replay:
        """The allocator model's replay of this phase at ``batch``; ``limit``: what the trial may
        use in total (the allocator gets what the workspaces and context leave of it)."""
        capacity = None if limit is None else max(limit - self.overhead, 0)
        if self.kind == "train":
            return self.sequence.replay(self.allocator, batch, capacity=capacity)
        return self.sequence.replay(self.allocator, micro_batch or batch, batch, capacity)

    def reserved_at(self, batch: int, *, micro_batch: int | None = None, limit: int | None = None) -> int:
        """What a plan budgets: reserved memory, workspaces and the CUDA context.

        Under ``limit`` the allocator frees its cache rather than pass it, so a modelled phase's
        reserved memory is what it holds at its peak when it must fit there.
        """
        if self.sequence is not None:
            return self.replay(batch, micro_batch, limit).peak_reserved + self.overhead
        allocated = self.allocated_at(batch)
        return allocated + self.fragmentation_bytes(allocated) + self.overhead

    def fragmentation_bytes(self, allocated: int) -> int:
        """What the flat ``fragmentation`` factor adds to ``allocated`` where the allocator is not
        modelled (0 where it is: the replay's reserved memory holds it)."""
        if self.sequence is not None:
            return 0
        return math.ceil(round(allocated * self.fragmentation, 3))  # no float noise in whole bytes

    def fits(self, batch: int, limit: int, *, micro_batch: int | None = None) -> bool:
        """Whether the phase runs at ``batch`` in ``limit`` bytes without running out of memory."""
        if self.sequence is not None:
            return limit > self.overhead and self.replay(batch, micro_batch, limit).fits
        return self.reserved_at(batch) <= limit

    def to_dict(self) -> dict:
        """A JSON summary (the allocation log is described, not included)."""
        d = {f: getattr(self, f) for f in self.__dataclass_fields__ if f not in ("sequence", "allocator")}
        d["points"] = [list(p) for p in self.points]
        d["allocator"] = self.allocator.describe() if self.allocator is not None else None
        d["sequence"] = self.sequence.describe() if self.sequence is not None else None
        return d


#: How the note of a profile made by a fallback estimator begins.
FALLBACK_NOTE = "trace impossible"


@dataclass(frozen=True)
class MemoryProfile:
    """Every phase of one trial configuration, as one estimator saw it for one target.

    ``compiled``: the workload's model is ``torch.compile``d and the profile is its eager
    modules' (``contract.COMPILED_MODEL_NOTE``): the plan says so, in ``plan`` and in MLflow.
    """

    estimator: str
    settings: Settings
    target: str
    phases: tuple[PhaseProfile, ...]
    notes: tuple[str, ...] = field(default=())
    compiled: bool = False

    @property
    def fallback(self) -> str | None:
        """Why the configured estimator could not run (``trace impossible (...); fell back to
        static``: the note :func:`memory.trace.trace_or_fallback` puts on the profile it fell back
        to), or None."""
        return next((n for n in self.notes if n.startswith(FALLBACK_NOTE)), None)

    def __post_init__(self):
        if self.target not in TARGETS:
            raise ValueError(f"target: expected one of {', '.join(TARGETS)}, got {self.target!r}")
        if not self.phases:
            raise ValueError("a memory profile needs at least one phase")

    def batch_for(self, phase: PhaseProfile, micro_batch: int, eval_batch: int) -> int:
        return micro_batch if phase.kind == "train" else eval_batch

    def phase_peaks(self, micro_batch: int, eval_batch: int, limit: int | None = None) -> dict[str, int]:
        """Predicted reserved bytes of every phase at these batch sizes (within ``limit``, if given)."""
        return {
            p.name: p.reserved_at(self.batch_for(p, micro_batch, eval_batch), micro_batch=micro_batch, limit=limit)
            for p in self.phases
        }

    def peak(self, micro_batch: int, eval_batch: int, limit: int | None = None) -> tuple[int, str]:
        """The worst phase's reserved bytes at these batch sizes, and that phase's name."""
        peaks = self.phase_peaks(micro_batch, eval_batch, limit)
        name = self.worst(peaks, micro_batch, eval_batch)
        return peaks[name], name

    def worst(self, peaks: dict[str, int], micro_batch: int, eval_batch: int) -> str:
        """The phase of ``peaks`` that needs the most; of equal reserved bytes (the allocator
        reserves whole segments), the one with more tensor bytes."""
        allocated = {p.name: p.allocated_at(self.batch_for(p, micro_batch, eval_batch)) for p in self.phases}
        return max(peaks, key=lambda name: (peaks[name], allocated[name]))

    def allocator_model_gap(self) -> str | None:
        """On a CUDA target, which phases' reserved memory is not the allocator model's and why,
        in one line (what ``plan`` and the plan's note show); None where every phase's is, and on
        targets without a caching allocator. A flat factor misses how the cache is carved up, so
        a plan made with it can be off by 10-40 %: a person should know which one they got."""
        flat = [p for p in self.phases if p.sequence is None]
        if self.target != "cuda" or not flat:
            return None
        factors = {f"{1 + p.fragmentation:.3g}" for p in flat}
        if len(factors) == 1:
            reserved = f"{', '.join(p.name for p in flat)}: reserved = allocated x {factors.pop()}"
        else:
            reserved = "reserved = allocated x " + ", ".join(f"{1 + p.fragmentation:.3g} in {p.name}" for p in flat)
        return f"{reserved}, not the allocator model ({self._why_flat()})"

    def _why_flat(self) -> str:
        if self.estimator == "trace":
            backend = next((n.partition(f" {NOT_MODELLED}")[0] for n in self.notes
                            if n.startswith("backend:") and NOT_MODELLED in n), None)
            if backend is not None:
                return f"PYTORCH_CUDA_ALLOC_CONF {backend} {NOT_MODELLED}"
            return f"the probe traces' allocation logs did not line up: {LOGS_DIFFER}"
        if self.estimator == "measured":
            return "the factor measured on the device"
        return f"the {self.estimator} estimator logs no allocations"

    def phases_of(self, kind: str) -> tuple[PhaseProfile, ...]:
        return tuple(p for p in self.phases if p.kind == kind)

    def to_dict(self) -> dict:
        return {
            "estimator": self.estimator,
            "settings": asdict(self.settings),
            "target": self.target,
            "phases": [p.to_dict() for p in self.phases],
            "notes": list(self.notes),
            "compiled": self.compiled,
        }


def overheads(target: str, fragmentation: float, *, measured_context: int | None = None) -> dict:
    """Context, workspace and fragmentation fields for a phase on ``target``.

    Only a CUDA target has them: the CPU and emulated devices count tensor bytes, nothing else.
    """
    if target != "cuda":
        return {"context": 0, "workspace": 0, "fragmentation": 0.0}
    from orchestrator.device.nvml import DEFAULT_CUDA_CONTEXT_BYTES

    return {
        "context": DEFAULT_CUDA_CONTEXT_BYTES if measured_context is None else measured_context,
        "workspace": CUDA_WORKSPACE_BYTES,
        "fragmentation": fragmentation,
    }
