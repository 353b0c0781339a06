"""The ``measured`` estimator: probe steps on the worker's own device and fit what they used.

It runs what the loop runs (``trainables.step``) on real tensors: per stage, a warm-up train
step (so the optimizer's state exists), then at each probe batch size a train step of two
micro-batches (gradient accumulation) and an eval step, reading the device's peak per window
(forward/backward, optimizer step, eval) as the trace estimator does.

Probe sizes: doubling from 2 until the peak has grown by half over the first probe, so the
per-sample slope is visible (at tiny batches memory can be flat: ViT-B/16 used 1.68 GiB at
b=1..8 on an H100, so a line through b=1,2 predicted nothing), or until the next probe is
predicted to fill most of the device, or ``MAX_PROBE``. An out-of-memory error ends the probing
with the points so far. On CUDA the allocator's statistics give peak allocated *and* reserved,
so the profile's fragmentation is measured, not assumed; on the CPU (``CpuDevice``: live tensor
bytes) the same code runs, which is what makes it testable here.
"""

from __future__ import annotations

import math

import torch

from orchestrator.device import CpuDevice, CudaDevice, Device, release, state_tensors
from orchestrator.device.oom import is_oom
from orchestrator.device.tensor_tracker import optimizer_tensors, storage_bytes
from orchestrator.memory.phases import enter_phase, phases_of
from orchestrator.memory.profile import (
    CUBLAS_WORKSPACE_BYTES,
    EstimateRequest,
    EstimationError,
    MemoryProfile,
    PhaseProfile,
    Settings,
    overheads,
)
from trainables.carry import Carry
from trainables.step import eval_step, make_grad_scaler, train_step
from trainables.workload import Workload, optimizer_for, sample_batch

FIRST_PROBE = 2
MAX_PROBE = 1024
#: Stop doubling once the peak is this much above the first probe's: the slope is visible.
VISIBLE_GROWTH = 0.5
#: Do not start a probe predicted to pass this share of the device's capacity.
CAPACITY_SHARE = 0.8
#: Without a capacity (the CPU), stop before probes hold more than this.
CPU_PROBE_LIMIT = 2 * 2**30
MICRO_BATCHES_PER_STEP = 2


class _Probe:
    """The worker's model, optimizer and data, and one measured window at a time."""

    def __init__(self, workload: Workload, settings: Settings, device: Device):
        self.workload, self.settings, self.device = workload, settings, device
        self.model = workload.build_model().to(device.torch_device)
        self.optimizer = optimizer_for(workload, self.model, device.torch_device.type)
        # A step the scaler skips (an overflow) runs no optimizer step, nor its hooks: each probe
        # would read the previous one's peaks. Unscaled, fp16 gradients overflow only where the
        # model's do; the memory a step uses is the same at any scale.
        self.scaler = make_grad_scaler(settings.precision, device, init_scale=1.0)
        self.train_data, self.eval_data = workload.train_data(), workload.eval_data()
        self.fb_peak = self.fb_reserved = self.step_peak = 0
        self.optimizer.register_step_pre_hook(self._before_step)
        self.optimizer.register_step_post_hook(self._after_step)

    def _state(self):
        return state_tensors(self.model, self.optimizer)

    def _before_step(self, *_):
        reading = self.device.reading()
        self.fb_peak, self.fb_reserved = reading.peak_allocated, reading.peak_reserved or 0
        self.device.reset_peak()

    def _after_step(self, *_):
        self.step_peak = self.device.reading().peak_allocated

    def recover(self) -> None:
        """Free what a step that ran out of memory left behind."""
        self.optimizer.zero_grad(set_to_none=True)
        release()

    def _batches(self, data, size: int, count: int):
        """``count`` batches of ``size``, each collated on the host and admitted to the device when
        the step takes it, as the loop does (indexing a dataset inside the measured window would
        count the dataset's storage)."""
        for _ in range(count):
            yield self.device.admit(self._host_batch(data, size))  # no local: the step's drop frees it

    def _host_batch(self, data, size: int):
        with self.device.host():
            return sample_batch(self.workload, data, size)

    def train(self, size: int, micro_batches: int) -> tuple[int, int, int]:
        """(forward/backward peak allocated, its peak reserved, optimizer-step peak) of one step."""
        self.device.track(self._state())
        self.device.reset_peak()
        with self.device.measuring():
            carry = (Carry.initial(self.workload, size * micro_batches, self.device.torch_device)
                     if self.workload.stateful else None)
            train_step(
                self.workload, self.model, self.optimizer, self._batches(self.train_data, size, micro_batches),
                [size] * micro_batches, self.device.torch_device, self.settings.precision, self.scaler, carry=carry,
            )
            del carry
        return self.fb_peak, self.fb_reserved, self.step_peak

    def eval(self, size: int) -> tuple[int, int]:
        self.device.track(self._state())
        self.device.reset_peak()
        with self.device.measuring():
            for batch in self._batches(self.eval_data, size, 1):
                eval_step(self.workload, self.model, batch, size, self.device.torch_device, self.settings.precision)
                del batch
        reading = self.device.reading()
        return reading.peak_allocated, reading.peak_reserved or 0

    def bytes_of(self, tensors) -> int:
        return storage_bytes(tensors, self.device.torch_device.type)


def default_device(target: str) -> Device:
    """The device to probe on when none is given: the GPU for a CUDA target, if here."""
    if target == "cuda" and torch.cuda.is_available():
        return CudaDevice(torch.cuda.current_device())
    return CpuDevice()


