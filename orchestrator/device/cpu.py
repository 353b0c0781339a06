"""The CPU as a device: live tensor bytes counted by a tracker, on sampled steps.

Honestly labelled (``cpu_tensor_tracker``): that is not what a GPU would reserve.
"""

from __future__ import annotations

import contextlib
import time

import torch

from orchestrator.device.base import Device, MemoryReading
from orchestrator.device.tensor_tracker import StorageTracker
from orchestrator.device.torch_internals import disable_current_modes, tree_leaves

#: The CPU measures at most this many steps of a phase at the start of every report window (two
#: where the first one changed the state that outlives steps), then one step per this many seconds.
CPU_SAMPLED_STEPS = 2
CPU_SAMPLE_EVERY_S = 1.0


class CpuDevice(Device):
    """The CPU: peak = the most tensor bytes alive at once (not process RSS, not a GPU figure).

    Counting runs every op through a Python dispatch mode, about 1 ms a step for a small MLP,
    which would make a CPU trial 2-3x slower than a plain loop (``bench/sweep_overhead.py
    --long``). So a trial's steps are sampled: the first train step and the first eval batch of
    each report window, then one every ``CPU_SAMPLE_EVERY_S``; the others run with the tracker
    set aside (left aside from one to the next, see ``_resume``) and admit nothing. A step's
    tensors are temporaries, so a sampled step peaks as any step of its shape does, once the
    state that outlives steps is the one every step runs with: the first optimizer step of a
    trainer creates the optimizer's state, and the step after it peaks higher. So a window whose
    first step of a phase finds another state than the one a second step of that phase last
    found (its tensors' shapes and dtypes differ: a new trainer's fresh optimizer, the first
    window) measures its second step too (``CPU_SAMPLED_STEPS``). Batches of varying shape may
    peak between samples.
    """

    kind = "cpu_tensor_tracker"
    target = "cpu"
    torch_type = "cpu"

    def __init__(self, tracker: StorageTracker | None = None):
        self.torch_device = torch.device(self.torch_type)
        self.tracker = tracker if tracker is not None else StorageTracker("cpu")
        self._window_samples: dict[str, int] = {}  # steps measured per phase since the last reset_peak
        self._window_quota: dict[str, int] = {}  # steps to measure per phase in this window (1 or 2)
        self._settled: dict[str, tuple] = {}  # phase -> the state (its tensors' shapes) a second measured step found
        self._last_sample = -float("inf")
        self._measuring_step = True  # False inside a step that is not sampled
        self._unmeasured = _Unmeasured(self)
        self._aside = None  # the dispatch modes an unsampled step set aside, until something else runs

    def measuring(self):
        return _Measuring(self)

    def track(self, tensors):
        self._resume()
        self.tracker.track(tensors)

    def host(self):
        # Host and device are one memory here: what is made outside the tracker is not counted.
        return disable_current_modes()

    def admit(self, batch):
        if self._measuring_step:
            self.tracker.track(t for t in tree_leaves(batch) if isinstance(t, torch.Tensor))
        return batch

    def step(self, phase, state):
        # Called at every optimizer step: returns a context (cheaper than a generator-based one).
        now = time.monotonic()
        sampled = self._window_samples.get(phase, 0)
        quota = self._window_quota.get(phase, min(1, CPU_SAMPLED_STEPS))  # its first step, until it says more
        if sampled < quota or now - self._last_sample >= CPU_SAMPLE_EVERY_S:
            self._resume()
            self._window_samples[phase] = sampled + 1
            self._last_sample = now
            self._measure_state(phase, sampled, list(state()))
            return _MEASURED
        if self._aside is None:
            self._aside = disable_current_modes()
            self._aside.__enter__()
        return self._unmeasured

    def _resume(self) -> None:
        """The modes the unsampled steps set aside, back on the stack: the steps of a run of
        unsampled ones leave them aside between them (popping and pushing them around every
        step was ~5 us of a ~370 us step of the sweep's MLP), and whatever else the device is
        asked for (a sampled step, a reading, the end of ``measuring``) puts them back first.
        So work between steps that asks the device nothing (a workload's ``set_epoch``) is
        counted as an unsampled step's is: by the state it leaves, at the next sampled step."""
        if self._aside is not None:
            aside, self._aside = self._aside, None
            aside.__exit__(None, None, None)

    def _measure_state(self, phase: str, sampled: int, tensors: list[torch.Tensor]) -> None:
        """Count what earlier, unmeasured steps made and kept, and decide from it whether this
        window measures a second step of ``phase``: when its first finds an unsettled state."""
        self.tracker.track(tensors)
        if sampled > 1:  # past a window's first two measured steps: nothing more to decide
            return
        found = tuple((t.shape, t.dtype) for t in tensors)
        if sampled == 0:
            settled = self._settled.get(phase) == found
            self._window_quota[phase] = min(1, CPU_SAMPLED_STEPS) if settled else CPU_SAMPLED_STEPS
        elif sampled == 1:
            self._settled[phase] = found  # the state the step after a state-making one runs with

    def reset_peak(self):
        self._resume()
        self.tracker.reset_peak()
        self._window_samples.clear()
        self._window_quota.clear()

    def allocated(self) -> int:
        self._resume()
        return self.tracker.allocated

    def reading(self) -> MemoryReading:
        self._resume()
        return MemoryReading(self.kind, self.tracker.peak, None)


_MEASURED = contextlib.nullcontext()  # a measured step runs under the tracker, as everything else


class _Measuring:
    """The tracker on the dispatch stack for the duration, put back first where unsampled steps
    left it aside, so that its exit pops itself."""

    __slots__ = ("device",)

    def __init__(self, device: CpuDevice):
        self.device = device

    def __enter__(self) -> StorageTracker:
        return self.device.tracker.__enter__()

    def __exit__(self, *exc) -> None:
        self.device._resume()
        self.device.tracker.__exit__(*exc)


class _Unmeasured:
    """A step the tracker does not see (its modes set aside by ``CpuDevice.step``): ``admit``
    counts nothing in it, and a step that fails puts the modes back before its error is handled."""

    __slots__ = ("device",)

    def __init__(self, device: CpuDevice):
        self.device = device

    def __enter__(self) -> None:
        self.device._measuring_step = False

    def __exit__(self, exc_type, *exc) -> None:
        self.device._measuring_step = True
        if exc_type is not None:
            self.device._resume()
