"""Running a workload on fake tensors: the shared ground of the ``trace`` and ``static`` estimators.

Under ``FakeTensorMode`` tensors have shapes, dtypes and devices but no data: the real model
(built by ``memory.construction``, never on real tensors), optimizer and step run for any batch
size in the time of a tiny one and use no memory.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field

import torch

from orchestrator.contract import COMPILED_MODEL_NOTE
from orchestrator.device.tensor_tracker import CUDA_BLOCK, StorageTracker, model_tensors, optimizer_tensors
from orchestrator.device.torch_internals import (
    FAKE_TENSOR_LOGGER,
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
    UnsupportedFakeTensorException,
    disable_current_modes,
    eager_module,
    tree_map,
    unset_fake_temporarily,
)
from orchestrator.memory.construction import build_fake
from orchestrator.memory.cuda_emulation import cuda_semantics, mha_fast_path
from orchestrator.memory.failure import where
from orchestrator.memory.known_values import KnownValues
from orchestrator.memory.optimizer import build_for_target
from orchestrator.memory.optimizer import describe as describe_optimizer
from orchestrator.memory.workspaces import KernelWorkspaces
from trainables.workload import Workload


class Untraceable(Exception):
    """The workload cannot run on fake tensors; the message says why, for the profile's notes."""


@dataclass
class FakeSetup:
    """A model and its optimizer built on fake tensors, and how to count their bytes."""

    mode: FakeTensorMode
    device: torch.device
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    workload: Workload
    sample: object  # the workload's largest sample (real): every probe batch of training is copies of it
    round_to: int
    emulate_cuda: bool
    notes: tuple[str, ...] = ()  # what was built: the optimizer counted, a compiled model's eager modules
    compiled: bool = False  # the workload's model is torch.compile'd: its eager modules run here
    _host_batches: dict = field(default_factory=dict)  # collated host batches by (size, of training's sample)
    #: Real values of the small fake tensors whose values are knowable (the sample's, a causal
    #: mask's): a model's data-dependent checks read them (``memory.known_values``).
    values: KnownValues = field(default_factory=KnownValues)
    #: The largest eval sample (real), where the workload names one (``largest_eval_sample``).
    eval_sample: object = None

    def tracker(self) -> StorageTracker:
        tracker = StorageTracker(self.device.type, self.round_to)
        tracker.track(list(model_tensors(self.model)))
        return tracker

    def batch(self, size: int, kind: str = "train"):
        """A fake batch of ``size`` samples as the loop hands it to the steps of ``kind``: ``size``
        copies of the workload's largest sample (of its eval data for an eval step), through its
        own ``collate``, on ``meta``, i.e. still on the host. The steps copy it to the device, so
        the device copy is counted for its micro-batch's lifetime and the host copy is not, as in
        the loop on every device.

        The collate runs on fake host tensors, which take no memory at any size; one that needs
        values (a graph batch's node offsets, say) runs on real copies of the sample instead, and
        its batch's tensors become fake host tensors of the same shapes. Either way the batch's
        small tensors keep their real values (``values``), for the checks a model makes on them.
        """
        sample = self.eval_sample if kind == "eval" and self.eval_sample is not None else self.sample
        key = (size, sample is self.sample)
        if key not in self._host_batches:
            with disable_current_modes():  # the host's work, not the step's: no tracker sees it
                try:
                    with self.mode, self.values:
                        batch = self.workload.collate([_host_fakes(self.mode, sample, self.values)] * size)
                except Exception:  # a collate that reads values: real samples, then shapes only
                    batch = _host_fakes(self.mode, self.workload.collate([sample] * size), self.values)
            self._host_batches[key] = batch
        return self._host_batches[key]

    def params_bytes(self, tracker: StorageTracker) -> int:
        return sum(tracker.size_of(p) for p in self.model.parameters())

    def buffers_bytes(self, tracker: StorageTracker) -> int:
        return sum(tracker.size_of(b) for b in self.model.buffers())

    def optimizer_bytes(self, tracker: StorageTracker) -> int:
        """Optimizer state on the device (a CPU ``step`` counter of a CUDA model is not device memory)."""
        return tracker.bytes_of(optimizer_tensors(self.optimizer))


def trace_device(target: str) -> str:
    """The device type a trace for ``target`` runs on here: ``cuda`` where the target is CUDA and
    a GPU is here, which makes the tracing process a CUDA context (a fake CUDA tensor starts with
    a real one), else ``cpu``."""
    return "cuda" if target == "cuda" and torch.cuda.is_available() else "cpu"