def measured_profile(workload: Workload, request: EstimateRequest) -> MemoryProfile:
    """The ``measured`` estimator: probe steps on the worker's device (``request.device``, else
    this process's own for the target). Raises :class:`MeasurementFailed` where too few fit."""
    settings, target, fragmentation = request.settings, request.target, request.fragmentation
    device = request.device or default_device(target)
    on_gpu = isinstance(device, CudaDevice)
    notes = []
    if target == "cuda" and not on_gpu:
        notes.append("measured on the CPU tensor tracker: CPU kernels' tensor bytes stand in for CUDA's")
    phases = phases_of(workload)
    probe = _Probe(workload, settings, device)
    sizes: list[int] = []
    seen: dict[str, dict[int, tuple]] = {p.name: {} for p in phases}
    try:
        for phase in phases:
            enter_phase(workload, probe.model, phase, settings)
            try:
                if phase.kind == "train":
                    probe.train(FIRST_PROBE, 1)  # warm-up: the optimizer's state comes to exist
                for b in sizes or _doubling(probe, device, seen[phase.name]):
                    if b not in seen[phase.name]:
                        seen[phase.name][b] = probe.train(b, MICRO_BATCHES_PER_STEP) if phase.kind == "train" else probe.eval(b)
            except Exception as exc:  # an OOM (cuBLAS's too) ends this phase's probing; the others go on
                if not is_oom(exc):
                    raise
                notes.append(f"{phase.name}: probing stopped by an out-of-memory error ({str(exc).splitlines()[0][:120]})")
                exc.__traceback__ = None  # it pins the failed step's tensors
                probe.recover()
            if not sizes and len(seen[phase.name]) == 1:  # only the first probe fit: add b=1 below it
                try:
                    seen[phase.name][1] = probe.train(1, MICRO_BATCHES_PER_STEP)
                except (RuntimeError, ValueError) as exc:  # OOM, or a model that cannot take one sample
                    notes.append(f"{phase.name}: no probe at b=1 either ({str(exc).splitlines()[0][:120]})")
                    exc.__traceback__ = None
                    probe.recover()
            sizes = sizes or sorted(seen[phase.name])
    finally:
        breakdown = _breakdown(probe)
        del probe
        release()
    if not sizes or any(len(seen[p.name]) < 2 for p in phases):
        raise MeasurementFailed("fewer than two probe batch sizes fit on the device: " + "; ".join(notes))
    notes.insert(0, f"measured on {device.kind} at batch sizes {', '.join(map(str, sizes))}")
    if on_gpu:
        from orchestrator.device.nvml import cuda_context_bytes

        extra = {"context": cuda_context_bytes(device.torch_device.index or 0), "workspace": CUBLAS_WORKSPACE_BYTES}
    else:
        extra = overheads(target, fragmentation)
    profiles = tuple(_fit(p, seen[p.name], breakdown, extra, on_gpu) for p in phases)
    return MemoryProfile("measured", settings, target, profiles, tuple(notes))


class MeasurementFailed(EstimationError):
    """Fewer than two probe batch sizes fit on the device."""


def _doubling(probe: _Probe, device: Device, seen: dict[int, tuple]):
    """Probe sizes 2, 4, 8, ... until the slope is visible or the next probe would fill the device."""
    capacity = device.capacity() or CPU_PROBE_LIMIT
    b = FIRST_PROBE
    while b <= MAX_PROBE:
        seen[b] = probe.train(b, MICRO_BATCHES_PER_STEP)
        yield b
        first = seen[FIRST_PROBE][0]
        if len(seen) >= 3 and seen[b][0] >= first * (1 + VISIBLE_GROWTH):
            return
        slope = (seen[b][0] - first) / (b - FIRST_PROBE) if b > FIRST_PROBE else 0
        if len(seen) >= 2 and seen[b][0] + slope * b > CAPACITY_SHARE * capacity:
            return
        b *= 2


def _breakdown(probe: _Probe) -> dict[str, int]:
    params = [p for p in probe.model.parameters()]
    return {
        "params": probe.bytes_of(params),
        "grads": probe.bytes_of([p for p in params if p.requires_grad]),
        "optimizer": probe.bytes_of(optimizer_tensors(probe.optimizer)),
        "buffers": probe.bytes_of(probe.model.buffers()),
    }


def _fit(phase, seen: dict[int, tuple], breakdown: dict, extra: dict, on_gpu: bool) -> PhaseProfile:
    batches = sorted(seen)
    points = tuple((b, seen[b][0]) for b in batches)
    (b0, m0), (b1, m1) = points[-2], points[-1]
    slope = math.ceil((m1 - m0) / (b1 - b0))
    if on_gpu:  # the allocator's own reserved/allocated at the largest probe
        allocated, reserved = seen[b1][0], seen[b1][1]
        extra = {**extra, "fragmentation": max(reserved / allocated - 1, 0.0) if allocated else 0.0}
    return PhaseProfile.from_line(
        phase, params=breakdown["params"], grads=breakdown["grads"] if phase.kind == "train" else 0,
        optimizer=breakdown["optimizer"], buffers=breakdown["buffers"],
        slope=slope, intercept=m1 - slope * b1,
        step_floor=max((seen[b][2] for b in batches if len(seen[b]) == 3), default=0),
        points=points,
        **extra,
    )
