"""The ``static`` estimator: an instant, conservative count from the model and one forward pass.

* states, counted from the real objects built on fake tensors: parameters, buffers, gradients
  of every trainable parameter (embeddings included: their gradients are dense), and the
  optimizer's state after one step on zero gradients, whatever the optimizer (SGD momentum: 1x
  the parameters, Adam/AdamW: 2x, ...); that step's peak also gives its temporaries;
* activations, by a heuristic that does not depend on when tensors are freed: every tensor the
  forward pass creates is assumed kept for backward (an upper bound on what autograd saves),
  plus two of the largest for the gradients in flight during backward. The eval step (no
  autograd) holds what its forward holds at its peak, plus the largest tensor as a margin.

Nothing runs backward and nothing is fitted to a trace, so it is quick and errs high: it never
budgets less than the step needs, and the planner's micro-batch from it is smaller than from
``trace``. Where the model cannot run on fake tensors (ops with data-dependent shapes, or
anything else fake tensors trip over), it runs on real CPU tensors at small batch sizes
instead, and the profile says so; a model too large for this machine's memory is not built
for real, and the estimate fails with both reasons.
"""

from __future__ import annotations

import torch

from orchestrator.available_memory import available_host_memory
from orchestrator.contract import COMPILED_MODEL_NOTE
from orchestrator.device.tensor_tracker import CUDA_BLOCK, StorageTracker, model_tensors, optimizer_tensors
from orchestrator.device.torch_internals import eager_module, tree_leaves
from orchestrator.memory.construction import HostOrMeta
from orchestrator.memory.failure import fails_on_any_tensors, summary
from orchestrator.memory.fake import Untraceable, describe, fake_setup, running
from orchestrator.memory.fit import line_through
from orchestrator.memory.optimizer import build_for_target
from orchestrator.memory.optimizer import describe as describe_optimizer
from orchestrator.memory.phases import Phase, enter_phase, phases_of
from orchestrator.memory.profile import EstimateRequest, MemoryProfile, PhaseProfile, Settings, overheads
from orchestrator.units import human
from trainables.carry import Carry, stateful_loss
from trainables.step import autocast
from trainables.workload import Workload, check_metric_names, metric_sums, one_number, sample_batch, to_device

PROBE_BATCHES = (2, 128)
#: Gradients alive at once during backward, in units of the largest forward tensor.
GRADIENTS_IN_FLIGHT = 2
#: Scalars the train step keeps across the optimizer step (its running mean loss, ...), which
#: the optimizer step run here on its own does not have; each takes a block on CUDA.
STEP_SCALARS = 4
#: Real-CPU fallback: batch sizes small enough to run quickly.
REAL_PROBE_BATCHES = (2, 8)
#: ... and only for a model whose parameters, gradients and two optimizer moments (4x the
#: parameters' bytes) take at most this share of the memory available here.
REAL_STATES_PER_PARAMETER_BYTE = 4
REAL_MEMORY_SHARE = 0.5


def static_profile(workload: Workload, request: EstimateRequest) -> MemoryProfile:
    """The ``static`` estimator: an analytic upper bound from the model's states and one forward."""
    settings, target, fragmentation = request.settings, request.target, request.fragmentation
    notes = ["static upper bound: every forward tensor kept for backward, "
             f"{GRADIENTS_IN_FLIGHT} of the largest in flight"]
    compiled = False
    try:
        setup = fake_setup(workload, target)
        compiled = setup.compiled
        with running(setup) as emulation_notes:
            states = _states(setup.model, setup.optimizer, setup.tracker())
            bounds = {
                phase.name: _forward_bounds(
                    workload, setup.model, phase, settings, setup.device, setup.round_to,
                    lambda b, kind=phase.kind: setup.batch(b, kind), PROBE_BATCHES,
                )
                for phase in phases_of(workload)
            }
        notes += [f"forward and optimizer step run on {describe(setup)}", *setup.notes, *emulation_notes]
    except Exception as exc:  # Untraceable, or a model fake tensors trip over in another way
        if isinstance(exc, ImportError) or fails_on_any_tensors(exc):
            raise  # a missing library, or the model's own error: real tensors fail the same way
        reason = str(exc) if isinstance(exc, Untraceable) else summary(exc)
        try:
            states, bounds, compiled, built = _on_real_cpu(workload, settings, target)
        except TooLargeForRealTensors as too_large:
            raise TooLargeForRealTensors(f"fake tensors failed ({reason}), and {too_large}") from exc
        notes += [f"fake tensors failed ({reason}); forward run on real CPU tensors at b={REAL_PROBE_BATCHES}", *built]
    extra = overheads(target, fragmentation)
    phases = tuple(_phase(phase, states, bounds[phase.name], extra) for phase in phases_of(workload))
    return MemoryProfile("static", settings, target, phases, tuple(notes), compiled=compiled)