def fake_setup(workload: Workload, target: str, trace_on: str | None = None) -> FakeSetup:
    """Build ``workload``'s model and optimizer on fake tensors of the device the trace runs on.

    That is fake *cuda* when the target is CUDA and a GPU is here (CUDA's own kernels), else
    fake *cpu*, with CUDA's allocations emulated (``cuda_emulation``) when the target is CUDA.
    ``trace_on="cpu"`` forces the CPU way (what a head node without a GPU does), to measure it.
    """
    device = torch.device(trace_on or trace_device(target))
    emulate = target == "cuda" and device.type == "cpu"
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    values = KnownValues()
    with translate_errors():
        model, compiled = eager_module(build_fake(workload.build_model, mode, device, values))  # never compiled here
        with mode, device:
            optimizer = build_for_target(workload, model, target)
    notes = (describe_optimizer(optimizer, target), *((COMPILED_MODEL_NOTE,) if compiled else ()))
    sample = workload.largest_sample()
    eval_sample = workload.largest_eval_sample() if type(workload).overrides("largest_eval_sample") else None
    return FakeSetup(mode, device, model, optimizer, workload, sample, CUDA_BLOCK if target == "cuda" else 1, emulate,
                     notes, compiled, values=values, eval_sample=eval_sample)


def _host_fakes(mode: FakeTensorMode, tree, values: KnownValues):
    """``tree`` with every tensor a fake tensor on ``meta`` (the host, not the device), same shape,
    whose value (the real tensor's) ``values`` knows."""

    def host_fake(t):
        if not isinstance(t, torch.Tensor):
            return t
        with unset_fake_temporarily():
            meta = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
        fake = mode.from_tensor(meta)
        values.know(fake, t)
        return fake

    return tree_map(host_fake, tree)


@contextlib.contextmanager
def running(setup: FakeSetup, fast_path: bool = True):
    """Fake mode, plus CUDA emulation where needed; yields the list the trace's notes go to
    (filled on exit: what could not be emulated or counted). ``fast_path=False`` turns torch's
    fused transformer path off on a CPU device too (where it would make nested tensors)."""
    notes: list[str] = []
    with translate_errors(), setup.mode, setup.values, contextlib.ExitStack() as stack:
        workspaces = stack.enter_context(KernelWorkspaces()) if setup.device.type == "cpu" else None
        if setup.emulate_cuda:
            emulation = stack.enter_context(cuda_semantics())
        elif setup.device.type == "cuda" or not fast_path:  # fused layers hide their insides
            stack.enter_context(mha_fast_path(False))
        yield notes
    if setup.emulate_cuda:
        notes.extend(emulation)
    if workspaces is not None:
        notes.extend(sorted(workspaces.notes))


@contextlib.contextmanager
def translate_errors():
    """Fake-tensor failures -> :class:`Untraceable` with a message a user can act on.

    FakeTensorMode logs each failing meta kernel with its whole traceback before it raises (a
    shape mismatch in the user's model prints four of them); the estimate reports that error in
    one line naming the user's file and line, so the log is held back while we trace.
    """
    added = _META_FAILURE_QUIET not in _FAKE_TENSOR_LOG.filters
    if added:
        _FAKE_TENSOR_LOG.addFilter(_META_FAILURE_QUIET)
    try:
        yield
    except (DynamicOutputShapeException, DataDependentOutputException) as exc:
        raise Untraceable(
            f"{where(exc) or type(exc).__name__}: an op whose output depends on tensor values cannot run on fake tensors"
        ) from exc
    except UnsupportedFakeTensorException as exc:
        place = where(exc)
        raise Untraceable(f"an op does not support fake tensors{' (' + place + ')' if place else ''}: {exc}") from exc
    finally:
        if added:
            _FAKE_TENSOR_LOG.removeFilter(_META_FAILURE_QUIET)


class _MetaFailureQuiet(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("failed while attempting to run meta")


_FAKE_TENSOR_LOG = logging.getLogger(FAKE_TENSOR_LOGGER)
_META_FAILURE_QUIET = _MetaFailureQuiet()


def describe(setup: FakeSetup) -> str:
    emulated = " with CUDA's attention, dropout, autocast and foreach-optimizer allocations emulated"
    return f"fake {setup.device.type} tensors" + (emulated if setup.emulate_cuda else "")
