"""Counting tensor bytes the way a GPU allocator would see them, on real or fake tensors.

Storages are keyed by the storage object itself (``data_ptr`` is 0 for every fake tensor), so
this works under ``FakeTensorMode`` (no memory used) as well as on real CPU tensors, where it is
what ``orchestrator.device`` measures the CPU and the emulated GPU with. It counts only storages on
one device type (the batch waiting on ``meta`` before its host-to-device copy is not device
memory), can round every storage up the way the CUDA caching allocator does (512 bytes), and
keeps a peak per window; it can also record the allocated bytes after every op (``events``),
which is what lets the trace estimator read the peak at *every* batch size off two runs.

While recording (:meth:`StorageTracker.record`) it also logs the order of allocations and frees
the CUDA caching allocator would be asked for: each new storage's requested bytes (the allocator
rounds them itself, by rules that depend on its configuration) and each free as the complement
``~k`` of the allocation's index ``k`` in the log; ``orchestrator.memory.allocator`` replays it.
"""

from __future__ import annotations

import functools
import math
import weakref
from typing import Iterable, Iterator

import torch

from orchestrator.device.torch_internals import DispatchMode, tree_leaves

#: The CUDA caching allocator's smallest block; every allocation is rounded up to a multiple.
CUDA_BLOCK = 512


def model_tensors(model: torch.nn.Module) -> Iterator[torch.Tensor]:
    """A model's parameters, then its buffers."""
    yield from model.parameters()
    yield from model.buffers()


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    """The tensors of an optimizer's state (moments, step counters), parameter by parameter."""
    for state in optimizer.state.values():
        yield from (v for v in state.values() if isinstance(v, torch.Tensor))


def state_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    """What a trainer holds between steps: the model's tensors and its optimizer's state. The one
    listing of them, for the device that counts them and for the estimators."""
    yield from model_tensors(model)
    yield from optimizer_tensors(optimizer)


def storage_bytes(tensors: Iterable[torch.Tensor], device_type: str, round_to: int = 1) -> int:
    """The bytes of the distinct storages of ``tensors`` on ``device_type``, each rounded up to
    ``round_to`` (a CPU ``step`` counter of a CUDA optimizer is not device memory; tensors that
    share a storage count once)."""
    seen, total = set(), 0
    for tensor in tensors:
        key = id(tensor.untyped_storage())
        if tensor.device.type == device_type and key not in seen:
            seen.add(key)
            total += math.ceil(tensor.untyped_storage().nbytes() / round_to) * round_to
    return total


class StorageTracker(DispatchMode):
    """Live, peak and ever-allocated bytes of the storages created while active.

    ``track`` registers tensors that exist already (parameters, optimizer state).
    ``total`` is the sum of every storage ever counted, freed or not: an upper bound on what
    the forward pass could keep for backward, which the static estimator uses.
    """

    def __init__(self, device_type: str = "cpu", round_to: int = 1):
        super().__init__()
        self.device_type = device_type
        self.round_to = round_to
        self.allocated = 0
        self.peak = 0
        self.total = 0
        self.largest = 0
        self.events: list[int] | None = None  # allocated bytes after every op, while recording
        self.most_live = 0  # the most storages alive at once since the last reset_peak
        self.log: list[int] | None = None  # requested bytes / ~index of the freed allocation, while recording
        self._live: dict[int, int] = {}
        self._logged: dict[int, int] = {}  # storage key -> its allocation's index in the log
        self._logged_count = 0  # allocations in the log so far
        self._requested: dict[int, int] = {}  # storage key -> bytes the allocator was asked for
        self._watches: dict[int, weakref.ref] = {}  # storage key -> the weak reference whose callback frees it

    def track(self, tensors: Iterable[torch.Tensor]) -> None:
        for tensor in tensors:
            self._add(tensor)

    def reset_peak(self) -> None:
        self.peak = self.allocated
        self.most_live = len(self._live)

    def record(self, existing: Iterable[torch.Tensor] = ()) -> list[int]:
        """Start a new allocation log, opening with the tracked storages of ``existing`` in their
        order (the tensors a step finds already allocated, e.g. a model's states as
        ``Module.to`` creates them), so their frees are logged too. Returns the log."""
        self.log, self._logged, self._logged_count = [], {}, 0
        for tensor in existing:
            key = id(tensor.untyped_storage())
            if key in self._live and key not in self._logged:
                self._log_allocation(key)
        return self.log

    def stop_recording(self) -> list[int]:
        log, self.log, self._logged = self.log or [], None, {}
        return log

    def bytes_of(self, tensors: Iterable[torch.Tensor]) -> int:
        """:func:`storage_bytes` of ``tensors`` on this tracker's device type, rounded as it rounds."""
        return storage_bytes(tensors, self.device_type, self.round_to)

    def size_of(self, tensor: torch.Tensor) -> int:
        return self._rounded(tensor.untyped_storage().nbytes())

    def _rounded(self, nbytes: int) -> int:
        """What a storage of ``nbytes`` counts for: rounded up to the device's block."""
        return -(-nbytes // self.round_to) * self.round_to

    def admit(self, size: int) -> None:
        """Called before a new storage of ``size`` bytes is counted; a subclass may refuse it."""

    def _log_allocation(self, key: int) -> None:
        self._logged[key] = self._logged_count
        self._logged_count += 1
        self.log.append(self._requested[key])

    def _free(self, key: int) -> None:
        self.allocated -= self._live.pop(key, 0)
        self._requested.pop(key, None)
        self._watches.pop(key, None)
        if self.log is not None and key in self._logged:
            self.log.append(~self._logged.pop(key))

    def _add(self, tensor: torch.Tensor) -> None:
        # Every output of every op passes here while the tracker is on (about 230 ops a step of
        # the LSTM example), so the common case (a storage already counted: views, in-place ops)
        # ends at a dict lookup, and a new storage's size is read once.
        if tensor.device.type != self.device_type or tensor.is_sparse:
            return
        storage = tensor.untyped_storage()
        key = id(storage)
        if key in self._live:
            return
        requested = storage.nbytes()
        size = self._rounded(requested)
        if size == 0:
            return
        self.admit(size)
        live = self._live
        live[key] = size
        self._requested[key] = requested
        if self.log is not None:
            self._log_allocation(key)
        self.allocated += size
        self.total += size
        self.largest = max(self.largest, size)
        self.peak = max(self.peak, self.allocated)
        self.most_live = max(self.most_live, len(live))
        # The storage's Python object lives as long as the storage does (PyTorch keeps it), so a
        # weak reference's callback is its free: a plain ``weakref.ref`` held here fires when a
        # ``weakref.finalize`` would, without the finalizer's registry and bookkeeping.
        self._watches[key] = weakref.ref(storage, functools.partial(self._freed, key))

    def _freed(self, key: int, _ref: weakref.ref) -> None:
        self._free(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **kwargs) if kwargs else func(*args)
        if isinstance(out, torch.Tensor):  # most ops: one tensor, no tree to flatten
            self._add(out)
        elif type(out) is tuple or type(out) is list:
            for item in out:
                if isinstance(item, torch.Tensor):
                    self._add(item)
                elif isinstance(item, (tuple, list, dict)):
                    self._add_leaves(item)
        elif out is not None:
            self._add_leaves(out)
        if self.events is not None:
            self.events.append(self.allocated)
        return out

    def _add_leaves(self, tree) -> None:
        for leaf in tree_leaves(tree):
            if isinstance(leaf, torch.Tensor):
                self._add(leaf)