def _states(model: torch.nn.Module, optimizer: torch.optim.Optimizer, tracker: StorageTracker) -> dict[str, int]:
    """Parameters, gradients, optimizer state and buffers, and the optimizer step's peak."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    with tracker:
        for p in trainable:
            p.grad = torch.zeros_like(p)
        tracker.reset_peak()
        optimizer.step()
        step_peak = tracker.peak
        grads = sum(tracker.size_of(p.grad) for p in trainable)
        optimizer.zero_grad(set_to_none=True)
    return {
        "params": sum(tracker.size_of(p) for p in model.parameters()),
        "grads": grads,
        "optimizer": tracker.bytes_of(optimizer_tensors(optimizer)),
        "buffers": sum(tracker.size_of(b) for b in model.buffers()),
        "step_peak": step_peak,
        "scalar": tracker.size_of(torch.zeros((), device=tracker.device_type)),
    }


def _forward_bounds(workload, model, phase: Phase, settings, device, round_to, make_batch, probes) -> dict[int, int]:
    """Activation bytes the phase may hold at each probe size, by the heuristic above."""
    enter_phase(workload, model, phase, settings)
    bounds = {}
    for b in probes:
        host_batch = make_batch(b)  # collated outside the tracker: a dataset's storage is not the batch's
        tracker = StorageTracker(device.type, round_to)
        grad_mode = torch.enable_grad() if phase.kind == "train" else torch.no_grad()
        with tracker, grad_mode, autocast(settings.precision, device):
            batch = to_device(host_batch, device)
            del host_batch
            tracker.track(t for t in tree_leaves(batch) if isinstance(t, torch.Tensor))  # already there on the CPU
            if phase.kind == "train" and workload.stateful:
                out = stateful_loss(workload, model, batch, Carry.initial(workload, b, device).state)
            elif phase.kind == "train":
                out = one_number(workload, workload.loss(model, batch), b)
            else:
                out = metric_sums(workload, workload.eval_metrics(model, batch, b), b)
                check_metric_names(workload, out, b)
            del out, batch
        if phase.kind == "train":
            bounds[b] = tracker.total + GRADIENTS_IN_FLIGHT * tracker.largest
        else:
            bounds[b] = tracker.peak + tracker.largest
    return bounds


class TooLargeForRealTensors(Exception):
    """Fake tensors failed, and the model is too large to run on real CPU tensors here instead."""


def _check_fits_here(workload: Workload) -> None:
    """Refuse to build a model for real whose states would not fit this machine's memory.

    Its size comes from a build that makes no large tensor (``memory.construction``); its
    states on real tensors are the parameters, their gradients and an optimizer's two moments.
    Where this machine's available memory cannot be read, the model is built and tried.
    """
    with HostOrMeta():
        model = workload.build_model()
    size = sum(t.numel() * t.element_size() for t in model_tensors(model))
    available = available_host_memory()
    if available is not None and REAL_STATES_PER_PARAMETER_BYTE * size > REAL_MEMORY_SHARE * available:
        raise TooLargeForRealTensors(
            f"its {human(size)} of parameters and buffers are too large to run on real CPU tensors "
            f"here ({human(available)} available)"
        )


def _on_real_cpu(workload: Workload, settings: Settings, target: str):
    """The same counts on a real CPU model, for workloads fake tensors cannot run; also whether
    the model is compiled (its eager modules run here) and the notes on what was built. The
    optimizer is the one a CPU trial builds: the tensors here are the CPU's."""
    _check_fits_here(workload)
    torch.manual_seed(workload.seed)
    model, compiled = eager_module(workload.build_model())
    optimizer = build_for_target(workload, model, "cpu")
    built = [describe_optimizer(optimizer, "cpu"), *([COMPILED_MODEL_NOTE] if compiled else [])]
    round_to = CUDA_BLOCK if target == "cuda" else 1
    tracker = StorageTracker("cpu", round_to)
    tracker.track(list(model_tensors(model)))
    states = _states(model, optimizer, tracker)
    data = workload.train_data()
    device = torch.device("cpu")
    make_batch = lambda b: sample_batch(workload, data, b)  # noqa: E731
    bounds = {
        phase.name: _forward_bounds(workload, model, phase, settings, device, round_to, make_batch, REAL_PROBE_BATCHES)
        for phase in phases_of(workload)
    }
    return states, bounds, compiled, built


def _phase(phase: Phase, states: dict[str, int], bounds: dict[int, int], extra: dict) -> PhaseProfile:
    train = phase.kind == "train"
    grads = states["grads"] if train else 0
    held = states["params"] + grads + states["optimizer"] + states["buffers"]
    points = tuple((b, held + bound) for b, bound in sorted(bounds.items()))
    slope, intercept = line_through(points)
    return PhaseProfile.from_line(
        phase, params=states["params"], grads=grads, optimizer=states["optimizer"], buffers=states["buffers"],
        slope=slope, intercept=intercept,
        step_floor=states["step_peak"] + states["scalar"] * STEP_SCALARS if train else 0,
        points=points,
        **extra,
    )
