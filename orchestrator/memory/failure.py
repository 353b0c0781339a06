"""Where an estimation failed, in the terms of the user's model: the op, and the model's own frames.

A trace that stops inside a model (an op fake tensors cannot run, or a bug) is reported with the
op that failed and the file:line of the model's code that called it, e.g. ``aten.nonzero in
my_models/wide.py:41 (loss)``, so a user can see which line to look at without a traceback.
The model's code is every frame that is not torch's, this project's or Python's own: the
user's files and the model libraries they use (timm, transformers, ...).
"""

from __future__ import annotations

import os
import sysconfig
import traceback
from types import TracebackType

import torch

import orchestrator
import trainables
from orchestrator.device.torch_internals import OpOverload
from trainables.workload import LossTypeError, MetricsMismatch, MetricTypeError

#: What autograd says of a model whose backward fails whatever its tensors hold: fake tensors keep
#: the version counters and ``requires_grad`` that these checks read, as real ones do.
AUTOGRAD_MODEL_ERRORS = (
    "modified by an inplace operation",  # a tensor backward needs, changed in place after it was saved
    "does not require grad and does not have a grad_fn",  # a loss that no parameter's gradient reaches
)

#: Ops whose failure on fake tensors means "a value was read on the host".
_READS_A_VALUE = {"aten._local_scalar_dense.default", "aten.is_nonzero.default", "aten.item.default"}


_PACKAGES = tuple(os.path.join(os.path.realpath(os.path.dirname(m.__file__)), "") for m in (torch, orchestrator, trainables))
_STDLIB = os.path.join(os.path.realpath(sysconfig.get_paths()["stdlib"]), "")
_INSTALLED = {"site-packages", "dist-packages"}


def is_model_code(filename: str) -> bool:
    """Whether a frame's file is the user's model code (theirs or a model library's)."""
    if filename.startswith("<"):  # <frozen ...>, <string>
        return False
    path = os.path.realpath(filename)
    if path.startswith(_PACKAGES):
        return False
    return bool(_INSTALLED & set(path.split(os.sep))) or not path.startswith(_STDLIB)


def _show(frame: traceback.FrameSummary) -> str:
    path = os.path.realpath(frame.filename)
    for marker in ("site-packages" + os.sep, "dist-packages" + os.sep):
        if marker in path:
            path = path.split(marker, 1)[1]
            break
    else:
        cwd = os.path.join(os.getcwd(), "")
        if path.startswith(cwd):
            path = path[len(cwd):]
    return f"{path}:{frame.lineno} ({frame.name})"


def _innermost_traceback(exc: BaseException) -> TracebackType | None:
    """The traceback of the exception that started it all (``raise ... from`` chains back)."""
    while exc.__cause__ is not None and exc.__cause__.__traceback__ is not None:
        exc = exc.__cause__
    return exc.__traceback__


def failed_op(exc: BaseException) -> str | None:
    """The aten op that was running when ``exc`` was raised, if it was raised inside one."""
    seen: BaseException | None = exc
    while seen is not None:
        func = getattr(seen, "func", None)
        if isinstance(func, OpOverload):
            return str(func)
        seen = seen.__cause__
    tb, op = _innermost_traceback(exc), None
    while tb is not None:
        func = tb.tb_frame.f_locals.get("func")
        if isinstance(func, OpOverload):
            op = str(func)  # the innermost wins
        tb = tb.tb_next
    return op


def fails_on_any_tensors(exc: BaseException) -> bool:
    """Whether an estimate's error is the model's own, which every trial would raise too: it is
    told before the sweep starts, as a shape mismatch in the forward is, and not planned around
    (the ``trace`` estimator's fallback to ``static``, which runs no backward; ``static``'s to real
    CPU tensors) to fail each trial after Ray started. Besides what autograd refuses: eval metrics
    other than the declared ones, and a loss or an eval metric that is not one number
    (``trainables.workload.one_number``, ``metric_sums``): their names, types and shapes, no value read."""
    if isinstance(exc, (MetricsMismatch, LossTypeError, MetricTypeError)):
        return True
    return isinstance(exc, RuntimeError) and any(message in str(exc) for message in AUTOGRAD_MODEL_ERRORS)


def makes_nested_tensors(exc: BaseException) -> bool:
    """Whether ``exc`` was raised making a nested tensor (what torch's fused transformer path does
    with a padding mask), which fake tensors cannot hold."""
    op = failed_op(exc)
    return op is not None and op.startswith("aten._nested_")


def model_frames(exc: BaseException) -> list[traceback.FrameSummary]:
    """The frames of the model's code on the way to ``exc``, outermost first."""
    tb = _innermost_traceback(exc)
    return [f for f in traceback.extract_tb(tb) if is_model_code(f.filename)]


def where(exc: BaseException) -> str:
    """``op in file:line (function), called from file:line (function)``; empty when neither is known.

    The first frame is the model code that called the failing op, the second the workload's
    method that the estimator called (where they differ).
    """
    op, frames = failed_op(exc), model_frames(exc)
    parts = []
    if op:
        parts.append(op + (" (a tensor's value read on the host: .item(), .tolist(), if tensor)" if op in _READS_A_VALUE else ""))
    if frames:
        parts.append(f"in {_show(frames[-1])}" + (f", called from {_show(frames[0])}" if len(frames) > 1 else ""))
    return " ".join(parts)


def summary(exc: BaseException) -> str:
    """One line for a plan: the error's type and first line, and where it happened."""
    text = str(exc).splitlines()[0] if str(exc) else ""
    place = where(exc)
    return f"{type(exc).__name__}: {text}" + (f" ({place})" if place else "")
